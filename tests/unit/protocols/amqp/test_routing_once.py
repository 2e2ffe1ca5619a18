"""Unit tests of routing without a copy per queue: a message that reaches several durable queues
is stored once (in its exchange's log) and each queue reads it through a subscription of its own."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer

from polybroker.protocols.amqp import codec as c

EXCHANGE_LOG = "public/default/persistent/amqp.exchange.fan"
QUEUES = [f"q{i}" for i in range(5)]


def stored(p: Peer) -> tuple[int, int]:
    """Entries and payload bytes over every log of the broker."""
    entries = [e for log in p.ledgers.logs.values() for e in log.entries]
    return len(entries), sum(len(e.data) for e in entries)


def fanout(p: Peer, queues: list[str] = QUEUES, *, confirm: bool = True) -> None:
    """Declare durable exchange ``fan`` with ``queues`` bound to it."""
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.ExchangeDeclare(exchange="fan", type="fanout", durable=True))
    for q in queues:
        p.method(1, c.QueueDeclare(queue=q, durable=True))
        p.method(1, c.QueueBind(queue=q, exchange="fan"))
    if confirm:
        p.method(1, c.ConfirmSelect())
    p.clock.advance(0)
    p.methods()


def get(p: Peer, queue: str, no_ack: bool = True) -> bytes | None:
    """basic.get one message's body (None: get-empty)."""
    p.method(1, c.BasicGet(queue=queue, no_ack=no_ack))
    p.clock.advance(0)
    frames = p.received()
    if any(isinstance(f, c.MethodFrame) and isinstance(f.method, c.BasicGetEmpty) for f in frames):
        return None
    return b"".join(f.data for f in frames if isinstance(f, c.BodyFrame))


def drain(p: Peer, queue: str) -> list[bytes]:
    out: list[bytes] = []
    while (body := get(p, queue)) is not None:
        out.append(body)
    return out


def restart(p: Peer) -> Peer:
    """Stop ``p`` and start a broker over what it stored."""
    p.handler.stop()
    p.service.close()
    p.clock.advance(0)
    again = Peer(ledgers=p.ledgers, store=p.store)
    again.clock.advance(0)
    return again


def test_fanout_to_five_queues_stores_the_body_once() -> None:
    """A 10 kB message fanned out to five durable queues adds one entry (about 10 kB) to
    storage, is confirmed once that entry is durable, and every queue delivers it."""
    p = Peer()
    fanout(p)
    body = bytes(range(256)) * 40
    before = stored(p)
    p.publish(1, "fan", "", body, delivery_mode=2)
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True)]
    entries, size = stored(p)
    assert entries - before[0] == 1
    assert len(body) < size - before[1] < 2 * len(body)
    assert len(p.ledgers.ledger(EXCHANGE_LOG).data.entries) == 1
    assert [get(p, q) for q in QUEUES] == [body] * 5
    assert [get(p, q) for q in QUEUES] == [None] * 5


def test_confirm_waits_for_the_shared_write_and_nacks_a_failed_one() -> None:
    """A message stored once for several queues is confirmed only after its durable write,
    and nacked (and delivered nowhere) when that write fails."""
    p = Peer()
    fanout(p, ["a", "b"])
    p.publish(1, "fan", "", b"first", delivery_mode=2)  # creates the exchange's log
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(1, True)]
    ledger = p.ledgers.ledger(EXCHANGE_LOG)
    ledger.hold_appends = True
    p.publish(1, "fan", "", b"second", delivery_mode=2)
    p.publish(1, "fan", "", b"third", delivery_mode=2)
    p.clock.advance(0)
    assert p.methods() == []
    ledger.release_appends(error=RuntimeError("bookies gone"))
    p.clock.advance(0)
    assert p.methods() == [c.BasicNack(2, False, False), c.BasicNack(3, False, False)]
    assert drain(p, "a") == [b"first"]
    assert drain(p, "b") == [b"first"]


