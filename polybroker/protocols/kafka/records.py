"""Kafka record batches (magic v2): split, verify, check, decode and build (sans-IO).

A produced ``records`` field is a sequence of batches::

    baseOffset i64 | batchLength i32 | partitionLeaderEpoch i32 | magic i8 (=2) | crc u32 |
    attributes i16 | lastOffsetDelta i32 | firstTimestamp i64 | maxTimestamp i64 |
    producerId i64 | producerEpoch i16 | baseSequence i32 | recordsCount i32 | records...

The CRC32C covers everything from ``attributes`` on, so the broker may rewrite ``baseOffset``
(and the leader epoch) of a stored batch without touching its checksum: that is how a batch
stored verbatim is served at the offset the log gave it.

Rule 1: every length read from the wire is checked against the bytes that are there; a
        decompressed body is bounded by ``limit``; a malformed batch raises ``RecordError``.
Rule 2: ``decode_batch`` and ``build_batch`` are inverse for key, value (or null), headers and
        timestamps.
Rule 3: ``check_batch`` accepts what a batch stored verbatim needs (records that tile the body,
        offset deltas 0..count-1) without building any record; ``decode_batch`` is the full
        check.
"""

from __future__ import annotations

import gzip
import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from crc32c import crc32c

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
_CRC_START = 21  # offset of attributes: what the CRC covers
_LOG_OVERHEAD = 12  # baseOffset + batchLength

COMPRESSION_NONE = 0
COMPRESSION_GZIP = 1
COMPRESSION_SNAPPY = 2
COMPRESSION_LZ4 = 3
COMPRESSION_ZSTD = 4
TIMESTAMP_LOG_APPEND = 0x08
TRANSACTIONAL = 0x10
CONTROL = 0x20

_XERIAL_MAGIC = b"\x82SNAPPY\x00"


class RecordError(ValueError):
    """A malformed, corrupt or oversize record batch."""


class OffsetDeltaError(RecordError):
    """Well-formed records whose offset deltas are not 0, 1, 2, ... (Kafka's INVALID_RECORD)."""


@dataclass(slots=True)
class Record:
    """One Kafka record; ``offset_delta`` is relative to its batch's base offset."""

    offset_delta: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """A record batch's header fields and its raw bytes (header included)."""

    raw: bytes
    base_offset: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    count: int

    @property
    def compression(self) -> int:
        return self.attributes & 0x07

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & CONTROL)

    def crc_ok(self) -> bool:
        return crc32c(self.raw[_CRC_START:]) == self.crc


def split_batches(data: bytes | memoryview, *, max_batches: int = 10_000) -> list[Batch]:
    """Split a ``records`` field into batches (v2 only, each copied out as bytes); raise
    ``RecordError``."""
    out: list[Batch] = []
    pos = 0
    n = len(data)
    while pos < n:
        if n - pos < HEADER_SIZE:
            raise RecordError("record batch header truncated")
        fields = HEADER.unpack_from(data, pos)
        length = fields[1]
        if fields[3] != 2:
            raise RecordError(f"record batch magic {fields[3]} is not supported (only v2)")
        if length < HEADER_SIZE - _LOG_OVERHEAD or pos + _LOG_OVERHEAD + length > n:
            raise RecordError(f"record batch length {length} does not fit the data")
        end = pos + _LOG_OVERHEAD + length
        out.append(Batch(bytes(data[pos:end]), *fields[:1], *fields[2:]))
        if len(out) > max_batches:
            raise RecordError("too many record batches")
        pos = end
    return out


def with_base_offset(raw: bytes, base_offset: int) -> bytes:
    """The batch with its base offset replaced (outside the CRC)."""
    return struct.pack(">q", base_offset) + raw[8:]


def _bounded(chunks: io.RawIOBase | io.BufferedIOBase, limit: int) -> bytes:
    out = chunks.read(limit + 1)
    if out is None or len(out) > limit:
        raise RecordError(f"decompressed record batch exceeds {limit} bytes")
    return bytes(out)


def _snappy_length(block: bytes) -> int:
    # A raw snappy block starts with its uncompressed length as an unsigned varint.
    value = 0
    for i, b in enumerate(block[:5]):
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return value
    raise RecordError("malformed snappy block")


