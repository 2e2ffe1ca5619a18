"""Executor side of a read straight from the bookies: the sealed-ledger part of a backlog.

Rows come out exactly as the broker path gives them (``polybroker.spark.reading``): the same key,
value, publish and event times, properties (as the client's map: by key) and ``__messageId``
bytes (the client's serialized id: ledger, entry, partition, batch index and batch size). A stored
entry is decoded with ``broker_core.messages`` (batches, compression, foreign formats such as
Kafka's); an entry in a format no installed protocol registers, or one no bookie can give, ends the
direct read there and the rest of the range is read through the broker.

Known difference: a message with an ordering key reads that key here, the client's partition key
through the broker; a key that is not UTF-8 reads as its bytes here, base64 through the broker.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from polybroker.broker_core import messages
from polybroker.broker_core.stored import stored_message_pb2 as pb
from polybroker.ledger import entry_format
from polybroker.ledger.direct import DirectLedgerReader, DirectReadError, LedgerLayout
from polybroker.spark.offsets import Boundary, ReadRange, entries_between

log = logging.getLogger(__name__)

#: key, value, serialized message id, publish time (us), event time (us) or None, properties.
Row = tuple[bytes | None, bytes, bytes, int, int | None, list[tuple[str, str]]]

_formats_loaded = False


@dataclass(frozen=True)
class Stop:
    """Where a direct read gave up: the rest of the range starts at ``resume``."""

    resume: Boundary
    reason: str


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def message_id_bytes(ledger: int, entry: int, partition: int, batch: int, size: int) -> bytes:
    """The Pulsar client's serialized MessageIdData for a message of a stored entry."""
    out = b"\x08" + _varint(ledger) + b"\x10" + _varint(entry)
    if partition >= 0:
        out += b"\x18" + _varint(partition)
    if batch >= 0:
        out += b"\x20" + _varint(batch) + b"\x30" + _varint(size)
    return out


def partition_index(topic: str) -> int:
    """``n`` of ``...-partition-n``, -1 for a topic that is not a partition."""
    _, sep, tail = topic.rpartition("-partition-")
    return int(tail) if sep and tail.isdigit() else -1


def _load_formats() -> None:
    """Import the installed protocol handlers once: they register their stored formats."""
    global _formats_loaded
    if _formats_loaded:
        return
    _formats_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group="polybroker.protocol_handlers"):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not break reads of other formats
            log.warning("protocol handler %s not loaded: %s", ep.name, e)


def _decode(data: bytes) -> tuple[list[messages.Message], bool]:
    """The messages of a stored entry's message part, and whether the client sees a batch."""
    md, _ = messages.split_entry(data)
    pulsar_format = messages.entry_format(data) == messages.PULSAR_FORMAT
    try:
        decoded = messages.decode_entry(data)
    except messages.MessageFormatError:
        if pulsar_format:
            raise
        _load_formats()
        decoded = messages.decode_entry(data)
    if pulsar_format:
        return decoded, md.HasField("num_messages_in_batch")
    # The broker hands such an entry to Pulsar clients re-encoded: a batch unless it holds one.
    return decoded, len(decoded) > 1


_US = 1000
_U32 = struct.Struct(">I")
_SEQ_TAG = b"\x40"  # SingleMetadata.sequence_id, field 8, varint
_BATCH_TAG = b"\x20"  # MessageIdData.batch_index, field 4
_SIZE_TAG = b"\x30"  # MessageIdData.batch_size, field 6
_BATCH_INDEX: list[bytes] = []  # _BATCH_TAG + varint(i), grown on demand

#: key, payload size, properties, event time (us) or None: what a SingleMetadata says.
_Single = tuple[bytes | None, int, list[tuple[str, str]], int | None]


