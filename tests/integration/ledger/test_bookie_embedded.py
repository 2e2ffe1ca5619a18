"""BookieServer embedded in this process on the real reactor: start, serve, checkpoint on its
timer, collect garbage, stop, restart; a large restart that stays fast and small; identity
registration in a metadata store."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, fail, succeed
from twisted.internet.task import deferLater

from polybroker.config import Config, ConfigError
from polybroker.ledger.api import BookieError, NoSuchLedgerError
from polybroker.ledger.bookie.cookie import CookieError
from polybroker.ledger.bookie.journal import read_mark
from polybroker.ledger.bookie.server import BookieServer
from polybroker.ledger.bookie_client import TcpBookieClient
from polybroker.metadata.api import BadVersionError, GetResult, NotFoundError, Stat

BookieProcessFactory = Any  # the fixture of this folder's conftest.py


async def eventually(check: Any, timeout: float = 20.0, step: float = 0.05) -> None:
    """Wait (on the reactor, bounded) until ``check()`` is true."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await deferLater(reactor, step, lambda: None)


@pytest_twisted.ensureDeferred
async def test_embedded_bookie_serves_checkpoints_collects_and_restarts(tmp_path: Path) -> None:
    """An in-process bookie answers on its port, checkpoints on its timer (the journal mark
    moves), reclaims a deleted ledger's entry log, and serves everything after a restart."""
    config = Config({"flushInterval": 100, "gcWaitTime": 100, "entryLogSizeLimit": 64 * 1024})
    server = BookieServer(config, tmp_path, reactor)
    port = await server.start()
    assert port > 0
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    assert await client.instance_id() == server.instance_id
    blob = os.urandom(8 * 1024)
    await DeferredList(
        [client.add_entry(1, e, e - 1, blob) for e in range(20)], fireOnOneErrback=True
    )
    await eventually(lambda: read_mark(tmp_path / "journal") is not None)
    await DeferredList(
        [client.add_entry(2, e, e - 1, blob[::-1]) for e in range(20)], fireOnOneErrback=True
    )
    logs = tmp_path / "ledgers" / "entrylogs"
    await eventually(lambda: len(list(logs.glob("*.log"))) >= 3)
    before = {p.name for p in logs.glob("*.log")}
    await client.delete_ledger(1)
    await eventually(lambda: len(set(p.name for p in logs.glob("*.log")) & before) < len(before))
    assert await client.read_entry(2, 19) == blob[::-1]
    await client.close()
    await server.stop()

    again = BookieServer(config, tmp_path, reactor)
    port = await again.start()
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    assert await client.instance_id() == server.instance_id
    assert [await client.read_entry(2, e) for e in (0, 10, 19)] == [blob[::-1]] * 3
    with pytest.raises(NoSuchLedgerError):
        await client.read_entry(1, 0)
    await client.close()
    await again.stop()


@pytest_twisted.ensureDeferred
async def test_embedded_bookie_compacts_logs_a_deleted_ledger_left_mostly_empty(
    tmp_path: Path,
) -> None:
    """Ledgers 1 (big entries) and 2 (small ones) share every entry log. Once ledger 1 is
    deleted, the minor compaction timer copies ledger 2's entries out and deletes the old logs
    while ledger 2 is still written to; everything of ledger 2 reads back, also after a
    restart."""
    config = Config(
        {
            "flushInterval": 100,
            "gcWaitTime": 600_000,  # compaction alone reclaims the space here
            "entryLogSizeLimit": 64 * 1024,
            "minorCompactionInterval": 0.2,
            "minorCompactionThreshold": 0.5,
            "majorCompactionInterval": 0,
        }
    )
    server = BookieServer(config, tmp_path, reactor)
    port = await server.start()
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    big, small = os.urandom(8 * 1024), os.urandom(512)
    logs = tmp_path / "ledgers" / "entrylogs"
    for r in range(10):
        await DeferredList(
            [client.add_entry(1, e, e - 1, big) for e in range(r * 4, r * 4 + 4)]
            + [client.add_entry(2, e, e - 1, small + bytes([e])) for e in range(r * 2, r * 2 + 2)],
            fireOnOneErrback=True,
        )
        await server.bookie.checkpoint()
    before = {p.name for p in logs.glob("*.log")}
    assert len(before) >= 4
    await client.delete_ledger(1)
    written = 20
    while len(before & {p.name for p in logs.glob("*.log")}) > 1:  # the current log stays
        assert written < 2000, "the old entry logs were not compacted"
        await client.add_entry(2, written, written - 1, small + bytes([written % 256]))
        written += 1
        await deferLater(reactor, 0.01, lambda: None)
    expected = [small + bytes([e % 256]) for e in range(written)]
    assert [await client.read_entry(2, e) for e in range(written)] == expected
    await client.close()
    await server.stop()

    again = BookieServer(config, tmp_path, reactor)
    port = await again.start()
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    assert [await client.read_entry(2, e) for e in range(written)] == expected
    with pytest.raises(NoSuchLedgerError):
        await client.read_entry(1, 0)
    await client.close()
    await again.stop()


