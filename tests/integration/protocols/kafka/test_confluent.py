"""confluent-kafka (librdkafka) against the Kafka handler over loopback."""

from __future__ import annotations

import time

import pytest_twisted
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)
from kafka_harness import Broker


def _poll_n(consumer: Consumer, n: int, timeout_s: float = 20.0) -> list[object]:
    out: list[object] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                continue
            raise AssertionError(f"consumer error: {msg.error()}")
        out.append(msg)
    return out


@pytest_twisted.ensureDeferred
async def test_produce_consume_every_compression(broker: Broker) -> None:
    """librdkafka's batches in every codec come back with keys, headers and timestamps."""

    def scenario() -> dict[str, list[tuple[object, ...]]]:
        results = {}
        for codec in ("none", "gzip", "snappy", "lz4", "zstd"):
            topic = f"ck-{codec}"
            p = Producer(
                {"bootstrap.servers": broker.bootstrap, "compression.type": codec, "linger.ms": 5}
            )
            for i in range(10):
                p.produce(
                    topic,
                    value=b"value-%d" % i * 10,
                    key=b"key-%d" % i,
                    headers=[("n", str(i).encode())],
                    timestamp=1_600_000_000_000 + i,
                )
            assert p.flush(20) == 0
            c = Consumer(
                {
                    "bootstrap.servers": broker.bootstrap,
                    "group.id": f"g-{codec}",
                    "auto.offset.reset": "earliest",
                    "enable.auto.commit": False,
                }
            )
            c.subscribe([topic])
            got = _poll_n(c, 10)
            c.close()
            results[topic] = [
                (m.offset(), m.key(), m.value(), m.headers(), m.timestamp()[1]) for m in got
            ]
        return results

    results = await broker.run(scenario)
    for records in results.values():
        assert [r[0] for r in records] == list(range(10))
        assert [r[1] for r in records] == [b"key-%d" % i for i in range(10)]
        assert [r[2] for r in records] == [b"value-%d" % i * 10 for i in range(10)]
        assert [r[3] for r in records] == [[("n", str(i).encode())] for i in range(10)]
        assert [r[4] for r in records] == [1_600_000_000_000 + i for i in range(10)]


@pytest_twisted.ensureDeferred
async def test_admin_create_describe_partitions_delete(broker: Broker) -> None:
    """AdminClient creates, lists, grows and deletes topics; produce lands in partitions."""

    def scenario() -> dict[str, object]:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        fs = admin.create_topics([NewTopic("adm", num_partitions=3, replication_factor=1)])
        fs["adm"].result(10)
        again = admin.create_topics([NewTopic("adm", num_partitions=3, replication_factor=1)])
        try:
            again["adm"].result(10)
            dup = "no error"
        except Exception as e:
            dup = e.args[0].code()
        md = admin.list_topics(timeout=10)
        parts = len(md.topics["adm"].partitions)
        admin.create_partitions([NewPartitions("adm", 5)])["adm"].result(10)
        grown = len(admin.list_topics(timeout=10).topics["adm"].partitions)
        p = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(5):
            p.produce("adm", value=b"x", partition=i)
        assert p.flush(20) == 0
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "adm-reader"})
        marks = [c.get_watermark_offsets(TopicPartition("adm", i), timeout=10) for i in range(5)]
        c.close()
        described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, "adm")])
        configs = next(iter(described.values())).result(10)
        retention = (configs["retention.ms"].value, configs["retention.bytes"].value)
        admin.delete_topics(["adm"])["adm"].result(10)
        gone = "adm" not in admin.list_topics(timeout=10).topics
        refused = []
        for name in (".", ".."):  # names a path would take for another place
            try:
                admin.create_topics([NewTopic(name, 1, 1)])[name].result(10)
                refused.append(None)
            except Exception as e:
                refused.append(e.args[0].code())
        return {
            "dup": dup,
            "parts": parts,
            "grown": grown,
            "marks": marks,
            "gone": gone,
            "refused": refused,
            "retention": retention,
        }

    r = await broker.run(scenario)
    assert r["dup"] == KafkaError.TOPIC_ALREADY_EXISTS
    assert r["parts"] == 3
    assert r["grown"] == 5
    assert r["marks"] == [(0, 1)] * 5
    assert r["gone"] is True
    assert r["refused"] == [KafkaError.TOPIC_EXCEPTION] * 2
    assert r["retention"] == ("0", "0")  # Pulsar's defaults: what was consumed goes


