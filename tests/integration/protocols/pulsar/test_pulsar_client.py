"""The official pulsar-client (C++ 4.2 inside) against the Pulsar handler, end to end."""

from __future__ import annotations

import re
import socket
import time
from collections import defaultdict
from typing import Any

import pulsar
import pytest
import pytest_twisted
from pulsar_harness import Broker, client

EARLIEST = pulsar.InitialPosition.Earliest


def drain(consumer: Any, n: int, ack: bool = True, timeout_ms: int = 5000) -> list[Any]:
    """Receive ``n`` messages (acknowledging them unless told not to)."""
    out = []
    for _ in range(n):
        m = consumer.receive(timeout_millis=timeout_ms)
        if ack:
            consumer.acknowledge(m)
        out.append(m)
    return out


def nothing_more(consumer: Any, wait_ms: int = 300) -> bool:
    """True when no further message arrives within ``wait_ms``."""
    try:
        consumer.receive(timeout_millis=wait_ms)
    except pulsar.Timeout:
        return True
    return False


@pytest_twisted.ensureDeferred
async def test_produce_consume_sync(broker: Broker) -> None:
    """Messages sent synchronously arrive in order with their keys and properties."""

    def scenario() -> list[tuple[bytes, str, dict[str, str]]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-basic", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-basic")
            for i in range(10):
                producer.send(f"m{i}".encode(), partition_key=f"k{i}", properties={"i": str(i)})
            return [(m.data(), m.partition_key(), m.properties()) for m in drain(consumer, 10)]
        finally:
            c.close()

    got = await broker.run(scenario)
    assert got == [(f"m{i}".encode(), f"k{i}", {"i": str(i)}) for i in range(10)]


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("compression", ["NONE", "LZ4", "ZLib", "ZSTD", "SNAPPY"])
@pytest_twisted.ensureDeferred
async def test_async_send_batching_and_compression(
    broker: Broker, batching: bool, compression: str
) -> None:
    """Async sends, batched or not, in every compression, arrive intact and in order."""
    topic = f"t-async-{batching}-{compression}"

    def scenario() -> tuple[list[bytes], list[Any]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(topic, "sub", initial_position=EARLIEST)
            producer = c.create_producer(
                topic,
                batching_enabled=batching,
                batching_max_messages=50,
                batching_max_publish_delay_ms=5,
                compression_type=getattr(pulsar.CompressionType, compression),
            )
            results: list[Any] = []
            for i in range(200):
                producer.send_async(
                    f"payload-{i}-".encode() * 5, lambda res, mid: results.append((res, mid))
                )
            producer.flush()
            deadline = time.monotonic() + 10
            while len(results) < 200 and time.monotonic() < deadline:
                time.sleep(0.01)
            return [m.data() for m in drain(consumer, 200)], results
        finally:
            c.close()

    data, results = await broker.run(scenario)
    assert data == [f"payload-{i}-".encode() * 5 for i in range(200)]
    assert len(results) == 200
    assert all(res == pulsar.Result.Ok for res, _ in results)


@pytest_twisted.ensureDeferred
async def test_batch_stored_as_one_entry(broker: Broker) -> None:
    """A batch of N messages is one entry holding N messages."""

    def scenario() -> None:
        c = client(broker.url)
        try:
            producer = c.create_producer(
                "t-batch-entry", batching_enabled=True, batching_max_publish_delay_ms=50
            )
            for i in range(10):
                producer.send_async(f"m{i}".encode(), None)
            producer.flush()
        finally:
            c.close()

    await broker.run(scenario)
    topic = broker.service.topics["persistent://public/default/t-batch-entry"]
    assert topic.msg_in == 10
    last = await topic.last_message_id()
    assert last.position.entry_id < 9  # fewer entries than messages


@pytest_twisted.ensureDeferred
async def test_shared_subscription_spreads_messages(broker: Broker) -> None:
    """Two Shared consumers split the messages between them, each delivered once."""

    def scenario() -> tuple[list[bytes], list[bytes]]:
        c = client(broker.url)
        try:
            kw = {"consumer_type": pulsar.ConsumerType.Shared, "receiver_queue_size": 10}
            a = c.subscribe("t-shared", "sub", initial_position=EARLIEST, **kw)
            b = c.subscribe("t-shared", "sub", initial_position=EARLIEST, **kw)
            producer = c.create_producer("t-shared")
            for i in range(40):
                producer.send(f"m{i}".encode())
            got_a: list[bytes] = []
            got_b: list[bytes] = []
            deadline = time.monotonic() + 10
            while len(got_a) + len(got_b) < 40 and time.monotonic() < deadline:
                for cons, got in ((a, got_a), (b, got_b)):
                    try:
                        m = cons.receive(timeout_millis=50)
                    except pulsar.Timeout:
                        continue
                    cons.acknowledge(m)
                    got.append(m.data())
            return got_a, got_b
        finally:
            c.close()

    got_a, got_b = await broker.run(scenario)
    assert sorted(got_a + got_b) == sorted(f"m{i}".encode() for i in range(40))
    assert got_a
    assert got_b


@pytest_twisted.ensureDeferred
async def test_exclusive_refuses_second_consumer(broker: Broker) -> None:
    """A second consumer on an Exclusive subscription is refused (ConsumerBusy)."""

    def scenario() -> str:
        c = client(broker.url)
        try:
            c.subscribe("t-excl", "sub")
            try:
                c.subscribe("t-excl", "sub")
            except pulsar.ConsumerBusy:
                return "busy"
            return "accepted"
        finally:
            c.close()

    assert await broker.run(scenario) == "busy"


@pytest_twisted.ensureDeferred
async def test_failover_delivers_to_one_consumer_then_the_other(broker: Broker) -> None:
    """Failover: one consumer gets everything; when it leaves, the standby takes over."""

    def scenario() -> tuple[int, int, int]:
        c = client(broker.url)
        try:
            kw = {"consumer_type": pulsar.ConsumerType.Failover}
            a = c.subscribe("t-fo", "sub", consumer_name="a", initial_position=EARLIEST, **kw)
            b = c.subscribe("t-fo", "sub", consumer_name="b", initial_position=EARLIEST, **kw)
            producer = c.create_producer("t-fo")
            for i in range(10):
                producer.send(f"m{i}".encode())
            first = len(drain(a, 10))
            idle = 0 if nothing_more(b) else 1
            a.close()
            for i in range(5):
                producer.send(f"n{i}".encode())
            second = len(drain(b, 5))
            return first, idle, second
        finally:
            c.close()

    assert await broker.run(scenario) == (10, 0, 5)


@pytest_twisted.ensureDeferred
async def test_key_shared_keeps_order_per_key(broker: Broker) -> None:
    """Key_Shared: each key goes to one consumer, in the order it was sent."""

    def scenario() -> dict[str, dict[str, list[int]]]:
        c = client(broker.url)
        try:
            kw = {"consumer_type": pulsar.ConsumerType.KeyShared}
            consumers = {
                n: c.subscribe("t-ks", "sub", initial_position=EARLIEST, consumer_name=n, **kw)
                for n in ("a", "b")
            }
            producer = c.create_producer("t-ks")
            for i in range(60):
                producer.send(f"{i}".encode(), partition_key=f"key-{i % 6}")
            seen: dict[str, dict[str, list[int]]] = {n: defaultdict(list) for n in consumers}
            total = 0
            deadline = time.monotonic() + 10
            while total < 60 and time.monotonic() < deadline:
                for n, cons in consumers.items():
                    try:
                        m = cons.receive(timeout_millis=50)
                    except pulsar.Timeout:
                        continue
                    cons.acknowledge(m)
                    seen[n][m.partition_key()].append(int(m.data()))
                    total += 1
            return {n: dict(v) for n, v in seen.items()}
        finally:
            c.close()

    seen = await broker.run(scenario)
    keys_a, keys_b = set(seen["a"]), set(seen["b"])
    assert keys_a | keys_b == {f"key-{k}" for k in range(6)}
    assert not keys_a & keys_b
    for per_key in seen.values():
        for key, values in per_key.items():
            assert values == [i for i in range(60) if f"key-{i % 6}" == key]


@pytest_twisted.ensureDeferred
async def test_acks_persist_across_consumer_reconnect(broker: Broker) -> None:
    """Acknowledged messages are not redelivered to a new consumer; the rest are."""

    def scenario() -> list[bytes]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-acks", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-acks")
            for i in range(10):
                producer.send(f"m{i}".encode())
            for m in drain(consumer, 10, ack=False)[:5]:
                consumer.acknowledge(m)
            consumer.close()  # flushes the grouped acks first
            again = c.subscribe("t-acks", "sub", initial_position=EARLIEST)
            got = [m.data() for m in drain(again, 5)]
            assert nothing_more(again)
            return got
        finally:
            c.close()

    assert await broker.run(scenario) == [f"m{i}".encode() for i in range(5, 10)]


