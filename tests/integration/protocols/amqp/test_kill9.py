"""Durability through kill -9: a real ``polybroker standalone`` (bookie with fsync'd journal,
embedded metadata store) is killed and restarted on the same data directory."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pika
import pika.exceptions
import pulsar
import pytest
from standalone_process import start_standalone, stop_process

WEB_PORTS: dict[int, int] = {}  # AMQP port -> admin HTTP port of the same standalone


def start(data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start a standalone with AMQP on a free port; return it and its AMQP port (its admin
    HTTP port is in ``WEB_PORTS``)."""
    proc, ports = start_standalone(data_dir, log, {"messagingProtocols": "amqp"})
    WEB_PORTS[ports["amqpListenerPort"]] = ports["webServicePort"]
    return proc, ports["amqpListenerPort"]


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    stop_process(proc, sig)


def admin(port: int, path: str) -> object:
    """GET an admin REST path of the standalone serving AMQP on ``port``."""
    url = f"http://127.0.0.1:{WEB_PORTS[port]}{path}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def stored_messages(port: int) -> dict[str, int]:
    """Messages ever written to each topic of public/default (the topics' stats)."""
    out: dict[str, int] = {}
    topics = admin(port, "/admin/v2/persistent/public/default")
    assert isinstance(topics, list)
    for full in topics:
        local = full.rsplit("/", 1)[-1]
        stats = admin(port, f"/admin/v2/persistent/public/default/{local}/stats")
        assert isinstance(stats, dict)
        out[local] = int(stats["msgInCounter"])
    return out


def connect(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", port, socket_timeout=10, blocked_connection_timeout=10
        )
    )


def test_kill_9_keeps_confirmed_persistent_messages_and_durable_definitions(
    tmp_path: Path,
) -> None:
    """Confirmed persistent messages, durable exchanges, queues and bindings survive kill -9;
    transient messages and queues do not."""
    data = tmp_path / "data"
    log = tmp_path / "standalone.log"
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("orders", "topic", durable=True)
        ch.queue_declare("eu", durable=True)
        ch.queue_bind("eu", "orders", "eu.*")
        ch.queue_declare("scratch")
        for i in range(50):
            ch.basic_publish(
                "orders", "eu.de", f"p{i}".encode(), pika.BasicProperties(delivery_mode=2)
            )
        ch.basic_publish("orders", "eu.fr", b"transient", pika.BasicProperties(delivery_mode=1))
        ch.basic_publish("", "scratch", b"gone")
        # Acknowledge the first ten: they must not come back.
        for _ in range(10):
            method, _, _ = ch.basic_get("eu")
            ch.basic_ack(method.delivery_tag)
        ch.queue_declare("eu", passive=True)  # a round trip: the acks were processed
        conn.close()
    finally:
        stop(proc, signal.SIGKILL)
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        bodies: list[bytes] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            _, _, body = ch.basic_get("eu", auto_ack=True)
            if body is not None:
                bodies.append(body)
            elif len(bodies) >= 40:
                break
        ch.confirm_delivery()
        ch.basic_publish("orders", "eu.it", b"after", mandatory=True)
        routed = ch.basic_get("eu", auto_ack=True)[2]
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare("scratch", passive=True)
        conn.close()
    finally:
        stop(proc)
    # Acks are persisted at the cursor's mark-delete rate, so acknowledged messages may come
    # back after a crash (at-least-once); every unacknowledged one must.
    published = [f"p{i}".encode() for i in range(50)]
    assert bodies[-40:] == published[10:]
    assert bodies == published[50 - len(bodies) :]  # in order, no transient message
    assert routed == b"after"
    assert e.value.reply_code == 404


