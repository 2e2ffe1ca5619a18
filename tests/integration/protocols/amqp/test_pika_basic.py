"""pika against the AMQP handler: publish, consume, get, ack, confirms over loopback."""

from __future__ import annotations

import time

import pika
import pytest_twisted
from amqp_harness import Broker


@pytest_twisted.ensureDeferred
async def test_publish_and_get_through_default_exchange(broker: Broker) -> None:
    """A message published to the default exchange is fetched with basic.get."""

    def scenario() -> tuple[bytes, str | None, bool]:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("q1")
        ch.basic_publish("", "q1", b"hello", pika.BasicProperties(content_type="text/plain"))
        _, props, body = ch.basic_get("q1", auto_ack=True)
        empty = ch.basic_get("q1")
        conn.close()
        return body, props.content_type, empty == (None, None, None)

    body, ctype, empty = await broker.run(scenario)
    assert body == b"hello"
    assert ctype == "text/plain"
    assert empty


@pytest_twisted.ensureDeferred
async def test_consume_ack_prefetch_and_requeue(broker: Broker) -> None:
    """A consumer with prefetch 2 gets two at a time; a nack requeues as redelivered."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("work", durable=True)
        ch.confirm_delivery()
        for i in range(5):
            ch.basic_publish("", "work", f"m{i}".encode())
        ch.basic_qos(prefetch_count=2)
        got: list[tuple[bytes, bool, int]] = []

        def on_message(c: object, method: object, props: object, body: bytes) -> None:
            got.append((body, method.redelivered, method.delivery_tag))  # type: ignore[attr-defined]

        ch.basic_consume("work", on_message)
        conn.process_data_events(time_limit=0.5)
        first_batch = [b for b, _, _ in got]
        # nack the first with requeue: it comes back redelivered after the others.
        ch.basic_nack(got[0][2], requeue=True)
        ch.basic_ack(got[1][2])
        acked = {got[0][2], got[1][2]}
        deadline = time.monotonic() + 5
        while len(got) < 6 and time.monotonic() < deadline:
            for _, _, tag in got:
                if tag not in acked:
                    ch.basic_ack(tag)
                    acked.add(tag)
            conn.process_data_events(time_limit=0.05)
        conn.close()
        return {
            "first": first_batch,
            "redelivered": [b for b, r, _ in got if r],
            "all": sorted({b for b, _, _ in got}),
        }

    out = await broker.run(scenario)
    assert out["first"] == [b"m0", b"m1"]
    assert out["redelivered"] == [b"m0"]
    assert out["all"] == [f"m{i}".encode() for i in range(5)]


@pytest_twisted.ensureDeferred
async def test_exchange_types_route_as_rabbitmq(broker: Broker) -> None:
    """direct, fanout, topic (* and #), headers (all/any) and exchange-to-exchange bindings."""

    def scenario() -> dict[str, list[bytes]]:
        conn = broker.connect()
        ch = conn.channel()
        ch.exchange_declare("d", "direct")
        ch.exchange_declare("f", "fanout")
        ch.exchange_declare("t", "topic")
        ch.exchange_declare("h", "headers")
        ch.exchange_declare("up", "fanout")
        names = ["qd", "qf1", "qf2", "qstar", "qhash", "qall", "qany", "qe2e"]
        for n in names:
            ch.queue_declare(n)
        ch.queue_bind("qd", "d", "red")
        ch.queue_bind("qf1", "f")
        ch.queue_bind("qf2", "f")
        ch.queue_bind("qstar", "t", "a.*.c")
        ch.queue_bind("qhash", "t", "a.#")
        ch.queue_bind("qall", "h", arguments={"x-match": "all", "k1": "v1", "k2": "v2"})
        ch.queue_bind("qany", "h", arguments={"x-match": "any", "k1": "v1", "k2": "v2"})
        ch.exchange_bind("d", "up")
        ch.queue_bind("qe2e", "d", "blue")
        ch.confirm_delivery()
        ch.basic_publish("d", "red", b"direct-red")
        ch.basic_publish("d", "green", b"direct-green")
        ch.basic_publish("f", "whatever", b"fan")
        ch.basic_publish("t", "a.b.c", b"abc")
        ch.basic_publish("t", "a", b"a")
        ch.basic_publish("t", "a.b.c.d", b"abcd")
        ch.basic_publish("h", "", b"both", pika.BasicProperties(headers={"k1": "v1", "k2": "v2"}))
        ch.basic_publish("h", "", b"one", pika.BasicProperties(headers={"k1": "v1"}))
        ch.basic_publish("up", "blue", b"via-up")
        out: dict[str, list[bytes]] = {}
        for n in names:
            bodies = []
            while True:
                _, _, body = ch.basic_get(n, auto_ack=True)
                if body is None:
                    break
                bodies.append(body)
            out[n] = bodies
        conn.close()
        return out

    out = await broker.run(scenario)
    assert out["qd"] == [b"direct-red"]
    assert out["qf1"] == [b"fan"]
    assert out["qf2"] == [b"fan"]
    assert out["qstar"] == [b"abc"]
    assert out["qhash"] == [b"abc", b"a", b"abcd"]
    assert out["qall"] == [b"both"]
    assert out["qany"] == [b"both", b"one"]
    assert out["qe2e"] == [b"via-up"]
