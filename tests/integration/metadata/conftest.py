"""Fixtures of the ZooKeeper store's own integration tests: one real ZooKeeper server per test
session (each test under a chroot of its own), and servers of a test's own where it stops or
pauses one."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "contract"))

import zk_server
from zk_server import ZooKeeperServer

#: One real ZooKeeper server for the test session (``zk_server.zookeeper_server``).
zookeeper_server = zk_server.zookeeper_server


@pytest.fixture
def zk_url(zookeeper_server: ZooKeeperServer) -> str:
    """A ``zk://`` URL under a fresh chroot."""
    return zookeeper_server.url(f"/store-{uuid.uuid4().hex}")
