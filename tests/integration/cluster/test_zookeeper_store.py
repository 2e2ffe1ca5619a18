"""What the ZooKeeper store adds to the shared contract, against a real server: opening by URL,
chroot isolation, plain nodes other ZooKeeper clients read, the request size limit, reserved
names, and a server that does not answer."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import pytest
import pytest_twisted
from cluster_harness import eventually
from kazoo.client import KazooClient
from twisted.internet import reactor, threads
from twisted.internet.defer import DeferredList
from zk_server import ZooKeeperServer

from polybroker.metadata import open_metadata_store
from polybroker.metadata.api import EventType, MetadataError, SessionEvent
from polybroker.metadata.memory import MAX_VALUE_BYTES
from polybroker.metadata.zookeeper import ZK_MAX_PACKET, ZooKeeperMetadataStore


def read_with_kazoo(hosts: str, path: str) -> tuple[bytes, bool]:
    """Read a node with a plain kazoo client (blocking): (value, ephemeral)."""
    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    try:
        value, stat = client.get(path)
        return value, stat.ephemeralOwner != 0
    finally:
        client.stop()
        client.close()


@pytest_twisted.ensureDeferred
async def test_open_by_url_under_a_chroot_that_other_clients_read(
    zookeeper_server: ZooKeeperServer, tmp_path: Path
) -> None:
    """open_metadata_store("zk://...") opens a ZooKeeper session; nodes are plain ZooKeeper
    nodes under the chroot; another chroot is another namespace."""
    chroot = f"/url-{uuid.uuid4().hex}"
    store = await open_metadata_store(
        zookeeper_server.url(chroot), data_dir=tmp_path, reactor=reactor
    )
    other = await open_metadata_store(
        zookeeper_server.url(chroot + "-other"), data_dir=tmp_path, reactor=reactor
    )
    try:
        assert isinstance(store, ZooKeeperMetadataStore)
        before_ms = int(time.time() * 1000)
        stat = await store.put("/admin/clusters/c1", b'{"serviceUrl": "x"}')
        assert isinstance(stat.created_ms, int)
        assert abs(stat.created_ms - before_ms) < 60_000
        await store.put("/live", b"me", ephemeral=True)
        value, ephemeral = await threads.deferToThread(
            read_with_kazoo, zookeeper_server.hosts, f"{chroot}/admin/clusters/c1"
        )
        assert (value, ephemeral) == (b'{"serviceUrl": "x"}', False)
        value, ephemeral = await threads.deferToThread(
            read_with_kazoo, zookeeper_server.hosts, f"{chroot}/live"
        )
        assert (value, ephemeral) == (b"me", True)
        assert await store.children("/") == ["admin", "live"]
        assert await other.children("/") == []
        assert await other.get("/live") is None
    finally:
        await store.close()
        await other.close()


@pytest_twisted.ensureDeferred
async def test_a_write_over_zookeepers_request_limit_fails_and_keeps_the_session(
    zk_url: str,
) -> None:
    """A value too large for one ZooKeeper request fails with ValueError before it is sent
    (ZooKeeper would drop the connection); a value just under the limit is stored."""
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    events: list[SessionEvent] = []
    store.add_session_listener(events.append)
    try:
        with pytest.raises(ValueError, match="request limit"):
            await store.put("/big", b"x" * MAX_VALUE_BYTES)
        with pytest.raises(ValueError, match="request limit"):
            await store.create_sequential("/deep/a/b/n-", b"x" * (ZK_MAX_PACKET - 500))
        assert await store.exists("/big") is None
        assert await store.exists("/deep") is None
        fits = b"y" * (MAX_VALUE_BYTES - 8 * 1024)
        await store.put("/big", fits)
        assert (await store.get("/big")).value == fits
        assert events == []
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_reserved_root_names_are_hidden_and_refused(
    zookeeper_server: ZooKeeperServer,
) -> None:
    """Without a chroot the server's /zookeeper and the store's /__polybroker are not listed
    and cannot be written through the store."""
    store = await ZooKeeperMetadataStore.open(zookeeper_server.url(), reactor)
    try:
        names = await store.children("/")
        assert "zookeeper" not in names
        assert "__polybroker" not in names
        for path in ("/zookeeper/x", "/__polybroker/sequence"):
            with pytest.raises(ValueError, match="reserved"):
                await store.put(path, b"x")
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_opening_a_server_that_does_not_answer_fails_in_bounded_time() -> None:
    """No server on the port: open fails with MetadataError after the connect timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(MetadataError, match="cannot connect"):
        await ZooKeeperMetadataStore.open(
            f"zk://127.0.0.1:{port}/x", reactor, connect_timeout_s=1.0
        )
    assert time.monotonic() - start < 10


@pytest_twisted.ensureDeferred
async def test_every_change_by_another_session_is_reported_once(zk_url: str) -> None:
    """Bursts of changes made by another session, faster than one-shot watches can be set
    again, still give one notification per change (counted from versions)."""
    watcher = await ZooKeeperMetadataStore.open(zk_url, reactor)
    writer = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        seen: list[EventType] = []
        watcher.watch("/n", lambda n: seen.append(n.type))
        assert await watcher.exists("/n") is None  # runs once the watch is armed
        await writer.put("/n", b"0")
        await DeferredList([writer.put("/n", b"%d" % i) for i in range(1, 41)])
        await DeferredList([writer.put(f"/n/c{i}", b"") for i in range(15)])
        await DeferredList([writer.delete(f"/n/c{i}") for i in range(5)])
        expected = (
            [EventType.CREATED] + [EventType.MODIFIED] * 40 + [EventType.CHILDREN_CHANGED] * 20
        )
        await eventually(lambda: sorted(seen, key=order) == expected, 20, "every change")
        assert seen[0] is EventType.CREATED
        assert (await watcher.get("/n")).value == b"40"
    finally:
        await watcher.close()
        await writer.close()


def order(t: EventType) -> int:
    return [EventType.CREATED, EventType.MODIFIED, EventType.CHILDREN_CHANGED].index(t)


@pytest_twisted.ensureDeferred
async def test_sequential_nodes_of_two_sessions_are_unique_and_ordered(zk_url: str) -> None:
    """Two sessions creating sequential nodes under one parent at once: all suffixes differ,
    each session's are increasing, and the parent lists them in creation order."""
    a = await ZooKeeperMetadataStore.open(zk_url, reactor)
    b = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        results = await DeferredList(
            [s.create_sequential("/q/item-", b"") for _ in range(25) for s in (a, b)],
            fireOnOneErrback=True,
        )
        paths = [p for _, p in results]
        assert len(set(paths)) == 50
        assert paths[0::2] == sorted(paths[0::2])
        assert paths[1::2] == sorted(paths[1::2])
        assert await a.children("/q") == sorted(p.rsplit("/", 1)[1] for p in paths)
    finally:
        await a.close()
        await b.close()
