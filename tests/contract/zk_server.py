"""A real ZooKeeper server (Debian's ``zookeeper`` package) for tests: one per test session.

``ZooKeeperServer.start(directory)`` writes a config with its own data dir, picks a free
loopback port, starts the server in its own process and waits (bounded) until it answers;
``stop()`` ends exactly that process, by its PID. A machine without the package makes
``start`` raise ``ZooKeeperMissing`` with the command that installs it: tests that need
ZooKeeper fail, they are not skipped (CI installs the package, see ``.ci/run``).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ZK_CONF_DIR = Path("/etc/zookeeper/conf")
ZK_JARS = Path("/usr/share/java")
ZK_JAR_GLOB = "zookeeper*.jar"
SLF4J_BINDING = "slf4j-simple.jar"
# Short ticks so tests may ask for short sessions (ZooKeeper's floor is 2 ticks).
TICK_MS = 250


class ZooKeeperMissing(RuntimeError):
    """The ZooKeeper server is not installed here."""


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. ``restart`` binds the same port
    again after the server exited: a port-0 bind anywhere else (a client socket, another
    test's server) could take an ephemeral port in that gap, never one of these."""
    floor = _ephemeral_floor()
    for _ in range(500):
        port = random.randrange(max(1024, floor - 12000), floor)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _answers(port: int) -> bool:
    """Whether a server on ``port`` answers ZooKeeper's ``ruok`` ... or at least accepts."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"srvr")
            return s.recv(64).startswith(b"Zookeeper version")
    except OSError:
        return False


class ZooKeeperServer:
    """One ZooKeeper process on 127.0.0.1 (see the module docstring)."""

    def __init__(self, directory: Path, port: int, process: subprocess.Popen[bytes]) -> None:
        self.directory = directory
        self.port = port
        self.process = process

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, chroot: str = "") -> str:
        """A ``zk://`` metadata store URL for this server, under ``chroot`` if given."""
        return f"zk://{self.hosts}{chroot}"

    @classmethod
    def start(cls, directory: Path, *, port: int = 0, timeout: float = 60.0) -> ZooKeeperServer:
        """Start a server whose data lives in ``directory``; return once it answers."""
        if not ZK_CONF_DIR.is_dir() or not any(ZK_JARS.glob(ZK_JAR_GLOB)):
            raise ZooKeeperMissing(
                "ZooKeeper is not installed: run `apt-get install -y zookeeper` "
                "(CI does it in .ci/run)"
            )
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "data").mkdir(exist_ok=True)
        port = port or _free_port()
        conf = directory / "zoo.cfg"
        conf.write_text(
            "\n".join(
                [
                    f"tickTime={TICK_MS}",
                    f"dataDir={directory / 'data'}",
                    f"clientPort={port}",
                    "clientPortAddress=127.0.0.1",
                    "admin.enableServer=false",
                    "4lw.commands.whitelist=srvr,ruok",
                    "maxClientCnxns=0",
                    # The default cap is 20 ticks (5 s here): let tests ask for longer sessions.
                    "maxSessionTimeout=120000",
                    "",
                ]
            )
        )
        log = open(directory / "zookeeper.log", "ab")  # noqa: SIM115 - the child keeps it
        cmd = [
            "java",
            "-Xmx128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dzookeeper.log.dir={directory}",
            "-Dzookeeper.root.logger=WARN,CONSOLE",
            # The jar directory holds several SLF4J bindings and the first one found, nop, drops
            # everything: the simple one goes first, so the log says why a server failed.
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-cp",
            f"{ZK_CONF_DIR}:{ZK_JARS}/{SLF4J_BINDING}:{ZK_JARS}/*",
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(conf),
        ]
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        server = cls(directory, port, process)
        deadline = time.monotonic() + timeout
        while not _answers(port):
            if process.poll() is not None:
                raise RuntimeError(
                    f"ZooKeeper exited with {process.returncode}; see {directory}/zookeeper.log"
                )
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"ZooKeeper did not answer on port {port} in {timeout}s")
            time.sleep(0.05)
        return server

    def stop(self) -> None:
        """Stop the server process (by its PID) and wait for it."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)

    def restart(self, timeout: float = 60.0) -> None:
        """Stop and start the server again on the same port and data (sessions survive if the
        pause is shorter than their timeout)."""
        self.stop()
        again = ZooKeeperServer.start(self.directory, port=self.port, timeout=timeout)
        self.process = again.process


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One real ZooKeeper server for the test session (fails if it is not installed); a
    conftest imports this fixture to offer it to its folder."""
    server = ZooKeeperServer.start(tmp_path_factory.mktemp("zookeeper"))
    try:
        yield server
    finally:
        server.stop()
