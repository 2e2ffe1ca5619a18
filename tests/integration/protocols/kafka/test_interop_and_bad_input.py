"""One log, two protocols: Pulsar and Kafka clients on one topic; bad input on the Kafka port."""

from __future__ import annotations

import gc
import os
import socket
import struct

import pulsar
import pytest_twisted
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka_harness import Broker
from twisted.internet import threads

CLIENT_LOG = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


@pytest_twisted.ensureDeferred
async def test_pulsar_and_kafka_clients_share_one_topic(broker: Broker) -> None:
    """Pulsar-produced messages reach a Kafka consumer (value, key, properties as headers,
    event time as timestamp) and Kafka records reach a Pulsar consumer, in one offset order."""

    def scenario() -> dict[str, object]:
        client = pulsar.Client(broker.pulsar_url, logger=CLIENT_LOG, operation_timeout_seconds=10)
        try:
            consumer = client.subscribe(
                "interop", "psub", initial_position=pulsar.InitialPosition.Earliest
            )
            producer = client.create_producer("interop", batching_enabled=False)
            for i in range(3):
                producer.send(
                    b"pulsar-%d" % i,
                    partition_key=f"pk{i}",
                    properties={"from": "pulsar", "i": str(i)},
                    event_timestamp=1_650_000_000_000 + i,
                )
            kp = KafkaProducer(bootstrap_servers=broker.bootstrap)
            for i in range(3):
                kp.send(
                    "interop",
                    value=b"kafka-%d" % i,
                    key=b"kk%d" % i,
                    headers=[("from", b"kafka")],
                    timestamp_ms=1_660_000_000_000 + i,
                )
            kp.flush()
            kp.close()
            kc = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=10_000)
            kc.assign([TopicPartition("interop", 0)])
            kc.seek_to_beginning()
            kafka_seen = []
            for r in kc:
                kafka_seen.append((r.offset, r.key, r.value, sorted(r.headers), r.timestamp))
                if len(kafka_seen) == 6:
                    break
            kc.close()
            pulsar_seen = []
            for _ in range(6):
                m = consumer.receive(10_000)
                pulsar_seen.append(
                    (m.data(), m.partition_key(), m.properties(), m.event_timestamp())
                )
                consumer.acknowledge(m)
            return {"kafka": kafka_seen, "pulsar": pulsar_seen}
        finally:
            client.close()

    r = await broker.run(scenario)
    await threads.deferToThread(gc.collect)
    kafka_seen = r["kafka"]
    assert [x[0] for x in kafka_seen] == list(range(6))
    assert kafka_seen[0] == (
        0,
        b"pk0",
        b"pulsar-0",
        [("from", b"pulsar"), ("i", b"0")],
        1_650_000_000_000,
    )
    assert kafka_seen[3] == (3, b"kk0", b"kafka-0", [("from", b"kafka")], 1_660_000_000_000)
    pulsar_seen = r["pulsar"]
    assert [x[0] for x in pulsar_seen] == [
        b"pulsar-0",
        b"pulsar-1",
        b"pulsar-2",
        b"kafka-0",
        b"kafka-1",
        b"kafka-2",
    ]
    assert pulsar_seen[4] == (b"kafka-1", "kk1", {"from": "kafka"}, 1_660_000_000_001)


def _closed_after(address: str, payload: bytes) -> bool:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        s.settimeout(10)
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True


@pytest_twisted.ensureDeferred
async def test_bad_input_closes_the_connection_and_the_broker_keeps_serving(
    broker: Broker,
) -> None:
    """Random bytes, an oversize frame, an unknown API key and a truncated body each close
    their connection; a Kafka client is served normally afterwards."""

    def scenario() -> list[tuple[int, bytes, bytes | None]]:
        header = struct.pack(">hhih", 1000, 0, 1, 1) + b"x"  # unknown API key 1000
        inputs = [
            os.urandom(4096),
            struct.pack(">i", 1 << 30) + b"\x00" * 100,
            struct.pack(">i", len(header)) + header,
            struct.pack(">i", 10) + struct.pack(">hhih", 3, 7, 1, 0),  # Metadata, cut short
        ]
        for payload in inputs:
            assert _closed_after(broker.bootstrap, payload)
        kp = KafkaProducer(bootstrap_servers=broker.bootstrap)
        kp.send("after-bad-input", value=b"still here").get(timeout=10)
        kp.close()
        kc = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=10_000)
        kc.assign([TopicPartition("after-bad-input", 0)])
        kc.seek_to_beginning()
        got = [(r.offset, r.value, r.key) for r in kc]
        kc.close()
        return got

    got = await broker.run(scenario)
    assert got == [(0, b"still here", None)]
