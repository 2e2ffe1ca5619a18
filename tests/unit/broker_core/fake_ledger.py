"""In-memory fakes for broker_core unit tests: a managed ledger and its cursors, a metadata
store, and a recording consumer. Everything completes synchronously unless told to hold
(``hold_appends``), so tests step through states with no reactor.

The fakes keep the contracts of ``polybroker.ledger.api`` that the broker relies on: appends
complete in order, cursors skip acknowledged entries, mark-delete advances over contiguous
acknowledgements and never moves back except by ``reset``, a waiting read fires on the next
append, durable cursor state survives close and reopen through the factory.
"""

from __future__ import annotations

import itertools
import json
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import Delivery, ServerConsumer, SubType
from polybroker.broker_core.topic import PersistentTopic, TopicSettings
from polybroker.ledger.api import (
    Cursor,
    Entry,
    InitialPosition,
    LedgerInfo,
    ManagedLedger,
    ManagedLedgerClosedError,
    ManagedLedgerConfig,
    ManagedLedgerFactory,
    ManagedLedgerTerminatedError,
    Position,
)
from polybroker.metadata.api import (
    BadVersionError,
    GetResult,
    MetadataStore,
    NotEmptyError,
    NotFoundError,
    Notification,
    SessionEvent,
    Stat,
)

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


# ---------------------------------------------------------------------------------------------
# Managed ledger
# ---------------------------------------------------------------------------------------------


@dataclass
class _CursorState:
    mark_delete: int
    deleted: set[int]


@dataclass
class LogData:
    """What survives closing and reopening one log."""

    name: str
    entries: list[Entry] = field(default_factory=list)
    ledger_ids: list[int] = field(default_factory=lambda: [1])
    next_index: int = 0
    terminated: bool = False
    cursors: dict[str, _CursorState] = field(default_factory=dict)


class FakeCursor(Cursor):
    def __init__(
        self, ml: FakeManagedLedger, name: str, durable: bool, mark_delete: int, deleted: set[int]
    ) -> None:
        self.ml = ml
        self.name = name
        self.durable = durable
        self._md = mark_delete
        self._deleted = set(deleted)
        self._read = mark_delete + 1
        self._waiting: tuple[int, Deferred[list[Entry]]] | None = None
        self.closed = False
        self.reads = 0
        self.entries_read: list[Position] = []

    @property
    def _entries(self) -> list[Entry]:
        return self.ml.data.entries

    def _advance(self) -> None:
        while self._md + 1 in self._deleted:
            self._md += 1
            self._deleted.discard(self._md)
        self._deleted = {i for i in self._deleted if i > self._md}
        if self._read <= self._md:
            self._read = self._md + 1

    @property
    def read_position(self) -> Position:
        if self._read < len(self._entries):
            return self._entries[self._read].position
        return self.ml._after_last()

    @property
    def mark_delete_position(self) -> Position:
        if self._md >= 0:
            return self._entries[self._md].position
        return Position(self.ml.data.ledger_ids[0], -1)

    def individually_deleted(self) -> Sequence[tuple[Position, Position]]:
        out: list[tuple[Position, Position]] = []
        run: list[int] = []
        for i in sorted(self._deleted):
            if run and i != run[-1] + 1:
                out.append((self._entries[run[0]].position, self._entries[run[-1]].position))
                run = []
            run.append(i)
        if run:
            out.append((self._entries[run[0]].position, self._entries[run[-1]].position))
        return out

    def _collect(self, max_entries: int) -> list[Entry]:
        out: list[Entry] = []
        i = self._read
        entries = self._entries
        while i < len(entries) and len(out) < max_entries:
            if i > self._md and i not in self._deleted:
                out.append(entries[i])
            i += 1
        self._read = i
        return out

    def read(self, max_entries: int, *, wait: bool = False) -> Deferred[list[Entry]]:
        if self.closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} closed"))
        if self.ml.fail_reads:
            self.ml.fail_reads -= 1
            return fail(RuntimeError("injected read failure"))
        assert self._waiting is None, "two reads at once on one cursor"
        self.reads += 1
        out = self._collect(max_entries)
        if out or not wait:
            self.entries_read.extend(e.position for e in out)
            return succeed(out)
        d: Deferred[list[Entry]] = Deferred()
        self._waiting = (max_entries, d)
        return d

    def _wake(self) -> None:
        if self._waiting is None:
            return
        max_entries, d = self._waiting
        out = self._collect(max_entries)
        if out:
            self._waiting = None
            self.entries_read.extend(e.position for e in out)
            d.callback(out)

    def cancel_pending_read(self) -> None:
        if self._waiting is not None:
            _, d = self._waiting
            self._waiting = None
            d.callback([])

    @property
    def waiting(self) -> bool:
        return self._waiting is not None

    def _index(self, position: Position) -> int:
        return bisect_left(self.ml._positions, position)

    def mark_delete(self, position: Position) -> Deferred[None]:
        if self.closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} closed"))
        i = bisect_right(self.ml._positions, position) - 1
        if i > self._md:
            self._md = i
        self._advance()
        return succeed(None)

    def delete(self, positions: Sequence[Position]) -> Deferred[None]:
        if self.closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} closed"))
        for p in positions:
            i = self._index(p)
            if i < len(self._entries) and self._entries[i].position == p and i > self._md:
                self._deleted.add(i)
        self._advance()
        return succeed(None)

    def is_deleted(self, position: Position) -> bool:
        i = self._index(position)
        return i <= self._md or i in self._deleted

    def seek(self, position: Position) -> None:
        self._read = max(self._index(position), self._md + 1)

    def reset(self, position: Position) -> Deferred[None]:
        i = self._index(position)
        self._md = i - 1
        self._read = i
        self._deleted.clear()
        self.ml.resets.append((self.name, position))
        return succeed(None)

    def backlog(self) -> int:
        return sum(
            e.num_messages
            for i, e in enumerate(self._entries)
            if i > self._md and i not in self._deleted
        )

    def backlog_entries(self) -> int:
        return sum(1 for i in range(self._md + 1, len(self._entries)) if i not in self._deleted)

    def _save(self) -> None:
        if self.durable:
            self.ml.data.cursors[self.name] = _CursorState(self._md, set(self._deleted))

    def close(self) -> Deferred[None]:
        if not self.closed:
            self._save()
            self.closed = True
            self.ml._cursors.pop(self.name, None)
            self.cancel_pending_read()
        return succeed(None)


