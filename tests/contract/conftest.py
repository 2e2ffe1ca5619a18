"""The metadata store implementations under contract test, one fixture over all of them.

``metadata`` yields a ``StoreHarness``: ``store`` is a fresh, empty store, and ``reopen()``
returns a new session that sees the same data, as another broker or a restarted process would
(memory: another session on the same tree; embedded: the same directory opened again, which
needs every earlier session closed first). Every store a harness opened is closed at teardown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor

from polybroker.metadata.api import MetadataStore
from polybroker.metadata.embedded import EmbeddedMetadataStore
from polybroker.metadata.memory import MemoryMetadataStore

IMPLEMENTATIONS = ["memory", "embedded"]


class StoreHarness:
    """One implementation under test (see the module docstring)."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.directory = directory
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
    harness = StoreHarness(request.param, tmp_path / "metadata")
    harness.store = await harness.open()
    yield harness
    await harness.close_all()
