"""The storage layer's public API: what the rest of polybroker may import from ``ledger/``.

Three levels, each built on the one below, each one async primitive per operation:

* ``BookieClient``: one bookie, over the wire protocol of ``ledger.wire``.
* ``LedgerClient`` / ``WriteHandle`` / ``ReadHandle``: ledgers replicated with ensemble size E,
  write quorum Qw and ack quorum Qa (BookKeeper's model).
* ``ManagedLedgerFactory`` / ``ManagedLedger`` / ``Cursor``: one named log per topic (partition)
  over a sequence of ledgers, with durable cursors (Pulsar's managed ledger).

Invariants the implementations keep (numbers refer to the storage-invariants reference):

Rule 1 (I1, I11): an add completes only after Qa bookies of its write set fsync'd it to their
        journal and every lower entry completed; the last-add-confirmed (LAC) is the highest such
        entry.
Rule 2 (I15, I16): a ledger is written by one writer; after fencing (recovery open) the old
        writer's adds fail with ``LedgerFencedError`` and the ledger is closed at an entry >= every
        entry ever acknowledged.
Rule 3 (I18, I25): ledger metadata and managed-ledger metadata change only by compare-and-set.
Rule 4 (I26): a cursor's mark-delete position never moves backwards except by an explicit reset;
        individually deleted positions are always above it.
Rule 5 (I27): a ledger is deleted only when every durable cursor has passed it.
"""

from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.python.failure import Failure

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class StorageError(Exception):
    """Base of every storage failure."""


class BookieError(StorageError):
    """A bookie answered with an error or could not be reached."""


class BookieUnavailableError(BookieError):
    """The bookie could not be reached, timed out, or is not the bookie we knew (identity)."""


class LedgerFencedError(BookieError):
    """The ledger was fenced by a recovering reader: this writer may write no more."""


class NoSuchEntryError(BookieError):
    """The bookie does not hold this entry."""


class NoSuchLedgerError(BookieError):
    """The bookie (or the metadata) knows no such ledger."""


class BookieProtocolError(BookieError):
    """A malformed, oversize or corrupt frame, or a version the peer does not speak."""


class DigestMismatchError(StorageError):
    """An entry read back does not match its digest: it is corrupt and was not returned."""


class NotEnoughBookiesError(StorageError):
    """Fewer bookies are available than the ensemble size asks for."""


class LedgerClosedError(StorageError):
    """The ledger is closed (or being recovered) and takes no more adds."""


class ManagedLedgerError(StorageError):
    """Base of managed-ledger failures."""


class ManagedLedgerFencedError(ManagedLedgerError):
    """Another owner took over this log; this instance writes no more."""


class ManagedLedgerTerminatedError(ManagedLedgerError):
    """The log was terminated: no more appends, ever."""


class ManagedLedgerClosedError(ManagedLedgerError):
    """The managed ledger (or cursor) was closed."""


class CursorNotFoundError(ManagedLedgerError):
    """No cursor of that name."""


# ---------------------------------------------------------------------------------------------
# Bookie level
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FenceResult:
    """What a bookie answers to a fence: its view of the ledger's end."""

    lac: int  # last-add-confirmed piggybacked on the adds it holds, -1 if none
    last_entry_id: int  # highest entry it holds, -1 if none


@dataclass(frozen=True)
class ReadResult:
    """One entry as a bookie returns it: the opaque bytes the writer stored."""

    entry_id: int
    data: bytes


