"""Unit tests of the AMQP connection over StringTransport, a Clock and the fake ledger."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest
from amqp_peer import Peer, consuming_peer
from fake_tcp import FakeTcp, SlowClient

from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.handler import parse_users, vhost_namespace

QUEUE_LEDGER = "public/default/persistent/amqp.queue.q"


def queue_peer(mode: c.Method) -> Peer:
    """A peer whose channel 1 declared the durable queue ``q`` and sent ``mode``
    (confirm.select, tx.select), with the set-up's answers read."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, mode)
    p.methods()
    return p


def test_handshake_tunes_and_opens() -> None:
    """The handshake offers the configured tuning and opens vhost '/'."""
    p = Peer(amqpFrameMax=65536, amqpHeartbeatSeconds=30)
    out = p.handshake()
    tune = out[0]
    assert isinstance(tune, c.ConnectionTune)
    assert (tune.frame_max, tune.heartbeat) == (65536, 30)
    assert isinstance(out[1], c.ConnectionOpenOk)
    assert p.conn.frame_max == 8192
    assert p.conn.channel_max == 100


def test_bad_password_is_access_refused() -> None:
    """A wrong password gets connection.close 403."""
    p = Peer()
    out = p.handshake(password=b"nope")
    assert isinstance(out[0], c.ConnectionClose)
    assert out[0].reply_code == c.ACCESS_REFUSED


def test_users_come_from_config() -> None:
    """Logins are those of amqpUsers; vhosts name namespaces."""
    p = Peer(amqpUsers="alice:secret")
    assert isinstance(p.handshake(b"alice", b"secret")[-1], c.ConnectionOpenOk)
    assert parse_users("a:1, b:2") == {"a": "1", "b": "2"}
    assert vhost_namespace("/") == "public/default"
    assert vhost_namespace("shop") == "public/shop"
    assert vhost_namespace("t/ns") == "t/ns"


def test_confirm_waits_for_the_durable_write_and_nacks_a_failed_one() -> None:
    """basic.ack of a publish is sent only once the append is durable; a failed one is nacked."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.ConfirmSelect())
    assert [type(m) for m in p.methods()] == [c.ChannelOpenOk, c.QueueDeclareOk, c.ConfirmSelectOk]
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    p.publish(1, "", "q", b"one", delivery_mode=2)
    p.publish(1, "", "q", b"two", delivery_mode=2)
    assert p.methods() == []
    ledger.release_appends(1)
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True)]
    ledger.release_appends(1, error=RuntimeError("bookies gone"))
    p.clock.advance(0)
    assert p.methods() == [c.BasicNack(2, False, False)]


def test_confirms_of_one_turn_are_coalesced() -> None:
    """Consecutive confirms completing together go out as one basic.ack with multiple set."""
    p = queue_peer(c.ConfirmSelect())
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    for i in range(5):
        p.publish(1, "", "q", str(i).encode(), delivery_mode=2)
    ledger.release_appends()
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(5, True)]


def test_tx_commit_replies_after_the_writes() -> None:
    """tx.commit-ok comes only once the transaction's publishes are durable."""
    p = queue_peer(c.TxSelect())
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    p.publish(1, "", "q", b"x")
    p.method(1, c.TxCommit())
    assert p.methods() == []
    ledger.release_appends()
    assert p.methods() == [c.TxCommitOk()]


@pytest.mark.parametrize(("publishes", "bytes_"), [(3, 1 << 20), (100, 30)])
def test_a_transaction_past_its_bound_closes_the_connection(
    monkeypatch: pytest.MonkeyPatch, publishes: int, bytes_: int
) -> None:
    """A transaction holds its publishes in memory until tx.commit: past MAX_TX_PUBLISHES (or
    MAX_TX_BYTES) the connection is closed with resource-error and nothing is stored; up to
    them, and again after each commit or rollback, it is served."""
    from polybroker.protocols.amqp import connection

    monkeypatch.setattr(connection, "MAX_TX_PUBLISHES", publishes)
    monkeypatch.setattr(connection, "MAX_TX_BYTES", bytes_)
    p = queue_peer(c.TxSelect())
    for _ in range(3):
        p.publish(1, "", "q", b"1234567890")
    p.method(1, c.TxRollback())
    for _ in range(3):
        p.publish(1, "", "q", b"1234567890")
    p.method(1, c.TxCommit())
    assert p.methods() == [c.TxRollbackOk(), c.TxCommitOk()]
    for _ in range(3):
        p.publish(1, "", "q", b"1234567890")
    assert p.methods() == []
    p.publish(1, "", "q", b"1234567890")
    (close,) = p.methods()
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.RESOURCE_ERROR
    assert "tx.commit" in close.reply_text
    assert p.ledgers.ledger(QUEUE_LEDGER).data.next_index == 3  # the first commit's messages


