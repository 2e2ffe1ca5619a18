"""The ``pulsar`` Python data source: batch and streaming readers and writers.

Option names follow the StreamNative pulsar-spark connector: ``service.url``, ``admin.url``,
``topic`` / ``topics`` / ``topicsPattern``, ``startingOffsets``, ``endingOffsets``,
``failOnDataLoss``, ``maxEntriesPerTrigger``; plus ``maxEntriesPerPartition`` and, as Spark's
Kafka source names it, ``minPartitions`` (default: the driver's CPU count): how large backlogs are
split; ``readFromStorage`` (default true: what storage holds of a backlog, the sealed ledgers and
the open one up to its last add confirmed, is read straight from the bookies,
``polybroker.spark.storage``) and, for writers, ``batchingMaxMessages``.

Where code runs: planning (topics, last ids, ledgers) on the driver through the admin REST API;
``read``/``write`` in executor workers through the Pulsar client. Everything a worker needs travels
in the pickled ``PulsarPartition`` or in the options, never in state set while planning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from polybroker.ledger.direct import LedgerLayout
from polybroker.spark import offsets as off
from polybroker.spark.admin import AdminError, PulsarAdmin
from polybroker.spark.typed import typed_fields
from polybroker.spark.writing import publish_rows

READ_SCHEMA = StructType(
    [
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("__topic", StringType(), True),
        StructField("__messageId", BinaryType(), True),
        StructField("__publishTime", TimestampType(), True),
        StructField("__eventTime", TimestampType(), True),
        StructField("__messageProperties", MapType(StringType(), StringType(), True), True),
    ]
)

DEFAULT_MAX_ENTRIES_PER_PARTITION = 50_000


class OptionError(ValueError):
    """A missing or invalid data source option."""


def _options(options: Any) -> dict[str, str]:
    """Spark's options with lower-case names: Spark hands them over case-insensitively."""
    return {str(k).lower(): str(v) for k, v in dict(options).items()}


def _flag(options: dict[str, str], name: str, default: bool) -> bool:
    value = str(options.get(name.lower(), default)).strip().lower()
    if value not in ("true", "false"):
        raise OptionError(f"{name} must be true or false, not {value!r}")
    return value == "true"


def _positive(options: dict[str, str], name: str, default: int | None) -> int | None:
    value = options.get(name.lower())
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        raise OptionError(f"{name} must be a positive integer, not {value!r}") from None
    if n <= 0:
        raise OptionError(f"{name} must be a positive integer, not {value!r}")
    return n


