"""Fixtures for storage integration tests: real ``polybroker bookie`` processes on loopback.

``bookie_process_factory(data_dir=None, *, port=0, config=None, metadata=None)`` starts a bookie
and returns ``BookieProcess(address, pid, data_dir)`` once it prints its listening line. Port 0
lets the bookie pick a free port itself; pass the port of an earlier run to restart a bookie at
the same address. Every process started is stopped at teardown (SIGTERM, then SIGKILL), by PID.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from standalone_process import wait_for_line

_LISTENING = "bookie listening on "


class BookieProcess(NamedTuple):
    """A running bookie process."""

    address: str
    pid: int
    data_dir: Path

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


class BookieProcessFactory:
    """Starts bookie processes and stops them (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, Path] = {}
        self._count = 0

    def _command(
        self, data_dir: Path, port: int, config: dict[str, object] | None, metadata: str | None
    ) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "polybroker",
            "bookie",
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
        ]
        if config:
            conf = self._root / f"bookie-{self._count}.conf"
            conf.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
            cmd += ["--config", str(conf)]
        if metadata:
            cmd += ["--metadata", metadata]
        return cmd

    def _spawn(
        self,
        data_dir: Path | None,
        port: int,
        config: dict[str, object] | None,
        metadata: str | None,
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        self._count += 1
        if data_dir is None:
            data_dir = self._root / f"bookie-data-{self._count}"
        log = self._root / f"bookie-{self._count}.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                self._command(data_dir, port, config, metadata),
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._procs[proc.pid] = proc
        self._logs[proc.pid] = log
        return proc, data_dir, log

    def __call__(
        self,
        data_dir: Path | None = None,
        *,
        port: int = 0,
        config: dict[str, object] | None = None,
        metadata: str | None = None,
        timeout: float = 60.0,
    ) -> BookieProcess:
        """Start a bookie and wait (bounded) for its listening line."""
        proc, data_dir, log = self._spawn(data_dir, port, config, metadata)
        line = wait_for_line(proc, _LISTENING, log, timeout, "bookie")
        return BookieProcess(line[len(_LISTENING) :].strip(), proc.pid, data_dir)

    def run_to_exit(
        self,
        data_dir: Path,
        *,
        port: int = 0,
        config: dict[str, object] | None = None,
        metadata: str | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, str]:
        """Run a bookie expected to refuse to start; return (exit status, stderr)."""
        proc, _, log = self._spawn(data_dir, port, config, metadata)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc.pid)
            raise AssertionError(f"bookie kept running: {log.read_text()}") from None
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.pop(proc.pid, None)
        return code, log.read_text()

    def stop(self, pid: int, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal a bookie and wait for it; return its exit status."""
        proc = self._procs.pop(pid)
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def kill(self, pid: int) -> None:
        """SIGKILL a bookie (a crash) and reap it."""
        self.stop(pid, signal.SIGKILL)

    def log(self, pid: int) -> str:
        """What the bookie wrote on stderr so far."""
        return self._logs[pid].read_text()

    def rss_mb(self, pid: int) -> float:
        """The resident memory of a running bookie."""
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS line")

    def close(self) -> None:
        """Stop whatever is still running: SIGTERM, then SIGKILL if it does not exit."""
        for pid in list(self._procs):
            proc = self._procs[pid]
            if proc.poll() is None:
                try:
                    self.stop(pid, signal.SIGTERM, timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            else:
                self._procs.pop(pid)
                if proc.stdout is not None:
                    proc.stdout.close()


@pytest.fixture
def bookie_process_factory(tmp_path: Path) -> Iterator[BookieProcessFactory]:
    """A factory of bookie processes, all stopped at teardown."""
    factory = BookieProcessFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()
