"""The load manager on a real cluster: a broker that joins late gets bundles shed to it by the
leader, and a bundle holding too many topics is split."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
from broker_harness import BrokerProcesses, initialize
from cluster_harness import BookieProcesses
from test_pulsar_cluster import NS, owners, wait_for

FAST = {
    "loadBalancerSheddingEnabled": "true",
    "loadBalancerSheddingIntervalMinutes": 0.02,  # about a second
    "loadBalancerReportUpdateMinIntervalMillis": 500,
}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[BrokerProcesses]:
    brokers = BrokerProcesses(tmp_path)
    try:
        yield brokers
    finally:
        brokers.close()


def touch_topics(service_url: str, names: list[str]) -> None:
    """Produce one message to each topic (each lookup assigns its bundle)."""
    client = pulsar.Client(service_url, operation_timeout_seconds=30)
    try:
        for name in names:
            producer = client.create_producer(f"persistent://{NS}/{name}")
            producer.send(b"x")
            producer.close()
    finally:
        client.close()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_the_leader_sheds_bundles_to_a_broker_that_joins(
    zk_url: str, bookies: BookieProcesses, procs: BrokerProcesses
) -> None:
    initialize(zk_url, bundles=8)
    bookies.start(zk_url)
    a = procs.start(zk_url, FAST)
    touch_topics(a.pulsar_url, [f"t{i}" for i in range(40)])
    held = [o for o in owners(a).values() if o is not None]
    assert held
    assert set(held) == {a.broker_id}
    b = procs.start(zk_url, FAST)

    def balanced() -> bool:
        counts = [o for o in owners(a).values() if o is not None]
        # A shed bundle is owned again once a client looks its topics up.
        touch_topics(a.pulsar_url, [f"t{i}" for i in range(40)])
        return counts.count(b.broker_id) >= 3 and counts.count(a.broker_id) >= 3

    wait_for(balanced, 60, "bundles shed to the new broker")


def test_a_bundle_with_too_many_topics_is_split(
    zk_url: str, bookies: BookieProcesses, procs: BrokerProcesses
) -> None:
    initialize(zk_url, bundles=1)
    bookies.start(zk_url)
    a = procs.start(
        zk_url,
        {
            "loadBalancerReportUpdateMinIntervalMillis": 500,
            "loadBalancerNamespaceBundleMaxTopics": 5,
            "loadBalancerSheddingEnabled": "false",
        },
    )
    touch_topics(a.pulsar_url, [f"s{i}" for i in range(12)])
    bundles_url = f"{a.http_url}/admin/v2/namespaces/{NS}/bundles"
    wait_for(lambda: get(bundles_url)["numBundles"] >= 2, 30, "the bundle split")
    # Its topics are still served, from the new bundles.
    touch_topics(a.pulsar_url, [f"s{i}" for i in range(12)])
