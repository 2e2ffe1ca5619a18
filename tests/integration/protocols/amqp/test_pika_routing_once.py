"""A message routed to several queues is stored once (pika against the broker): storage grows by
one entry per fanout, and every queue bound to one exchange keeps its messages across a restart."""

from __future__ import annotations

from typing import Any

import pika
import pytest_twisted
from amqp_harness import Broker, restart_broker, start_broker, stop_broker

NS = "public/default"


async def storage(broker: Broker) -> dict[str, int]:
    """Entries and bytes over every topic of the namespace, from the managed ledgers' stats
    (Pulsar's internal stats)."""
    total = {"entries": 0, "bytes": 0}
    for topic in await broker.service.topics_of_namespace(NS):
        stats: dict[str, Any] = await broker.service.internal_stats(topic)
        total["entries"] += int(stats["numberOfEntries"])
        total["bytes"] += int(stats["totalSize"])
    return total


def declare_fanout(ch: Any, queues: list[str]) -> None:
    ch.exchange_declare("fan", "fanout", durable=True)
    for q in queues:
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, "fan")


def drain(ch: Any, queue: str) -> list[bytes]:
    out: list[bytes] = []
    while True:
        _, _, body = ch.basic_get(queue, auto_ack=True)
        if body is None:
            return out
        out.append(body)


@pytest_twisted.ensureDeferred
async def test_fanout_to_five_queues_grows_storage_by_one_entry(broker: Broker) -> None:
    """Each confirmed fanout of a 20 kB body to five durable queues adds one entry (about
    20 kB) to storage, and each queue delivers every message."""
    queues = [f"q{i}" for i in range(5)]
    body = b"x" * 20_000

    def setup() -> None:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        declare_fanout(ch, queues)
        ch.basic_publish("fan", "", b"warm-up", pika.BasicProperties(delivery_mode=2))
        for q in queues:
            assert drain(ch, q) == [b"warm-up"]
        conn.close()

    def publish(n: int) -> None:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        for _ in range(n):
            ch.basic_publish("fan", "", body, pika.BasicProperties(delivery_mode=2))
        conn.close()

    def consume() -> dict[str, list[int]]:
        conn = broker.connect()
        ch = conn.channel()
        got = {q: [len(b) for b in drain(ch, q)] for q in queues}
        conn.close()
        return got

    await broker.run(setup)
    before = await storage(broker)
    await broker.run(publish, 3)
    after = await storage(broker)
    got = await broker.run(consume)
    assert after["entries"] - before["entries"] == 3
    assert 3 * len(body) < after["bytes"] - before["bytes"] < 4 * len(body)
    assert got == {q: [len(body)] * 3 for q in queues}


@pytest_twisted.ensureDeferred
async def test_restart_keeps_several_queues_bound_to_one_exchange() -> None:
    """Three durable queues on one fanout and a topic exchange: after a restart each has
    exactly what it had not acknowledged, in order, and routing goes on to all of them."""
    broker = await start_broker()

    def before() -> None:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        declare_fanout(ch, ["a", "b", "c"])
        ch.exchange_declare("t", "topic", durable=True)
        ch.queue_bind("a", "t", "eu.#")
        ch.queue_bind("b", "t", "*.de")
        for i in range(6):
            ch.basic_publish("fan", "", f"f{i}".encode(), pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("t", "eu.de", b"both", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("t", "eu.fr", b"a-only", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("fan", "", b"transient", pika.BasicProperties(delivery_mode=1))
        for _ in range(2):  # a acknowledges two, b takes one and never acknowledges it
            method, _, _ = ch.basic_get("a")
            ch.basic_ack(method.delivery_tag)
        assert ch.basic_get("b")[2] == b"f0"
        ch.queue_declare("a", passive=True)  # a round trip: the acks were processed
        conn.close()

    await broker.run(before)
    broker = await restart_broker(broker)
    try:

        def after() -> dict[str, list[bytes]]:
            conn = broker.connect()
            ch = conn.channel()
            got = {q: drain(ch, q) for q in ("a", "b", "c")}
            ch.confirm_delivery()
            ch.basic_publish("fan", "", b"again", mandatory=True)
            ch.basic_publish("t", "eu.de", b"both-again", mandatory=True)
            for q in ("a", "b", "c"):
                got[q + "+"] = drain(ch, q)
            conn.close()
            return got

        out = await broker.run(after)
    finally:
        await stop_broker(broker)
    fan = [f"f{i}".encode() for i in range(6)]
    # Order is kept within each exchange's log; the two logs may interleave.
    assert [m for m in out["a"] if m.startswith(b"f")] == fan[2:]
    assert [m for m in out["a"] if not m.startswith(b"f")] == [b"both", b"a-only"]
    assert [m for m in out["b"] if m.startswith(b"f")] == fan
    assert [m for m in out["b"] if not m.startswith(b"f")] == [b"both"]
    assert out["c"] == fan
    assert sorted(out["a+"]) == [b"again", b"both-again"]
    assert sorted(out["b+"]) == [b"again", b"both-again"]
    assert out["c+"] == [b"again"]
