"""Executor side of a read: one ``ReadRange`` through a Pulsar reader, as Arrow record batches."""

from __future__ import annotations

import logging
import uuid
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from polybroker.ledger.direct import DirectLedgerReader, LedgerLayout
from polybroker.spark.offsets import Boundary, ReadRange, format_boundary
from polybroker.spark.storage import Columns, Stop, read_rows

log = logging.getLogger(__name__)

#: Rows per Arrow record batch handed to Spark.
BATCH_ROWS = 10_000


class DataLossError(RuntimeError):
    """Messages that the planned range promised could not be read."""


def arrow_schema(typed: Sequence[Any] = ()) -> Any:
    """The Arrow form of the fixed columns (``polybroker.spark.source.READ_SCHEMA``), then of
    the ``typed`` Spark fields."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("__topic", pa.string()),
            ("__messageId", pa.binary()),
            ("__publishTime", ts),
            ("__eventTime", ts),
            ("__messageProperties", pa.map_(pa.string(), pa.string())),
            *((f.name, to_arrow_type(f.dataType, timezone="UTC")) for f in typed),
        ]
    )


def client(service_url: str) -> Any:
    """A Pulsar client logging errors only, from C++ (no Python called from its threads)."""
    import pulsar

    return pulsar.Client(
        service_url,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        operation_timeout_seconds=30,
    )


def _start_id(rng: ReadRange) -> tuple[Any, bool]:
    import pulsar

    partition = _partition_index(rng.topic)
    if rng.start[0] < 0:
        return pulsar.MessageId.earliest, False
    return pulsar.MessageId(partition, rng.start[0], rng.start[1], -1), True


def _partition_index(topic: str) -> int:
    _, sep, tail = topic.rpartition("-partition-")
    return int(tail) if sep and tail.isdigit() else -1


def read_messages(
    service_url: str, rng: ReadRange, *, fail_on_data_loss: bool, timeout_ms: int = 30_000
) -> Iterator[tuple[Any, Any]]:
    """Yield ``(message, message id)`` for each message of ``rng``, in order.

    The reader starts at the range's first entry and stops at the first message at or past
    ``rng.end``, or once the last planned entry is read and nothing more is stored. Raise
    DataLossError when a planned message does not come (with ``fail_on_data_loss``).

    The messages are the client's C++ binding objects (``pulsar.Message`` minus its pure-Python
    wrapper, which costs a third of the read time): data(), partition_key(), properties(),
    publish_timestamp(), event_timestamp() and message_id() have the same meaning.
    """
    c = client(service_url)
    try:
        start_id, inclusive = _start_id(rng)
        # A subscription name of our own: the client draws its random reader names from a
        # generator that Spark's forked Python workers share, so two workers reading one topic
        # partition would otherwise collide (ConsumerBusy).
        reader = c.create_reader(
            rng.topic,
            start_id,
            start_message_id_inclusive=inclusive,
            receiver_queue_size=5000,
            subscription_role_prefix=f"spark-{uuid.uuid4().hex}",
        )
        # The binding's reader, when this client version has it; else the public wrapper.
        raw = getattr(reader, "_reader", None)
        read_next = raw.read_next if raw is not None else reader.read_next
        unwrap = raw is None
        start, end, last = rng.start, rng.end, rng.last_entry
        while True:
            try:
                msg = read_next(timeout_ms)
            except Exception as e:  # the client raises pulsar.Timeout (and others) here
                if fail_on_data_loss:
                    raise DataLossError(
                        f"{rng.topic}: no message within {timeout_ms} ms before {rng.end}"
                    ) from e
                return
            if unwrap:
                msg = msg._message
            mid = msg.message_id()
            pos: Boundary = (mid.ledger_id(), mid.entry_id(), mid.batch_index())
            if pos >= end:
                return
            if pos >= start:
                yield msg, mid
            if (pos[0], pos[1]) >= last and not reader.has_message_available():
                return
    finally:
        c.close()


class _Batches:
    """Collects rows column by column and cuts them into Arrow record batches."""

    def __init__(self, topic: str, typed: Sequence[Any], batch_rows: int) -> None:
        self.topic = topic
        self.schema = arrow_schema(typed)
        self.fields = list(typed)
        self.batch_rows = batch_rows
        self.cols = Columns()
        # The values, in order: lists of bytes, or (blob, width, count) of uniform batches.
        self.pieces: list[list[bytes] | tuple[bytes, int, int]] = []

    def add(self, cols: Columns) -> Any:
        """Add rows; a full batch or None."""
        c = self.cols
        c.keys += cols.keys
        c.ids += cols.ids
        c.pubs += cols.pubs
        c.events += cols.events
        c.props += cols.props
        if cols.blob is not None:
            self.pieces.append((cols.blob, cols.width, len(cols)))
        elif cols.values:
            self.pieces.append(list(cols.values))
        return self.flush() if len(c) >= self.batch_rows else None

    def _values(self) -> Any:
        import pyarrow as pa

        pieces, self.pieces = self.pieces, []
        if pieces and all(isinstance(p, tuple) for p in pieces):
            offsets = array("i")
            pos = 0
            for _, w, n in pieces:  # type: ignore[misc]
                offsets.extend(range(pos, pos + w * n, w))
                pos += w * n
            offsets.append(pos)
            data = b"".join(p[0] for p in pieces)  # type: ignore[misc]
            return pa.BinaryArray.from_buffers(
                pa.binary(), len(offsets) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
            )
        values: list[bytes] = []
        for p in pieces:
            if isinstance(p, list):
                values += p
            else:
                blob, w, n = p
                values += [blob[i : i + w] for i in range(0, w * n, w)]
        return pa.array(values, pa.binary())

    def flush(self) -> Any:
        """The rows collected so far as one record batch (None if there are none)."""
        import pyarrow as pa

        c, self.cols = self.cols, Columns()
        n = len(c)
        if not n:
            return None
        schema = self.schema
        values = self._values()
        extra: list[list[Any]] = [[] for _ in self.fields]
        if self.fields:
            from polybroker.spark.typed import extract

            for value in values.to_pylist():
                for column, v in zip(extra, extract(value, self.fields), strict=True):
                    column.append(v)
        if any(c.props):
            props = pa.array(c.props, type=schema.field("__messageProperties").type)
        else:
            offsets = pa.py_buffer(bytes(4 * (n + 1)))
            props = pa.MapArray.from_arrays(
                pa.Array.from_buffers(pa.int32(), n + 1, [None, offsets]),
                pa.array([], pa.string()),
                pa.array([], pa.string()),
            )
        arrays = [
            pa.array(c.keys, pa.binary()),
            values,
            pa.repeat(pa.scalar(self.topic, pa.string()), n),
            pa.array(c.ids, pa.binary()),
            pa.array(c.pubs, schema.field("__publishTime").type),
            pa.array(c.events, schema.field("__eventTime").type),
            props,
            *(pa.array(v, type=f.type) for v, f in zip(extra, list(schema)[7:], strict=True)),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)


def read_batches(
    service_url: str,
    rng: ReadRange,
    *,
    fail_on_data_loss: bool,
    batch_rows: int = BATCH_ROWS,
    timeout_ms: int = 30_000,
    typed: Sequence[Any] = (),
    layouts: Sequence[LedgerLayout] = (),
    ledgers: Sequence[tuple[int, int]] = (),
) -> Iterator[Any]:
    """Yield ``rng``'s rows as Arrow record batches: the fixed columns, then the ``typed``
    fields (Spark StructFields) taken from each JSON value (``polybroker.spark.typed``).

    With ``layouts`` (of the sealed ledgers ``ledgers`` the range lies in) the rows are read
    from the bookies (``polybroker.spark.storage``); where that stops, the rest comes through
    the broker."""
    out = _Batches(rng.topic, typed, batch_rows)
    if layouts:
        stops: list[Stop] = []
        with DirectLedgerReader(timeout=timeout_ms / 1000) as reader:
            for cols in read_rows(rng, layouts, ledgers, reader, stops):
                batch = out.add(cols)
                if batch is not None:
                    yield batch
        if not stops:
            batch = out.flush()
            if batch is not None:
                yield batch
            return
        log.warning(
            "%s: reading on through the broker from %s: %s",
            rng.topic,
            format_boundary(stops[0].resume),
            stops[0].reason,
        )
        rng = replace(rng, start=stops[0].resume)
    one = Columns()
    keys, values, ids, pubs, events, props = (
        one.keys,
        one.values,
        one.ids,
        one.pubs,
        one.events,
        one.props,
    )
    for msg, mid in read_messages(
        service_url, rng, fail_on_data_loss=fail_on_data_loss, timeout_ms=timeout_ms
    ):
        key = msg.partition_key()
        event = msg.event_timestamp()
        p = msg.properties()
        keys.append(key.encode() if key else None)
        values.append(msg.data())
        ids.append(mid.serialize())
        pubs.append(msg.publish_timestamp() * 1000)
        events.append(event * 1000 if event else None)
        props.append(list(p.items()) if p else [])
        if len(values) >= 1000:
            batch = out.add(one)
            for column in (keys, values, ids, pubs, events, props):
                column.clear()
            if batch is not None:
                yield batch
    out.add(one)
    batch = out.flush()
    if batch is not None:
        yield batch