class BookieClient(abc.ABC):
    """One connection (pool) to one bookie. Errors are the ``BookieError`` subclasses above.

    ``data`` is opaque to the bookie: the ledger client stores its digest-protected record there.
    ``lac`` on an add is the writer's LAC when it sent the add (piggybacked, Rule 1).
    """

    address: str  # "host:port", the bookie's id in ledger metadata

    @abc.abstractmethod
    def add_entry(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, *, recovery: bool = False
    ) -> Deferred[None]:
        """Store an entry durably (journal fsync'd) before answering.

        Fails with ``LedgerFencedError`` if the ledger is fenced, unless ``recovery`` is set
        (recovery writes go through fencing)."""

    @abc.abstractmethod
    def read_entry(self, ledger_id: int, entry_id: int, *, fence: bool = False) -> Deferred[bytes]:
        """Return an entry's data; ``fence`` fences the ledger first (recovery reads)."""

    @abc.abstractmethod
    def read_range(
        self,
        ledger_id: int,
        first_entry_id: int,
        last_entry_id: int,
        max_bytes: int,
        stride: int = 1,
    ) -> Deferred[list[ReadResult]]:
        """Return the entries ``first_entry_id``, ``first_entry_id + stride``, ..., stopping
        at ``last_entry_id``, at ``max_bytes`` (at least one entry is returned) or at the first
        entry it lacks. A bookie too old for a stride above 1 fails it with
        ``BookieProtocolError``."""

    @abc.abstractmethod
    def read_lac(
        self, ledger_id: int, *, previous_lac: int | None = None, timeout_ms: int = 0
    ) -> Deferred[int]:
        """Return the highest LAC this bookie has seen for the ledger (-1 if none).

        With ``previous_lac`` and ``timeout_ms`` > 0 it long-polls: it answers as soon as the LAC
        is above ``previous_lac``, or at the timeout with the current value."""

    @abc.abstractmethod
    def fence(self, ledger_id: int) -> Deferred[FenceResult]:
        """Durably fence the ledger on this bookie, then answer with its view of the end."""

    @abc.abstractmethod
    def delete_ledger(self, ledger_id: int) -> Deferred[None]:
        """Forget a ledger; its space is reclaimed by garbage collection."""

    @abc.abstractmethod
    def instance_id(self) -> Deferred[str]:
        """The bookie's identity (the instance id of its cookie), asked of it on connect.

        A bookie whose data dir was wiped or swapped has another one and must not be taken for
        the old bookie at the same address."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Close the connection(s); pending requests fail with ``BookieUnavailableError``."""


# ---------------------------------------------------------------------------------------------
# Ledger level
# ---------------------------------------------------------------------------------------------


class LedgerState(enum.Enum):
    OPEN = "open"
    IN_RECOVERY = "in_recovery"
    CLOSED = "closed"


@dataclass(frozen=True)
class LedgerMetadata:
    """A ledger's metadata as kept in the metadata store (changed only by CAS)."""

    ledger_id: int
    ensemble_size: int
    write_quorum: int
    ack_quorum: int
    state: LedgerState
    last_entry_id: int  # -1 while open or when empty
    length: int  # bytes of data, known once closed
    # (first entry id, ensemble of bookie addresses) in ascending first-entry order.
    fragments: tuple[tuple[int, tuple[str, ...]], ...]
    ctime_ms: int
    custom: dict[str, str] = field(default_factory=dict)

    def ensemble_for(self, entry_id: int) -> tuple[str, ...]:
        """Return the ensemble of the fragment holding ``entry_id``."""
        chosen = self.fragments[0][1]
        for first, ensemble in self.fragments:
            if first > entry_id:
                break
            chosen = ensemble
        return chosen

    def write_set(self, entry_id: int) -> tuple[str, ...]:
        """Return the Qw bookies entry ``entry_id`` is written to: ensemble[(e + i) mod E]."""
        ensemble = self.ensemble_for(entry_id)
        e = self.ensemble_size
        return tuple(ensemble[(entry_id + i) % e] for i in range(self.write_quorum))