def test_content_frame_without_publish_is_unexpected_frame() -> None:
    """A body frame with no content method before it closes the connection with 505."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.methods()
    p.send(c._frame(c.FRAME_BODY, 1, b"stray"))
    (close,) = p.methods()
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.UNEXPECTED_FRAME
    p.method(0, c.ConnectionCloseOk())
    assert p.transport.disconnecting


def test_oversize_body_closes_the_channel_only() -> None:
    """A body above maxMessageSize is 406 on its channel; the connection stays open."""
    p = Peer(maxMessageSize=1024)
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(2, c.ChannelOpen())
    p.methods()
    p.method(1, c.BasicPublish(exchange="", routing_key="q"))
    header = (60).to_bytes(2, "big") + b"\x00\x00" + (4096).to_bytes(8, "big") + b"\x00\x00"
    p.send(c._frame(c.FRAME_HEADER, 1, header))
    p.send(c._frame(c.FRAME_BODY, 1, b"x" * 4000))
    (close,) = p.methods()
    assert isinstance(close, c.ChannelClose)
    assert close.reply_code == c.PRECONDITION_FAILED
    p.method(2, c.QueueDeclare(queue="other"))
    assert isinstance(p.methods()[0], c.QueueDeclareOk)


def test_missed_heartbeats_drop_the_connection() -> None:
    """A client silent for two heartbeat intervals is disconnected; heartbeats are sent."""
    p = Peer()
    p.handshake()
    p.clock.advance(5)
    assert c.HeartbeatFrame(0) in p.received()
    p.clock.advance(25)
    assert p.transport.disconnecting


def test_broker_cancels_consumers_of_a_deleted_queue() -> None:
    """Deleting a queue sends basic.cancel to its consumers on other channels."""
    p = Peer()
    p.handshake()
    p.conn.cancel_notify = True  # pika announces consumer_cancel_notify
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q"))
    p.method(1, c.BasicConsume(queue="q", consumer_tag="ct"))
    p.method(2, c.ChannelOpen())
    p.methods()
    p.method(2, c.QueueDelete(queue="q"))
    out = p.methods()
    assert c.BasicCancel("ct", True) in out
    assert c.QueueDeleteOk(0) in out


def test_publishers_are_blocked_above_the_memory_watermark() -> None:
    """Transient queues above amqpMemoryHighWatermarkMB block publishing connections
    (connection.blocked, reads paused) until consumers drain them."""
    p = Peer(amqpMemoryHighWatermarkMB=1)
    p.handshake()
    p.conn.blocked_notify = True  # pika announces the connection.blocked capability
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    p.methods()
    p.publish(1, "", "t", b"x" * 700_000)
    assert p.methods() == []
    p.publish(1, "", "t", b"y" * 700_000)
    assert p.methods() == [c.ConnectionBlocked("low on memory")]
    assert p.transport.producerState == "paused"
    p.method(1, c.QueuePurge(queue="t"))
    out = p.methods()
    assert c.ConnectionUnblocked() in out
    assert c.QueuePurgeOk(2) in out
    assert p.transport.producerState == "producing"


def test_unknown_vhost_is_not_allowed() -> None:
    """A vhost whose namespace does not exist is refused with 530, as RabbitMQ does."""
    p = Peer()
    p.service.namespace_exists = lambda ns: ns == "public/default"
    p.send(c.PROTOCOL_HEADER)
    p.method(0, c.ConnectionStartOk({}, "PLAIN", b"\x00guest\x00guest"))
    p.method(0, c.ConnectionTuneOk(0, 131072, 0))
    p.method(0, c.ConnectionOpen("nowhere"))
    close = p.methods()[-1]
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.NOT_ALLOWED


def test_declare_ok_counts_the_backlog_beyond_the_window() -> None:
    """A durable queue's message count includes what its topic holds past the window."""
    from polybroker.protocols.amqp.vhost import WINDOW

    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.methods()
    for i in range(WINDOW + 500):
        p.publish(1, "", "q", str(i).encode(), delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueueDeclare(queue="q", durable=True, passive=True))
    (ok,) = p.methods()
    assert ok == c.QueueDeclareOk("q", WINDOW + 500, 0)


