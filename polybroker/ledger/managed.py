"""The managed ledger: one named append-only log over a sequence of ledgers (Pulsar's model).

Rule 1: appends complete in the order they were made. An append is sent to the current ledger
        only when that ledger is writable; while it rolls over (only once idle of pending adds)
        or is replaced after a failure, appends queue and are sent, in order, to the next one.
        Appends pending on a failed ledger are resent, in order, with the same index, to the
        new ledger; if no new ledger can be had, every pending and queued append fails, and so
        they do when that new ledger too fails before confirming any entry (the bookies take
        ledgers but refuse adds): the next append tries again, no loop of ledgers made and
        failed.
Rule 2: the ledger list lives in the metadata store at ``/managed-ledgers/<name>`` and changes
        only by compare-and-set; a lost CAS (or a fenced ledger) means another owner took the
        log: pending appends fail with ``ManagedLedgerFencedError`` and the log writes no more.
Rule 3: opening a log recovers (fences) its last ledger unless it was sealed by a clean close,
        then creates a new ledger before the first append (a ledger is never written twice).
Rule 4: every entry carries broker entry metadata (``entry_format``): publish time, index (the
        offset of its first message in the log) and message count.
Rule 5: a ledger is deleted only when every durable cursor's mark-delete passed it, never the
        current one, and only after the CAS that removes it from the list succeeded.

Internally entries are numbered by a sequence number ``seq``: the ledgers' entries laid end to
end. A position maps to a seq by a binary search over the ledgers; cursors keep their state in
seqs, so ranges of acknowledgements merge by integer arithmetic across ledger boundaries.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import itertools
import json
import logging
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, DeferredLock, fail, succeed
from twisted.python.failure import Failure

from polybroker.ledger import entry_format
from polybroker.ledger.api import (
    EARLIEST,
    Cursor,
    Entry,
    InitialPosition,
    LedgerClient,
    LedgerConfig,
    LedgerFencedError,
    LedgerInfo,
    ManagedLedger,
    ManagedLedgerClosedError,
    ManagedLedgerConfig,
    ManagedLedgerError,
    ManagedLedgerFactory,
    ManagedLedgerFencedError,
    ManagedLedgerTerminatedError,
    NoSuchLedgerError,
    Position,
    ReadHandle,
    WriteHandle,
)
from polybroker.ledger.cache import ENTRY_OVERHEAD as _CACHE_OVERHEAD
from polybroker.ledger.cache import EntryCache, EntryCacheManager
from polybroker.ledger.cursor import ROOT, ManagedCursorImpl, cursor_path
from polybroker.logs import Repeats
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE_BYTES = 256 * 1024 * 1024
FORMAT_VERSION = 1
# A log keeps in its cache only entries appended this recently (ms), read or not (Pulsar's
# managedLedgerCacheEvictionTimeThresholdMillis): a subscription that fell behind reads its
# backlog from the bookies instead of pinning it in memory.
DEFAULT_TAIL_CACHE_MS = 1000
# Reads that miss the cache fetch at most this many entries from a ledger in one request.
READ_BATCH = 100
# Sealed ledgers keep the index and time of every SPARSE_STEP-th entry (16 bytes per step).
SPARSE_STEP = 64

_pack_header = entry_format.HEADER.pack
_MAGIC, _VERSION, _HEADER_SIZE = entry_format.MAGIC, entry_format.VERSION, entry_format.HEADER_SIZE
_new = tuple.__new__  # builds a named tuple without the Python-level __new__ of namedtuple


def ledger_path(name: str) -> str:
    """The metadata path of a log."""
    return f"{ROOT}/{name}"


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..", "cursors") for p in parts):
        raise ValueError(f"invalid managed ledger name {name!r}")


class _State(enum.Enum):
    OPENING = "opening"
    OPEN = "open"  # the current ledger takes appends
    ROLLING = "rolling"  # waiting to be idle, closing, creating: appends queue
    NO_LEDGER = "no_ledger"  # creating a ledger failed; the next append tries again
    TERMINATED = "terminated"
    FENCED = "fenced"
    CLOSED = "closed"


_OPEN = _State.OPEN
_MAX_NUM_MESSAGES = entry_format.MAX_NUM_MESSAGES


class _Ledger:
    """What the log knows of one of its ledgers (a mutable ``LedgerInfo`` plus lookups)."""

    __slots__ = (
        "entries",
        "first_index",
        "first_time",
        "indexes",
        "last_time",
        "ledger_id",
        "messages",
        "sealed",
        "size",
        "start",
        "step",
        "times",
    )

    def __init__(
        self,
        ledger_id: int,
        start: int,
        first_index: int,
        *,
        entries: int = 0,
        size: int = 0,
        messages: int = 0,
        first_time: int = 0,
        last_time: int = 0,
        sealed: bool = False,
        in_memory: bool = False,
    ) -> None:
        self.ledger_id = ledger_id
        self.start = start  # seq of entry 0
        self.first_index = first_index
        self.entries = entries
        self.size = size
        self.messages = messages
        self.first_time = first_time
        self.last_time = last_time
        self.sealed = sealed
        # For ledgers written by this instance: the index of every entry (exact lookups and
        # backlogs with no reads; dropped when sealed if every entry holds one message, as
        # arithmetic then does) and the publish time of every ``step``-th entry (dense while
        # current; sparse once sealed, so a time lookup reads one window of entries at most).
        self.indexes: array[int] | None = array("q") if in_memory else None
        self.times: array[int] | None = array("q") if in_memory else None
        self.step = 1

    def compact(self) -> None:
        """Shrink the lookup arrays of a ledger that takes no more entries."""
        if self.times is not None and self.step == 1:
            self.times = self.times[::SPARSE_STEP]
            self.step = SPARSE_STEP
        if self.messages == self.entries:
            self.indexes = None

    def info(self) -> LedgerInfo:
        return LedgerInfo(
            self.ledger_id,
            self.entries,
            self.size,
            self.first_index,
            self.messages,
            self.first_time,
            self.last_time,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.ledger_id,
            "entries": self.entries,
            "size": self.size,
            "first_index": self.first_index,
            "messages": self.messages,
            "first_time": self.first_time,
            "last_time": self.last_time,
            "sealed": self.sealed,
        }


class _Group:
    """The one completion of the appends of an ``append_many``."""

    __slots__ = ("count", "d", "entries")

    def __init__(self, count: int) -> None:
        self.count = count
        self.entries: list[Entry] = []
        self.d: Deferred[list[Entry]] = Deferred()


# One append on its way to a ledger, told through ``on_done(entry, token)`` or
# ``on_failed(error, token)`` (``append_then``), or else, with on_done None, through its group (the
# token): a list indexed by these (a list is made several times faster than an object, and there
# is one per append). Index, size (stored bytes: header and data) and entry id (in the ledger it
# was last sent to) are set by ``_send``.
_A_DATA, _A_NUM, _A_TIME, _A_DONE, _A_FAILED, _A_TOKEN, _A_INDEX, _A_SIZE, _A_ENTRY = range(9)
_Add = list[Any]  # [data, num, time, on_done, on_failed, token, index, size, entry id]
AppendDone = Callable[[Entry, Any], object]
AppendFailed = Callable[[Exception, Any], object]


def _new_add(
    data: bytes,
    num: int,
    time: int,
    on_done: AppendDone | None,
    on_failed: AppendFailed | None,
    token: Any,
) -> _Add:
    """An append not sent yet."""
    return [data, num, time, on_done, on_failed, token, 0, 0, -1]


def _resolve(entry: Entry, d: Deferred[Entry]) -> None:
    d.callback(entry)


def _reject(error: Exception, d: Deferred[Entry]) -> None:
    d.errback(error)


def _fail_add(add: _Add, error: Exception) -> None:
    """Tell whoever waits that this append failed (a group hears only its first failure)."""
    if add[_A_DONE] is not None:
        try:
            add[_A_FAILED](error, add[_A_TOKEN])
        except Exception:
            log.exception("append failure callback failed")
        return
    group = add[_A_TOKEN]
    assert isinstance(group, _Group)
    if not group.d.called:
        group.d.errback(error)


def _decode(position: Position, raw: bytes) -> Entry:
    header, data = entry_format.decode(raw)
    return Entry(position, header.index, header.num_messages, header.publish_time_ms, data)


class ManagedLedgerImpl(ManagedLedger):
    """A managed ledger over a ``LedgerClient``; made and opened by ``ManagedLedgerFactoryImpl``."""

    def __init__(
        self,
        factory: ManagedLedgerFactoryImpl,
        name: str,
        config: ManagedLedgerConfig,
    ) -> None:
        self.name = name
        self.config = config
        self._factory = factory
        self._store: MetadataStore = factory.store
        self._client: LedgerClient = factory.client
        self._reactor = factory.reactor
        self._cache: EntryCache = factory.cache_manager.new_cache(name)
        self._state = _State.OPENING
        self._version = -1  # of the metadata node
        self._ledgers: list[_Ledger] = []
        self._ids: list[int] = []
        self._starts: list[int] = []
        self._next_seq = 0  # seq of the next confirmed entry
        self._next_index = 0  # index of the next confirmed message
        self._terminated_at: Position | None = None
        self._current: WriteHandle | None = None
        self._current_ledger: _Ledger | None = None
        self._created_at = 0.0
        self._young_until = 0.0  # a full ledger younger than this is not rolled yet
        self._sent_entries = 0
        self._sent_bytes = 0
        self._sent_index = 0
        self._pending: deque[_Add] = deque()
        self._queued: deque[_Add] = deque()
        self._accepting = True
        self._roll_timer: Any = None
        self._idle_waiters: list[Deferred[None]] = []
        self._meta_lock = DeferredLock()
        self._handles: dict[int, ReadHandle] = {}
        self._opening_handles: dict[int, list[Deferred[ReadHandle]]] = {}
        self._cursors: dict[str, ManagedCursorImpl] = {}
        self._waiting: list[ManagedCursorImpl] = []
        # (when, first seq) of each completion cached (``_trim_tail``).
        self._tail_marks: deque[tuple[float, int]] = deque()
        self._trimming = False
        self._trim_again = False
        self._reader_names = 0
        self._error: Exception | None = None
        self._closing: list[Deferred[None]] | None = None  # waiters while a close runs
        self._switching = False  # a _start_ledger runs
        self._young_failures = 0  # ledgers in a row that failed before their first entry
        # Every append retries, and a broker whose bookies refuse writes must not flood its log.
        self._no_ledger_repeats = Repeats(self._reactor.seconds)

    @property
    def config(self) -> ManagedLedgerConfig:
        """The config in force (the broker may replace it, e.g. when retention changes)."""
        return self._config

    @config.setter
    def config(self, config: ManagedLedgerConfig) -> None:
        self._config = config
        self._young_until = 0.0  # ``_is_full`` asks again under the new limits
        # Below these a ledger is never full (``_is_full``), whatever its age.
        self._max_entries = config.max_entries_per_ledger
        self._max_bytes = config.max_size_per_ledger_bytes

    # -- opening ---------------------------------------------------------------------------

    async def _open(self) -> None:
        """Load the metadata, recover the last ledger, load the cursors, start a ledger."""
        path = ledger_path(self.name)
        found = await self._store.get(path)
        if found is None or not found.value:
            doc: dict[str, Any] = {"version": FORMAT_VERSION, "ledgers": [], "next_index": 0}
            try:
                expected = -1 if found is None else found.stat.version
                stat = await self._store.put(path, self._encode(doc), expected)
            except BadVersionError as e:
                raise ManagedLedgerFencedError(f"{self.name}: created by another owner") from e
            self._version = stat.version
        else:
            try:
                doc = json.loads(found.value)
            except ValueError as e:
                raise ManagedLedgerError(f"{self.name}: unreadable metadata") from e
            self._version = found.stat.version
        try:
            self._load(doc)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ManagedLedgerError(f"{self.name}: unreadable ledger list: {e!r}") from e
        dropped = await self._recover_last()
        for name in await self._store.children(f"{path}/cursors"):
            node = await self._store.get(f"{path}/cursors/{name}")
            if node is None:
                continue
            cursor = ManagedCursorImpl.recover(self, node.value, node.stat.version)
            self._cursors[cursor.name] = cursor
        if self._terminated_at is not None:
            self._state = _State.TERMINATED
            self._accepting = False
            self._error = ManagedLedgerTerminatedError(f"{self.name} is terminated")
            await self._write_metadata()
        else:
            self._state = _State.ROLLING
            self._switching = True
            try:
                await self._start_ledger(None)
            finally:
                self._switching = False
        for ledger_id in dropped:
            self._delete_ledger_later(ledger_id)
        self._maybe_trim()

    def _load(self, doc: dict[str, Any]) -> None:
        seq = 0
        for item in doc.get("ledgers", []):
            ledger = _Ledger(
                int(item["id"]),
                seq,
                int(item["first_index"]),
                entries=int(item["entries"]),
                size=int(item["size"]),
                messages=int(item["messages"]),
                first_time=int(item["first_time"]),
                last_time=int(item["last_time"]),
                sealed=bool(item["sealed"]),
            )
            self._append_ledger(ledger)
            seq += ledger.entries
        self._next_seq = seq
        self._next_index = int(doc.get("next_index", 0))
        if self._ledgers:
            last = self._ledgers[-1]
            self._next_index = max(self._next_index, last.first_index + last.messages)
        terminated = doc.get("terminated")
        if terminated is not None:
            self._terminated_at = Position(int(terminated[0]), int(terminated[1]))

    async def _recover_last(self) -> list[int]:
        """Fence and read the end of the last ledger unless a clean close sealed it."""
        if not self._ledgers or self._ledgers[-1].sealed:
            return []
        last = self._ledgers[-1]
        handle = await self._client.open(last.ledger_id, recovery=True)
        lac = handle.last_add_confirmed
        if lac < 0:
            self._remove_last_ledger()
            await handle.close()
            return [last.ledger_id]
        self._handles[last.ledger_id] = handle
        raw = await handle.read(0, 0)
        first = entry_format.decode_header(raw[0])
        if lac > 0:
            raw = await handle.read(lac, lac)
        final = entry_format.decode_header(raw[0])
        last.entries = lac + 1
        last.size = handle.metadata.length
        last.first_index = first.index
        last.messages = final.index + final.num_messages - first.index
        last.first_time = first.publish_time_ms
        last.last_time = final.publish_time_ms
        last.sealed = True
        self._next_seq = last.start + last.entries
        self._next_index = max(self._next_index, last.first_index + last.messages)
        return []

    # -- ledger list -----------------------------------------------------------------------

    def _append_ledger(self, ledger: _Ledger) -> None:
        self._ledgers.append(ledger)
        self._ids.append(ledger.ledger_id)
        self._starts.append(ledger.start)

    def _remove_last_ledger(self) -> None:
        self._ledgers.pop()
        self._ids.pop()
        self._starts.pop()

    def _doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "ledgers": [ledger.to_json() for ledger in self._ledgers],
            "next_index": self._next_index,
        }
        if self._terminated_at is not None:
            doc["terminated"] = [self._terminated_at.ledger_id, self._terminated_at.entry_id]
        return doc

    @staticmethod
    def _encode(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc, separators=(",", ":")).encode()

    async def _write_metadata(self) -> None:
        """CAS the ledger list; a lost CAS fences the log (Rule 2)."""
        await self._meta_lock.acquire()
        try:
            try:
                stat = await self._store.put(
                    ledger_path(self.name), self._encode(self._doc()), self._version
                )
            except BadVersionError as e:
                error = ManagedLedgerFencedError(f"{self.name}: another owner changed the log")
                self._fence(error)
                raise error from e
            self._version = stat.version
        finally:
            self._meta_lock.release()

    # -- appending -------------------------------------------------------------------------

    def append(
        self, data: bytes, num_messages: int = 1, publish_time_ms: int | None = None
    ) -> Deferred[Entry]:
        d: Deferred[Entry] = Deferred()
        self.append_then(data, _resolve, _reject, d, num_messages, publish_time_ms)
        return d

    def append_then(
        self,
        data: bytes,
        on_done: AppendDone,
        on_failed: AppendFailed,
        token: Any = None,
        num_messages: int = 1,
        publish_time_ms: int | None = None,
    ) -> None:
        """``append`` without a Deferred (see ``ManagedLedger.append_then``)."""
        if not self._accepting:
            on_failed(self._refusal(), token)
            return
        if not 1 <= num_messages <= _MAX_NUM_MESSAGES:
            on_failed(ValueError(f"num_messages must be >= 1, got {num_messages}"), token)
            return
        if publish_time_ms is None:
            publish_time_ms = int(self._reactor.seconds() * 1000)
        sent = self._sent_entries
        if (
            self._state is _OPEN
            and not self._queued
            and (
                (sent < self._max_entries and self._sent_bytes < self._max_bytes)
                or self._reactor.seconds() < self._young_until
            )
        ):
            # The common case of ``_enqueue``: ``_send`` inlined.
            handle = self._current
            assert handle is not None
            index = self._sent_index
            self._sent_index = index + num_messages
            size = _HEADER_SIZE + len(data)
            self._sent_entries = sent + 1
            self._sent_bytes += size
            self._pending.append(
                [data, num_messages, publish_time_ms, on_done, on_failed, token, index, size, sent]
            )
            head = _pack_header(_MAGIC, _VERSION, 0, publish_time_ms, index, num_messages)
            handle.append_quiet(data, self, head)
        else:
            self._enqueue(_new_add(data, num_messages, publish_time_ms, on_done, on_failed, token))

    def append_many(
        self,
        datas: Sequence[bytes],
        num_messages: Sequence[int] | None = None,
        publish_time_ms: int | None = None,
    ) -> Deferred[list[Entry]]:
        """Append the entries in order, as many ``append`` calls would, with one completion
        (and no Deferred per entry): fire with the entries once all are durable, or fail with
        the first failure (entries before it may then be durable, as separate appends would)."""
        if not self._accepting:
            return fail(self._refusal())
        if num_messages is None:
            num_messages = [1] * len(datas)
        elif len(num_messages) != len(datas):
            return fail(ValueError(f"{len(datas)} entries but {len(num_messages)} counts"))
        for num in num_messages:
            if not 1 <= num <= entry_format.MAX_NUM_MESSAGES:
                return fail(ValueError(f"num_messages must be >= 1, got {num}"))
        if publish_time_ms is None:
            publish_time_ms = int(self._reactor.seconds() * 1000)
        group = _Group(len(datas))
        if not datas:
            group.d.callback([])
            return group.d
        adds = [
            _new_add(data, num, publish_time_ms, None, None, group)
            for data, num in zip(datas, num_messages, strict=True)
        ]
        sent = 0
        if self._state is _State.OPEN and not self._queued:
            sent = self._send_many(adds)
        enqueue = self._enqueue
        for add in itertools.islice(adds, sent, None):
            if not self._accepting:
                # Refused half-way (fenced by a synchronous failure): the rest never goes.
                if not group.d.called:
                    group.d.errback(self._refusal())
                break
            enqueue(add)
        return group.d

    def _enqueue(self, add: _Add) -> None:
        """Send ``add`` to the current ledger, or queue it behind a rollover (Rule 1)."""
        state = self._state
        if state is _State.OPEN and not self._queued:
            if self._is_full():
                self._queued.append(add)
                self._begin_roll()
            else:
                self._send(add)
        else:
            self._queued.append(add)
            if state is _State.NO_LEDGER:
                self._state = _State.ROLLING
                self._switch(None)

    def _refusal(self) -> Exception:
        if self._state is _State.CLOSED:
            return ManagedLedgerClosedError(f"{self.name} is closed")
        if self._error is not None:
            return self._error
        if self._terminated_at is not None:
            return ManagedLedgerTerminatedError(f"{self.name} is terminated")
        return ManagedLedgerClosedError(f"{self.name} is closing")

    def _is_full(self) -> bool:
        config = self.config
        if self._sent_entries == 0:
            return False  # an empty ledger is never full, whatever the limits say
        if (
            self._sent_entries < config.max_entries_per_ledger
            and self._sent_bytes < config.max_size_per_ledger_bytes
        ):
            return False
        age = self._reactor.seconds() - self._created_at
        if age >= config.min_ledger_rollover_time_s:
            return True
        # Full but too young to roll: until then ``append`` need not ask again.
        self._young_until = self._created_at + config.min_ledger_rollover_time_s
        return False

    def _send(self, add: _Add) -> None:
        handle = self._current
        assert handle is not None
        index = add[_A_INDEX] = self._sent_index
        num = add[_A_NUM]
        self._sent_index = index + num
        data = add[_A_DATA]
        # entry_format.encode without its checks: ``append`` checked the fields. The header
        # goes as the entry's prefix: the ledger copies the data once, into its record.
        add[_A_SIZE] = size = _HEADER_SIZE + len(data)
        # The log is the only writer of its ledgers: entry ids are the sends, counted from 0.
        add[_A_ENTRY] = self._sent_entries
        self._sent_entries += 1
        self._sent_bytes += size
        self._pending.append(add)
        handle.append_quiet(data, self, _pack_header(_MAGIC, _VERSION, 0, add[_A_TIME], index, num))

    def _send_many(self, adds: list[_Add]) -> int:
        """``_send`` the first of ``adds`` while the current ledger is surely not full (the
        rest go by ``_enqueue``), with one call to the ledger; return how many were sent."""
        handle = self._current
        assert handle is not None
        pending_append = self._pending.append
        index, entry_id, nbytes = self._sent_index, self._sent_entries, self._sent_bytes
        max_entries, max_bytes = self._max_entries, self._max_bytes
        magic, version = _MAGIC, _VERSION
        heads: list[bytes] = []
        datas: list[bytes] = []
        for add in adds:
            if entry_id >= max_entries or nbytes >= max_bytes:
                break
            add[_A_INDEX] = index
            head = _pack_header(magic, version, 0, add[_A_TIME], index, add[_A_NUM])
            index += add[_A_NUM]
            add[_A_SIZE] = size = _HEADER_SIZE + len(add[_A_DATA])
            add[_A_ENTRY] = entry_id
            entry_id += 1
            nbytes += size
            pending_append(add)
            heads.append(head)
            datas.append(add[_A_DATA])
        self._sent_index, self._sent_entries, self._sent_bytes = index, entry_id, nbytes
        if datas:
            handle.append_quiet_many(datas, self, heads)
        return len(datas)

    # The ``WriteListener`` of the current ledger.

    def adds_done(self, handle: WriteHandle, last_entry_id: int) -> None:
        """The current ledger completed every add up to ``last_entry_id``."""
        pending = self._pending
        if handle is not self._current or not pending or pending[0][_A_ENTRY] > last_entry_id:
            return  # an answer from a ledger this log already gave up, or nothing new
        ledger = self._current_ledger
        assert ledger is not None
        assert ledger.indexes is not None
        assert ledger.times is not None
        lid = ledger.ledger_id
        cache = self._cache
        seq = self._next_seq
        size = messages = 0
        index_of, time_of = ledger.indexes.append, ledger.times.append
        if ledger.entries == 0:
            ledger.first_time = pending[0][_A_TIME]
        adds: list[_Add] = []
        entries: list[Entry] = []
        add_done, entry_done = adds.append, entries.append
        popleft = pending.popleft
        # Record every completed entry first, then tell the callers: whatever their callbacks
        # do (append, read, close) sees the log with all of them.
        # The cache's columns are made here, as the adds are walked (``EntryCache.put_run``).
        ints: list[int] = []
        datas: list[bytes] = []
        ints_done, data_done = ints.extend, datas.append
        before = cache.put_bytes
        t = 0
        # The pending adds are of consecutive entry ids (sent in order, dropped together).
        for _ in range(min(len(pending), last_entry_id - pending[0][_A_ENTRY] + 1)):
            a = popleft()
            data, num, t, _, _, _, index, asize, eid = a
            entry_done(_new(Entry, (_new(Position, (lid, eid)), index, num, t, data)))
            ints_done((lid, eid, index, num, t, before))
            data_done(data)
            before += len(data) + _CACHE_OVERHEAD
            add_done(a)
            index_of(index)
            time_of(t)
            size += asize
            messages += num
        cache.put_run(seq, ints, datas, before)
        seq += len(datas)
        ledger.entries += len(adds)
        self._young_failures = 0
        ledger.size += size
        ledger.messages += messages
        ledger.last_time = t
        self._next_seq = seq
        self._next_index += messages
        self._trim_tail(seq - len(adds))
        for a, entry in zip(adds, entries, strict=True):
            on_done = a[_A_DONE]
            if on_done is not None:
                try:
                    on_done(entry, a[_A_TOKEN])
                except Exception:
                    # One caller's bug must not stop the completions of the others.
                    log.exception("%s: append callback failed", self.name)
                continue
            group = a[_A_TOKEN]
            group.entries.append(entry)
            if len(group.entries) == group.count and not group.d.called:
                group.d.callback(group.entries)
        if self._waiting and not getattr(handle, "completing", False):
            # A group the bookies acknowledged together wakes readers once, after it
            # (``_group_done``), so a tailing read takes the whole group at once.
            self._wake_readers()
        if not self._pending:
            if self._state is _State.ROLLING and self._current is handle:
                self._switch(handle)
            elif self._state is _State.OPEN and self._accepting and self._is_full():
                self._begin_roll()
            self._check_idle()

    def _trim_tail(self, first_seq: int) -> None:
        """Keep only the entries cached within the tail window, whoever has read them
        (entries numbered from ``first_seq`` were cached just now)."""
        now = self._reactor.seconds()
        marks = self._tail_marks
        marks.append((now, first_seq))
        cutoff = now - self._factory.tail_cache_ms / 1000.0
        if marks[0][0] >= cutoff:
            return  # nothing cached has aged out
        while marks[0][0] < cutoff:
            marks.popleft()
        self._cache.evict_before(marks[0][1])

    def adds_failed(self, handle: WriteHandle, error: Exception) -> None:
        """The current ledger failed: resend what is pending to a new one (Rule 1)."""
        if handle is not self._current:
            return
        if isinstance(error, LedgerFencedError):
            self._fence(ManagedLedgerFencedError(f"{self.name}: ledger fenced by another owner"))
            return
        ledger = self._current_ledger
        young = ledger is not None and ledger.ledger_id == handle.ledger_id and not ledger.entries
        self._young_failures = self._young_failures + 1 if young else 0
        # Everything not yet confirmed goes back, in order, in front of what was queued.
        self._queued.extendleft(reversed(self._pending))
        self._pending.clear()
        self._sent_index = self._next_index
        self._current = None
        self._state = _State.ROLLING
        self._close_quietly(handle)
        if self._young_failures > 1:
            # A second ledger in a row failed before confirming anything: the bookies take
            # ledgers but refuse every add. As when no ledger can be made, what waits fails
            # and the next append tries one more ledger (until one confirms an entry), rather
            # than ledgers made and failed in a loop.
            self._no_ledger(error)
            return
        log.warning(
            "ledger %d of %s failed (%s); resending %d appends to a new ledger",
            handle.ledger_id,
            self.name,
            error,
            len(self._queued),
        )
        self._switch(None)

    def _begin_roll(self) -> None:
        """Roll to a new ledger as soon as the current one is idle of pending adds."""
        self._state = _State.ROLLING
        if not self._pending:
            self._switch(self._current)

    def _check_roll_time(self) -> None:
        self._roll_timer = None
        if self._state is not _State.OPEN or not self._accepting:
            return  # closing or terminating: the ledger is sealed, not rolled
        if self._sent_entries == 0:
            self._arm_roll_timer(self.config.max_ledger_rollover_time_s)
            return
        self._begin_roll()

    def _arm_roll_timer(self, delay: float) -> None:
        if self._roll_timer is not None and self._roll_timer.active():
            self._roll_timer.cancel()
        self._roll_timer = self._reactor.callLater(max(delay, 0.0), self._check_roll_time)

    def _switch(self, old: WriteHandle | None) -> None:
        """Start ``_start_ledger`` unless one runs (callbacks may ask for it twice)."""
        if self._switching:
            return
        self._switching = True

        def done(result: object) -> None:
            self._switching = False
            if isinstance(result, Failure):
                log.error("%s: %s", self.name, result.getTraceback())
                return
            # Only now, with the flag down, may the sends below ask for the next rollover.
            self._send_queued()

        Deferred.fromCoroutine(self._start_ledger(old)).addBoth(done)

    def _send_queued(self) -> None:
        """Send what queued to the current ledger, in order, while it takes entries."""
        queued, handle = self._queued, self._current
        while queued and self._state is _State.OPEN and self._current is handle:
            if self._is_full():
                self._begin_roll()
                break
            self._send(queued.popleft())
        self._maybe_trim()
        self._check_idle()

    async def _start_ledger(self, old: WriteHandle | None) -> None:
        """Close ``old`` (idle), create the next ledger and CAS the list (run by ``_switch``,
        which then sends what queued)."""
        if old is not None:
            try:
                await old.close_ledger()
            except LedgerFencedError:
                self._fence(ManagedLedgerFencedError(f"{self.name}: ledger fenced on close"))
                return
            except Exception as e:
                # Its confirmed entries are recorded in our list; readers recover it.
                log.warning("closing ledger %d of %s failed: %s", old.ledger_id, self.name, e)
                sealed = False
            else:
                sealed = True
            self._current = None
        else:
            sealed = False
        if self._state is not _State.ROLLING:
            return
        previous = self._current_ledger
        self._current_ledger = None
        dropped: list[int] = []
        if previous is not None:
            previous.sealed = sealed
            previous.compact()
            if previous.entries == 0 and self._ledgers and self._ledgers[-1] is previous:
                self._remove_last_ledger()
                dropped.append(previous.ledger_id)
        cfg = self.config
        try:
            handle = await self._client.create(
                LedgerConfig(
                    cfg.ensemble_size,
                    cfg.write_quorum,
                    cfg.ack_quorum,
                    custom={"managed-ledger": self.name},
                )
            )
        except Exception as e:
            self._no_ledger(e)
            return
        if self._state is not _State.ROLLING:
            self._close_quietly(handle)
            self._delete_ledger_later(handle.ledger_id)
            return
        ledger = _Ledger(handle.ledger_id, self._next_seq, self._next_index, in_memory=True)
        self._append_ledger(ledger)
        try:
            await self._write_metadata()
        except Exception as e:
            self._remove_last_ledger()
            self._close_quietly(handle)
            self._delete_ledger_later(handle.ledger_id)
            if not isinstance(e, ManagedLedgerFencedError):
                self._no_ledger(e)
            return
        for ledger_id in dropped:
            self._delete_ledger_later(ledger_id)
        self._current = handle
        if hasattr(handle, "after_completions"):
            handle.after_completions = self._group_done
        self._current_ledger = ledger
        self._created_at = self._reactor.seconds()
        self._young_until = 0.0
        self._no_ledger_repeats.reset()  # a later failure is news again
        self._sent_entries = 0
        self._sent_bytes = 0
        self._sent_index = self._next_index
        self._arm_roll_timer(cfg.max_ledger_rollover_time_s)
        if self._state is _State.ROLLING:
            self._state = _State.OPEN

    def _no_ledger(self, error: Exception) -> None:
        """No ledger to write to: fail what waits; the next append tries again."""
        more = self._no_ledger_repeats.news(str(error))
        if more is not None:
            log.warning("no ledger for %s: %s%s", self.name, error, more)
        if self._state is _State.ROLLING:
            self._state = _State.NO_LEDGER
        self._fail_queued(error)
        self._check_idle()

    def _fail_queued(self, error: Exception) -> None:
        adds = list(self._pending) + list(self._queued)
        self._pending.clear()
        self._queued.clear()
        for a in adds:
            _fail_add(a, error)

    def _fence(self, error: Exception) -> None:
        if self._state in (_State.FENCED, _State.CLOSED):
            return
        log.warning("%s: %s", self.name, error)
        self._state = _State.FENCED
        self._error = error
        self._accepting = False
        handle, self._current = self._current, None
        if handle is not None:
            self._close_quietly(handle)
        self._fail_queued(error)
        self._cancel_roll_timer()
        self._check_idle()

    def _cancel_roll_timer(self) -> None:
        if self._roll_timer is not None and self._roll_timer.active():
            self._roll_timer.cancel()
        self._roll_timer = None

    def _close_quietly(self, handle: ReadHandle) -> None:
        handle.close().addErrback(lambda f: None)

    def _delete_ledger_later(self, ledger_id: int) -> None:
        handle = self._handles.pop(ledger_id, None)
        if handle is not None:
            self._close_quietly(handle)

        def failed(f: Failure) -> None:
            if not f.check(NoSuchLedgerError):
                log.warning("deleting ledger %d of %s failed: %s", ledger_id, self.name, f.value)

        self._client.delete(ledger_id).addErrback(failed)

    def _run(self, coro: Any) -> None:
        d = Deferred.fromCoroutine(coro)
        d.addErrback(lambda f: log.error("%s: %s", self.name, f.getTraceback()))

    def _idle(self) -> Deferred[None]:
        """Fire once no append is pending or queued and no rollover runs."""
        d: Deferred[None] = Deferred()
        self._idle_waiters.append(d)
        self._check_idle()
        return d

    def _check_idle(self) -> None:
        if self._pending or self._queued or self._state is _State.ROLLING:
            return
        waiters, self._idle_waiters = self._idle_waiters, []
        for d in waiters:
            d.callback(None)

    # -- seq <-> position ------------------------------------------------------------------

    def _position(self, seq: int) -> Position:
        """The position of entry ``seq`` (past the end: the next position in the last ledger)."""
        starts = self._starts
        if not starts:
            return EARLIEST
        i = bisect_right(starts, seq) - 1
        if i < 0:
            return Position(self._ids[0], -1)
        return Position(self._ids[i], seq - starts[i])

    def _ledger_end(self, i: int) -> int:
        """One past the last seq of ledger ``i`` as far as appends completed."""
        ledger = self._ledgers[i]
        if ledger is self._current_ledger:
            return self._next_seq
        return ledger.start + ledger.entries

    def _floor(self, position: Position) -> int:
        """The seq of the last entry at or before ``position`` (``first - 1`` if none)."""
        ids = self._ids
        if not ids:
            return self._next_seq - 1
        i = bisect_right(ids, position.ledger_id) - 1
        if i < 0:
            return self._starts[0] - 1
        end = self._ledger_end(i)
        if ids[i] < position.ledger_id:
            return end - 1
        return min(self._starts[i] + position.entry_id, end - 1, self._next_seq - 1)

    def _ceil(self, position: Position) -> int:
        """The seq of the first entry at or after ``position`` (the next seq if none)."""
        ids = self._ids
        i = bisect_left(ids, position.ledger_id)
        if i == len(ids):
            return self._next_seq
        if ids[i] > position.ledger_id or position.entry_id < 0:
            return self._starts[i]
        return min(self._starts[i] + position.entry_id, self._ledger_end(i), self._next_seq)

    @property
    def _first_seq(self) -> int:
        return self._starts[0] if self._starts else self._next_seq

    def _ledger_of(self, seq: int) -> int:
        return bisect_right(self._starts, seq) - 1

    def _index_hint(self, seq: int) -> int:
        """The index of entry ``seq``: exact for ledgers written by this instance and for
        ledgers of single-message entries, interpolated otherwise (used only for backlogs)."""
        if seq >= self._next_seq:
            return self._next_index
        i = self._ledger_of(max(seq, self._first_seq))
        if i < 0:
            return self._next_index
        ledger = self._ledgers[i]
        e = max(seq - ledger.start, 0)
        if ledger.messages == ledger.entries or ledger.entries == 0:
            return ledger.first_index + e
        if ledger.indexes is not None and e < len(ledger.indexes):
            return ledger.indexes[e]
        return ledger.first_index + e * ledger.messages // ledger.entries

    # -- reading ---------------------------------------------------------------------------

    def _handle(self, i: int) -> Deferred[ReadHandle]:
        ledger = self._ledgers[i]
        if ledger is self._current_ledger and self._current is not None:
            return succeed(self._current)
        ledger_id = ledger.ledger_id
        handle = self._handles.get(ledger_id)
        if handle is not None:
            return succeed(handle)
        d: Deferred[ReadHandle] = Deferred()
        waiters = self._opening_handles.get(ledger_id)
        if waiters is not None:
            waiters.append(d)
            return d
        waiters = self._opening_handles[ledger_id] = [d]

        def opened(handle: ReadHandle) -> None:
            self._handles[ledger_id] = handle
            for w in self._opening_handles.pop(ledger_id, waiters):
                w.callback(handle)

        def failed(f: Failure) -> None:
            for w in self._opening_handles.pop(ledger_id, waiters):
                w.errback(f)

        # Older ledgers are sealed, or were given up after a failure: a recovery open closes
        # the latter so that every confirmed entry is readable.
        self._client.open(ledger_id, recovery=True).addCallbacks(opened, failed)
        return d

    def _read_seqs(self, seqs: Sequence[int]) -> Deferred[list[Entry]]:
        """Return the entries numbered ``seqs`` (ascending, all confirmed), cache first."""
        cache = self._cache
        out: list[Entry | None] = []
        missing = 0
        for s in seqs:
            e = cache.get(s)
            out.append(e)
            if e is None:
                missing += 1
        cache.count_reads(len(out) - missing, missing)
        if not missing:
            return succeed(out)  # type: ignore[arg-type]
        return Deferred.fromCoroutine(self._fill(list(seqs), out))

    async def _fill(self, seqs: list[int], out: list[Entry | None]) -> list[Entry]:
        k = 0
        while k < len(seqs):
            if out[k] is not None:
                k += 1
                continue
            i = self._ledger_of(seqs[k])
            if i < 0 or seqs[k] >= self._ledger_end(i):
                raise ManagedLedgerError(f"{self.name}: entry {seqs[k]} is no longer stored")
            start = self._starts[i]
            end = self._ledger_end(i)
            # A run of consecutive missing seqs inside one ledger is one read.
            j = k
            while (
                j + 1 < len(seqs)
                and out[j + 1] is None
                and seqs[j + 1] == seqs[j] + 1
                and seqs[j + 1] < end
                and j + 1 - k < READ_BATCH
            ):
                j += 1
            ledger_id = self._ids[i]
            handle = await self._handle(i)
            raws = await handle.read(seqs[k] - start, seqs[j] - start)
            for n, raw in enumerate(raws):
                out[k + n] = _decode(Position(ledger_id, seqs[k] - start + n), raw)
            k = j + 1
        return out  # type: ignore[return-value]

    def _read_one(self, seq: int) -> Deferred[Entry]:
        return self._read_seqs([seq]).addCallback(lambda entries: entries[0])

    def read(self, position: Position, max_entries: int) -> Deferred[list[Entry]]:
        if self._state is _State.CLOSED:
            return fail(ManagedLedgerClosedError(f"{self.name} is closed"))
        first = max(self._ceil(position), self._first_seq)
        last = min(first + max(max_entries, 0), self._next_seq)
        return self._read_seqs(range(first, last))

    def _group_done(self) -> None:
        """The ledger client finished a group of completions (see ``adds_done``)."""
        if self._waiting:
            self._wake_readers()

    def _wake_readers(self) -> None:
        waiting, self._waiting = self._waiting, []
        for cursor in waiting:
            cursor._wake()

    def _park(self, cursor: ManagedCursorImpl) -> None:
        self._waiting.append(cursor)

    def _unpark(self, cursor: ManagedCursorImpl) -> None:
        with contextlib.suppress(ValueError):
            self._waiting.remove(cursor)

    def _readers_moved(self) -> None:
        """Drop cached entries behind the slowest cursor's read position."""
        if not len(self._cache):
            return
        slowest = min((c._read for c in self._cursors.values()), default=self._next_seq)
        self._cache.evict_before(slowest)

    # -- cursors ---------------------------------------------------------------------------

    def open_cursor(
        self, name: str, initial_position: InitialPosition = InitialPosition.LATEST
    ) -> Deferred[Cursor]:
        if self._state in (_State.CLOSED, _State.FENCED):
            return fail(self._refusal())
        existing = self._cursors.get(name)
        if existing is not None and existing.durable:
            return succeed(existing)
        return Deferred.fromCoroutine(self._open_cursor(name, initial_position))

    async def _open_cursor(self, name: str, initial: InitialPosition) -> Cursor:
        path = cursor_path(self.name, name)
        node = await self._store.get(path)
        existing = self._cursors.get(name)
        if existing is not None and existing.durable:
            return existing
        if node is not None:
            cursor = ManagedCursorImpl.recover(self, node.value, node.stat.version)
        else:
            md = self._first_seq - 1 if initial is InitialPosition.EARLIEST else self._next_seq - 1
            cursor = ManagedCursorImpl(self, name, durable=True, mark_delete=md)
            try:
                await cursor._create()
            except BadVersionError:
                # Opened twice at once: the first open made it.
                existing = self._cursors.get(name)
                if existing is not None and existing.durable:
                    return existing
                raise
        existing = self._cursors.get(name)
        if existing is not None and existing.durable:
            return existing
        self._cursors[name] = cursor
        return cursor

    def new_non_durable_cursor(self, start: Position, name: str | None = None) -> Cursor:
        if name is None:
            self._reader_names += 1
            name = f"non-durable-{self._reader_names}"
        md = self._first_seq - 1 if start.ledger_id < 0 else self._floor(start)
        cursor = ManagedCursorImpl(self, name, durable=False, mark_delete=md)
        self._cursors[name] = cursor
        return cursor

    def delete_cursor(self, name: str) -> Deferred[None]:
        return Deferred.fromCoroutine(self._delete_cursor(name))

    async def _delete_cursor(self, name: str) -> None:
        cursor = self._cursors.pop(name, None)
        if cursor is not None:
            cursor._stop()
        # Deleting a cursor that is gone already is not an error (the broker may retry).
        with contextlib.suppress(NotFoundError):
            await self._store.delete(cursor_path(self.name, name))
        self._maybe_trim()

    def _cursor_closed(self, cursor: ManagedCursorImpl) -> None:
        if self._cursors.get(cursor.name) is cursor:
            del self._cursors[cursor.name]
        self._unpark(cursor)

    @property
    def cursors(self) -> dict[str, Cursor]:
        return dict(self._cursors)

    # -- trimming consumed ledgers ---------------------------------------------------------

    def _maybe_trim(self) -> None:
        """Delete ledgers every durable cursor passed (Rule 5), outside retention."""
        if self._state not in (_State.OPEN, _State.ROLLING, _State.TERMINATED):
            return
        if self._trimming:
            self._trim_again = True
            return
        if self._trimmable() == 0:
            return
        self._trimming = True
        self._run(self._trim())

    def _md_advanced(self, md: int) -> None:
        """A durable cursor's mark-delete moved to ``md``: trim if it left the first ledger."""
        if len(self._ledgers) > 1:
            first = self._ledgers[0]
            if first is not self._current_ledger and md >= first.start + first.entries - 1:
                self._maybe_trim()

    def _trimmable(self) -> int:
        slowest = min(
            (c._md for c in self._cursors.values() if c.durable),
            default=self._next_seq - 1,
        )
        cfg = self.config
        now_ms = int(self._reactor.seconds() * 1000)
        total = sum(ledger.size for ledger in self._ledgers)
        n = 0
        for ledger in self._ledgers:
            if ledger is self._current_ledger or ledger.start + ledger.entries - 1 > slowest:
                break
            if ledger.entries == 0 and ledger is self._ledgers[-1]:
                break
            keep_time = cfg.retention_time_s < 0 or (
                now_ms - ledger.last_time < cfg.retention_time_s * 1000
            )
            keep_size = cfg.retention_size_bytes < 0 or (
                total - ledger.size < cfg.retention_size_bytes
            )
            if keep_time or keep_size:
                break
            total -= ledger.size
            n += 1
        return n

    async def _trim(self) -> None:
        try:
            while True:
                self._trim_again = False
                n = self._trimmable()
                if n == 0:
                    return
                removed = self._ledgers[:n]
                self._ledgers = self._ledgers[n:]
                self._ids = self._ids[n:]
                self._starts = self._starts[n:]
                try:
                    await self._write_metadata()
                except Exception:
                    # Put them back in front (a rollover may have added a ledger meanwhile).
                    self._ledgers = removed + self._ledgers
                    self._ids = [x.ledger_id for x in removed] + self._ids
                    self._starts = [x.start for x in removed] + self._starts
                    raise
                self._cache.evict_before(self._first_seq)
                for ledger in removed:
                    self._delete_ledger_later(ledger.ledger_id)
                if not self._trim_again:
                    return
        finally:
            self._trimming = False

    # -- lookups ---------------------------------------------------------------------------

    def position_of_index(self, index: int) -> Deferred[Position | None]:
        if index < self.first_index or index >= self._next_index:
            return succeed(None)
        i = bisect_right(self._ledgers, index, key=lambda led: led.first_index) - 1
        # Skip back over empty ledgers that share the next one's first index.
        while i > 0 and self._ledger_end(i) == self._starts[i]:
            i -= 1
        ledger = self._ledgers[i]
        count = self._ledger_end(i) - ledger.start
        if ledger.messages == ledger.entries:
            return succeed(Position(ledger.ledger_id, index - ledger.first_index))
        if ledger.indexes is not None and len(ledger.indexes) >= count:
            e = bisect_right(ledger.indexes, index, 0, count) - 1
            return succeed(Position(ledger.ledger_id, e))
        return Deferred.fromCoroutine(self._search(i, count, index, by_time=False))

    async def _search(self, i: int, count: int, target: int, *, by_time: bool) -> Position | None:
        """Binary search ledger ``i`` by reading entries: the last entry whose index is <=
        ``target``, or (``by_time``) the first entry published at or after ``target``."""
        ledger = self._ledgers[i]
        lo, hi = 0, count - 1
        if by_time:
            found = count
            while lo <= hi:
                mid = (lo + hi) // 2
                entry = await self._read_one(ledger.start + mid)
                if entry.publish_time_ms >= target:
                    found, hi = mid, mid - 1
                else:
                    lo = mid + 1
            return Position(ledger.ledger_id, found) if found < count else None
        found = 0
        while lo <= hi:
            mid = (lo + hi) // 2
            entry = await self._read_one(ledger.start + mid)
            if entry.index <= target:
                found, lo = mid, mid + 1
            else:
                hi = mid - 1
        return Position(ledger.ledger_id, found)

    async def _scan_time(self, i: int, lo: int, hi: int, target: int) -> Position | None:
        """The first of entries lo..hi of ledger ``i`` published at or after ``target``,
        read in one request."""
        ledger = self._ledgers[i]
        entries = await self._read_seqs(range(ledger.start + lo, ledger.start + hi + 1))
        for n, entry in enumerate(entries):
            if entry.publish_time_ms >= target:
                return Position(ledger.ledger_id, lo + n)
        return None

    def index_of_position(self, position: Position) -> Deferred[int]:
        seq = self._ceil(position)
        if seq >= self._next_seq:
            return succeed(self._next_index)
        seq = max(seq, self._first_seq)
        ledger = self._ledgers[self._ledger_of(seq)]
        e = seq - ledger.start
        if ledger.messages == ledger.entries:
            return succeed(ledger.first_index + e)
        if ledger.indexes is not None and e < len(ledger.indexes):
            return succeed(ledger.indexes[e])
        cached = self._cache.get(seq)
        if cached is not None:
            return succeed(cached.index)
        return self._read_one(seq).addCallback(lambda entry: entry.index)

    def position_of_time(self, timestamp_ms: int) -> Deferred[Position | None]:
        # Publish times are taken as non-decreasing along the log (the broker stamps them).
        # Only the last ledger can be empty (others are dropped when empty), and its times
        # say nothing.
        n = len(self._ledgers)
        if n and self._ledger_end(n - 1) == self._starts[n - 1]:
            n -= 1
        i = bisect_left(self._ledgers, timestamp_ms, 0, n, key=lambda led: led.last_time)
        if i >= n:
            return succeed(None)
        ledger = self._ledgers[i]
        count = self._ledger_end(i) - ledger.start
        times, step = ledger.times, ledger.step
        if times is not None and step == 1 and len(times) >= count:
            e = bisect_left(times, timestamp_ms, 0, count)
            return succeed(Position(ledger.ledger_id, e) if e < count else None)
        if times is not None and step > 1:
            # The first sampled entry at or after the time bounds the window from above.
            j = bisect_left(times, timestamp_ms)
            if j == 0:
                return succeed(Position(ledger.ledger_id, 0))
            lo = (j - 1) * step + 1
            hi = min(j * step, count - 1)
            return Deferred.fromCoroutine(self._scan_time(i, lo, hi, timestamp_ms))
        return Deferred.fromCoroutine(self._search(i, count, timestamp_ms, by_time=True))

    # -- properties ------------------------------------------------------------------------

    @property
    def last_confirmed(self) -> Position:
        if self._next_seq > self._first_seq:
            return self._position(self._next_seq - 1)
        if self._ids:
            return Position(self._ids[-1], -1)
        return EARLIEST

    @property
    def first_position(self) -> Position:
        if self._next_seq > self._first_seq:
            return self._position(self._first_seq)
        if self._ids:
            return Position(self._ids[-1], 0)
        return Position(-1, 0)

    @property
    def next_index(self) -> int:
        return self._next_index

    @property
    def first_index(self) -> int:
        for ledger in self._ledgers:
            if ledger.entries or ledger is self._current_ledger:
                return ledger.first_index
        return self._next_index

    @property
    def ledgers(self) -> Sequence[LedgerInfo]:
        return [ledger.info() for ledger in self._ledgers]

    @property
    def entries(self) -> int:
        return self._next_seq - self._first_seq

    @property
    def size(self) -> int:
        return sum(ledger.size for ledger in self._ledgers)

    @property
    def terminated(self) -> bool:
        return self._terminated_at is not None

    @property
    def fenced(self) -> bool:
        """Whether another owner took the log."""
        return self._state is _State.FENCED

    # -- lifecycle -------------------------------------------------------------------------

    def terminate(self) -> Deferred[Position]:
        if self._terminated_at is not None:
            return succeed(self._terminated_at)
        if self._state in (_State.CLOSED, _State.FENCED):
            return fail(self._refusal())
        return Deferred.fromCoroutine(self._terminate())

    async def _terminate(self) -> Position:
        self._accepting = False
        self._cancel_roll_timer()
        self._error = ManagedLedgerTerminatedError(f"{self.name} is terminated")
        # Appends not yet sent never will be: the log ends at what is durable now.
        queued = list(self._queued)
        self._queued.clear()
        for a in queued:
            _fail_add(a, ManagedLedgerTerminatedError(f"{self.name} is terminated"))
        await self._idle()
        if self._state is _State.FENCED:
            raise self._refusal()
        await self._seal_current()
        self._terminated_at = self.last_confirmed
        self._state = _State.TERMINATED
        await self._write_metadata()
        for cursor in list(self._waiting):
            cursor._wake()
        return self._terminated_at

    async def _seal_current(self) -> None:
        """Close the current ledger and record it as sealed (no recovery needed on reopen)."""
        self._cancel_roll_timer()
        handle, ledger = self._current, self._current_ledger
        self._current = None
        self._current_ledger = None
        if ledger is None:
            return
        ledger.compact()
        if handle is not None:
            try:
                await handle.close_ledger()
                ledger.sealed = True
            except Exception as e:
                log.warning("closing ledger %d of %s failed: %s", ledger.ledger_id, self.name, e)
        if ledger.entries == 0 and self._ledgers and self._ledgers[-1] is ledger:
            self._remove_last_ledger()
            self._delete_ledger_later(ledger.ledger_id)

    def close(self) -> Deferred[None]:
        if self._state is _State.CLOSED:
            return succeed(None)
        if self._closing is not None:
            return self._when_closed()
        self._closing = []
        return Deferred.fromCoroutine(self._close())

    def _when_closed(self) -> Deferred[None]:
        """Fire once a close in progress finished (at once if none is)."""
        if self._closing is None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._closing.append(d)
        return d

    async def _close(self) -> None:
        try:
            await self._close_now()
        finally:
            self._state = _State.CLOSED
            self._factory._forget(self)
            waiters, self._closing = self._closing or [], None
            for d in waiters:
                d.callback(None)

    async def _close_now(self) -> None:
        self._accepting = False
        self._cancel_roll_timer()
        await self._idle()
        for cursor in list(self._cursors.values()):
            try:
                await cursor.close()
            except Exception as e:
                log.warning("closing cursor %s of %s failed: %s", cursor.name, self.name, e)
        if self._state in (_State.OPEN, _State.ROLLING, _State.NO_LEDGER):
            await self._seal_current()
            try:
                await self._write_metadata()
            except Exception as e:
                log.warning("recording the close of %s failed: %s", self.name, e)
        elif self._current is not None:
            self._close_quietly(self._current)
            self._current = None
        self._state = _State.CLOSED
        self._cancel_roll_timer()
        for handle in self._handles.values():
            self._close_quietly(handle)
        self._handles.clear()
        self._cache.close()

    def delete(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._delete())

    async def _delete(self) -> None:
        await self.close()
        for ledger in self._ledgers:
            with contextlib.suppress(NoSuchLedgerError):
                await self._client.delete(ledger.ledger_id)
        await self._store.delete_recursive(ledger_path(self.name))


