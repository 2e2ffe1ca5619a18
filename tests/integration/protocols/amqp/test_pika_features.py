"""pika against the AMQP handler: returns, transactions, queue lifecycle, TTL, dead letters,
limits, errors with the spec's reply codes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
import pytest_twisted
from amqp_harness import Broker
from twisted.internet.defer import succeed


def _drain(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> list[bytes]:
    out = []
    while True:
        _, _, body = ch.basic_get(queue, auto_ack=True)
        if body is None:
            return out
        out.append(body)


@pytest_twisted.ensureDeferred
async def test_mandatory_unroutable_is_returned(broker: Broker) -> None:
    """A mandatory publish nobody is bound for comes back in basic.return (312 NO_ROUTE)."""

    def scenario() -> list[tuple[int, str, bytes]]:
        conn = broker.connect()
        ch = conn.channel()
        returned: list[tuple[int, str, bytes]] = []
        ch.add_on_return_callback(
            lambda c, m, p, b: returned.append((m.reply_code, m.routing_key, b))
        )
        ch.exchange_declare("lonely", "direct")
        ch.basic_publish("lonely", "nobody", b"back", mandatory=True)
        ch.basic_publish("lonely", "nobody", b"dropped", mandatory=False)
        conn.process_data_events(time_limit=0.3)
        conn.close()
        return returned

    assert await broker.run(scenario) == [(312, "nobody", b"back")]


@pytest_twisted.ensureDeferred
async def test_confirm_unroutable_mandatory_raises_in_blocking_channel(broker: Broker) -> None:
    """With confirms on, pika's blocking channel reports an unroutable mandatory publish."""

    def scenario() -> bool:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("cq")
        ch.basic_publish("", "cq", b"ok", mandatory=True)
        try:
            ch.basic_publish("", "missing-queue", b"x", mandatory=True)
        except pika.exceptions.UnroutableError:
            conn.close()
            return True
        conn.close()
        return False

    assert await broker.run(scenario)


@pytest_twisted.ensureDeferred
async def test_transactions_commit_and_rollback(broker: Broker) -> None:
    """Publishes and acks in a transaction take effect on commit only; rollback drops them."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        other = conn.channel()
        ch.queue_declare("txq")
        ch.tx_select()
        ch.basic_publish("", "txq", b"a")
        before = other.basic_get("txq")[2]
        ch.tx_commit()
        committed = _drain(other, "txq")
        ch.basic_publish("", "txq", b"b")
        ch.tx_rollback()
        rolled_back = _drain(other, "txq")
        other.basic_publish("", "txq", b"c")
        method, _, body = ch.basic_get("txq")
        ch.basic_ack(method.delivery_tag)
        ch.tx_rollback()  # the ack is dropped: the message stays unacked on ch
        ch.basic_recover(requeue=True)
        method2, _, body2 = ch.basic_get("txq")
        ch.basic_ack(method2.delivery_tag)
        ch.tx_commit()
        after = _drain(other, "txq")
        conn.close()
        return {
            "before": before,
            "committed": committed,
            "rolled_back": rolled_back,
            "got": body,
            "again": (body2, method2.redelivered),
            "after": after,
        }

    out = await broker.run(scenario)
    assert out["before"] is None
    assert out["committed"] == [b"a"]
    assert out["rolled_back"] == []
    assert out["got"] == b"c"
    assert out["again"] == (b"c", True)
    assert out["after"] == []


@pytest_twisted.ensureDeferred
async def test_queue_lifecycle_purge_delete_and_broker_cancel(broker: Broker) -> None:
    """Purge counts ready messages, delete cancels consumers (basic.cancel from the broker),
    a server-named queue gets an amq.gen name, passive declare of a missing queue is 404."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("life")
        for i in range(3):
            ch.basic_publish("", "life", str(i).encode())
        declared = ch.queue_declare("life", passive=True).method.message_count
        purged = ch.queue_purge("life").method.message_count
        cancelled: list[str] = []
        ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
        tag = ch.basic_consume("life", lambda *a: None)
        other = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            other.queue_delete("life", if_unused=True)
        in_use = e.value.reply_code
        ch.queue_delete("life")
        conn.process_data_events(time_limit=0.3)
        server_named = ch.queue_declare("", exclusive=True).method.queue
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e2:
            ch.queue_declare("nope", passive=True)
        conn.close()
        return {
            "declared": declared,
            "purged": purged,
            "in_use": in_use,
            "cancelled": cancelled == [tag],
            "server_named": server_named,
            "missing": e2.value.reply_code,
        }

    out = await broker.run(scenario)
    assert out["declared"] == 3
    assert out["purged"] == 3
    assert out["in_use"] == 406
    assert out["cancelled"]
    assert str(out["server_named"]).startswith("amq.gen-")
    assert out["missing"] == 404


