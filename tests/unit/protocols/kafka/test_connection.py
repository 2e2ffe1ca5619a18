"""Unit tests of the Kafka connection and APIs over StringTransport, a Clock and the fake
ledger: ordering, long-poll fetch, produce checks, idempotence, offsets and bad input."""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.consumer import FetchRequest, ListOffsetsRequest
from kafka.protocol.metadata import MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of

from polybroker.broker_core import messages
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.kafka import apis as apis_module
from polybroker.protocols.kafka import codec as c
from polybroker.protocols.kafka.apis import (
    KafkaApis,
    Settings,
    producer_name,
    stored_producer_batch,
)
from polybroker.protocols.kafka.connection import KafkaConnection


def batch(
    n: int = 3, *, pid: int = -1, epoch: int = -1, seq: int = -1, codec: int = 0, size: int = 10
) -> bytes:
    b = MemoryRecordsBuilder(2, codec, 1 << 22)
    if pid >= 0:
        b.set_producer_state(pid, epoch, seq, False)
    for i in range(n):
        b.append(5000 + i, b"k%d" % i, b"v" * size, [("h", b"%d" % i)])
    b.close()
    return bytes(b.buffer())


class Wire:
    """One broker (fake storage) and one client connection over StringTransport."""

    def __init__(
        self,
        entry_format: str = "pulsar",
        max_message_size: int = 1 << 20,
        api_versions: dict[int, tuple[int, int]] | None = None,
        restarted: Wire | None = None,
    ) -> None:
        self.clock = Clock()
        ledgers = FakeLedgerFactory(self.clock.seconds)
        store = FakeMetadataStore()
        if restarted is not None:  # a new broker on the stored logs and metadata of another
            ledgers.logs = restarted.ledgers.logs
            store = restarted.service.metadata_store
        self.ledgers = ledgers
        self.service = BrokerService(
            ledgers,
            self.clock,
            Config({"statsUpdateFrequencyInSecs": 0}),
            store,
        )
        self.apis = KafkaApis(
            self.service,
            self.clock,
            Settings(
                node_id=0,
                host=lambda: "127.0.0.1",
                port=lambda: 9092,
                cluster_id="test",
                max_message_size=max_message_size,
                default_partitions=1,
                auto_create=True,
                entry_format=entry_format,
                api_versions=api_versions or dict(c.API_VERSIONS),
            ),
        )
        self.transport, self.conn = self.connect()
        self.corr = 0

    def connect(self) -> tuple[StringTransport, KafkaConnection]:
        transport = StringTransport()
        conn = KafkaConnection(self.apis, max_frame=2 << 20)
        conn.makeConnection(transport)
        return transport, conn

    def send(self, request: Any, conn: KafkaConnection | None = None) -> int:
        self.corr += 1
        request.with_header(correlation_id=self.corr, client_id="unit")
        (conn or self.conn).dataReceived(bytes(request.encode(header=True, framed=True)))
        return self.corr

    def responses(self, transport: StringTransport | None = None) -> list[tuple[int, bytes]]:
        t = transport or self.transport
        data = t.value()
        t.clear()
        out = []
        pos = 0
        while pos < len(data):
            (size,) = struct.unpack_from(">i", data, pos)
            frame = data[pos + 4 : pos + 4 + size]
            out.append((struct.unpack_from(">i", frame)[0], frame[4:]))
            pos += 4 + size
        return out

    def call(self, request: Any) -> Any:
        corr = self.send(request)
        [(got, body)] = self.responses()
        assert got == corr
        return decoded(request, body)

    def produce(self, data: bytes, topic: str = "t", acks: int = -1) -> Any:
        req = produce_request(data, topic, acks)
        if acks == 0:
            self.send(req)
            return None
        return self.call(req).responses[0].partition_responses[0]


def produce_request(data: bytes, topic: str = "t", acks: int = -1) -> Any:
    """A Produce v7 of the record batch ``data`` to partition 0 of ``topic``."""
    return ProduceRequest[7](
        transactional_id=None,
        acks=acks,
        timeout_ms=1000,
        topic_data=[
            ProduceRequest.TopicProduceData(
                name=topic,
                partition_data=[
                    ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=data)
                ],
            )
        ],
    )


def decoded(request: Any, body: bytes) -> Any:
    """The response to ``request`` whose body (after the correlation id) is ``body``."""
    version = request.API_VERSION
    cls = c.response_class(request.API_KEY)
    if cls.flexible_version_q(version) and request.API_KEY != c.API_API_VERSIONS:
        assert body[0] == 0  # response header v1: no tagged fields
        body = body[1:]
    return cls[version].decode(body)


def fetch_request(
    topic: str,
    offset: int,
    *,
    max_wait_ms: int = 0,
    min_bytes: int = 1,
    partition_max_bytes: int = 1 << 20,
) -> Any:
    return FetchRequest[10](
        replica_id=-1,
        max_wait_ms=max_wait_ms,
        min_bytes=min_bytes,
        max_bytes=50 << 20,
        isolation_level=0,
        session_id=0,
        session_epoch=-1,
        topics=[
            FetchRequest.FetchTopic(
                topic=topic,
                partitions=[
                    FetchRequest.FetchTopic.FetchPartition(
                        partition=0,
                        current_leader_epoch=-1,
                        fetch_offset=offset,
                        log_start_offset=-1,
                        partition_max_bytes=partition_max_bytes,
                    )
                ],
            )
        ],
        forgotten_topics_data=[],
        rack_id="",
    )


