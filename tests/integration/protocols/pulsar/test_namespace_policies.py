"""Namespace policies that change what the broker does, on a real standalone with the
official client: messageTTL (what is older is acknowledged on every subscription), the
autoTopicCreation override and the schema settings (compatibility strategy, auto update,
validation)."""

from __future__ import annotations

import contextlib
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
from standalone_process import http_json, start_standalone, stop_process

LOG = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


@contextlib.contextmanager
def standalone(
    tmp_path: Path, config: dict[str, object] | None = None
) -> Iterator[tuple[str, pulsar.Client]]:
    """A standalone (stopped at the end) and a client of it; yields its admin base URL."""
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{ports['brokerServicePort']}",
        logger=LOG,
        operation_timeout_seconds=10,
    )
    try:
        yield f"http://127.0.0.1:{ports['webServicePort']}/admin/v2", client
    finally:
        client.close()
        stop_process(proc)


def test_a_namespace_ttl_expires_old_messages_on_every_subscription(tmp_path: Path) -> None:
    config = {"messagingProtocols": "pulsar", "messageExpiryCheckIntervalInMinutes": 0.005}
    with standalone(tmp_path, config) as (admin, client):
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
        subs = http_json("GET", f"{admin}/persistent/public/ttl/old/stats")["subscriptions"]
        assert subs["idle"]["totalMsgExpired"] == 5
        # The consumer stays connected: it gets the one message it had been sent before the
        # expiry (its queue holds one), then the first published after it.
        client.create_producer(expiring).send(b"new")
        got = [live.receive(10_000).data() for _ in range(2)]
        assert got == [b"old-0", b"new"]


def test_a_namespace_decides_how_its_topics_are_auto_created(tmp_path: Path) -> None:
    """With the namespace's override, a producer's first use of a topic name creates it
    partitioned (3 partitions here), or is refused; other namespaces follow the broker."""
    with standalone(tmp_path) as (admin, client):
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


def _book(version: int) -> Any:
    """The same record, Book, at three versions: v2 adds a field with a default (the client's
    ``required_default``), v3 one without."""
    from pulsar.schema import Record, String

    if version == 1:

        class Book(Record):
            title = String()

    elif version == 2:

        class Book(Record):  # type: ignore[no-redef]
            title = String()
            isbn = String(required_default=True)

    else:

        class Book(Record):  # type: ignore[no-redef]
            title = String()
            isbn = String(required=True)

    return Book


def test_schema_changes_follow_the_namespace_strategy(tmp_path: Path) -> None:
    """Under the default strategy (FULL, as Pulsar's broker) a record may gain a field with a
    default, not one without; a namespace set to ALWAYS_COMPATIBLE takes it; a strategy Pulsar
    does not know is refused (412)."""
    from pulsar.schema import JsonSchema

    with standalone(tmp_path) as (admin, client):
        topic = "persistent://public/default/books"
        first = _book(1)
        client.create_producer(topic, schema=JsonSchema(first)).send(first(title="a"))
        client.create_producer(topic, schema=JsonSchema(_book(2)))
        with pytest.raises(pulsar.IncompatibleSchema):
            client.create_producer(topic, schema=JsonSchema(_book(3)))

        http_json("PUT", f"{admin}/namespaces/public/lax", {})
        strategy = f"{admin}/namespaces/public/lax/schemaCompatibilityStrategy"
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json("PUT", strategy, "SOMETIMES")
        assert refused.value.code == 412
        http_json("PUT", strategy, "ALWAYS_COMPATIBLE")
        lax = "persistent://public/lax/books"
        client.create_producer(lax, schema=JsonSchema(_book(1)))
        client.create_producer(lax, schema=JsonSchema(_book(3)))
        versions = http_json("GET", f"{admin}/schemas/public/lax/books/schema")["version"]
        assert versions == 1


def test_schema_auto_update_and_validation_flags_bind_producers(tmp_path: Path) -> None:
    """With isAllowAutoUpdateSchema false a producer may use a registered schema version but
    not add one; with schemaValidationEnforced a producer without a schema is refused on a
    topic that has one (a consumer without one is not)."""
    from pulsar.schema import JsonSchema

    with standalone(tmp_path) as (admin, client):
        ns = f"{admin}/namespaces/public/strict"
        http_json("PUT", ns, {})
        topic = "persistent://public/strict/books"
        client.create_producer(topic, schema=JsonSchema(_book(1)))
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json("POST", f"{ns}/isAllowAutoUpdateSchema", "no")
        assert refused.value.code == 412
        http_json("POST", f"{ns}/isAllowAutoUpdateSchema", False)
        http_json("POST", f"{ns}/schemaValidationEnforced", True)
        client.create_producer(topic, schema=JsonSchema(_book(1)))  # registered: taken
        with pytest.raises(pulsar.IncompatibleSchema):
            client.create_producer(topic, schema=JsonSchema(_book(2)))  # new: not added
        with pytest.raises(pulsar.IncompatibleSchema):
            client.create_producer(topic)  # bytes, no schema
        client.subscribe(topic, "plain").close()
        http_json("POST", f"{ns}/isAllowAutoUpdateSchema", True)
        client.create_producer(topic, schema=JsonSchema(_book(2)))


