"""Unit tests of Kafka record batches v2: split, CRC, decode, build, bounds."""

from __future__ import annotations

import contextlib

import pytest
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder

from polybroker.protocols.kafka import records as r


def _client_batch(codec: int, n: int = 5, value: bytes = b"v" * 50) -> bytes:
    b = MemoryRecordsBuilder(2, codec, 1 << 20)
    for i in range(n):
        b.append(1000 + i, b"k%d" % i, value if i else None, [("h", b"x%d" % i)])
    b.close()
    return bytes(b.buffer())


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_client_batches_decode_and_rebuild_for_every_codec(codec: int) -> None:
    """A kafka-python batch decodes to its records and a rebuilt batch reads back the same."""
    [batch] = r.split_batches(_client_batch(codec))
    assert batch.crc_ok()
    assert batch.count == 5
    assert batch.compression == codec
    records = r.decode_batch(batch, limit=1 << 20)
    assert [(x.offset_delta, x.key, x.timestamp_ms) for x in records] == [
        (i, b"k%d" % i, 1000 + i) for i in range(5)
    ]
    assert records[0].value is None
    assert records[1].value == b"v" * 50
    assert records[2].headers == [("h", b"x2")]
    rebuilt = r.build_batch(40, records, compression=codec)
    client_view = MemoryRecords(rebuilt).next_batch()
    assert client_view.validate_crc()
    assert [(x.offset, x.key, x.value, x.headers) for x in client_view] == [
        (40 + i, b"k%d" % i, None if i == 0 else b"v" * 50, [("h", b"x%d" % i)]) for i in range(5)
    ]


def test_base_offset_rewrite_keeps_the_crc_valid() -> None:
    """Rewriting the base offset leaves the checksummed part untouched."""
    raw = _client_batch(3)
    moved = r.with_base_offset(raw, 123456)
    [batch] = r.split_batches(moved)
    assert batch.base_offset == 123456
    assert batch.crc_ok()


def test_a_flipped_byte_fails_the_crc() -> None:
    """Any change after the CRC field is detected."""
    raw = bytearray(_client_batch(0))
    raw[-3] ^= 0x40
    [batch] = r.split_batches(bytes(raw))
    assert not batch.crc_ok()


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_decompression_is_bounded(codec: int) -> None:
    """A batch that inflates past the limit is refused, whatever the codec."""
    [batch] = r.split_batches(_client_batch(codec, n=50, value=b"\x00" * 10_000))
    with pytest.raises(r.RecordError):
        r.decode_batch(batch, limit=4096)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00" * 30,  # header truncated
        _client_batch(0)[:-5],  # length runs past the data
        _client_batch(0)[:16] + b"\x01" + _client_batch(0)[17:],  # magic 1
    ],
)
def test_malformed_record_sets_are_refused(data: bytes) -> None:
    """Truncated batches and old magic raise RecordError."""
    with pytest.raises(r.RecordError):
        r.split_batches(data)


def test_garbage_records_inside_a_batch_raise_record_errors() -> None:
    """Fuzz the record area of a batch: decoding fails cleanly or succeeds, never crashes."""
    import random

    rng = random.Random(7)
    raw = _client_batch(0)
    for _ in range(1000):
        body = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            body[rng.randrange(r.HEADER_SIZE, len(body))] = rng.getrandbits(8)
        [batch] = r.split_batches(bytes(body))
        with contextlib.suppress(r.RecordError):
            r.decode_batch(batch, limit=1 << 16)


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_check_batch_accepts_client_batches_of_every_codec(codec: int) -> None:
    """A client's batch passes the framing check, with records past one- and two-byte lengths."""
    for n, value in [(5, b"v" * 50), (300, b"w" * 100), (3, b"z" * 20_000)]:
        [batch] = r.split_batches(_client_batch(codec, n=n, value=value))
        r.check_batch(batch, limit=1 << 20)
        assert len(r.decode_batch(batch, limit=1 << 20)) == n


def test_check_batch_accepts_more_records_than_the_fast_path_covers() -> None:
    """Offset deltas past the precomputed table are checked too."""
    records = [r.Record(i, 1000, None, b"x", []) for i in range(17_000)]
    [batch] = r.split_batches(r.build_batch(0, records))
    r.check_batch(batch, limit=1 << 22)


