"""BookKeeperClient over real bookie processes and TCP: crashes mid-stream, ensemble changes and
fencing by a recovering reader, each checked by reading back every acknowledged entry."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from polybroker.config import Config
from polybroker.ledger.api import (
    LedgerConfig,
    LedgerFencedError,
    LedgerState,
    NotEnoughBookiesError,
    WriteHandle,
)
from polybroker.ledger.bookie.server import BookieServer
from polybroker.ledger.client import BookKeeperClient, tcp_connector
from polybroker.ledger.direct import DirectLedgerReader, LedgerLayout
from polybroker.ledger.registry import MetadataBookieRegistry, StaticBookieRegistry
from polybroker.metadata.memory import MemoryMetadataStore

# The fixture types live in this folder's conftest.py, which tests cannot import by name.
BookieProcessFactory = Any

WINDOW = 256


def payload(seq: int) -> bytes:
    """1 KiB of bytes specific to the seq-th append."""
    head = f"append-{seq:08d}-".encode()
    return (head * (1024 // len(head) + 1))[:1024]


class Stream:
    """Appends with ``WINDOW`` outstanding until ``total`` were sent or an add fails."""

    def __init__(self, handle: WriteHandle, total: int) -> None:
        self.handle = handle
        self.total = total
        self.sent = 0
        self.outstanding = 0
        self.acked: dict[int, bytes] = {}
        self.errors: list[BaseException] = []

    def start(self) -> Stream:
        for _ in range(WINDOW):
            self._issue()
        return self

    @property
    def finished(self) -> bool:
        return self.outstanding == 0 and (bool(self.errors) or self.sent >= self.total)

    def _issue(self) -> None:
        if self.errors or self.sent >= self.total:
            return
        data = payload(self.sent)
        self.sent += 1
        self.outstanding += 1
        self.handle.append(data).addCallbacks(self._ok, self._failed, callbackArgs=(data,))

    def _ok(self, entry_id: int, data: bytes) -> None:
        self.outstanding -= 1
        assert entry_id not in self.acked
        self.acked[entry_id] = data
        self._issue()

    def _failed(self, failure: Failure) -> None:
        self.outstanding -= 1
        self.errors.append(failure.value)


async def wait_for(condition: Callable[[], bool], what: str, timeout: float = 8.0) -> None:
    """Let the reactor run until ``condition`` holds, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await deferLater(reactor, 0.005, lambda: None)


def new_client(store: MemoryMetadataStore, addresses: list[str]) -> BookKeeperClient:
    return BookKeeperClient(
        store, StaticBookieRegistry(addresses), tcp_connector(reactor), reactor, add_timeout_s=5.0
    )


async def check_readable(client: BookKeeperClient, ledger_id: int, acked: dict[int, bytes]) -> int:
    """Recover-open the ledger; every acknowledged entry reads back identical. Return its end."""
    handle = await client.open(ledger_id, recovery=True)
    last = handle.last_add_confirmed
    assert handle.metadata.state is LedgerState.CLOSED
    assert max(acked) <= last, "the closed end must cover every acknowledged entry"
    entries = await handle.read(0, last)
    for entry_id, data in acked.items():
        assert entries[entry_id] == data, f"entry {entry_id} differs"
    return last