@pytest_twisted.ensureDeferred
async def test_negative_ack_redelivers_with_count(broker: Broker) -> None:
    """A negatively acknowledged message comes back with its redelivery count raised."""

    def scenario() -> list[int]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(
                "t-nack",
                "sub",
                consumer_type=pulsar.ConsumerType.Shared,
                initial_position=EARLIEST,
                negative_ack_redelivery_delay_ms=100,
            )
            c.create_producer("t-nack").send(b"x")
            counts = []
            for _ in range(3):
                m = consumer.receive(timeout_millis=5000)
                counts.append(m.redelivery_count())
                consumer.negative_acknowledge(m)
            return counts
        finally:
            c.close()

    assert await broker.run(scenario) == [0, 1, 2]


@pytest_twisted.ensureDeferred
async def test_seek_by_message_id_and_time(broker: Broker) -> None:
    """Seek rewinds a subscription to a message id, and to a publish time."""

    def scenario() -> tuple[list[bytes], list[bytes]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-seek", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-seek")
            ids = [producer.send(f"m{i}".encode()) for i in range(10)]
            drain(consumer, 10)
            consumer.seek(ids[4])
            # The client drops the seek id itself and what precedes it (exclusive seek).
            after_id = [m.data() for m in drain(consumer, 5)]
            consumer.seek(0)
            after_time = [m.data() for m in drain(consumer, 10)]
            return after_id, after_time
        finally:
            c.close()

    after_id, after_time = await broker.run(scenario)
    assert after_id == [f"m{i}".encode() for i in range(5, 10)]
    assert after_time == [f"m{i}".encode() for i in range(10)]