def pipelined(request: Any, count: int) -> bytes:
    """``count`` copies of ``request``, framed, with correlation ids 1 to ``count``."""
    frames = b""
    for corr in range(1, count + 1):
        request.with_header(correlation_id=corr, client_id="unit")
        frames += bytes(request.encode(header=True, framed=True))
    return frames


def release_until_answered(w: Wire, ledger: Any, count: int) -> list[int]:
    """Let ``ledger``'s held appends complete until ``count`` requests were answered (or none
    is held); the correlation ids of the answers, in order."""
    answered: list[int] = []
    while len(answered) < count and ledger.held_appends:
        ledger.release_appends()
        w.clock.advance(0)
        answered += [corr for corr, _ in w.responses()]
    return answered


def records_of(part: Any) -> list[tuple[int, bytes | None, bytes | None]]:
    out = []
    recs = MemoryRecords(bytes(part.records))
    while recs.has_next():
        b = recs.next_batch()
        assert b.validate_crc()
        out.extend((r.offset, r.key, r.value) for r in b)
    return out


@pytest.mark.parametrize("entry_format", ["pulsar", "kafka"])
def test_produced_batches_get_consecutive_offsets_and_fetch_back(entry_format: str) -> None:
    """Two batches take offsets 0-2 and 3-4; a fetch from 1 returns both batches intact."""
    w = Wire(entry_format)
    assert w.produce(batch(3)).base_offset == 0
    second = w.produce(batch(2, codec=3))
    assert (second.error_code, second.base_offset) == (c.NONE, 3)
    part = w.call(fetch_request("t", 1)).responses[0].partitions[0]
    assert (part.error_code, part.high_watermark, part.log_start_offset) == (0, 5, 0)
    assert [r[0] for r in records_of(part)] == [0, 1, 2, 3, 4]
    stored = result_of(w.service.get_topic("t-partition-0"))
    entry = result_of(stored.read_from_index(3, 1))[0]
    assert messages.entry_format(entry.data) == entry_format
    decoded = messages.decode_entry(entry.data)
    assert [(m.key, m.payload, m.properties, m.event_time_ms) for m in decoded] == [
        (b"k0", b"v" * 10, [("h", "0")], 5000),
        (b"k1", b"v" * 10, [("h", "1")], 5001),
    ]


def test_responses_leave_in_request_order_behind_a_long_poll() -> None:
    """A Metadata answered at once waits behind an earlier long-polling Fetch."""
    w = Wire()
    w.produce(batch(1))
    fetch_corr = w.send(fetch_request("t", 1, max_wait_ms=500))
    meta_corr = w.send(MetadataRequest[7](topics=None, allow_auto_topic_creation=False))
    assert w.responses() == []
    w.clock.advance(0.5)
    assert [corr for corr, _ in w.responses()] == [fetch_corr, meta_corr]


def test_a_long_poll_wakes_when_another_connection_produces() -> None:
    """A Fetch waiting at the log end answers as soon as a record is appended."""
    w = Wire()
    w.produce(batch(1))
    corr = w.send(fetch_request("t", 1, max_wait_ms=30_000))
    assert w.responses() == []
    _transport2, conn2 = w.connect()
    w.send(
        ProduceRequest[7](
            transactional_id=None,
            acks=1,
            timeout_ms=1000,
            topic_data=[
                ProduceRequest.TopicProduceData(
                    name="t",
                    partition_data=[
                        ProduceRequest.TopicProduceData.PartitionProduceData(
                            index=0, records=batch(2)
                        )
                    ],
                )
            ],
        ),
        conn2,
    )
    [(got, body)] = w.responses()
    assert got == corr
    part = c.response_class(1)[10].decode(body).responses[0].partitions[0]
    assert [r[0] for r in records_of(part)] == [1, 2]
    assert not w.clock.getDelayedCalls()


def test_idempotent_retries_are_acknowledged_once_and_gaps_refused() -> None:
    """A resent batch gets its first offset without a second append; a gap is refused."""
    w = Wire()
    assert w.produce(batch(2, pid=7, epoch=0, seq=0)).base_offset == 0
    assert w.produce(batch(2, pid=7, epoch=0, seq=2)).base_offset == 2
    again = w.produce(batch(2, pid=7, epoch=0, seq=0))
    assert (again.error_code, again.base_offset) == (c.NONE, 0)
    gap = w.produce(batch(1, pid=7, epoch=0, seq=9))
    assert gap.error_code == c.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert result_of(w.service.get_topic("t-partition-0")).next_index == 4