class ReadHandle(abc.ABC):
    """Read access to one ledger."""

    ledger_id: int

    @property
    @abc.abstractmethod
    def metadata(self) -> LedgerMetadata:
        """The metadata as last seen by this handle."""

    @property
    @abc.abstractmethod
    def last_add_confirmed(self) -> int:
        """The LAC as known locally (for a closed ledger: its last entry)."""

    @abc.abstractmethod
    def read(self, first_entry_id: int, last_entry_id: int) -> Deferred[list[bytes]]:
        """Return entries first..last inclusive (all <= LAC), digests verified, in order.

        Each entry is read from one bookie of its write set and retried on the others."""

    @abc.abstractmethod
    def read_last_add_confirmed(self) -> Deferred[int]:
        """Ask the bookies for the LAC (for tailing readers of an open ledger); update locally."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Release the handle (does not close the ledger)."""


class WriteListener(Protocol):
    """Who hears of adds made with ``WriteHandle.append_quiet`` (no Deferred per add)."""

    def adds_done(self, handle: WriteHandle, last_entry_id: int) -> None:
        """Every add of ``handle`` up to ``last_entry_id`` completed (Rule 1)."""

    def adds_failed(self, handle: WriteHandle, error: Exception) -> None:
        """Adds of ``handle`` failed with ``error``: none not yet reported done completes."""


class WriteHandle(ReadHandle):
    """The single writer of a ledger."""

    @abc.abstractmethod
    def append(self, data: bytes) -> Deferred[int]:
        """Add an entry; fire with its entry id once Rule 1 holds. Entries complete in order.

        Bookie failures trigger an ensemble change (new fragment, by CAS) and the add goes on.
        Fails with ``LedgerFencedError`` once the ledger was fenced, and ``LedgerClosedError``
        after ``close_ledger``."""

    def append_quiet(self, data: bytes, listener: WriteListener, prefix: bytes = b"") -> None:
        """``append`` telling ``listener`` instead of a Deferred: completions in entry order,
        possibly several entries per ``adds_done`` call; once an add failed, ``adds_failed``
        (possibly more than once, possibly before this returns) and no ``adds_done`` beyond
        what completed before. The entry is ``prefix + data`` (the caller need not copy
        ``data`` to prepend a header). This default rides on ``append``; implementations do
        better."""

        def done(entry_id: int) -> None:
            listener.adds_done(self, entry_id)

        def failed(failure: Failure) -> None:
            listener.adds_failed(self, failure.value)  # type: ignore[arg-type]

        self.append(prefix + data if prefix else data).addCallbacks(done, failed)

    def append_quiet_many(
        self,
        datas: Sequence[bytes],
        listener: WriteListener,
        prefixes: Sequence[bytes] | None = None,
    ) -> None:
        """``append_quiet`` of each of ``datas`` (with its prefix, if given), in order."""
        if prefixes is None:
            for data in datas:
                self.append_quiet(data, listener)
        else:
            for data, prefix in zip(datas, prefixes, strict=True):
                self.append_quiet(data, listener, prefix)

    @property
    @abc.abstractmethod
    def length(self) -> int:
        """Bytes of data acknowledged so far."""

    @abc.abstractmethod
    def close_ledger(self) -> Deferred[None]:
        """Wait for pending adds, then seal the ledger at its LAC (CAS to CLOSED)."""


@dataclass(frozen=True)
class LedgerConfig:
    """How a new ledger is replicated."""

    ensemble_size: int = 1
    write_quorum: int = 1
    ack_quorum: int = 1
    custom: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ensemble_size >= self.write_quorum >= self.ack_quorum >= 1:
            raise ValueError(
                "need ensemble size >= write quorum >= ack quorum >= 1, got "
                f"E={self.ensemble_size} Qw={self.write_quorum} Qa={self.ack_quorum}"
            )


