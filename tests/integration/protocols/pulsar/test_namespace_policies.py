"""Namespace policies that change what the broker does, on a real standalone with the
official client: messageTTL (what is older is acknowledged on every subscription) and the
autoTopicCreation override."""

from __future__ import annotations

import time
from pathlib import Path

import pulsar
import pytest
from standalone_process import http_json, start_standalone, stop_process

LOG = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


def test_a_namespace_ttl_expires_old_messages_on_every_subscription(tmp_path: Path) -> None:
    config = {"messagingProtocols": "pulsar", "messageExpiryCheckIntervalInMinutes": 0.005}
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    admin = f"http://127.0.0.1:{ports['webServicePort']}/admin/v2"
    client = pulsar.Client(f"pulsar://127.0.0.1:{ports['brokerServicePort']}", logger=LOG)
    try:
        http_json("PUT", f"{admin}/namespaces/public/ttl", {})
        kept, expiring = "persistent://public/default/kept", "persistent://public/ttl/old"
        for topic in (kept, expiring):
            client.subscribe(topic, "idle").close()
        live = client.subscribe(expiring, "live", receiver_queue_size=1)
        for topic in (kept, expiring):
            producer = client.create_producer(topic, batching_enabled=False)
            for i in range(5):
                producer.send(f"old-{i}".encode())
        time.sleep(1.1)  # the messages above are now more than a second old
        http_json("POST", f"{admin}/namespaces/public/ttl/messageTTL", 1)
        assert http_json("GET", f"{admin}/namespaces/public/ttl/messageTTL") == 1

        def backlogs(topic: str) -> dict[str, int]:
            path = topic.replace("://", "/")
            subs = http_json("GET", f"{admin}/{path}/stats")["subscriptions"]
            return {name: sub["msgBacklog"] for name, sub in subs.items()}

        deadline = time.monotonic() + 30
        while backlogs(expiring) != {"idle": 0, "live": 0}:
            assert time.monotonic() < deadline, backlogs(expiring)
            time.sleep(0.1)
        assert backlogs(kept) == {"idle": 5}
        # The consumer stays connected: it gets the one message it had been sent before the
        # expiry (its queue holds one), then the first published after it.
        client.create_producer(expiring).send(b"new")
        got = [live.receive(10_000).data() for _ in range(2)]
        assert got == [b"old-0", b"new"]
    finally:
        client.close()
        stop_process(proc)


def test_a_namespace_decides_how_its_topics_are_auto_created(tmp_path: Path) -> None:
    """With the namespace's override, a producer's first use of a topic name creates it
    partitioned (3 partitions here), or is refused; other namespaces follow the broker."""
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log")
    admin = f"http://127.0.0.1:{ports['webServicePort']}/admin/v2"
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{ports['brokerServicePort']}",
        logger=LOG,
        operation_timeout_seconds=10,
    )
    try:
        for ns in ("parts", "closed"):
            http_json("PUT", f"{admin}/namespaces/public/{ns}", {})
        http_json(
            "POST",
            f"{admin}/namespaces/public/parts/autoTopicCreation",
            {"allowAutoTopicCreation": True, "topicType": "partitioned", "defaultNumPartitions": 3},
        )
        http_json(
            "POST",
            f"{admin}/namespaces/public/closed/autoTopicCreation",
            {"allowAutoTopicCreation": False},
        )
        consumer = client.subscribe("persistent://public/parts/t", "s")
        client.create_producer("persistent://public/parts/t").send(b"x")
        assert consumer.receive(10_000).data() == b"x"
        assert http_json("GET", f"{admin}/persistent/public/parts/t/partitions") == {
            "partitions": 3
        }
        with pytest.raises(pulsar.TopicNotFound):
            client.create_producer("persistent://public/closed/t")
        client.create_producer("persistent://public/default/t").send(b"y")
        assert http_json("GET", f"{admin}/persistent/public/default/t/partitions") == {
            "partitions": 0
        }
    finally:
        client.close()
        stop_process(proc)
