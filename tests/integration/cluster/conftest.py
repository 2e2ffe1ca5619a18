"""Fixtures of the cluster tests: a real ZooKeeper (one per test session, each test under a
chroot of its own) and real ``polybroker bookie`` processes (see ``cluster_harness``)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "contract"))

import zk_server
from cluster_harness import BookieProcesses
from zk_server import ZooKeeperServer

#: One real ZooKeeper server for the test session (``zk_server.zookeeper_server``).
zookeeper_server = zk_server.zookeeper_server


@pytest.fixture
def zk_url(zookeeper_server: ZooKeeperServer) -> str:
    """A ``zk://`` URL under a fresh chroot: this test's own empty cluster."""
    return zookeeper_server.url(f"/cluster-{uuid.uuid4().hex}")


@pytest.fixture
def bookies(tmp_path: Path) -> Iterator[BookieProcesses]:
    """Starts bookie processes; all still running are stopped (by PID) at teardown."""
    procs = BookieProcesses(tmp_path)
    try:
        yield procs
    finally:
        procs.close()
