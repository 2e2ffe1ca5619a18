"""Real ``polybroker bookie`` processes for the cluster tests, and a bounded wait helper.

``BookieProcesses.start(metadata, config)`` runs ``python -m polybroker bookie`` on a free
loopback port with a data dir of its own and returns once the process printed its listening
line (bounded); ``send``/``kill``/``stop`` act on that PID only; ``close`` stops what is left.
``start(..., data_dir=, port=)`` restarts a bookie where an earlier one ran; ``run_to_exit`` runs
one expected to refuse to start; ``LedgerClientRig`` is a ledger client in the test process that
can also read what one bookie itself holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from standalone_process import wait_for_line
from twisted.internet import reactor
from twisted.internet.task import deferLater

LISTENING = "bookie listening on "


async def eventually(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait on the reactor until ``check()`` holds; return the seconds it took, or fail the
    test naming ``what`` after ``timeout`` seconds."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        await deferLater(reactor, 0.01, lambda: None)
    return time.monotonic() - start


@dataclass
class Bookie:
    """A running bookie process."""

    address: str
    process: subprocess.Popen[bytes]
    data_dir: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid


class BookieProcesses:
    """Starts and stops bookie processes (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: list[Bookie] = []
        self._count = 0

    def start(
        self,
        metadata: str,
        config: dict[str, object] | None = None,
        timeout: float = 60.0,
        *,
        data_dir: Path | None = None,
        port: int = 0,
    ) -> Bookie:
        """Start a bookie registered in ``metadata``; blocks until it listens (bounded).
        ``data_dir`` and ``port`` restart a bookie where an earlier one ran."""
        self._count += 1
        data_dir = data_dir or self.root / f"bookie-{self._count}"
        log = self.root / f"bookie-{self._count}.log"
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
            "--metadata",
            metadata,
        ]
        if config:
            conf = self.root / f"bookie-{self._count}.conf"
            conf.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
            cmd += ["--config", str(conf)]
        with open(log, "wb") as err:
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        line = wait_for_line(process, LISTENING, log, timeout, "bookie")
        bookie = Bookie(line[len(LISTENING) :].strip(), process, data_dir, log)
        self.running.append(bookie)
        return bookie

    def send(self, bookie: Bookie, sig: int) -> None:
        """Send ``sig`` to that bookie's PID."""
        os.kill(bookie.pid, sig)

    def stop(self, bookie: Bookie, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the bookie, wait for it and return its exit status."""
        if bookie.process.poll() is None:
            os.kill(bookie.pid, sig)
        try:
            return bookie.process.wait(timeout)
        finally:
            if bookie.process.stdout is not None:
                bookie.process.stdout.close()
            if bookie in self.running:
                self.running.remove(bookie)

    def kill(self, bookie: Bookie) -> None:
        """kill -9: a crash."""
        self.stop(bookie, signal.SIGKILL)

    def close(self) -> None:
        for bookie in list(self.running):
            if bookie.process.poll() is None:
                os.kill(bookie.pid, signal.SIGCONT)
            try:
                self.stop(bookie, signal.SIGTERM, timeout=20)
            except subprocess.TimeoutExpired:
                self.stop(bookie, signal.SIGKILL)


# -- bookie loss and autorecovery --------------------------------------------------------------


def run_to_exit(
    metadata: str, data_dir: Path, port: int, config: dict[str, object], timeout: float = 60.0
) -> tuple[int, str]:
    """Run a bookie that is expected to refuse to start; return (exit status, stderr)."""
    conf = data_dir.parent / f"{data_dir.name}-refused.conf"
    conf.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
    done = subprocess.run(
        [
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
            "--metadata",
            metadata,
            "--config",
            str(conf),
        ],
        capture_output=True,
        timeout=timeout,
    )
    return done.returncode, done.stderr.decode(errors="replace")


def port_of(bookie: Bookie) -> int:
    """The TCP port a bookie listens on."""
    return int(bookie.address.rpartition(":")[2])


class LedgerClientRig:
    """A ledger client in the test process over the cluster's ZooKeeper and bookies, with
    direct reads from one bookie to check where entries are stored."""

    def __init__(self, store: Any, client: Any, registry: Any) -> None:
        self.store = store
        self.client = client
        self.registry = registry

    @classmethod
    async def open(cls, zk_url: str, add_timeout_s: float = 10.0) -> LedgerClientRig:
        from polybroker.ledger.client import BookKeeperClient
        from polybroker.ledger.registry import MetadataBookieRegistry, tcp_connector
        from polybroker.metadata.zookeeper import ZooKeeperMetadataStore

        store = await ZooKeeperMetadataStore.open(zk_url, reactor)
        registry = MetadataBookieRegistry(store)
        client = BookKeeperClient(
            store, registry, tcp_connector(reactor), reactor, add_timeout_s=add_timeout_s
        )
        return cls(store, client, registry)

    async def close(self) -> None:
        await self.client.close()
        self.registry.close()
        await self.store.close()

    async def available(self) -> list[str]:
        from polybroker.ledger.bookie.cookie import AVAILABLE_PATH

        return list(await self.store.children(AVAILABLE_PATH))

    async def metadata(self, ledger_id: int) -> Any:
        return await self.client.get_metadata(ledger_id)

    async def stored_on(
        self, address: str, ledger_id: int, entry_ids: list[int]
    ) -> dict[int, bytes]:
        """The entries (data, digest checked) that bookie ``address`` itself holds."""
        from polybroker.ledger.api import NoSuchEntryError, NoSuchLedgerError
        from polybroker.ledger.bookie_client import TcpBookieClient
        from polybroker.ledger.client import decode_record

        bookie = TcpBookieClient(address, reactor, timeout_s=10.0)
        out: dict[int, bytes] = {}
        try:
            for entry_id in entry_ids:
                try:
                    raw = await bookie.read_entry(ledger_id, entry_id)
                except (NoSuchEntryError, NoSuchLedgerError):
                    continue
                out[entry_id] = decode_record(ledger_id, entry_id, raw)[0]
        finally:
            await bookie.close()
        return out
