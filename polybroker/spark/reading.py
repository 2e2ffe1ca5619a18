"""Executor side of a read: one ``ReadRange`` through a Pulsar reader, as Arrow record batches."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from polybroker.ledger.direct import DirectLedgerReader, LedgerLayout
from polybroker.spark.offsets import Boundary, ReadRange, format_boundary
from polybroker.spark.storage import Columns, Stop, partition_index, read_rows

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
    """Collects rows (``storage.Columns``) and cuts them into Arrow record batches."""

    def __init__(self, topic: str, typed: Sequence[Any], batch_rows: int) -> None:
        self.topic = topic
        self.partition = partition_index(topic)
        self.schema = arrow_schema(typed)
        self.fields = list(typed)
        self.batch_rows = batch_rows
        self.cols = Columns()

    def add(self, cols: Columns) -> Any:
        """Add rows; a full batch or None."""
        self.cols.extend(cols)
        return self.flush() if len(self.cols) >= self.batch_rows else None

    def flush(self) -> Any:
        """The rows collected so far as one record batch (None if there are none)."""
        import pyarrow as pa

        c, self.cols = self.cols, Columns()
        n = len(c)
        if not n:
            return None
        schema = self.schema
        ts = schema.field("__publishTime").type
        key, value, mid, pub, event, props = c.arrays(
            self.partition, ts, schema.field("__messageProperties").type
        )
        extra: list[list[Any]] = [[] for _ in self.fields]
        if self.fields:
            from polybroker.spark.typed import extract

            for v in value.to_pylist():
                for column, x in zip(extra, extract(v, self.fields), strict=True):
                    column.append(x)
        arrays = [
            key,
            value,
            pa.repeat(pa.scalar(self.topic, pa.string()), n),
            mid,
            pub,
            event,
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

    With ``layouts`` (of the ledgers ``ledgers`` the range lies in) the rows are read from
    the bookies (``polybroker.spark.storage``); where that stops, the rest comes through the
    broker."""
    out = _Batches(rng.topic, typed, batch_rows)
    if layouts:
        stops: list[Stop] = []
        with DirectLedgerReader(timeout=timeout_ms / 1000) as reader:
            for cols in read_rows(rng, layouts, ledgers, reader, stops):
                batch = out.add(cols)
                if batch is not None:
                    yield batch
        batch = out.flush()
        if batch is not None:
            yield batch
        if not stops:
            return
        log.warning(
            "%s: reading on through the broker from %s: %s",
            rng.topic,
            format_boundary(stops[0].resume),
            stops[0].reason,
        )
        rng = replace(rng, start=stops[0].resume)
    one = Columns()
    values: list[bytes] = []
    for msg, mid in read_messages(
        service_url, rng, fail_on_data_loss=fail_on_data_loss, timeout_ms=timeout_ms
    ):
        key = msg.partition_key()
        event = msg.event_timestamp()
        p = msg.properties()
        one.runs.append(1)
        one.keys.append(key.encode() if key else None)
        values.append(msg.data())
        one.raw_ids.append(mid.serialize())
        one.pubs.append(msg.publish_timestamp() * 1000)
        one.events.append(event * 1000 if event else None)
        one.props.append(list(p.items()) if p else [])
        if len(values) >= 1000:
            one.n = len(values)
            one.chunks.append(values)
            batch = out.add(one)
            one, values = Columns(), []
            if batch is not None:
                yield batch
    one.n = len(values)
    one.chunks.append(values)
    out.add(one)
    batch = out.flush()
    if batch is not None:
        yield batch
