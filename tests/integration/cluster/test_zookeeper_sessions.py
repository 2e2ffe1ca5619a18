"""Session events of the ZooKeeper metadata store against a real server: an expired session
(forced with a second client on the same session id and password, which then closes it) and a
server restart within the session timeout (the same session reconnects)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from cluster_harness import eventually
from kazoo.client import KazooClient
from twisted.internet import reactor, threads
from zk_server import ZooKeeperServer

from polybroker.metadata.api import ConnectionLossError, EventType, Notification, SessionEvent
from polybroker.metadata.claim import ClaimState, EphemeralClaim
from polybroker.metadata.zookeeper import ZooKeeperMetadataStore

OWNED = "/owners/me"


def expire_session(hosts: str, store: ZooKeeperMetadataStore) -> None:
    """Make the server expire ``store``'s session: attach a second client to it, then close
    that client (blocking; run it off the reactor thread)."""
    session_id, password = store._zk.client_id
    other = KazooClient(hosts=hosts, client_id=(session_id, password))
    other.start(timeout=15)
    other.stop()
    other.close()


class SilentListener:
    """Listens on a port and accepts connections that it never answers nor closes, as a
    ZooKeeper server that is starting sometimes does, until ``close``."""

    def __init__(self, port: int) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen()
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # stop_listening closed the listener
            self.accepted.append(conn)

    def stop_listening(self) -> None:
        """Close the listening socket; the accepted connections stay open and silent."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(10)

    def close(self) -> None:
        self.stop_listening()
        for conn in self.accepted:
            conn.close()


class Owner:
    """Holds an ephemeral node and takes it again on each new session, as an owner must."""

    def __init__(self, store: ZooKeeperMetadataStore) -> None:
        self.store = store
        self.events: list[SessionEvent] = []
        self.reacquired: list[Any] = []
        store.add_session_listener(self.on_session)

    def on_session(self, event: SessionEvent) -> None:
        self.events.append(event)
        if event is SessionEvent.SESSION_REESTABLISHED:
            d = self.store.put(OWNED, b"owner", ephemeral=True)
            d.addBoth(self.reacquired.append)


class Stores:
    """Opens stores and closes them all at the end of the test."""

    def __init__(self) -> None:
        self.opened: list[ZooKeeperMetadataStore] = []

    async def open(
        self, url: str, timeout_ms: int, operation_timeout_s: float | None = None
    ) -> ZooKeeperMetadataStore:
        store = await ZooKeeperMetadataStore.open(
            url, reactor, session_timeout_ms=timeout_ms, operation_timeout_s=operation_timeout_s
        )
        self.opened.append(store)
        return store

    async def close(self) -> None:
        for store in self.opened:
            await store.close()


@pytest_twisted.async_yield_fixture
async def stores() -> AsyncIterator[Stores]:
    s = Stores()
    try:
        yield s
    finally:
        await s.close()


@pytest_twisted.ensureDeferred
async def test_an_expired_session_is_reported_and_its_owner_takes_the_ephemeral_again(
    zookeeper_server: ZooKeeperServer, zk_url: str, stores: Stores
) -> None:
    """The owner's listener sees SESSION_LOST then SESSION_REESTABLISHED; another session sees
    the ephemeral node deleted (ZooKeeper dropped it) and created again by the owner; the
    owner's watches keep firing on the new session."""
    owner_store = await stores.open(zk_url, 10_000)
    observer = await stores.open(zk_url, 10_000)
    owner = Owner(owner_store)
    first = await owner_store.put(OWNED, b"owner", ephemeral=True)
    assert first.ephemeral
    seen: list[EventType] = []
    observer.watch(OWNED, lambda n: seen.append(n.type))
    watched: list[Notification] = []
    owner_store.watch("/w", watched.append)
    assert await owner_store.exists("/w") is None  # runs once the watch is armed
    old_session = owner_store._zk.client_id[0]

    await threads.deferToThread(expire_session, zookeeper_server.hosts, owner_store)

    await eventually(lambda: SessionEvent.SESSION_REESTABLISHED in owner.events, 30, "new session")
    lost = owner.events.index(SessionEvent.SESSION_LOST)
    assert lost < owner.events.index(SessionEvent.SESSION_REESTABLISHED)
    assert SessionEvent.RECONNECTED not in owner.events
    assert owner_store._zk.client_id[0] != old_session
    await eventually(lambda: len(owner.reacquired) == 1, 10, "ephemeral taken again")
    assert owner.reacquired[0].ephemeral, owner.reacquired
    await eventually(lambda: seen == [EventType.DELETED, EventType.CREATED], 10, "observer")
    got = await observer.get(OWNED)
    assert got is not None
    assert got.stat.ephemeral
    assert got.value == b"owner"

    await observer.put("/w", b"after the new session")
    await eventually(lambda: [n.type for n in watched] == [EventType.CREATED], 10, "watch")
    assert (await owner_store.get("/w")).value == b"after the new session"

    # The re-acquired node belongs to the new session: it goes when that session ends.
    await owner_store.close()
    await eventually(
        lambda: seen == [EventType.DELETED, EventType.CREATED, EventType.DELETED], 10, "gone"
    )


