"""A produced batch whose inner records are malformed (CRC valid) is refused with
INVALID_RECORD, as Kafka's broker answers; nothing of it is stored, and the connection and other
clients keep working."""

from __future__ import annotations

import socket
import struct

import lz4.frame
import pytest_twisted
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka_harness import Broker

from polybroker.protocols.kafka import records as r

TOPIC = "bad-batches"


def _zz(v: int) -> bytes:
    return r._zigzag_slow(v)


def _record(delta: int, value: bytes, value_len: int | None = None) -> bytes:
    """Attributes, timestamp delta 0, offset delta, null key, the value (its length prefix as
    given, or true), no headers."""
    size = len(value) if value_len is None else value_len
    body = b"\x00" + _zz(0) + _zz(delta) + _zz(-1) + _zz(size) + value + _zz(0)
    return _zz(len(body)) + body


def _batch(records: list[bytes], codec: int) -> bytes:
    """A v2 batch around raw records (lz4 or none) with a valid CRC."""
    body = b"".join(records)
    if codec == r.COMPRESSION_LZ4:
        body = lz4.frame.compress(body)
    n = len(records)
    after = struct.pack(">hiqqqhii", codec, n - 1, 1000, 1000, -1, -1, -1, n)
    crc = r.crc32c(after + body)
    return struct.pack(">qiibI", 0, 9 + len(after) + len(body), -1, 2, crc) + after + body


def _produce_v3(correlation: int, records: bytes) -> bytes:
    """A Produce v3 request (acks=1) of ``records`` to partition 0 of TOPIC, framed."""
    name = TOPIC.encode()
    body = (
        struct.pack(">hhih", 0, 3, correlation, 4)
        + b"test"
        + struct.pack(">hhi", -1, 1, 10_000)  # no transactional id, acks, timeout
        + struct.pack(">ih", 1, len(name))
        + name
        + struct.pack(">iii", 1, 0, len(records))
        + records
    )
    return struct.pack(">i", len(body)) + body


def _answer(s: socket.socket) -> tuple[int, int, int]:
    """(correlation id, error code, base offset) of a Produce v3 response for one partition."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack_from(">i", data)[0]:
        chunk = s.recv(65536)
        assert chunk, "connection closed"
        data += chunk
    (correlation,) = struct.unpack_from(">i", data, 4)
    pos = 8 + 4  # topics array length
    (name_len,) = struct.unpack_from(">h", data, pos)
    pos += 2 + name_len + 4  # name, partitions array length
    _, error, base = struct.unpack_from(">ihq", data, pos)
    return correlation, error, base


@pytest_twisted.ensureDeferred
async def test_a_batch_with_malformed_records_is_refused_and_nothing_is_stored(
    broker: Broker,
) -> None:
    """Uncompressed and lz4 batches whose middle or last record claims a value longer than the
    record get INVALID_RECORD on a connection that then stores a good batch; a kafka-python
    producer on its own connection works meanwhile, and consumers read exactly the good
    records at offsets 0, 1, 2."""

    def scenario() -> tuple[list[tuple[int, int, int]], list[tuple[int, bytes | None]]]:
        kp = KafkaProducer(bootstrap_servers=broker.bootstrap)
        kp.send(TOPIC, value=b"first", partition=0).get(timeout=10)
        bad_middle = [_record(0, b"ok"), _record(1, b"abc", value_len=9), _record(2, b"ok")]
        bad_last = [_record(0, b"ok"), _record(1, b"abc", value_len=4)]
        answers = []
        host, port = broker.bootstrap.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            correlation = 1
            for codec in (r.COMPRESSION_NONE, r.COMPRESSION_LZ4):
                for records in (bad_middle, bad_last):
                    s.sendall(_produce_v3(correlation, _batch(records, codec)))
                    answers.append(_answer(s))
                    correlation += 1
            good = [_record(0, b"good-0"), _record(1, b"good-1")]
            s.sendall(_produce_v3(correlation, _batch(good, r.COMPRESSION_LZ4)))
            answers.append(_answer(s))
        kp.send(TOPIC, value=b"last", partition=0).get(timeout=10)
        kp.close()
        kc = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=5_000)
        kc.assign([TopicPartition(TOPIC, 0)])
        kc.seek_to_beginning()
        got = [(m.offset, m.value) for m in kc]
        kc.close()
        return answers, got

    answers, got = await broker.run(scenario)
    invalid_record = 87
    assert answers == [(i, invalid_record, -1) for i in range(1, 5)] + [(5, 0, 1)]
    assert got == [(0, b"first"), (1, b"good-0"), (2, b"good-1"), (3, b"last")]