def direct(p: Peer, bindings: dict[str, tuple[str, ...]]) -> None:
    """Declare durable direct exchange ``fan`` and durable queues bound with these keys."""
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.ExchangeDeclare(exchange="fan", type="direct", durable=True))
    for q, keys in bindings.items():
        p.method(1, c.QueueDeclare(queue=q, durable=True))
        for k in keys:
            p.method(1, c.QueueBind(queue=q, exchange="fan", routing_key=k))
    p.clock.advance(0)
    p.methods()


def test_each_queue_gets_what_was_routed_to_it_in_order() -> None:
    """On a direct exchange one log holds the messages for several queues; each queue gets
    exactly the ones routed to it, in publish order (once a queue reads the exchange's log,
    what the exchange routes to it alone goes there too)."""
    p = Peer()
    direct(p, {"a": ("x", "both"), "b": ("y", "both"), "c": ("z",)})
    for i in range(3):
        p.publish(1, "fan", "both", f"both{i}".encode(), delivery_mode=2)
        p.publish(1, "fan", "x", f"x{i}".encode(), delivery_mode=2)
        p.publish(1, "fan", "y", f"y{i}".encode(), delivery_mode=2)
        p.publish(1, "fan", "z", f"z{i}".encode(), delivery_mode=2)
    p.clock.advance(0)
    assert len(p.ledgers.ledger(EXCHANGE_LOG).data.entries) == 9
    assert len(p.ledgers.ledger("public/default/persistent/amqp.queue.c").data.entries) == 3
    assert drain(p, "a") == [f"{k}{i}".encode() for i in range(3) for k in ("both", "x")]
    assert drain(p, "b") == [f"{k}{i}".encode() for i in range(3) for k in ("both", "y")]
    assert drain(p, "c") == [b"z0", b"z1", b"z2"]
    p.publish(1, "fan", "both", b"late", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "a") == [b"late"]


def test_a_queue_that_starts_reading_the_exchange_log_keeps_the_exchange_order() -> None:
    """Messages routed to one queue alone (its own topic, appends still in flight) and then
    some routed to several (the exchange's log) reach that queue in publish order."""
    p = Peer()
    direct(p, {"a": ("x", "both"), "b": ("both",)})
    own = p.ledgers.ledger("public/default/persistent/amqp.queue.a")
    own.hold_appends = True
    p.publish(1, "fan", "x", b"x0", delivery_mode=2)
    p.publish(1, "fan", "x", b"x1", delivery_mode=2)
    p.publish(1, "fan", "both", b"both0", delivery_mode=2)
    p.publish(1, "fan", "x", b"x2", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.BasicConsume(queue="a", consumer_tag="t", no_ack=True))
    p.clock.advance(0)
    assert [f.data for f in p.received() if isinstance(f, c.BodyFrame)] == []
    own.release_appends()
    p.clock.advance(0)
    bodies = [f.data for f in p.received() if isinstance(f, c.BodyFrame)]
    assert bodies == [b"x0", b"x1", b"both0", b"x2"]
    assert drain(p, "b") == [b"both0"]


def test_unbind_keeps_what_was_routed_before() -> None:
    """Messages routed to a queue before its unbind stay in it; later ones do not reach it."""
    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    p.publish(1, "fan", "", b"before", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueueUnbind(queue="b", exchange="fan"))
    p.clock.advance(0)
    assert p.methods() == [c.QueueUnbindOk()]
    p.publish(1, "fan", "", b"after", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "a") == [b"before", b"after"]
    assert drain(p, "b") == [b"before"]