class Columns:
    """Rows as columns: key, value, message id, publish and event time (us), properties.

    ``blob`` (when set, ``values`` is empty) holds the values of equal length ``width``
    back to back: a uniform batch's payloads, copied out at C speed."""

    __slots__ = ("blob", "events", "ids", "keys", "props", "pubs", "values", "width")

    def __init__(self) -> None:
        self.keys: list[bytes | None] = []
        self.values: list[bytes] = []
        self.ids: list[bytes] = []
        self.pubs: list[int] = []
        self.events: list[int | None] = []
        self.props: list[list[tuple[str, str]]] = []
        self.blob: bytes | None = None
        self.width = 0

    def __len__(self) -> int:
        return len(self.ids)

    def value_list(self) -> list[bytes]:
        """The values, one bytes each."""
        if self.blob is None:
            return self.values
        w = self.width
        return [self.blob[i : i + w] for i in range(0, w * len(self.ids), w)]

    def rows(self) -> list[Row]:
        """The rows one by one (for tests and the typed columns)."""
        return list(
            zip(
                self.keys,
                self.value_list(),
                self.ids,
                self.pubs,
                self.events,
                self.props,
                strict=True,
            )
        )


def _batch_index(count: int) -> None:
    """Make ``_BATCH_INDEX`` hold at least ``count`` items."""
    while len(_BATCH_INDEX) < count:
        _BATCH_INDEX.append(_BATCH_TAG + _varint(len(_BATCH_INDEX)))


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, (n >> 7) & 0x7F | 0x80, n >> 14))
    return _varint(n)


#: Maps a byte to 1 if it continues a varint (high bit set), else 0.
_CONTINUES = bytes(1 if b >= 0x80 else 0 for b in range(256))


try:  # numpy, when installed, checks and copies a uniform batch as one n x stride matrix
    import numpy as _np
except ImportError:  # pragma: no cover - exercised where numpy is absent
    _np = None


def _strided(body: bytes, n: int, stride: int, fixed: int, width: int, skip: int) -> bytes | None:
    """The payloads of ``n`` messages of ``stride`` bytes each (``body[skip:stride]`` of each)
    if every message has the first one's ``fixed`` bytes and then a ``width``-byte varint;
    None otherwise."""
    if _np is not None:
        rows = _np.frombuffer(body, dtype=_np.uint8).reshape(n, stride)
        if not (rows[:, :fixed] == rows[0, :fixed]).all():
            return None
        if width > 1 and not (rows[:, fixed : fixed + width - 1] >= 0x80).all():
            return None
        if not (rows[:, fixed + width - 1] < 0x80).all():
            return None
        return rows[:, skip:].tobytes()
    starts = range(0, len(body), stride)
    if b"".join([body[p : p + fixed] for p in starts]) != body[:fixed] * n:
        return None
    varints = b"".join([body[p + fixed : p + fixed + width] for p in starts])
    if varints.translate(_CONTINUES) != (b"\x01" * (width - 1) + b"\x00") * n:
        return None
    return b"".join([body[p + skip : p + stride] for p in starts])


def _uniform(
    body: bytes, n: int, seq: int, cache: _SingleCache, out: Columns, pub: int, ids: list[bytes]
) -> bool:
    """Take a whole batch at once when every message is the first one's shape: the same
    SingleMetadata but for a sequence id of the same width, and the same payload size. Checked
    byte for byte; False (nothing taken) otherwise."""
    if n < 2 or len(body) < 4:
        return False
    (size,) = _U32.unpack_from(body, 0)
    raw = body[4 : 4 + size]
    seq_field = _SEQ_TAG + _uvarint(seq)
    if len(raw) != size or not raw.endswith(seq_field):
        return False
    info = cache.parse(raw, seq)
    head = raw[: -len(seq_field)]
    if cache.known(head) is not info:
        return False  # the prefix did not parse alone to the same fields: not cached
    width = len(seq_field) - 1
    length = info[1]
    stride = 4 + size + length
    if n * stride != len(body):
        return False
    fixed = 4 + len(head) + 1
    skip = 4 + size
    blob = _strided(body, n, stride, fixed, width, skip)
    if blob is None:
        return False
    out.blob = blob
    out.width = length
    key, _, prop, event = info
    out.keys += [key] * n
    out.ids += ids
    out.pubs += [pub] * n
    out.events += [event] * n
    out.props += [prop] * n
    return True


