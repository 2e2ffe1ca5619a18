"""The ZooKeeper store's pure parts: URL parsing, choosing a store by URL, and how a watched
node's re-read turns into notifications (no server here; the contract suite runs one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler
from twisted.internet.task import Clock

from polybroker.config import ConfigError
from polybroker.metadata import open_metadata_store
from polybroker.metadata.api import EventType, Notification, SessionEvent
from polybroker.metadata.memory import MemoryMetadataStore
from polybroker.metadata.zookeeper import (
    RESTART_DELAY_S,
    ZooKeeperMetadataStore,
    ZooKeeperUrl,
    _Connection,
    _diff,
    _Handler,
    _Seen,
    handshake_timeout,
    parse_url,
)


@pytest.mark.parametrize(
    ("url", "hosts", "chroot"),
    [
        ("zk://127.0.0.1:2181", "127.0.0.1:2181", ""),
        ("zk://a:1,b:2,c:3/pulsar", "a:1,b:2,c:3", "/pulsar"),
        ("zk://zk.example:2181/", "zk.example:2181", ""),
        ("zk://h:2181/a/b", "h:2181", "/a/b"),
        ("zk://[::1]:2181/x", "[::1]:2181", "/x"),
    ],
)
def test_zk_urls_parse_into_hosts_and_chroot(url: str, hosts: str, chroot: str) -> None:
    assert parse_url(url) == ZooKeeperUrl(hosts, chroot)


@pytest.mark.parametrize(
    "url",
    [
        "zk://",
        "zk:///chroot",
        "zk://host",
        "zk://host:",
        "zk://host:port",
        "zk://host:0",
        "zk://host:70000",
        "zk://a:1,,b:2",
        "zk://h:1/bad/",
        "zk://h:1/a//b",
        "http://h:1",
    ],
)
def test_malformed_zk_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)


@pytest.mark.parametrize("url", ["zk://nohost", "mysql://x", "embeded", "memory"])
def test_open_metadata_store_refuses_unknown_or_malformed_urls(url: str, tmp_path) -> None:
    """A bad URL is a ConfigError raised at once, naming the URL."""
    with pytest.raises(ConfigError, match="metadata store URL"):
        open_metadata_store(url, data_dir=tmp_path, reactor=Clock())


def test_open_metadata_store_memory(tmp_path) -> None:
    d = open_metadata_store("memory:", data_dir=tmp_path, reactor=Clock())
    results: list[object] = []
    d.addCallback(results.append)
    assert isinstance(results[0], MemoryMetadataStore)


def kinds(ns: list[Notification]) -> list[EventType]:
    assert all(n.path == "/p" for n in ns)
    return [n.type for n in ns]


def test_diff_counts_every_data_and_child_version() -> None:
    """Each data version is one MODIFIED, each child version one CHILDREN_CHANGED."""
    old = _Seen(czxid=7, version=1, cversion=4)
    assert kinds(_diff("/p", old, old)) == []
    assert kinds(_diff("/p", old, _Seen(7, 3, 5))) == [
        EventType.MODIFIED,
        EventType.MODIFIED,
        EventType.CHILDREN_CHANGED,
    ]


def test_diff_reports_creation_deletion_and_replacement() -> None:
    assert kinds(_diff("/p", None, None)) == []
    assert kinds(_diff("/p", None, _Seen(9, 1, 0))) == [EventType.CREATED, EventType.MODIFIED]
    assert kinds(_diff("/p", _Seen(9, 1, 0), None)) == [EventType.DELETED]
    # Deleted and created again between two reads: another creation id.
    assert kinds(_diff("/p", _Seen(9, 4, 2), _Seen(12, 0, 1))) == [
        EventType.DELETED,
        EventType.CREATED,
        EventType.CHILDREN_CHANGED,
    ]


# -- the kazoo handler the store gives its client ---------------------------------------------


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def test_handler_select_reports_what_is_ready_and_times_out(pipe: tuple[int, int]) -> None:
    """``select`` keeps ``select.select``'s contract: the ready objects of each list, empty
    lists once the timeout passes with nothing ready."""
    r, w = pipe
    handler = _Handler()
    assert handler.select([r], [], [], 0) == ([], [], [])
    assert handler.select([r], [w], [], 0) == ([], [w], [])
    os.write(w, b"x")
    assert handler.select([r], [], [], None) == ([r], [], [])
    assert handler.select([r], [w], [], 0.5) == ([r], [w], [])


def test_handler_select_reports_a_closed_peer_as_readable() -> None:
    """A hang-up is readable (the reader then sees the end), as with ``select.select``."""
    r, w = os.pipe()
    os.close(w)
    try:
        assert _Handler().select([r], [], [], 0) == ([r], [], [])
    finally:
        os.close(r)


# -- Rule Z8: a connection attempt is bounded well below the session timeout ---------------


@pytest.mark.parametrize(
    ("session_s", "bound"), [(30.0, 3.0), (120.0, 12.0), (10.0, 2.0), (1.5, 1.5)]
)
def test_handshake_timeout_is_a_tenth_of_the_session_at_least_two_seconds(
    session_s: float, bound: float
) -> None:
    assert handshake_timeout(session_s) == pytest.approx(bound)


def test_the_store_bounds_each_connection_attempt_of_its_client() -> None:
    """The store's kazoo client connects (TCP) and waits for the handshake at most the bound,
    not the 30 s session kazoo would wait (kazoo's internals this relies on are checked)."""
    store = ZooKeeperMetadataStore("zk://127.0.0.1:2181", Clock(), session_timeout_ms=30_000)
    try:
        connection = store._zk._connection
        assert isinstance(connection, _Connection)
        assert connection.bound == pytest.approx(3.0)
        assert connection.client is store._zk
        assert connection.retry_sleeper.max_tries == -1
        assert store._zk.handler.connect_timeout == pytest.approx(3.0)
    finally:
        store._worker.shutdown()


def test_the_handshake_and_tcp_connect_timeouts_are_clamped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(
        ConnectionHandler, "_invoke", lambda self, t, req, xid=None: seen.append(("invoke", t))
    )
    monkeypatch.setattr(
        SequentialThreadingHandler,
        "create_connection",
        lambda self, *a, **kw: seen.append(("connect", kw.get("timeout"))),
    )
    store = ZooKeeperMetadataStore("zk://127.0.0.1:2181", Clock(), session_timeout_ms=30_000)
    try:
        store._zk._connection._invoke(30.0, object())
        store._zk._connection._invoke(1.0, object(), 5)
        store._zk.handler.create_connection(address=("127.0.0.1", 2181), timeout=30.0)
        store._zk.handler.create_connection(address=("127.0.0.1", 2181), timeout=0.5)
        store._zk.handler.create_connection(address=("127.0.0.1", 2181))
    finally:
        store._worker.shutdown()
    assert seen == [
        ("invoke", 3.0),
        ("invoke", 1.0),
        ("connect", 3.0),
        ("connect", 0.5),
        ("connect", 3.0),
    ]


@pytest.mark.parametrize("stopped", [False, True])
def test_the_end_of_kazoos_connection_loop_is_reported_unless_the_client_was_stopped(
    monkeypatch: pytest.MonkeyPatch, stopped: bool
) -> None:
    """Rule Z9: the loop ending on an error kazoo does not handle (or returning) while nobody
    stopped the client calls ``on_ended``; a stopped client's loop ending does not."""
    ended: list[str] = []

    def loop(self: ConnectionHandler) -> None:
        if stopped:
            self.client._stopped.set()
        raise RuntimeError("xids do not match")

    monkeypatch.setattr(ConnectionHandler, "zk_loop", loop)
    store = ZooKeeperMetadataStore("zk://127.0.0.1:2181", Clock(), session_timeout_ms=30_000)
    try:
        connection = _Connection(
            store._zk, store._zk._connection, 3.0, lambda: ended.append("ended")
        )
        store._zk._stopped.clear()
        connection.zk_loop()  # the error does not escape: kazoo logged it
    finally:
        store._worker.shutdown()
    assert ended == ([] if stopped else ["ended"])


class ClockReactor(Clock):
    """A Clock whose ``callFromThread`` runs the call at once (one thread in these tests)."""

    def callFromThread(self, f: Any, *args: Any) -> None:
        f(*args)


def test_a_dead_connection_loop_is_a_lost_session_and_a_restart_later() -> None:
    """Rule Z9: the store reports SESSION_LOST once and starts kazoo again after the delay;
    closing the store cancels the pending restart."""
    reactor = ClockReactor()
    store = ZooKeeperMetadataStore("zk://127.0.0.1:2181", reactor, session_timeout_ms=30_000)
    events: list[SessionEvent] = []
    store.add_session_listener(events.append)
    store._opened = True
    store._on_connection_ended()
    assert events == [SessionEvent.SESSION_LOST]
    assert [c.getTime() for c in reactor.getDelayedCalls()] == [RESTART_DELAY_S]
    store._on_connection_ended()  # the loss is reported once, one restart is due
    assert events == [SessionEvent.SESSION_LOST]
    assert len(reactor.getDelayedCalls()) == 1
    store.close()
    assert all(not c.active() for c in reactor.getDelayedCalls())
    assert store._restart_call is not None
    assert not store._restart_call.active()


def test_handler_select_refuses_bad_arguments() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    handler = _Handler()
    with pytest.raises(ValueError, match="Invalid event mask or fd"):
        handler.select([-1], [], [], 0)
    with pytest.raises(ValueError, match="Invalid event mask or fd"):
        handler.select([r], [], [], 0)  # closed: poll reports it invalid
    with pytest.raises(ValueError, match="non-negative"):
        handler.select([], [], [], -1)
    with pytest.raises(TypeError):
        handler.select([], [], [], "1")


def test_inline_completion_runs_once_on_the_completing_call() -> None:
    """A function linked before the outcome runs inside ``set``/``set_exception``, once."""
    handler = _Handler()
    calls: list[object] = []
    result = handler.async_result()
    result.link_inline(lambda res: calls.append(res.get_nowait()))
    assert calls == []
    result.set(42)
    assert calls == [42]
    result.set(43)  # a second outcome does not call it again
    assert calls == [42]

    failing = handler.async_result()
    failing.link_inline(lambda res: calls.append(res.exception))
    error = RuntimeError("boom")
    failing.set_exception(error)
    assert calls == [42, error]


def test_inline_completion_linked_after_the_outcome_runs_at_once() -> None:
    handler = _Handler()
    result = handler.async_result()
    result.set("done")
    calls: list[object] = []
    result.link_inline(lambda res: calls.append(res.get_nowait()))
    assert calls == ["done"]
