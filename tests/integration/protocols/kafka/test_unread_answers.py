"""A Kafka client that sends requests but does not read their answers: the broker stops
reading it instead of buffering every answer, and the answers all arrive once it reads."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from kafka import KafkaProducer
from kafka.protocol.consumer import FetchRequest, FetchResponse
from standalone_process import rss_mb, start_standalone, stop_process, wait_until_idle

FETCHES = 300
RECORDS = 1000  # of 1000 bytes: each fetch answer carries about 1 MB


def _read_frame(s: socket.socket) -> bytes:
    head = s.recv(4, socket.MSG_WAITALL)
    assert len(head) == 4, "connection closed"
    (size,) = struct.unpack(">i", head)
    body = bytearray()
    while len(body) < size:
        chunk = s.recv(size - len(body))
        assert chunk, "connection closed"
        body += chunk
    return bytes(body)


def test_unread_fetch_answers_are_not_buffered_and_all_arrive_later(tmp_path: Path) -> None:
    proc, ports = start_standalone(
        tmp_path / "data", tmp_path / "standalone.log", {"messagingProtocols": "kafka"}
    )
    try:
        port = ports["kafkaListenerPort"]
        producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}")
        for _ in range(RECORDS):
            producer.send("unread", b"x" * 1000)
        producer.flush()
        producer.close()
        fetch = FetchRequest[4](
            replica_id=-1,
            max_wait_ms=0,
            min_bytes=0,
            max_bytes=50 << 20,
            isolation_level=0,
            topics=[
                FetchRequest.FetchTopic(
                    topic="unread",
                    partitions=[
                        FetchRequest.FetchTopic.FetchPartition(
                            partition=0, fetch_offset=0, partition_max_bytes=1 << 20
                        )
                    ],
                )
            ],
        )
        frames = []
        for corr in range(1, FETCHES + 1):
            fetch.with_header(correlation_id=corr, client_id="unread")
            frames.append(bytes(fetch.encode(header=True, framed=True)))
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            rss_before = rss_mb(proc.pid)
            s.sendall(b"".join(frames))  # about 45 KB of requests: the kernel takes them all
            wait_until_idle(proc.pid)
            # Buffering every answer would hold about FETCHES MB.
            assert rss_mb(proc.pid) - rss_before < 100
            for corr in range(1, FETCHES + 1):
                frame = _read_frame(s)
                assert struct.unpack_from(">i", frame)[0] == corr
                answer = FetchResponse[4].decode(frame[4:])
                assert len(answer.responses[0].partitions[0].records) > 900_000
    finally:
        stop_process(proc)