def test_expiry_into_its_own_queue_does_not_cycle() -> None:
    """A queue whose dead-letter exchange routes back to itself drops expired messages
    instead of cycling them; a rejected one comes back with an x-death count."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.ExchangeDeclare(exchange="self-dlx", type="fanout"))
    args = {"x-dead-letter-exchange": "self-dlx", "x-message-ttl": 1000}
    p.method(1, c.QueueDeclare(queue="loop", arguments=args))
    p.method(1, c.QueueBind(queue="loop", exchange="self-dlx"))
    p.methods()
    p.publish(1, "", "loop", b"old")
    p.clock.advance(2)
    p.method(1, c.BasicGet(queue="loop"))
    assert p.methods() == [c.BasicGetEmpty()]
    p.publish(1, "", "loop", b"again")
    p.method(1, c.BasicGet(queue="loop"))
    p.method(1, c.BasicReject(1, requeue=False))
    p.received()
    p.method(1, c.BasicGet(queue="loop", no_ack=True))
    frames = p.received()
    header = next(f for f in frames if isinstance(f, c.HeaderFrame))
    (death,) = header.properties.headers["x-death"]  # type: ignore[index]
    assert (death["reason"], death["count"]) == ("rejected", 1)


def test_purge_reaches_the_backlog_beyond_the_window() -> None:
    """Purging a durable queue drops what its topic holds past the window too."""
    from polybroker.protocols.amqp.vhost import WINDOW

    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.methods()
    for i in range(WINDOW + 300):
        p.publish(1, "", "q", str(i).encode(), delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueuePurge(queue="q"))
    assert p.methods() == [c.QueuePurgeOk(WINDOW + 300)]
    p.clock.advance(0)
    p.publish(1, "", "q", b"after", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.BasicGet(queue="q", no_ack=True))
    frames = p.received()
    assert c.BodyFrame(1, b"after") in frames
    p.method(1, c.QueueDeclare(queue="q", durable=True, passive=True))
    assert p.methods() == [c.QueueDeclareOk("q", 0, 0)]


def test_confirms_completed_by_the_input_itself_go_out_at_once() -> None:
    """Publishes to a transient queue are confirmed at the end of the input that carried
    them, with no extra reactor turn."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    p.method(1, c.ConfirmSelect())
    p.methods()
    p.publish(1, "", "t", b"a")
    assert p.methods() == [c.BasicAck(1, True)]


def test_publishes_of_one_input_share_a_batch_entry() -> None:
    """Publishes to one durable queue that arrive in one read are stored as one batch entry,
    each confirmed, each delivered, and the entry acknowledged once all are acked."""
    p = queue_peer(c.ConfirmSelect())
    data = b""
    for i in range(3):
        body = f"m{i}".encode()
        data += c.encode_content(
            1, c.BasicPublish(exchange="", routing_key="q"), c.BasicProperties(), body, 4096
        )
    p.send(data)
    assert p.methods() == [c.BasicAck(3, True)]
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    assert ledger.last_confirmed.entry_id == 0  # one entry holds the three messages
    p.method(1, c.BasicConsume(queue="q", consumer_tag="t"))
    frames = p.received()
    assert [f.data for f in frames if isinstance(f, c.BodyFrame)] == [b"m0", b"m1", b"m2"]
    p.method(1, c.BasicAck(3, True))
    p.clock.advance(0)
    p.method(1, c.QueueDeclare(queue="q", durable=True, passive=True))
    assert p.methods() == [c.QueueDeclareOk("q", 0, 1)]


