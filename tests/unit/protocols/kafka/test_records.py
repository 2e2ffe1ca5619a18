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


def test_lz4_is_decompressed_in_steps_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a step smaller than the data, frames (two concatenated) come back whole and in
    order; a limit inside a later step still refuses the batch, a frame cut short too."""
    import lz4.frame

    first, second = bytes(range(256)) * 40, b"y" * 7000
    body = lz4.frame.compress(first) + lz4.frame.compress(second)
    monkeypatch.setattr(r, "_LZ4_STEP", 1000)
    assert r.decompress(r.COMPRESSION_LZ4, body, 1 << 20) == first + second
    assert r.decompress(r.COMPRESSION_LZ4, body, len(first) + len(second)) == first + second
    with pytest.raises(r.RecordError, match="exceeds"):
        r.decompress(r.COMPRESSION_LZ4, body, len(first) + len(second) - 1)
    with pytest.raises(r.RecordError):
        r.decompress(r.COMPRESSION_LZ4, lz4.frame.compress(first)[:-9], 1 << 20)


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
    r._walk_records(body, count)


def test_records_of_other_layouts_fall_back_to_the_walk() -> None:
    """Records of changing sizes, or a timestamp delta width that changes within a run of one
    size, are left (in part) to the record-by-record walk; the whole check still accepts."""
    records = [r.Record(i, 1000, None, b"x" * (10 + i % 3), []) for i in range(100)]
    [batch] = r.split_batches(r.build_batch(0, records))
    assert not r._uniform(batch.raw[r.HEADER_SIZE :], 100)
    r.check_batch(batch, limit=1 << 20)
    # From record 32 the timestamp delta takes two bytes and the value one byte less: one size,
    # two layouts.
    records = [r.Record(i, 1000 + 2 * i, None, b"x" * (11 - (i >= 32)), []) for i in range(64)]
    [batch] = r.split_batches(r.build_batch(0, records))
    body = batch.raw[r.HEADER_SIZE :]
    assert not r._uniform(body, 64)
    r._walk_records(body, 64)
    r._check_records(body, 64)


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
                r._walk_records(data, claimed)
            else:
                refused += 1
                with contextlib.suppress(r.RecordError):
                    r._walk_records(data, claimed)
    assert accepted
    assert refused


# -- inner record validation: crafted records that tile the batch but are malformed inside --


def _zz(v: int) -> bytes:
    return r._zigzag_slow(v)


def _record(delta: int, fields: bytes, extra: bytes = b"") -> bytes:
    """One record: attributes, timestamp delta 0, offset delta, then ``fields`` as given."""
    body = b"\x00" + _zz(0) + _zz(delta) + fields + extra
    return _zz(len(body)) + body


def _good(delta: int) -> bytes:
    return _record(delta, _zz(-1) + _zz(3) + b"abc" + _zz(0))


def _crafted_batch(records: list[bytes], codec: int, count: int | None = None) -> r.Batch:
    """A batch around raw record bytes (compressed with ``codec``), with a valid CRC."""
    import struct

    import lz4.frame
    import zstandard

    body = b"".join(records)
    if codec == r.COMPRESSION_LZ4:
        body = lz4.frame.compress(body)
    elif codec == r.COMPRESSION_ZSTD:
        body = zstandard.ZstdCompressor().compress(body)
    elif codec == r.COMPRESSION_GZIP:
        import gzip

        body = gzip.compress(body)
    n = len(records) if count is None else count
    after = struct.pack(">hiqqqhii", codec, n - 1, 1000, 1000, -1, -1, -1, n)
    crc = r.crc32c(after + body)
    head = struct.pack(">qiibI", 0, 9 + len(after) + len(body), -1, 2, crc)
    [batch] = r.split_batches(head + after + body)
    assert batch.crc_ok()
    return batch


_BAD_RECORDS = {
    # The key claims more bytes than the record holds (the value then runs into the next).
    "key past record": _record(1, _zz(40) + b"k" + _zz(3) + b"abc" + _zz(0)),
    "value past record": _record(1, _zz(-1) + _zz(60) + b"abc" + _zz(0)),
    "key length below -1": _record(1, _zz(-5) + _zz(3) + b"abc" + _zz(0)),
    "value length below -1": _record(1, _zz(-1) + _zz(-3) + b"abc" + _zz(0)),
    "negative header count": _record(1, _zz(-1) + _zz(3) + b"abc" + _zz(-1)),
    "header count past record": _record(1, _zz(-1) + _zz(3) + b"abc" + _zz(30)),
    "null header key": _record(1, _zz(-1) + _zz(3) + b"abc" + _zz(1) + _zz(-1) + _zz(-1)),
    "header key not UTF-8": _record(
        1, _zz(-1) + _zz(3) + b"abc" + _zz(1) + _zz(2) + b"\xff\xfe" + _zz(-1)
    ),
    "header value past record": _record(
        1, _zz(-1) + _zz(3) + b"abc" + _zz(1) + _zz(1) + b"h" + _zz(50) + b"v"
    ),
    # Unused, but kafka-python reads the attributes as a varint: a high bit shifts every field.
    "attributes high bit": (lambda b: _zz(len(b)) + b)(
        b"\x80\x00" + _zz(1) + _zz(-1) + _zz(3) + b"abc" + _zz(0)
    ),
    # Fields end before the record does: a stray byte the length prefix covers.
    "bytes after the fields": _record(1, _zz(-1) + _zz(3) + b"abc" + _zz(0), b"\x07"),
    # Fields end after it: the value length says 4, the record holds 3 bytes of value.
    "fields past the length": _good(1)[:-1],
}


@pytest.mark.parametrize("codec", [0, 1, 3, 4])
@pytest.mark.parametrize("case", sorted(_BAD_RECORDS))
def test_check_batch_refuses_malformed_inner_records(case: str, codec: int) -> None:
    """A record whose key, value or headers do not fit it is refused, compressed or not, and
    also when it is the last record, whose overrun would otherwise end at the batch's end."""
    bad = _BAD_RECORDS[case]
    if case == "fields past the length":
        # Keep the tiling intact: the shortened record is re-prefixed with its new length.
        inner = bad[1:]
        bad = _zz(len(inner)) + inner
    for records in ([_good(0), bad, _good(2)], [_good(0), bad]):
        batch = _crafted_batch(records, codec)
        with pytest.raises(r.InvalidRecordError) as e:
            r.check_batch(batch, limit=1 << 20)
        assert not isinstance(e.value, r.OffsetDeltaError)


