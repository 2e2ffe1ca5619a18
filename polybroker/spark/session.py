"""A SparkSession for the example pipelines: workers run this interpreter.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` (and py4j's zip) first on the path of every
Python process it starts, and Python compiles a zip's modules afresh at every start: it keeps no
bytecode cache for them. With pip's pyspark, ``SPARK_HOME`` is the installed package itself and
the zip holds the same sources, so a process that imports the installed package instead runs the
same code from its compiled cache. That matters for the processes Spark starts fresh rather than
forks from its daemon: each streaming query's source (and sink) runner, where compiling pyspark
costs about 0.65 CPU-seconds of the query's start-up. ``worker_python`` makes such a launcher.

Even compiled, a source runner imports pyspark.sql, pyarrow and numpy before the query's first
call. ``local_session`` also starts a fork server (``polybroker.spark.forkserver``) that has them
imported: the launcher hands a source runner's launch to it, and the runner is a fork of it that
starts in milliseconds (or, when the server cannot serve the launch as a fresh process would
run, a plain process as before).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from polybroker.spark import forkclient, forkserver


def _bundled_zips() -> list[str]:
    """The zips on Spark's worker path whose code is the installed pyspark's (and py4j's, when
    the installed py4j is the zip's version), as Spark spells their paths."""
    try:
        import pyspark
    except ImportError:
        return []
    home = Path(pyspark.__file__).parent
    homes = {str(home)}
    spark_home = os.environ.get("SPARK_HOME")
    if spark_home and os.path.realpath(spark_home) == os.path.realpath(home):
        homes.add(spark_home)
    names = ["pyspark.zip"]
    try:
        from py4j.version import __version__ as py4j_version

        names.append(f"py4j-{py4j_version}-src.zip")
    except ImportError:
        pass
    zips = []
    for h in sorted(homes):
        for name in names:
            path = os.path.join(h, "python", "lib", name)
            if os.path.isfile(path):
                zips.append(path)
    return zips


def launcher_script(python: str, zips: list[str], client: str | None = None) -> str:
    """A POSIX sh script that runs ``python`` with its arguments after dropping the entries equal
    to one of ``zips`` from ``PYTHONPATH`` (the others stay, in order). With ``client`` (the
    path of ``polybroker/spark/forkserver.py``), a launch of a module the fork server takes goes
    through that client when ``$POLYBROKER_SPARK_FORKSERVER`` names a server."""
    drops = " ".join(shlex.quote(z) for z in zips)
    py = shlex.quote(python)
    handoff = ""
    if client is not None:
        modules = "|".join(shlex.quote(m) for m in forkserver.MODULES)
        handoff = (
            f'if [ -n "${forkserver.ENV}" ] && [ "$1" = -m ]; then\n'
            '  case "$2" in\n'
            f'    {modules}) exec {py} -I -S {shlex.quote(client)} {py} "$@" ;;\n'
            "  esac\n"
            "fi\n"
        )
    return (
        "#!/bin/sh\n"
        "# Spark's Python processes import the installed pyspark rather than the same code from\n"
        "# its zip, compiled at every start (polybroker.spark.session).\n"
        "set -f\n"
        "kept=\n"
        "IFS=:\n"
        "for entry in $PYTHONPATH; do\n"
        "  drop=\n"
        f"  for z in {drops}; do\n"
        '    if [ "$entry" = "$z" ]; then drop=1; fi\n'
        "  done\n"
        '  if [ -z "$drop" ]; then kept="${kept:+$kept:}$entry"; fi\n'
        "done\n"
        "unset IFS\n"
        'PYTHONPATH="$kept"\n'
        "export PYTHONPATH\n"
        f"{handoff}"
        f'exec {py} "$@"\n'
    )


def worker_python(python: str = sys.executable, cache: Path | None = None) -> str:
    """An executable for ``PYSPARK_PYTHON``: ``python`` itself when Spark's path holds no zip of
    the installed pyspark (or off POSIX), else a launcher script (``launcher_script``) kept in
    the user's cache, named by its content."""
    zips = _bundled_zips()
    if not zips or os.name != "posix":
        return python
    client = forkclient.__file__ if os.path.isfile(forkclient.__file__) else None
    text = launcher_script(python, zips, client)
    base = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = base / "polybroker" / f"spark-python-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    try:
        if not (where.is_file() and where.read_text() == text and os.access(where, os.X_OK)):
            where.parent.mkdir(parents=True, exist_ok=True)
            fresh = where.with_name(f"{where.name}.{os.getpid()}")
            fresh.write_text(text)
            fresh.chmod(0o755)
            os.replace(fresh, where)
    except OSError:
        return python
    return str(where)


_server: forkserver.ForkServer | None = None
_stop_registered = False


def start_fork_server() -> forkserver.ForkServer | None:
    """Start this driver's fork server (``polybroker.spark.forkserver``) unless it runs, and
    name it in the environment, which a SparkSession started afterwards hands its Python
    processes (through ``worker_python``'s launcher they use it). Its environment is the
    driver's with what Spark sets for its Python processes (``PYTHONHASHSEED``, by default 0,
    and ``PYTHONUNBUFFERED``). None off POSIX. Stopped by ``stop_fork_server`` or at exit."""
    global _server, _stop_registered
    if _server is not None and _server.proc.poll() is None:
        return _server
    if os.name != "posix" or not hasattr(socket, "send_fds"):
        return None
    env = {
        **os.environ,
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"),
        "PYTHONUNBUFFERED": "YES",
    }
    env.pop(forkserver.ENV, None)
    _server = forkserver.start(env=env)
    os.environ[forkserver.ENV] = _server.path
    if not _stop_registered:
        atexit.register(stop_fork_server)
        _stop_registered = True
    return _server


def stop_fork_server() -> None:
    """Stop the fork server ``start_fork_server`` started (with any source runner it still
    runs: call it after the session's stop) and take its name out of the environment."""
    global _server
    if _server is None:
        return
    server, _server = _server, None
    if os.environ.get(forkserver.ENV) == server.path:
        del os.environ[forkserver.ENV]
    server.stop()


def local_session(app: str, master: str = "local[2]") -> Any:
    """Get or create a session; ``PYSPARK_PYTHON`` defaults to the driver's interpreter (through
    ``worker_python``'s launcher when it applies). A session this call creates with that
    launcher gets the fork server of ``start_fork_server`` for its streaming sources.

    The data source's reader and writer run in Spark's Python workers, which must import
    ``polybroker`` and ``pyarrow``: the driver's interpreter has both.
    """
    launcher = worker_python()
    os.environ.setdefault("PYSPARK_PYTHON", launcher)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if (
        os.environ["PYSPARK_PYTHON"] == launcher != sys.executable
        and SparkContext._active_spark_context is None
    ):
        start_fork_server()

    return (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