def test_kill_9_keeps_every_queue_bound_to_one_exchange(tmp_path: Path) -> None:
    """Three durable queues on one fanout read its one stored copy of each message; after
    kill -9 each has what it had not acknowledged, in order, and routing goes on."""
    data = tmp_path / "data"
    log = tmp_path / "standalone.log"
    queues = ("a", "b", "c")
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare("fan", "fanout", durable=True)
        for q in queues:
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, "fan")
        for i in range(30):
            ch.basic_publish("fan", "", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
        stored = stored_messages(port)
        for _ in range(10):  # a acknowledges ten
            method, _, _ = ch.basic_get("a")
            ch.basic_ack(method.delivery_tag)
        ch.queue_declare("a", passive=True)  # a round trip: the acks were processed
        conn.close()
    finally:
        stop(proc, signal.SIGKILL)
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        got: dict[str, list[bytes]] = {q: [] for q in queues}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            progress = False
            for q in queues:
                body = ch.basic_get(q, auto_ack=True)[2]
                if body is not None:
                    got[q].append(body)
                    progress = True
            if not progress and all(len(got[q]) >= (20 if q == "a" else 30) for q in queues):
                break
        ch.confirm_delivery()
        ch.basic_publish("fan", "", b"after", mandatory=True)
        after = {q: ch.basic_get(q, auto_ack=True)[2] for q in queues}
        conn.close()
    finally:
        stop(proc)
    published = [f"m{i}".encode() for i in range(30)]
    # Acks are persisted at the cursor's mark-delete rate (at-least-once after a crash).
    assert got["a"][-20:] == published[10:]
    assert got["a"] == published[30 - len(got["a"]) :]
    assert got["b"] == published
    assert got["c"] == published
    assert after == {q: b"after" for q in queues}
    # Stored once: the exchange's log holds the 30 messages, the queues' own topics none.
    assert stored["amqp.exchange.fan"] == 30
    assert sum(stored.values()) == 30


def test_kill_9_does_not_redeliver_acked_messages_of_a_partly_acked_entry(
    tmp_path: Path,
) -> None:
    """Ten messages committed in one transaction share one stored entry; four of them acked
    in a committed transaction do not come back after kill -9, the other six do, in order."""
    data = tmp_path / "data"
    log = tmp_path / "standalone.log"
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        ch.queue_declare("batch", durable=True)
        ch.tx_select()
        for i in range(10):
            ch.basic_publish("", "batch", f"b{i}".encode(), pika.BasicProperties(delivery_mode=2))
        ch.tx_commit()
        internal = admin(port, "/admin/v2/persistent/public/default/amqp.queue.batch/internalStats")
        assert isinstance(internal, dict)
        ch.tx_select()
        taken = []
        for _ in range(4):
            method, _, body = ch.basic_get("batch")
            taken.append(body)
            ch.basic_ack(method.delivery_tag)
        ch.tx_commit()  # replies once the acks are durable
    finally:
        stop(proc, signal.SIGKILL)
    proc, port = start(data, log)
    try:
        conn = connect(port)
        ch = conn.channel()
        bodies: list[bytes] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(bodies) < 6:
            _, _, body = ch.basic_get("batch", auto_ack=True)
            if body is not None:
                bodies.append(body)
        extra = ch.basic_get("batch", auto_ack=True)[2]
        conn.close()
    finally:
        stop(proc)
    assert internal["numberOfEntries"] == 1
    assert taken == [f"b{i}".encode() for i in range(4)]
    assert bodies == [f"b{i}".encode() for i in range(4, 10)]
    assert extra is None


def test_kill_9_keeps_the_backlog_of_a_queue_bound_to_amq_topic(tmp_path: Path) -> None:
    """A durable queue bound to ``amq.topic`` reads a topic the Pulsar client writes; after
    kill -9 it still has every message it had not acknowledged. Other durable queues are
    restored after it, each opening its own topic, while it already reads its backlog."""
    data = tmp_path / "data"
    log = tmp_path / "standalone.log"
    config = {"messagingProtocols": "amqp,pulsar"}
    proc, ports = start_standalone(data, log, config)
    try:
        conn = connect(ports["amqpListenerPort"])
        ch = conn.channel()
        ch.queue_declare("bridged", durable=True)
        ch.queue_bind("bridged", "amq.topic", "feed")
        ch.confirm_delivery()
        for name in ("later-1", "later-2", "later-3"):
            ch.queue_declare(name, durable=True)
            ch.basic_publish("", name, b"own", pika.BasicProperties(delivery_mode=2))
        conn.close()
        client = pulsar.Client(f"pulsar://127.0.0.1:{ports['brokerServicePort']}")
        try:
            producer = client.create_producer("feed", batching_enabled=False)
            for i in range(200):
                producer.send(f"f{i}".encode())
        finally:
            client.close()
    finally:
        stop(proc, signal.SIGKILL)
    for _ in range(3):  # each restart reads the whole backlog again
        proc, ports = start_standalone(data, log, config)
        try:
            conn = connect(ports["amqpListenerPort"])
            ch = conn.channel()
            got: list[bytes] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(got) < 200:
                body = ch.basic_get("bridged")[2]
                if body is not None:
                    got.append(body)
                else:
                    time.sleep(0.05)
            conn.close()  # unacknowledged: all of it stays in the queue
        finally:
            stop(proc, signal.SIGKILL)
        assert got == [f"f{i}".encode() for i in range(200)]
