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

import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from polybroker.broker_core import messages
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


def entry_rows(
    ledger: int, entry: int, partition: int, data: bytes, start: Boundary, end: Boundary
) -> list[Row]:
    """The rows of one stored entry (``entry_format`` header and message part) in
    ``[start, end)``; ``MessageFormatError``/``EntryFormatError`` if it cannot be decoded."""
    body = data[entry_format.HEADER_SIZE :]
    entry_format.decode_header(data)
    decoded, batched = _decode(body)
    n = len(decoded)
    rows: list[Row] = []
    for i, m in enumerate(decoded):
        b = i if batched else -1
        pos = (ledger, entry, b)
        if pos < start or pos >= end:
            continue
        props = sorted(dict(m.properties).items()) if m.properties else []
        rows.append(
            (
                m.key or None,
                m.payload,
                message_id_bytes(ledger, entry, partition, b, n),
                m.publish_time_ms * _US,
                m.event_time_ms * _US if m.event_time_ms else None,
                props,
            )
        )
    return rows


def read_rows(
    rng: ReadRange,
    layouts: Sequence[LedgerLayout],
    ledgers: Sequence[tuple[int, int]],
    reader: DirectLedgerReader,
    stop: list[Stop],
) -> Iterator[list[Row]]:
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
                rows = entry_rows(ledger, entry, partition, data, rng.start, rng.end)
                expected = entry + 1
                yield rows
        except (DirectReadError, messages.MessageFormatError, entry_format.EntryFormatError) as e:
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
        except struct.error as e:  # pragma: no cover - the decoders bound their reads
            stop.append(Stop(max(rng.start, (ledger, expected, -1)), str(e)))
            return