def test_the_newest_confirm_leaves_at_once_when_its_write_completes() -> None:
    """A storage completion confirms the channel's newest publish at once, handed to the
    kernel then (not when the reactor next polls); earlier ones of the completion go with it
    as one basic.ack."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.ConfirmSelect())
    p.clock.advance(0)
    p.methods()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    tcp_transport = FakeTcp(p.transport)
    p.conn.transport = tcp_transport
    for body in (b"one", b"two"):
        p.publish(1, "", "q", body, delivery_mode=2)
    p.clock.advance(0)
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (0, [])
    ledger.release_appends()  # both batches complete: one confirm, sent at once
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (1, [])
    assert p.methods() == [c.BasicAck(2, True)]


def test_a_lone_delivery_of_a_storage_read_leaves_at_once() -> None:
    """One new message a durable queue reads from storage reaches a waiting consumer in a
    write handed to the kernel at once; several read together wait for the reactor's poll,
    in one send as before."""
    p = consuming_peer()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    tcp_transport = FakeTcp(p.transport)
    p.conn.transport = tcp_transport
    publish = c.encode_content(
        1, c.BasicPublish(exchange="", routing_key="q"), c.BasicProperties(), b"lone", 4096
    )
    p.send(publish)
    p.clock.advance(0)
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (0, [])
    ledger.release_appends()
    p.clock.advance(0)
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (1, [])
    assert [f.data for f in p.received() if isinstance(f, c.BodyFrame)] == [b"lone"]
    ledger.hold_appends = True
    p.send(publish * 3)
    p.clock.advance(0)
    ledger.release_appends()
    p.clock.advance(0)
    assert tcp_transport.socket.sends == 1
    assert len(tcp_transport.queued) == 1  # the three deliveries, in one write


def test_lone_deliveries_before_the_client_answers_wait_for_the_poll() -> None:
    """After a lone delivery went at once, more lone ones (a fanout's queues, each reading
    the message) go through the transport's buffer, sent together when the reactor polls,
    until the client sends again."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.ExchangeDeclare(exchange="fx", type="fanout", durable=True))
    for q in ("q1", "q2", "q3"):
        p.method(1, c.QueueDeclare(queue=q, durable=True))
        p.method(1, c.QueueBind(queue=q, exchange="fx"))
        p.method(1, c.BasicConsume(queue=q, consumer_tag=q, no_ack=True))
    publish = c.encode_content(
        1, c.BasicPublish(exchange="fx", routing_key=""), c.BasicProperties(), b"m", 4096
    )
    p.send(publish)  # the queues' subscriptions to the exchange's log are made
    p.clock.advance(0)
    p.received()
    ledger = p.ledgers.ledger("public/default/persistent/amqp.exchange.fx")
    ledger.hold_appends = True
    tcp_transport = FakeTcp(p.transport)
    p.conn.transport = tcp_transport
    p.send(publish)
    p.clock.advance(0)
    ledger.release_appends()
    p.clock.advance(0)
    assert tcp_transport.socket.sends == 1
    assert len(tcp_transport.queued) == 2  # the other queues' deliveries
    assert [f.data for f in p.received() if isinstance(f, c.BodyFrame)] == [b"m"]


def test_deliveries_made_while_input_is_handled_ride_with_that_turn() -> None:
    """A transient queue delivers during the publisher's input: those deliveries wait for the
    reactor's poll with the turn's other writes instead of one send each."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    consumer = p.connect()
    consumer.dataReceived(c.PROTOCOL_HEADER)
    consumer.dataReceived(
        c.encode_method(0, c.ConnectionStartOk({}, "PLAIN", b"\x00guest\x00guest"))
        + c.encode_method(0, c.ConnectionTuneOk(100, 8192, 10))
        + c.encode_method(0, c.ConnectionOpen("/"))
        + c.encode_method(1, c.ChannelOpen())
        + c.encode_method(1, c.BasicConsume(queue="t", consumer_tag="ct", no_ack=True))
    )
    p.clock.advance(0)
    tcp_transport = FakeTcp(consumer.transport)
    consumer.transport = tcp_transport
    for body in (b"x", b"y"):
        p.publish(1, "", "t", body)
    assert tcp_transport.socket.sends == 0
    queued = c.FrameReader(1 << 20, expect_header=False)
    queued.feed(b"".join(tcp_transport.queued))
    assert [f.data for f in queued.frames() if isinstance(f, c.BodyFrame)] == [b"x", b"y"]


def _delivered(p: Peer) -> list[int]:
    return [m.delivery_tag for m in p.methods() if isinstance(m, c.BasicDeliver)]


def test_a_multiple_ack_settles_exactly_the_tags_up_to_it() -> None:
    """basic.ack with multiple settles every unacknowledged tag up to its own and none above,
    also when a requeued message came back under a newer tag."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    for i in range(6):
        p.publish(1, "", "t", f"m{i}".encode())
    p.method(1, c.BasicConsume(queue="t", consumer_tag="ct"))
    assert _delivered(p) == [1, 2, 3, 4, 5, 6]
    unacked = p.conn.channels[1].unacked
    p.method(1, c.BasicAck(2, True))
    assert list(unacked) == [3, 4, 5, 6]
    p.method(1, c.BasicNack(4, False, True))  # back to the queue, redelivered as tag 7
    assert _delivered(p) == [7]
    p.method(1, c.BasicAck(6, True))
    assert list(unacked) == [7]
    p.method(1, c.BasicAck(0, True))  # tag 0 with multiple: everything
    assert list(unacked) == []
    p.method(1, c.QueueDeclare(queue="t", passive=True))
    assert p.methods() == [c.QueueDeclareOk("t", 0, 1)]


