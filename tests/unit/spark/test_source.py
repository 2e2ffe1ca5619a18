"""The data source's driver side over a fake admin API, and the writer over a fake client."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pulsar
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from polybroker.ledger.direct import LedgerLayout
from polybroker.spark import offsets as off
from polybroker.spark import reading, source
from polybroker.spark.source import OptionError, PulsarBatchReader, PulsarStreamReader, ReadConfig
from polybroker.spark.writing import PublishError, publish_rows

T = "persistent://public/default/t"


class FakeAdmin:
    """Topic partitions with ``(ledgerId, entries)`` lists; the last entry is the last id."""

    def __init__(self, ledgers: dict[str, list[tuple[int, int]]]) -> None:
        self.stored = ledgers

    def partitions(self, topic: str) -> list[str]:
        full = off.full_topic(topic)
        parts = sorted(t for t in self.stored if t.startswith(full + "-partition-"))
        return parts or [full]

    def matching(self, pattern: str) -> list[str]:
        return sorted(self.stored)

    def last_boundary(self, topic: str) -> off.Boundary:
        filled = [(lid, n) for lid, n in self.stored.get(topic, []) if n > 0]
        return off.after_last((filled[-1][0], filled[-1][1] - 1) if filled else None)

    def ledgers(self, topic: str) -> list[tuple[int, int]]:
        return list(self.stored.get(topic, []))

    #: Ledger ids told as sealed, with one bookie each.
    sealed: frozenset[int] = frozenset()

    #: The open ledger's last add confirmed, when told (with its layout).
    confirmed: tuple[int, int] | None = None

    def storage(
        self, topic: str
    ) -> tuple[list[tuple[int, int]], dict[int, LedgerLayout], off.Boundary]:
        ledgers = self.ledgers(topic)
        told = set(self.sealed) | ({self.confirmed[0]} if self.confirmed else set())
        layouts = {i: LedgerLayout(i, 1, 1, ((0, ("b:1",)),)) for i, _ in ledgers if i in told}
        return ledgers, layouts, off.readable_end(ledgers, self.sealed, self.confirmed)


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], FakeAdmin]:
    """Make every ReadConfig use one FakeAdmin of the given ledgers."""

    def install(ledgers: dict[str, Any]) -> FakeAdmin:
        fake = FakeAdmin(ledgers)
        monkeypatch.setattr(ReadConfig, "admin", lambda self: fake)
        return fake

    return install


def _options(**extra: str) -> dict[str, str]:
    base = {
        "service.url": "pulsar://x:1",
        "admin.url": "http://x:2",
        "topic": "t",
        "minPartitions": "1",
    }
    return {k.lower(): v for k, v in {**base, **extra}.items()}


def test_batch_plan_splits_each_partition(admin: Callable[..., FakeAdmin]) -> None:
    """Two partitions of 5 and 1 entries, 2 per range: 3 + 1 ranges covering everything."""
    admin({f"{T}-partition-0": [(1, 5)], f"{T}-partition-1": [(2, 1)]})
    parts = PulsarBatchReader(_options(maxEntriesPerPartition="2")).partitions()
    ranges = [p.rng for p in parts]  # type: ignore[attr-defined]
    assert [(r.topic[-1], r.entries) for r in ranges] == [("0", 2), ("0", 2), ("0", 1), ("1", 1)]
    assert ranges[2].end == (1, 5, -1)


def test_sealed_ledgers_are_planned_for_storage_reads_and_the_open_one_for_the_broker(
    admin: Callable[..., FakeAdmin],
) -> None:
    """Ranges end at the first open ledger; those before it carry their ledgers' layouts."""
    fake = admin({T: [(1, 3), (2, 2), (4, 3)]})
    fake.sealed = frozenset({1, 2})
    parts = PulsarBatchReader(_options(maxEntriesPerPartition="2")).partitions()
    got = [
        (p.rng.start, p.rng.end, [x.ledger_id for x in p.layouts], list(p.ledgers))  # type: ignore[attr-defined]
        for p in parts
    ]
    assert got == [
        (off.EARLIEST, (1, 2, -1), [1], [(1, 3)]),
        ((1, 2, -1), (2, 1, -1), [1, 2], [(1, 3), (2, 2)]),
        ((2, 1, -1), (4, 0, -1), [2], [(2, 2)]),
        ((4, 0, -1), (4, 2, -1), [], []),
        ((4, 2, -1), (4, 3, -1), [], []),
    ]
    # readFromStorage=false: the broker reads everything; a start past the sealed part too.
    off_parts = PulsarBatchReader(_options(readFromStorage="false")).partitions()
    assert [p.layouts for p in off_parts] == [()]  # type: ignore[attr-defined]
    late = PulsarBatchReader(_options(startingOffsets=json.dumps({T: "4:1"}))).partitions()
    assert [(p.rng.start, p.layouts) for p in late] == [((4, 1, -1), ())]  # type: ignore[attr-defined]
    # Every ledger sealed (an unloaded topic): all of it from storage.
    fake.sealed = frozenset({1, 2, 4})
    whole = PulsarBatchReader(_options()).partitions()
    assert [len(p.layouts) for p in whole] == [3]  # type: ignore[attr-defined]
    # An open ledger first (its predecessors trimmed): nothing from storage.
    fake.sealed = frozenset({2})
    assert off.sealed_end([(1, 3), (2, 2)], fake.sealed) == off.EARLIEST
    assert all(not p.layouts for p in PulsarBatchReader(_options()).partitions())  # type: ignore[attr-defined]