@pytest_twisted.ensureDeferred
async def test_a_server_restart_keeps_the_session_and_reports_changes_made_meanwhile(
    tmp_path: Path, stores: Stores
) -> None:
    """A restart shorter than the session timeout: CONNECTION_LOST then RECONNECTED, no session
    loss, the ephemeral node stays, and a change made by another client while this one was
    disconnected is reported once it is back."""
    server = await threads.deferToThread(ZooKeeperServer.start, tmp_path / "zk")
    try:
        url = server.url(f"/restart-{uuid.uuid4().hex}")
        store = await stores.open(url, 30_000)
        events: list[SessionEvent] = []
        store.add_session_listener(events.append)
        await store.put(OWNED, b"kept", ephemeral=True)
        await store.put("/data", b"v0")
        watched: list[EventType] = []
        store.watch("/data", lambda n: watched.append(n.type))
        # Any operation issued after watch() runs after the watch is armed (Rule Z2).
        assert (await store.get("/data")).value == b"v0"

        await threads.deferToThread(server.restart)
        # Another client changes the node before this one has reconnected (or just after).
        other = await stores.open(url, 30_000)
        await other.put("/data", b"v1")
        await eventually(lambda: SessionEvent.RECONNECTED in events, 30, "reconnect")
        assert events[0] is SessionEvent.CONNECTION_LOST
        assert SessionEvent.SESSION_LOST not in events
        await eventually(lambda: watched == [EventType.MODIFIED], 10, "change seen")
        got = await other.get(OWNED)
        assert got is not None
        assert got.value == b"kept"
        assert got.stat.ephemeral
        await other.put("/data", b"v2")
        await eventually(lambda: watched == [EventType.MODIFIED] * 2, 10, "watch still on")
        assert (await store.get("/data")).value == b"v2"
    finally:
        await stores.close()
        await threads.deferToThread(server.stop)


@pytest_twisted.ensureDeferred
async def test_an_expired_owner_loses_its_claim_to_a_contender(
    zookeeper_server: ZooKeeperServer, zk_url: str, stores: Stores
) -> None:
    """A claim held by a session that expires is not kept: a contending session takes the
    node, and the old holder ends RELEASED without ever holding it again."""
    a = await stores.open(zk_url, 10_000)
    b = await stores.open(zk_url, 10_000)
    a_states: list[ClaimState] = []
    b_states: list[ClaimState] = []
    first = EphemeralClaim(a, "/bundles/b0", b"broker-a", on_change=a_states.append)
    second = EphemeralClaim(b, "/bundles/b0", b"broker-b", contend=True, on_change=b_states.append)
    assert await first.start() is ClaimState.HELD
    assert await second.start() is ClaimState.PENDING

    await threads.deferToThread(expire_session, zookeeper_server.hosts, a)

    await eventually(lambda: second.held, 30, "the contender holds the claim")
    await eventually(lambda: first.state is ClaimState.RELEASED, 30, "the old holder gave up")
    assert a_states[0] is ClaimState.HELD
    assert ClaimState.HELD not in a_states[1:]
    assert b_states == [ClaimState.HELD]
    got = await a.get("/bundles/b0")
    assert got is not None
    assert got.value == b"broker-b"
    await second.release()
    assert await b.get("/bundles/b0") is None