def test_restart_keeps_every_queue_of_a_fanout() -> None:
    """After a restart each queue bound to one exchange has what it had not acknowledged,
    in order, and the exchange keeps routing to all of them."""
    p = Peer()
    fanout(p, ["a", "b", "c"])
    for i in range(4):
        p.publish(1, "fan", "", f"m{i}".encode(), delivery_mode=2)
    p.clock.advance(0)
    p.methods()
    assert [get(p, "a"), get(p, "a")] == [b"m0", b"m1"]  # acknowledged (no-ack)
    assert get(p, "b", no_ack=False) == b"m0"  # delivered, never acknowledged
    p.clock.advance(1)
    p = restart(p)
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.clock.advance(0)
    p.methods()
    assert drain(p, "a") == [b"m2", b"m3"]
    assert drain(p, "b") == [b"m0", b"m1", b"m2", b"m3"]
    assert drain(p, "c") == [b"m0", b"m1", b"m2", b"m3"]
    p.publish(1, "fan", "", b"again", delivery_mode=2)
    p.clock.advance(0)
    assert [drain(p, q) for q in "abc"] == [[b"again"]] * 3


def test_delete_and_purge_release_the_shared_log() -> None:
    """A deleted queue's subscription on the exchange's log goes with it; a purged queue
    drops what it had; the log keeps serving the other queues."""
    p = Peer()
    fanout(p, ["a", "b", "c"], confirm=False)
    p.publish(1, "fan", "", b"one", delivery_mode=2)
    p.clock.advance(0)
    ledger = p.ledgers.ledger(EXCHANGE_LOG)
    assert sorted(n.split(".")[2] for n in ledger.data.cursors) == ["a", "b", "c"]
    p.method(1, c.QueueDelete(queue="c"))
    p.method(1, c.QueuePurge(queue="b"))
    p.clock.advance(0)
    assert p.methods() == [c.QueueDeleteOk(1), c.QueuePurgeOk(1)]
    assert sorted(n.split(".")[2] for n in ledger.data.cursors) == ["a", "b"]
    assert drain(p, "b") == []
    assert drain(p, "a") == [b"one"]
    assert not any("/sources/c/" in path for path in p.store.nodes)
    assert any("/sources/a/" in path for path in p.store.nodes)


def test_transient_and_durable_queues_share_one_publish() -> None:
    """A fanout to a transient and two durable queues: the transient one holds the message in
    memory, the durable ones read the one stored copy."""
    p = Peer()
    fanout(p, ["d1", "d2"], confirm=False)
    p.method(1, c.QueueDeclare(queue="t", durable=False))
    p.method(1, c.QueueBind(queue="t", exchange="fan"))
    p.clock.advance(0)
    p.methods()
    before = stored(p)[0]
    p.publish(1, "fan", "", b"m", delivery_mode=2)
    p.clock.advance(0)
    assert stored(p)[0] - before == 1
    assert [drain(p, q) for q in ("d1", "d2", "t")] == [[b"m"]] * 3


def test_a_queue_declared_again_does_not_inherit_the_old_ones_messages() -> None:
    """A queue deleted while the exchange's log still held messages for it, then declared
    and bound again under the same name, gets only what is routed to it afterwards."""
    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    p.publish(1, "fan", "", b"old", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueueDelete(queue="b"))
    p.method(1, c.QueueDeclare(queue="b", durable=True))
    p.method(1, c.QueueBind(queue="b", exchange="fan"))
    p.clock.advance(0)
    p.methods()
    p.publish(1, "fan", "", b"new", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "b") == [b"new"]
    assert drain(p, "a") == [b"old", b"new"]


def test_a_restart_removes_what_exclusive_queues_left_on_shared_logs() -> None:
    """An exclusive queue does not come back after a crash, and neither does its
    subscription on the exchange's log (which would hold the log forever)."""
    p = Peer()
    fanout(p, ["a"], confirm=False)
    p.method(1, c.QueueDeclare(queue="mine", durable=True, exclusive=True))
    p.method(1, c.QueueBind(queue="mine", exchange="fan"))
    p.clock.advance(0)
    p.methods()
    p.publish(1, "fan", "", b"m", delivery_mode=2)
    p.clock.advance(0)
    log = p.ledgers.logs[EXCHANGE_LOG]
    assert sorted(n.split(".")[2] for n in log.cursors) == ["a", "mine"]
    # A crash: nothing is closed, a new broker starts over the same storage.
    again = Peer(ledgers=p.ledgers, store=p.store)
    again.handshake()
    again.clock.advance(0)
    assert sorted(n.split(".")[2] for n in log.cursors) == ["a"]
    assert not any("/sources/mine" in path for path in again.store.nodes)
    again.method(1, c.ChannelOpen())
    again.clock.advance(0)
    again.methods()
    assert drain(again, "a") == [b"m"]


