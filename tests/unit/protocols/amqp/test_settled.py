"""Unit tests of partly settled entries: publishes of one input share a batch entry, and the
messages of it a queue settled are recorded, so neither a restart nor reading the entry again
hands them out a second time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer

from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.vhost import SETTLED_PERSIST_S


def setup(p: Peer, queues: tuple[str, ...] = ("q",), *, fanout: bool = False) -> None:
    p.handshake()
    p.method(1, c.ChannelOpen())
    if fanout:
        p.method(1, c.ExchangeDeclare(exchange="fan", type="fanout", durable=True))
    for q in queues:
        p.method(1, c.QueueDeclare(queue=q, durable=True))
        if fanout:
            p.method(1, c.QueueBind(queue=q, exchange="fan"))
    p.clock.advance(0)
    p.methods()


def publish_batch(p: Peer, n: int, exchange: str = "", key: str = "q") -> None:
    """Publish ``n`` persistent messages in one client input (one batch entry)."""
    chunks: list[bytes] = []
    send, p.send = p.send, chunks.append  # type: ignore[method-assign]
    try:
        for i in range(n):
            p.publish(1, exchange, key, f"m{i}".encode(), delivery_mode=2)
    finally:
        p.send = send  # type: ignore[method-assign]
    p.send(b"".join(chunks))
    p.clock.advance(0)
    p.methods()


def get_acked(p: Peer, queue: str, count: int) -> list[bytes]:
    """basic.get ``count`` messages and ack each."""
    out = []
    for _ in range(count):
        p.method(1, c.BasicGet(queue=queue, no_ack=False))
        p.clock.advance(0)
        frames = p.received()
        ok = next(f.method for f in frames if isinstance(f, c.MethodFrame))
        assert isinstance(ok, c.BasicGetOk)
        out.append(b"".join(f.data for f in frames if isinstance(f, c.BodyFrame)))
        p.method(1, c.BasicAck(delivery_tag=ok.delivery_tag))
    p.clock.advance(0)
    return out


def drain(p: Peer, queue: str) -> list[bytes]:
    out: list[bytes] = []
    while True:
        p.method(1, c.BasicGet(queue=queue, no_ack=True))
        p.clock.advance(0)
        frames = p.received()
        if any(
            isinstance(f, c.MethodFrame) and isinstance(f.method, c.BasicGetEmpty) for f in frames
        ):
            return out
        out.append(b"".join(f.data for f in frames if isinstance(f, c.BodyFrame)))


def restart(p: Peer) -> Peer:
    """Stop ``p`` abruptly (no flush) and start a broker over what it stored."""
    again = Peer(ledgers=p.ledgers, store=p.store)
    again.clock.advance(0)
    again.handshake()
    again.method(1, c.ChannelOpen())
    again.clock.advance(0)
    again.methods()
    return again


def test_acked_messages_of_a_batch_entry_are_not_handed_out_after_a_restart() -> None:
    """Two of five messages of one stored entry acked: once their record is written (at the
    cursor's pace), a broker restarted over the store delivers only the other three."""
    p = Peer()
    setup(p)
    publish_batch(p, 5)
    assert len(p.ledgers.ledger("public/default/persistent/amqp.queue.q").data.entries) == 1
    assert get_acked(p, "q", 2) == [b"m0", b"m1"]
    p.clock.advance(SETTLED_PERSIST_S)
    again = restart(p)
    assert drain(again, "q") == [b"m2", b"m3", b"m4"]


def test_tx_commit_replies_once_partial_acks_are_recorded() -> None:
    """Acks in a transaction: commit-ok is sent once the acked messages of a partly settled
    entry are recorded, and after a restart only the others come back."""
    p = Peer()
    setup(p)
    publish_batch(p, 4)
    p.method(1, c.TxSelect())
    p.clock.advance(0)
    assert p.methods() == [c.TxSelectOk()]
    p.method(1, c.BasicGet(queue="q", no_ack=False))
    p.clock.advance(0)
    tag = next(f.method for f in p.received() if isinstance(f, c.MethodFrame)).delivery_tag
    p.method(1, c.BasicAck(delivery_tag=tag))
    p.method(1, c.TxCommit())
    p.clock.advance(0)
    assert p.methods() == [c.TxCommitOk()]
    again = restart(p)
    assert drain(again, "q") == [b"m1", b"m2", b"m3"]


def test_a_shared_log_remembers_what_one_queue_settled() -> None:
    """On a fanout's log (one entry for two queues) queue a acks two of four; after a restart
    a gets the other two and b all four."""
    p = Peer()
    setup(p, ("a", "b"), fanout=True)
    publish_batch(p, 4, "fan", "")
    assert get_acked(p, "a", 2) == [b"m0", b"m1"]
    p.clock.advance(SETTLED_PERSIST_S)
    again = restart(p)
    assert drain(again, "a") == [b"m2", b"m3"]
    assert drain(again, "b") == [b"m0", b"m1", b"m2", b"m3"]


def test_the_record_is_dropped_once_the_entry_is_acked_and_with_the_queue() -> None:
    """Once every message of the entry is acked the record of it goes; deleting the queue
    removes what is left."""
    p = Peer()
    setup(p)
    publish_batch(p, 3)
    get_acked(p, "q", 1)
    p.clock.advance(SETTLED_PERSIST_S)
    root = "/amqp/public/default/settled/q"
    assert p.store.children(root).result  # recorded
    get_acked(p, "q", 2)
    p.clock.advance(SETTLED_PERSIST_S * 3)
    children = p.store.children(root).result
    assert children == []
    publish_batch(p, 3)
    get_acked(p, "q", 1)
    p.clock.advance(SETTLED_PERSIST_S)
    assert p.store.children(root).result
    p.method(1, c.QueueDelete(queue="q"))
    p.clock.advance(0)
    assert p.store.children(root).result == []


def test_tx_commit_records_entries_it_settled_whole() -> None:
    """An entry settled whole in a transaction is written to the record (marked all settled,
    until its ack on the subscription is durable) before commit-ok, which does not wait for
    the cursor's pace (the clock does not move)."""
    p = Peer()
    setup(p)
    publish_batch(p, 2)
    p.method(1, c.TxSelect())
    p.clock.advance(0)
    p.methods()
    for _ in range(2):
        p.method(1, c.BasicGet(queue="q", no_ack=False))
        p.clock.advance(0)
        tag = next(f.method for f in p.received() if isinstance(f, c.MethodFrame)).delivery_tag
        p.method(1, c.BasicAck(delivery_tag=tag))
    written: list[bytes] = []
    put = p.store.put

    def recording_put(path: str, value: bytes, *args: object, **kwargs: object) -> object:
        if "/settled/" in path:
            written.append(value)
        return put(path, value, *args, **kwargs)

    p.store.put = recording_put  # type: ignore[method-assign]
    p.method(1, c.TxCommit())
    assert p.methods() == [c.TxCommitOk()]
    assert any(json.loads(v)["entries"][0][2] == -1 for v in written)
