"""Pulsar clients that do not read: a consumer granting many permits leaves its backlog in
storage instead of the broker's send buffer, and a client pipelining requests whose answers
are large (topic listings) stops being read instead of having every answer buffered; all
arrives, in order, once the client reads."""

from __future__ import annotations

import socket
import struct
import time
import urllib.request
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


LISTINGS = 15_000
TOPICS = 100  # with long names each listing answers about 24 KB: 350 MB for all of them
LONG = "a-rather-long-topic-name-" + "x" * 160


def test_unread_answers_stop_the_reading(tmp_path: Path) -> None:
    proc, ports = start_standalone(
        tmp_path / "data", tmp_path / "standalone.log", {"messagingProtocols": "pulsar"}
    )
    try:
        admin = f"http://127.0.0.1:{ports['webServicePort']}/admin/v2/persistent/public/default"
        for i in range(TOPICS):
            put = urllib.request.Request(f"{admin}/{LONG}-{i:05d}", method="PUT")
            urllib.request.urlopen(put, timeout=30).read()
        with socket.create_connection(("127.0.0.1", ports["brokerServicePort"]), timeout=30) as s:
            decoder = FrameDecoder(1 << 24)
            connect = command(T.CONNECT, "connect", client_version="raw", protocol_version=19)
            s.sendall(encode_command(connect))
            _expect(s, decoder, T.CONNECTED)
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            requests = b"".join(
                encode_command(
                    command(
                        T.GET_TOPICS_OF_NAMESPACE,
                        "getTopicsOfNamespace",
                        request_id=i,
                        namespace="public/default",
                    )
                )
                for i in range(LISTINGS)
            )
            s.setblocking(False)
            sent = 0
            deadline = time.monotonic() + 60
            while sent < len(requests):  # what the kernels take (all of it, here)
                try:
                    sent += s.send(requests[sent:])
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            wait_until_idle(proc.pid)
            grown = rss_mb(proc.pid) - rss_before
            # 6 MB measured; 41 MB when a whole read of requests was answered at once.
            assert grown < 25, f"the broker grew by {grown:.0f} MB"
            s.setblocking(True)
            answered = 0
            while answered < LISTINGS:
                if sent < len(requests):
                    sent += s.send(requests[sent:])
                data = s.recv(1 << 20)
                assert data, "connection closed"
                for frame in decoder.feed(data):
                    if frame.command.type == T.PING:  # the broker's keep-alive
                        s.sendall(encode_command(command(T.PONG, "pong")))
                        continue
                    listing = frame.command.getTopicsOfNamespaceResponse
                    assert listing.request_id == answered
                    assert len(listing.topics) == TOPICS
                    answered += 1
    finally:
        stop_process(proc)
