"""The launcher ``local_session`` gives Spark's Python processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polybroker.spark import session


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