def test_the_open_ledger_is_read_from_storage_up_to_its_last_add_confirmed(
    admin: Callable[..., FakeAdmin],
) -> None:
    """Entries up to the open ledger's last add confirmed are as final as a sealed ledger's:
    planned for storage with its layout; any entry past it goes through the broker."""
    fake = admin({T: [(1, 3), (4, 3)]})
    fake.sealed = frozenset({1})
    fake.confirmed = (4, 1)
    parts = PulsarBatchReader(_options()).partitions()
    got = [(p.rng.start, p.rng.end, [x.ledger_id for x in p.layouts]) for p in parts]  # type: ignore[attr-defined]
    assert got == [(off.EARLIEST, (4, 2, -1), [1, 4]), ((4, 2, -1), (4, 3, -1), [])]
    assert off.readable_end([(1, 3), (4, 3)], {1}, (4, 2)) == (4, 3, -1)
    # Only the first open ledger counts; so does an open ledger with nothing confirmed.
    assert off.readable_end([(1, 3), (4, 3)], set(), (4, 2)) == off.EARLIEST
    assert off.readable_end([(4, 3)], set(), (4, 2)) == (4, 3, -1)
    assert off.readable_end([(1, 3), (4, 0)], {1}, (4, -1)) == (4, 0, -1)
    assert off.readable_end([(1, 3)], {1}, None) == (2, 0, -1)


def test_min_partitions_cuts_a_read_into_shares_of_about_equal_size(
    admin: Callable[..., FakeAdmin],
) -> None:
    """A backlog is cut into at least minPartitions ranges, shared between topic partitions by
    their size; maxEntriesPerPartition still caps each range; tiny reads stay whole."""
    admin({f"{T}-partition-0": [(1, 90)], f"{T}-partition-1": [(2, 30)]})

    def sizes(**extra: str) -> list[tuple[str, int]]:
        parts = PulsarBatchReader(_options(**extra)).partitions()
        return [(p.rng.topic[-1], p.rng.entries) for p in parts]  # type: ignore[attr-defined]

    assert sizes() == [("0", 90), ("1", 30)]
    assert sizes(minPartitions="4") == [("0", 30), ("0", 30), ("0", 30), ("1", 30)]
    # Shares round up: 3.75 and 1.25 of 5 become 4 and 2.
    assert sizes(minPartitions="5") == [
        ("0", 23),
        ("0", 23),
        ("0", 23),
        ("0", 21),
        ("1", 15),
        ("1", 15),
    ]
    assert sizes(minPartitions="2", maxEntriesPerPartition="40") == [
        ("0", 40),
        ("0", 40),
        ("0", 10),
        ("1", 30),
    ]
    admin({T: [(1, 1)]})
    assert sizes(minPartitions="8") == [("t", 1)]
    with pytest.raises(OptionError, match="positive"):
        ReadConfig.of(_options(minPartitions="0"))