@pytest_twisted.ensureDeferred
async def test_readers_from_earliest_latest_and_message_id(broker: Broker) -> None:
    """Readers start at the earliest message, after the latest, or after a given id."""

    def scenario() -> tuple[list[bytes], list[bytes], list[bytes], bool]:
        c = client(broker.url)
        try:
            producer = c.create_producer("t-reader")
            ids = [producer.send(f"m{i}".encode()) for i in range(5)]
            earliest = c.create_reader("t-reader", pulsar.MessageId.earliest)
            from_id = c.create_reader("t-reader", ids[2])
            latest = c.create_reader("t-reader", pulsar.MessageId.latest)
            has_before = latest.has_message_available()
            producer.send(b"new")
            e = [earliest.read_next(5000).data() for _ in range(6)]
            f = [from_id.read_next(5000).data() for _ in range(3)]
            la = [latest.read_next(5000).data()]
            return e, f, la, has_before
        finally:
            c.close()

    e, f, la, has_before = await broker.run(scenario)
    assert e == [f"m{i}".encode() for i in range(5)] + [b"new"]
    assert f == [b"m3", b"m4", b"new"]
    assert la == [b"new"]
    assert has_before is False


@pytest_twisted.ensureDeferred
async def test_partitioned_topic_produce_consume(broker: Broker) -> None:
    """A partitioned topic takes keyed messages on every partition and delivers them all."""
    await broker.service.create_partitioned_topic("t-part", 3)

    def scenario() -> tuple[list[bytes], set[int]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-part", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-part")
            for i in range(30):
                producer.send(f"m{i}".encode(), partition_key=f"k{i}")
            msgs = drain(consumer, 30)
            partitions = {m.topic_name().rsplit("-", 1)[-1] for m in msgs}
            return sorted(m.data() for m in msgs), {int(p) for p in partitions}
        finally:
            c.close()

    data, partitions = await broker.run(scenario)
    assert data == sorted(f"m{i}".encode() for i in range(30))
    assert partitions == {0, 1, 2}