class FakeManagedLedger(ManagedLedger):
    def __init__(self, data: LogData, factory: FakeLedgerFactory) -> None:
        self.name = data.name
        self.data = data
        self.factory = factory
        self.config: ManagedLedgerConfig | None = None
        self._cursors: dict[str, FakeCursor] = {}
        self._positions = [e.position for e in data.entries]
        self._held: list[tuple[bytes, int, int | None, Deferred[Entry]]] = []
        self.hold_appends = False
        self.fail_reads = 0
        self.closed = False
        self.resets: list[tuple[str, Position]] = []
        self._reader_names = itertools.count()
        for name, state in data.cursors.items():
            self._cursors[name] = FakeCursor(self, name, True, state.mark_delete, state.deleted)

    def _after_last(self) -> Position:
        last = self.last_confirmed
        return Position(last.ledger_id, last.entry_id + 1)

    def append(
        self, data: bytes, num_messages: int = 1, publish_time_ms: int | None = None
    ) -> Deferred[Entry]:
        if self.closed:
            return fail(ManagedLedgerClosedError(self.name))
        if self.data.terminated:
            return fail(ManagedLedgerTerminatedError(self.name))
        d: Deferred[Entry] = Deferred()
        self._held.append((data, num_messages, publish_time_ms, d))
        if not self.hold_appends:
            self.release_appends()
        return d

    def release_appends(self, count: int | None = None, error: Exception | None = None) -> None:
        """Complete held appends, oldest first (or fail them with ``error``)."""
        n = len(self._held) if count is None else count
        batch, self._held = self._held[:n], self._held[n:]
        for data, num, t, d in batch:
            if error is not None:
                d.errback(error)
                continue
            entry = self._store(data, num, t)
            d.callback(entry)

    @property
    def held_appends(self) -> int:
        return len(self._held)

    def _store(self, data: bytes, num: int, t: int | None) -> Entry:
        log = self.data
        ledger = log.ledger_ids[-1]
        last = log.entries[-1].position if log.entries else None
        in_ledger = last.entry_id + 1 if last is not None and last.ledger_id == ledger else 0
        if in_ledger >= self.factory.max_entries_per_ledger:
            ledger += 1
            log.ledger_ids.append(ledger)
            in_ledger = 0
        now = int(self.factory.clock() * 1000) if t is None else t
        entry = Entry(Position(ledger, in_ledger), log.next_index, num, now, data)
        log.next_index += num
        log.entries.append(entry)
        self._positions.append(entry.position)
        for cursor in list(self._cursors.values()):
            cursor._wake()
        return entry

    def open_cursor(
        self, name: str, initial_position: InitialPosition = InitialPosition.LATEST
    ) -> Deferred[Cursor]:
        if self.closed:
            return fail(ManagedLedgerClosedError(self.name))
        cursor = self._cursors.get(name)
        if cursor is None:
            md = len(self.data.entries) - 1 if initial_position is InitialPosition.LATEST else -1
            cursor = FakeCursor(self, name, True, md, set())
            self._cursors[name] = cursor
            cursor._save()
        return succeed(cursor)

    def new_non_durable_cursor(self, start: Position, name: str | None = None) -> Cursor:
        md = -1 if start.ledger_id < 0 else bisect_right(self._positions, start) - 1
        name = name or f"non-durable-{next(self._reader_names)}"
        cursor = FakeCursor(self, name, False, md, set())
        self._cursors[name] = cursor
        return cursor

    def delete_cursor(self, name: str) -> Deferred[None]:
        cursor = self._cursors.pop(name, None)
        self.data.cursors.pop(name, None)
        if cursor is not None:
            cursor.closed = True
            cursor.cancel_pending_read()
        return succeed(None)

    @property
    def cursors(self) -> dict[str, Cursor]:
        return dict(self._cursors)

    def read(self, position: Position, max_entries: int) -> Deferred[list[Entry]]:
        i = bisect_left(self._positions, position)
        return succeed(self.data.entries[i : i + max_entries])

    @property
    def last_confirmed(self) -> Position:
        if self.data.entries:
            return self.data.entries[-1].position
        return Position(self.data.ledger_ids[-1], -1)

    @property
    def first_position(self) -> Position:
        if self.data.entries:
            return self.data.entries[0].position
        return Position(self.data.ledger_ids[0], 0)

    @property
    def next_index(self) -> int:
        return self.data.next_index

    @property
    def first_index(self) -> int:
        return self.data.entries[0].index if self.data.entries else self.data.next_index

    @property
    def ledgers(self) -> Sequence[LedgerInfo]:
        out = []
        for lid in self.data.ledger_ids:
            es = [e for e in self.data.entries if e.position.ledger_id == lid]
            out.append(
                LedgerInfo(
                    lid,
                    len(es),
                    sum(len(e.data) for e in es),
                    es[0].index if es else self.data.next_index,
                    sum(e.num_messages for e in es),
                    es[0].publish_time_ms if es else 0,
                    es[-1].publish_time_ms if es else 0,
                )
            )
        return out

    def position_of_index(self, index: int) -> Deferred[Position | None]:
        for e in self.data.entries:
            if e.index <= index <= e.last_index:
                return succeed(e.position)
        return succeed(None)

    def index_of_position(self, position: Position) -> Deferred[int]:
        i = bisect_left(self._positions, position)
        return succeed(self.data.entries[i].index)

    def position_of_time(self, timestamp_ms: int) -> Deferred[Position | None]:
        for e in self.data.entries:
            if e.publish_time_ms >= timestamp_ms:
                return succeed(e.position)
        return succeed(None)

    @property
    def entries(self) -> int:
        return len(self.data.entries)

    @property
    def size(self) -> int:
        return sum(len(e.data) for e in self.data.entries)

    @property
    def terminated(self) -> bool:
        return self.data.terminated

    def terminate(self) -> Deferred[Position]:
        self.data.terminated = True
        return succeed(self.last_confirmed)

    def close(self) -> Deferred[None]:
        if not self.closed:
            for cursor in list(self._cursors.values()):
                cursor.close()
            self.closed = True
            self.factory._open.pop(self.name, None)
        return succeed(None)

    def delete(self) -> Deferred[None]:
        self.close()
        self.factory.logs.pop(self.name, None)
        return succeed(None)