def test_fail_on_data_loss_refuses_or_skips_a_trimmed_start(
    admin: Callable[..., FakeAdmin],
) -> None:
    """A start in a deleted ledger fails; with failOnDataLoss=false what is left is read."""
    admin({T: [(7, 3)]})
    start = json.dumps({T: "3:0"})
    with pytest.raises(off.OffsetError, match="no longer stored"):
        PulsarBatchReader(_options(startingOffsets=start)).partitions()
    parts = PulsarBatchReader(_options(startingOffsets=start, failOnDataLoss="false")).partitions()
    assert [p.rng.entries for p in parts] == [3]  # type: ignore[attr-defined]


def test_option_errors() -> None:
    """Missing URLs, several topic options, bad numbers and batch latest starts are refused."""
    with pytest.raises(OptionError, match=r"admin\.url"):
        ReadConfig.of({"service.url": "pulsar://x:1", "topic": "t"})
    with pytest.raises(OptionError, match="exactly one"):
        ReadConfig.of(_options(topics="a,b"))
    with pytest.raises(OptionError, match="positive"):
        ReadConfig.of(_options(maxentriesperpartition="0"))
    with pytest.raises(OptionError, match="true or false"):
        ReadConfig.of(_options(failondataloss="maybe"))
    with pytest.raises(OptionError, match="latest"):
        PulsarBatchReader(_options(startingOffsets="latest"))


def test_stream_offsets_limits_and_available_now(admin: Callable[..., FakeAdmin]) -> None:
    """maxEntriesPerTrigger bounds each batch; availableNow stops at the target it recorded."""
    fake = admin({T: [(1, 4), (2, 3)]})
    reader = PulsarStreamReader(_options(startingOffsets="earliest", maxEntriesPerTrigger="3"))
    start = reader.initialOffset()
    assert start == {T: "-1:-1:-1"}
    assert reader.getDefaultReadLimit() == ReadMaxRows(3)
    first = reader.latestOffset(start, ReadMaxRows(3))
    assert first == {T: "1:3:-1"}
    second = reader.latestOffset(first, ReadMaxRows(3))
    assert second == {T: "2:2:-1"}
    assert [p.rng.entries for p in reader.partitions(first, second)] == [3]  # type: ignore[attr-defined]
    assert reader.partitions(second, second) == []
    reader.prepareForTriggerAvailableNow()
    fake.stored[T] = [(1, 4), (2, 9)]  # written after the availableNow query started
    assert reader.latestOffset(second, ReadAllAvailable()) == {T: "2:3:-1"}
    # A new reader sees everything, and a topic partition appearing later starts at EARLIEST.
    fake.stored[T + "-x"] = [(5, 1)]
    fake.matching = lambda pattern: sorted(fake.stored)  # type: ignore[method-assign]
    pattern = PulsarStreamReader(
        {k: v for k, v in _options(topicsPattern="t.*").items() if k != "topic"}
    )
    assert pattern.latestOffset({T: "2:3:-1"}, ReadAllAvailable()) == {
        T: "2:9:-1",
        T + "-x": "5:1:-1",
    }


