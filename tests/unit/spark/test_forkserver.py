"""The fork server's rule 1: which launches it serves, and the path its children get."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from polybroker.spark import forkclient, forkserver


def _server(base: list[str]) -> forkserver._Server:
    return forkserver._Server(("probe.mod",), base, [*sys.path, *base])


def _request(**changes: object) -> dict:
    request: dict = {
        "python": sys.executable,
        "argv": ["-m", "probe.mod", "x"],
        "env": dict(os.environ),
        "cwd": "/w",
    }
    request.update(changes)
    return request


def test_a_launch_as_the_server_would_run_it_is_served() -> None:
    """Same interpreter and module, the environment equal but for per-process variables."""
    server = _server([])
    assert server.refusal(_request()) is None
    per_process = {
        **os.environ,
        "PYTHONPATH": "",
        "PYTHON_WORKER_FACTORY_PORT": "1",
        "SPARK_BUFFER_SIZE": "1",
        forkserver.ENV: "/elsewhere",
    }
    assert server.refusal(_request(env=per_process)) is None


def test_other_interpreters_modules_and_environments_are_refused() -> None:
    """Each difference a fresh process would see is a refusal, with its reason."""
    server = _server([])
    assert server.refusal(_request(python="/bin/sh")) == "another interpreter"
    assert server.refusal(_request(argv=["-c", "pass"])) == "not a -m launch"
    assert server.refusal(_request(argv=["-m", "other"])) == "module other is not preloaded"
    assert server.refusal(_request(env={**os.environ, "PROBE_NEW": "1"})) == (
        "environment variable PROBE_NEW differs"
    )
    hashed = {**os.environ, "PYTHONHASHSEED": "12345"}
    assert server.refusal(_request(env=hashed)) == "environment variable PYTHONHASHSEED differs"
    assert server.refusal(_request(env=None)) == "malformed request"


def test_a_path_entry_that_would_give_a_preloaded_package_elsewhere_is_refused(
    tmp_path: Path,
) -> None:
    """A ``PYTHONPATH`` directory holding a package the server imported (pytest here) would
    give a fresh process another copy: refused; one holding none is served."""
    (tmp_path / "pytest").mkdir()
    (tmp_path / "pytest" / "__init__.py").write_text("")
    (tmp_path / "free").mkdir()
    server = _server([])
    shadow = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert server.refusal(_request(env=shadow)) == f"{tmp_path} holds pytest"
    free = {**os.environ, "PYTHONPATH": str(tmp_path / "free")}
    assert server.refusal(_request(env=free)) is None


def test_a_child_path_is_the_directory_the_request_path_then_the_interpreter_own() -> None:
    """As ``python -m``: the working directory first, relative entries resolved against it,
    duplicates dropped."""
    server = _server(["/lib/a", "/lib/b"])
    env = {"PYTHONPATH": "/p:rel::/lib/b"}
    assert server.child_path(_request(env=env)) == ["/w", "/p", "/w/rel", "/lib/b", "/lib/a"]


def test_a_request_reads_back_as_the_client_wrote_it() -> None:
    """Arguments with spaces or none, values holding ``=`` and newlines, and bytes that are not
    UTF-8 (as the file system encoding gives them) come through unchanged."""
    odd = b"\xff".decode(sys.getfilesystemencoding(), "surrogateescape")
    args = ["-m", "probe.mod", "a b", "", odd]
    env = {"A": "x=y", "B": "line\nnext", "C": "", odd: odd}
    data = forkclient.encode_request("/py", "/w d", args, env)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    assert forkserver._decode_request(data[4:]) == {
        "python": "/py",
        "cwd": "/w d",
        "argv": args,
        "env": env,
    }
    empty = forkclient.encode_request("/py", "/", [], {})[4:]
    assert forkserver._decode_request(empty) == {"python": "/py", "cwd": "/", "argv": [], "env": {}}
