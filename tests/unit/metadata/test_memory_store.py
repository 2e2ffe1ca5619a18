"""MemoryMetadataStore beyond the shared contract: synchronous completion on a Clock, several
sessions over one tree, session expiry, and notification order when watchers write."""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.metadata.api import (
    EventType,
    MetadataError,
    Notification,
    SessionEvent,
    StoreClosedError,
)
from polybroker.metadata.memory import MAX_VALUE_BYTES, MemoryMetadataStore

T = TypeVar("T")


def result_of(d: Deferred[T]) -> T:
    """Return what an already-fired Deferred fired with; raise its failure."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]  # type: ignore[no-any-return]


def events(log: list[Notification]) -> list[tuple[EventType, str]]:
    return [(n.type, n.path) for n in log]


def test_operations_fire_synchronously_with_clock_times() -> None:
    """Every operation's Deferred has fired on return, and stats carry the clock's time."""
    clock = Clock()
    clock.advance(12.5)
    store = MemoryMetadataStore(clock)
    stat = result_of(store.put("/a", b"x"))
    assert (stat.created_ms, stat.modified_ms) == (12500, 12500)
    clock.advance(1)
    stat = result_of(store.put("/a", b"y"))
    assert (stat.version, stat.created_ms, stat.modified_ms) == (1, 12500, 13500)
    assert result_of(store.get("/a")).value == b"y"
    assert result_of(store.children("/")) == ["a"]


def test_watchers_are_called_before_the_operation_returns() -> None:
    """A watch callback has run by the time put returns (Rule M2)."""
    store = MemoryMetadataStore(Clock())
    seen: list[Notification] = []
    store.watch("/a", seen.append)
    store.put("/a", b"x")
    assert events(seen) == [(EventType.CREATED, "/a")]


def test_changes_made_by_a_watcher_reach_everyone_in_order() -> None:
    """When a watcher writes from its callback, every watcher still sees the first change
    before the one the watcher made."""
    store = MemoryMetadataStore(Clock())
    first: list[Notification] = []
    second: list[Notification] = []

    def echo(n: Notification) -> None:
        first.append(n)
        if n.path == "/ping":
            store.put("/pong", b"")

    store.watch("/ping", echo)
    store.watch("/pong", first.append)
    store.watch("/ping", second.append)
    store.watch("/pong", second.append)
    store.put("/ping", b"")
    expected = [(EventType.CREATED, "/ping"), (EventType.CREATED, "/pong")]
    assert events(first) == expected
    assert events(second) == expected


def test_sessions_share_one_tree_and_see_each_others_changes() -> None:
    """Two sessions over one tree read each other's writes and get each other's watches."""
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    assert a.session_id != b.session_id
    seen: list[Notification] = []
    b.watch("/shared", seen.append)
    result_of(a.put("/shared", b"from a"))
    assert result_of(b.get("/shared")).value == b"from a"
    assert events(seen) == [(EventType.CREATED, "/shared")]


def test_close_removes_only_that_sessions_ephemeral_nodes() -> None:
    """Closing one session deletes its ephemeral nodes, which the other session's watches
    report; the other session's ephemeral nodes and all persistent nodes stay."""
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    result_of(a.put("/brokers/a", b"", ephemeral=True))
    result_of(b.put("/brokers/b", b"", ephemeral=True))
    result_of(a.put("/topics/t", b""))
    seen: list[Notification] = []
    b.watch("/brokers/a", seen.append)
    b.watch("/brokers", seen.append)
    result_of(a.close())
    assert events(seen) == [
        (EventType.DELETED, "/brokers/a"),
        (EventType.CHILDREN_CHANGED, "/brokers"),
    ]
    assert result_of(b.children("/brokers")) == ["b"]
    assert result_of(b.exists("/topics/t")) is not None


def test_expire_session_drops_ephemerals_and_reestablishes() -> None:
    """expire_session deletes the session's ephemeral nodes (seen by another session, not by
    the expired one), reports SESSION_LOST then SESSION_REESTABLISHED, and the store keeps
    working under a new session whose ephemeral nodes are its own."""
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    result_of(a.put("/owner", b"a", ephemeral=True))
    result_of(a.put("/data", b"persistent"))
    a_session_events: list[SessionEvent] = []
    a.add_session_listener(a_session_events.append)
    a_seen: list[Notification] = []
    b_seen: list[Notification] = []
    a.watch("/owner", a_seen.append)
    b.watch("/owner", b_seen.append)
    old_id = a.session_id

    a.expire_session()

    assert a_session_events == [SessionEvent.SESSION_LOST, SessionEvent.SESSION_REESTABLISHED]
    assert events(b_seen) == [(EventType.DELETED, "/owner")]
    assert a_seen == []
    assert result_of(b.exists("/owner")) is None
    assert result_of(b.get("/data")).value == b"persistent"
    assert a.session_id != old_id
    # The new session works and keeps its watches.
    result_of(a.put("/owner", b"a again", ephemeral=True))
    assert events(a_seen) == [(EventType.CREATED, "/owner")]
    b_seen.clear()
    a.expire_session()
    assert events(b_seen) == [(EventType.CREATED, "/owner"), (EventType.DELETED, "/owner")][1:]