def test_stream_initial_offset_is_resolved_once(admin: Callable[..., FakeAdmin]) -> None:
    """startingOffsets=latest: Spark's repeated initialOffset calls while a query starts all get
    the first answer, even when messages arrive in between."""
    fake = admin({T: [(1, 4)]})
    reader = PulsarStreamReader(_options(startingOffsets="latest"))
    first = reader.initialOffset()
    assert first == {T: "1:4:-1"}
    fake.stored[T] = [(1, 6)]
    assert reader.initialOffset() == first
    assert PulsarStreamReader(_options(startingOffsets="latest")).initialOffset() == {T: "1:6:-1"}


class FakeProducer:
    """Acknowledges (or refuses) each send through the callback at flush()."""

    def __init__(self, sent: list[tuple[str, bytes, dict[str, Any]]], topic: str, fail: bool):
        self.sent, self.topic, self.fail = sent, topic, fail
        self.pending: list[Callable[[Any, Any], None]] = []
        self.closed = False

    def send_async(self, data: bytes, callback: Callable[[Any, Any], None], **kw: Any) -> None:
        self.sent.append((self.topic, data, kw))
        self.pending.append(callback)

    def flush(self) -> None:
        for cb in self.pending:
            cb(pulsar.Result.Timeout if self.fail else pulsar.Result.Ok, None)
        self.pending.clear()

    def close(self) -> None:
        self.closed = True


class FakeClient:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []
        self.fail = fail
        self.producers: list[FakeProducer] = []
        self.closed = False

    def create_producer(self, topic: str, **_kw: Any) -> FakeProducer:
        p = FakeProducer(self.sent, topic, self.fail)
        self.producers.append(p)
        return p

    def close(self) -> None:
        self.closed = True


def test_writer_publishes_rows_and_counts_acks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows go to their __topic with key, event time and properties; all acked, all closed."""
    fake = FakeClient()
    monkeypatch.setattr(reading, "client", lambda url: fake)
    rows = [("a", "k1", b"v1", 1234, {"p": 1}), ("b", None, "v2", None, None)]
    cols = ["__topic", "key", "value", "__eventTime", "__messageProperties"]
    assert publish_rows("pulsar://x:1", cols, rows, topic=None) == 2
    assert fake.sent == [
        (
            "persistent://public/default/a",
            b"v1",
            {"partition_key": "k1", "event_timestamp": 1234, "properties": {"p": "1"}},
        ),
        ("persistent://public/default/b", b"v2", {}),
    ]
    assert fake.closed
    assert all(p.closed for p in fake.producers)


def test_writer_fails_when_a_message_is_not_acknowledged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused send makes the task fail (Spark retries it) instead of returning a count."""
    fake = FakeClient(fail=True)
    monkeypatch.setattr(reading, "client", lambda url: fake)
    with pytest.raises(PublishError, match="Timeout"):
        publish_rows("pulsar://x:1", ["value"], [(b"v",)], topic="t")
    assert fake.closed
    with pytest.raises(PublishError, match="value"):
        publish_rows("pulsar://x:1", ["key"], [("k",)], topic="t")
    monkeypatch.setattr(reading, "client", lambda url: FakeClient())
    with pytest.raises(PublishError, match="null"):
        publish_rows("pulsar://x:1", ["value"], [(None,)], topic="t")


def test_data_source_schema_without_admin_is_the_fixed_columns() -> None:
    """Without admin.url the schema is the seven fixed columns."""
    ds = source.PulsarDataSource({"service.url": "pulsar://x:1", "topic": "t"})
    assert [f.name for f in ds.schema().fields] == [
        "key",
        "value",
        "__topic",
        "__messageId",
        "__publishTime",
        "__eventTime",
        "__messageProperties",
    ]


def test_the_planning_side_imports_no_reading_code() -> None:
    """Spark starts a fresh Python process for every streaming query's source (and for planner
    workers): importing ``pyspark_pulsar`` there loads none of what only a read needs."""
    reading_only = [
        "crc32c",
        "numpy",
        "pyarrow",
        "pulsar",
        "polybroker.ledger.wire",
        "polybroker.spark.reading",
        "polybroker.spark.storage",
    ]
    code = f"import sys, pyspark_pulsar; print([m for m in {reading_only!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
