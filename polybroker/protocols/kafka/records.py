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
Rule 3: ``check_batch`` validates every record of a batch as Kafka's broker does (fields that
        fill each record exactly, lengths in bounds, offset deltas 0..count-1) in one pass over
        the decompressed bytes, without building any record; what it accepts ``decode_batch``
        decodes.
"""

from __future__ import annotations

import gzip
import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from crc32c import crc32c

from polybroker.compression import snappy_length

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


class InvalidRecordError(RecordError):
    """A batch whose records are malformed inside (Kafka's INVALID_RECORD): lengths that do not
    fit, a count that disagrees, a bad header."""


class OffsetDeltaError(InvalidRecordError):
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
        return crc32c(memoryview(self.raw)[_CRC_START:]) == self.crc  # no copy of the bytes


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


def _snappy_length(block: bytes | memoryview) -> int:
    length = snappy_length(block)
    if length is None:
        raise RecordError("malformed snappy block")
    return length


def _snappy(data: bytes | memoryview, limit: int) -> bytes:
    import snappy

    if data[: len(_XERIAL_MAGIC)] != _XERIAL_MAGIC:
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


#: Most an lz4 decompression call is asked to produce at once: the library sets aside room for
#: all it may produce, which costs time with the size (a 100 MB limit made each call ~5x slower).
_LZ4_STEP = 8 * 1024 * 1024


def _lz4(data: bytes | memoryview, limit: int) -> bytes:
    # One decompressor per LZ4 frame (clients write one; concatenated frames are legal), each
    # told how much it may produce, so a bomb stops at the limit without a file wrapper.
    import lz4.frame

    parts: list[bytes] = []
    size = 0
    rest = data
    while True:
        d = lz4.frame.LZ4FrameDecompressor()
        chunk = d.decompress(rest, max_length=min(_LZ4_STEP, limit + 1 - size))
        while True:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise RecordError(f"decompressed record batch exceeds {limit} bytes")
            if d.eof:
                break
            if d.needs_input:
                raise RecordError("truncated lz4 frame")
            # The step was reached: the rest of this frame, in steps again.
            chunk = d.decompress(b"", max_length=min(_LZ4_STEP, limit + 1 - size))
        rest = d.unused_data
        if not rest:
            return b"".join(parts)


def decompress(kind: int, data: bytes | memoryview, limit: int) -> bytes:
    """Decompress a batch body, bounded by ``limit``; raise ``RecordError``. An uncompressed
    body comes back as bytes (a view is copied)."""
    try:
        if kind == COMPRESSION_NONE:
            return data if isinstance(data, bytes) else bytes(data)
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
            raise InvalidRecordError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7
        if shift > 63:
            raise InvalidRecordError("varint too long")


def _bytes(data: bytes, pos: int, end: int) -> tuple[bytes | None, int]:
    size, pos = _varint(data, pos)
    if size < 0:
        return None, pos
    if pos + size > end:
        raise InvalidRecordError("record field runs past the record")
    return bytes(data[pos : pos + size]), pos + size


def decode_batch(batch: Batch, *, limit: int, body: bytes | None = None) -> list[Record]:
    """The records of a batch (decompressed within ``limit`` bytes, or ``body`` as
    ``check_batch`` returned it); raise ``RecordError``."""
    if batch.count < 0 or batch.count > len(batch.raw) * 64:
        raise InvalidRecordError(f"record count {batch.count} is implausible")
    if body is None:
        body = decompress(batch.compression, batch.raw[HEADER_SIZE:], limit)
    log_append = bool(batch.attributes & TIMESTAMP_LOG_APPEND)
    out: list[Record] = []
    pos = 0
    for _ in range(batch.count):
        length, pos = _varint(body, pos)
        end = pos + length
        if length < 0 or end > len(body):
            raise InvalidRecordError("record runs past the batch")
        pos += 1  # attributes
        ts_delta, pos = _varint(body, pos)
        offset_delta, pos = _varint(body, pos)
        key, pos = _bytes(body, pos, end)
        value, pos = _bytes(body, pos, end)
        n_headers, pos = _varint(body, pos)
        if n_headers < 0 or n_headers > length:
            raise InvalidRecordError("invalid header count")
        headers: list[tuple[str, bytes | None]] = []
        for _ in range(n_headers):
            hkey, pos = _bytes(body, pos, end)
            if hkey is None:
                raise InvalidRecordError("null header key")
            hval, pos = _bytes(body, pos, end)
            try:
                headers.append((hkey.decode("utf-8"), hval))
            except UnicodeDecodeError:
                raise InvalidRecordError("header key is not UTF-8") from None
        if pos != end:
            raise InvalidRecordError("record length does not match its fields")
        ts = batch.max_timestamp if log_append else batch.first_timestamp + ts_delta
        out.append(Record(offset_delta, ts, key, value, headers))
    if pos != len(body):
        raise InvalidRecordError("bytes left over after the last record")
    return out


def check_batch(batch: Batch, *, limit: int) -> bytes:
    """Validate a batch's records without building any; raise ``RecordError``.

    The body (decompressed within ``limit`` bytes) must hold exactly ``count`` records that
    tile it, each one well formed as Kafka's broker reads it: its fields (attributes,
    timestamp delta, offset delta, key, value, headers) fill exactly its length, its unused
    attributes byte has no high bit (kafka-python reads it as a varint), key and value
    lengths are -1 (null) or fit the record, the header count is not negative and every header
    has a non-null UTF-8 key; the offset delta of record ``i`` is ``i`` (``OffsetDeltaError``
    otherwise). Malformed records raise ``InvalidRecordError``. What passes decodes with
    ``decode_batch`` and with every client. Returns the decompressed body."""
    count = batch.count
    if count < 1 or count > len(batch.raw) * 64:
        raise InvalidRecordError(f"record count {count} is implausible")
    raw = batch.raw
    # A compressed body is read through a view (no copy); an uncompressed one is sliced once.
    area = (
        raw[HEADER_SIZE:]
        if batch.compression == COMPRESSION_NONE
        else memoryview(raw)[HEADER_SIZE:]
    )
    body = decompress(batch.compression, area, limit)
    _check_records(body, count)
    return body


def _check_records(body: bytes, count: int) -> None:
    """Validate the ``count`` records of ``body`` (see ``check_batch``); raise ``RecordError``.

    Runs of records that share one layout are checked a few slices at a time
    (``_uniform_run``); where none starts, a few records are walked one by one (``_walk``)."""
    n = len(body)
    pos = i = 0
    while i < count:
        run = _uniform_run(body, pos, i, count) if i < _UNIFORM_MAX else None
        if run is not None:
            pos, i = run
            continue
        stop = min(count, i + _WALK_STEP)
        pos = _walk(body, pos, i, stop)
        i = stop
    if pos != n:
        raise InvalidRecordError("bytes left over after the last record")


def _uniform(body: bytes, count: int) -> bool:
    """Whether runs of one layout (``_uniform_run``) cover every record of ``body`` exactly.
    False when they do not, whether or not the records are valid."""
    pos = i = 0
    while i < count:
        run = _uniform_run(body, pos, i, count) if i < _UNIFORM_MAX else None
        if run is None:
            return False
        pos, i = run
    return pos == len(body)


def _walk_records(body: bytes, count: int) -> None:
    """The record-by-record check of all of ``body`` (no runs); raise ``RecordError``."""
    if _walk(body, 0, 0, count) != len(body):
        raise InvalidRecordError("bytes left over after the last record")


def _uniform_run(body: bytes, pos: int, i: int, count: int) -> tuple[int, int] | None:
    """Records ``i``, ``i + 1``, ... from ``pos`` that share the first one's layout: its size
    S, its timestamp-delta width, key and value length prefixes and no headers, with offset
    deltas counting up. Checked on every S-th byte, a few slices for the whole run, never
    record by record. Returns (position, index) after the run, or None when fewer than
    ``_MIN_RUN`` records share a layout; a None says nothing about validity."""
    n = len(body)
    if i < 64:
        width, low, high = 1, 0, 64
    elif i < 8192:
        width, low, high = 2, 64, 8192
    else:
        width, low, high = 3, 8192, _UNIFORM_MAX
    try:
        v = body[pos]
        if v < 0x80:
            head = 1
            length = _LEN1[v]
        elif body[pos + 1] < 0x80:
            head = 2
            length = _LEN2[v & 0x7F][body[pos + 1]]
        else:
            return None
        size = head + length
        if length < 6:
            return None
        m = min(min(count, high) - i, (n - pos) // size)
        if m < 1:
            return None
        end = pos + size * m
        # The run: the records whose length prefix is the first one's (each then starts
        # where the S-th byte stride puts it).
        lead = body[pos:end:size]
        m -= len(lead.lstrip(lead[:1]))
        if head == 2:
            lead = body[pos + 1 : end : size]
            m = min(m, len(lead) - len(lead.lstrip(lead[:1])))
        if m < _MIN_RUN and m < count - i:
            return None
        end = pos + size * m
        a = pos + head  # the attributes: no high bit (some readers take them for a varint)
        if body[a:end:size].translate(None, _ONE_BYTE):
            return None
        t = a + 1  # the timestamp delta: one byte, or two (first with its high bit)
        if body[t] < 0x80:
            if body[t:end:size].translate(None, _ONE_BYTE):
                return None
            d = t + 1
        elif body[t + 1] < 0x80:
            if body[t:end:size].translate(None, _HIGH_BYTES) or body[t + 1 : end : size].translate(
                None, _ONE_BYTE
            ):
                return None
            d = t + 2
        else:
            return None
        k = i - low
        for j, table in enumerate(_DELTAS[width]):  # the offset deltas, byte by byte
            if body[d + j : end : size] != table[k : k + m]:
                return None
        # The first record's key length (one byte) and value length (one or two) and a zero
        # header count must end it exactly; then every record has the same prefixes.
        q = d + width
        key_len = _LEN1[body[q]] if body[q] < 0x80 else -2
        if key_len < -1:
            return None
        qv = q + 1 + max(key_len, 0)
        b0 = body[qv]
        if b0 < 0x80:
            value_width = 1
            value_len = _LEN1[b0]
        elif body[qv + 1] < 0x80:
            value_width = 2
            value_len = _LEN2[b0 & 0x7F][body[qv + 1]]
        else:
            return None
        h = qv + value_width + max(value_len, 0)  # the header count: the record's last byte
        if value_len < -1 or h != pos + size - 1 or body[h]:
            return None
        if (
            body[q:end:size] != body[q : q + 1] * m
            or body[qv:end:size] != body[qv : qv + 1] * m
            or (value_width == 2 and body[qv + 1 : end : size] != body[qv + 1 : qv + 2] * m)
            or body[h:end:size].count(0) != m
        ):
            return None
    except IndexError:
        return None
    return end, i + m


def _walk(body: bytes, pos: int, first: int, stop: int) -> int:
    """Check records ``first`` .. ``stop - 1`` one by one from ``pos`` and return the position
    after them; raise ``RecordError``. One pass, no per-record objects: one- and two-byte
    varints come from tables, longer ones from ``_varint``."""
    n = len(body)
    len1, len2, zigzag = _LEN1, _LEN2, _ZIGZAG
    try:
        for i in range(first, stop):
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
            # attributes, timestamp delta, offset delta, key, value, header count: 6 at least
            if end - pos < 6 or end > n:
                raise InvalidRecordError("record runs past the batch")
            if body[pos] & 0x80:  # unused, but some readers take it for a varint
                raise InvalidRecordError("record attributes have the high bit set")
            p = pos + 2  # past the attributes and the timestamp delta's first byte
            if body[p - 1] & 0x80:
                p += 1
                while body[p - 1] & 0x80:
                    p += 1
                if p - pos > 11:
                    raise InvalidRecordError("timestamp delta varint too long")
            expected = zigzag[i + 1] if i < _SMALL - 1 else _zigzag_slow(i)
            if not body.startswith(expected, p, end):
                raise OffsetDeltaError("record offset deltas are not 0, 1, 2, ...")
            p += len(expected)
            v = body[p]  # key length
            if v < 0x80:
                size = len1[v]
                p += 1
            else:
                size, p = _varint(body, p)
            if size > 0:
                p += size
            elif size < -1:
                raise InvalidRecordError("invalid key length")
            v = body[p]  # value length
            if v < 0x80:
                size = len1[v]
                p += 1
            elif body[p + 1] < 0x80:
                size = len2[v & 0x7F][body[p + 1]]
                p += 2
            else:
                size, p = _varint(body, p)
            if size > 0:
                p += size
            elif size < -1:
                raise InvalidRecordError("invalid value length")
            if body[p] == 0:  # no headers: the common case
                p += 1
            else:
                p = _skip_headers(body, p, end)
            if p != end:
                raise InvalidRecordError("record length does not match its fields")
            pos = end
    except IndexError:
        raise InvalidRecordError("record runs past the batch") from None
    return pos


def _skip_headers(body: bytes, p: int, end: int) -> int:
    """Past the headers of a record ending at ``end``; raise ``RecordError``."""
    count, p = _varint(body, p)
    if count < 0 or count > end - p:
        raise InvalidRecordError("invalid header count")
    for _ in range(count):
        size, p = _varint(body, p)
        if size < 0 or p + size > end:
            raise InvalidRecordError("invalid header key")
        try:
            body[p : p + size].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRecordError("header key is not UTF-8") from None
        p += size
        size, p = _varint(body, p)
        if size > 0:
            p += size
        elif size < -1:
            raise InvalidRecordError("invalid header value length")
        if p > end:
            raise InvalidRecordError("header runs past the record")
    return p


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
# Offset deltas as zigzag varints, one table per byte: 0..63 take one byte, 64..8191 two,
# 8192.. three (a run is checked against a slice of each).
_UNIFORM_MAX = 1 << 17
_MIN_RUN = 4  # shorter runs are walked
_WALK_STEP = 16  # records walked where no run starts
_DELTAS = {
    1: [bytes(range(0, 128, 2))],
    2: [
        bytes(((2 * i) & 0x7F) | 0x80 for i in range(64, 8192)),
        bytes((2 * i) >> 7 for i in range(64, 8192)),
    ],
    3: [
        bytes(((2 * i) & 0x7F) | 0x80 for i in range(8192, _UNIFORM_MAX)),
        bytes(((2 * i) >> 7 & 0x7F) | 0x80 for i in range(8192, _UNIFORM_MAX)),
        bytes((2 * i) >> 14 for i in range(8192, _UNIFORM_MAX)),
    ],
}
_HIGH_BYTES = bytes(range(0x80, 0x100))
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
