"""A fork server for the Python process Spark starts afresh for each streaming query's source.

Spark runs a streaming query's Python source in a new process
(``python -m pyspark.sql.streaming.python_streaming_source_runner``), which imports pyspark.sql,
pyarrow and numpy before it answers the query's first call: 0.25-0.3 CPU-seconds of every query's
start. The server (started by ``polybroker.spark.session.local_session``, a child of the driver)
imports them once; the session's launcher (``session.launcher_script``) hands such a launch to it
through its client (``forkclient.py``), and the server forks a child that runs the module.

``python -m polybroker.spark.forkserver serve SOCKET FD MODULES PRELOAD`` is the server
(``start`` starts one); ``forkclient.py`` is the client, one AF_UNIX stream connection per
launch (its docstring has the protocol).

Rule 1: the child is what ``PYTHON -m module args`` would be, started with the request's
environment, working directory and standard streams: same interpreter, same ``sys.path`` (the
request's ``PYTHONPATH``, then the interpreter's own entries), ``os.environ`` the request's. A
request the server cannot serve so is refused: another interpreter or module, a different value
of a variable the interpreter or the preloaded modules read when they start (anything but the
per-process ones Spark sets, ``_PER_PROCESS``), or a ``PYTHONPATH`` entry that would give one of
the preloaded packages from elsewhere.
Rule 2: a refused request, or a server that cannot be reached, makes the client exec the
interpreter itself: the launch then is the plain one.
Rule 3: the client ends as the child did (its exit code, or killed by the same signal); signals
the client gets (TERM, INT, HUP, QUIT, USR1, USR2) go to the child; a client that dies (its
connection closes) before the child ends takes the child with it (SIGKILL).
Rule 4: the server ends when its parent's pipe closes (the parent exited, or ``ForkServer.stop``),
killing the children still running; on Linux a child also dies with a server killed outright.

Forking a process with threads is safe only for threads made for it: the server's are numpy's
BLAS pool and pyarrow's jemalloc background thread, both of which handle fork (pthread_atfork);
it runs no Python thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys
from typing import Any

from polybroker.spark.forkclient import ENV

__all__ = ["ENV", "MODULES", "PRELOAD", "ForkServer", "start"]

#: The modules whose launches the server takes (and preloads).
MODULES = ("pyspark.sql.streaming.python_streaming_source_runner",)
#: Further modules the server preloads: the source the runner unpickles.
PRELOAD = ("polybroker.spark.source",)
#: Variables that may differ between the server and a request: set by Spark for each Python
#: process it starts and read at run time, or set by the shell on the way.
_PER_PROCESS = frozenset(
    {
        ENV,
        "PYTHONPATH",
        "PYTHON_WORKER_FACTORY_PORT",
        "PYTHON_WORKER_FACTORY_SECRET",
        "PYTHON_UNIX_DOMAIN_SOCKET",
        "PYTHON_FAULTHANDLER_DIR",
        "PYSPARK_PYTHON",
        "PYSPARK_DRIVER_PYTHON",
        "_PYSPARK_DRIVER_CONN_INFO_PATH",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    }
)
_PER_PROCESS_PREFIXES = ("SPARK_",)
_LENGTH = struct.Struct(">I")
_MAX_REQUEST = 1 << 20


def _per_process(name: str) -> bool:
    return name in _PER_PROCESS or name.startswith(_PER_PROCESS_PREFIXES)


# --- driver side ---------------------------------------------------------------------------


class ForkServer:
    """A running server (a child of this process) and the socket it serves on."""

    def __init__(self, proc: Any, path: str, parent_w: int) -> None:
        self.proc = proc
        self.path = path
        self._parent_w = parent_w

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def stop(self, timeout: float = 10.0) -> None:
        """End the server (rule 4: with any child still running) and remove its socket; at
        once if it has ended already. Idempotent."""
        import shutil
        import subprocess

        if self._parent_w >= 0:
            os.close(self._parent_w)
            self._parent_w = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def start(
    modules: tuple[str, ...] = MODULES,
    preload: tuple[str, ...] = PRELOAD,
    env: dict[str, str] | None = None,
) -> ForkServer:
    """Start a server of ``modules`` (preloading them and ``preload``) on a new socket in a
    private directory, with ``env`` (default: this process's) as its environment. It serves
    once its imports are done (a launch before falls back to a plain one, rule 2) and lives
    until ``stop`` or this process's exit (rule 4)."""
    import subprocess
    import tempfile

    where = tempfile.mkdtemp(prefix="polybroker-spark-")
    path = os.path.join(where, "fork.sock")
    parent_r, parent_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polybroker.spark.forkserver",
                "serve",
                path,
                str(parent_r),
                ",".join(modules),
                ",".join(preload),
            ],
            pass_fds=(parent_r,),
            stdin=subprocess.DEVNULL,
            env=dict(os.environ if env is None else env),
        )
    except BaseException:
        os.close(parent_w)
        raise
    finally:
        os.close(parent_r)
    return ForkServer(proc, path, parent_w)