def test_purge_after_a_restart_reaches_the_shared_backlog_beyond_the_window() -> None:
    """A purge drops what the exchange's log holds for the queue beyond the window, also
    messages stored before a restart; the other queue keeps all of them."""
    from polybroker.protocols.amqp.vhost import WINDOW

    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    for i in range(WINDOW + 300):
        p.publish(1, "fan", "", str(i).encode(), delivery_mode=2)
    p.clock.advance(0)
    p = restart(p)
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.clock.advance(0)
    p.methods()
    p.method(1, c.QueuePurge(queue="a"))
    p.clock.advance(0)
    assert p.methods() == [c.QueuePurgeOk(WINDOW + 300)]
    p.publish(1, "fan", "", b"after", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "a") == [b"after"]
    assert len(drain(p, "b")) == WINDOW + 301


def cursors_of(p: Peer) -> list[str]:
    """The queues with a subscription on the exchange's log."""
    return sorted(n.split(".")[2] for n in p.ledgers.logs[EXCHANGE_LOG].cursors)


def test_an_unbound_queue_stops_reading_the_log_once_it_has_its_messages() -> None:
    """After an unbind a queue keeps its subscription on the exchange's log until it has
    read and settled what was routed to it (a delivered message holds it until acked); then
    the subscription and its record go, and the other queues go on."""
    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    p.publish(1, "fan", "", b"m1", delivery_mode=2)
    p.publish(1, "fan", "", b"m2", delivery_mode=2)
    p.clock.advance(0)
    assert get(p, "b", no_ack=False) == b"m1"
    p.method(1, c.QueueUnbind(queue="b", exchange="fan"))
    p.clock.advance(0)
    p.methods()
    p.publish(1, "fan", "", b"m3", delivery_mode=2)
    p.clock.advance(0)
    assert cursors_of(p) == ["a", "b"]
    assert drain(p, "b") == [b"m2"]
    assert cursors_of(p) == ["a", "b"]  # m1 is delivered, not yet acknowledged
    p.method(1, c.BasicAck(1))
    p.clock.advance(0)
    assert cursors_of(p) == ["a"]
    assert not any("/sources/b/" in path for path in p.store.nodes)
    p.publish(1, "fan", "", b"m4", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "a") == [b"m1", b"m2", b"m3", b"m4"]
    assert drain(p, "b") == []


def test_a_queue_bound_again_before_it_drained_keeps_reading_the_log() -> None:
    """Unbind then bind again while messages for the queue are still unread: nothing is
    lost, nothing retires, and the queue gets what is routed after the new bind."""
    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    p.publish(1, "fan", "", b"m1", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueueUnbind(queue="b", exchange="fan"))
    p.method(1, c.QueueBind(queue="b", exchange="fan"))
    p.clock.advance(0)
    p.methods()
    p.publish(1, "fan", "", b"m2", delivery_mode=2)
    p.clock.advance(0)
    assert drain(p, "b") == [b"m1", b"m2"]
    assert cursors_of(p) == ["a", "b"]


def test_a_restarted_broker_retires_what_an_exchange_deleted_before_left() -> None:
    """A queue whose exchange was deleted reads what was routed to it before, also across a
    restart, and then leaves the exchange's log."""
    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    p.publish(1, "fan", "", b"m1", delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.ExchangeDelete(exchange="fan"))
    p.clock.advance(0)
    p.methods()
    p = restart(p)
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.clock.advance(0)
    p.methods()
    assert cursors_of(p) == ["a", "b"]
    assert drain(p, "a") == [b"m1"]
    assert drain(p, "b") == [b"m1"]
    assert cursors_of(p) == []


