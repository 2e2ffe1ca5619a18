"""A Pulsar consumer that grants many permits and does not read: its backlog stays in
storage instead of moving into the broker's send buffer, and it all arrives, in order, once
the client reads."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pulsar
from standalone_process import rss_mb, start_standalone, stop_process, wait_until_idle

from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import FrameDecoder, command, encode_command, split_tail

T = pb.BaseCommand
MESSAGES = 100_000
BODY = 3000  # 300 MB in all
TOPIC = "persistent://public/default/unread"


def _expect(s: socket.socket, decoder: FrameDecoder, type_: int) -> None:
    while True:
        for frame in decoder.feed(s.recv(65536)):
            assert frame.command.type == type_, T.Type.Name(frame.command.type)
            return


def test_unread_deliveries_stay_in_storage(tmp_path: Path) -> None:
    proc, ports = start_standalone(
        tmp_path / "data", tmp_path / "standalone.log", {"messagingProtocols": "pulsar"}
    )
    try:
        port = ports["brokerServicePort"]
        client = pulsar.Client(f"pulsar://127.0.0.1:{port}")
        producer = client.create_producer(TOPIC, block_if_queue_full=True)
        pad = b"x" * (BODY - 4)
        for i in range(MESSAGES):
            producer.send_async(i.to_bytes(4, "big") + pad, None)
        producer.flush()
        client.close()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            decoder = FrameDecoder(1 << 24)
            s.sendall(
                encode_command(
                    command(T.CONNECT, "connect", client_version="raw", protocol_version=19)
                )
            )
            _expect(s, decoder, T.CONNECTED)
            sub = command(
                T.SUBSCRIBE,
                "subscribe",
                topic=TOPIC,
                subscription="unread",
                subType=pb.CommandSubscribe.Exclusive,
                consumer_id=1,
                request_id=1,
                initialPosition=pb.CommandSubscribe.Earliest,
            )
            s.sendall(encode_command(sub))
            _expect(s, decoder, T.SUCCESS)
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            flow = command(T.FLOW, "flow", consumer_id=1, messagePermits=10 * MESSAGES)
            s.sendall(encode_command(flow))
            wait_until_idle(proc.pid)
            # Sending the whole backlog would hold its 300 MB (and more) in the broker.
            grown = rss_mb(proc.pid) - rss_before
            assert grown < 150, f"the broker grew by {grown:.0f} MB"
            seen: list[int] = []
            while len(seen) < MESSAGES:
                data = s.recv(1 << 20)
                assert data, "connection closed"
                for frame in decoder.feed(data):
                    assert frame.command.type == T.MESSAGE
                    _, body = split_tail(frame.payload or b"")
                    seen += _indexes(body)
            assert seen == list(range(MESSAGES))
    finally:
        stop_process(proc)


def _indexes(body: bytes) -> list[int]:
    """The indexes of the messages of one entry (a batch of the client's, or one message)."""
    out = []
    if len(body) == BODY:
        return [int.from_bytes(body[:4], "big")]
    pos = 0
    while pos < len(body):
        (size,) = struct.unpack_from(">I", body, pos)
        meta = pb.SingleMessageMetadata()
        meta.ParseFromString(body[pos + 4 : pos + 4 + size])
        pos += 4 + size
        out.append(int.from_bytes(body[pos : pos + 4], "big"))
        pos += meta.payload_size
    return out