def test_expire_session_without_reestablish_closes_the_store() -> None:
    """After an expiry that is not re-established, the store refuses every operation."""
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    result_of(a.put("/e", b"", ephemeral=True))
    lost: list[SessionEvent] = []
    a.add_session_listener(lost.append)
    a.expire_session(reestablish=False)
    assert lost == [SessionEvent.SESSION_LOST]
    assert result_of(b.exists("/e")) is None
    with pytest.raises(StoreClosedError):
        result_of(a.get("/e"))
    with pytest.raises(StoreClosedError):
        a.expire_session()


def test_ephemeral_node_updated_by_another_session_keeps_its_owner() -> None:
    """A node stays owned by the session that created it even after another session wrote it."""
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    result_of(a.put("/leader", b"a", ephemeral=True))
    assert result_of(b.put("/leader", b"b")).ephemeral
    result_of(b.close())
    assert result_of(a.get("/leader")).value == b"b"
    a.expire_session()
    assert result_of(a.exists("/leader")) is None


def test_session_listener_failure_does_not_stop_others() -> None:
    """A session listener that raises does not keep later listeners from being told."""
    store = MemoryMetadataStore(Clock())
    told: list[SessionEvent] = []

    def broken(event: SessionEvent) -> None:
        raise RuntimeError("listener bug")

    store.add_session_listener(broken)
    store.add_session_listener(told.append)
    store.expire_session()
    assert told == [SessionEvent.SESSION_LOST, SessionEvent.SESSION_REESTABLISHED]


def test_a_removed_session_listener_is_told_nothing_more() -> None:
    store = MemoryMetadataStore(Clock())
    told: list[SessionEvent] = []
    remove = store.add_session_listener(told.append)
    remove()
    remove()  # idempotent
    store.expire_session()
    assert told == []


def test_values_are_bounded_and_typed() -> None:
    """A value over MAX_VALUE_BYTES fails with ValueError, a str with TypeError, and neither
    creates the node; bytearray and memoryview are accepted as bytes."""
    store = MemoryMetadataStore(Clock())
    with pytest.raises(ValueError, match="exceeds"):
        result_of(store.put("/big", b"x" * (MAX_VALUE_BYTES + 1)))
    with pytest.raises(TypeError):
        result_of(store.put("/str", "text"))  # type: ignore[arg-type]
    assert result_of(store.children("/")) == []
    result_of(store.put("/ba", bytearray(b"ab")))
    result_of(store.put("/mv", memoryview(b"cd")))
    assert result_of(store.get("/ba")).value == b"ab"
    assert result_of(store.get("/mv")).value == b"cd"


def test_bad_expected_version_and_root_delete_are_refused() -> None:
    """expected_version below -1 and deleting the root fail with ValueError."""
    store = MemoryMetadataStore(Clock())
    with pytest.raises(ValueError, match="expected_version"):
        result_of(store.put("/a", b"", expected_version=-2))
    with pytest.raises(ValueError, match="root"):
        result_of(store.delete("/"))
    assert result_of(store.get("/")) is not None


def test_sequential_skips_a_name_taken_by_a_plain_put() -> None:
    """A sequential create never collides with a node someone created under that exact name."""
    store = MemoryMetadataStore(Clock())
    result_of(store.put("/q/n-0000000000", b"by hand"))
    path = result_of(store.create_sequential("/q/n-", b"seq"))
    assert path == "/q/n-0000000001"
    assert result_of(store.get("/q/n-0000000000")).value == b"by hand"


def test_sequence_floor_keeps_a_recreated_parent_from_reusing_numbers() -> None:
    """A parent deleted and created again continues above every number it handed out."""
    store = MemoryMetadataStore(Clock())
    for _ in range(3):
        last = result_of(store.create_sequential("/p/n-", b""))
    assert last == "/p/n-0000000002"
    for child in result_of(store.children("/p")):
        result_of(store.delete(f"/p/{child}"))
    result_of(store.delete("/p"))
    assert result_of(store.create_sequential("/p/n-", b"")) == "/p/n-0000000003"
    assert result_of(store.create_sequential("/fresh/n-", b"")) >= "/fresh/n-0000000000"


def test_store_errors_are_metadata_errors() -> None:
    """An ephemeral-parent refusal is a MetadataError delivered through the Deferred."""
    store = MemoryMetadataStore(Clock())
    result_of(store.put("/e", b"", ephemeral=True))
    d = store.put("/e/c", b"")
    with pytest.raises(MetadataError, match="ephemeral"):
        result_of(d)