@pytest.mark.parametrize("entry_format", ["pulsar", "kafka"])
def test_producer_states_are_rebuilt_from_the_log_after_a_restart(entry_format: str) -> None:
    """A broker restarted on the stored log answers a retried batch the old one stored (but
    never acknowledged) with its first offset and no second append; the next sequence follows,
    a gap and a fenced epoch are refused as they were before the restart."""
    old = Wire(entry_format)
    old.produce(batch(2, pid=7, epoch=3, seq=0))
    old.produce(batch(1))  # a plain producer in between
    old.produce(batch(2, pid=8, epoch=0, seq=0))
    old.produce(batch(2, pid=7, epoch=3, seq=2))  # offsets 5-6: stored, its answer lost
    w = Wire(entry_format, restarted=old)
    again = w.produce(batch(2, pid=7, epoch=3, seq=2))
    assert (again.error_code, again.base_offset) == (c.NONE, 5)
    earlier = w.produce(batch(2, pid=7, epoch=3, seq=0))
    assert (earlier.error_code, earlier.base_offset) == (c.NONE, 0)
    assert w.produce(batch(2, pid=8, epoch=0, seq=0)).base_offset == 3
    assert w.produce(batch(1, pid=7, epoch=3, seq=9)).error_code == c.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert w.produce(batch(1, pid=7, epoch=2, seq=4)).error_code == c.INVALID_PRODUCER_EPOCH
    topic = result_of(w.service.get_topic("t-partition-0"))
    assert topic.next_index == 7
    nxt = w.produce(batch(1, pid=7, epoch=3, seq=4))
    assert (nxt.error_code, nxt.base_offset) == (c.NONE, 7)
    assert topic.next_index == 8


def test_the_first_idempotent_produce_waits_for_the_rebuild_and_answers_in_order() -> None:
    """While the tail is still being read, idempotent produces wait (nothing is appended), then
    are checked against the rebuilt state in the order they came."""
    old = Wire()
    old.produce(batch(1, pid=5, epoch=0, seq=0))
    w = Wire(restarted=old)
    topic = result_of(w.service.get_topic("t-partition-0"))
    ledger = topic.ledger
    pending: list[tuple[Deferred[list[Any]], Any, int]] = []
    real_read = ledger.read

    def held_read(position: Any, max_entries: int) -> Deferred[list[Any]]:
        d: Deferred[list[Any]] = Deferred()
        pending.append((d, position, max_entries))
        return d

    ledger.read = held_read  # type: ignore[method-assign]
    corrs = []
    for records in (batch(1, pid=5, epoch=0, seq=0), batch(1, pid=5, epoch=0, seq=1)):
        corrs.append(w.send(produce_request(records)))
    assert w.responses() == []  # nothing answered, nothing appended while the tail is read
    assert topic.next_index == 1
    assert pending
    ledger.read = real_read  # type: ignore[method-assign]
    while pending:
        d, position, max_entries = pending.pop(0)
        d.callback(result_of(real_read(position, max_entries)))
    answers = w.responses()
    assert [corr for corr, _ in answers] == corrs
    decoded = [c.response_class(0)[7].decode(body) for _, body in answers]
    offsets = [d.responses[0].partition_responses[0].base_offset for d in decoded]
    assert offsets == [0, 1]  # the retry is acknowledged with its stored offset, then the next
    assert topic.next_index == 2


def test_a_produce_held_up_before_its_append_is_not_overtaken() -> None:
    """Two produces to one partition, the first held up before its append (its topic still
    loading) and the second not: they are checked and stored in the order they came, as a
    Kafka broker does. Taken in the other order, an idempotent batch was checked before the
    one ahead of it, and that one was then answered as a duplicate, stored nowhere."""
    w = Wire()
    w.produce(batch(1))  # a plain producer: the topic exists, its partition count is known
    real_load = w.apis._load
    held: list[Deferred[Any]] = []

    def slow_first_load(full: str, create: bool) -> Deferred[Any]:
        if held:
            return real_load(full, create)
        held.append(Deferred())
        return held[0]

    w.apis._load = slow_first_load  # type: ignore[method-assign]
    corrs = [
        w.send(produce_request(batch(1, pid=5, epoch=0, seq=0))),
        w.send(produce_request(batch(1, pid=5, epoch=0, seq=1))),
    ]
    topic = result_of(real_load("persistent://public/default/t-partition-0", False))
    assert w.responses() == []
    assert topic.next_index == 1  # the second waits its turn, not stored ahead
    held[0].callback(topic)
    answers = w.responses()
    assert [corr for corr, _ in answers] == corrs
    parts = [
        c.response_class(0)[7].decode(body).responses[0].partition_responses[0]
        for _, body in answers
    ]
    assert [(r.error_code, r.base_offset) for r in parts] == [(c.NONE, 1), (c.NONE, 2)]
    assert topic.next_index == 3


