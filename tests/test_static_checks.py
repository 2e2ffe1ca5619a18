"""The code base stays lint-clean and keeps the layer boundaries of the design."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_is_clean() -> None:
    """ruff finds nothing in the package, the tests or the benchmarks."""
    result = _run(sys.executable, "-m", "ruff", "check", "polybroker", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold() -> None:
    """import-linter's contracts (layers, codecs without Twisted, protocols independent) hold."""
    lint_imports = shutil.which("lint-imports")
    assert lint_imports, "import-linter is a test dependency: pip install -e '.[test]'"
    result = _run(lint_imports)
    assert result.returncode == 0, result.stdout + result.stderr
