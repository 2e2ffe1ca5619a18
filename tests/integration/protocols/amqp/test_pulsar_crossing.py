"""amq.topic bridges AMQP and Pulsar: a routing key is a topic name, both ways."""

from __future__ import annotations

import gc
import time

import pika
import pulsar
import pytest_twisted
from amqp_harness import start_broker, stop_broker
from twisted.internet import threads


@pytest_twisted.ensureDeferred
async def test_amq_topic_bridges_both_ways_with_the_pulsar_client() -> None:
    """AMQP publishes to amq.topic reach a Pulsar consumer of topic R with headers and key;
    a queue bound with key P (exact or wildcard) gets what a Pulsar producer sends there."""
    broker = await start_broker(with_pulsar=True)

    def scenario() -> dict[str, object]:
        client = pulsar.Client(
            broker.pulsar_url,
            operation_timeout_seconds=10,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        )
        try:
            consumer = client.subscribe("orders", "s1")
            producer = client.create_producer("sensor.a")
            conn = broker.connect()
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish(
                "amq.topic",
                "orders",
                b"from-amqp",
                pika.BasicProperties(headers={"region": "eu"}, timestamp=1_700_000_000),
            )
            msg = consumer.receive(timeout_millis=10_000)
            consumer.acknowledge(msg)
            to_pulsar = (msg.data(), msg.properties().get("region"), msg.event_timestamp())

            ch.queue_declare("exact")
            ch.queue_bind("exact", "amq.topic", "orders")
            ch.queue_declare("wild")
            ch.queue_bind("wild", "amq.topic", "sensor.*")
            orders = client.create_producer("orders")
            orders.send(b"from-pulsar", properties={"k": "v"}, partition_key="pk")
            producer.send(b"reading")
            got: dict[str, tuple[bytes, str, object]] = {}
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                for q in ("exact", "wild"):
                    if q in got:
                        continue
                    method, props, body = ch.basic_get(q, auto_ack=True)
                    if body is not None:
                        got[q] = (body, method.routing_key, (props.headers or {}).get("k"))
            conn.close()
            return {"to_pulsar": to_pulsar, "got": got}
        finally:
            client.close()
            gc.collect()

    try:
        out = await broker.run(scenario)
    finally:
        await threads.deferToThread(gc.collect)
        await stop_broker(broker)
    assert out["to_pulsar"] == (b"from-amqp", "eu", 1_700_000_000_000)
    assert out["got"] == {
        "exact": (b"from-pulsar", "orders", "v"),
        "wild": (b"reading", "sensor.a", None),
    }


@pytest_twisted.ensureDeferred
async def test_a_wildcard_binding_gets_the_first_messages_of_topics_created_after_it() -> None:
    """A Pulsar producer that creates a topic a queue's amq.topic pattern covers: the queue
    gets every message from the first, and nothing published before the binding was made."""
    broker = await start_broker(with_pulsar=True)

    def scenario() -> list[tuple[bytes, str]]:
        client = pulsar.Client(
            broker.pulsar_url,
            operation_timeout_seconds=10,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        )
        try:
            client.create_producer("base.old.c").send(b"before-binding")
            conn = broker.connect()
            ch = conn.channel()
            ch.queue_declare("wild", durable=True)
            ch.queue_bind("wild", "amq.topic", "base.*.c")
            for name in ("base.b.c", "base.d.c"):
                producer = client.create_producer(name, batching_enabled=False)
                for i in range(3):
                    producer.send(f"{name}-{i}".encode())
            got: list[tuple[bytes, str]] = []
            deadline = time.monotonic() + 20
            while len(got) < 6 and time.monotonic() < deadline:
                method, _, body = ch.basic_get("wild", auto_ack=True)
                if body is not None:
                    got.append((body, method.routing_key))
            conn.close()
            return got
        finally:
            client.close()
            gc.collect()

    try:
        got = await broker.run(scenario)
    finally:
        await threads.deferToThread(gc.collect)
        await stop_broker(broker)
    expected = [
        (f"{name}-{i}".encode(), name) for name in ("base.b.c", "base.d.c") for i in range(3)
    ]
    assert sorted(got) == expected