def test_the_rebuild_reads_only_a_bounded_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the newest entries are read (newest window first, no hole): a producer whose last
    batch is older than the tail starts afresh, one in the tail is known."""
    monkeypatch.setattr(apis_module, "_REBUILD_MAX_ENTRIES", 20)
    monkeypatch.setattr(apis_module, "_REBUILD_FIRST_SPAN", 4)
    old = Wire()
    old.produce(batch(1, pid=1, epoch=0, seq=0))  # offset 0: beyond the tail after the rest
    for i in range(40):
        old.produce(batch(1, pid=2, epoch=0, seq=i))  # offsets 1-40
    w = Wire(restarted=old)
    topic = result_of(w.service.get_topic("t-partition-0"))
    reads: list[int] = []
    real = topic.read_from_index

    def counted(index: int, max_entries: int) -> Any:
        d = real(index, max_entries)
        d.addCallback(lambda got: reads.append(len(got)) or got)
        return d

    topic.read_from_index = counted
    retried = w.produce(batch(1, pid=2, epoch=0, seq=39))
    assert (retried.error_code, retried.base_offset) == (c.NONE, 40)
    assert reads == [4, 16]  # the newest 4 messages, then 16 more: the budget of 20 entries
    unknown = w.produce(batch(1, pid=1, epoch=0, seq=0))  # forgotten: stored again
    assert (unknown.error_code, unknown.base_offset) == (c.NONE, 41)


@pytest.mark.parametrize("trimmed", ["empty read", "read error"])
def test_a_tail_window_cut_short_by_a_trim_is_dropped(
    monkeypatch: pytest.MonkeyPatch, trimmed: str
) -> None:
    """The log's head trimmed while a window is read (its reads then come back empty, or
    fail) drops that window whole: a producer whose last batches it held starts afresh,
    rather than from an older batch of the window, which would refuse its next one as a gap."""
    monkeypatch.setattr(apis_module, "_REBUILD_MAX_ENTRIES", 20)
    monkeypatch.setattr(apis_module, "_REBUILD_FIRST_SPAN", 4)
    monkeypatch.setattr(apis_module, "_READ_ENTRIES", 4)
    old = Wire()
    for i in range(32):
        old.produce(batch(1, pid=2, epoch=0, seq=i))  # offsets 0-31
    for i in range(8):
        old.produce(batch(1, pid=3, epoch=0, seq=i))  # offsets 32-39: the newest window
    w = Wire(restarted=old)
    topic = result_of(w.service.get_topic("t-partition-0"))
    real = topic.read_from_index
    calls: list[int] = []

    def trimmed_after_two(index: int, max_entries: int) -> Any:
        calls.append(index)
        if len(calls) <= 2:  # the newest window [36, 40), then [20, 24) of [20, 36)
            return real(index, max_entries)
        if trimmed == "read error":
            raise RuntimeError(f"entry {index} is no longer stored")
        return succeed([])

    topic.read_from_index = trimmed_after_two
    nxt = w.produce(batch(1, pid=2, epoch=0, seq=32))
    assert (nxt.error_code, nxt.base_offset) == (c.NONE, 40)  # not a gap after seq 23
    assert calls == [36, 20, 24]
    assert w.produce(batch(1, pid=3, epoch=0, seq=8)).base_offset == 41  # the newest: known
    assert w.produce(batch(1, pid=3, epoch=0, seq=7)).base_offset == 39  # a retry: stored once


def test_stored_producer_batches_are_read_from_either_format() -> None:
    """Verbatim entries give their batch header; converted ones their ``kafka-<id>-<epoch>``
    name and sequence; other writers and plain producers give nothing."""
    raw = batch(3, pid=9, epoch=2, seq=10)
    verbatim = messages.encode_native_entry(
        "kafka", raw, num_messages=3, producer_name="x", sequence_id=0, publish_time_ms=1
    )
    assert stored_producer_batch(verbatim) == (9, 2, 10, 12)
    msgs = [messages.Message(b"a"), messages.Message(b"b")]
    converted = messages.encode_entry(
        msgs, producer_name=producer_name(9, 2, 10), sequence_id=10, publish_time_ms=1
    )
    assert stored_producer_batch(converted) == (9, 2, 10, 11)
    for name in ("kafka-9", "kafka-x-1", "standalone-0-1", producer_name(-1, -1, -1)):
        other = messages.encode_entry(
            msgs[:1], producer_name=name, sequence_id=3, publish_time_ms=1
        )
        assert stored_producer_batch(other) is None
    plain = messages.encode_native_entry(
        "kafka", batch(1), num_messages=1, producer_name="x", sequence_id=0, publish_time_ms=1
    )
    assert stored_producer_batch(plain) is None
    assert stored_producer_batch(b"garbage") is None


def test_bad_batches_are_refused_with_kafka_errors_and_not_stored() -> None:
    """A corrupt CRC, an oversize batch and garbage records leave the log untouched."""
    w = Wire(max_message_size=4096)
    corrupt = bytearray(batch(2))
    corrupt[-2] ^= 1
    assert w.produce(bytes(corrupt)).error_code == c.CORRUPT_MESSAGE
    assert w.produce(batch(1, size=8000)).error_code == c.MESSAGE_TOO_LARGE
    assert w.produce(b"\x00" * 20).error_code == c.CORRUPT_MESSAGE
    assert w.produce(b"").error_code == c.INVALID_RECORD
    assert result_of(w.service.get_topic("t-partition-0")).next_index == 0


def _recrc(raw: bytearray) -> bytes:
    """``raw`` with its batch CRC made valid again."""
    from polybroker.protocols.kafka import records as rec

    raw[17:21] = rec.crc32c(bytes(raw[21:])).to_bytes(4, "big")
    return bytes(raw)


@pytest.mark.parametrize("entry_format", ["pulsar", "kafka"])
def test_malformed_records_get_invalid_record_and_bad_compression_corrupt_message(
    entry_format: str,
) -> None:
    """With a valid CRC, a record whose key length runs past it is INVALID_RECORD (as Kafka's
    broker answers) and an lz4 body that does not decompress is CORRUPT_MESSAGE, whatever the
    entry format; nothing is stored, and a good batch is stored after them."""
    w = Wire(entry_format=entry_format)
    bad = bytearray(batch(3))
    # The second record: length, attributes, timestamp and offset deltas, then its key length.
    first_len = (bad[61] >> 1) + 1
    bad[61 + first_len + 4] = 40  # key length 20 (zigzag) in a record of about 16 bytes
    assert w.produce(_recrc(bad)).error_code == c.INVALID_RECORD
    lz4 = bytearray(batch(3, codec=3))
    lz4[70:74] = b"\xff\xff\xff\xff"
    assert w.produce(_recrc(lz4)).error_code == c.CORRUPT_MESSAGE
    assert result_of(w.service.get_topic("t-partition-0")).next_index == 0
    assert w.produce(batch(2)).error_code == c.NONE
    assert result_of(w.service.get_topic("t-partition-0")).next_index == 2


def test_acks_zero_stores_without_answering() -> None:
    """acks=0 gets no response, yet the batch is stored and later requests are answered."""
    w = Wire()
    w.produce(batch(2), acks=0)
    meta = w.call(MetadataRequest[7](topics=None, allow_auto_topic_creation=False))
    assert [t.name for t in meta.topics] == ["t"]
    assert result_of(w.service.get_topic("t-partition-0")).next_index == 2


def test_offsets_out_of_range_and_list_offsets() -> None:
    """Fetching past the end is OFFSET_OUT_OF_RANGE; earliest/latest/by-time resolve."""
    w = Wire()
    w.clock.advance(100)
    w.produce(batch(2))
    w.clock.advance(100)
    w.produce(batch(3))
    part = w.call(fetch_request("t", 6)).responses[0].partitions[0]
    assert part.error_code == c.OFFSET_OUT_OF_RANGE
    req = ListOffsetsRequest[4](
        replica_id=-1,
        isolation_level=0,
        topics=[
            ListOffsetsRequest.ListOffsetsTopic(
                name="t",
                partitions=[
                    ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(
                        partition_index=0, current_leader_epoch=-1, timestamp=ts
                    )
                    for ts in (-2, -1, 150_000, 10**13)
                ],
            )
        ],
    )
    parts = w.call(req).topics[0].partitions
    assert [p.offset for p in parts] == [0, 5, 2, -1]


def test_partitions_nothing_wrote_yet_are_there_and_empty() -> None:
    """A created topic's partitions fetch empty at offset 0 and list offsets 0 before any
    produce (as in Kafka), instead of UNKNOWN_TOPIC_OR_PARTITION; a partition past the count
    stays unknown."""
    w = Wire()
    result_of(w.service.create_partitioned_topic("made", 2))
    part = w.call(fetch_request("made", 0)).responses[0].partitions[0]
    assert (part.error_code, part.high_watermark, part.log_start_offset) == (c.NONE, 0, 0)
    assert bytes(part.records or b"") == b""
    req = ListOffsetsRequest[4](
        replica_id=-1,
        isolation_level=0,
        topics=[
            ListOffsetsRequest.ListOffsetsTopic(
                name="made",
                partitions=[
                    ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition(
                        partition_index=i, current_leader_epoch=-1, timestamp=-1
                    )
                    for i in (1, 2)
                ],
            )
        ],
    )
    parts = w.call(req).topics[0].partitions
    assert [(p.error_code, p.offset) for p in parts] == [
        (c.NONE, 0),
        (c.UNKNOWN_TOPIC_OR_PARTITION, -1),
    ]
    assert w.produce(batch(2), topic="made").base_offset == 0


def test_unknown_topics_are_reported_and_metadata_autocreates() -> None:
    """Fetch of a missing topic is UNKNOWN_TOPIC_OR_PARTITION; Metadata may create it."""
    w = Wire()
    part = w.call(fetch_request("missing", 0)).responses[0].partitions[0]
    assert part.error_code == c.UNKNOWN_TOPIC_OR_PARTITION
    req = MetadataRequest[7](
        topics=[MetadataRequest.MetadataRequestTopic(name="fresh")], allow_auto_topic_creation=True
    )
    [topic] = w.call(req).topics
    assert (topic.error_code, len(topic.partitions)) == (c.NONE, 1)


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff\xff", struct.pack(">i", 8) + struct.pack(">hhih", 999, 0, 1, -1), b"\x7f" * 8],
)
def test_bad_input_closes_the_connection(data: bytes) -> None:
    """A negative or oversize size, or an unknown API key, closes the connection."""
    w = Wire()
    w.conn.dataReceived(data)
    assert w.transport.disconnecting
    w.conn.dataReceived(b"more")  # ignored after close


def test_too_new_api_versions_is_answered_with_error_35() -> None:
    """ApiVersions v3 gets error 35 with a v0 body; the connection stays open."""
    from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse

    w = Wire()
    corr = w.send(ApiVersionsRequest[3](client_software_name="x", client_software_version="1"))
    [(got, body)] = w.responses()
    assert got == corr
    assert ApiVersionsResponse[0].decode(body).error_code == c.UNSUPPORTED_VERSION
    assert not w.transport.disconnecting


def test_modern_versions_name_topics_by_stable_ids() -> None:
    """Metadata v12 gives a topic id derived from the name; Fetch v16 by that id reads the
    records; an unknown id is UNKNOWN_TOPIC_ID."""
    import uuid

    w = Wire(api_versions=dict(c.API_VERSIONS_MODERN))
    w.produce(batch(2))
    req = MetadataRequest[12](
        topics=[MetadataRequest.MetadataRequestTopic(name="t", topic_id=uuid.UUID(int=0))],
        allow_auto_topic_creation=False,
        include_topic_authorized_operations=False,
    )
    [topic] = w.call(req).topics
    assert topic.topic_id == uuid.uuid5(
        uuid.UUID("5c0f9d4e-6a55-4b8e-9a43-4b6b2f1d7a01"), "persistent://public/default/t"
    )

    def fetch(topic_id: uuid.UUID) -> Any:
        return FetchRequest[16](
            replica_id=-1,
            max_wait_ms=0,
            min_bytes=1,
            max_bytes=1 << 20,
            isolation_level=0,
            session_id=0,
            session_epoch=-1,
            topics=[
                FetchRequest.FetchTopic(
                    topic_id=topic_id,
                    partitions=[
                        FetchRequest.FetchTopic.FetchPartition(
                            partition=0,
                            current_leader_epoch=-1,
                            fetch_offset=0,
                            last_fetched_epoch=-1,
                            log_start_offset=-1,
                            partition_max_bytes=1 << 20,
                        )
                    ],
                )
            ],
            forgotten_topics_data=[],
            rack_id="",
        )

    resp = w.call(fetch(topic.topic_id)).responses[0]
    assert resp.topic_id == topic.topic_id
    assert [r[0] for r in records_of(resp.partitions[0])] == [0, 1]
    other = w.call(fetch(uuid.uuid4())).responses[0].partitions[0]
    assert other.error_code == c.UNKNOWN_TOPIC_ID


def test_modern_group_apis_take_batches() -> None:
    """FindCoordinator v4, OffsetFetch v8 and LeaveGroup v3 answer each key, group or member;
    InitProducerId v3 bumps a known producer's epoch."""
    from kafka.protocol.consumer import LeaveGroupRequest, OffsetCommitRequest, OffsetFetchRequest
    from kafka.protocol.metadata import FindCoordinatorRequest
    from kafka.protocol.producer import InitProducerIdRequest

    w = Wire(api_versions=dict(c.API_VERSIONS_MODERN))
    result_of(w.service.create_partitioned_topic("t", 1))  # commits name existing ones
    found = w.call(FindCoordinatorRequest[4](key_type=0, coordinator_keys=["a", "b"]))
    assert [(x.key, x.node_id, x.port) for x in found.coordinators] == [
        ("a", 0, 9092),
        ("b", 0, 9092),
    ]
    commit = OffsetCommitRequest[8](
        group_id="g",
        generation_id_or_member_epoch=-1,
        member_id="",
        group_instance_id=None,
        topics=[
            OffsetCommitRequest.OffsetCommitRequestTopic(
                name="t",
                partitions=[
                    OffsetCommitRequest.OffsetCommitRequestTopic.OffsetCommitRequestPartition(
                        partition_index=0,
                        committed_offset=7,
                        committed_leader_epoch=-1,
                        committed_metadata="m",
                    )
                ],
            )
        ],
    )
    assert w.call(commit).topics[0].partitions[0].error_code == c.NONE
    fetch = OffsetFetchRequest[8](
        groups=[OffsetFetchRequest.OffsetFetchRequestGroup(group_id="g", topics=None)],
        require_stable=False,
    )
    [group] = w.call(fetch).groups
    assert [
        (t.name, [(p.partition_index, p.committed_offset, p.metadata) for p in t.partitions])
        for t in group.topics
    ] == [("t", [(0, 7, "m")])]
    leave = LeaveGroupRequest[3](
        group_id="g",
        members=[LeaveGroupRequest.MemberIdentity(member_id="nobody", group_instance_id=None)],
    )
    [member] = w.call(leave).members
    assert (member.member_id, member.error_code) == ("nobody", c.UNKNOWN_MEMBER_ID)
    first = w.call(
        InitProducerIdRequest[3](
            transactional_id=None, transaction_timeout_ms=60000, producer_id=-1, producer_epoch=-1
        )
    )
    bumped = w.call(
        InitProducerIdRequest[3](
            transactional_id=None,
            transaction_timeout_ms=60000,
            producer_id=first.producer_id,
            producer_epoch=first.producer_epoch,
        )
    )
    assert (bumped.producer_id, bumped.producer_epoch) == (first.producer_id, 1)


