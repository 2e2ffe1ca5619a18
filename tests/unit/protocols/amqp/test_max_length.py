"""Unit tests of x-max-length over what a queue holds in its log as well as in memory."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer
from test_settled import drain, publish_batch, restart

from polybroker.protocols.amqp import codec as c


def declare(p: Peer, **arguments: object) -> None:
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True, arguments=arguments))
    p.clock.advance(0)
    p.methods()


def test_a_restart_counts_the_backlog_without_the_settled_part_of_an_entry() -> None:
    """Eight messages in one entry, the three oldest dropped by x-max-length 5: after a
    restart the queue holds the newest five (the dropped ones are not counted twice)."""
    p = Peer()
    declare(p, **{"x-max-length": 5})
    publish_batch(p, 8)
    again = restart(p)
    assert drain(again, "q") == [b"m3", b"m4", b"m5", b"m6", b"m7"]


def test_the_count_leaves_out_settled_messages_of_a_partly_settled_entry() -> None:
    """queue.declare-ok counts what the queue holds: the dropped head of an entry is not in it."""
    p = Peer()
    declare(p, **{"x-max-length": 5})
    publish_batch(p, 8)
    p.method(1, c.QueueDeclare(queue="q", durable=True, passive=True))
    p.clock.advance(0)
    ok = p.methods()[0]
    assert isinstance(ok, c.QueueDeclareOk)
    assert ok.message_count == 5


def test_reject_publish_refuses_once_full() -> None:
    """x-overflow=reject-publish: publishes beyond the limit are nacked, the rest confirmed."""
    p = Peer()
    declare(p, **{"x-max-length": 2, "x-overflow": "reject-publish"})
    p.method(1, c.ConfirmSelect())
    p.clock.advance(0)
    p.methods()
    for i in range(3):
        p.publish(1, "", "q", f"r{i}".encode(), delivery_mode=2)
        p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True), c.BasicAck(2, True), c.BasicNack(3, False, False)]
    assert drain(p, "q") == [b"r0", b"r1"]
