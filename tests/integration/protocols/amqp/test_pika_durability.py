"""Durable definitions and persistent messages survive a broker restart; transient ones do not.
Bad input gets the spec's errors while other connections keep being served. SelectConnection."""

from __future__ import annotations

import socket
import struct

import pika
import pika.exceptions
import pytest
import pytest_twisted
from amqp_harness import Broker, restart_broker, start_broker, stop_broker

from polybroker.protocols.amqp import codec as c


@pytest_twisted.ensureDeferred
async def test_restart_keeps_durable_and_drops_transient() -> None:
    """Durable exchange, queue, binding and persistent messages come back after a restart;
    transient messages and a transient queue do not."""
    broker = await start_broker()

    def before() -> None:
        conn = broker.connect()
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("dx", "direct", durable=True)
        ch.queue_declare("dq", durable=True)
        ch.queue_bind("dq", "dx", "k")
        ch.queue_declare("tq", durable=False)
        ch.basic_publish("dx", "k", b"persistent", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("dx", "k", b"transient", pika.BasicProperties(delivery_mode=1))
        ch.basic_publish("dx", "k", b"unacked", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("", "tq", b"gone")
        _, _, first = ch.basic_get("dq")  # left unacknowledged when the broker stops
        assert first == b"persistent"
        conn.close()

    await broker.run(before)
    broker = await restart_broker(broker)
    try:

        def after() -> dict[str, object]:
            conn = broker.connect()
            ch = conn.channel()
            ch.exchange_declare("dx", "direct", passive=True)
            bodies = []
            while True:
                _, props, body = ch.basic_get("dq", auto_ack=True)
                if body is None:
                    break
                bodies.append((body, props.delivery_mode))
            ch.confirm_delivery()
            ch.basic_publish("dx", "k", b"routed-after-restart", mandatory=True)
            routed = ch.basic_get("dq", auto_ack=True)[2]
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                ch.queue_declare("tq", passive=True)
            conn.close()
            return {"bodies": bodies, "routed": routed, "tq": e.value.reply_code}

        out = await broker.run(after)
    finally:
        await stop_broker(broker)
    assert out["bodies"] == [(b"persistent", 2), (b"unacked", 2)]
    assert out["routed"] == b"routed-after-restart"
    assert out["tq"] == 404


def _raw(port: int, data: bytes, handshake: bool = True) -> bytes:
    """Send ``data`` on a raw socket (after a full handshake if asked); return all replies."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        if handshake:
            s.sendall(c.PROTOCOL_HEADER)
            _recv_frame(s)  # connection.start
            s.sendall(
                c.encode_method(0, c.ConnectionStartOk({}, "PLAIN", b"\x00guest\x00guest", "en_US"))
            )
            _recv_frame(s)  # connection.tune
            s.sendall(c.encode_method(0, c.ConnectionTuneOk(0, 4096, 0)))
            s.sendall(c.encode_method(0, c.ConnectionOpen("/")))
            _recv_frame(s)  # connection.open-ok
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if out.startswith(b"AMQP") or b"\xce" in out:
                # One reply is enough for these cases; the broker closes after close-ok.
                reader = c.FrameReader(1 << 20, expect_header=False)
                reader.feed(out)
                frames = reader.frames() if not out.startswith(b"AMQP") else []
                if out.startswith(b"AMQP") or any(
                    isinstance(f, c.MethodFrame) and isinstance(f.method, c.ConnectionClose)
                    for f in frames
                ):
                    s.sendall(c.encode_method(0, c.ConnectionCloseOk()))
                    break
        return out
    finally:
        s.close()


def _recv_frame(s: socket.socket) -> bytes:
    head = b""
    while len(head) < 7:
        head += s.recv(7 - len(head))
    _, _, size = struct.unpack(">BHI", head)
    body = b""
    while len(body) < size + 1:
        body += s.recv(size + 1 - len(body))
    return head + body


def _close_code(reply: bytes) -> int:
    reader = c.FrameReader(1 << 20, expect_header=False)
    reader.feed(reply)
    for f in reader.frames():
        if isinstance(f, c.MethodFrame) and isinstance(f.method, c.ConnectionClose):
            return f.method.reply_code
    return -1


@pytest_twisted.ensureDeferred
async def test_bad_input_gets_spec_errors_and_others_are_served(broker: Broker) -> None:
    """Garbage, a wrong frame-end, an oversize frame and a method on a closed channel get the
    spec's answers; a pika connection opened before keeps working throughout."""

    def scenario() -> dict[str, object]:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("survivor")
        garbage = _raw(broker.port, b"GET / HTTP/1.1\r\n\r\n", handshake=False)
        bad_end = bytearray(c.encode_method(1, c.ChannelOpen()))
        bad_end[-1] = 0
        wrong_end = _close_code(_raw(broker.port, bytes(bad_end)))
        oversize = _close_code(_raw(broker.port, struct.pack(">BHI", 3, 1, 1 << 24)))
        closed_channel = _close_code(
            _raw(broker.port, c.encode_method(7, c.QueueDeclare(queue="x")))
        )
        ch.basic_publish("", "survivor", b"alive")
        body = ch.basic_get("survivor", auto_ack=True)[2]
        conn.close()
        return {
            "garbage": garbage,
            "wrong_end": wrong_end,
            "oversize": oversize,
            "closed_channel": closed_channel,
            "body": body,
        }

    out = await broker.run(scenario)
    assert out["garbage"] == c.PROTOCOL_HEADER
    assert out["wrong_end"] == 501
    assert out["oversize"] == 501
    assert out["closed_channel"] == 504
    assert out["body"] == b"alive"


@pytest_twisted.ensureDeferred
async def test_select_connection_publishes_with_confirms_and_consumes(broker: Broker) -> None:
    """pika's asynchronous SelectConnection: declare, confirm 20 publishes, consume them."""

    def scenario() -> tuple[int, list[bytes]]:
        acks: list[int] = []
        got: list[bytes] = []
        state: dict[str, object] = {}

        def on_open(conn: pika.SelectConnection) -> None:
            conn.channel(on_open_callback=on_channel)

        def on_channel(ch: object) -> None:
            state["ch"] = ch
            ch.queue_declare("sel", callback=on_declared)  # type: ignore[attr-defined]

        def on_declared(_: object) -> None:
            ch = state["ch"]
            ch.confirm_delivery(on_confirm, callback=on_confirm_ok)  # type: ignore[attr-defined]

        def on_confirm_ok(_: object) -> None:
            ch = state["ch"]
            for i in range(20):
                ch.basic_publish("", "sel", f"s{i}".encode())  # type: ignore[attr-defined]
            ch.basic_consume("sel", on_message)  # type: ignore[attr-defined]

        def on_confirm(frame: object) -> None:
            method = frame.method  # type: ignore[attr-defined]
            first = method.delivery_tag
            if method.multiple:
                first = acks[-1] + 1 if acks else 1
            acks.extend(range(first, method.delivery_tag + 1))
            maybe_done()

        def on_message(ch: object, method: object, props: object, body: bytes) -> None:
            got.append(body)
            ch.basic_ack(method.delivery_tag)  # type: ignore[attr-defined]
            maybe_done()

        def maybe_done() -> None:
            if len(got) == 20 and len(acks) == 20:
                state["conn"].close()  # type: ignore[attr-defined]

        conn = pika.SelectConnection(
            broker.params(),
            on_open_callback=on_open,
            on_close_callback=lambda conn, reason: conn.ioloop.stop(),
        )
        state["conn"] = conn
        conn.ioloop.call_later(10, conn.ioloop.stop)
        conn.ioloop.start()
        return len(acks), got

    n_acks, got = await broker.run(scenario)
    assert n_acks == 20  # every publish confirmed once (multiple acks expanded)
    assert got == [f"s{i}".encode() for i in range(20)]
