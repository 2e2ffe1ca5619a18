"""A publish read as one frame (``PublishFrame``) is handled as its three frames would be."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer

from polybroker.protocols.amqp import codec as c

QUEUE_LEDGER = "public/default/persistent/amqp.queue.q"


def _whole(channel: int, body: bytes, key: str = "q") -> bytes:
    return c.encode_content(
        channel,
        c.BasicPublish(exchange="", routing_key=key),
        c.BasicProperties(delivery_mode=2),
        body,
        131072,
    )


def _publisher(**config: object) -> Peer:
    p = Peer(**config)
    p.handshake()
    for channel in (1, 2):
        p.method(channel, c.ChannelOpen())
        p.method(channel, c.ConfirmSelect())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.clock.advance(0)
    p.methods()
    return p


def test_whole_publishes_in_one_input_are_stored_confirmed_and_delivered_in_order() -> None:
    """Publishes whose frames arrive whole, several per input, are stored, confirmed and
    delivered in their order, bodies and properties intact."""
    p = _publisher()
    p.send(_whole(1, b"first"))  # a connection's first publish takes the frame-by-frame path
    p.send(b"".join(_whole(1, f"m{i}".encode()) for i in range(3)))
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True), c.BasicAck(4, True)]
    p.method(1, c.BasicConsume(queue="q", consumer_tag="t", no_ack=True))
    frames = p.received()
    assert [f.data for f in frames if isinstance(f, c.BodyFrame)] == [
        b"first",
        b"m0",
        b"m1",
        b"m2",
    ]
    headers = [f for f in frames if isinstance(f, c.HeaderFrame)]
    assert [h.properties.delivery_mode for h in headers] == [2, 2, 2, 2]


def test_a_whole_oversize_publish_closes_its_channel_only() -> None:
    """A whole publish above maxMessageSize is 406 on its channel, as when its frames come
    one by one; the publish after it on another channel is stored and confirmed."""
    p = _publisher(maxMessageSize=1024)
    p.send(_whole(1, b"first"))
    p.clock.advance(0)
    p.methods()
    p.send(_whole(1, b"x" * 2000) + _whole(2, b"fine"))
    p.clock.advance(0)
    out = p.methods()
    assert isinstance(out[0], c.ChannelClose)
    assert out[0].reply_code == c.PRECONDITION_FAILED
    assert out[1:] == [c.BasicAck(1, True)]
    assert len(p.ledgers.ledger(QUEUE_LEDGER).data.entries) == 2


def test_a_whole_publish_on_an_unopened_channel_closes_the_connection() -> None:
    """A whole publish on a channel never opened is the connection's 504, as its method
    frame alone would be."""
    p = _publisher()
    p.send(_whole(1, b"first"))
    p.clock.advance(0)
    p.methods()
    p.send(_whole(9, b"stray"))
    (close,) = p.methods()
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.CHANNEL_ERROR


def test_whole_publishes_in_a_transaction_wait_for_the_commit() -> None:
    """In a transaction, whole publishes are stored only at tx.commit, whose reply follows
    their durable write."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.TxSelect())
    p.clock.advance(0)
    p.methods()
    p.send(_whole(1, b"a") + _whole(1, b"b"))
    p.clock.advance(0)
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    assert ledger.data.entries == []
    ledger.hold_appends = True
    p.method(1, c.TxCommit())
    p.clock.advance(0)
    assert p.methods() == []
    ledger.release_appends()
    p.clock.advance(0)
    assert p.methods() == [c.TxCommitOk()]
