"""The fork server of Spark's source runners (``polybroker.spark.forkserver``), as processes.

A probe module stands in for the runner: it reports what a process sees (argv, directory,
environment, path, standard streams, parent) and exits with a given code, or sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from spark_harness import wait_for

from polybroker.spark import forkclient, forkserver

PROBE = """
import json, os, sys, time

def main():
    if sys.argv[1:2] == ["libs"]:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute
        product = np.ones((300, 300)) @ np.ones((300, 300))
        total = pa.compute.sum(pa.array(range(200_000))).as_py()
        print(json.dumps({"ppid": os.getppid(), "product": float(product[0, 0]), "sum": total}))
        return
    if sys.argv[1:2] == ["sleep"]:
        print(os.getpid(), flush=True)
        time.sleep(120)
    print(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
        "x": os.environ.get("PROBE_X"), "path": sys.path[:3], "stdin": sys.stdin.read(),
        "name": __name__, "origin": __file__,
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))

if __name__ == "__main__":
    main()
"""


def _base_env() -> dict[str, str]:
    """This process's environment but pytest's per-phase variable (the server's and a request's
    environments must agree)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.pop(forkserver.ENV, None)
    return env


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    where = tmp_path / "mods"
    where.mkdir()
    (where / "fs_probe.py").write_text(PROBE)
    return where


@pytest.fixture
def server(probe_dir: Path) -> Iterator[forkserver.ForkServer]:
    """A server of the probe module, its environment this one's plus the probe's path."""
    env = {**_base_env(), "PYTHONPATH": str(probe_dir), "PROBE_X": "x1"}
    s = forkserver.start(modules=("fs_probe",), preload=(), env=env)
    try:
        wait_for(lambda: os.path.exists(s.path), 60, "the fork server's socket")
        yield s
    finally:
        s.stop()


def _env(server: forkserver.ForkServer, probe_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **_base_env(),
        "PYTHONPATH": f"{probe_dir}:rel",
        "PROBE_X": "x1",
        forkserver.ENV: server.path,
        **extra,
    }


def _client(*args: str) -> list[str]:
    return [sys.executable, "-I", "-S", forkclient.__file__, sys.executable, *args]


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, dict, str]:
    done = subprocess.run(
        cmd, input="in", capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )
    return done.returncode, json.loads(done.stdout), done.stderr


def test_a_served_launch_is_a_fork_that_runs_as_python_m_would(
    server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path
) -> None:
    """Same argv, directory, environment, path, streams and exit code as the plain launch; its
    parent is the server."""
    env = _env(server, probe_dir)
    code, served, err = _run(_client("-m", "fs_probe", "3", "a b"), env, tmp_path)
    plain_code, plain, plain_err = _run(
        [sys.executable, "-m", "fs_probe", "3", "a b"], env, tmp_path
    )
    assert served["ppid"] == server.pid
    assert plain["ppid"] == os.getpid()
    assert (code, err) == (plain_code, plain_err) == (3, "to stderr\n")
    for key in ("argv", "cwd", "x", "path", "stdin", "name", "origin"):
        assert served[key] == plain[key], key
    assert served["path"] == [str(tmp_path), str(probe_dir), str(tmp_path / "rel")]


