"""Make the echo plugin importable and discoverable without pip or a network.

``importlib.metadata`` finds distributions through ``*.dist-info`` directories on
``sys.path``; ``install_into(target)`` writes one for this plugin (its entry points read from
``pyproject.toml``, so that file stays the single source) and returns the directories to put
on ``sys.path`` (in-process) or ``PYTHONPATH`` (a subprocess). This is what ``pip install``
would leave behind, minus the copy, so it works the same on a fresh CI machine.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

PLUGIN_ROOT = Path(__file__).resolve().parent


def install_into(target: Path) -> list[Path]:
    """Write the plugin's ``.dist-info`` under ``target``; return the paths to import from."""
    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    dist = target / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{k} = {v}" for k, v in entries.items())
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [target, PLUGIN_ROOT]