# --- server --------------------------------------------------------------------------------


class Job:
    """What a forked child runs: ``module`` as ``__main__`` with ``argv``."""

    def __init__(self, module: str, argv: list[str]) -> None:
        self.module = module
        self.argv = argv


def _path_entries(pythonpath: str | None) -> list[str]:
    return [p for p in (pythonpath or "").split(os.pathsep) if p]


def _dedup_abs(entries: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for e in entries:
        a = os.path.abspath(e) if e else os.getcwd()
        if a not in seen:
            seen.add(a)
            out.append(a)
    return out


class _Server:
    """The checks of rule 1: ``modules`` are the ones served, ``base_path`` is the interpreter's
    own path (after a request's ``PYTHONPATH``), ``seen`` every entry the preloaded modules could
    come from."""

    def __init__(self, modules: tuple[str, ...], base_path: list[str], seen: list[str]) -> None:
        self.modules = modules
        self.base_path = base_path
        self.seen = set(seen)
        self.env = dict(os.environ)
        self.python = os.path.realpath(sys.executable)
        self.preloaded = sorted(
            {
                name.partition(".")[0]
                for name in list(sys.modules)
                if name.partition(".")[0] not in sys.stdlib_module_names
                and not name.startswith("_")
            }
        )

    def refusal(self, request: dict[str, Any]) -> str | None:
        """Why the request cannot be served as rule 1 says, or None."""
        from importlib.machinery import PathFinder

        if os.path.realpath(str(request.get("python"))) != self.python:
            return "another interpreter"
        argv = request.get("argv")
        if not (isinstance(argv, list) and argv[:1] == ["-m"] and len(argv) >= 2):
            return "not a -m launch"
        if argv[1] not in self.modules:
            return f"module {argv[1]} is not preloaded"
        env = request.get("env")
        if not isinstance(env, dict) or not isinstance(request.get("cwd"), str):
            return "malformed request"
        for name in sorted(set(env) | set(self.env)):
            if not _per_process(name) and env.get(name) != self.env.get(name):
                return f"environment variable {name} differs"
        extra = [p for p in self.child_path(request) if p not in self.seen]
        for name in self.preloaded:
            for entry in extra:
                if PathFinder.find_spec(name, [entry]) is not None:
                    return f"{entry} holds {name}"
        return None

    def child_path(self, request: dict[str, Any]) -> list[str]:
        cwd = request["cwd"]
        entries = [cwd, *_path_entries(request["env"].get("PYTHONPATH")), *self.base_path]
        return _dedup_abs([os.path.normpath(os.path.join(cwd, e)) for e in entries])


def _decode_request(body: bytes) -> dict[str, Any]:
    """The fields of a request's bytes (``forkclient.encode_request``)."""
    fields = [os.fsdecode(f) for f in body.split(b"\0")]
    python, cwd, argc = fields[:3]
    n = int(argc)
    if n < 0 or len(fields) < 3 + n:
        raise ValueError("malformed request")
    env = {}
    for entry in fields[3 + n :]:
        name, sep, value = entry.partition("=")
        if not sep:
            raise ValueError("malformed request")
        env[name] = value
    return {"python": python, "cwd": cwd, "argv": fields[3 : 3 + n], "env": env}


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
    try:
        while len(data) < _LENGTH.size:
            chunk = conn.recv(_LENGTH.size - len(data))
            if not chunk:
                raise ValueError("short request")
            data += chunk
        (length,) = _LENGTH.unpack(data)
        if length > _MAX_REQUEST:
            raise ValueError("request too large")
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                raise ValueError("short request")
            body += chunk
        request = _decode_request(body)
        if len(fds) != 3:
            raise ValueError("malformed request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _send(conn: socket.socket, kind: str, value: object) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"{kind} {value}\n".encode("ascii", "replace"))


def _die_with_server(server: int) -> None:
    """Rule 4 for a server killed outright: on Linux, the kernel kills the child with it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != server:  # it died before the request took
        os._exit(1)


def _enter_child(request: dict[str, Any], fds: list[int], path: list[str]) -> Job:
    """In the forked child: take the request's streams, directory, environment and path."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = path
    argv = request["argv"]
    return Job(argv[1], [argv[1], *argv[2:]])


def serve(path: str, parent_fd: int, modules: tuple[str, ...]) -> Job | None:
    """Serve launches of ``modules`` on the AF_UNIX socket ``path`` until ``parent_fd`` reads
    end of file; None in the server when it ends, the child's Job in a forked child."""
    import selectors

    own = set(_dedup_abs(_path_entries(os.environ.get("PYTHONPATH"))))
    server = _Server(
        modules, [p for p in _dedup_abs(sys.path[1:]) if p not in own], _dedup_abs(sys.path)
    )
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(parent_fd, selectors.EVENT_READ, "parent")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket | None] = {}
    by_conn: dict[socket.socket, int] = {}
    uid = os.getuid()
    me = os.getpid()
    job: Job | None = None
    try:
        while job is None:
            for key, _ in sel.select():
                what = key.data
                if what == "parent":
                    return None
                if what == "wake":
                    os.read(wake_r, 4096)
                    _reap(children, by_conn, sel)
                elif what == "accept":
                    conn, _ = listener.accept()
                    creds = conn.getsockopt(
                        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                    )
                    if struct.unpack("3i", creds)[1] != uid:
                        conn.close()
                        continue
                    try:
                        request, fds = _read_request(conn)
                    except (OSError, ValueError):
                        conn.close()
                        continue
                    why = server.refusal(request)
                    if why is not None:
                        with contextlib.suppress(OSError, ValueError):  # a closed stderr
                            print(f"fork server: a plain launch instead: {why}", file=sys.stderr)
                        for fd in fds:
                            os.close(fd)
                        _send(conn, "refused", why)
                        conn.close()
                        continue
                    child_path = server.child_path(request)
                    for stream in (sys.stdout, sys.stderr):
                        with contextlib.suppress(OSError, ValueError):
                            stream.flush()
                    pid = os.fork()
                    if pid == 0:
                        # The child leaves the server's loop with only its job.
                        sel.close()
                        listener.close()
                        for c in by_conn:
                            c.close()
                        conn.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        os.close(parent_fd)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        _die_with_server(me)
                        job = _enter_child(request, fds, child_path)
                        break
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    by_conn[conn] = pid
                    sel.register(conn, selectors.EVENT_READ, "conn")
                    _send(conn, "pid", pid)
                else:  # a client's connection: it only ever closes (rule 3)
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    try:
                        gone = not conn.recv(4096)
                    except OSError:
                        gone = True
                    if gone:
                        sel.unregister(conn)
                        pid = by_conn.pop(conn)
                        children[pid] = None
                        conn.close()
                        _kill(pid)
        return job
    finally:
        if os.getpid() == me:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))  # start()'s private directory
            for pid in children:
                _kill(pid)
            for pid in list(children):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _reap(
    children: dict[int, socket.socket | None], by_conn: dict[socket.socket, int], sel: Any
) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        by_conn.pop(conn, None)
        sel.unregister(conn)
        if os.WIFSIGNALED(status):
            _send(conn, "signal", os.WTERMSIG(status))
        else:
            _send(conn, "exit", os.waitstatus_to_exitcode(status))
        conn.close()


def run(job: Job) -> None:
    """Run a child's job as ``python -m`` would (the caller then exits as the interpreter)."""
    import runpy

    sys.argv[:] = job.argv
    # As in a fresh ``python -m``: the module runs as __main__ only, not also under its name.
    sys.modules.pop(job.module, None)
    runpy.run_module(job.module, run_name="__main__", alter_sys=True)


def server_main(
    path: str, parent_fd: int, modules: tuple[str, ...], preload: tuple[str, ...]
) -> None:
    """Preload ``modules`` and ``preload``, serve launches of ``modules``, and in a forked child
    run its job."""
    import importlib

    # As Spark's JVM does for its Python processes: Ctrl-C goes to the driver, not to them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("ctypes", *modules, *preload):
        importlib.import_module(name)
    job = serve(path, parent_fd, modules)
    if job is not None:
        run(job)


if __name__ == "__main__":
    # serve SOCKET FD MODULE,... PRELOAD,...
    server_main(
        sys.argv[2],
        int(sys.argv[3]),
        tuple(m for m in sys.argv[4].split(",") if m),
        tuple(m for m in sys.argv[5].split(",") if m),
    )