def test_producer_and_consumer_limits_follow_the_namespace_then_the_broker(
    tmp_path: Path,
) -> None:
    """maxProducersPerTopic, maxConsumersPerTopic and maxConsumersPerSubscription: the
    namespace's where set, else the broker's; a refused client gets Pulsar's busy errors and
    those already attached stay."""
    config = {"messagingProtocols": "pulsar", "maxProducersPerTopic": 2}
    with standalone(tmp_path, config) as (admin, client):
        ns = f"{admin}/namespaces/public/limits"
        http_json("PUT", ns, {})
        for field, value in [
            ("maxProducersPerTopic", 1),
            ("maxConsumersPerTopic", 2),
            ("maxConsumersPerSubscription", 1),
        ]:
            http_json("POST", f"{ns}/{field}", value)
            assert http_json("GET", f"{ns}/{field}") == value
        for bad in (-1, 2**31, "3"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                http_json("POST", f"{ns}/maxProducersPerTopic", bad)
            assert refused.value.code == 412
        topic = "persistent://public/limits/t"

        first = client.create_producer(topic)
        with pytest.raises(pulsar.ProducerBusy):
            client.create_producer(topic)
        shared = pulsar.ConsumerType.Shared
        a = client.subscribe(topic, "s", consumer_type=shared)
        with pytest.raises(pulsar.ConsumerBusy):
            client.subscribe(topic, "s", consumer_type=shared)  # the subscription's limit
        b = client.subscribe(topic, "other", consumer_type=shared)
        with pytest.raises(pulsar.ConsumerBusy):
            client.subscribe(topic, "third", consumer_type=shared)  # the topic's limit
        path = topic.replace("://", "/")
        subs = http_json("GET", f"{admin}/{path}/stats")["subscriptions"]
        assert sorted(subs) == ["other", "s"]  # a refused consumer left no subscription
        first.send(b"still served")
        assert a.receive(10_000).data() == b"still served"
        assert b.receive(10_000).data() == b"still served"
        a.close()
        client.subscribe(topic, "s", consumer_type=shared).close()  # room again

        # Without the namespace's own limit, the broker's applies (2 producers here).
        http_json("DELETE", f"{ns}/maxProducersPerTopic")
        assert http_json("GET", f"{ns}/maxProducersPerTopic") is None
        second = client.create_producer(topic)
        with pytest.raises(pulsar.ProducerBusy):
            client.create_producer(topic)
        for producer in (first, second):
            producer.close()
        others = [client.create_producer("persistent://public/default/d") for _ in range(2)]
        with pytest.raises(pulsar.ProducerBusy):
            client.create_producer("persistent://public/default/d")
        for producer in others:
            producer.close()


def _backlog_of(admin: str, topic: str, subscription: str) -> int:
    path = topic.replace("://", "/")
    stats = http_json("GET", f"{admin}/{path}/stats")
    return int(stats["subscriptions"][subscription]["msgBacklog"])


def test_backlog_quota_holds_or_fails_producers_until_the_backlog_shrinks(
    tmp_path: Path,
) -> None:
    """A new producer is judged by the size of the backlog when it comes. (The periodic
    check, which also disconnects producers of a topic over its quota, is kept out of the
    way: it would cut off the producer sending past the quota here, as on Pulsar.)"""
    config = {"messagingProtocols": "pulsar", "backlogQuotaCheckIntervalInSeconds": 3600}
    with standalone(tmp_path, config) as (admin, client):
        for ns, policy, refusal in [
            ("hold", "producer_request_hold", pulsar.ProducerBlockedQuotaExceededError),
            ("fail", "producer_exception", pulsar.ProducerBlockedQuotaExceededException),
        ]:
            http_json("PUT", f"{admin}/namespaces/public/{ns}", {})
            quota = {"limitSize": 8 * 1024, "limitTime": -1, "policy": policy}
            http_json("POST", f"{admin}/namespaces/public/{ns}/backlogQuota", quota)
            got = http_json("GET", f"{admin}/namespaces/public/{ns}/backlogQuotaMap")
            assert got == {"destination_storage": quota}
            topic = f"persistent://public/{ns}/t"
            consumer = client.subscribe(topic, "slow")
            producer = client.create_producer(topic, batching_enabled=False)
            for i in range(16):
                producer.send(bytes([i]) * 1024)
            with pytest.raises(refusal):
                client.create_producer(topic)
            # Once the subscription catches up, producers are welcome again.
            for _ in range(16):
                consumer.acknowledge(consumer.receive(10_000))
            deadline = time.monotonic() + 30
            while _backlog_of(admin, topic, "slow"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            client.create_producer(topic).close()
            producer.close()
            consumer.close()


def test_backlog_quota_eviction_drops_the_oldest_by_size_and_by_age(tmp_path: Path) -> None:
    config = {"messagingProtocols": "pulsar", "backlogQuotaCheckIntervalInSeconds": 0.2}
    with standalone(tmp_path, config) as (admin, client):
        ns = f"{admin}/namespaces/public/evict"
        http_json("PUT", ns, {})
        evict = {"limitSize": 8 * 1024, "limitTime": -1, "policy": "consumer_backlog_eviction"}
        http_json("POST", f"{ns}/backlogQuota", evict)
        topic = "persistent://public/evict/size"
        consumer = client.subscribe(topic, "slow", receiver_queue_size=1)
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(32):
            producer.send(i.to_bytes(4, "big") * 256)  # 1 KiB each
        deadline = time.monotonic() + 30
        while (kept := _backlog_of(admin, topic, "slow")) > 8:  # 1 KiB and their metadata
            assert time.monotonic() < deadline, kept
            time.sleep(0.05)
        assert kept >= 6
        # The consumer stays connected: after the one its queue held, it gets the newest.
        got = [int.from_bytes(consumer.receive(10_000).data()[:4], "big") for _ in range(kept + 1)]
        assert got == [0, *range(32 - kept, 32)]
        producer.send(b"after")  # producers were never held back
        assert consumer.receive(10_000).data() == b"after"

        age = {"limitSize": -1, "limitTime": 1, "policy": "consumer_backlog_eviction"}
        http_json("POST", f"{ns}/backlogQuota?backlogQuotaType=message_age", age)
        old = "persistent://public/evict/age"
        client.subscribe(old, "idle").close()
        aged = client.create_producer(old, batching_enabled=False)
        for _ in range(5):
            aged.send(b"old")
        deadline = time.monotonic() + 30
        while _backlog_of(admin, old, "idle"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        http_json("DELETE", f"{ns}/backlogQuota?backlogQuotaType=message_age")
        assert set(http_json("GET", f"{ns}/backlogQuotaMap")) == {"destination_storage"}
        with pytest.raises(urllib.error.HTTPError) as refused:
            http_json("POST", f"{ns}/backlogQuota", {"limitSize": 1, "policy": "drop_all"})
        assert refused.value.code == 412


def test_a_topics_own_policies_win_over_its_namespaces(tmp_path: Path) -> None:
    """Pulsar's topic-level policies: set on a topic (or a partitioned topic, for all its
    partitions), they take precedence over the namespace's, for that topic only; removed, or
    with the topic deleted, the namespace's apply again."""
    config = {"messagingProtocols": "pulsar", "messageExpiryCheckIntervalInMinutes": 0.005}
    with standalone(tmp_path, config) as (admin, client):
        http_json("PUT", f"{admin}/namespaces/public/tp", {})
        http_json("POST", f"{admin}/namespaces/public/tp/maxProducersPerTopic", 3)
        own, other = "persistent://public/tp/own", "persistent://public/tp/other"
        for topic in (own, other):
            client.subscribe(topic, "idle").close()
        base = f"{admin}/persistent/public/tp/own"
        http_json("POST", f"{base}/maxProducers", 1)
        assert http_json("GET", f"{base}/maxProducers") == 1
        first = client.create_producer(own, batching_enabled=False)
        with pytest.raises(pulsar.ProducerBusy):
            client.create_producer(own)
        kept = [client.create_producer(other) for _ in range(3)]  # the namespace's 3
        with pytest.raises(pulsar.ProducerBusy):
            client.create_producer(other)

        for producer in (first, kept[0]):
            for _ in range(4):
                producer.send(b"old")
        time.sleep(1.1)  # the messages above are now more than a second old
        http_json("POST", f"{base}/messageTTL?messageTTL=1")  # as pulsar-admin sends it
        assert http_json("GET", f"{base}/messageTTL") == 1

        def backlog(topic: str) -> int:
            path = topic.replace("://", "/")
            return int(
                http_json("GET", f"{admin}/{path}/stats")["subscriptions"]["idle"]["msgBacklog"]
            )

        deadline = time.monotonic() + 30
        while backlog(own):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert backlog(other) == 4  # the namespace sets no TTL

        http_json("DELETE", f"{base}/maxProducers")
        assert http_json("GET", f"{base}/maxProducers") is None
        client.create_producer(own).close()  # the namespace's 3 apply again
        with pytest.raises(urllib.error.HTTPError) as missing:
            http_json("POST", f"{admin}/persistent/public/tp/nowhere/maxProducers", 1)
        assert missing.value.code == 404

        parted = f"{admin}/persistent/public/tp/parted"
        http_json("PUT", f"{parted}/partitions", 2)
        http_json("POST", f"{parted}/maxConsumers", 1)
        one = client.subscribe(
            "persistent://public/tp/parted", "s", consumer_type=pulsar.ConsumerType.Shared
        )
        with pytest.raises(pulsar.ConsumerBusy):
            client.subscribe("persistent://public/tp/parted-partition-1", "t")
        one.close()
        http_json("DELETE", f"{parted}/partitions")
        http_json("PUT", f"{parted}/partitions", 2)
        assert http_json("GET", f"{parted}/maxConsumers") is None  # went with the topic
        for producer in (first, *kept):
            producer.close()
