"""The fork server's client: ``python -I -S forkclient.py PYTHON ARGS...`` (see ``forkserver``).

It runs for every launch the session's launcher hands over, before the launch itself, so it
imports nothing but built-in modules (``_socket`` and ``_signal`` rather than their enum-laden
wrappers) and nothing from its package: run by path, it is a script, not a module.

Request: a 4-byte big-endian length, then NUL-separated fields ``python``, ``cwd``, the number
of arguments, the arguments, then ``name=value`` for each environment variable (file system
encoding); the first bytes carry the client's stdin, stdout and stderr (SCM_RIGHTS). Replies,
ASCII lines: ``pid N`` (the child runs) or ``refused WHY``, then ``exit N`` or ``signal N``.
"""

from __future__ import annotations

import _signal
import _socket
import os
import sys
from array import array

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import NoReturn

ENV = "POLYBROKER_SPARK_FORKSERVER"
_FORWARDED = (
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGQUIT,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
)


def encode_request(python: str, cwd: str, args: list[str], env: dict[str, str]) -> bytes:
    """A request's bytes, its length first."""
    fields = [python, cwd, str(len(args)), *args, *(f"{k}={v}" for k, v in env.items())]
    body = b"\0".join(os.fsencode(f) for f in fields)
    return len(body).to_bytes(4, "big") + body


def _plain(python: str, args: list[str]) -> NoReturn:
    """Rule 2: become the interpreter."""
    os.execv(python, [python, *args])


def _replies(conn: _socket.socket) -> Iterator[tuple[str, str]]:
    buffered = b""
    while True:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            kind, _, value = line.decode("ascii", "replace").partition(" ")
            yield kind, value
        chunk = conn.recv(4096)
        if not chunk:
            return
        buffered += chunk


def client(python: str, args: list[str]) -> int:
    """Launch ``python args`` through the server named by ``$POLYBROKER_SPARK_FORKSERVER``, or
    exec it (rule 2); return the child's exit code (rule 3: or die of its signal)."""
    path = os.environ.get(ENV)
    if not path:
        _plain(python, args)
    request = encode_request(python, os.getcwd(), args, dict(os.environ))
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.connect(path)
        fds = array("i", [0, 1, 2])
        conn.sendmsg([request[:4]], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds.tobytes())])
        conn.sendall(request[4:])
        replies = _replies(conn)
        kind, value = next(replies, ("", ""))
    except (OSError, ValueError):
        kind, value = "", ""
    if kind != "pid":
        conn.close()
        _plain(python, args)
    pid = int(value)

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105 (contextlib is one more import at every launch)
            os.kill(pid, signum)
        except OSError:
            pass

    for s in _FORWARDED:
        _signal.signal(s, forward)
    for kind, value in replies:
        if kind == "signal":
            signum = int(value)
            _signal.signal(signum, _signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return 128 + signum
        if kind == "exit":
            return int(value)
    return 1  # the server went away before the child ended (and killed it, rule 4)


if __name__ == "__main__":
    sys.exit(client(sys.argv[1], sys.argv[2:]))