@pytest.mark.parametrize("codec", [0, 3])
def test_check_batch_accepts_crafted_records_with_headers_and_nulls(codec: int) -> None:
    """The walk accepts well-formed records of every shape (null key, null value, headers with
    a null value, multi-byte lengths), and kafka-python reads the batch back the same."""
    records = [
        _good(0),
        _record(
            1,
            _zz(2)
            + b"kk"
            + _zz(-1)
            + _zz(2)
            + _zz(1)
            + b"a"
            + _zz(-1)
            + _zz(1)
            + b"b"
            + _zz(2)
            + b"xy",
        ),
        _record(2, _zz(0) + _zz(300) + b"v" * 300 + _zz(0)),
    ]
    batch = _crafted_batch(records, codec)
    r.check_batch(batch, limit=1 << 20)
    decoded = r.decode_batch(batch, limit=1 << 20)
    assert [(x.key, x.value, x.headers) for x in decoded] == [
        (None, b"abc", []),
        (b"kk", None, [("a", None), ("b", b"xy")]),
        (b"", b"v" * 300, []),
    ]
    client_view = MemoryRecords(batch.raw).next_batch()
    assert [(x.key, x.value) for x in client_view] == [(x.key, x.value) for x in decoded]


@pytest.mark.parametrize("n", [10, 64, 100])
def test_the_slice_check_refuses_equal_sized_records_with_bad_fields(n: int) -> None:
    """Records of one size whose key or value prefixes disagree, or whose header count is not
    zero, leave the slice check, and the walk refuses the malformed one."""
    body, count = _uniform_body(n, 20)
    narrow = len(_uniform_body(1, 20)[0])  # records from offset delta 64 on are one byte longer
    for index in (0, n // 2, n - 1):
        at = index * narrow + max(0, index - 64)
        size = narrow + (index >= 64)
        wrong_value = bytearray(body)
        # key length stays -1; the value length grows by one byte into the header count.
        prefix = 1 + 1 + 1 + (1 if index < 64 else 2) + 1
        wrong_value[at + prefix] = _zz(21)[0]
        assert not r._uniform(bytes(wrong_value), count)
        with pytest.raises(r.RecordError):
            r._walk_records(bytes(wrong_value), count)
        headers = bytearray(body)
        headers[at + size - 1] = _zz(1)[0]
        assert not r._uniform(bytes(headers), count)
        with pytest.raises(r.RecordError):
            r._walk_records(bytes(headers), count)


def test_what_check_batch_accepts_every_reader_decodes() -> None:
    """Fuzzed batches with keys and headers: whatever check_batch accepts, decode_batch and
    kafka-python's reader decode to ``count`` records."""
    import random

    rng = random.Random(13)
    raw = _client_batch(0, n=12)
    accepted = 0
    for _ in range(3000):
        body = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            body[rng.randrange(r.HEADER_SIZE, len(body))] = rng.getrandbits(8)
        [batch] = r.split_batches(bytes(body))
        try:
            r.check_batch(batch, limit=1 << 16)
        except r.RecordError:
            continue
        accepted += 1
        assert len(r.decode_batch(batch, limit=1 << 16)) == batch.count
        assert len(list(MemoryRecords(bytes(body)).next_batch())) == batch.count
    assert accepted


@pytest.mark.parametrize(("n", "ts_step"), [(200, 0.5), (3000, 0.05), (20_000, 0.01)])
def test_runs_cover_timestamp_deltas_of_two_bytes_and_long_batches(n: int, ts_step: float) -> None:
    """A batch whose timestamp deltas grow past one byte, or whose offset deltas take three
    bytes, is covered by runs of one layout (no record-by-record walk), and is valid."""
    records = [r.Record(i, 1000 + int(i * ts_step), None, b"x" * 90, []) for i in range(n)]
    [batch] = r.split_batches(r.build_batch(0, records, compression=r.COMPRESSION_LZ4))
    body = r.decompress(batch.compression, batch.raw[r.HEADER_SIZE :], 1 << 24)
    assert r._uniform(body, n)
    r._walk_records(body, n)
    r.check_batch(batch, limit=1 << 24)


def test_runs_and_walks_agree_on_fuzzed_batches_of_mixed_layouts() -> None:
    """Fuzzed batches whose layout changes (sizes, timestamp widths, keys): the check that
    mixes runs and walks accepts exactly what the walk alone accepts."""
    import random

    rng = random.Random(17)
    records = [
        r.Record(i, 1000 + i * 3, b"k" if i % 50 == 7 else None, b"x" * (20 + (i // 40) % 2), [])
        for i in range(150)
    ]
    [batch] = r.split_batches(r.build_batch(0, records))
    body = batch.raw[r.HEADER_SIZE :]
    r._check_records(body, 150)
    verdicts = set()
    for _ in range(600):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 2)):
            mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
        data = bytes(mutated)
        try:
            r._walk_records(data, 150)
            walk = True
        except r.RecordError:
            walk = False
        try:
            r._check_records(data, 150)
            mixed = True
        except r.RecordError:
            mixed = False
        assert walk == mixed
        verdicts.add(walk)
    assert verdicts == {True, False}
