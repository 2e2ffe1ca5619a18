"""An AMQP client publishing persistent messages to a durable queue as fast as its socket
takes them (no confirms), faster than storage writes: the broker stops reading it while its
publishes under way pass their bound, so what waits stays in the client's socket, not in the
broker's memory; every message reaches the queue."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pika
from standalone_process import (
    SMALL_CACHES,
    rss_mb,
    start_standalone,
    stop_and_remove,
    wait_until_idle,
)

from polybroker.protocols.amqp import codec as c

BODY = 10_000
ROUNDS = 100  # of 1000 publishes: 1 GB in all


def _frames(s: socket.socket, reader: c.FrameReader, n: int) -> list[c.Frame]:
    got: list[c.Frame] = []
    while len(got) < n:
        data = s.recv(65536)
        assert data, "connection closed"
        reader.feed(data)
        got += reader.frames()
    return got


def _queued(port: int) -> int:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        ok = conn.channel().queue_declare("flood", durable=True, passive=True)
        return int(ok.method.message_count)
    finally:
        conn.close()


def test_a_publisher_faster_than_storage_is_slowed_not_buffered(tmp_path: Path) -> None:
    config = {"messagingProtocols": "amqp", **SMALL_CACHES}
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    try:
        port = ports["amqpListenerPort"]
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            reader = c.FrameReader(frame_max=1 << 20, expect_header=False)
            s.sendall(c.PROTOCOL_HEADER)
            _frames(s, reader, 1)
            s.sendall(c.encode_method(0, c.ConnectionStartOk({}, "PLAIN", b"\0guest\0guest")))
            _frames(s, reader, 1)
            s.sendall(
                c.encode_method(0, c.ConnectionTuneOk(100, 131072, 0))
                + c.encode_method(0, c.ConnectionOpen("/"))
                + c.encode_method(1, c.ChannelOpen())
                + c.encode_method(1, c.QueueDeclare(queue="flood", durable=True))
            )
            declared = _frames(s, reader, 3)[-1]
            assert isinstance(declared, c.MethodFrame)
            assert isinstance(declared.method, c.QueueDeclareOk)
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            peak = 0.0
            one = c.encode_content(
                1,
                c.BasicPublish(exchange="", routing_key="flood"),
                c.BasicProperties(delivery_mode=2),
                b"x" * BODY,
                131072,
            )
            burst = one * 1000
            for _ in range(ROUNDS):
                s.sendall(burst)
                peak = max(peak, rss_mb(proc.pid) - rss_before)
            deadline = time.monotonic() + 120
            while _queued(port) < ROUNDS * 1000:
                assert time.monotonic() < deadline, "not everything was stored"
                peak = max(peak, rss_mb(proc.pid) - rss_before)
                time.sleep(0.1)
            assert _queued(port) == ROUNDS * 1000
            # 115 MB measured; 463 MB without the bound, and growing with the flood.
            assert peak < 250, f"the broker grew by {peak:.0f} MB"
    finally:
        stop_and_remove(proc, tmp_path / "data")
