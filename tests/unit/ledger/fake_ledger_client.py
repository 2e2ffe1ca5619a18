"""An in-memory ``LedgerClient`` for managed-ledger unit tests.

It keeps the contracts of ``polybroker.ledger.api`` that the managed ledger relies on:
adds complete in order and only then count towards the LAC; a recovery open fences the ledger,
fails the old writer's pending and later adds with ``LedgerFencedError`` and closes the ledger
at its LAC; reads beyond the LAC fail. Adds complete synchronously, after ``add_delay`` seconds
of the given clock, or only when released (``hold``). Failures are injected per operation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.ledger.api import (
    BookieError,
    Entry,
    LedgerClient,
    LedgerClosedError,
    LedgerConfig,
    LedgerFencedError,
    LedgerMetadata,
    LedgerState,
    ManagedLedgerConfig,
    NoSuchEntryError,
    NoSuchLedgerError,
    ReadHandle,
    WriteHandle,
)
from polybroker.ledger.managed import ManagedLedgerFactoryImpl, ManagedLedgerImpl
from polybroker.metadata.memory import MemoryMetadataStore


@dataclass
class FakeLedger:
    """What the 'bookies' hold for one ledger."""

    ledger_id: int
    config: LedgerConfig
    ctime_ms: int
    entries: list[bytes] = field(default_factory=list)  # written (maybe not confirmed)
    lac: int = -1
    state: LedgerState = LedgerState.OPEN
    fenced: bool = False

    def metadata(self) -> LedgerMetadata:
        closed = self.state is LedgerState.CLOSED
        return LedgerMetadata(
            ledger_id=self.ledger_id,
            ensemble_size=self.config.ensemble_size,
            write_quorum=self.config.write_quorum,
            ack_quorum=self.config.ack_quorum,
            state=self.state,
            last_entry_id=self.lac if closed else -1,
            length=sum(len(e) for e in self.entries[: self.lac + 1]),
            fragments=((0, ("fake:1",)),),
            ctime_ms=self.ctime_ms,
            custom=dict(self.config.custom),
        )


class FakeReadHandle(ReadHandle):
    def __init__(self, client: FakeLedgerClient, ledger: FakeLedger) -> None:
        self.client = client
        self.ledger = ledger
        self.ledger_id = ledger.ledger_id
        self.closed = False

    @property
    def metadata(self) -> LedgerMetadata:
        return self.ledger.metadata()

    @property
    def last_add_confirmed(self) -> int:
        return self.ledger.lac

    def read(self, first_entry_id: int, last_entry_id: int) -> Deferred[list[bytes]]:
        client = self.client
        client.reads += 1
        client.entries_read += max(0, last_entry_id - first_entry_id + 1)
        if client.fail_reads:
            client.fail_reads -= 1
            return fail(BookieError("injected read failure"))
        if self.ledger_id not in client.ledgers:
            return fail(NoSuchLedgerError(f"ledger {self.ledger_id}"))
        if first_entry_id < 0 or last_entry_id > self.ledger.lac or first_entry_id > last_entry_id:
            return fail(
                NoSuchEntryError(
                    f"ledger {self.ledger_id}: {first_entry_id}..{last_entry_id} "
                    f"beyond LAC {self.ledger.lac}"
                )
            )
        return succeed(list(self.ledger.entries[first_entry_id : last_entry_id + 1]))

    def read_last_add_confirmed(self) -> Deferred[int]:
        return succeed(self.ledger.lac)

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)


class FakeWriteHandle(FakeReadHandle, WriteHandle):
    def __init__(self, client: FakeLedgerClient, ledger: FakeLedger) -> None:
        super().__init__(client, ledger)
        # entry id, Deferred, completed: adds sent and not yet answered, in order
        self.pending: list[tuple[int, Deferred[int]]] = []
        self.failed: Exception | None = None
        self.closing = False
        # As the real handle: True while a group of confirmations runs its callbacks, and
        # ``after_completions`` called once after the group.
        self.completing = False
        self.after_completions: Any = None

    @property
    def length(self) -> int:
        return sum(len(e) for e in self.ledger.entries[: self.ledger.lac + 1])

    def append(self, data: bytes) -> Deferred[int]:
        client, ledger = self.client, self.ledger
        client.appends += 1
        if ledger.fenced:
            return fail(LedgerFencedError(f"ledger {self.ledger_id} is fenced"))
        if ledger.state is LedgerState.CLOSED or self.closing:
            return fail(LedgerClosedError(f"ledger {self.ledger_id} is closed"))
        if self.failed is not None:
            return fail(self.failed)
        if client.fail_all_adds:
            self._fail_all(BookieError("injected refusal"))
            return fail(BookieError("injected refusal"))
        if client.fail_appends_after is not None:
            if client.fail_appends_after == 0:
                client.fail_appends_after = None
                self._fail_all(BookieError("injected add failure"))
                return fail(BookieError("injected add failure"))
            client.fail_appends_after -= 1
        entry_id = len(ledger.entries)
        ledger.entries.append(bytes(data))
        d: Deferred[int] = Deferred()
        self.pending.append((entry_id, d))
        if client.hold:
            return d
        if client.add_delay > 0 and client.clock is not None:
            client.clock.callLater(client.add_delay, self._confirm_through, entry_id)
        else:
            self._confirm_through(entry_id)
        return d

    def _confirm_through(self, entry_id: int) -> None:
        self.completing = True
        try:
            while self.pending and self.pending[0][0] <= entry_id:
                eid, d = self.pending.pop(0)
                if self.ledger.fenced or self.failed is not None:
                    continue  # answered already by the fencing/failure
                self.ledger.lac = eid
                d.callback(eid)
        finally:
            self.completing = False
        if self.after_completions is not None:
            self.after_completions()

    def release(self, count: int | None = None) -> None:
        """Confirm the oldest ``count`` held adds (all if None)."""
        if not self.pending:
            return
        n = len(self.pending) if count is None else count
        if n <= 0:
            return
        self._confirm_through(self.pending[min(n, len(self.pending)) - 1][0])

    def _fail_all(self, error: Exception) -> None:
        """Fail every pending add (the handle is broken; later adds fail too)."""
        self.failed = error
        pending, self.pending = self.pending, []
        for _, d in pending:
            d.errback(error)

    def fence(self) -> None:
        pending, self.pending = self.pending, []
        for _, d in pending:
            d.errback(LedgerFencedError(f"ledger {self.ledger_id} is fenced"))

    def close_ledger(self) -> Deferred[None]:
        client = self.client
        if client.fail_close:
            client.fail_close -= 1
            return fail(BookieError("injected close failure"))
        if self.ledger.fenced:
            return fail(LedgerFencedError(f"ledger {self.ledger_id} is fenced"))
        self.closing = True
        self.ledger.state = LedgerState.CLOSED
        if client.close_delay > 0 and client.clock is not None:
            d: Deferred[None] = Deferred()
            client.clock.callLater(client.close_delay, d.callback, None)
            return d
        return succeed(None)


class FakeLedgerClient(LedgerClient):
    """Ledgers in memory; see the module docstring."""

    def __init__(self, clock: Clock | None = None, *, add_delay: float = 0.0) -> None:
        self.clock = clock
        self.add_delay = add_delay
        self.ledgers: dict[int, FakeLedger] = {}
        self.writers: dict[int, FakeWriteHandle] = {}
        self._ids = itertools.count(1)
        self.hold = False
        self.create_delay = 0.0
        self.close_delay = 0.0
        self.fail_creates = 0
        self.fail_reads = 0
        self.fail_close = 0
        self.fail_appends_after: int | None = None
        self.fail_all_adds = False  # every add fails the ledger (bookies that refuse writes)
        self.creates = 0
        self.opens: list[tuple[int, bool]] = []
        self.deleted: list[int] = []
        self.reads = 0
        self.entries_read = 0
        self.appends = 0
        self.closed = False

    def create(self, config: LedgerConfig) -> Deferred[WriteHandle]:
        self.creates += 1
        if self.fail_creates:
            self.fail_creates -= 1
            return fail(BookieError("injected create failure"))
        ledger_id = next(self._ids)
        now = int(self.clock.seconds() * 1000) if self.clock is not None else 0
        ledger = FakeLedger(ledger_id, config, now)
        self.ledgers[ledger_id] = ledger
        handle = FakeWriteHandle(self, ledger)
        self.writers[ledger_id] = handle
        if self.create_delay > 0 and self.clock is not None:
            d: Deferred[WriteHandle] = Deferred()
            self.clock.callLater(self.create_delay, d.callback, handle)
            return d
        return succeed(handle)

    def open(self, ledger_id: int, *, recovery: bool = True) -> Deferred[ReadHandle]:
        self.opens.append((ledger_id, recovery))
        ledger = self.ledgers.get(ledger_id)
        if ledger is None:
            return fail(NoSuchLedgerError(f"ledger {ledger_id}"))
        if recovery and ledger.state is not LedgerState.CLOSED:
            ledger.fenced = True
            ledger.state = LedgerState.CLOSED
            writer = self.writers.get(ledger_id)
            if writer is not None:
                writer.fence()
            del ledger.entries[ledger.lac + 1 :]
        return succeed(FakeReadHandle(self, ledger))

    def delete(self, ledger_id: int) -> Deferred[None]:
        if self.ledgers.pop(ledger_id, None) is None:
            return fail(NoSuchLedgerError(f"ledger {ledger_id}"))
        self.deleted.append(ledger_id)
        return succeed(None)

    def get_metadata(self, ledger_id: int) -> Deferred[LedgerMetadata]:
        ledger = self.ledgers.get(ledger_id)
        if ledger is None:
            return fail(NoSuchLedgerError(f"ledger {ledger_id}"))
        return succeed(ledger.metadata())

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)

    # -- test helpers ------------------------------------------------------------------------

    def writer(self, ledger_id: int) -> FakeWriteHandle:
        """The write handle of a ledger."""
        return self.writers[ledger_id]

    def release(self, count: int | None = None) -> None:
        """Confirm held adds of every open writer, oldest ledger first."""
        for handle in list(self.writers.values()):
            handle.release(count)

    def fail_pending(self, ledger_id: int, error: Exception | None = None) -> None:
        """Fail every pending add of a ledger (a broken write quorum)."""
        self.writers[ledger_id]._fail_all(error or BookieError("injected bookie failure"))

    def confirmed(self, ledger_id: int) -> list[bytes]:
        """The confirmed entries of a ledger."""
        ledger = self.ledgers[ledger_id]
        return ledger.entries[: ledger.lac + 1]


# ---------------------------------------------------------------------------------------------
# Helpers for managed-ledger tests
# ---------------------------------------------------------------------------------------------

T = TypeVar("T")


def result_of(d: Deferred[T]) -> T:
    """Return what an already-fired Deferred fired with; raise its failure."""
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    value = out[0]
    if isinstance(value, Failure):
        value.raiseException()
    return value  # type: ignore[return-value]


def failure_of(d: Deferred[Any]) -> BaseException:
    """Return the exception an already-fired Deferred failed with."""
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    value = out[0]
    assert isinstance(value, Failure), f"expected a failure, got {value!r}"
    return value.value


def fired(d: Deferred[Any]) -> bool:
    """Whether ``d`` has fired (without consuming its result)."""
    return bool(d.called)


class Rig:
    """A clock, an in-memory metadata tree, a fake ledger client and a factory over them.

    ``reopen`` starts a second 'broker': a new session on the same tree, a new client view of
    the same ledgers, a new factory; the old one is left as it was (a crashed owner)."""

    def __init__(self, *, cache_size_bytes: int = 1 << 20, add_delay: float = 0.0) -> None:
        self.clock = Clock()
        self.store = MemoryMetadataStore(self.clock)
        self.client = FakeLedgerClient(self.clock, add_delay=add_delay)
        self.cache_size_bytes = cache_size_bytes
        self.factory = ManagedLedgerFactoryImpl(
            self.store, self.client, self.clock, cache_size_bytes=cache_size_bytes
        )

    def open(self, name: str = "t/ns/persistent/topic", **config: Any) -> ManagedLedgerImpl:
        config.setdefault("min_ledger_rollover_time_s", 0)
        # Keep consumed ledgers unless a test is about deleting them.
        config.setdefault("retention_time_s", -1)
        ml = result_of(self.factory.open(name, ManagedLedgerConfig(**config)))
        assert isinstance(ml, ManagedLedgerImpl)
        return ml

    def new_owner(self) -> Rig:
        """A second rig sharing this one's metadata tree and ledgers."""
        other = Rig.__new__(Rig)
        other.clock = self.clock
        other.store = self.store.new_session()
        other.client = FakeLedgerClient(self.clock, add_delay=self.client.add_delay)
        other.client.ledgers = self.client.ledgers
        other.client.writers = self.client.writers
        other.client._ids = self.client._ids
        other.cache_size_bytes = self.cache_size_bytes
        other.factory = ManagedLedgerFactoryImpl(
            other.store, other.client, self.clock, cache_size_bytes=self.cache_size_bytes
        )
        return other

    def append(self, ml: ManagedLedgerImpl, *payloads: bytes, num: int = 1) -> list[Entry]:
        """Append and return the entries (appends must complete at once)."""
        return [result_of(ml.append(p, num)) for p in payloads]
