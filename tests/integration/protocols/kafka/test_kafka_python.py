"""kafka-python 3 against the Kafka handler over loopback."""

from __future__ import annotations

import pytest_twisted
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic
from kafka.structs import OffsetAndMetadata
from kafka_harness import Broker


def _consume(bootstrap: str, topic: str, n: int, **kwargs: object) -> list[object]:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=10_000,
        **kwargs,
    )
    try:
        if "group_id" in kwargs:
            consumer.subscribe([topic])
        else:
            consumer.assign([TopicPartition(topic, 0)])
        out = []
        for record in consumer:
            out.append(record)
            if len(out) >= n:
                break
        return out
    finally:
        consumer.close()


@pytest_twisted.ensureDeferred
async def test_produce_and_fetch_every_compression(broker: Broker) -> None:
    """Records with keys, headers and timestamps come back identical for every codec."""

    def scenario() -> dict[str, list[tuple[object, ...]]]:
        results = {}
        for codec in (None, "gzip", "snappy", "lz4", "zstd"):
            topic = f"kp-{codec or 'none'}"
            producer = KafkaProducer(bootstrap_servers=broker.bootstrap, compression_type=codec)
            for i in range(5):
                producer.send(
                    topic,
                    value=b"v%d" % i * 20,
                    key=b"k%d" % i,
                    headers=[("h", b"x%d" % i)],
                    timestamp_ms=1_700_000_000_000 + i,
                )
            producer.flush()
            producer.close()
            got = _consume(broker.bootstrap, topic, 5)
            results[topic] = [(r.offset, r.key, r.value, r.headers, r.timestamp) for r in got]
        return results

    results = await broker.run(scenario)
    for records in results.values():
        assert [r[0] for r in records] == [0, 1, 2, 3, 4]
        assert [r[1] for r in records] == [b"k%d" % i for i in range(5)]
        assert [r[2] for r in records] == [b"v%d" % i * 20 for i in range(5)]
        assert [r[3] for r in records] == [[("h", b"x%d" % i)] for i in range(5)]
        assert [r[4] for r in records] == [1_700_000_000_000 + i for i in range(5)]


@pytest_twisted.ensureDeferred
async def test_admin_describe_cluster_configs_and_groups(broker: Broker) -> None:
    """kafka-python's admin client describes the cluster, topic and broker configs, and lists
    groups with their committed offsets."""

    def scenario() -> dict[str, object]:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        try:
            admin.create_topics([NewTopic("kp-admin", 2, 1)])
            cluster = admin.describe_cluster()
            configs = admin.describe_configs(
                [
                    ConfigResource(ConfigResourceType.TOPIC, "kp-admin"),
                    ConfigResource(ConfigResourceType.BROKER, "0"),
                ],
                config_filter="all",
            )
            consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="kp-g")
            consumer.commit({TopicPartition("kp-admin", 1): OffsetAndMetadata(0, "", -1)})
            consumer.close()
            groups = repr(admin.list_groups())
            offsets = repr(admin.list_group_offsets("kp-g"))
            return {
                "cluster": cluster,
                "configs": repr(configs),
                "groups": groups,
                "offsets": offsets,
            }
        finally:
            admin.close()

    r = await broker.run(scenario)
    assert r["cluster"]["cluster_id"] == "standalone"
    assert [b["broker_id"] for b in r["cluster"]["brokers"]] == [0]
    assert "retention.ms" in r["configs"]
    assert "message.max.bytes" in r["configs"]
    assert "kp-g" in r["groups"]
    assert "kp-admin" in r["offsets"]