def test_methods_held_back_beyond_the_backlog_limit_pause_reading() -> None:
    """1500 methods pipelined behind one that waits: from MAX_BACKLOG on the socket is not
    read; once the wait ends they all run, in order, and reading resumes."""
    from twisted.internet.defer import Deferred

    from polybroker.protocols.amqp.connection import MAX_BACKLOG

    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.methods()
    held: Deferred[None] = Deferred()
    declare = p.conn.on_QueueDeclare

    def waiting(ch: object, m: c.QueueDeclare) -> Deferred[object]:
        return held.addCallback(lambda _: declare(ch, m))

    p.conn.on_QueueDeclare = waiting
    batch = c.encode_method(1, c.QueueDeclare(queue="q"))
    batch += c.encode_method(1, c.BasicQos(0, 7, False)) * 1500
    p.send(batch)
    assert p.methods() == []
    assert len(p.conn.channels[1].backlog) == 1500 > MAX_BACKLOG
    assert p.transport.producerState == "paused"
    held.callback(None)
    out = p.methods()
    assert isinstance(out[0], c.QueueDeclareOk)
    assert out[1:] == [c.BasicQosOk()] * 1500
    assert p.transport.producerState == "producing"


def test_an_unframed_stream_is_not_buffered_while_the_close_waits() -> None:
    """After a frame-end error nothing of the stream can be framed, so none of it is kept:
    the socket is not read, and the connection goes after the grace period."""
    from polybroker.protocols.amqp.connection import CLOSE_GRACE_S

    p = Peer()
    p.handshake()
    bad = bytearray(c.encode_method(0, c.ConnectionCloseOk()))
    bad[-1] = 0
    p.send(bytes(bad) + b"x" * 100_000)
    (close,) = p.methods()
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.FRAME_ERROR
    assert p.transport.producerState == "paused"
    p.send(b"y" * 100_000)  # what the kernel had already read
    assert p.conn.reader.take_rest() == b""
    p.clock.advance(CLOSE_GRACE_S)
    assert p.transport.disconnecting


def test_deliveries_wait_while_the_send_buffer_is_full() -> None:
    """An auto-ack consumer that does not read: its messages stay in their queue, not in the
    send buffer, and each drain lets in about a buffer's worth more, in order, until all
    have arrived."""
    from polybroker.protocols.amqp.connection import MAX_GATHERED

    p = Peer()
    slow = SlowClient()
    p.conn = p.connect_with(slow)
    p.transport = slow
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    p.method(1, c.BasicConsume(queue="t", consumer_tag="ct", no_ack=True))
    p.methods()
    slow.drain()
    body = 1000
    for i in range(1000):
        p.publish(1, "", "t", i.to_bytes(4, "big") + b"x" * (body - 4))
    seen: list[int] = []
    rounds = 0
    while len(seen) < 1000:
        got = [f.data for f in p.received() if isinstance(f, c.BodyFrame)]
        assert got, "no delivery after a drain"
        assert len(got) * body <= slow.limit + 2 * MAX_GATHERED
        seen += [int.from_bytes(b[:4], "big") for b in got]
        rounds += 1
        slow.drain()
    assert seen == list(range(1000))
    assert rounds >= 1000 * body // (slow.limit + 2 * MAX_GATHERED)