def test_a_launch_the_server_cannot_serve_so_is_a_plain_one(
    server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path
) -> None:
    """A differing variable, a module the server does not take, a path entry that holds a
    preloaded module elsewhere, or no server at all: the client execs the interpreter."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "fs_probe.py").write_text(PROBE)
    cases = [
        (_env(server, probe_dir, PROBE_X="x2"), "fs_probe", str(probe_dir / "fs_probe.py")),
        (_env(server, probe_dir, PYTHONPATH=f"{other}:{probe_dir}"), "fs_probe", None),
        (_env(server, probe_dir, **{forkserver.ENV: str(tmp_path / "none")}), "fs_probe", None),
    ]
    for env, module, origin in cases:
        code, got, _ = _run(_client("-m", module, "0"), env, tmp_path)
        assert code == 0
        assert got["ppid"] == os.getpid()
        assert got["x"] == env["PROBE_X"]
        if origin is not None:
            assert got["origin"] == origin
    # The shadowing entry's module is the one a plain launch imports.
    _, got, _ = _run(_client("-m", "fs_probe", "0"), cases[1][0], tmp_path)
    assert got["origin"] == str(other / "fs_probe.py")
    done = subprocess.run(
        _client("-c", "import os; print(os.getppid())"),
        capture_output=True,
        text=True,
        env=_env(server, probe_dir),
        timeout=60,
    )
    assert done.stdout.strip() == str(os.getpid())


def _sleeping(server: forkserver.ForkServer, probe_dir: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        _client("-m", "fs_probe", "sleep"),
        stdout=subprocess.PIPE,
        text=True,
        env=_env(server, probe_dir),
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.stdout.close()
    assert child != proc.pid
    return proc, child


def test_signals_reach_the_child_and_a_dead_client_takes_it_along(
    server: forkserver.ForkServer, probe_dir: Path
) -> None:
    """SIGTERM to the client ends the child, and the client with the same signal; a client
    killed outright (its connection closed) gets its child killed."""
    proc, child = _sleeping(server, probe_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    wait_for(lambda: not _alive(child), 30, "the child's end")
    proc, child = _sleeping(server, probe_dir)
    proc.kill()
    proc.wait(30)
    wait_for(lambda: not _alive(child), 30, "the child's end")


def test_stop_ends_the_server_its_children_and_its_socket(
    server: forkserver.ForkServer, probe_dir: Path
) -> None:
    """No process is left behind and the socket's directory is gone."""
    proc, child = _sleeping(server, probe_dir)
    server.stop()
    assert server.proc.returncode == 0
    assert proc.wait(30) == 1
    assert not _alive(child)
    assert not os.path.exists(os.path.dirname(server.path))


def test_children_of_a_server_with_numpy_and_pyarrow_imported_use_them(
    probe_dir: Path, tmp_path: Path
) -> None:
    """numpy's BLAS pool and pyarrow's allocator each run a thread in the server, made for
    fork (pthread_atfork): its children run BLAS and Arrow compute, one after another and side
    by side, to their end."""
    env = {**_base_env(), "PYTHONPATH": str(probe_dir), "PROBE_X": "x1"}
    s = forkserver.start(modules=("fs_probe",), preload=("numpy", "pyarrow.compute"), env=env)
    try:
        wait_for(lambda: os.path.exists(s.path), 60, "the fork server's socket")
        procs = [
            subprocess.Popen(
                _client("-m", "fs_probe", "libs"),
                stdout=subprocess.PIPE,
                text=True,
                env=_env(s, probe_dir),
                cwd=tmp_path,
            )
            for _ in range(4)
        ]
        for proc in procs:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0
            got = json.loads(out)
            assert got == {"ppid": s.pid, "product": 300.0, "sum": 199_999 * 100_000}
    finally:
        s.stop()


def test_a_server_killed_outright_takes_its_children_and_a_dead_driver_its_server(
    probe_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL to the server kills its running child (the client ends); SIGKILL to the
    process that started a server ends the server (its pipe closes)."""
    env = {**_base_env(), "PYTHONPATH": str(probe_dir), "PROBE_X": "x1"}
    s = forkserver.start(modules=("fs_probe",), preload=(), env=env)
    try:
        wait_for(lambda: os.path.exists(s.path), 60, "the fork server's socket")
        proc, child = _sleeping(s, probe_dir)
        s.proc.kill()
        wait_for(lambda: not _alive(child), 30, "the child's end")
        assert proc.wait(30) == 1
    finally:
        s.stop()
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from polybroker.spark import forkserver\n"
            "s = forkserver.start(modules=('json.tool',), preload=())\n"
            "print(s.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=_base_env(),
    )
    assert driver.stdout is not None
    server = int(driver.stdout.readline())
    driver.stdout.close()
    assert _alive(server)
    driver.kill()
    driver.wait(30)
    wait_for(lambda: not _alive(server), 30, "the server's end")