@pytest_twisted.ensureDeferred
async def test_single_bookie_killed_mid_stream_loses_no_acknowledged_entry(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """kill -9 of the only bookie with hundreds of adds outstanding, restart on the same data
    dir: the writer stops (no spare bookie) and every entry it acknowledged is readable."""
    bookie = bookie_process_factory()
    store = MemoryMetadataStore(reactor)
    writer_client = new_client(store, [bookie.address])
    try:
        handle = await writer_client.create(LedgerConfig(1, 1, 1))
        stream = Stream(handle, 100_000).start()
        await wait_for(lambda: len(stream.acked) >= 1500, "1500 acks")
        bookie_process_factory.kill(bookie.pid)
        await wait_for(lambda: stream.finished, "the stream to stop")
        assert stream.outstanding == 0
        assert isinstance(stream.errors[0], NotEnoughBookiesError)
        assert stream.sent > len(stream.acked), "the kill should catch adds in flight"
        assert sorted(stream.acked) == list(range(len(stream.acked)))

        bookie_process_factory(bookie.data_dir, port=bookie.port)
        reader_client = new_client(store, [bookie.address])
        try:
            await check_readable(reader_client, handle.ledger_id, stream.acked)
        finally:
            await reader_client.close()
    finally:
        await writer_client.close()


@pytest_twisted.ensureDeferred
async def test_ensemble_change_after_a_bookie_dies_mid_stream(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """E=3 Qw=2 Qa=2 over three bookies plus a spare: kill -9 one mid-stream; the writer
    replaces it and goes on, and a fresh client reads back every acknowledged entry."""
    bookies = [bookie_process_factory() for _ in range(4)]
    addresses = [b.address for b in bookies]
    store = MemoryMetadataStore(reactor)
    writer_client = new_client(store, addresses)
    try:
        handle = await writer_client.create(LedgerConfig(3, 2, 2))
        ensemble = handle.metadata.fragments[0][1]
        victim = next(b for b in bookies if b.address == ensemble[1])
        stream = Stream(handle, 4000).start()
        await wait_for(lambda: len(stream.acked) >= 1000, "1000 acks")
        bookie_process_factory.kill(victim.pid)
        await wait_for(lambda: stream.finished, "the stream to finish")
        assert stream.errors == []
        assert len(stream.acked) == 4000
        meta = await writer_client.get_metadata(handle.ledger_id)
        assert len(meta.fragments) >= 2
        assert victim.address not in meta.fragments[-1][1]
        assert meta.fragments[-1][0] >= 1000
        await handle.close_ledger()

        reader_client = new_client(store, addresses)
        try:
            assert await check_readable(reader_client, handle.ledger_id, stream.acked) == 3999
        finally:
            await reader_client.close()
        # The striped ledger read straight from the bookies (strided reads, the dead bookie's
        # residues from their other replica), as a Spark worker does.
        meta = await writer_client.get_metadata(handle.ledger_id)
        fragments = tuple((start, tuple(ensemble)) for start, ensemble in meta.fragments)
        layout = LedgerLayout(handle.ledger_id, 3, 2, fragments)
        with DirectLedgerReader(timeout=5.0) as direct:
            assert dict(direct.read(layout, 0, 3999)) == stream.acked
    finally:
        await writer_client.close()


@pytest_twisted.ensureDeferred
async def test_recovery_open_fences_the_writer(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """A second client's recovery open stops a streaming writer with LedgerFencedError, and
    the closed end covers every entry the writer had acknowledged."""
    bookies = [bookie_process_factory() for _ in range(3)]
    addresses = [b.address for b in bookies]
    store = MemoryMetadataStore(reactor)
    writer_client = new_client(store, addresses)
    reader_client = new_client(store, addresses)
    try:
        handle = await writer_client.create(LedgerConfig(3, 2, 2))
        stream = Stream(handle, 1_000_000).start()
        await wait_for(lambda: len(stream.acked) >= 1000, "1000 acks")
        recovered = await reader_client.open(handle.ledger_id, recovery=True)
        await wait_for(lambda: stream.finished, "the writer to be stopped")
        assert stream.errors
        assert all(isinstance(e, LedgerFencedError) for e in stream.errors)
        last = recovered.last_add_confirmed
        assert max(stream.acked) <= last
        entries = await recovered.read(0, last)
        for entry_id, data in stream.acked.items():
            assert entries[entry_id] == data, f"entry {entry_id} differs"
        try:
            await handle.append(b"after")
        except LedgerFencedError:
            pass
        else:
            raise AssertionError("the fenced writer could still append")
        meta = await reader_client.get_metadata(handle.ledger_id)
        assert (meta.state, meta.last_entry_id) == (LedgerState.CLOSED, last)
    finally:
        await reader_client.close()
        await writer_client.close()


@pytest_twisted.ensureDeferred
async def test_replacement_comes_from_the_registered_bookies(tmp_path: Path) -> None:
    """In-process bookies announce themselves in the metadata store; when one of the ensemble
    stops (and withdraws), the writer takes the registered spare and loses nothing."""
    store = MemoryMetadataStore(reactor)
    servers = [
        BookieServer(
            Config({"journalMaxGroupWaitMSec": 1.0}),
            tmp_path / f"b{i}",
            reactor,
            metadata_store=store,
        )
        for i in range(4)
    ]
    for server in servers:
        await server.start()
    registry = MetadataBookieRegistry(store)
    client = BookKeeperClient(store, registry, tcp_connector(reactor), reactor, add_timeout_s=5.0)
    stopped: list[BookieServer] = []
    try:
        assert sorted(await registry.writable_bookies()) == sorted(s.address for s in servers)
        handle = await client.create(LedgerConfig(3, 2, 2))
        ensemble = handle.metadata.fragments[0][1]
        victim = next(s for s in servers if s.address == ensemble[0])
        spare = next(s.address for s in servers if s.address not in ensemble)
        stream = Stream(handle, 2000).start()
        await wait_for(lambda: len(stream.acked) >= 500, "500 acks")
        stopped.append(victim)
        await victim.stop()
        assert victim.address not in await registry.writable_bookies()
        await wait_for(lambda: stream.finished, "the stream to finish")
        assert stream.errors == []
        assert len(stream.acked) == 2000
        assert handle.metadata.fragments[-1][1] == (spare, ensemble[1], ensemble[2])
        await handle.close_ledger()
        reader = new_client(store, [s.address for s in servers if s is not victim])
        try:
            assert await check_readable(reader, handle.ledger_id, stream.acked) == 1999
        finally:
            await reader.close()
    finally:
        await client.close()
        registry.close()
        for server in servers:
            if server not in stopped:
                await server.stop()