def test_declare_ok_counts_a_fanout_backlog_beyond_the_window() -> None:
    """queue.declare-ok counts what the exchange's log holds for the queue beyond the
    window, and what is left after some are taken."""
    from polybroker.protocols.amqp.vhost import WINDOW

    p = Peer()
    fanout(p, ["a", "b"], confirm=False)
    for i in range(WINDOW + 500):
        p.publish(1, "fan", "", str(i).encode(), delivery_mode=2)
    p.clock.advance(0)
    p.method(1, c.QueueDeclare(queue="a", durable=True, passive=True))
    p.clock.advance(0)
    assert p.methods() == [c.QueueDeclareOk("a", WINDOW + 500, 0)]
    for _ in range(10):
        get(p, "a")
    p.method(1, c.QueueDeclare(queue="a", durable=True, passive=True))
    p.clock.advance(0)
    assert p.methods() == [c.QueueDeclareOk("a", WINDOW + 490, 0)]


def test_a_publish_whose_queue_cannot_read_the_log_is_nacked() -> None:
    """When a queue's subscription on the exchange's log cannot be recorded, the publish
    that needed it is nacked (not left unanswered) and stored nowhere; the next one works."""
    from twisted.internet.defer import fail

    p = Peer()
    fanout(p, ["a", "b"])
    put = p.store.put
    broken = {"on": True}

    def flaky_put(path: str, value: bytes, *args: object, **kwargs: object) -> object:
        if broken["on"] and "/sources/" in path:
            return fail(RuntimeError("metadata store down"))
        return put(path, value, *args, **kwargs)  # type: ignore[arg-type]

    p.store.put = flaky_put  # type: ignore[method-assign]
    p.publish(1, "fan", "", b"lost", delivery_mode=2)
    p.clock.advance(0)
    assert p.methods() == [c.BasicNack(1, False, False)]
    broken["on"] = False
    p.publish(1, "fan", "", b"kept", delivery_mode=2)
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(2, True)]
    assert drain(p, "a") == [b"kept"]
    assert drain(p, "b") == [b"kept"]


def test_a_publish_waiting_for_a_new_subscription_keeps_its_place_in_the_log() -> None:
    """While a newly bound queue's subscription on the exchange's log is being made, a later
    publish that needs no new subscription still lands after the waiting one."""
    from twisted.internet.defer import Deferred

    p = Peer()
    direct(p, {"a": ("x", "both"), "b": ("both",)})
    p.method(1, c.ConfirmSelect())
    p.publish(1, "fan", "both", b"first", delivery_mode=2)  # a and b read the log now
    p.clock.advance(0)
    p.method(1, c.QueueDeclare(queue="c", durable=True))
    p.method(1, c.QueueBind(queue="c", exchange="fan", routing_key="both"))
    p.clock.advance(0)
    p.methods()
    put = p.store.put
    held: list[Deferred[object]] = []

    def slow_put(path: str, value: bytes, *args: object, **kwargs: object) -> object:
        if "/sources/c/" in path:
            d: Deferred[object] = Deferred()
            d.addCallback(lambda _: put(path, value, *args, **kwargs))  # type: ignore[arg-type]
            held.append(d)
            return d
        return put(path, value, *args, **kwargs)  # type: ignore[arg-type]

    p.store.put = slow_put  # type: ignore[method-assign]
    p.publish(1, "fan", "both", b"second", delivery_mode=2)  # waits for c's subscription
    p.publish(1, "fan", "x", b"third", delivery_mode=2)  # a only: must not overtake
    p.clock.advance(0)
    assert p.methods() == []
    held[0].callback(None)
    p.clock.advance(0)
    assert p.methods() == [c.BasicAck(3, True)]
    assert drain(p, "a") == [b"first", b"second", b"third"]
    assert drain(p, "b") == [b"first", b"second"]
    assert drain(p, "c") == [b"second"]
