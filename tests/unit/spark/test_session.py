"""The launcher ``local_session`` gives Spark's Python processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polybroker.spark import forkserver, session


def _run(script: Path, pythonpath: str) -> list[str]:
    code = "import os, sys; print(os.environ['PYTHONPATH']); print(sys.argv[1:])"
    out = subprocess.run(
        [str(script), "-c", code, "a b", "*"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.splitlines()


def test_launcher_drops_only_the_named_zips_and_passes_arguments(tmp_path: Path) -> None:
    """Exact entries go, every other (spaces, globs, empty) stays in order; arguments pass as
    they are, and the interpreter is the one named."""
    script = tmp_path / "python"
    zips = [str(tmp_path / "lib" / "pyspark.zip"), str(tmp_path / "lib" / "py4j-1-src.zip")]
    script.write_text(session.launcher_script(sys.executable, zips))
    script.chmod(0o755)
    path = f"/a:{zips[0]}:/b c::{zips[1]}:/x*:{zips[0]}.old"
    assert _run(script, path) == [f"/a:/b c::/x*:{zips[0]}.old", "['a b', '*']"]


def test_worker_python_is_the_interpreter_unless_the_installed_pyspark_ships_its_zip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With zips to drop, a content-named launcher in the cache, made once and reused."""
    monkeypatch.setattr(session, "_bundled_zips", lambda: [])
    assert session.worker_python("/usr/bin/python3", tmp_path) == "/usr/bin/python3"
    monkeypatch.setattr(session, "_bundled_zips", lambda: ["/s/python/lib/pyspark.zip"])
    first = session.worker_python(sys.executable, tmp_path)
    assert Path(first).parent == tmp_path / "polybroker"
    assert os.access(first, os.X_OK)
    assert session.worker_python(sys.executable, tmp_path) == first
    assert _run(Path(first), "/s/python/lib/pyspark.zip:/k") == ["/k", "['a b', '*']"]


def test_the_installed_pyspark_zip_holds_the_installed_sources() -> None:
    """The zips dropped hold the code the workers import instead (spot check of the modules a
    streaming source runner starts with)."""
    import zipfile

    import pyspark

    home = Path(pyspark.__file__).parent
    zips = [z for z in session._bundled_zips() if z.endswith("pyspark.zip")]
    if not zips:
        assert not (home / "python" / "lib" / "pyspark.zip").is_file()
        return
    with zipfile.ZipFile(zips[0]) as z:
        for name in ("__init__.py", "sql/datasource.py", "worker_util.py", "serializers.py"):
            assert z.read(f"pyspark/{name}") == (home / name).read_bytes()


def test_launcher_hands_only_source_runner_launches_to_the_fork_server_client(
    tmp_path: Path,
) -> None:
    """With a server named in the environment, ``-m`` of a module the server takes goes to the
    client (as ``python -I -S client python args``, after the zip is dropped); anything else,
    or no server named, is the plain interpreter."""
    client = tmp_path / "client.py"
    client.write_text("import os, sys; print('client', sys.argv[1:], os.environ['PYTHONPATH'])\n")
    script = tmp_path / "python"
    zips = [str(tmp_path / "pyspark.zip")]
    script.write_text(session.launcher_script(sys.executable, zips, str(client)))
    script.chmod(0o755)
    runner = forkserver.MODULES[0]

    def run(env: dict[str, str], *args: str) -> str:
        out = subprocess.run(
            [str(script), *args],
            env={**os.environ, "PYTHONPATH": f"{zips[0]}:/k", **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip()

    named = {forkserver.ENV: str(tmp_path / "sock")}
    assert run(named, "-m", runner, "a b") == f"client {[sys.executable, '-m', runner, 'a b']} /k"
    assert run(named, "-c", "print('plain')") == "plain"
    assert run(named, "-m", "json.tool", "--help").startswith("usage")
    assert run({forkserver.ENV: ""}, "-c", "print('plain')") == "plain"