@pytest_twisted.ensureDeferred
async def test_exclusive_queue_is_locked_and_goes_with_its_connection(broker: Broker) -> None:
    """Another connection gets 405 on an exclusive queue; it is deleted when its owner closes."""

    def scenario() -> tuple[int, int]:
        owner = broker.connect()
        och = owner.channel()
        och.queue_declare("mine", exclusive=True)
        other = broker.connect()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            other.channel().basic_consume("mine", lambda *a: None)
        owner.close()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e2:
            other.channel().queue_declare("mine", passive=True)
        other.close()
        return e.value.reply_code, e2.value.reply_code

    assert await broker.run(scenario) == (405, 404)


@pytest_twisted.ensureDeferred
async def test_ttl_max_length_and_dead_lettering(broker: Broker) -> None:
    """Rejected, expired and overflowing messages go to the dead-letter exchange with x-death."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("dlx", "fanout")
        ch.queue_declare("dead")
        ch.queue_bind("dead", "dlx")
        ch.queue_declare("src", arguments={"x-dead-letter-exchange": "dlx"})
        ch.queue_declare("short", arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "dlx"})
        ch.queue_declare("capped", arguments={"x-max-length": 2, "x-dead-letter-exchange": "dlx"})
        ch.basic_publish("", "src", b"rejected")
        method, _, _ = ch.basic_get("src")
        ch.basic_reject(method.delivery_tag, requeue=False)
        ch.basic_publish("", "short", b"expired")
        for i in range(3):
            ch.basic_publish("", "capped", f"c{i}".encode())
        capped = _drain(ch, "capped")
        deadline = time.monotonic() + 5
        dead: list[tuple[bytes, str]] = []
        while len(dead) < 3 and time.monotonic() < deadline:
            _, props, body = ch.basic_get("dead", auto_ack=True)
            if body is not None:
                dead.append((body, props.headers["x-death"][0]["reason"]))
        expired_left = ch.basic_get("short")[2]
        conn.close()
        return {"expired_left": expired_left, "capped": capped, "dead": sorted(dead)}

    out = await broker.run(scenario)
    assert out["expired_left"] is None
    assert out["capped"] == [b"c1", b"c2"]
    assert out["dead"] == [(b"c0", "maxlen"), (b"expired", "expired"), (b"rejected", "rejected")]


@pytest_twisted.ensureDeferred
async def test_bad_login_is_refused(broker: Broker) -> None:
    """Wrong credentials end the handshake with 403 ACCESS_REFUSED."""

    def scenario() -> bool:
        try:
            broker.connect(credentials=pika.PlainCredentials("guest", "wrong"))
        except pika.exceptions.ProbableAuthenticationError:
            return True
        except pika.exceptions.AuthenticationError:
            return True
        return False

    assert await broker.run(scenario)


@pytest_twisted.ensureDeferred
async def test_a_vhost_whose_namespace_does_not_exist_is_refused_at_open(broker: Broker) -> None:
    """As RabbitMQ's 530 "vhost not found", also when the broker learns whether the
    namespace exists from its metadata store (asynchronously, as a standalone does)."""
    broker.service.namespace_exists = lambda ns: succeed(ns == "public/default")

    def scenario() -> str:
        broker.connect(virtual_host="/").close()
        try:
            broker.connect(virtual_host="nosuch")
        except pika.exceptions.ProbableAccessDeniedError as e:
            return str(e)  # pika's name for a close while opening the vhost
        return "opened"

    said = await broker.run(scenario)
    assert said == "ConnectionClosedByBroker: (530) \"vhost 'nosuch' not found\""


@pytest_twisted.ensureDeferred
async def test_errors_close_the_channel_with_the_spec_codes(broker: Broker) -> None:
    """Publishing to a missing exchange is 404; unknown delivery tag is 406; the connection
    stays usable on another channel."""

    def scenario() -> tuple[int, int, bytes]:
        conn = broker.connect()
        ch = conn.channel()
        ch.basic_publish("no-such-exchange", "k", b"x")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare("after")
        ch2 = conn.channel()
        ch2.basic_ack(999)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e2:
            ch2.queue_declare("after")
        ch3 = conn.channel()
        ch3.queue_declare("fine")
        ch3.basic_publish("", "fine", b"still")
        body = ch3.basic_get("fine", auto_ack=True)[2]
        conn.close()
        return e.value.reply_code, e2.value.reply_code, body

    assert await broker.run(scenario) == (404, 406, b"still")


@pytest_twisted.ensureDeferred
async def test_declare_equivalence_deletes_and_unbind(broker: Broker) -> None:
    """Passive declares of missing exchanges are 404, inequivalent redeclares 406, reserved
    names 403; exchange delete honours if-unused; unbind stops routing."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        codes: dict[str, int] = {}
        for name, call in [
            ("passive", lambda ch: ch.exchange_declare("nope", passive=True)),
            ("inequivalent", lambda ch: ch.exchange_declare("amq.topic", "direct")),
            ("reserved", lambda ch: ch.exchange_declare("amq.mine", "direct")),
        ]:
            ch = conn.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                call(ch)
            codes[name] = e.value.reply_code
        ch = conn.channel()
        ch.exchange_declare("ex", "direct")
        ch.queue_declare("uq")
        ch.queue_bind("uq", "ex", "k")
        busy = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            busy.exchange_delete("ex", if_unused=True)
        codes["if_unused"] = e.value.reply_code
        ch.confirm_delivery()
        ch.basic_publish("ex", "k", b"bound")
        ch.queue_unbind("uq", "ex", "k")
        ch.basic_publish("ex", "k", b"unbound")
        got = _drain(ch, "uq")
        ch.exchange_delete("ex")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.exchange_declare("ex", passive=True)
        codes["deleted"] = e.value.reply_code
        conn.close()
        return {"codes": codes, "got": got}

    out = await broker.run(scenario)
    assert out["codes"] == {
        "passive": 404,
        "inequivalent": 406,
        "reserved": 403,
        "if_unused": 406,
        "deleted": 404,
    }
    assert out["got"] == [b"bound"]


