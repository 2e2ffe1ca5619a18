"""An in-memory ``BookieClient`` for ledger-client unit tests.

It keeps what a real bookie promises: an add is stored when it arrives and answered (its "fsync")
at once, after ``add_delay`` seconds of the shared clock, or only when released (``hold``); a
fence (or fencing read) marks the ledger fenced at once, so later adds fail with
``LedgerFencedError`` unless they carry the recovery flag; reads answer ``NoSuchEntryError`` for
entries it lacks. Failures are injected: ``crash()`` fails held requests and everything after
with ``BookieUnavailableError`` (what it stored stays, as on a disk), ``fail_adds`` fails the next
adds, ``corrupt`` flips a byte of a stored entry, ``silent`` leaves requests unanswered forever.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.ledger.api import (
    BookieClient,
    BookieError,
    BookieProtocolError,
    BookieUnavailableError,
    FenceResult,
    LedgerConfig,
    LedgerFencedError,
    LedgerMetadata,
    NoSuchEntryError,
    NoSuchLedgerError,
    ReadResult,
)
from polybroker.ledger.client import BookKeeperClient
from polybroker.ledger.registry import StaticBookieRegistry
from polybroker.metadata.memory import MemoryMetadataStore

# An ADD_MULTI record's head and ADD fields (``ledger.wire`` Rule 8).
WIRE_RECORD_HEAD = struct.Struct(">IIQqqB")


@dataclass
class FakeLedgerState:
    """What one bookie holds of one ledger."""

    entries: dict[int, bytes] = field(default_factory=dict)
    lac: int = -1
    fenced: bool = False


class FakeBookie(BookieClient):
    """One in-memory bookie (see the module docstring)."""

    def __init__(self, address: str, clock: Clock) -> None:
        self.address = address
        self.clock = clock
        self.ledgers: dict[int, FakeLedgerState] = {}
        self.hold = False
        self.held: list[tuple[Deferred[None], int, int]] = []  # (answer, ledger, entry)
        self.add_delay = 0.0
        self.down = False
        self.silent = False
        self.strided = True  # False: a bookie of wire version 2, refusing strided reads
        self.fail_adds = 0
        self.adds: list[tuple[int, int, int, bool]] = []  # (ledger, entry, lac, recovery)
        self.reads = 0
        self.fences = 0
        self.deleted: list[int] = []
        self.closed = False  # recorded only: several clients may share one fake

    # -- failure injection -------------------------------------------------------------------

    def crash(self) -> None:
        """Fail held requests and every later one; stored entries stay."""
        self.down = True
        held, self.held = self.held, []
        for d, ledger_id, entry_id in held:
            d.errback(BookieUnavailableError(f"{self.address}: crashed ({ledger_id}:{entry_id})"))

    def release(self, count: int | None = None) -> None:
        """Answer the first ``count`` held adds (all if None), in arrival order."""
        n = len(self.held) if count is None else count
        batch, self.held = self.held[:n], self.held[n:]
        for d, _, _ in batch:
            d.callback(None)

    def release_entry(self, ledger_id: int, entry_id: int) -> None:
        """Answer the held add of one entry."""
        for i, (d, lid, eid) in enumerate(self.held):
            if (lid, eid) == (ledger_id, entry_id):
                del self.held[i]
                d.callback(None)
                return
        raise AssertionError(f"{self.address} holds no add of {ledger_id}:{entry_id}")

    def corrupt(self, ledger_id: int, entry_id: int) -> None:
        """Flip the last byte of a stored entry."""
        raw = self.ledgers[ledger_id].entries[entry_id]
        self.ledgers[ledger_id].entries[entry_id] = raw[:-1] + bytes([raw[-1] ^ 0xFF])

    def entry_ids(self, ledger_id: int) -> list[int]:
        """The entries stored for a ledger, sorted."""
        st = self.ledgers.get(ledger_id)
        return sorted(st.entries) if st else []

    # -- BookieClient ------------------------------------------------------------------------

    def _refuse(self) -> Deferred[Any] | None:
        if self.silent:
            return Deferred()
        if self.down:
            return fail(BookieUnavailableError(f"{self.address} is down"))
        return None

    def add_entry(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, *, recovery: bool = False
    ) -> Deferred[None]:
        refused = self._refuse()
        if refused is not None:
            return refused
        self.adds.append((ledger_id, entry_id, lac, recovery))
        if self.fail_adds:
            self.fail_adds -= 1
            return fail(BookieError(f"{self.address}: injected add failure"))
        st = self.ledgers.setdefault(ledger_id, FakeLedgerState())
        if st.fenced and not recovery:
            return fail(LedgerFencedError(f"{self.address}: ledger {ledger_id} is fenced"))
        st.entries[entry_id] = data
        st.lac = max(st.lac, lac)
        if self.hold:
            d: Deferred[None] = Deferred()
            self.held.append((d, ledger_id, entry_id))
            return d
        if self.add_delay > 0:
            later: Deferred[None] = Deferred()
            self.clock.callLater(self.add_delay, self._answer, later)
            return later
        return succeed(None)

    def _answer(self, d: Deferred[None]) -> None:
        if self.down:
            d.errback(BookieUnavailableError(f"{self.address} is down"))
        else:
            d.callback(None)

    def read_entry(self, ledger_id: int, entry_id: int, *, fence: bool = False) -> Deferred[bytes]:
        refused = self._refuse()
        if refused is not None:
            return refused
        self.reads += 1
        if fence:
            self.ledgers.setdefault(ledger_id, FakeLedgerState()).fenced = True
        st = self.ledgers.get(ledger_id)
        if st is None:
            return fail(NoSuchLedgerError(f"{self.address}: no ledger {ledger_id}"))
        raw = st.entries.get(entry_id)
        if raw is None:
            return fail(NoSuchEntryError(f"{self.address}: no entry {ledger_id}:{entry_id}"))
        return succeed(raw)

    def read_range(
        self,
        ledger_id: int,
        first_entry_id: int,
        last_entry_id: int,
        max_bytes: int,
        stride: int = 1,
    ) -> Deferred[list[ReadResult]]:
        refused = self._refuse()
        if refused is not None:
            return refused
        if stride != 1 and not self.strided:
            return fail(BookieProtocolError(f"{self.address}: strided reads need version 3"))
        self.reads += 1
        st = self.ledgers.get(ledger_id)
        if st is None:
            return fail(NoSuchLedgerError(f"{self.address}: no ledger {ledger_id}"))
        out: list[ReadResult] = []
        size = 0
        for entry_id in range(first_entry_id, last_entry_id + 1, stride):
            raw = st.entries.get(entry_id)
            if raw is None or (out and size + len(raw) > max_bytes):
                break
            out.append(ReadResult(entry_id, raw))
            size += len(raw)
        if not out:
            return fail(NoSuchEntryError(f"{self.address}: no entry {ledger_id}:{first_entry_id}"))
        return succeed(out)

    def read_lac(
        self, ledger_id: int, *, previous_lac: int | None = None, timeout_ms: int = 0
    ) -> Deferred[int]:
        refused = self._refuse()
        if refused is not None:
            return refused
        st = self.ledgers.get(ledger_id)
        return succeed(st.lac if st else -1)

    def fence(self, ledger_id: int) -> Deferred[FenceResult]:
        refused = self._refuse()
        if refused is not None:
            return refused
        self.fences += 1
        st = self.ledgers.setdefault(ledger_id, FakeLedgerState())
        st.fenced = True
        return succeed(FenceResult(st.lac, max(st.entries, default=-1)))

    def delete_ledger(self, ledger_id: int) -> Deferred[None]:
        refused = self._refuse()
        if refused is not None:
            return refused
        self.deleted.append(ledger_id)
        if self.ledgers.pop(ledger_id, None) is None:
            return fail(NoSuchLedgerError(f"{self.address}: no ledger {ledger_id}"))
        return succeed(None)

    def instance_id(self) -> Deferred[str]:
        return succeed(f"instance-{self.address}")

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)


class BatchingBookie:
    """A ``FakeBookie`` seen through ``add_entry_batched`` and ``add_record_batched`` (as
    ``TcpBookieClient`` offers them): each add's outcome goes to the listener instead of a
    Deferred."""

    def __init__(self, bookie: FakeBookie) -> None:
        self._bookie = bookie

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bookie, name)

    def add_entry_batched(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, listener: Any
    ) -> None:
        address = self._bookie.address

        def acked(_: object) -> None:
            listener.entries_acked(address, [entry_id])

        def failed(f: Failure) -> None:
            listener.entries_failed(address, [entry_id], f.value)

        self._bookie.add_entry(ledger_id, entry_id, lac, data).addCallbacks(acked, failed)

    def add_record_batched(
        self, ledger_id: int, entry_id: int, record: bytes, listener: Any
    ) -> None:
        _, _, lid, eid, lac, _ = WIRE_RECORD_HEAD.unpack_from(record)
        assert (lid, eid) == (ledger_id, entry_id), "a record of another entry"
        self.add_entry_batched(ledger_id, entry_id, lac, record[WIRE_RECORD_HEAD.size :], listener)


class FakeCluster:
    """Bookies by address plus a connect function counting how often each is connected.

    With ``batched`` (default: ``FakeCluster.batched_default``) clients get ``BatchingBookie``s."""

    batched_default = False

    def __init__(self, clock: Clock, count: int, *, batched: bool | None = None) -> None:
        self.clock = clock
        self.bookies = {
            f"10.0.0.{i}:3181": FakeBookie(f"10.0.0.{i}:3181", clock) for i in range(count)
        }
        self.connects: dict[str, int] = {}
        self.batched = self.batched_default if batched is None else batched

    @property
    def addresses(self) -> list[str]:
        return list(self.bookies)

    def connect(self, address: str) -> BookieClient:
        self.connects[address] = self.connects.get(address, 0) + 1
        if self.batched:
            return BatchingBookie(self.bookies[address])  # type: ignore[return-value]
        return self.bookies[address]

    def connector(self) -> Callable[[str], BookieClient]:
        return self.connect


def result_of(d: Deferred[Any]) -> Any:
    """Return what an already-fired Deferred fired with (leaving it there); raise its failure."""
    out: list[object] = []

    def keep(value: object) -> object:
        out.append(value)
        return None if isinstance(value, Failure) else value

    d.addBoth(keep)
    assert out, "the Deferred has not fired"
    value = out[0]
    if isinstance(value, Failure):
        value.raiseException()
    return value


def failure_of(d: Deferred[Any]) -> BaseException:
    """Return the exception an already-fired Deferred failed with."""
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    value = out[0]
    assert isinstance(value, Failure), f"expected a failure, got {value!r}"
    return value.value


class LedgerRig:
    """A clock, an in-memory metadata store, fake bookies and a ``BookKeeperClient`` over them."""

    def __init__(self, bookies: int = 3, *, add_timeout_s: float = 5.0, seed: int = 7) -> None:
        self.clock = Clock()
        self.store = MemoryMetadataStore(self.clock)
        self.cluster = FakeCluster(self.clock, bookies)
        self.add_timeout_s = add_timeout_s
        self.seed = seed
        self.client = self.new_client()

    def new_client(self) -> BookKeeperClient:
        """Another client (another 'broker') over the same store and bookies."""
        self.seed += 1
        return BookKeeperClient(
            self.store,
            StaticBookieRegistry(self.cluster.addresses),
            self.cluster.connect,
            self.clock,
            add_timeout_s=self.add_timeout_s,
            rng=random.Random(self.seed),
        )

    def bookie(self, address: str) -> FakeBookie:
        return self.cluster.bookies[address]

    def create(self, e: int, qw: int, qa: int) -> Any:
        """Create a ledger and return its write handle."""
        return result_of(self.client.create(LedgerConfig(e, qw, qa)))

    def stored_metadata(self, ledger_id: int) -> LedgerMetadata:
        return result_of(self.client.get_metadata(ledger_id))
