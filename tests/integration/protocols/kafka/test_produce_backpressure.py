"""A Kafka producer with acks=0 sends as fast as its socket takes the requests, faster than
storage writes: each request stays in flight until its write is done, so the broker stops
reading the connection at its bound and what waits stays in the client, not in the broker's
memory; every record is stored, and the memory the flood used goes back to the system."""

from __future__ import annotations

import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from standalone_process import (
    SMALL_CACHES,
    rss_mb,
    start_standalone,
    stop_and_remove,
    wait_until_idle,
)

BODY = 10_000
COUNT = 100_000  # 1 GB


def test_an_acks0_producer_faster_than_storage_is_slowed_not_buffered(tmp_path: Path) -> None:
    config = {"messagingProtocols": "kafka", **SMALL_CACHES}
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    try:
        bootstrap = f"127.0.0.1:{ports['kafkaListenerPort']}"
        producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": 0,
                "linger.ms": 5,
                "queue.buffering.max.messages": 1_000_000,
                "queue.buffering.max.kbytes": 4_000_000,
            }
        )
        producer.produce("flood", b"first")
        assert producer.flush(30) == 0
        wait_until_idle(proc.pid)
        rss_before = rss_mb(proc.pid)
        peak = 0.0
        body = b"x" * BODY
        for i in range(COUNT):
            producer.produce("flood", body)
            producer.poll(0)
            if i % 5000 == 0:
                peak = max(peak, rss_mb(proc.pid) - rss_before)
        assert producer.flush(120) == 0
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "check"})
        try:
            deadline = time.monotonic() + 120
            while True:
                peak = max(peak, rss_mb(proc.pid) - rss_before)
                _, high = consumer.get_watermark_offsets(TopicPartition("flood", 0), timeout=30)
                if high >= COUNT + 1:
                    break
                assert time.monotonic() < deadline, f"{high} of {COUNT + 1} records stored"
                time.sleep(0.1)
            assert high == COUNT + 1
        finally:
            consumer.close()
        # 258 MB measured, most of it freed memory the allocator keeps; 1002 MB when acks=0
        # requests left the in-flight count at once.
        assert peak < 500, f"the broker grew by {peak:.0f} MB"
        # The heap trimmer (every 10 s) gives what the flood left free back to the system:
        # +15 MB measured; it may keep up to 64 MB free, beside the caches.
        deadline = time.monotonic() + 30
        while (grown := rss_mb(proc.pid) - rss_before) > 150:
            assert time.monotonic() < deadline, f"still {grown:.0f} MB above the start"
            time.sleep(0.5)
    finally:
        stop_and_remove(proc, tmp_path / "data")
