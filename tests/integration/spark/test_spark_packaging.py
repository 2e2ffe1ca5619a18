"""pyspark finds ``format("pulsar")`` by itself, from a built wheel and from an editable install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

# What pyspark's data source lookup does in its worker: scan top-level pyspark_* modules.
_LOOKUP = """
import pkgutil, sys
from importlib import import_module
from pyspark.sql.datasource import DataSource
found = {}
for info in pkgutil.iter_modules():
    if info.name.startswith("pyspark_"):
        mod = import_module(info.name)
        cls = getattr(mod, "DefaultSource", None)
        if isinstance(cls, type) and issubclass(cls, DataSource):
            found[cls.name()] = mod.__file__
import polybroker
print(found.get("pulsar"), polybroker.__file__)
"""


def _lookup(env_path: str | None, cwd: Path) -> list[str]:
    """Run the scan in a fresh interpreter outside the work tree (so not via the cwd)."""
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = env_path
    out = subprocess.run(
        [sys.executable, "-c", _LOOKUP],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_lookup_finds_the_source_in_the_editable_install(tmp_path: Path) -> None:
    """With the project installed editable, the scan finds pyspark_pulsar in the work tree."""
    module, package = _lookup(None, tmp_path)
    assert Path(module).parent == ROOT
    assert Path(package).parent.parent == ROOT


def test_a_built_wheel_ships_the_module_and_the_scan_finds_it(tmp_path: Path) -> None:
    """The wheel holds pyspark_pulsar.py and polybroker.spark; installed, the scan finds it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "pyspark_pulsar.py"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "polybroker", src / "polybroker", ignore=shutil.ignore_patterns("__pycache__")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("polybroker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pyspark_pulsar.py" in names
    assert "polybroker/spark/source.py" in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    module, package = _lookup(str(target), tmp_path)
    assert Path(module) == target / "pyspark_pulsar.py"
    assert Path(package) == target / "polybroker" / "__init__.py"
