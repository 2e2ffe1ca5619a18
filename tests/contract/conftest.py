"""The metadata store implementations under contract test, one fixture over all of them.

``metadata`` yields a ``StoreHarness``: ``store`` is a fresh, empty store, and ``reopen()``
returns a new session that sees the same data, as another broker or a restarted process would
(memory: another session on the same tree; embedded: the same directory opened again, which
needs every earlier session closed first; zookeeper: another session under the same chroot of one
real ZooKeeper server, started once per test session, each test under a chroot of its own).
Every store a harness opened is closed at teardown.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor

from polybroker.metadata.api import MetadataStore
from polybroker.metadata.embedded import EmbeddedMetadataStore
from polybroker.metadata.memory import MemoryMetadataStore
from polybroker.metadata.zookeeper import ZooKeeperMetadataStore

sys.path.insert(0, str(Path(__file__).parent))

import zk_server

#: One real ZooKeeper server for the test session (``zk_server.zookeeper_server``).
zookeeper_server = zk_server.zookeeper_server

IMPLEMENTATIONS = ["memory", "embedded", "zookeeper"]


class StoreHarness:
    """One implementation under test (see the module docstring)."""

    def __init__(self, kind: str, directory: Path, zk_url: str = "") -> None:
        self.kind = kind
        self.directory = directory
        self.zk_url = zk_url
        self.opened: list[MetadataStore] = []
        self.store: MetadataStore

    async def open(self) -> MetadataStore:
        if self.kind == "memory":
            if self.opened:
                first = self.opened[0]
                assert isinstance(first, MemoryMetadataStore)
                store: MetadataStore = MemoryMetadataStore(reactor, tree=first.tree)
            else:
                store = MemoryMetadataStore(reactor)
        elif self.kind == "zookeeper":
            store = await ZooKeeperMetadataStore.open(self.zk_url, reactor)
        else:
            store = await EmbeddedMetadataStore.open(self.directory, reactor)
        self.opened.append(store)
        return store

    async def reopen(self) -> MetadataStore:
        """Return a new session over the same data (close the earlier ones first)."""
        return await self.open()

    async def close_all(self) -> None:
        for store in self.opened:
            await store.close()


@pytest_twisted.async_yield_fixture(params=IMPLEMENTATIONS)
async def metadata(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreHarness]:
    """A harness over a fresh store of each implementation."""
    zk_url = ""
    if request.param == "zookeeper":
        server = request.getfixturevalue("zookeeper_server")
        zk_url = server.url(f"/contract-{uuid.uuid4().hex}")
    harness = StoreHarness(request.param, tmp_path / "metadata", zk_url)
    harness.store = await harness.open()
    yield harness
    await harness.close_all()
