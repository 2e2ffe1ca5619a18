"""A queue reading an entry its vhost just stored takes the messages the vhost encoded into it
rather than decoding the entry again; any other bytes are decoded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer, consuming_peer

from polybroker.broker_core.messages import decode_entry, encode_entry
from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp import vhost as vhost_module

QUEUE_LEDGER = "public/default/persistent/amqp.queue.q"


def test_a_queue_takes_the_messages_of_an_entry_just_stored_without_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delivery of a message the queue reads right after its write carries the body,
    properties and routing key published, and the entry is not decoded on the way."""
    p = consuming_peer()
    decoded: list[bytes] = []

    def counting(data: bytes, **kw: Any) -> Any:
        decoded.append(data)
        return decode_entry(data, **kw)

    monkeypatch.setattr(vhost_module, "decode_entry", counting)
    props = c.BasicProperties(content_type="text/plain", delivery_mode=2, headers={"h": "v"})
    p.send(c.encode_content(1, c.BasicPublish(exchange="", routing_key="q"), props, b"b1", 4096))
    p.clock.advance(0)
    p.clock.advance(0)
    frames = p.received()
    deliver = next(f.method for f in frames if isinstance(f, c.MethodFrame))
    header = next(f for f in frames if isinstance(f, c.HeaderFrame))
    assert isinstance(deliver, c.BasicDeliver)
    assert (deliver.exchange, deliver.routing_key, deliver.redelivered) == ("", "q", False)
    assert header.properties.content_type == "text/plain"
    assert header.properties.delivery_mode == 2
    assert header.properties.headers == {"h": "v"}
    assert [f.data for f in frames if isinstance(f, c.BodyFrame)] == [b"b1"]
    assert decoded == []
    stored = p.ledgers.ledger(QUEUE_LEDGER).data.entries
    assert len(stored) == 1
    # What the queue took is what a decode of the stored bytes gives (bar the publish time
    # and sequence ids, which come from the entry).
    vh = p.conn.vhost
    kept = vh.messages_of(stored[0].data)
    fresh = decode_entry(stored[0].data)
    assert [(m.payload, m.key, m.properties, m.event_time_ms) for m in kept] == [
        (m.payload, m.key, m.properties, m.event_time_ms) for m in fresh
    ]


def test_equal_bytes_that_are_not_the_stored_ones_are_decoded() -> None:
    """Only the very bytes the vhost stored are looked up (an equal copy, as read back from
    a bookie or another broker, is decoded), and only the latest entries are kept."""
    p = consuming_peer()
    vh = p.conn.vhost
    p.send(
        c.encode_content(
            1, c.BasicPublish(exchange="", routing_key="q"), c.BasicProperties(), b"one", 4096
        )
    )
    p.clock.advance(0)
    p.clock.advance(0)
    data = p.ledgers.ledger(QUEUE_LEDGER).data.entries[0].data
    copy = bytes(bytearray(data))
    assert copy == data
    assert copy is not data
    assert vh.messages_of(data) is vh.messages_of(data)  # the kept list
    assert vh.messages_of(copy) is not vh.messages_of(data)  # decoded afresh
    assert [m.payload for m in vh.messages_of(copy)] == [b"one"]
    other = encode_entry(decode_entry(data), producer_name="x", sequence_id=0, publish_time_ms=1)
    assert [m.payload for m in vh.messages_of(other)] == [b"one"]
    for _ in range(vhost_module.STORED_KEEP):
        p.send(
            c.encode_content(
                1, c.BasicPublish(exchange="", routing_key="q"), c.BasicProperties(), b"n", 4096
            )
        )
        p.clock.advance(0)
    assert vh.messages_of(data) is not vh.messages_of(data)  # dropped: decoded each time
    assert len(vh._stored) == vhost_module.STORED_KEEP


def test_a_clients_publishes_and_acks_leave_at_the_end_of_its_input_without_a_timer() -> None:
    """The batch entry of an input's publishes and the acknowledgement of an input's basic.ack
    reach the log when the input ends, with nothing left scheduled for the next turn."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.BasicConsume(queue="q", consumer_tag="ct"))
    p.clock.advance(0)
    p.methods()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    publish = c.encode_content(
        1, c.BasicPublish(exchange="", routing_key="q"), c.BasicProperties(), b"m", 4096
    )
    p.send(publish * 2)
    assert _due(p) == []
    ledger.release_appends()  # appended within the input: no turn has passed
    assert len(ledger.data.entries) == 1  # both publishes in one batch entry
    p.clock.advance(0)
    tags = [
        f.method.delivery_tag
        for f in p.received()
        if isinstance(f, c.MethodFrame) and isinstance(f.method, c.BasicDeliver)
    ]
    assert tags == [1, 2]
    cursor = ledger._cursors["amqp"]
    before = cursor.mark_delete_position
    p.method(1, c.BasicAck(2, True))
    # Acknowledged on the log within the input (the entry is settled), no timer added.
    assert cursor.mark_delete_position > before
    assert _due(p) == []


def _due(p: Peer) -> list[Any]:
    """Calls scheduled for the reactor's next turn (timeouts and heartbeats aside)."""
    return [d for d in p.clock.getDelayedCalls() if d.getTime() <= p.clock.seconds()]
