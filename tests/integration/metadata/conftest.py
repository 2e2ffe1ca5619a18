"""Fixtures of the ZooKeeper store's own integration tests: one real ZooKeeper server per test
session (each test under a chroot of its own), and servers of a test's own where it stops or
pauses one."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "contract"))

from zk_server import ZooKeeperServer


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One real ZooKeeper server for the test session (fails if it is not installed)."""
    server = ZooKeeperServer.start(tmp_path_factory.mktemp("zookeeper"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def zk_url(zookeeper_server: ZooKeeperServer) -> str:
    """A ``zk://`` URL under a fresh chroot."""
    return zookeeper_server.url(f"/store-{uuid.uuid4().hex}")
