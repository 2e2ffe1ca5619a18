"""An auto-ack consumer that does not read: a durable queue's messages stay in its log instead
of moving into the broker's send buffer, and they all arrive, in order, once it reads."""

from __future__ import annotations

import time
from pathlib import Path

import pika
from standalone_process import rss_mb, start_standalone, stop_process, wait_until_idle

MESSAGES = 150_000
BODY = 2000  # 300 MB in all


def test_unread_auto_ack_deliveries_stay_in_the_log(tmp_path: Path) -> None:
    proc, ports = start_standalone(
        tmp_path / "data", tmp_path / "standalone.log", {"messagingProtocols": "amqp"}
    )
    try:
        params = pika.ConnectionParameters("127.0.0.1", ports["amqpListenerPort"])
        publisher = pika.BlockingConnection(params)
        pch = publisher.channel()
        pch.queue_declare("unread", durable=True)
        reader = pika.BlockingConnection(params)
        rch = reader.channel()
        got: list[int] = []
        rch.basic_consume(
            "unread",
            lambda _ch, _m, _p, body: got.append(int.from_bytes(body[:4], "big")),
            auto_ack=True,
        )
        rss_before = rss_mb(proc.pid)
        persistent = pika.BasicProperties(delivery_mode=2)
        pad = b"x" * (BODY - 4)
        # The reader's connection is not serviced meanwhile: nothing reads its socket.
        for i in range(MESSAGES):
            pch.basic_publish("", "unread", i.to_bytes(4, "big") + pad, persistent)
        publisher.process_data_events(0)
        wait_until_idle(proc.pid)
        # Buffering every delivery would hold the 300 MB (and more) in the broker; what it
        # may hold is storage's caches, about 100 MB whatever the volume.
        grown = rss_mb(proc.pid) - rss_before
        assert grown < 180, f"the broker grew by {grown:.0f} MB"
        deadline = time.monotonic() + 120
        while len(got) < MESSAGES and time.monotonic() < deadline:
            reader.process_data_events(0.2)
        assert got == list(range(MESSAGES))
        publisher.close()
        reader.close()
    finally:
        stop_process(proc)
