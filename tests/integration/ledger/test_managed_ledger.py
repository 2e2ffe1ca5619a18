"""Managed ledgers over the real ledger client, in-process bookies on loopback (port 0) and the
embedded metadata store, on the real reactor: appends across ledgers, lookups, cursors, a
crash-style takeover that fences the old owner, and closing and reopening everything on the
same data."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import DeferredList
from twisted.internet.task import deferLater

from polybroker.config import Config
from polybroker.ledger.api import (
    InitialPosition,
    LedgerState,
    ManagedLedgerConfig,
    ManagedLedgerFencedError,
    NoSuchLedgerError,
)
from polybroker.ledger.bookie.server import BookieServer
from polybroker.ledger.client import BookKeeperClient
from polybroker.ledger.managed import ManagedLedgerFactoryImpl, ManagedLedgerImpl
from polybroker.ledger.registry import StaticBookieRegistry, tcp_connector
from polybroker.metadata import open_metadata_store
from polybroker.metadata.api import MetadataStore

NAME = "public/default/persistent/ml-it"
BOOKIE_CONFIG = {"journalMaxGroupWaitMSec": 1.0, "flushInterval": 500}


class Cluster:
    """Bookies, a metadata store and factories over them; everything stopped by ``stop``."""

    def __init__(self, root: Path, ports: list[int] | None = None) -> None:
        self.root = root
        self.ports = ports or []  # bookies keep their address across restarts
        self.bookies: list[BookieServer] = []
        self.store: MetadataStore | None = None
        self.factories: list[ManagedLedgerFactoryImpl] = []

    async def start(self, bookies: int = 1) -> None:
        self.store = await open_metadata_store("embedded", data_dir=self.root, reactor=reactor)
        for i in range(bookies):
            port = self.ports[i] if i < len(self.ports) else 0
            server = BookieServer(
                Config(BOOKIE_CONFIG), self.root / f"bookie-{i}", reactor, port=port
            )
            bound = await server.start()
            if i >= len(self.ports):
                self.ports.append(bound)
            self.bookies.append(server)

    def factory(self, config: ManagedLedgerConfig | None = None) -> ManagedLedgerFactoryImpl:
        assert self.store is not None
        client = BookKeeperClient(
            self.store,
            StaticBookieRegistry([b.address for b in self.bookies]),
            tcp_connector(reactor),
            reactor,
        )
        factory = ManagedLedgerFactoryImpl(self.store, client, reactor, default_config=config)
        self.factories.append(factory)
        return factory

    async def stop(self) -> None:
        for factory in self.factories:
            with contextlib.suppress(Exception):
                await factory.close()
        self.factories.clear()
        for server in self.bookies:
            await server.stop()
        self.bookies.clear()
        if self.store is not None:
            await self.store.close()
            self.store = None


def _config(**kw: Any) -> ManagedLedgerConfig:
    kw.setdefault("min_ledger_rollover_time_s", 0)
    kw.setdefault("cursor_mark_delete_rate_per_s", 50.0)
    return ManagedLedgerConfig(**kw)


@pytest_twisted.ensureDeferred
async def test_appends_rollover_lookups_and_cursors_survive_a_full_restart(
    tmp_path: Path,
) -> None:
    """256 appends in flight over several ledgers complete in order; lookups are exact; a
    cursor's acknowledgements and every entry survive closing and reopening the factory, the
    bookie and the store on the same data."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    try:
        factory = cluster.factory(_config(max_entries_per_ledger=100))
        ml = await factory.open(NAME)
        assert isinstance(ml, ManagedLedgerImpl)
        cursor = await ml.open_cursor("sub", InitialPosition.EARLIEST)
        payload = b"x" * 1024
        results = await DeferredList(
            [ml.append(payload + b"%d" % i, 1 + i % 3) for i in range(256)],
            fireOnOneErrback=True,
        )
        entries = [entry for _, entry in results]
        assert [e.index for e in entries] == sorted(e.index for e in entries)
        assert entries[-1].index + entries[-1].num_messages == ml.next_index
        assert len({e.position.ledger_id for e in entries}) == 3
        for e in entries[::17]:
            assert await ml.position_of_index(e.index + e.num_messages - 1) == e.position
            assert await ml.index_of_position(e.position) == e.index
        got = await cursor.read(300)
        assert [e.data for e in got] == [e.data for e in entries]
        await cursor.mark_delete(entries[97].position)
        await cursor.delete([entries[150].position, entries[151].position])
        await factory.close()
        await cluster.stop()

        cluster = Cluster(tmp_path, cluster.ports)
        await cluster.start()
        factory = cluster.factory(_config(max_entries_per_ledger=100))
        again = await factory.open(NAME)
        recovered = again.cursors["sub"]
        assert recovered.mark_delete_position == entries[97].position
        assert recovered.individually_deleted() == [(entries[150].position, entries[151].position)]
        rest = await recovered.read(300)
        assert [e.position for e in rest] == [
            e.position for i, e in enumerate(entries) if i >= 98 and i not in (150, 151)
        ]
        assert recovered.backlog_entries() == 156
        new = await again.append(b"after restart")
        assert new.index == entries[-1].index + entries[-1].num_messages
        assert await again.position_of_index(entries[200].index) == entries[200].position
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_new_owner_fences_the_old_one(tmp_path: Path) -> None:
    """A second factory opening a log whose owner never closed it recovers every confirmed
    entry and fences the old owner: its next append fails and nothing it wrote is lost."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    try:
        old = await cluster.factory(_config(retention_time_s=-1)).open(NAME)
        confirmed = [await old.append(b"m%d" % i) for i in range(20)]
        new = await cluster.factory(_config(retention_time_s=-1)).open(NAME)
        assert new.next_index == 20
        with pytest.raises(ManagedLedgerFencedError):
            await old.append(b"stale")
        entry = await new.append(b"m20")
        assert entry.index == 20
        got = await new.read(new.first_position, 100)
        assert [e.data for e in got] == [e.data for e in confirmed] + [b"m20"]
        client = cluster.factories[1].client
        metadata = await client.get_metadata(confirmed[0].position.ledger_id)
        assert metadata.state is LedgerState.CLOSED
        assert metadata.last_entry_id == 19
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_consumed_ledgers_are_deleted_from_the_bookies(tmp_path: Path) -> None:
    """Ledgers every cursor has passed leave the list and the ledger metadata."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    try:
        factory = cluster.factory(_config(max_entries_per_ledger=5, retention_time_s=0))
        ml = await factory.open(NAME)
        cursor = await ml.open_cursor("sub", InitialPosition.EARLIEST)
        entries = [await ml.append(b"%d" % i) for i in range(12)]
        first = entries[0].position.ledger_id
        await cursor.mark_delete(entries[9].position)
        deadline = reactor.seconds() + 10
        while first in [i.ledger_id for i in ml.ledgers]:
            assert reactor.seconds() < deadline, "consumed ledger was not trimmed"
            await deferLater(reactor, 0.05, lambda: None)
        assert ml.first_position == entries[10].position
        client = cluster.factories[0].client
        # The ledger is deleted right after the list without it was written.
        while True:
            try:
                await client.get_metadata(first)
            except NoSuchLedgerError:
                break
            assert reactor.seconds() < deadline, "consumed ledger was not deleted"
            await deferLater(reactor, 0.05, lambda: None)
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_appends_go_on_when_a_bookie_stops(tmp_path: Path) -> None:
    """With a spare bookie (3 bookies, E=Qw=Qa=2), stopping one bookie mid-stream loses and
    reorders nothing: every append completes, in order, and reads back."""
    cluster = Cluster(tmp_path)
    await cluster.start(bookies=3)
    try:
        config = _config(ensemble_size=2, write_quorum=2, ack_quorum=2, retention_time_s=-1)
        ml = await cluster.factory(config).open(NAME)
        cursor = await ml.open_cursor("sub", InitialPosition.EARLIEST)
        first = [await ml.append(b"a%d" % i) for i in range(10)]
        client = cluster.factories[0].client
        metadata = await client.get_metadata(first[-1].position.ledger_id)
        ensemble = metadata.ensemble_for(first[-1].position.entry_id)
        victim = next(b for b in cluster.bookies if b.address in ensemble)
        cluster.bookies.remove(victim)
        await victim.stop()
        results = await DeferredList(
            [ml.append(b"b%d" % i) for i in range(50)], fireOnOneErrback=True
        )
        later = [entry for _, entry in results]
        entries = first + later
        assert [e.index for e in entries] == list(range(60))
        got = await cursor.read(100)
        assert [e.data for e in got] == [e.data for e in entries]
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_a_tailing_read_wakes_on_the_next_append(tmp_path: Path) -> None:
    """A waiting read on the real reactor fires with the entry appended after it parked."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    try:
        ml = await cluster.factory(_config()).open(NAME)
        cursor = await ml.open_cursor("tail")
        waiting = cursor.read(10, wait=True)
        assert not waiting.called
        entry = await ml.append(b"news")
        assert await waiting == [entry]
    finally:
        await cluster.stop()


@pytest_twisted.ensureDeferred
async def test_append_many_over_three_bookies_interleaves_with_appends(tmp_path: Path) -> None:
    """Groups appended with ``append_many`` (E=3, Qw=2, Qa=2, rolling over every 50 entries)
    complete whole, in order with single appends made around them, and read back as written
    from a second owner that recovered the log."""
    cluster = Cluster(tmp_path)
    await cluster.start(bookies=3)
    try:
        config = _config(
            ensemble_size=3,
            write_quorum=2,
            ack_quorum=2,
            max_entries_per_ledger=50,
            retention_time_s=-1,  # no cursor: keep the consumed ledgers for the reader
        )
        ml = await cluster.factory(config).open(NAME)
        groups = [ml.append_many([b"g%d-%d" % (g, i) for i in range(40)]) for g in range(4)]
        singles = [ml.append(b"s%d" % i, 2) for i in range(10)]
        done = await DeferredList([*groups, *singles], fireOnOneErrback=True)
        written = [e for _, r in done[:4] for e in r] + [e for _, e in done[4:]]
        assert [e.index for e in written] == list(range(160)) + list(range(160, 180, 2))
        assert len({e.position.ledger_id for e in written}) == 4
        reader = await cluster.factory(config).open(NAME)  # fences and recovers the first
        got = await reader.read(reader.first_position, 500)
        assert [e.data for e in got] == [e.data for e in written]
    finally:
        await cluster.stop()