@pytest_twisted.ensureDeferred
async def test_an_operation_while_zookeeper_is_down_fails_in_bounded_time(
    tmp_path: Path, stores: Stores
) -> None:
    """With the server down an operation fails with ConnectionLossError after the operation
    timeout (it may still be applied later: its outcome is unknown); once the server is back
    the same session serves again."""
    server = await threads.deferToThread(ZooKeeperServer.start, tmp_path / "zk")
    try:
        url = server.url(f"/down-{uuid.uuid4().hex}")
        store = await stores.open(url, 30_000, operation_timeout_s=2.0)
        events: list[SessionEvent] = []
        store.add_session_listener(events.append)
        await store.put("/before", b"1")
        await threads.deferToThread(server.stop)
        start = time.monotonic()
        with pytest.raises(ConnectionLossError):
            await store.put("/during", b"2")
        # Bounded by the operation timeout, not by the 30 s session: generous room for a
        # loaded machine, far below what waiting for the session would take.
        assert time.monotonic() - start < 15.0
        await threads.deferToThread(server.restart)
        await eventually(lambda: SessionEvent.RECONNECTED in events, 30, "reconnect")
        assert SessionEvent.SESSION_LOST not in events
        assert (await store.get("/before")).value == b"1"
        await store.put("/after", b"3")
        assert (await store.get("/after")).value == b"3"
    finally:
        await stores.close()
        await threads.deferToThread(server.stop)


@pytest_twisted.ensureDeferred
async def test_a_connection_the_server_never_answers_does_not_hold_the_session_back(
    tmp_path: Path, stores: Stores
) -> None:
    """While ZooKeeper is down something accepts the store's reconnection and never answers
    (a starting ZooKeeper server can do that); the store gives that attempt up after its
    handshake bound (Rule Z8), reaches the server once it is back and keeps its session,
    long before the 30 s session timeout (kazoo alone waits that long on the connection)."""
    server = await threads.deferToThread(ZooKeeperServer.start, tmp_path / "zk")
    silent: SilentListener | None = None
    try:
        url = server.url(f"/silent-{uuid.uuid4().hex}")
        store = await stores.open(url, 30_000)
        events: list[SessionEvent] = []
        store.add_session_listener(events.append)
        await store.put(OWNED, b"kept", ephemeral=True)
        await threads.deferToThread(server.stop)
        silent = listener = SilentListener(server.port)
        await eventually(lambda: len(listener.accepted) >= 1, 15, "a reconnection attempt")
        listener.stop_listening()
        start = time.monotonic()
        await threads.deferToThread(server.restart)
        await eventually(lambda: SessionEvent.RECONNECTED in events, 10, "reconnect")
        assert time.monotonic() - start < 15.0
        assert SessionEvent.SESSION_LOST not in events
        got = await store.get(OWNED)
        assert got is not None
        assert got.value == b"kept"
        assert got.stat.ephemeral
    finally:
        if silent is not None:
            silent.close()
        await stores.close()
        await threads.deferToThread(server.stop)


@pytest_twisted.ensureDeferred
async def test_a_connection_thread_that_dies_is_started_again(zk_url: str, stores: Stores) -> None:
    """kazoo's connection thread ends on an error it does not expect (a frame it cannot parse,
    injected once here), after which kazoo never connects again by itself: the store reports
    SESSION_LOST, starts the client again and reports SESSION_REESTABLISHED, then serves
    (Rule Z9)."""
    store = await stores.open(zk_url, 10_000)
    events: list[SessionEvent] = []
    store.add_session_listener(events.append)
    await store.put("/before", b"1")
    connection = store._zk._connection

    def malformed_once(read_timeout: float) -> None:
        del connection._read_socket  # kazoo's own reads the frames after this one
        raise struct.error("unpack_from requires a buffer of at least 16 bytes")

    connection._read_socket = malformed_once
    with pytest.raises(ConnectionLossError):
        await store.get("/before")
    await eventually(lambda: SessionEvent.SESSION_REESTABLISHED in events, 20, "a new session")
    assert events == [SessionEvent.SESSION_LOST, SessionEvent.SESSION_REESTABLISHED]
    got = await store.get("/before")
    assert got is not None
    assert got.value == b"1"
    await store.put("/after", b"2")
    assert (await store.get("/after")).value == b"2"
