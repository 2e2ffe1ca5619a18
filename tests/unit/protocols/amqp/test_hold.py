"""Deliveries of entries stored for a publisher waiting on each confirm wait for the end of
the next client input (its next publish, read and stored first), or ``HOLD_S``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer

from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.vhost import HOLD_S, LOOP_S

QUEUE_LEDGER = "public/default/persistent/amqp.queue.q"


def _setup() -> tuple[Peer, Any]:
    """A confirming publisher (the peer's connection) and a consumer on a second one."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.ConfirmSelect())
    p.clock.advance(0)
    p.methods()
    consumer = p.connect()
    consumer.dataReceived(c.PROTOCOL_HEADER)
    consumer.dataReceived(
        c.encode_method(0, c.ConnectionStartOk({}, "PLAIN", b"\x00guest\x00guest"))
    )
    consumer.dataReceived(c.encode_method(0, c.ConnectionTuneOk(100, 8192, 0)))
    consumer.dataReceived(c.encode_method(0, c.ConnectionOpen("/")))
    consumer.dataReceived(c.encode_method(1, c.ChannelOpen()))
    consumer.dataReceived(
        c.encode_method(1, c.BasicConsume(queue="q", consumer_tag="t", no_ack=True))
    )
    p.clock.advance(0)
    consumer.transport.clear()
    p.ledgers.ledger(QUEUE_LEDGER).hold_appends = True
    return p, consumer


def _bodies(consumer: Any) -> list[bytes]:
    data = consumer.transport.value()
    consumer.transport.clear()
    reader = c.FrameReader(1 << 20, expect_header=False)
    reader.feed(data)
    return [f.data for f in reader.frames() if isinstance(f, c.BodyFrame)]


def _publish(p: Peer, body: bytes) -> None:
    p.send(
        c.encode_content(
            1,
            c.BasicPublish(exchange="", routing_key="q"),
            c.BasicProperties(delivery_mode=2),
            body,
            8192,
        )
    )


def test_a_looping_publishers_delivery_waits_for_its_next_publish() -> None:
    """A first publish is delivered as soon as it is stored; one that follows its confirm at
    once is confirmed when stored but delivered at the end of the next publish's input, after
    that publish was stored; with no input after it, after ``HOLD_S``."""
    p, consumer = _setup()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    _publish(p, b"m0")
    ledger.release_appends()
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True)]
    assert _bodies(consumer) == [b"m0"]
    _publish(p, b"m1")  # right after its confirm: a publisher waiting on each
    ledger.release_appends()
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(2, True)]
    assert _bodies(consumer) == []
    _publish(p, b"m2")
    assert ledger.held_appends == 1  # m2 is on its way to storage ...
    assert _bodies(consumer) == [b"m1"]  # ... when m1 is delivered
    ledger.release_appends()
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(3, True)]
    assert _bodies(consumer) == []
    p.clock.advance(HOLD_S)
    assert _bodies(consumer) == [b"m2"]


def test_what_is_held_goes_before_later_entries_of_a_queue() -> None:
    """Entries a queue reads while others wait in the hold (during a client input, or for a
    publisher not looping) reach the queue after those: its order holds."""
    p, _consumer = _setup()
    vh = p.conn.vhost
    q = vh.queues["q"]
    source = q.sources[q.topic]
    fed: list[str] = []
    q.fed = lambda s, deliveries: fed.extend(deliveries)  # type: ignore[method-assign]
    vh.hold(source, ["held"])  # type: ignore[list-item]
    vh.inputs += 1  # a client input under way
    source.send_entries(["later"])  # type: ignore[list-item]
    vh.inputs -= 1
    assert fed == ["held", "later"]
    assert vh.held == []
    vh.hold(source, ["held2"])  # type: ignore[list-item]
    vh.looping = False
    source.send_entries(["later2"])  # type: ignore[list-item]
    assert fed[2:] == ["held2", "later2"]
    p.clock.advance(HOLD_S)
    assert fed[4:] == []


def test_publishers_that_do_not_wait_on_confirms_are_delivered_at_once() -> None:
    """Without confirms, or with a confirm the publisher took long to follow, each delivery
    leaves as soon as its entry is stored."""
    p, consumer = _setup()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    for body in (b"a", b"b"):
        p.clock.advance(LOOP_S)
        _publish(p, body)
        ledger.release_appends()
        p.clock.advance(0)
        assert _bodies(consumer) == [body]