def _snappy(data: bytes, limit: int) -> bytes:
    import snappy

    if not data.startswith(_XERIAL_MAGIC):
        if _snappy_length(data) > limit:
            raise RecordError(f"decompressed record batch exceeds {limit} bytes")
        return bytes(snappy.uncompress(data))
    pos = 16  # magic + version + compatible version
    out = bytearray()
    while pos < len(data):
        if pos + 4 > len(data):
            raise RecordError("truncated xerial snappy block")
        (size,) = struct.unpack_from(">i", data, pos)
        pos += 4
        if size < 0 or pos + size > len(data):
            raise RecordError("xerial snappy block runs past the data")
        block = data[pos : pos + size]
        if len(out) + _snappy_length(block) > limit:
            raise RecordError(f"decompressed record batch exceeds {limit} bytes")
        out += snappy.uncompress(block)
        pos += size
    return bytes(out)


def _lz4(data: bytes, limit: int) -> bytes:
    # One decompressor per LZ4 frame (clients write one; concatenated frames are legal), each
    # told how much it may produce, so a bomb stops at the limit without a file wrapper.
    import lz4.frame

    out = b""
    rest = data
    while True:
        d = lz4.frame.LZ4FrameDecompressor()
        out += d.decompress(rest, max_length=limit + 1 - len(out))
        if len(out) > limit:
            raise RecordError(f"decompressed record batch exceeds {limit} bytes")
        if not d.eof:
            if d.needs_input:
                raise RecordError("truncated lz4 frame")
            raise RecordError(f"decompressed record batch exceeds {limit} bytes")
        rest = d.unused_data
        if not rest:
            return out


