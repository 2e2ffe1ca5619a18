"""Idempotent producers across kill -9 of a real ``polybroker standalone``: batches stored by
one broker process whose answers were lost are sent again, byte for byte (same producer id,
epoch and sequences), to the process restarted on the same data directory; it answers with the
original offsets and stores nothing twice, then an idempotent confluent-kafka producer and a
consumer see every record exactly once."""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from kafka.protocol.producer import ProduceRequest
from kafka.record.memory_records import MemoryRecordsBuilder
from standalone_process import start_standalone, stop_process

from polybroker.protocols.kafka import codec as c

TOPIC = "idem"
PID, EPOCH = 4242, 0


def start(data_dir: Path, entry_format: str, log: Path) -> tuple[Any, int]:
    """A standalone serving Kafka on a free port; returns (process, Kafka port)."""
    # Kafka consumers read by offset: keep what no subscription holds (as Kafka does).
    config = {
        "messagingProtocols": "kafka",
        "kafkaEntryFormat": entry_format,
        "defaultRetentionTimeInMinutes": -1,
    }
    proc, ports = start_standalone(data_dir, log, config)
    return proc, ports["kafkaListenerPort"]


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    stop_process(proc, sig)


def records(seq: int, n: int) -> bytes:
    """A batch of ``n`` records from the idempotent producer, sequences ``seq``..``seq+n-1``."""
    b = MemoryRecordsBuilder(2, 0, 1 << 20)
    b.set_producer_state(PID, EPOCH, seq, False)
    for i in range(n):
        b.append(1_700_000_000_000 + seq + i, None, b"raw-%d" % (seq + i), [])
    b.close()
    return bytes(b.buffer())


class RawClient:
    """Produce requests over a plain socket: what a client's retry puts on the wire."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.corr = 0

    def produce(self, data: bytes) -> tuple[int, int]:
        self.corr += 1
        req = ProduceRequest[7](
            transactional_id=None,
            acks=-1,
            timeout_ms=10_000,
            topic_data=[
                ProduceRequest.TopicProduceData(
                    name=TOPIC,
                    partition_data=[
                        ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=data)
                    ],
                )
            ],
        )
        req.with_header(correlation_id=self.corr, client_id="raw")
        self.sock.sendall(bytes(req.encode(header=True, framed=True)))
        (size,) = struct.unpack(">i", self._read(4))
        frame = self._read(size)
        assert struct.unpack_from(">i", frame)[0] == self.corr
        part = c.response_class(c.API_PRODUCE)[7].decode(frame[4:])
        answer = part.responses[0].partition_responses[0]
        return answer.error_code, answer.base_offset

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "the broker closed the connection"
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()


def read_all(port: int) -> list[bytes]:
    """Every record value of partition 0, from the beginning to the end offset."""
    consumer = Consumer(
        {"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "check", "enable.auto.commit": False}
    )
    try:
        tp = TopicPartition(TOPIC, 0)
        _, high = consumer.get_watermark_offsets(tp, timeout=15)
        consumer.assign([TopicPartition(TOPIC, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(values) < high and time.monotonic() < deadline:
            for m in consumer.consume(num_messages=500, timeout=0.5):
                if m.error() is None:
                    values.append(m.value())
        assert len(values) == high, f"read {len(values)} of {high} records"
        return values
    finally:
        consumer.close()


@pytest.mark.parametrize("entry_format", ["pulsar", "kafka"])
def test_batches_stored_before_a_kill_9_are_not_stored_again_on_retry(
    tmp_path: Path, entry_format: str
) -> None:
    """Two batches are stored (offsets 0-2, 3-4) and the broker is killed -9; the restarted
    broker answers both retried batches with their original offsets, takes the next sequence at
    offset 5, and a gap is refused; then an idempotent confluent-kafka producer adds its
    records: every record is in the log exactly once."""
    data = tmp_path / "data"
    log = tmp_path / "standalone.log"
    proc, port = start(data, entry_format, log)
    try:
        raw = RawClient(port)
        assert raw.produce(records(0, 3)) == (c.NONE, 0)
        assert raw.produce(records(3, 2)) == (c.NONE, 3)
        raw.close()
        kill(proc)

        proc, port = start(data, entry_format, log)
        raw = RawClient(port)
        assert raw.produce(records(3, 2)) == (c.NONE, 3), "the retry was stored again"
        assert raw.produce(records(0, 3)) == (c.NONE, 0)
        assert raw.produce(records(5, 1)) == (c.NONE, 5)
        assert raw.produce(records(9, 1))[0] == c.OUT_OF_ORDER_SEQUENCE_NUMBER
        raw.close()

        producer = Producer(
            {"bootstrap.servers": f"127.0.0.1:{port}", "enable.idempotence": True, "acks": "all"}
        )
        for i in range(100):
            producer.produce(TOPIC, value=b"client-%d" % i, partition=0)
        assert producer.flush(30) == 0

        values = read_all(port)
        expected = [b"raw-%d" % i for i in range(6)] + [b"client-%d" % i for i in range(100)]
        assert Counter(values) == Counter(expected)
        assert values[:6] == expected[:6]
    finally:
        kill(proc, signal.SIGTERM)