class LedgerClient(abc.ABC):
    """Creates, opens and deletes ledgers (BookKeeper's client)."""

    @abc.abstractmethod
    def create(self, config: LedgerConfig) -> Deferred[WriteHandle]:
        """Create a ledger with a fresh id on bookies chosen by the placement policy."""

    @abc.abstractmethod
    def open(self, ledger_id: int, *, recovery: bool = True) -> Deferred[ReadHandle]:
        """Open a ledger for reading. With ``recovery`` an open ledger is fenced, recovered and
        closed first (Rule 2); without it, a tailing reader reads up to the LAC."""

    @abc.abstractmethod
    def delete(self, ledger_id: int) -> Deferred[None]:
        """Delete the ledger's metadata, then tell its bookies (they GC it)."""

    @abc.abstractmethod
    def get_metadata(self, ledger_id: int) -> Deferred[LedgerMetadata]:
        """Return the current metadata (``NoSuchLedgerError`` if none)."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Close every bookie connection."""

    def storage_problem(self, ensemble_size: int) -> Deferred[str | None]:
        """Why a new ledger of ``ensemble_size`` bookies could not be created now (too few
        bookies take writes), or None; a client that cannot tell answers None."""
        return succeed(None)


# ---------------------------------------------------------------------------------------------
# Managed-ledger level
# ---------------------------------------------------------------------------------------------


class Position(NamedTuple):
    """A place in a managed ledger: (ledger id, entry id). Ordered.

    A named tuple, not a dataclass: positions are made and compared on every entry's path, and
    tuples do both at C speed."""

    ledger_id: int
    entry_id: int

    def __str__(self) -> str:
        return f"{self.ledger_id}:{self.entry_id}"


# Before the first entry of any log; a mark-delete here means nothing is acknowledged yet.
EARLIEST = Position(-1, -1)


class Entry(NamedTuple):
    """One stored unit of a managed ledger, with its broker entry metadata (a named tuple, as
    ``Position``, for the hot path)."""

    position: Position
    index: int  # offset of the entry's first message within the log (Kafka offset)
    num_messages: int
    publish_time_ms: int
    data: bytes

    @property
    def last_index(self) -> int:
        """The offset of the entry's last message."""
        return self.index + self.num_messages - 1


class InitialPosition(enum.Enum):
    EARLIEST = "earliest"
    LATEST = "latest"


@dataclass(frozen=True)
class ManagedLedgerConfig:
    """Per-log settings; defaults are Pulsar's."""

    ensemble_size: int = 1
    write_quorum: int = 1
    ack_quorum: int = 1
    max_entries_per_ledger: int = 50_000
    max_size_per_ledger_bytes: int = 2048 * 1024 * 1024
    max_ledger_rollover_time_s: float = 240 * 60
    min_ledger_rollover_time_s: float = 10 * 60
    cursor_mark_delete_rate_per_s: float = 1.0
    max_unacked_ranges_to_persist: int = 1000
    retention_time_s: float = 0.0  # keep consumed ledgers this long (0: delete when consumed)
    retention_size_bytes: int = 0


@dataclass(frozen=True)
class LedgerInfo:
    """One ledger of a managed ledger, as kept in the log's metadata."""

    ledger_id: int
    entries: int
    size: int
    first_index: int  # index of the ledger's first message
    messages: int
    first_publish_time_ms: int
    last_publish_time_ms: int


