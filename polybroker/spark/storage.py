"""Executor side of a read straight from the bookies: what storage holds of a backlog.

Rows come out exactly as the broker path gives them (``polybroker.spark.reading``): the same key,
value, publish and event times, properties (as the client's map: by key) and ``__messageId``
bytes (the client's serialized id: ledger, entry, partition, batch index and batch size). A stored
entry is decoded with ``broker_core.messages`` (batches, compression, foreign formats such as
Kafka's); an entry in a format no installed protocol registers, or one no bookie can give, ends the
direct read there and the rest of the range is read through the broker.

Rows are gathered as columns (``Columns``) and turned into Arrow arrays in bulk: a batch whose
messages share one shape costs a few numpy operations, not a Python step per message.

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

import numpy as np

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

#: key, payload size, properties, event time (us) or None: what a SingleMetadata says.
_Single = tuple[bytes | None, int, list[tuple[str, str]], int | None]


class Columns:
    """Rows as columns, built in bulk (``arrays``).

    Key, publish time, event time (us) and properties come in runs: ``runs[j]`` rows share
    ``keys[j]``, ``pubs[j]``, ``events[j]`` and ``props[j]``. Message ids come in runs of one
    entry, ``id_runs``: ``(ledger, entry, first batch index, rows, batch size)`` (batch index
    -1: a message outside a batch), or as the ids' bytes in ``raw_ids`` (rows read through the
    broker), never both. Values come in ``chunks``: lists of bytes, or ``n x width`` uint8
    matrices of equal-length values (a uniform batch's payloads)."""

    __slots__ = ("chunks", "events", "id_runs", "keys", "n", "props", "pubs", "raw_ids", "runs")

    def __init__(self) -> None:
        self.n = 0
        self.runs: list[int] = []
        self.keys: list[bytes | None] = []
        self.pubs: list[int] = []
        self.events: list[int | None] = []
        self.props: list[list[tuple[str, str]]] = []
        self.id_runs: list[tuple[int, int, int, int, int]] = []
        self.raw_ids: list[bytes] = []
        self.chunks: list[list[bytes] | Any] = []

    def __len__(self) -> int:
        return self.n

    def extend(self, other: Columns) -> None:
        """Append ``other``'s rows."""
        self.n += other.n
        self.runs += other.runs
        self.keys += other.keys
        self.pubs += other.pubs
        self.events += other.events
        self.props += other.props
        self.id_runs += other.id_runs
        self.raw_ids += other.raw_ids
        self.chunks += other.chunks

    def _expand(self, column: list[Any]) -> list[Any]:
        out: list[Any] = []
        for v, k in zip(column, self.runs, strict=True):
            out += [v] * k
        return out

    def rows(self, partition: int = -1) -> list[Row]:
        """The rows one by one (for tests)."""
        values: list[bytes] = []
        for c in self.chunks:
            values += list(c) if isinstance(c, list) else [bytes(r) for r in c]
        ids = self.raw_ids or message_ids(self.id_runs, partition).to_pylist()
        return list(
            zip(
                self._expand(self.keys),
                values,
                ids,
                self._expand(self.pubs),
                self._expand(self.events),
                self._expand(self.props),
                strict=True,
            )
        )

    def arrays(self, partition: int, ts: Any, props_type: Any) -> list[Any]:
        """The key, value, message id, publish time, event time and properties columns as
        Arrow arrays (``ts``: the timestamp type; ``partition``: the topic partition index)."""
        import pyarrow as pa

        n = self.n
        runs = self.runs
        index = None if len(runs) == n else pa.array(np.repeat(np.arange(len(runs)), runs))

        def spread(column: list[Any], type_: Any) -> Any:
            if column.count(None) == len(column):
                return pa.nulls(n, type_)
            arr = pa.array(column, type_)
            return arr if index is None else arr.take(index)

        if any(self.props):
            props = spread(self.props, props_type)
        else:
            props = pa.MapArray.from_arrays(
                pa.array(np.zeros(n + 1, np.int32)),
                pa.array([], pa.string()),
                pa.array([], pa.string()),
            )
        ids = (
            pa.array(self.raw_ids, pa.binary())
            if self.raw_ids
            else message_ids(self.id_runs, partition)
        )
        return [
            spread(self.keys, pa.binary()),
            _values(self.chunks, n),
            ids,
            pa.array(np.repeat(np.array(self.pubs, np.int64), runs), ts),
            spread(self.events, ts),
            props,
        ]


def _values(chunks: list[list[bytes] | Any], n: int) -> Any:
    """One binary array of the values in ``chunks`` (see ``Columns``)."""
    import pyarrow as pa

    lengths = []
    datas = []
    for c in chunks:
        if isinstance(c, list):
            lengths.append(np.fromiter(map(len, c), np.int64, len(c)))
            datas.append(np.frombuffer(b"".join(c), np.uint8))
        else:
            lengths.append(np.full(c.shape[0], c.shape[1], np.int64))
            datas.append(c.reshape(-1))
    offsets = np.zeros(n + 1, np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise messages.MessageFormatError("values of one batch exceed 2 GiB")
    data = np.concatenate(datas) if datas else np.zeros(0, np.uint8)
    return pa.BinaryArray.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
    )


def _varint_columns(v: Any, keep: Any) -> tuple[list[Any], list[Any]]:
    """Protobuf varints of the non-negative int64 column ``v`` as byte columns, with the mask
    of the bytes each row's varint has (for rows where ``keep``)."""
    top = int(v.max()) if len(v) else 0
    cols, masks = [], []
    shifted = v
    for _ in range(max(1, (top.bit_length() + 6) // 7)):
        more = shifted >> 7
        cols.append(((shifted & 0x7F) | np.where(more != 0, 0x80, 0)).astype(np.uint8))
        masks.append(keep & ((shifted != 0) | (not masks)))
        shifted = more
    return cols, masks


def message_ids(id_runs: Sequence[tuple[int, int, int, int, int]], partition: int) -> Any:
    """The client's serialized message ids (``message_id_bytes``) of ``id_runs`` (see
    ``Columns``) as one Arrow binary array.

    A run of many rows (a batch's messages) is its entry's id prefix joined to the batch index
    and size fields of each row, a layout that depends only on the batch and the prefix length
    and is kept (``_run_template``): one numpy gather per run. Runs of few rows are built column
    by column together."""
    import pyarrow as pa

    datas: list[Any] = []
    lengths: list[Any] = []
    small: list[tuple[int, int, int, int, int]] = []

    def flush_small() -> None:
        if small:
            data, row_lengths = _ids_by_columns(small, partition)
            datas.append(data)
            lengths.append(row_lengths)
            small.clear()

    tail = b"\x18" + _varint(partition) if partition >= 0 else b""
    for run in id_runs:
        ledger, entry, first, rows, size = run
        if rows < _TEMPLATE_MIN_ROWS:
            small.append(run)
            continue
        flush_small()
        prefix = b"\x08" + _uvarint(ledger) + b"\x10" + _uvarint(entry) + tail
        gather, suffixes, row_lengths = _run_template(first, rows, size, len(prefix))
        datas.append(np.concatenate((np.frombuffer(prefix, np.uint8), suffixes))[gather])
        lengths.append(row_lengths)
    flush_small()
    if not datas:
        return pa.array([], pa.binary())
    all_lengths = np.concatenate(lengths) if len(lengths) > 1 else lengths[0]
    n = len(all_lengths)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(all_lengths, out=offsets[1:])
    data = np.concatenate(datas) if len(datas) > 1 else datas[0]
    return pa.BinaryArray.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


#: Runs of at least this many rows are built from a kept template (``_run_template``).
_TEMPLATE_MIN_ROWS = 32
_TEMPLATES: dict[tuple[int, int, int, int], tuple[Any, Any, Any]] = {}
_TEMPLATES_MAX = 256


def _run_template(first: int, rows: int, size: int, prefix: int) -> tuple[Any, Any, Any]:
    """For a run of ``rows`` rows from batch index ``first`` (-1: not batched) of a batch of
    ``size`` whose ids start with ``prefix`` bytes: the gather index that lays out every row's
    id from ``prefix bytes + suffixes``, the suffixes (batch index and size fields of each row,
    concatenated) and each row's id length."""
    key = (first, rows, size, prefix)
    got = _TEMPLATES.get(key)
    if got is not None:
        return got
    if first >= 0:
        suffixes, suffix_lengths = _ids_by_columns([(0, 0, first, rows, size)], -1, prefix=False)
    else:
        suffixes, suffix_lengths = np.zeros(0, np.uint8), np.zeros(rows, np.int64)
    row_lengths = suffix_lengths + prefix
    starts = np.zeros(rows, np.int64)
    np.cumsum(row_lengths[:-1], out=starts[1:])
    suffix_starts = starts - np.arange(rows) * prefix  # where each row's suffix starts in them
    row = np.repeat(np.arange(rows), row_lengths)
    within = np.arange(int(row_lengths.sum())) - starts[row]
    gather = np.where(within < prefix, within, suffix_starts[row] + within).astype(np.intp)
    got = (gather, suffixes, row_lengths)
    if len(_TEMPLATES) >= _TEMPLATES_MAX:
        _TEMPLATES.clear()
    _TEMPLATES[key] = got
    return got


def _ids_by_columns(
    id_runs: Sequence[tuple[int, int, int, int, int]], partition: int, *, prefix: bool = True
) -> tuple[Any, Any]:
    """The ids of ``id_runs`` built column by column: their bytes (uint8) and each one's
    length. Without ``prefix``, only the batch index and size fields of each row."""
    runs = np.array(id_runs, np.int64).reshape(-1, 5)
    counts = runs[:, 3]
    n = int(counts.sum())
    within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
    first = np.repeat(runs[:, 2], counts)
    batched = first >= 0
    batch = np.where(batched, first + within, 0)
    size = np.where(batched, np.repeat(runs[:, 4], counts), 0)
    everyone = np.ones(n, bool)
    cols: list[Any] = []
    masks: list[Any] = []

    def tag(byte: int, keep: Any) -> None:
        cols.append(np.full(n, byte, np.uint8))
        masks.append(keep)

    def varint(v: Any, keep: Any) -> None:
        c, m = _varint_columns(v, keep)
        cols.extend(c)
        masks.extend(m)

    if prefix:
        tag(0x08, everyone)
        varint(np.repeat(runs[:, 0], counts), everyone)
        tag(0x10, everyone)
        varint(np.repeat(runs[:, 1], counts), everyone)
        if partition >= 0:
            tag(0x18, everyone)
            varint(np.full(n, partition, np.int64), everyone)
    tag(0x20, batched)
    varint(batch, batched)
    tag(0x30, batched)
    varint(size, batched)
    matrix = np.stack(cols, axis=1)
    mask = np.stack(masks, axis=1)
    return matrix[mask], mask.sum(axis=1)


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, (n >> 7) & 0x7F | 0x80, n >> 14))
    return _varint(n)


def _strided(body: bytes, n: int, stride: int, fixed: int, width: int, skip: int) -> Any:
    """The payloads of ``n`` messages of ``stride`` bytes each (``body[skip:stride]`` of each,
    an ``n x (stride - skip)`` matrix) if every message has the first one's ``fixed`` bytes and
    then a ``width``-byte varint; None otherwise."""
    rows = np.frombuffer(body, dtype=np.uint8).reshape(n, stride)
    if not (rows[:, :fixed] == rows[0, :fixed]).all():
        return None
    if width > 1 and not (rows[:, fixed : fixed + width - 1] >= 0x80).all():
        return None
    if not (rows[:, fixed + width - 1] < 0x80).all():
        return None
    return rows[:, skip:]


def _uniform(body: bytes, n: int, seq: int, cache: _SingleCache) -> tuple[Any, _Single] | None:
    """A whole batch at once when every message is the first one's shape: the same
    SingleMetadata but for a sequence id of the same width, and the same payload size. Checked
    byte for byte; the payloads (an ``n x size`` matrix) and the shared fields, or None."""
    if n < 2 or len(body) < 4:
        return None
    (size,) = _U32.unpack_from(body, 0)
    raw = body[4 : 4 + size]
    seq_field = _SEQ_TAG + _uvarint(seq)
    if len(raw) != size or not raw.endswith(seq_field):
        return None
    info = cache.parse(raw, seq)
    head = raw[: -len(seq_field)]
    if cache.known(head) is not info:
        return None  # the prefix did not parse alone to the same fields: not cached
    width = len(seq_field) - 1
    stride = 4 + size + info[1]
    if n * stride != len(body):
        return None
    payloads = _strided(body, n, stride, 4 + len(head) + 1, width, 4 + size)
    return None if payloads is None else (payloads, info)


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


def _pulsar_batch(
    md: Any, payload: bytes, lo: int, hi: int, ledger: int, entry: int, out: Columns
) -> None:
    """Messages ``lo..hi-1`` of a Pulsar batch (the common case, fast)."""
    n = md.num_messages_in_batch
    body = messages.decompress(
        md.compression, md.uncompressed_size, payload, messages.DEFAULT_MAX_SIZE
    )
    if n < 0 or n > len(body) // 4 + 1:
        raise messages.MessageFormatError(f"batch claims {n} messages in {len(body)} bytes")
    cache = _SingleCache(int(md.event_time))
    seq = int(md.sequence_id)
    pub = int(md.publish_time) * _US
    count = max(0, min(hi, n))
    if lo == 0 and count == n:
        whole = _uniform(body, n, seq, cache)
        if whole is not None:
            payloads, (key, _, prop, event) = whole
            out.n += n
            out.runs.append(n)
            out.keys.append(key)
            out.pubs.append(pub)
            out.events.append(event)
            out.props.append(prop)
            out.id_runs.append((ledger, entry, 0, n, n))
            out.chunks.append(payloads)
            return
    known = cache.known
    parse = cache.parse
    unpack = _U32.unpack_from
    runs, keys, events, props = out.runs, out.keys, out.events, out.props
    values: list[bytes] = []
    last: _Single | None = None
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
        if info is None:
            info = parse(raw, s)
        length = info[1]
        if length < 0 or length > end - pos:
            raise messages.MessageFormatError("message payload runs past the batch")
        if i >= lo:
            values.append(body[pos : pos + length])
            if info is last:
                runs[-1] += 1
            else:
                last = info
                key, _, prop, event = info
                runs.append(1)
                keys.append(key)
                out.pubs.append(pub)
                events.append(event)
                props.append(prop)
        pos += length
    if values:
        out.n += len(values)
        out.chunks.append(values)
        out.id_runs.append((ledger, entry, lo, len(values), n))


def entry_columns(
    ledger: int,
    entry: int,
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
    md, payload = messages.split_entry(body)
    if (
        md.HasField("num_messages_in_batch")
        and messages.entry_format(body) == messages.PULSAR_FORMAT
    ):
        _pulsar_batch(md, payload, lo, hi, ledger, entry, out)
        return
    decoded, batched = _decode(body)
    n = len(decoded)
    values: list[bytes] = []
    for i, m in enumerate(decoded):
        b = i if batched else -1
        pos = (ledger, entry, b)
        if pos < start or pos >= end:
            continue
        out.runs.append(1)
        out.keys.append(m.key or None)
        values.append(m.payload)
        out.id_runs.append((ledger, entry, b, 1, n))
        out.pubs.append(m.publish_time_ms * _US)
        out.events.append(m.event_time_ms * _US if m.event_time_ms else None)
        out.props.append(sorted(dict(m.properties).items()) if m.properties else [])
    out.n += len(values)
    out.chunks.append(values)


def entry_rows(
    ledger: int, entry: int, partition: int, data: bytes, start: Boundary, end: Boundary
) -> list[Row]:
    """``entry_columns`` as a list of rows."""
    out = Columns()
    entry_columns(ledger, entry, data, start, end, out)
    return out.rows(partition)


def read_rows(
    rng: ReadRange,
    layouts: Sequence[LedgerLayout],
    ledgers: Sequence[tuple[int, int]],
    reader: DirectLedgerReader,
    stop: list[Stop],
) -> Iterator[Columns]:
    """Yield the rows of ``rng`` entry by entry, read from the bookies.

    ``ledgers`` are the ``(ledger id, entries)`` of the ledgers the range covers (entries that
    can no longer change: ``DirectLedgerReader``'s Rule 1). If an
    entry cannot be read or decoded, append a ``Stop`` to ``stop`` and return: the caller reads
    from ``Stop.resume`` on through the broker."""
    by_id = {layout.ledger_id: layout for layout in layouts}
    for ledger, first, stop_entry in entries_between(ledgers, rng.start, rng.end):
        layout = by_id.get(ledger)
        if layout is None:
            stop.append(Stop(max(rng.start, (ledger, first, -1)), f"no layout of ledger {ledger}"))
            return
        expected = first
        try:
            for entry, data in reader.read(layout, first, stop_entry - 1):
                out = Columns()
                entry_columns(ledger, entry, data, rng.start, rng.end, out)
                expected = entry + 1
                yield out
        except (DirectReadError, messages.MessageFormatError, entry_format.EntryFormatError) as e:
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
        except struct.error as e:  # pragma: no cover - the decoders bound their reads
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
