"""Bad input on every protocol port: real clients' sessions, mutated, against a standalone.

The seeds under ``sessions/`` are what paho-mqtt, kafka-python, pika and pulsar-client sent a
standalone in short sessions (``sessions/record.py`` records them again). Each case replays one
seed with a few mutations (bit flips, boundary bytes, huge lengths, cuts, inserted and repeated
runs), often only after an intact prefix so that the handshake passes and later frames are hit,
written in pieces, several connections at once. Whatever the bytes, the broker must answer or
close the connection with a reason (logged at info), never fail inside a handler (an error in
its log), stop serving, or stop being healthy; a real client of the same protocol is then served.
The cases are seeded: a failure names its seed and replays the same way.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from standalone_process import start_standalone, stop_process

SEEDS = Path(__file__).parent / "sessions"
CASES = 200  # mutated sessions per protocol
PARALLEL = 8
QUIET_S = 0.2  # a case ends when the broker closed, or wrote nothing for this long,
READ_BOUND_S = 5.0  # or after this long in all
_BOUNDARY = (b"\x00", b"\x01", b"\x7f", b"\x80", b"\xff")
_WIDE = (b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00", b"\x80\x00\x00\x00")
_BAD_LEVEL = re.compile(r"^\S+ (error|critical) |Traceback", re.MULTILINE)

PORT_KEYS = {
    "mqtt": "mqttListenerPort",
    "kafka": "kafkaListenerPort",
    "amqp": "amqpListenerPort",
    "pulsar": "brokerServicePort",
}


def mutate(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one to ten random edits."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 5, 10))):
        if not b:
            b += rng.randbytes(8)
        i = rng.randrange(len(b))
        op = rng.randrange(7)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i : i + 1] = rng.choice(_BOUNDARY)
        elif op == 2:
            b[i : i + 4] = rng.choice(_WIDE)
        elif op == 3:
            del b[i : i + rng.randrange(1, 64)]
        elif op == 4:
            b[i:i] = rng.randbytes(rng.randrange(1, 64))
        elif op == 5:
            b[i:i] = b[i : i + rng.randrange(1, 256)]
        else:
            del b[rng.randrange(len(b) + 1) :]
    return bytes(b)


def case(seeds: list[bytes], rng: random.Random) -> bytes:
    """One case: a seed mutated after an intact prefix, or wholly, or random bytes."""
    seed = rng.choice(seeds)
    r = rng.random()
    if r < 0.6:
        cut = rng.randrange(len(seed))
        return seed[:cut] + mutate(seed[cut:], rng)
    if r < 0.95:
        return mutate(seed, rng)
    return rng.randbytes(rng.randrange(1, 2000))


def replay(port: int, data: bytes, rng: random.Random) -> None:
    """Send ``data`` in pieces (sometimes half-closing after it) and read until the broker
    closes or goes quiet; a reset, a refused write or a shutdown of a connection the broker
    already dropped only means that the broker closed first."""
    pieces = []
    pos = 0
    while pos < len(data):
        n = rng.choice((len(data), 1, 7, 100, 1000))
        pieces.append(data[pos : pos + n])
        pos += n
    half_close = rng.random() < 0.3
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            s.settimeout(QUIET_S)
            deadline = time.monotonic() + READ_BOUND_S
            while s.recv(65536) and time.monotonic() < deadline:
                pass
        except OSError:  # TimeoutError, ConnectionError, ENOTCONN
            pass


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, int], Path]]:
    root = tmp_path_factory.mktemp("mutated")
    log = root / "standalone.log"
    proc, ports = start_standalone(root / "data", log)
    try:
        yield ports, log
        assert proc.poll() is None, "the standalone died"
    finally:
        stop_process(proc)


def mqtt_round_trip(port: int) -> None:
    import paho.mqtt.client as mqtt

    topic = f"check/{uuid.uuid4().hex}"
    subscribed, received = threading.Event(), threading.Event()
    got: list[bytes] = []

    def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
        got.append(msg.payload)
        received.set()

    sub = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2)
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.on_message = on_message
    sub.connect("127.0.0.1", port)
    sub.loop_start()
    pub = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2)
    try:
        sub.subscribe(topic, qos=1)
        assert subscribed.wait(10), "no SUBACK"
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        pub.publish(topic, b"still served", qos=1).wait_for_publish(10)
        assert received.wait(10), "nothing delivered"
    finally:
        pub.disconnect()
        pub.loop_stop()
        sub.disconnect()
        sub.loop_stop()
    assert got == [b"still served"]


def kafka_round_trip(port: int) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = f"check-{uuid.uuid4().hex}"
    producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}")
    producer.send(topic, b"still served").get(30)
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=f"127.0.0.1:{port}", consumer_timeout_ms=10_000)
    consumer.assign([TopicPartition(topic, 0)])
    consumer.seek_to_beginning()
    assert next(iter(consumer)).value == b"still served"
    consumer.close()


def amqp_round_trip(port: int) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, socket_timeout=10))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        queue = f"check-{uuid.uuid4().hex}"
        ch.queue_declare(queue)
        ch.basic_publish("", queue, b"still served")
        for method, _, body in ch.consume(queue, inactivity_timeout=10):
            assert method is not None, "nothing delivered"
            assert body == b"still served"
            ch.basic_ack(method.delivery_tag)
            break
        ch.cancel()
    finally:
        conn.close()


def pulsar_round_trip(port: int) -> None:
    import pulsar

    client = pulsar.Client(f"pulsar://127.0.0.1:{port}", operation_timeout_seconds=30)
    try:
        topic = f"check-{uuid.uuid4().hex}"
        consumer = client.subscribe(topic, "s")
        client.create_producer(topic).send(b"still served")
        msg = consumer.receive(30_000)
        consumer.acknowledge(msg)
        assert msg.data() == b"still served"
    finally:
        client.close()


ROUND_TRIPS: dict[str, Callable[[int], None]] = {
    "mqtt": mqtt_round_trip,
    "kafka": kafka_round_trip,
    "amqp": amqp_round_trip,
    "pulsar": pulsar_round_trip,
}


@pytest.mark.parametrize("protocol", sorted(PORT_KEYS))
def test_mutated_sessions_are_refused_cleanly_and_the_broker_keeps_serving(
    standalone: tuple[dict[str, int], Path], protocol: str
) -> None:
    ports, log = standalone
    port = ports[PORT_KEYS[protocol]]
    seeds = [p.read_bytes() for p in sorted(SEEDS.glob(f"{protocol}-*.bin"))]
    assert seeds, f"no seeds for {protocol}"
    start = log.stat().st_size
    datas = [case(seeds, random.Random(f"{protocol}-{n}")) for n in range(CASES)]

    def run(n: int) -> None:
        replay(port, datas[n], random.Random(f"{protocol}-{n}-send"))

    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(run, range(CASES)))
    url = f"http://127.0.0.1:{ports['webServicePort']}/admin/v2/brokers/health"
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.read() == b"ok"
    ROUND_TRIPS[protocol](port)
    with open(log, "rb") as f:
        f.seek(start)
        written = f.read().decode(errors="replace")
    bad = _BAD_LEVEL.findall(written)
    assert not bad, "\n".join(
        line for line in written.splitlines() if _BAD_LEVEL.search(line + "\n")
    )[:4000]
    assert "closing" in written or "error code" in written, "no bad input was refused"