def _key(smm: Any) -> bytes | None:
    """The key as ``messages.decode_entry`` gives it: ordering key, else the partition key."""
    if smm.HasField("ordering_key"):
        return bytes(smm.ordering_key)
    if not smm.HasField("partition_key"):
        return None
    if smm.partition_key_b64_encoded:
        try:
            return base64.b64decode(smm.partition_key, validate=True)
        except (binascii.Error, ValueError):
            raise messages.MessageFormatError("partition key is not valid base64") from None
    return smm.partition_key.encode("utf-8")


class _SingleCache:
    """Parsed SingleMetadata by their bytes without the trailing sequence id.

    A producer's messages differ mostly in their sequence id, the last field: the rest is
    parsed once. A prefix is cached only once it parsed alone to the same fields, so any bytes
    that are that prefix plus a sequence id field parse as it (protobuf concatenation)."""

    def __init__(self, event_default: int) -> None:
        self.event_default = event_default
        self._by_prefix: dict[bytes, _Single] = {}
        self.known = self._by_prefix.get

    def parse(self, raw: bytes, seq: int) -> _Single:
        tail = _SEQ_TAG + _uvarint(seq)
        if raw.endswith(tail):
            head = raw[: -len(tail)]
            got = self._by_prefix.get(head)
            if got is not None:
                return got
        else:
            head = None
        smm = pb.SingleMetadata()
        try:
            smm.ParseFromString(raw)
        except Exception as e:
            raise messages.MessageFormatError(f"malformed single-message metadata: {e}") from None
        event = int(smm.event_time) or self.event_default
        info: _Single = (
            _key(smm) or None,
            int(smm.payload_size),
            sorted({p.key: p.value for p in smm.properties}.items()),
            event * _US if event else None,
        )
        if head is not None and len(self._by_prefix) < 10_000:
            alone = pb.SingleMetadata()
            with contextlib.suppress(Exception):
                alone.ParseFromString(head)
                smm.ClearField("sequence_id")
                if alone == smm:
                    self._by_prefix[head] = info
        return info


def _pulsar_batch(md: Any, payload: bytes, lo: int, hi: int, prefix: bytes, out: Columns) -> None:
    """Messages ``lo..hi-1`` of a Pulsar batch (the common case, fast)."""
    n = md.num_messages_in_batch
    body = messages.decompress(
        md.compression, md.uncompressed_size, payload, messages.DEFAULT_MAX_SIZE
    )
    if n < 0 or n > len(body) // 4 + 1:
        raise messages.MessageFormatError(f"batch claims {n} messages in {len(body)} bytes")
    cache = _SingleCache(int(md.event_time))
    known = cache.known
    parse = cache.parse
    seq = int(md.sequence_id)
    pub = int(md.publish_time) * _US
    tail = _SIZE_TAG + _uvarint(n)
    unpack = _U32.unpack_from
    count = max(0, min(hi, n))
    _batch_index(count)
    index = _BATCH_INDEX
    if lo == 0 and count == n and not out.ids:
        all_ids = [prefix + x + tail for x in index[:n]]
        if _uniform(body, n, seq, cache, out, pub, all_ids):
            return
    keys, values, ids, events, props = out.keys, out.values, out.ids, out.events, out.props
    pos = 0
    end = len(body)
    for i in range(count):
        if end - pos < 4:
            raise messages.MessageFormatError("truncated batch: no single-message metadata size")
        (size,) = unpack(body, pos)
        pos += 4
        if size > end - pos:
            raise messages.MessageFormatError("single-message metadata runs past the batch")
        raw = body[pos : pos + size]
        pos += size
        # The common case inline: known fields, then this message's sequence id (_SingleCache).
        s = seq + i
        seq_field = _SEQ_TAG + (bytes((s,)) if s < 0x80 else _uvarint(s))
        info = known(raw[: -len(seq_field)]) if raw.endswith(seq_field) else None
        key, length, prop, event = info or parse(raw, s)
        if length < 0 or length > end - pos:
            raise messages.MessageFormatError("message payload runs past the batch")
        if i >= lo:
            keys.append(key)
            values.append(body[pos : pos + length])
            ids.append(prefix + index[i] + tail)
            events.append(event)
            props.append(prop)
        pos += length
    out.pubs.extend([pub] * max(0, min(hi, n) - lo))


