"""A producer that pipelines SENDs as fast as its socket takes them, faster than storage
writes: the broker stops reading it while maxPendingPublishRequestsPerConnection SENDs await
their receipts, so what waits stays in the client's socket, not in the broker's memory."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from standalone_process import (
    SMALL_CACHES,
    rss_mb,
    start_standalone,
    stop_and_remove,
    wait_until_idle,
)

from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    FrameDecoder,
    build_tail,
    command,
    encode_command,
    encode_payload_command,
)

T = pb.BaseCommand
TOPIC = "persistent://public/default/fast-producer"
BODY = 10_000
ROUNDS = 60  # of 1000 SENDs: 600 MB in all


def test_a_producer_faster_than_storage_is_slowed_not_buffered(tmp_path: Path) -> None:
    config = {"messagingProtocols": "pulsar", **SMALL_CACHES}
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    try:
        with socket.create_connection(("127.0.0.1", ports["brokerServicePort"]), timeout=60) as s:
            decoder = FrameDecoder(1 << 24)
            connect = command(T.CONNECT, "connect", client_version="raw", protocol_version=19)
            producer = command(T.PRODUCER, "producer", topic=TOPIC, producer_id=1, request_id=1)
            s.sendall(encode_command(connect) + encode_command(producer))
            answers: list[int] = []
            while len(answers) < 2:
                answers += [f.command.type for f in decoder.feed(s.recv(65536))]
            assert answers == [T.CONNECTED, T.PRODUCER_SUCCESS]
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            peak = [0.0]
            receipts: list[int] = []

            def read_receipts() -> None:
                while len(receipts) < ROUNDS * 1000:
                    data = s.recv(1 << 20)
                    if not data:
                        return
                    for frame in decoder.feed(data):
                        assert frame.command.type == T.SEND_RECEIPT
                        receipts.append(frame.command.send_receipt.sequence_id)
                    if len(receipts) % 10_000 < 100:
                        peak[0] = max(peak[0], rss_mb(proc.pid) - rss_before)

            reader = threading.Thread(target=read_receipts, daemon=True)
            reader.start()
            body = b"x" * BODY
            for r in range(ROUNDS):
                s.sendall(
                    b"".join(
                        encode_payload_command(
                            command(T.SEND, "send", producer_id=1, sequence_id=seq),
                            build_tail(
                                pb.MessageMetadata(
                                    producer_name="raw", sequence_id=seq, publish_time=1
                                ),
                                body,
                            ),
                        )
                        for seq in range(r * 1000, (r + 1) * 1000)
                    )
                )
                peak[0] = max(peak[0], rss_mb(proc.pid) - rss_before)
            reader.join(120)
            assert receipts == list(range(ROUNDS * 1000))
            # Pending SENDs are bounded at 1000 (10 MB here) and caches at 32 MB: 72 MB
            # measured; 716 MB without the bound, SENDs awaiting storage.
            assert peak[0] < 150, f"the broker grew by {peak[0]:.0f} MB"
    finally:
        stop_and_remove(proc, tmp_path / "data")