@pytest_twisted.ensureDeferred
async def test_verbatim_entry_format_round_trips_and_converts_for_other_readers() -> None:
    """With kafkaEntryFormat=kafka, librdkafka's compressed batches are stored verbatim, fetched
    back intact, and still decode to messages for readers of other protocols."""
    from kafka_harness import start_broker, stop_broker

    from polybroker.broker_core import messages

    broker = await start_broker({"kafkaEntryFormat": "kafka"})
    try:

        def scenario() -> list[tuple[object, ...]]:
            p = Producer({"bootstrap.servers": broker.bootstrap, "compression.type": "zstd"})
            for i in range(20):
                p.produce("verbatim", value=b"v%d" % i, key=b"k%d" % i, headers=[("h", b"x")])
            assert p.flush(20) == 0
            c = Consumer(
                {
                    "bootstrap.servers": broker.bootstrap,
                    "group.id": "verbatim",
                    "auto.offset.reset": "earliest",
                }
            )
            c.subscribe(["verbatim"])
            got = _poll_n(c, 20)
            c.close()
            return [(m.offset(), m.key(), m.value(), m.headers()) for m in got]

        got = await broker.run(scenario)
        assert [g[0] for g in got] == list(range(20))
        assert got[7] == (7, b"k7", b"v7", [("h", b"x")])
        topic = await broker.service.get_topic("verbatim-partition-0")
        entries = await topic.read_from_index(0, 100)
        assert {messages.entry_format(e.data) for e in entries} == {"kafka"}
        decoded = [m for e in entries for m in messages.decode_entry(e.data)]
        assert [(m.key, m.payload, m.properties) for m in decoded][7] == (
            b"k7",
            b"v7",
            [("h", "x")],
        )
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_modern_table_clients_use_flexible_versions_and_topic_ids() -> None:
    """With kafkaApiVersions=modern, librdkafka fetches by topic id (Fetch v13+) and both
    Python clients use flexible Metadata and Produce versions; records still round-trip."""
    from kafka import KafkaConsumer, KafkaProducer
    from kafka import TopicPartition as KTopicPartition
    from kafka_harness import start_broker, stop_broker

    broker = await start_broker({"kafkaApiVersions": "modern"})
    try:

        def scenario() -> list[bytes]:
            kp = KafkaProducer(bootstrap_servers=broker.bootstrap)
            kp.send("modern", value=b"from-kafka-python").get(timeout=10)
            kp.close()
            p = Producer({"bootstrap.servers": broker.bootstrap})
            p.produce("modern", value=b"from-librdkafka")
            assert p.flush(20) == 0
            c = Consumer(
                {
                    "bootstrap.servers": broker.bootstrap,
                    "group.id": "modern",
                    "auto.offset.reset": "earliest",
                }
            )
            c.subscribe(["modern"])
            got = [m.value() for m in _poll_n(c, 2)]
            c.close()
            kc = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=10_000)
            kc.assign([KTopicPartition("modern", 0)])
            kc.seek_to_beginning()
            got += [r.value for r in kc]
            kc.close()
            return got

        got = await broker.run(scenario)
        assert got == [b"from-kafka-python", b"from-librdkafka"] * 2
        fetch_versions = {v for k, v in broker.seen if k == 1}
        assert max(fetch_versions) >= 13, broker.seen
        assert max(v for k, v in broker.seen if k == 3) >= 10
        assert max(v for k, v in broker.seen if k == 0) >= 9
        assert (18, 3) in broker.seen or (18, 4) in broker.seen
    finally:
        await stop_broker(broker)