def entry_columns(
    ledger: int,
    entry: int,
    partition: int,
    data: bytes,
    start: Boundary,
    end: Boundary,
    out: Columns,
) -> None:
    """Append the rows of one stored entry (``entry_format`` header and message part) in
    ``[start, end)`` to ``out``; ``MessageFormatError``/``EntryFormatError`` if it cannot be
    decoded (``out`` may then hold some of its rows: the caller drops them)."""
    entry_format.decode_header(data)
    body = data[entry_format.HEADER_SIZE :]
    # Batch indexes of this entry inside [start, end): lo <= i < hi.
    lo = max(start[2], 0) if (start[0], start[1]) == (ledger, entry) else 0
    hi = max(end[2], 0) if (end[0], end[1]) == (ledger, entry) else 1 << 31
    prefix = b"\x08" + _varint(ledger) + b"\x10" + _varint(entry)
    if partition >= 0:
        prefix += b"\x18" + _varint(partition)
    md, payload = messages.split_entry(body)
    if (
        md.HasField("num_messages_in_batch")
        and messages.entry_format(body) == messages.PULSAR_FORMAT
    ):
        _pulsar_batch(md, payload, lo, hi, prefix, out)
        return
    decoded, batched = _decode(body)
    n = len(decoded)
    for i, m in enumerate(decoded):
        b = i if batched else -1
        pos = (ledger, entry, b)
        if pos < start or pos >= end:
            continue
        out.keys.append(m.key or None)
        out.values.append(m.payload)
        out.ids.append(message_id_bytes(ledger, entry, partition, b, n))
        out.pubs.append(m.publish_time_ms * _US)
        out.events.append(m.event_time_ms * _US if m.event_time_ms else None)
        out.props.append(sorted(dict(m.properties).items()) if m.properties else [])


def entry_rows(
    ledger: int, entry: int, partition: int, data: bytes, start: Boundary, end: Boundary
) -> list[Row]:
    """``entry_columns`` as a list of rows."""
    out = Columns()
    entry_columns(ledger, entry, partition, data, start, end, out)
    return out.rows()


def read_rows(
    rng: ReadRange,
    layouts: Sequence[LedgerLayout],
    ledgers: Sequence[tuple[int, int]],
    reader: DirectLedgerReader,
    stop: list[Stop],
) -> Iterator[Columns]:
    """Yield the rows of ``rng`` entry by entry, read from the bookies.

    ``ledgers`` are the ``(ledger id, entries)`` of the sealed ledgers the range covers. If an
    entry cannot be read or decoded, append a ``Stop`` to ``stop`` and return: the caller reads
    from ``Stop.resume`` on through the broker."""
    by_id = {layout.ledger_id: layout for layout in layouts}
    partition = partition_index(rng.topic)
    for ledger, first, stop_entry in entries_between(ledgers, rng.start, rng.end):
        layout = by_id.get(ledger)
        if layout is None:
            stop.append(Stop(max(rng.start, (ledger, first, -1)), f"no layout of ledger {ledger}"))
            return
        expected = first
        try:
            for entry, data in reader.read(layout, first, stop_entry - 1):
                out = Columns()
                entry_columns(ledger, entry, partition, data, rng.start, rng.end, out)
                expected = entry + 1
                yield out
        except (DirectReadError, messages.MessageFormatError, entry_format.EntryFormatError) as e:
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
        except struct.error as e:  # pragma: no cover - the decoders bound their reads
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
