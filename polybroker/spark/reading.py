"""Executor side of a read: one ``ReadRange`` through a Pulsar reader, as Arrow record batches."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from polybroker.ledger.direct import DirectLedgerReader, LedgerLayout
from polybroker.spark.offsets import Boundary, ReadRange, format_boundary
from polybroker.spark.storage import Row, Stop, read_rows

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
        self.extra: list[list[Any]] = [[] for _ in self.fields]
        self.keys: list[bytes | None] = []
        self.values: list[bytes] = []
        self.ids: list[bytes] = []
        self.pubs: list[int] = []
        self.events: list[int | None] = []
        self.props: list[list[tuple[str, str]]] = []

    def add_rows(self, rows: Sequence[Row]) -> Any:
        """Add rows ``(key, value, id, publish us, event us, properties)``; a full batch or None."""
        for key, value, mid, pub, event, props in rows:
            self.keys.append(key)
            self.values.append(value)
            self.ids.append(mid)
            self.pubs.append(pub)
            self.events.append(event)
            self.props.append(props)
        if self.fields:
            from polybroker.spark.typed import extract

            for row in rows:
                for column, v in zip(self.extra, extract(row[1], self.fields), strict=True):
                    column.append(v)
        return self.flush() if len(self.values) >= self.batch_rows else None

    def flush(self) -> Any:
        """The rows collected so far as one record batch (None if there are none)."""
        import pyarrow as pa

        n = len(self.values)
        if not n:
            return None
        arrays = [
            self.keys,
            self.values,
            [self.topic] * n,
            self.ids,
            self.pubs,
            self.events,
            self.props,
            *self.extra,
        ]
        batch = pa.RecordBatch.from_arrays(
            [pa.array(c, type=f.type) for c, f in zip(arrays, self.schema, strict=True)],
            schema=self.schema,
        )
        for c in (self.keys, self.values, self.ids, self.pubs, self.events, self.props):
            c.clear()
        for c in self.extra:
            c.clear()
        return batch


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
            for rows in read_rows(rng, layouts, ledgers, reader, stops):
                batch = out.add_rows(rows)
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
    row: list[Row] = [None]  # type: ignore[list-item]
    for msg, mid in read_messages(
        service_url, rng, fail_on_data_loss=fail_on_data_loss, timeout_ms=timeout_ms
    ):
        key = msg.partition_key()
        event = msg.event_timestamp()
        p = msg.properties()
        row[0] = (
            key.encode() if key else None,
            msg.data(),
            mid.serialize(),
            msg.publish_timestamp() * 1000,
            event * 1000 if event else None,
            list(p.items()) if p else [],
        )
        batch = out.add_rows(row)
        if batch is not None:
            yield batch
    batch = out.flush()
    if batch is not None:
        yield batch