def _cores() -> int:
    """The CPUs this process may run on: the default ``minPartitions``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _deserialize(data: bytes) -> off.Boundary:
    import pulsar

    mid = pulsar.MessageId.deserialize(data)
    return (mid.ledger_id(), mid.entry_id(), mid.batch_index())


@dataclass
class PulsarPartition(InputPartition):
    """One range of one topic partition to read (pickled to the executor).

    With ``layouts`` the range lies in the sealed ledgers ``ledgers`` and is read from the
    bookies; without, through the broker."""

    rng: off.ReadRange
    layouts: tuple[LedgerLayout, ...] = ()
    ledgers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ReadConfig:
    """The reader options, checked once on the driver."""

    service_url: str
    admin_url: str
    topic: str | None
    topics: tuple[str, ...]
    pattern: str | None
    fail_on_data_loss: bool
    max_entries_per_partition: int
    max_entries_per_trigger: int | None
    typed: tuple[StructField, ...] = ()
    read_from_storage: bool = True
    min_partitions: int = 1

    @classmethod
    def of(cls, options: dict[str, str], schema: StructType | None = None) -> ReadConfig:
        service = options.get("service.url")
        admin = options.get("admin.url")
        if not service or not admin:
            raise OptionError("the pulsar source needs the service.url and admin.url options")
        topic = options.get("topic")
        topics = tuple(t.strip() for t in options.get("topics", "").split(",") if t.strip())
        pattern = options.get("topicspattern")
        if sum(x is not None and x != () for x in (topic, topics or None, pattern)) != 1:
            raise OptionError("set exactly one of topic, topics and topicsPattern")
        return cls(
            service_url=service,
            admin_url=admin,
            topic=topic,
            topics=topics,
            pattern=pattern,
            fail_on_data_loss=_flag(options, "failOnDataLoss", True),
            max_entries_per_partition=_positive(
                options, "maxEntriesPerPartition", DEFAULT_MAX_ENTRIES_PER_PARTITION
            )
            or DEFAULT_MAX_ENTRIES_PER_PARTITION,
            max_entries_per_trigger=_positive(options, "maxEntriesPerTrigger", None),
            typed=tuple(schema.fields[len(READ_SCHEMA.fields) :]) if schema else (),
            read_from_storage=_flag(options, "readFromStorage", True),
            min_partitions=_positive(options, "minPartitions", _cores()) or 1,
        )

    def admin(self) -> PulsarAdmin:
        return PulsarAdmin(self.admin_url)

    def topic_partitions(self, admin: PulsarAdmin) -> list[str]:
        """Every topic partition the options name, sorted."""
        if self.pattern is not None:
            return admin.matching(self.pattern)
        names = [self.topic] if self.topic else list(self.topics)
        return sorted({p for name in names if name for p in admin.partitions(name)})


def _entries(ledgers: Sequence[tuple[int, int]], start: off.Boundary, end: off.Boundary) -> int:
    return sum(stop - first for _, first, stop in off.entries_between(ledgers, start, end))


def plan(
    cfg: ReadConfig,
    admin: PulsarAdmin,
    starts: dict[str, off.Boundary],
    ends: dict[str, off.Boundary],
) -> list[PulsarPartition]:
    """Split every topic partition's ``[start, end)`` into read ranges (driver side).

    What storage holds (``PulsarAdmin.storage``) is planned for reads from the bookies, the rest
    through the broker. Ranges hold at most ``maxEntriesPerPartition`` entries, and the read is
    cut into at least ``minPartitions`` ranges of about equal size when it has that many
    entries, so every core of the cluster gets a share."""
    pieces: list[tuple[str, off.Boundary, off.Boundary, list[tuple[int, int]], Any]] = []
    for topic in sorted(ends):
        start, end = starts.get(topic, off.EARLIEST), ends[topic]
        if start >= end:
            continue
        if cfg.read_from_storage:
            ledgers, layouts, cut = admin.storage(topic)
        else:
            ledgers, layouts, cut = admin.ledgers(topic), {}, off.EARLIEST
        if off.first_lost(ledgers, start):
            if cfg.fail_on_data_loss:
                raise off.OffsetError(
                    f"{topic}: messages from {off.format_boundary(start)} are no longer stored "
                    "(set failOnDataLoss=false to skip them)"
                )
            start = off.EARLIEST
        # What storage holds straight from the bookies; the rest through the broker.
        if start < cut:
            pieces.append((topic, start, min(end, cut), ledgers, layouts))
            start = max(start, cut)
        if start < end:
            pieces.append((topic, start, end, ledgers, None))
    counts = [_entries(p[3], p[1], p[2]) for p in pieces]
    total = sum(counts)
    parts = []
    for (topic, start, end, ledgers, layouts), count in zip(pieces, counts, strict=True):
        share = max(1, math.ceil(cfg.min_partitions * count / total)) if total else 1
        size = max(1, min(cfg.max_entries_per_partition, math.ceil(count / share)))
        for rng in off.split_range(topic, ledgers, start, end, size):
            if layouts is None:
                parts.append(PulsarPartition(rng))
                continue
            ids = [seg[0] for seg in off.entries_between(ledgers, rng.start, rng.end)]
            parts.append(
                PulsarPartition(
                    rng,
                    tuple(layouts[i] for i in ids),
                    tuple(x for x in ledgers if x[0] in ids),
                )
            )
    return parts


def _read(cfg: ReadConfig, partition: InputPartition) -> Iterator[Any]:
    """A partition's rows as Arrow record batches (executor side)."""
    # Imported here: the driver's planning processes need none of it (nor numpy).
    from polybroker.spark.reading import read_batches

    assert isinstance(partition, PulsarPartition)
    return read_batches(
        cfg.service_url,
        partition.rng,
        fail_on_data_loss=cfg.fail_on_data_loss,
        typed=cfg.typed,
        layouts=partition.layouts,
        ledgers=partition.ledgers,
    )


class PulsarBatchReader(DataSourceReader):
    """Reads ``[startingOffsets, endingOffsets)`` of every named topic partition."""

    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.cfg = ReadConfig.of(options, schema)
        self.starting = off.parse_offset_spec(options.get("startingoffsets"), "earliest")
        self.ending = off.parse_offset_spec(options.get("endingoffsets"), "latest")
        if self.starting.kind == "latest":
            raise OptionError("startingOffsets=latest makes no sense for a batch query")
        if self.ending.kind == "earliest":
            raise OptionError("endingOffsets=earliest makes no sense for a batch query")

    def partitions(self) -> Sequence[InputPartition]:
        admin = self.cfg.admin()
        topics = self.cfg.topic_partitions(admin)
        starts = {
            t: self.starting.resolve(t, admin.last_boundary, _deserialize, missing="earliest")
            for t in topics
        }
        ends = {
            t: self.ending.resolve(t, admin.last_boundary, _deserialize, missing="latest")
            for t in topics
        }
        return plan(self.cfg, admin, starts, ends)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition)


class PulsarStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over offsets ``{topic partition: "ledger:entry:batch"}``.

    An offset is a boundary per topic partition; batch ``n`` reads ``[offset n-1, offset n)``,
    so restarting from a checkpoint neither loses nor repeats rows. Topic partitions that appear
    later are read from their start.
    """

    def __init__(self, options: dict[str, str], schema: StructType | None = None) -> None:
        self.cfg = ReadConfig.of(options, schema)
        self.starting = off.parse_offset_spec(options.get("startingoffsets"), "latest")
        self.target: dict[str, off.Boundary] | None = None
        self.initial: dict[str, str] | None = None

    def _latest(self, admin: PulsarAdmin) -> dict[str, off.Boundary]:
        return {t: admin.last_boundary(t) for t in self.cfg.topic_partitions(admin)}

    def initialOffset(self) -> dict:
        """The start of a query with no checkpoint, resolved once (Spark asks more than once
        while starting the query: ``startingOffsets=latest`` gives every call the same
        answer, and the later calls cost no admin requests)."""
        if self.initial is None:
            admin = self.cfg.admin()
            self.initial = off.dumps_offsets(
                {
                    t: self.starting.resolve(
                        t, admin.last_boundary, _deserialize, missing="earliest"
                    )
                    for t in self.cfg.topic_partitions(admin)
                }
            )
        return dict(self.initial)

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._latest(self.cfg.admin())

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.cfg.max_entries_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        admin = self.cfg.admin()
        begin = off.loads_offsets(start)
        latest = self._latest(admin) if self.target is None else dict(self.target)
        for t, b in begin.items():
            # A topic partition no longer listed keeps its offset.
            latest.setdefault(t, b)
        end = {t: max(latest[t], begin.get(t, off.EARLIEST)) for t in latest}
        if isinstance(limit, ReadMaxRows):
            # maxEntriesPerTrigger counts entries (a batch is one entry), shared in topic order.
            budget = limit.max_rows
            for t in sorted(end):
                s = begin.get(t, off.EARLIEST)
                if budget <= 0:
                    end[t] = s
                    continue
                if s >= end[t]:
                    continue
                ledgers = admin.ledgers(t)
                end[t] = off.advance(ledgers, s, end[t], budget)
                budget -= sum(r.entries for r in off.split_range(t, ledgers, s, end[t], 1 << 62))
        return off.dumps_offsets(end)

    def reportLatestOffset(self) -> dict | None:
        return off.dumps_offsets(self._latest(self.cfg.admin()))

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return plan(self.cfg, self.cfg.admin(), off.loads_offsets(start), off.loads_offsets(end))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition)

    def commit(self, end: dict) -> None:
        """Nothing to do: offsets live in Spark's checkpoint, the broker keeps no cursor."""


@dataclass
class PublishedCount(WriterCommitMessage):
    """How many messages one task published and saw acknowledged."""

    count: int


class _Publisher:
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        service = options.get("service.url")
        if not service:
            raise OptionError("the pulsar sink needs the service.url option")
        self.service_url = service
        self.topic = options.get("topic")
        self.columns = [f.name for f in schema.fields]
        if "value" not in self.columns:
            raise OptionError("the DataFrame written to pulsar needs a value column")
        if not self.topic and "__topic" not in self.columns:
            raise OptionError("set the topic option or give the DataFrame a __topic column")
        self.batching = _positive(options, "batchingMaxMessages", 1000) or 1000

    def write(self, iterator: Iterator[Any]) -> PublishedCount:
        return PublishedCount(
            publish_rows(
                self.service_url,
                self.columns,
                iterator,
                topic=self.topic,
                batching_max_messages=self.batching,
            )
        )


class PulsarBatchWriter(_Publisher, DataSourceWriter):
    """``df.write.format("pulsar").mode("append")``: each task publishes its rows."""


class PulsarStreamWriter(_Publisher, DataSourceStreamWriter):
    """``writeStream.format("pulsar")``: at-least-once (a retried batch is published again)."""

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: every message was acknowledged before its task returned."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Published messages cannot be withdrawn; the retried batch publishes again."""


class PulsarDataSource(DataSource):
    """``format("pulsar")``: read and write topics of a Pulsar-protocol broker."""

    @classmethod
    def name(cls) -> str:
        return "pulsar"

    def schema(self) -> StructType:
        """The fixed columns, then typed ones when the (first) topic has a JSON schema."""
        options = _options(self.options)
        try:
            cfg = ReadConfig.of(options)
            admin = cfg.admin()
            topics = cfg.topic_partitions(admin)
            info = admin.schema(topics[0]) if topics else None
        except (OptionError, AdminError, off.OffsetError):
            # Reported where it matters: planning a read raises the same error.
            return READ_SCHEMA
        taken = {f.name for f in READ_SCHEMA.fields}
        return StructType([*READ_SCHEMA.fields, *typed_fields(info, taken)])

    def reader(self, schema: StructType) -> DataSourceReader:
        return PulsarBatchReader(_options(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return PulsarStreamReader(_options(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise OptionError("topics are append-only: use mode('append')")
        return PulsarBatchWriter(_options(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return PulsarStreamWriter(_options(self.options), schema)