class Cursor(abc.ABC):
    """A position in a managed ledger that moves as entries are read and acknowledged.

    Durable cursors persist their mark-delete position and individually deleted ranges (rate
    limited; flushed on close), so after a crash acknowledged entries may come again only inside
    that window (at-least-once), never unacknowledged ones lost."""

    name: str
    durable: bool

    @property
    @abc.abstractmethod
    def read_position(self) -> Position:
        """The next position ``read`` returns."""

    @property
    @abc.abstractmethod
    def mark_delete_position(self) -> Position:
        """Everything at or below this is acknowledged."""

    @property
    def persisted_mark_delete_position(self) -> Position:
        """The mark-delete position as last made durable: after a crash the cursor resumes
        after this one. Equal to ``mark_delete_position`` unless a write is still due."""
        return self.mark_delete_position

    @abc.abstractmethod
    def individually_deleted(self) -> Sequence[tuple[Position, Position]]:
        """Acknowledged ranges above the mark-delete, as closed intervals, ascending."""

    @abc.abstractmethod
    def read(self, max_entries: int, *, wait: bool = False) -> Deferred[list[Entry]]:
        """Read up to ``max_entries`` from the read position, skipping acknowledged ones, and
        advance it. With ``wait`` and nothing to read, fire when an entry arrives (or with []
        when the cursor is closed or the read cancelled)."""

    @abc.abstractmethod
    def cancel_pending_read(self) -> None:
        """Fire a waiting ``read`` with []."""

    @abc.abstractmethod
    def mark_delete(self, position: Position) -> Deferred[None]:
        """Acknowledge everything up to ``position`` (cumulative). Never moves backwards."""

    @abc.abstractmethod
    def delete(self, positions: Sequence[Position]) -> Deferred[None]:
        """Acknowledge individual positions; the mark-delete advances over contiguous runs."""

    @abc.abstractmethod
    def is_deleted(self, position: Position) -> bool:
        """Whether ``position`` is acknowledged."""

    @abc.abstractmethod
    def seek(self, position: Position) -> None:
        """Move the read position (acknowledgements unchanged): for redelivery."""

    @abc.abstractmethod
    def reset(self, position: Position) -> Deferred[None]:
        """Move read and mark-delete so that ``position`` is the next entry read (may go back)."""

    @abc.abstractmethod
    def backlog(self) -> int:
        """Messages (not entries) not yet acknowledged."""

    @abc.abstractmethod
    def backlog_entries(self) -> int:
        """Entries not yet acknowledged."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Persist the state (durable) and stop; pending reads fire with []."""