@pytest_twisted.ensureDeferred
async def test_auto_delete_exclusive_consumer_and_channel_prefetch(broker: Broker) -> None:
    """An auto-delete queue goes with its last consumer; an exclusive consumer locks the queue
    (403 for other consumers, as RabbitMQ's "in exclusive use"); a global prefetch caps the
    whole channel."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("ad", auto_delete=True)
        tag = ch.basic_consume("ad", lambda *a: None)
        ch.basic_cancel(tag)
        probe = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            probe.queue_declare("ad", passive=True)
        auto_deleted = e.value.reply_code
        ch.queue_declare("ex1")
        ch.basic_consume("ex1", lambda *a: None, exclusive=True)
        other = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e2:
            other.basic_consume("ex1", lambda *a: None)
        locked = e2.value.reply_code
        pc = conn.channel()
        pc.confirm_delivery()
        pc.queue_declare("pq1")
        pc.queue_declare("pq2")
        for _i in range(5):
            pc.basic_publish("", "pq1", b"a")
            pc.basic_publish("", "pq2", b"b")
        pc.basic_qos(prefetch_count=3, global_qos=True)
        got: list[bytes] = []
        pc.basic_consume("pq1", lambda c, m, p, b: got.append(b))
        pc.basic_consume("pq2", lambda c, m, p, b: got.append(b))
        conn.process_data_events(time_limit=0.5)
        conn.close()
        return {"auto_deleted": auto_deleted, "locked": locked, "capped": len(got)}

    out = await broker.run(scenario)
    assert out == {"auto_deleted": 404, "locked": 403, "capped": 3}


@pytest_twisted.ensureDeferred
async def test_queue_expires_when_unused(broker: Broker) -> None:
    """A queue with x-expires is deleted once unused for that long."""

    def scenario() -> int:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("ephemeral", arguments={"x-expires": 200})
        deadline = time.monotonic() + 5
        code = 0
        while time.monotonic() < deadline and not code:
            probe = conn.channel()
            try:
                probe.queue_declare("ephemeral", passive=True)
                probe.close()
                conn.process_data_events(time_limit=0.1)
            except pika.exceptions.ChannelClosedByBroker as e:
                code = e.reply_code
        conn.close()
        return code

    assert await broker.run(scenario) == 404


@pytest_twisted.ensureDeferred
async def test_a_redeclaration_must_repeat_what_rabbitmq_compares(broker: Broker) -> None:
    """Declaring an existing queue or exchange again with another flag or checked argument is
    406 "inequivalent arg", as on RabbitMQ; the same declaration, or other arguments, is fine."""

    def scenario() -> list[str]:
        conn = broker.connect()

        def refused(declare: Callable[[Any], object]) -> str:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                declare(conn.channel())
            assert e.value.reply_code == 406
            return str(e.value.reply_text)

        ch = conn.channel()
        ch.queue_declare("eq", arguments={"x-message-ttl": 1000, "x-custom": 1})
        ch.queue_declare("eq", arguments={"x-message-ttl": 1000, "x-custom": 2})
        ch.exchange_declare("ex", "direct")
        ch.exchange_declare("ex", "direct")
        said = [
            refused(lambda c: c.queue_declare("eq")),
            refused(lambda c: c.queue_declare("eq", arguments={"x-message-ttl": 2000})),
            refused(
                lambda c: c.queue_declare("eq", auto_delete=True, arguments={"x-message-ttl": 1000})
            ),
            refused(lambda c: c.exchange_declare("ex", "direct", auto_delete=True)),
            refused(lambda c: c.exchange_declare("ex", "direct", internal=True)),
        ]
        conn.close()
        return said

    said = await broker.run(scenario)
    queue, exchange = "queue 'eq' in vhost 'public/default'", "exchange 'ex' in vhost"
    assert said[0] == (
        f"inequivalent arg 'x-message-ttl' for {queue}: "
        "received none but current is the value '1000'"
    )
    assert "received the value '2000' but current is the value '1000'" in said[1]
    assert said[2].startswith(f"inequivalent arg 'auto_delete' for {queue}: received the value")
    assert "'auto_delete' for " + exchange in said[3]
    assert "'internal' for " + exchange in said[4]


@pytest_twisted.ensureDeferred
async def test_an_alternate_exchange_takes_what_its_exchange_routes_nowhere(
    broker: Broker,
) -> None:
    """RabbitMQ's alternate-exchange: unroutable messages go there (and are not returned to
    a mandatory publisher); routable ones do not; an alternate that routes nowhere either
    leaves the message unroutable."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("ae", "fanout", durable=True)
        ch.queue_declare("unrouted", durable=True)
        ch.queue_bind("unrouted", "ae")
        ch.exchange_declare("main", "direct", durable=True, arguments={"alternate-exchange": "ae"})
        ch.queue_declare("routed", durable=True)
        ch.queue_bind("routed", "main", "k")
        ch.exchange_declare("empty-ae", "fanout")
        ch.exchange_declare("lonely", "direct", arguments={"alternate-exchange": "empty-ae"})
        persistent = pika.BasicProperties(delivery_mode=2)
        ch.basic_publish("main", "k", b"to-routed", persistent, mandatory=True)
        ch.basic_publish("main", "other", b"to-ae", persistent, mandatory=True)
        returned = False
        try:
            ch.basic_publish("lonely", "x", b"nowhere", mandatory=True)
        except pika.exceptions.UnroutableError:
            returned = True
        got = {}
        for q in ("routed", "unrouted"):
            method, _, body = ch.basic_get(q, auto_ack=True)
            got[q] = (body, method.exchange, method.routing_key)
        conn.close()
        return {"got": got, "returned": returned}

    out = await broker.run(scenario)
    assert out["got"] == {
        "routed": (b"to-routed", "main", "k"),
        "unrouted": (b"to-ae", "main", "other"),  # delivered as published to its exchange
    }
    assert out["returned"] is True


@pytest_twisted.ensureDeferred
async def test_a_publisher_may_not_claim_another_user_or_a_malformed_expiration(
    broker: Broker,
) -> None:
    """As RabbitMQ: 406 for a user_id that is not the connection's user, or an expiration
    that is not a whole number of milliseconds; the connection's own user is fine."""

    def scenario() -> list[object]:
        conn = broker.connect()
        out: list[object] = []
        for props in (
            pika.BasicProperties(user_id="guest", expiration="60000"),
            pika.BasicProperties(user_id="someone-else"),
            pika.BasicProperties(expiration="abc"),
            pika.BasicProperties(expiration="-5"),
        ):
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare("checked")
            try:
                ch.basic_publish("", "checked", b"x", props)
                out.append("ok")
            except pika.exceptions.ChannelClosedByBroker as e:
                out.append(e.reply_code)
        conn.close()
        return out

    assert await broker.run(scenario) == ["ok", 406, 406, 406]