def _many_topics_metadata(names: list[str]) -> Any:
    topics = [MetadataRequest.MetadataRequestTopic(name=n) for n in names]
    return MetadataRequest[7](topics=topics, allow_auto_topic_creation=False)


def _many_partitions_list_offsets(names: list[str]) -> Any:
    topic = ListOffsetsRequest.ListOffsetsTopic
    parts = [topic.ListOffsetsPartition(partition_index=i, timestamp=-1) for i in range(len(names))]
    return ListOffsetsRequest[2](
        replica_id=-1, isolation_level=0, topics=[topic(name="none", partitions=parts)]
    )


def _many_topics_fetch(names: list[str]) -> Any:
    req = fetch_request("x", 0)
    req.topics = [
        FetchRequest.FetchTopic(topic=n, partitions=req.topics[0].partitions) for n in names
    ]
    return req


def _many_topics_describe_configs(names: list[str]) -> Any:
    from kafka.protocol.admin import DescribeConfigsRequest

    resource = DescribeConfigsRequest.DescribeConfigsResource
    return DescribeConfigsRequest[1](
        resources=[
            resource(resource_type=2, resource_name=n, configuration_keys=None) for n in names
        ],
        include_synonyms=False,
    )


@pytest.mark.parametrize(
    ("build", "answers"),
    [
        (_many_topics_metadata, lambda r: [(t.name, t.error_code) for t in r.topics]),
        (
            _many_partitions_list_offsets,
            lambda r: [(p.partition_index, p.error_code) for p in r.topics[0].partitions],
        ),
        (
            _many_topics_fetch,
            lambda r: [(t.topic, t.partitions[0].error_code) for t in r.responses],
        ),
        (
            _many_topics_describe_configs,
            lambda r: [(x.resource_name, x.error_code) for x in r.results],
        ),
    ],
    ids=["metadata", "list_offsets", "fetch", "describe_configs"],
)
def test_a_request_naming_many_topics_hands_the_reactor_back(
    build: Callable[[list[str]], Any],
    answers: Callable[[Any], list[tuple[Any, int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """600 unknown topics (or partitions): the work pauses on the clock after each 256, and
    another connection's request is answered in the pause; then all 600 are answered."""
    from kafka.protocol.metadata import ApiVersionsRequest

    w = Wire()
    pauses: list[float] = []
    call_later = w.clock.callLater

    def counted(delay: float, f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if delay == 0:
            pauses.append(w.clock.seconds())
        return call_later(delay, f, *args, **kwargs)

    monkeypatch.setattr(w.clock, "callLater", counted)
    request = build([f"u{i}" for i in range(600)])
    corr = w.send(request)
    assert (w.responses(), len(pauses)) == ([], 1)
    other, conn = w.connect()
    w.send(ApiVersionsRequest[0](), conn)
    assert len(w.responses(other)) == 1
    w.clock.advance(0)
    assert len(pauses) == 2  # after elements 256 and 512
    [(got, body)] = w.responses()
    assert got == corr
    found = answers(decoded(request, body))
    assert len(found) == 600
    assert {error for _, error in found} == {c.UNKNOWN_TOPIC_OR_PARTITION}


def test_topics_and_partitions_named_twice_are_answered_once() -> None:
    """Metadata answers each named topic once and OffsetFetch each named partition once, in
    the order first named."""
    from kafka.protocol.consumer import OffsetFetchRequest

    w = Wire()
    meta = w.call(_many_topics_metadata(["b", "a", "b", "c", "a"]))
    assert [t.name for t in meta.topics] == ["b", "a", "c"]
    topic = OffsetFetchRequest.OffsetFetchRequestTopic
    fetch = w.call(
        OffsetFetchRequest[5](
            group_id="g", topics=[topic(name="t", partition_indexes=[2, 0, 2, 1, 0])]
        )
    )
    assert [p.partition_index for p in fetch.topics[0].partitions] == [2, 0, 1]


class FillingTransport(StringTransport):
    """A StringTransport whose send buffer fills: past ``limit`` buffered bytes it tells its
    producer to pause, as a TCP transport does when the client does not read."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: bytes) -> None:
        super().write(data)
        if len(self.value()) > self.limit and self.producer is not None:
            self.producer.pauseProducing()

    def writeSequence(self, seq: Any) -> None:
        self.write(b"".join(seq))


def test_a_client_that_does_not_read_its_answers_stops_being_read() -> None:
    """200 fetches in one read: once the answers fill the send buffer nothing more is taken
    and the socket is not read, so the broker holds no more answers; as the client reads,
    the rest are answered, all in order."""
    w = Wire()
    w.produce(batch(50, size=1000))
    transport = FillingTransport(limit=100_000)
    w.conn.makeConnection(transport)
    req = fetch_request("t", 0)
    frames = pipelined(req, 200)
    w.conn.dataReceived(frames)
    answered = w.responses(transport)
    assert 0 < len(answered) < 10  # each answer is ~50 KB: the buffer filled at once
    assert transport.producerState == "paused"  # the socket is not read meanwhile
    while transport.producerState == "paused":
        w.conn.resumeProducing()  # the client read what was buffered
        answered += w.responses(transport)
    assert [corr for corr, _ in answered] == list(range(1, 201))
    assert all(
        len(records_of(decoded(req, body).responses[0].partitions[0])) == 50 for _, body in answered
    )


def test_requests_beyond_the_in_flight_limit_wait_unread() -> None:
    """100 produces in one read while storage holds their writes: 64 are taken, the rest
    wait with the socket unread; as the writes complete, the rest are taken, and all are
    answered in order."""
    from polybroker.protocols.kafka.connection import MAX_IN_FLIGHT

    w = Wire()
    w.produce(batch(1))
    ledger = w.ledgers.ledger("public/default/persistent/t-partition-0")
    ledger.hold_appends = True
    req = produce_request(batch(1))
    frames = pipelined(req, 100)
    w.conn.dataReceived(frames)
    assert len(w.conn.pending) == MAX_IN_FLIGHT
    assert w.transport.producerState == "paused"
    assert release_until_answered(w, ledger, 100) == list(range(1, 101))
    assert w.transport.producerState == "producing"


def test_acks0_produces_count_in_flight_until_written() -> None:
    """Produces with acks=0 get no answer, but each stays in flight until its write is done:
    100 of them while storage holds their writes take 64, and the rest wait unread."""
    from polybroker.protocols.kafka.connection import MAX_IN_FLIGHT

    w = Wire()
    w.produce(batch(1))
    ledger = w.ledgers.ledger("public/default/persistent/t-partition-0")
    ledger.hold_appends = True
    w.conn.dataReceived(pipelined(produce_request(batch(1), acks=0), 100))
    assert len(w.conn.pending) == MAX_IN_FLIGHT
    assert w.transport.producerState == "paused"
    while ledger.held_appends:
        ledger.release_appends()
        w.clock.advance(0)
    assert w.responses() == []
    assert not w.conn.pending
    assert w.transport.producerState == "producing"
    assert ledger.data.entries[-1].position.entry_id == 100  # every batch stored


def test_requests_beyond_the_in_flight_bytes_wait_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Produces whose frames pass MAX_IN_FLIGHT_BYTES while storage holds their writes: the
    rest wait with the socket unread until half of those bytes were answered."""
    from polybroker.protocols.kafka import connection

    monkeypatch.setattr(connection, "MAX_IN_FLIGHT_BYTES", 100_000)
    w = Wire()
    w.produce(batch(1))
    ledger = w.ledgers.ledger("public/default/persistent/t-partition-0")
    ledger.hold_appends = True
    req = produce_request(batch(10, size=2000))  # about 20 KB each
    w.conn.dataReceived(pipelined(req, 20))
    assert len(w.conn.pending) == 5
    assert w.transport.producerState == "paused"
    assert release_until_answered(w, ledger, 20) == list(range(1, 21))
    assert w.transport.producerState == "producing"


def test_a_full_publish_buffer_stops_taking_produces() -> None:
    """Past the broker-wide publish buffer's limit (which counts Produce frames) requests wait
    with the socket unread; when it drained to half they are taken, and all answered."""
    w = Wire()
    w.produce(batch(1))
    buffer = w.conn.apis.service.publish_buffer
    req = produce_request(batch(10, size=2000))
    buffer.limit = 3 * len(pipelined(req, 1)) - 100
    ledger = w.ledgers.ledger("public/default/persistent/t-partition-0")
    ledger.hold_appends = True
    w.conn.dataReceived(pipelined(req, 10))
    assert buffer.full
    assert len(w.conn.pending) == 3
    assert w.transport.producerState == "paused"
    assert release_until_answered(w, ledger, 10) == list(range(1, 11))
    assert w.transport.producerState == "producing"
    assert buffer.used == 0


def test_fetches_beyond_their_bound_wait_unread() -> None:
    """20 long-polling fetches in one read: 4 are taken, the rest wait with the socket
    unread (a client keeps one fetch in flight; one that pipelines them holds at most a
    few answers); as the polls end the rest are taken, and all are answered in order."""
    from polybroker.protocols.kafka.connection import MAX_FETCHES_IN_FLIGHT

    w = Wire()
    w.produce(batch(1))
    req = fetch_request("t", 1, max_wait_ms=500)
    frames = pipelined(req, 20)
    w.conn.dataReceived(frames)
    assert len(w.conn.pending) == MAX_FETCHES_IN_FLIGHT
    assert w.transport.producerState == "paused"
    answered: list[int] = []
    for _ in range(20 // MAX_FETCHES_IN_FLIGHT):
        w.clock.advance(0.5)
        answered += [corr for corr, _ in w.responses()]
    assert answered == list(range(1, 21))
    assert w.transport.producerState == "producing"