def decompress(kind: int, data: bytes, limit: int) -> bytes:
    """Decompress a batch body, bounded by ``limit``; raise ``RecordError``."""
    try:
        if kind == COMPRESSION_NONE:
            return data
        if kind == COMPRESSION_GZIP:
            return _bounded(gzip.GzipFile(fileobj=io.BytesIO(data)), limit)
        if kind == COMPRESSION_SNAPPY:
            return _snappy(data, limit)
        if kind == COMPRESSION_LZ4:
            return _lz4(data, limit)
        if kind == COMPRESSION_ZSTD:
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
            return _bounded(reader, limit)
    except RecordError:
        raise
    except Exception as e:
        raise RecordError(f"cannot decompress record batch: {e!r}") from None
    raise RecordError(f"unknown compression codec {kind}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    if pos < len(data) and data[pos] < 0x80:  # one byte: the common case
        b = data[pos]
        return (b >> 1) ^ -(b & 1), pos + 1
    value = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise RecordError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7
        if shift > 63:
            raise RecordError("varint too long")


def _bytes(data: bytes, pos: int, end: int) -> tuple[bytes | None, int]:
    size, pos = _varint(data, pos)
    if size < 0:
        return None, pos
    if pos + size > end:
        raise RecordError("record field runs past the record")
    return bytes(data[pos : pos + size]), pos + size


def decode_batch(batch: Batch, *, limit: int) -> list[Record]:
    """The records of a batch (decompressed within ``limit`` bytes); raise ``RecordError``."""
    if batch.count < 0 or batch.count > len(batch.raw) * 64:
        raise RecordError(f"record count {batch.count} is implausible")
    body = decompress(batch.compression, batch.raw[HEADER_SIZE:], limit)
    log_append = bool(batch.attributes & TIMESTAMP_LOG_APPEND)
    out: list[Record] = []
    pos = 0
    for _ in range(batch.count):
        length, pos = _varint(body, pos)
        end = pos + length
        if length < 0 or end > len(body):
            raise RecordError("record runs past the batch")
        pos += 1  # attributes
        ts_delta, pos = _varint(body, pos)
        offset_delta, pos = _varint(body, pos)
        key, pos = _bytes(body, pos, end)
        value, pos = _bytes(body, pos, end)
        n_headers, pos = _varint(body, pos)
        if n_headers < 0 or n_headers > length:
            raise RecordError("invalid header count")
        headers: list[tuple[str, bytes | None]] = []
        for _ in range(n_headers):
            hkey, pos = _bytes(body, pos, end)
            if hkey is None:
                raise RecordError("null header key")
            hval, pos = _bytes(body, pos, end)
            try:
                headers.append((hkey.decode("utf-8"), hval))
            except UnicodeDecodeError:
                raise RecordError("header key is not UTF-8") from None
        if pos != end:
            raise RecordError("record length does not match its fields")
        ts = batch.max_timestamp if log_append else batch.first_timestamp + ts_delta
        out.append(Record(offset_delta, ts, key, value, headers))
    if pos != len(body):
        raise RecordError("bytes left over after the last record")
    return out


def check_batch(batch: Batch, *, limit: int) -> None:
    """Check a batch's record area without decoding its records; raise ``RecordError``.

    The body (decompressed within ``limit`` bytes) must hold exactly ``count`` records whose
    length prefixes tile it, each with offset delta equal to its position: what a broker needs
    to store the batch verbatim and serve every record at its own offset. Keys, values and
    headers are left to the reader (``decode_batch`` raises on a malformed one)."""
    count = batch.count
    if count < 1 or count > len(batch.raw) * 64:
        raise RecordError(f"record count {count} is implausible")
    body = decompress(batch.compression, batch.raw[HEADER_SIZE:], limit)
    if count <= _UNIFORM_MAX and _uniform(body, count):
        return
    _check_records(body, count)


def _uniform(body: bytes, count: int) -> bool:
    """Whether the records of ``body`` pass ``_check_records`` by sharing one layout per
    offset-delta width (equal lengths, one-byte timestamp deltas): checked with a few slices of
    every S-th byte (S the record size) instead of record by record. False when they do not
    share it, whether or not they are valid (``_check_records`` then decides)."""
    n = len(body)
    pos = 0
    i = 0
    try:
        while i < count:
            wide = i >= 64  # offset deltas from 64 on take two bytes
            m = min(count, _UNIFORM_MAX if wide else 64) - i
            v = body[pos]
            if v < 0x80:
                head = 1
                length = _LEN1[v]
                prefix = bytes((v,))
            elif body[pos + 1] < 0x80:
                head = 2
                length = _LEN2[v & 0x7F][body[pos + 1]]
                prefix = body[pos : pos + 2]
            else:
                return False
            size = head + length
            end = pos + size * m
            if length < 4 or end > n:
                return False
            # Every record's length prefix is the first one's.
            if body[pos:end:size] != prefix[:1] * m:
                return False
            if head == 2 and body[pos + 1 : end : size] != prefix[1:] * m:
                return False
            t = pos + head + 1  # each record's timestamp delta, after its attributes
            if body[t:end:size].translate(None, _ONE_BYTE):  # a continuation bit somewhere
                return False
            k = i - 64
            if not wide:
                if body[t + 1 : end : size] != _DELTAS_1[i : i + m]:
                    return False
            elif (
                body[t + 1 : end : size] != _DELTAS_2_LOW[k : k + m]
                or body[t + 2 : end : size] != _DELTAS_2_HIGH[k : k + m]
            ):
                return False
            pos = end
            i += m
    except IndexError:
        return False
    return pos == n


def _check_records(body: bytes, count: int) -> None:
    """Walk the records of ``body`` one by one (see ``check_batch``); raise ``RecordError``."""
    n = len(body)
    pos = 0
    small = min(count, _SMALL - 1)
    len1, len2 = _LEN1, _LEN2
    try:
        for expected in _ZIGZAG[1 : small + 1]:  # offset delta i as a zigzag varint
            # Record length: a zigzag varint, one or two bytes below 8 KiB (tables).
            v = body[pos]
            if v < 0x80:
                pos += 1
                end = pos + len1[v]
            elif body[pos + 1] < 0x80:
                end = pos + 2 + len2[v & 0x7F][body[pos + 1]]
                pos += 2
            else:
                length, pos = _varint(body, pos)
                end = pos + length
            if end - pos < 4 or end > n:  # attributes, timestamp, offset delta, key at least
                raise RecordError("record runs past the batch")
            p = pos + 2  # past the attributes and the timestamp delta's first byte
            if body[p - 1] & 0x80:
                p += 1
                while body[p - 1] & 0x80:
                    p += 1
            if not body.startswith(expected, p, end):
                raise OffsetDeltaError("record offset deltas are not 0, 1, 2, ...")
            pos = end
        for i in range(small, count):
            length, pos = _varint(body, pos)
            end = pos + length
            if length < 4 or end > n:
                raise RecordError("record runs past the batch")
            _, p = _varint(body, pos + 1)
            delta, p = _varint(body, p)
            if delta != i or p > end:
                raise OffsetDeltaError("record offset deltas are not 0, 1, 2, ...")
            pos = end
    except IndexError:
        raise RecordError("record runs past the batch") from None
    if pos != n:
        raise RecordError("bytes left over after the last record")


def _zigzag_slow(value: int) -> bytes:
    v = (value << 1) ^ (value >> 63)
    out = bytearray()
    while v & ~0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_SMALL = 1 << 14
_ZIGZAG = [_zigzag_slow(v) for v in range(-1, _SMALL)]  # index v + 1
# Offset deltas 0..63 as one-byte zigzag varints, 64..8191 as two bytes (low, high).
_UNIFORM_MAX = 8192
_DELTAS_1 = bytes(range(0, 128, 2))
_DELTAS_2_LOW = bytes(((2 * i) & 0x7F) | 0x80 for i in range(64, _UNIFORM_MAX))
_DELTAS_2_HIGH = bytes((2 * i) >> 7 for i in range(64, _UNIFORM_MAX))
_ONE_BYTE = bytes(range(0x80))
# Zigzag varints of one byte (b) and two bytes (b0 without its continuation bit, b1).
_LEN1 = [(b >> 1) ^ -(b & 1) for b in range(0x80)]
_LEN2 = [[((b0 | b1 << 7) >> 1) ^ -(b0 & 1) for b1 in range(0x80)] for b0 in range(0x80)]


def _zigzag(value: int) -> bytes:
    if -1 <= value < _SMALL:
        return _ZIGZAG[value + 1]
    return _zigzag_slow(value)


def _field(value: bytes | None) -> bytes:
    if value is None:
        return _ZIGZAG[0]
    return _zigzag(len(value)) + value


def encode_record(record: Record, first_timestamp: int) -> bytes:
    """One record as it sits in an uncompressed batch body."""
    key = record.key
    value = record.value
    body = b"".join(
        (
            b"\x00",
            _zigzag(record.timestamp_ms - first_timestamp),
            _zigzag(record.offset_delta),
            _ZIGZAG[0] if key is None else _zigzag(len(key)),
            key or b"",
            _ZIGZAG[0] if value is None else _zigzag(len(value)),
            value or b"",
            _zigzag(len(record.headers)),
            *(_field(k.encode("utf-8")) + _field(v) for k, v in record.headers),
        )
    )
    return _zigzag(len(body)) + body


def build_batch(
    base_offset: int,
    records: Sequence[Record],
    *,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    compression: int = COMPRESSION_NONE,
) -> bytes:
    """A v2 batch of ``records`` (offset deltas as given) with a valid CRC."""
    if not records:
        raise ValueError("a record batch holds at least one record")
    first_ts = min(r.timestamp_ms for r in records)
    max_ts = max(r.timestamp_ms for r in records)
    body = b"".join(encode_record(r, first_ts) for r in records)
    if compression == COMPRESSION_GZIP:
        body = gzip.compress(body)
    elif compression == COMPRESSION_ZSTD:
        import zstandard

        body = zstandard.ZstdCompressor().compress(body)
    elif compression == COMPRESSION_LZ4:
        import lz4.frame

        body = lz4.frame.compress(body)
    elif compression == COMPRESSION_SNAPPY:
        import snappy

        body = snappy.compress(body)
    elif compression != COMPRESSION_NONE:
        raise ValueError(f"unknown compression {compression}")
    last_delta = max(r.offset_delta for r in records)
    after_crc = struct.pack(
        ">hiqqqhii",
        compression,
        last_delta,
        first_ts,
        max_ts,
        producer_id,
        producer_epoch,
        base_sequence,
        len(records),
    )
    crc = crc32c(after_crc + body)
    length = 4 + 1 + 4 + len(after_crc) + len(body)
    head = struct.pack(">qiibI", base_offset, length, -1, 2, crc)
    return head + after_crc + body
