"""The ZooKeeper store's one-request operations (reads, versioned writes of unwatched nodes)
go to ZooKeeper from the reactor thread and come back from kazoo's connection thread, without
the worker thread; against a real server: they keep the issue order with the worker's
operations, a watched node still reports before its write fires, and an unanswered one fails
after the operation timeout (Rule Z5)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred, DeferredList
from zk_server import ZooKeeperServer

from polybroker.metadata.api import ConnectionLossError, EventType, Notification
from polybroker.metadata.zookeeper import ZooKeeperMetadataStore, _Seen


@pytest_twisted.ensureDeferred
async def test_one_request_operations_do_not_wait_for_the_worker_thread(zk_url: str) -> None:
    """With the worker thread held busy, reads and a versioned write of unwatched nodes
    still complete."""
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    gate = threading.Event()
    held: list[bool] = []
    try:
        stat = await store.put("/cursor", b"a")
        # Hold the worker thread (bounded, should a failure leave the gate closed).
        store._worker.submit(lambda: held.append(gate.wait(30)))
        stat = await store.put("/cursor", b"b", stat.version)
        assert stat.version == 1
        got = await store.get("/cursor")
        assert got is not None
        assert (got.value, got.stat.version) == (b"b", 1)
        assert (await store.exists("/cursor")).version == 1
        assert await store.children("/") == ["cursor"]
        assert await store.get("/missing") is None
        assert held == []  # all of it while the worker was held
    finally:
        gate.set()
        await store.close()


@pytest_twisted.ensureDeferred
async def test_direct_and_worker_operations_complete_in_issue_order(zk_url: str) -> None:
    """A burst mixing versioned writes and reads (one request each) with creations (the
    worker's): Deferreds fire in issue order, every versioned write finds the version the
    writes before it left, every read sees exactly the writes issued before it."""
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        await store.put("/n", b"0")
        order: list[int] = []
        ds: list[Deferred[Any]] = []
        version, last = 0, b"0"
        expected: dict[int, Any] = {}
        for i in range(1, 40):
            if i % 4 == 0:
                d = store.put(f"/made/{i}", b"x")  # creates parents: the worker's
            elif i % 4 == 3:
                d = store.get("/n")
                expected[i] = last
            else:
                last = b"%d" % i
                d = store.put("/n", last, version)
                version += 1
                expected[i] = version
            d.addCallback(lambda r, i=i: (order.append(i), r)[1])
            ds.append(d)
        results = await DeferredList(ds, fireOnOneErrback=True, consumeErrors=True)
        assert order == list(range(1, 40))
        for i, want in expected.items():
            got = results[i - 1][1]
            if isinstance(want, bytes):
                assert got.value == want, i
            else:
                assert got.version == want, i
        assert len(await store.children("/made")) == 9
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_versioned_write_of_a_watched_node_reports_before_it_fires(zk_url: str) -> None:
    """Rule Z2 holds for versioned writes too: the watch's MODIFIED comes first."""
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        stat = await store.put("/w", b"0")
        seen: list[Notification] = []
        store.watch("/w", seen.append)
        await store.get("/w")  # the watch's first read is done
        fired_after: list[int] = []
        d = store.put("/w", b"1", stat.version)
        d.addCallback(lambda s: fired_after.append(len(seen)))
        await d
        assert fired_after == [1]
        assert [n.type for n in seen] == [EventType.MODIFIED]
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_an_operation_issued_after_watch_fires_after_the_watchs_first_read(
    zk_url: str,
) -> None:
    """Rule Z2: a watch's first read comes before any operation issued after ``watch()``,
    also a one-request operation of another, unwatched node (with the worker held while
    both are issued)."""
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    gate = threading.Event()
    try:
        await store.put("/watched", b"0")
        await store.put("/other", b"0")
        store._worker.submit(gate.wait, 30)
        store.watch("/watched", lambda n: None)
        d = store.get("/other")
        gate.set()
        got = await d
        assert got is not None
        assert got.value == b"0"
        assert isinstance(store._seen.get("/watched"), _Seen)
    finally:
        gate.set()
        await store.close()


@pytest_twisted.ensureDeferred
async def test_an_unanswered_direct_operation_fails_after_the_operation_timeout(
    tmp_path: Path,
) -> None:
    """A paused server answers nothing: a read fails with ConnectionLossError after the
    operation timeout, its late answer changes nothing, and the session serves again once
    the server resumes."""
    server = await threads.deferToThread(ZooKeeperServer.start, tmp_path / "zk")
    store = None
    paused = False
    try:
        store = await ZooKeeperMetadataStore.open(
            server.url("/paused"), reactor, session_timeout_ms=30_000, operation_timeout_s=1.0
        )
        await store.put("/a", b"1")
        os.kill(server.process.pid, signal.SIGSTOP)
        paused = True
        start = time.monotonic()
        with pytest.raises(ConnectionLossError):
            await store.get("/a")
        assert 0.9 <= time.monotonic() - start < 10.0
        os.kill(server.process.pid, signal.SIGCONT)
        paused = False
        got = await store.get("/a")
        assert got is not None
        assert got.value == b"1"
    finally:
        if paused:
            os.kill(server.process.pid, signal.SIGCONT)
        if store is not None:
            await store.close()
        await threads.deferToThread(server.stop)