@pytest_twisted.ensureDeferred
async def test_a_compaction_asked_for_while_one_runs_follows_it(tmp_path: Path) -> None:
    """A major compaction asked for while a minor one runs is not lost: a pass at its
    threshold follows, and both callers hear of every log deleted."""
    config = Config(
        {
            "flushInterval": 600_000,
            "gcWaitTime": 600_000,
            "entryLogSizeLimit": 64 * 1024,
            "minorCompactionInterval": 0,
            "majorCompactionInterval": 0,
        }
    )
    server = BookieServer(config, tmp_path, reactor)
    port = await server.start()
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    big, small = os.urandom(8 * 1024), os.urandom(4 * 1024)
    for r in range(6):
        await DeferredList(
            [client.add_entry(1, e, e - 1, big) for e in range(r * 4, r * 4 + 4)]
            + [client.add_entry(2, e, e - 1, small) for e in range(r * 2, r * 2 + 2)],
            fireOnOneErrback=True,
        )
        await server.bookie.checkpoint()
    await client.delete_ledger(1)
    await server.bookie.checkpoint()
    await server.bookie.checkpoint()  # the one after the deletion's: the log rolled over
    logs = tmp_path / "ledgers" / "entrylogs"
    before = {p.name for p in logs.glob("*.log")}
    # Ledger 2 is a fifth of each shared log: live, but above a minor threshold of 0.1.
    minor = server.bookie.compact(0.1)
    major = server.bookie.compact(0.5)
    deleted_minor, deleted_major = await minor, await major
    assert deleted_minor == deleted_major
    assert len(deleted_major) >= 3
    assert {f"{i:08x}.log" for i in deleted_major} <= before - {p.name for p in logs.glob("*.log")}
    assert [await client.read_entry(2, e) for e in range(12)] == [small] * 12
    await client.close()
    await server.stop()