@pytest_twisted.ensureDeferred
async def test_regex_subscription_lists_namespace_topics(broker: Broker) -> None:
    """A pattern subscription finds the namespace's matching topics and reads them."""

    def scenario() -> list[bytes]:
        c = client(broker.url)
        try:
            for name in ("t-rx-a", "t-rx-b", "t-other"):
                c.create_producer(name).send(name.encode())
            consumer = c.subscribe(
                re.compile("persistent://public/default/t-rx-.*"),
                "sub",
                initial_position=EARLIEST,
            )
            got = sorted(m.data() for m in drain(consumer, 2))
            assert nothing_more(consumer)
            return got
        finally:
            c.close()

    assert await broker.run(scenario) == [b"t-rx-a", b"t-rx-b"]


@pytest_twisted.ensureDeferred
async def test_exclusive_producer_fences_second(broker: Broker) -> None:
    """A second producer on a topic held by an Exclusive producer is refused."""

    def scenario() -> str:
        c = client(broker.url)
        try:
            c.create_producer("t-xprod", access_mode=pulsar.ProducerAccessMode.Exclusive)
            try:
                c.create_producer("t-xprod", access_mode=pulsar.ProducerAccessMode.Exclusive)
            except pulsar.ProducerFenced:
                return "fenced"
            return "accepted"
        finally:
            c.close()

    assert await broker.run(scenario) == "fenced"


@pytest_twisted.ensureDeferred
async def test_last_message_id_and_has_message_available(broker: Broker) -> None:
    """A consumer sees the topic's last message id and whether anything is left to read."""

    def scenario() -> tuple[bool, bool, Any, Any]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-last", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-last")
            sent = [producer.send(f"m{i}".encode()) for i in range(3)]
            reader = c.create_reader("t-last", pulsar.MessageId.earliest)
            before = reader.has_message_available()
            for _ in range(3):
                reader.read_next(5000)
            after = reader.has_message_available()
            return before, after, consumer.get_last_message_id(), sent[-1]
        finally:
            c.close()

    before, after, last, sent = await broker.run(scenario)
    assert (before, after) == (True, False)
    assert (last.ledger_id(), last.entry_id()) == (sent.ledger_id(), sent.entry_id())


@pytest_twisted.ensureDeferred
async def test_unload_makes_clients_reconnect(broker: Broker) -> None:
    """After the broker unloads a topic, producer and consumer carry on after reconnecting."""

    def before() -> Any:
        c = client(broker.url)
        consumer = c.subscribe("t-unload", "sub", initial_position=EARLIEST)
        producer = c.create_producer("t-unload")
        producer.send(b"one")
        assert drain(consumer, 1)[0].data() == b"one"
        return c, consumer, producer

    c, consumer, producer = await broker.run(before)
    await broker.service.unload_topic("t-unload")

    def after() -> bytes:
        try:
            producer.send(b"two")
            # "one" may come back first: its grouped ack may not have left before the unload.
            got = drain(consumer, 1)[0].data()
            return got if got == b"two" else drain(consumer, 1)[0].data()
        finally:
            c.close()

    assert await broker.run(after) == b"two"


@pytest_twisted.ensureDeferred
async def test_garbage_connection_does_not_disturb_a_client(broker: Broker) -> None:
    """A connection sending random bytes is closed; a working client keeps being served."""

    def scenario() -> tuple[bytes, list[bytes]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-garbage", "sub", initial_position=EARLIEST)
            producer = c.create_producer("t-garbage")
            producer.send(b"before")
            with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
                s.sendall(b"\xff\xff\xff\xff" + bytes(range(256)) * 4)
                closed = b""
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    closed += chunk
            producer.send(b"after")
            return closed, [m.data() for m in drain(consumer, 2)]
        finally:
            c.close()

    reply, got = await broker.run(scenario)
    assert got == [b"before", b"after"]
    assert len(reply) < 200  # an ERROR frame at most, then the close