class ManagedLedgerFactoryImpl(ManagedLedgerFactory):
    """Opens managed ledgers over one ``LedgerClient`` and ``MetadataStore``; shares one entry
    cache budget (``cache_size_bytes``) among them; a log with no cursor keeps what it appended
    in the last ``tail_cache_ms`` (within that budget)."""

    def __init__(
        self,
        store: MetadataStore,
        client: LedgerClient,
        reactor: Any,
        *,
        default_config: ManagedLedgerConfig | None = None,
        cache_size_bytes: int = DEFAULT_CACHE_SIZE_BYTES,
        tail_cache_ms: int = DEFAULT_TAIL_CACHE_MS,
    ) -> None:
        self.store = store
        self.tail_cache_ms = tail_cache_ms
        self.client = client
        self.reactor = reactor
        self.default_config = default_config or ManagedLedgerConfig()
        self.cache_manager = EntryCacheManager(cache_size_bytes)
        self._open: dict[str, ManagedLedgerImpl] = {}
        self._opening: dict[str, list[Deferred[ManagedLedger]]] = {}
        self._closed = False

    def storage_problem(self, ensemble_size: int) -> Deferred[str | None]:
        return self.client.storage_problem(ensemble_size)

    def cache_stats(self) -> dict[str, int]:
        return self.cache_manager.stats()

    def open(self, name: str, config: ManagedLedgerConfig | None = None) -> Deferred[ManagedLedger]:
        if self._closed:
            return fail(ManagedLedgerClosedError("the managed ledger factory is closed"))
        try:
            _check_name(name)
        except ValueError as e:
            return fail(e)
        ml = self._open.get(name)
        if ml is not None:
            if ml._closing is None:
                return succeed(ml)
            # Reopen only once the close finished writing its metadata.
            closed = ml._when_closed()
            closed.addCallback(lambda _: self.open(name, config))
            return closed  # type: ignore[return-value]
        d: Deferred[ManagedLedger] = Deferred()
        waiters = self._opening.get(name)
        if waiters is not None:
            waiters.append(d)
            return d
        self._opening[name] = [d]
        ml = ManagedLedgerImpl(self, name, config or self.default_config)

        def opened(_: object) -> None:
            self._open[name] = ml
            for w in self._opening.pop(name):
                w.callback(ml)

        def failed(f: Failure) -> None:
            ml._cache.close()
            ml._state = _State.CLOSED
            for w in self._opening.pop(name):
                w.errback(f)

        Deferred.fromCoroutine(ml._open()).addCallbacks(opened, failed)
        return d

    def _forget(self, ml: ManagedLedgerImpl) -> None:
        if self._open.get(ml.name) is ml:
            del self._open[ml.name]

    def exists(self, name: str) -> Deferred[bool]:
        if name in self._open:
            return succeed(True)

        def found(result: Any) -> bool:
            return result is not None and bool(result.value)

        return self.store.get(ledger_path(name)).addCallback(found)

    def list(self, prefix: str = "") -> Deferred[list[str]]:
        return Deferred.fromCoroutine(self._list(prefix))

    async def _list(self, prefix: str) -> builtins.list[str]:
        out: builtins.list[str] = []

        async def walk(name: str) -> None:
            path = ledger_path(name) if name else ROOT
            if name:
                node = await self.store.get(path)
                if node is not None and node.value:
                    if name.startswith(prefix):
                        out.append(name)
                    return  # a log's children are its cursors
            for child in await self.store.children(path):
                sub = f"{name}/{child}" if name else child
                # Only descend where a name with the prefix can be found.
                if sub.startswith(prefix) or prefix.startswith(sub + "/"):
                    await walk(sub)

        await walk("")
        return sorted(out)

    def delete(self, name: str) -> Deferred[None]:
        return Deferred.fromCoroutine(self._delete(name))

    async def _delete(self, name: str) -> None:
        if not await self.exists(name):
            return
        ml = await self.open(name)
        await ml.delete()

    def close(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._close())

    async def _close(self) -> None:
        self._closed = True
        for ml in list(self._open.values()):
            try:
                await ml.close()
            except Exception as e:
                log.warning("closing %s failed: %s", ml.name, e)
        await self.client.close()