class ManagedLedger(abc.ABC):
    """One named append-only log over a sequence of ledgers (see module docstring)."""

    name: str

    @abc.abstractmethod
    def append(
        self, data: bytes, num_messages: int = 1, publish_time_ms: int | None = None
    ) -> Deferred[Entry]:
        """Append one entry holding ``num_messages`` messages; fire with it once durable.

        Appends complete in order; the index of each entry follows the previous one's messages."""

    def append_then(
        self,
        data: bytes,
        on_done: Callable[[Entry, Any], object],
        on_failed: Callable[[Exception, Any], object],
        token: Any = None,
        num_messages: int = 1,
        publish_time_ms: int | None = None,
    ) -> None:
        """``append`` without a Deferred: exactly one of ``on_done(entry, token)`` and
        ``on_failed(error, token)`` is called, in the order of the appends (an append refused
        at once is failed before this returns); an exception they raise is logged, and the
        other completions still happen. This default rides on ``append``; implementations do
        better."""

        def done(entry: Entry) -> None:
            on_done(entry, token)

        def failed(f: Failure) -> None:
            on_failed(f.value, token)  # type: ignore[arg-type]

        def raised(f: Failure) -> None:
            logging.getLogger(__name__).error("append callback failed: %s", f.getTraceback())

        d = self.append(data, num_messages, publish_time_ms)
        d.addCallbacks(done, failed).addErrback(raised)

    def append_many(
        self,
        datas: Sequence[bytes],
        num_messages: Sequence[int] | None = None,
        publish_time_ms: int | None = None,
    ) -> Deferred[list[Entry]]:
        """Append the entries in order with one completion: fire with them once all are durable,
        or fail with the first failure (entries before it may then be durable). This default
        rides on ``append``; implementations do better."""
        counts = [1] * len(datas) if num_messages is None else list(num_messages)
        if len(counts) != len(datas):
            return fail(ValueError(f"{len(datas)} entries but {len(counts)} counts"))
        ds = [self.append(d, n, publish_time_ms) for d, n in zip(datas, counts, strict=True)]
        out: Deferred[list[Entry]] = gatherResults(ds, consumeErrors=True)
        return out.addErrback(lambda f: f.value.subFailure)

    @abc.abstractmethod
    def open_cursor(
        self, name: str, initial_position: InitialPosition = InitialPosition.LATEST
    ) -> Deferred[Cursor]:
        """Open (creating if needed) a durable cursor; an existing one keeps its position."""

    @abc.abstractmethod
    def new_non_durable_cursor(self, start: Position, name: str | None = None) -> Cursor:
        """A cursor kept only in memory whose next read is the first entry after ``start``
        (``EARLIEST`` for the beginning; ``last_confirmed`` for only new entries)."""

    @abc.abstractmethod
    def delete_cursor(self, name: str) -> Deferred[None]:
        """Remove a durable cursor and its persisted state."""

    @property
    @abc.abstractmethod
    def cursors(self) -> dict[str, Cursor]:
        """The open cursors by name."""

    @abc.abstractmethod
    def read(self, position: Position, max_entries: int) -> Deferred[list[Entry]]:
        """Read entries from ``position`` (inclusive) regardless of cursors."""

    @property
    @abc.abstractmethod
    def last_confirmed(self) -> Position:
        """The last durable entry (``EARLIEST``-like ``Position(first ledger, -1)`` if empty)."""

    @property
    @abc.abstractmethod
    def first_position(self) -> Position:
        """The first entry still stored."""

    @property
    @abc.abstractmethod
    def next_index(self) -> int:
        """The index the next appended message gets (= messages ever appended)."""

    @property
    @abc.abstractmethod
    def first_index(self) -> int:
        """The index of the first message still stored."""

    @property
    @abc.abstractmethod
    def ledgers(self) -> Sequence[LedgerInfo]:
        """The log's ledgers, oldest first."""

    @abc.abstractmethod
    def position_of_index(self, index: int) -> Deferred[Position | None]:
        """Return the position of the entry holding message ``index``; None if past the end or
        before the first stored message."""

    @abc.abstractmethod
    def index_of_position(self, position: Position) -> Deferred[int]:
        """Return the index of the first message of the entry at ``position``."""

    @abc.abstractmethod
    def position_of_time(self, timestamp_ms: int) -> Deferred[Position | None]:
        """Return the first entry published at or after ``timestamp_ms``; None if none."""

    @property
    @abc.abstractmethod
    def entries(self) -> int:
        """Entries stored."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Bytes stored."""

    @property
    @abc.abstractmethod
    def terminated(self) -> bool:
        """Whether the log was terminated."""

    @abc.abstractmethod
    def terminate(self) -> Deferred[Position]:
        """Refuse all further appends, durably; return the last position."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Wait for pending appends, close cursors and the current ledger."""

    @abc.abstractmethod
    def delete(self) -> Deferred[None]:
        """Close, then delete every ledger, cursor and the metadata."""


class ManagedLedgerFactory(abc.ABC):
    """Opens managed ledgers by name; one instance per broker process."""

    @abc.abstractmethod
    def open(self, name: str, config: ManagedLedgerConfig | None = None) -> Deferred[ManagedLedger]:
        """Open (creating if needed) the log. A log is opened once per factory: a second call
        returns the same instance. If its previous owner died, its last ledger is recovered
        (fenced) before the first append."""

    @abc.abstractmethod
    def exists(self, name: str) -> Deferred[bool]:
        """Whether a log of that name exists in the metadata store."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Deferred[list[str]]:
        """Names of the logs whose name starts with ``prefix``."""

    @abc.abstractmethod
    def delete(self, name: str) -> Deferred[None]:
        """Delete a log (opening it if needed)."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Close every open log and the ledger client."""

    def storage_problem(self, ensemble_size: int) -> Deferred[str | None]:
        """Why appends needing a new ledger of ``ensemble_size`` bookies would fail now, or
        None (``LedgerClient.storage_problem``); a factory that cannot tell answers None."""
        return succeed(None)

    def cache_stats(self) -> dict[str, int]:
        """The entry cache's figures for metrics: ``used_bytes``, ``max_bytes``, ``logs`` (with
        a cache), and the counters ``hits``, ``misses`` (entries read) and ``evictions``
        (times the byte budget made a cache give back entries); empty without a cache."""
        return {}
