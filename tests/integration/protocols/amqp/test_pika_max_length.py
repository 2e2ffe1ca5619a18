"""x-max-length bounds the whole queue, not only what it holds in memory: a durable queue with
a backlog in its log beyond its in-memory window keeps at most max-length ready messages,
dropping (or dead-lettering) the oldest, or refusing new ones with x-overflow=reject-publish."""

from __future__ import annotations

import time

import pika
import pika.exceptions
import pytest
import pytest_twisted
from amqp_harness import Broker, restart_broker, start_broker, stop_broker

from polybroker.protocols.amqp.vhost import WINDOW

PERSISTENT = pika.BasicProperties(delivery_mode=2)
#: More than the queue's in-memory window, so most of the backlog waits in the log.
LIMIT = WINDOW + 500
TOTAL = 2 * LIMIT


def publish(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, n: int) -> None:
    """Publish m0..m<n-1> persistently, in committed transactions of 500."""
    ch.tx_select()
    for i in range(n):
        ch.basic_publish("", queue, f"m{i}".encode(), PERSISTENT)
        if i % 500 == 499:
            ch.tx_commit()
    ch.tx_commit()


def wait_count(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, n: int) -> int:
    """The queue's message count once it is ``n`` (or what it is after 20 s)."""
    deadline = time.monotonic() + 20
    count = -1
    while time.monotonic() < deadline:
        count = ch.queue_declare(queue, passive=True).method.message_count
        if count == n:
            break
    return count


def consume_all(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> list[bytes]:
    """Consume (auto-ack) until the queue is empty (one get-empty after a pause of 2 s)."""
    out: list[bytes] = []
    for _method, _props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=2):
        if body is None:
            break
        out.append(body)
    ch.cancel()
    return out


@pytest_twisted.ensureDeferred
async def test_max_length_drops_the_head_of_a_backlog_beyond_the_window(broker: Broker) -> None:
    """A durable queue limited to more than its window: of twice that many persistent
    messages it keeps the newest ``LIMIT``; the oldest go to its dead-letter exchange."""

    def scenario() -> tuple[int, list[bytes], int]:
        conn = broker.connect()
        ch = conn.channel()
        ch.exchange_declare("dlx", "fanout")
        ch.queue_declare("dead")
        ch.queue_bind("dead", "dlx")
        args = {"x-max-length": LIMIT, "x-dead-letter-exchange": "dlx"}
        ch.queue_declare("capped", durable=True, arguments=args)
        publish(ch, "capped", TOTAL)
        count = wait_count(ch, "capped", LIMIT)
        kept = consume_all(ch, "capped")
        dead = wait_count(ch, "dead", TOTAL - LIMIT)
        conn.close()
        return count, kept, dead

    count, kept, dead = await broker.run(scenario)
    assert count == LIMIT
    assert (len(kept), dead) == (LIMIT, TOTAL - LIMIT)
    assert kept == [f"m{i}".encode() for i in range(TOTAL - LIMIT, TOTAL)]
    assert dead == TOTAL - LIMIT


@pytest_twisted.ensureDeferred
async def test_max_length_holds_after_a_restart_with_a_backlog() -> None:
    """A queue restarted over a backlog of ``LIMIT`` messages, most of them beyond its
    window, counts that backlog: ten more publishes drop the ten oldest."""
    broker = await start_broker()
    try:

        def fill() -> None:
            conn = broker.connect()
            ch = conn.channel()
            ch.queue_declare("capped", durable=True, arguments={"x-max-length": LIMIT})
            publish(ch, "capped", LIMIT)
            conn.close()

        await broker.run(fill)
        broker = await restart_broker(broker)

        def more() -> tuple[int, list[bytes]]:
            conn = broker.connect()
            ch = conn.channel()
            publish(ch, "capped", 10)  # m0..m9 again, after the LIMIT stored before
            count = wait_count(ch, "capped", LIMIT)
            kept = consume_all(ch, "capped")
            conn.close()
            return count, kept

        count, kept = await broker.run(more)
    finally:
        await stop_broker(broker)
    assert count == LIMIT
    expected = [f"m{i}".encode() for i in range(10, LIMIT)] + [f"m{i}".encode() for i in range(10)]
    assert kept == expected


@pytest_twisted.ensureDeferred
async def test_reject_publish_nacks_what_a_full_queue_refuses(broker: Broker) -> None:
    """x-overflow=reject-publish: a full queue nacks the publish and keeps what it had."""

    def scenario() -> tuple[int, list[bytes]]:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        args = {"x-max-length": 3, "x-overflow": "reject-publish"}
        ch.queue_declare("strict", durable=True, arguments=args)
        nacked = 0
        for i in range(5):
            try:
                ch.basic_publish("", "strict", f"s{i}".encode(), PERSISTENT)
            except pika.exceptions.NackError:
                nacked += 1
        kept = consume_all(ch, "strict")
        conn.close()
        return nacked, kept

    nacked, kept = await broker.run(scenario)
    assert nacked == 2
    assert kept == [b"s0", b"s1", b"s2"]


@pytest_twisted.ensureDeferred
async def test_an_unknown_overflow_mode_fails_the_declare(broker: Broker) -> None:
    """x-overflow other than drop-head or reject-publish is a 406 on the declare."""

    def scenario() -> int:
        conn = broker.connect()
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare("odd", arguments={"x-max-length": 1, "x-overflow": "sideways"})
        conn.close()
        return e.value.reply_code

    assert await broker.run(scenario) == 406