def test_pipelined_gets_stop_at_max_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """basic.gets held back behind one that waits for appends run, once it completes, only
    until their answers pass MAX_UNREAD; the rest run, in order, as the client reads."""
    from polybroker.protocols.amqp import connection

    monkeypatch.setattr(connection, "MAX_UNREAD", 10_000)
    p = Peer()
    slow = SlowClient(limit=1000)
    p.conn = p.connect_with(slow)
    p.transport = slow
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.methods()
    slow.drain()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    body = 1000
    for i in range(100):
        p.publish(1, "", "q", i.to_bytes(4, "big") + b"x" * (body - 4), delivery_mode=2)
    p.send(c.encode_method(1, c.BasicGet(queue="q", no_ack=True)) * 100)
    assert p.received() == []  # the first get waits for the appends, the others behind it
    ledger.release_appends()
    p.clock.advance(0)
    seen: list[int] = []
    rounds = 0
    while len(seen) < 100:
        assert slow.unsent <= 10_000 + body + 100
        got = [f.data for f in p.received() if isinstance(f, c.BodyFrame)]
        assert got, "no answer after a drain"
        seen += [int.from_bytes(b[:4], "big") for b in got]
        rounds += 1
        slow.drain()
    assert seen == list(range(100))
    assert rounds >= 100 * body // (10_000 + body + 100)


def test_publishes_past_the_pending_bound_stop_the_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_PENDING_PUBLISHES publishes on their way to storage the socket is not read;
    once half of them are stored it is read again, and every message is in the queue."""
    from polybroker.protocols.amqp import connection

    monkeypatch.setattr(connection, "MAX_PENDING_PUBLISHES", 4)
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.methods()
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    for i in range(5):
        assert p.transport.producerState == "producing"
        p.publish(1, "", "q", b"m%d" % i, delivery_mode=2)
    assert p.transport.producerState == "paused"
    ledger.release_appends(2)
    p.clock.advance(0)
    assert p.transport.producerState == "paused"  # 3 under way: more than half
    ledger.release_appends(1)
    p.clock.advance(0)
    assert p.transport.producerState == "producing"
    ledger.release_appends()
    p.clock.advance(0)
    p.method(1, c.BasicConsume(queue="q", consumer_tag="t", no_ack=True))
    bodies = [f.data for f in p.received() if isinstance(f, c.BodyFrame)]
    assert bodies == [b"m%d" % i for i in range(5)]


def test_a_full_publish_buffer_stops_the_reading() -> None:
    """Past the broker-wide publish buffer's limit a publishing connection stops being read;
    when it drained to half it reads on."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.methods()
    buffer = p.conn.s.service.publish_buffer
    buffer.limit = 2500
    ledger = p.ledgers.ledger(QUEUE_LEDGER)
    ledger.hold_appends = True
    for i in range(3):
        assert p.transport.producerState == "producing"
        p.publish(1, "", "q", b"%d" % i * 1000, delivery_mode=2)
    assert buffer.full
    assert p.transport.producerState == "paused"
    ledger.release_appends()
    p.clock.advance(0)
    assert p.transport.producerState == "producing"
    assert buffer.used == 0


def test_held_messages_count_their_overhead_against_the_watermark() -> None:
    """Small messages weigh more than their bodies: 2,200 of 100 bytes (220 KB of bodies)
    in a transient queue block publishers under a 1 MB watermark."""
    p = Peer(amqpMemoryHighWatermarkMB=1)
    p.handshake()
    p.conn.blocked_notify = True
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="t"))
    p.methods()
    for _ in range(2200):
        p.publish(1, "", "t", b"x" * 100)
    assert p.methods() == [c.ConnectionBlocked("low on memory")]
    p.method(1, c.QueuePurge(queue="t"))
    assert c.ConnectionUnblocked() in p.methods()


def test_a_client_that_does_not_read_its_answers_stops_being_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the answers waiting for a client pass MAX_UNREAD the socket is not read, and
    what came in the same read waits; it is all answered, in order, as the client reads."""
    from polybroker.protocols.amqp import connection

    monkeypatch.setattr(connection, "MAX_UNREAD", 10_000)
    p = Peer()
    slow = SlowClient(limit=1000)
    p.conn = p.connect_with(slow)
    p.transport = slow
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.methods()
    slow.drain()
    qos = c.encode_method(1, c.BasicQos(0, 7, False))
    ok = len(c.encode_method(1, c.BasicQosOk()))
    p.send(qos * 500)  # 6000 bytes of answers
    assert slow.producerState == "producing"
    p.send(qos * 10_000)
    assert slow.producerState == "paused"
    assert 10_000 < slow.unsent <= 10_000 + ok
    drains = 0
    while slow.producerState == "paused":
        assert slow.unsent <= 10_000 + ok
        slow.drain()
        drains += 1
    assert drains >= 10_000 * ok // (10_000 + ok)  # each drain answered a share
    assert p.methods() == [c.BasicQosOk()] * 10_500