class FakeLedgerFactory(ManagedLedgerFactory):
    def __init__(
        self, clock: Callable[[], float] | None = None, max_entries_per_ledger: int = 1_000_000
    ) -> None:
        self.clock = clock or (lambda: 0.0)
        self.max_entries_per_ledger = max_entries_per_ledger
        self.logs: dict[str, LogData] = {}
        self._open: dict[str, FakeManagedLedger] = {}
        self.opens = 0
        self.closed = False
        self.configs: dict[str, ManagedLedgerConfig | None] = {}

    def open(self, name: str, config: ManagedLedgerConfig | None = None) -> Deferred[ManagedLedger]:
        ml = self._open.get(name)
        if ml is None:
            data = self.logs.setdefault(name, LogData(name))
            ml = FakeManagedLedger(data, self)
            self._open[name] = ml
            self.opens += 1
            self.configs[name] = config
            ml.config = config  # as the real one, the config in force (retention may change it)
        return succeed(ml)

    def ledger(self, name: str) -> FakeManagedLedger:
        """The open instance of a log (tests only)."""
        return self._open[name]

    def exists(self, name: str) -> Deferred[bool]:
        return succeed(name in self.logs)

    def list(self, prefix: str = "") -> Deferred[list[str]]:
        return succeed(sorted(n for n in self.logs if n.startswith(prefix)))

    def delete(self, name: str) -> Deferred[None]:
        ml = self._open.get(name)
        if ml is not None:
            ml.delete()
        self.logs.pop(name, None)
        return succeed(None)

    def close(self) -> Deferred[None]:
        for ml in list(self._open.values()):
            ml.close()
        self.closed = True
        return succeed(None)