def test_check_batch_refuses_offset_deltas_out_of_order() -> None:
    """Records stored verbatim must sit at consecutive offsets: other deltas are refused."""
    records = [r.Record(d, 1000, None, b"v", []) for d in (0, 2, 1)]
    [batch] = r.split_batches(r.build_batch(0, records))
    with pytest.raises(r.OffsetDeltaError):
        r.check_batch(batch, limit=1 << 20)


def test_check_batch_refuses_a_count_that_disagrees_with_the_records() -> None:
    """A header count larger or smaller than the records present is refused."""
    raw = bytearray(r.build_batch(0, [r.Record(i, 1000, None, b"v", []) for i in range(3)]))
    for count in (2, 4):
        raw[57:61] = count.to_bytes(4, "big")
        [batch] = r.split_batches(bytes(raw))
        with pytest.raises(r.RecordError):
            r.check_batch(batch, limit=1 << 20)


def test_check_batch_is_bounded_and_never_crashes_on_garbage() -> None:
    """A decompression bomb is refused at the limit; fuzzed records raise only RecordError."""
    [bomb] = r.split_batches(_client_batch(3, n=50, value=b"\x00" * 10_000))
    with pytest.raises(r.RecordError):
        r.check_batch(bomb, limit=4096)
    import random

    rng = random.Random(11)
    raw = _client_batch(0, n=20)
    for _ in range(2000):
        body = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            body[rng.randrange(r.HEADER_SIZE, len(body))] = rng.getrandbits(8)
        [batch] = r.split_batches(bytes(body))
        with contextlib.suppress(r.RecordError):
            r.check_batch(batch, limit=1 << 16)


def test_truncated_lz4_is_refused() -> None:
    """An lz4 body cut short raises RecordError instead of returning part of it."""
    [batch] = r.split_batches(_client_batch(3, n=50))
    with pytest.raises(r.RecordError):
        r.decompress(r.COMPRESSION_LZ4, batch.raw[r.HEADER_SIZE : -10], 1 << 20)


def _uniform_body(n: int, value_size: int, ts_step: int = 0) -> tuple[bytes, int]:
    records = [r.Record(i, 1000 + i * ts_step, None, b"x" * value_size, []) for i in range(n)]
    [batch] = r.split_batches(r.build_batch(0, records))
    return batch.raw[r.HEADER_SIZE :], n


@pytest.mark.parametrize(
    ("n", "value_size"),
    [(1, 1), (5, 50), (64, 100), (65, 100), (1000, 100), (300, 1024), (8192, 9)],
)
def test_equal_sized_records_take_the_slice_check(n: int, value_size: int) -> None:
    """Records of one layout are accepted by the slice check, which agrees with the walk."""
    body, count = _uniform_body(n, value_size)
    assert r._uniform(body, count)
    r._check_records(body, count)


def test_records_of_other_layouts_fall_back_to_the_walk() -> None:
    """Different sizes or multi-byte timestamp deltas are left to the record-by-record walk."""
    records = [r.Record(i, 1000, None, b"x" * (10 + i % 3), []) for i in range(100)]
    [batch] = r.split_batches(r.build_batch(0, records))
    assert not r._uniform(batch.raw[r.HEADER_SIZE :], 100)
    r.check_batch(batch, limit=1 << 20)
    body, count = _uniform_body(100, 10, ts_step=1)  # deltas past 63 ms take two bytes
    assert not r._uniform(body, count)
    r._check_records(body, count)


def test_the_slice_check_never_accepts_what_the_walk_refuses() -> None:
    """Fuzzed uniform batches: whenever the slice check says yes, the walk agrees."""
    import random

    rng = random.Random(5)
    accepted = refused = 0
    for n, size in [(3, 20), (64, 5), (70, 30), (200, 100)]:
        body, count = _uniform_body(n, size)
        for _ in range(400):
            mutated = bytearray(body)
            for _ in range(rng.randint(1, 3)):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            data = bytes(mutated)
            claimed = rng.choice([count, count, count - 1, count + 1])
            if r._uniform(data, claimed):
                accepted += 1
                r._check_records(data, claimed)
            else:
                refused += 1
                with contextlib.suppress(r.RecordError):
                    r._check_records(data, claimed)
    assert accepted
    assert refused