@pytest_twisted.ensureDeferred
async def test_restart_of_a_full_bookie_is_fast_and_small(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """A bookie holding 256 MB, killed with -9, restarts in well under 10 s and serves reads
    with under 200 MB of resident memory."""
    bookie = bookie_process_factory()
    client = TcpBookieClient(bookie.address, reactor, timeout_s=30)
    blob = os.urandom(64 * 1024)
    total = 256 * 1024 * 1024 // len(blob)
    for first in range(0, total, 64):
        await DeferredList(
            [client.add_entry(1, e, e - 1, blob) for e in range(first, min(total, first + 64))],
            fireOnOneErrback=True,
        )
    bookie_process_factory.kill(bookie.pid)
    await client.close()
    started = time.monotonic()
    again = bookie_process_factory(bookie.data_dir, port=bookie.port)
    restart_s = time.monotonic() - started
    client = TcpBookieClient(again.address, reactor, timeout_s=30)
    for e in (0, 1, total // 2, total - 1):
        assert await client.read_entry(1, e) == blob
    rss = bookie_process_factory.rss_mb(again.pid)
    await client.close()
    assert restart_s < 10, restart_s
    assert rss < 200, rss


class MemoryStore:
    """The part of a metadata store bookie registration uses: get, put (CAS), delete."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int, bool]] = {}

    def get(self, path: str) -> Deferred[GetResult | None]:
        node = self.nodes.get(path)
        return succeed(None if node is None else GetResult(node[0], Stat(node[1], node[2], 0, 0)))

    def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        ephemeral: bool = False,
    ) -> Deferred[Stat]:
        node = self.nodes.get(path)
        if expected_version == -1 and node is not None:
            return fail(BadVersionError(path))
        version = 0 if node is None else node[1] + 1
        self.nodes[path] = (value, version, ephemeral)
        return succeed(Stat(version, ephemeral, 0, 0))

    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        if self.nodes.pop(path, None) is None:
            return fail(NotFoundError(path))
        return succeed(None)

    def children(self, path: str) -> Deferred[list[str]]:
        prefix = path + "/"
        return succeed(
            sorted(
                p[len(prefix) :]
                for p in self.nodes
                if p.startswith(prefix) and "/" not in p[len(prefix) :]
            )
        )


@pytest_twisted.ensureDeferred
async def test_wiped_bookie_cannot_rejoin_under_its_registered_address(tmp_path: Path) -> None:
    """A bookie registers its cookie and availability; after its data dir is wiped, a start at
    the same address refuses (the registered identity differs) and releases the port."""
    store = MemoryStore()
    server = BookieServer(Config(), tmp_path / "data", reactor, metadata_store=store)  # type: ignore[arg-type]
    port = await server.start()
    address = f"127.0.0.1:{port}"
    assert f"/bookies/cookies/{address}" in store.nodes
    assert store.nodes[f"/bookies/available/{address}"][2] is True
    first_id = server.instance_id
    await server.stop()
    assert f"/bookies/available/{address}" not in store.nodes

    shutil.rmtree(tmp_path / "data")
    wiped = BookieServer(Config(), tmp_path / "data", reactor, port=port, metadata_store=store)  # type: ignore[arg-type]
    with pytest.raises(CookieError, match=first_id):
        await wiped.start()
    assert f"/bookies/available/{address}" not in store.nodes
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the refused bookie let go of its port

    # The original data dir would still be welcome: the same identity re-registers.
    again = BookieServer(Config(), tmp_path / "other", reactor, metadata_store=store)  # type: ignore[arg-type]
    other_port = await again.start()
    assert f"/bookies/available/127.0.0.1:{other_port}" in store.nodes
    await again.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest_twisted.ensureDeferred
async def test_a_bookie_keeps_its_address_and_refuses_another(tmp_path: Path) -> None:
    """A bookie first started on port 0 restarts on port 0 under the same address; a start on
    another port refuses before touching the data dir or the store, and leaves the port free;
    with the move allowed it starts there, same identity, and records the new address."""
    store = MemoryStore()
    data = tmp_path / "data"
    first = BookieServer(Config(), data, reactor, metadata_store=store)  # type: ignore[arg-type]
    port = await first.start()
    client = TcpBookieClient(f"127.0.0.1:{port}", reactor, timeout_s=10)
    await client.add_entry(7, 0, -1, b"kept")
    await client.close()
    await first.stop()

    again = BookieServer(Config(), data, reactor, metadata_store=store)  # type: ignore[arg-type]
    assert await again.start() == port
    assert again.instance_id == first.instance_id
    await again.stop()

    other = _free_port()
    before_disk, before_nodes = _snapshot(data), dict(store.nodes)
    moved = BookieServer(Config(), data, reactor, port=other, metadata_store=store)  # type: ignore[arg-type]
    with pytest.raises(CookieError, match=f"127.0.0.1:{port}"):
        await moved.start()
    assert _snapshot(data) == before_disk
    assert store.nodes == before_nodes
    with socket.socket() as s:
        s.bind(("127.0.0.1", other))  # never listened there

    allowed = BookieServer(
        Config({"allowBookieAddressChange": True}),
        data,
        reactor,
        port=other,
        metadata_store=store,  # type: ignore[arg-type]
    )
    assert await allowed.start() == other
    assert allowed.instance_id == first.instance_id
    assert allowed.address == f"127.0.0.1:{other}"
    assert f"/bookies/available/127.0.0.1:{other}" in store.nodes
    client = TcpBookieClient(allowed.address, reactor, timeout_s=10)
    assert await client.read_entry(7, 0) == b"kept"
    await client.close()
    await allowed.stop()

    # The data dir now belongs at the new address: port 0 means that one.
    last = BookieServer(Config(), data, reactor, metadata_store=store)  # type: ignore[arg-type]
    assert await last.start() == other
    await last.stop()


@pytest_twisted.ensureDeferred
async def test_a_filling_disk_makes_the_bookie_read_only_until_space_is_freed(
    tmp_path: Path,
) -> None:
    """Above diskUsageThreshold (checked on the bookie's timer) adds are refused with the
    reason, reads go on, and the bookie is announced read-only, so the registry stops offering
    it; between the thresholds it stays so; below diskUsageLwmThreshold it takes adds again
    and the announcement goes, with no restart. A disk full at start is read-only at once."""
    from polybroker.ledger.registry import MetadataBookieRegistry
    from polybroker.metadata.memory import MemoryMetadataStore

    used = {"fraction": 0.5}
    store = MemoryMetadataStore(reactor)
    config = Config(
        {"diskUsageThreshold": 0.95, "diskUsageLwmThreshold": 0.9, "diskCheckInterval": 20}
    )
    server = BookieServer(
        config, tmp_path, reactor, metadata_store=store, disk_usage=lambda _: used["fraction"]
    )
    port = await server.start()
    address = f"127.0.0.1:{port}"
    registry = MetadataBookieRegistry(store)
    client = TcpBookieClient(address, reactor, timeout_s=10)
    try:
        await client.add_entry(1, 0, -1, b"before")
        assert await registry.writable_bookies() == [address]

        used["fraction"] = 0.97
        await eventually(lambda: server.read_only)
        with pytest.raises(BookieError, match=r"read-only: disk 97\.0% used"):
            await client.add_entry(1, 1, 0, b"refused")
        assert await client.read_entry(1, 0) == b"before"
        await server.check_disk()  # the announcement is written when this fires
        assert await store.children("/bookies/readonly") == [address]
        assert await registry.writable_bookies() == []

        used["fraction"] = 0.92  # under the threshold, above the low-water mark
        await server.check_disk()
        assert server.read_only

        used["fraction"] = 0.5
        await eventually(lambda: not server.read_only)
        await client.add_entry(1, 1, 0, b"after")
        assert await client.read_entry(1, 1) == b"after"
        await server.check_disk()
        assert await store.children("/bookies/readonly") == []
        assert await registry.writable_bookies() == [address]
    finally:
        registry.close()
        await client.close()
        await server.stop()

    used["fraction"] = 0.99
    full = BookieServer(config, tmp_path, reactor, disk_usage=lambda _: used["fraction"])
    await full.start()
    try:
        assert full.read_only
        client = TcpBookieClient(address, reactor, timeout_s=10)
        with pytest.raises(BookieError, match="read-only"):
            await client.add_entry(2, 0, -1, b"refused")
        assert await client.read_entry(1, 1) == b"after"
        await client.close()
    finally:
        await full.stop()


def test_a_low_water_mark_above_the_threshold_is_refused(tmp_path: Path) -> None:
    """diskUsageLwmThreshold above diskUsageThreshold would flap: a clear error at once."""
    config = Config({"diskUsageThreshold": 0.8, "diskUsageLwmThreshold": 0.9})
    with pytest.raises(ConfigError, match="diskUsageLwmThreshold"):
        BookieServer(config, tmp_path, reactor)