# ---------------------------------------------------------------------------------------------
# Metadata store
# ---------------------------------------------------------------------------------------------


class FakeMetadataStore(MetadataStore):
    """Just enough of the MetadataStore contract: versions, CAS, children."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int]] = {}

    def get(self, path: str) -> Deferred[GetResult | None]:
        node = self.nodes.get(path)
        if node is None:
            return succeed(None)
        return succeed(GetResult(node[0], Stat(node[1], False, 0, 0)))

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
        if (
            expected_version is not None
            and expected_version >= 0
            and (node is None or node[1] != expected_version)
        ):
            return fail(BadVersionError(path))
        version = 0 if node is None else node[1] + 1
        self.nodes[path] = (value, version)
        return succeed(Stat(version, ephemeral, 0, 0))

    def create_sequential(
        self, prefix: str, value: bytes, *, ephemeral: bool = False
    ) -> Deferred[str]:
        raise NotImplementedError

    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        if path not in self.nodes:
            return fail(NotFoundError(path))
        if any(p.startswith(path + "/") for p in self.nodes):
            return fail(NotEmptyError(path))
        del self.nodes[path]
        return succeed(None)

    def children(self, path: str) -> Deferred[list[str]]:
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix) :].split("/")[0] for p in self.nodes if p.startswith(prefix)}
        return succeed(sorted(names))

    def exists(self, path: str) -> Deferred[Stat | None]:
        node = self.nodes.get(path)
        return succeed(None if node is None else Stat(node[1], False, 0, 0))

    def watch(self, path: str, callback: Callable[[Notification], None]) -> Callable[[], None]:
        return lambda: None

    def add_session_listener(self, callback: Callable[[SessionEvent], None]) -> Callable[[], None]:
        return lambda: None

    def close(self) -> Deferred[None]:
        return succeed(None)


# ---------------------------------------------------------------------------------------------
# Consumer
# ---------------------------------------------------------------------------------------------


class RecordingConsumer:
    """A ``Consumer`` that records what the broker tells it."""

    _ids = itertools.count(1)

    def __init__(self, name: str = "", priority_level: int = 0) -> None:
        self.consumer_id = next(self._ids)
        self.consumer_name = name or f"c{self.consumer_id}"
        self.priority_level = priority_level
        self.deliveries: list[Delivery] = []
        self.batches: list[list[Delivery]] = []
        self.active_changes: list[bool] = []
        self.ended = 0
        self.disconnects = 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        self.batches.append(list(deliveries))
        self.deliveries.extend(deliveries)

    def active_changed(self, is_active: bool) -> None:
        self.active_changes.append(is_active)

    def reached_end_of_topic(self) -> None:
        self.ended += 1

    def disconnect(self) -> None:
        self.disconnects += 1

    @property
    def payloads(self) -> list[bytes]:
        return [d.entry.data for d in self.deliveries]

    @property
    def positions(self) -> list[Position]:
        return [d.entry.position for d in self.deliveries]

    def take(self) -> list[Delivery]:
        """Return and forget what was delivered so far."""
        out, self.deliveries = self.deliveries, []
        return out


# ---------------------------------------------------------------------------------------------
# Entries with keys, delays and sequence ids, and a topic to test with
# ---------------------------------------------------------------------------------------------


def message(
    payload: str,
    *,
    key: str | None = None,
    deliver_at: int | None = None,
    producer: str | None = None,
    seq: int | None = None,
) -> bytes:
    """Encode a test entry the ``JsonInspector`` can read."""
    doc: dict[str, object] = {"p": payload}
    if key is not None:
        doc["k"] = key
    if deliver_at is not None:
        doc["at"] = deliver_at
    if producer is not None:
        doc["prod"] = producer
        doc["seq"] = seq
    return json.dumps(doc).encode()


def payload_of(entry: Entry) -> str:
    return str(json.loads(entry.data)["p"])


class JsonInspector:
    """An ``EntryInspector`` for entries made by ``message``."""

    def key_of(self, entry: Entry) -> bytes | None:
        key = json.loads(entry.data).get("k")
        return key.encode() if key is not None else None

    def deliver_at_ms(self, entry: Entry) -> int | None:
        at = json.loads(entry.data).get("at")
        return int(at) if at is not None else None

    def producer_sequence(self, entry: Entry) -> tuple[str, int] | None:
        doc = json.loads(entry.data)
        if "prod" not in doc:
            return None
        return str(doc["prod"]), int(doc["seq"])


@dataclass
class Bench:
    """A persistent topic over a fake log, with its clock, factory and store."""

    topic: PersistentTopic
    ledger: FakeManagedLedger
    factory: FakeLedgerFactory
    clock: Clock
    store: FakeMetadataStore

    def publish(self, *payloads: str, **kw: object) -> list[Entry]:
        out = []
        for p in payloads:
            entry = result_of(self.topic.publish(message(p, **kw)))  # type: ignore[arg-type]
            assert isinstance(entry, Entry)
            out.append(entry)
        return out

    def subscribe(
        self,
        sub: str,
        consumer: RecordingConsumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        **kw: object,
    ) -> ServerConsumer:
        kw.setdefault("initial_position", InitialPosition.EARLIEST)
        server = result_of(self.topic.subscribe(sub, consumer, sub_type, **kw))  # type: ignore[arg-type]
        assert isinstance(server, ServerConsumer)
        return server

    def reload(self) -> None:
        """Close the topic and load it again over the same log and store."""
        result_of(self.topic.close())
        self.topic = make_topic(
            clock=self.clock,
            factory=self.factory,
            store=self.store,
            settings=self.topic.settings,
            inspector=self.topic.inspector,
            name=self.topic.name,
        ).topic
        self.ledger = self.factory.ledger(self.topic.ledger.name)


def make_topic(
    *,
    clock: Clock | None = None,
    factory: FakeLedgerFactory | None = None,
    store: FakeMetadataStore | None = None,
    settings: TopicSettings | None = None,
    inspector: object | None = None,
    name: str = "persistent://public/default/t",
    partition_index: int = -1,
    max_entries_per_ledger: int = 1_000_000,
) -> Bench:
    """Build a loaded persistent topic over fakes (JSON inspector unless given)."""
    clock = clock or Clock()
    factory = factory or FakeLedgerFactory(clock.seconds, max_entries_per_ledger)
    store = store or FakeMetadataStore()
    ml_name = "public/default/persistent/" + name.rsplit("/", 1)[1]
    ml = result_of(factory.open(ml_name))
    assert isinstance(ml, FakeManagedLedger)
    topic = PersistentTopic(
        name,
        ml,
        clock,
        settings=settings,
        inspector=inspector or JsonInspector(),  # type: ignore[arg-type]
        metadata_store=store,
        partition_index=partition_index,
    )
    result_of(topic.load())
    return Bench(topic, ml, factory, clock, store)
