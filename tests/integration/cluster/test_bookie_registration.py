"""Real ``polybroker bookie`` processes registering in a real ZooKeeper, discovered through
``MetadataBookieRegistry``: a crashed bookie's node goes within its session timeout, a bookie
whose session expired (the process was frozen) announces itself again, a stopped one withdraws;
a data dir restarted under another address is refused unless the move is allowed."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest_twisted
from cluster_harness import BookieProcesses, eventually, port_of, run_to_exit
from twisted.internet import reactor, threads

from polybroker.ledger.bookie.cookie import AVAILABLE_PATH, COOKIES_PATH
from polybroker.ledger.registry import MetadataBookieRegistry
from polybroker.metadata.api import EventType
from polybroker.metadata.zookeeper import ZooKeeperMetadataStore

SESSION_MS = 2000
# ZooKeeper expires sessions on tick boundaries and the test's own polling adds a little.
EXPIRY_SLACK_S = 3.0
BOOKIE_CONFIG = {"metadataStoreSessionTimeoutMillis": SESSION_MS}


class Available:
    """Tracks the registered bookies through the registry's own cache and a children watch."""

    def __init__(self, store: ZooKeeperMetadataStore) -> None:
        self.store = store
        self.registry = MetadataBookieRegistry(store)
        self.names: list[str] = []
        self.changes = 0
        store.watch(AVAILABLE_PATH, self._changed)

    def _changed(self, n: object) -> None:
        self.changes += 1
        self.store.children(AVAILABLE_PATH).addCallback(self._got)

    def _got(self, names: list[str]) -> None:
        self.names = names

    async def refresh(self) -> list[str]:
        self.names = await self.store.children(AVAILABLE_PATH)
        return self.names


@pytest_twisted.ensureDeferred
async def test_bookies_register_and_a_killed_one_is_gone_within_the_session_timeout(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """Two bookie processes register; the registry offers both; after kill -9 of one its node
    is gone within the session timeout (plus ZooKeeper's tick), the other stays offered."""
    first = await threads.deferToThread(bookies.start, zk_url, BOOKIE_CONFIG)
    second = await threads.deferToThread(bookies.start, zk_url, BOOKIE_CONFIG)
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        available = Available(store)
        assert sorted(await available.refresh()) == sorted([first.address, second.address])
        assert sorted(await available.registry.writable_bookies()) == sorted(
            [first.address, second.address]
        )
        node = await store.get(f"{AVAILABLE_PATH}/{first.address}")
        assert node is not None
        assert node.stat.ephemeral
        registered = json.loads(node.value)
        cookie = await store.get(f"{COOKIES_PATH}/{first.address}")
        assert cookie is not None
        assert json.loads(cookie.value)["instance_id"] == registered["instance_id"]

        bookies.kill(first)
        await eventually(
            lambda: available.names == [second.address],
            SESSION_MS / 1000 + EXPIRY_SLACK_S,
            "the killed bookie's node to go",
        )
        assert await available.registry.writable_bookies() == [second.address]
        # The identity stays registered: a wiped disk must not rejoin under the address.
        assert await store.exists(f"{COOKIES_PATH}/{first.address}") is not None

        assert bookies.stop(second) == 0
        await eventually(lambda: available.names == [], 10, "the stopped bookie withdrawn")
        assert await available.registry.writable_bookies() == []
        available.registry.close()
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_a_bookie_whose_session_expired_announces_itself_again(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """A bookie frozen (SIGSTOP) past its session timeout loses its node; once it runs again
    it gets a new session and registers again under the same identity, and still serves."""
    bookie = await threads.deferToThread(bookies.start, zk_url, BOOKIE_CONFIG)
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        path = f"{AVAILABLE_PATH}/{bookie.address}"
        before = await store.get(path)
        assert before is not None
        seen: list[EventType] = []
        store.watch(path, lambda n: seen.append(n.type))
        assert await store.exists(path) is not None  # runs once the watch is armed

        bookies.send(bookie, signal.SIGSTOP)
        try:
            await eventually(
                lambda: seen == [EventType.DELETED],
                SESSION_MS / 1000 + EXPIRY_SLACK_S,
                "the frozen bookie's node to go",
            )
        finally:
            bookies.send(bookie, signal.SIGCONT)
        await eventually(
            lambda: seen == [EventType.DELETED, EventType.CREATED], 20, "announced again"
        )
        after = await store.get(path)
        assert after is not None
        assert after.stat.ephemeral
        assert json.loads(after.value) == json.loads(before.value)
        assert bookie.process.poll() is None
        log = bookie.log.read_text()
        assert "bookie announced again" in log, log

        # It still answers as a bookie (a plain TCP connect to its port).
        host, _, port = bookie.address.rpartition(":")
        await threads.deferToThread(_connects, host, int(port))

        assert bookies.stop(bookie) == 0
        await eventually(lambda: seen[-1] is EventType.DELETED, 10, "withdrawn at stop")
    finally:
        await store.close()


def _connects(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=5):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest_twisted.ensureDeferred
async def test_a_bookie_restarted_under_another_address_is_refused(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """A bookie process restarted on another port exits 1 with the reason, its data dir and
    ZooKeeper untouched; on port 0 it comes back under its recorded address; with
    allowBookieAddressChange it moves, same identity, registered under the new address."""
    first = await threads.deferToThread(bookies.start, zk_url, BOOKIE_CONFIG)
    assert bookies.stop(first) == 0
    store = await ZooKeeperMetadataStore.open(zk_url, reactor)
    try:
        cookies_before = sorted(await store.children(COOKIES_PATH))
        assert first.address in cookies_before
        disk_before = _snapshot(first.data_dir)
        other = _free_port()
        code, err = await threads.deferToThread(
            run_to_exit, zk_url, first.data_dir, other, BOOKIE_CONFIG
        )
        assert code == 1, err
        assert first.address in err, err
        assert "allowBookieAddressChange" in err, err
        assert _snapshot(first.data_dir) == disk_before
        assert sorted(await store.children(COOKIES_PATH)) == cookies_before
        assert await store.exists(f"{AVAILABLE_PATH}/127.0.0.1:{other}") is None

        again = await threads.deferToThread(
            lambda: bookies.start(zk_url, BOOKIE_CONFIG, data_dir=first.data_dir, port=0)
        )
        assert again.address == first.address
        assert bookies.stop(again) == 0

        moved = await threads.deferToThread(
            lambda: bookies.start(
                zk_url,
                {**BOOKIE_CONFIG, "allowBookieAddressChange": "true"},
                data_dir=first.data_dir,
                port=other,
            )
        )
        assert port_of(moved) == other
        old = await store.get(f"{COOKIES_PATH}/{first.address}")
        new = await store.get(f"{COOKIES_PATH}/{moved.address}")
        assert old is not None
        assert new is not None
        assert json.loads(new.value)["instance_id"] == json.loads(old.value)["instance_id"]
        assert json.loads(new.value)["address"] == moved.address
        assert bookies.stop(moved) == 0
    finally:
        await store.close()
