"""Backlogs read straight from the bookies: the same rows as through the broker.

The broker here rolls its ledgers every 4 entries, so a backlog spans sealed ledgers and one open
ledger (read from the bookies up to its last add confirmed).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pulsar
import pytest
from spark_harness import (
    Broker,
    admin_get,
    admin_put,
    create_partitioned,
    start_broker,
    wait_for,
    wait_healthy,
)

from polybroker.ledger.direct import LedgerLayout
from polybroker.spark.source import PulsarBatchReader, PulsarPartition, _options

pytestmark = pytest.mark.slow

T = "/admin/v2/persistent/public/default"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A standalone broker that seals a ledger every 4 entries."""
    root = tmp_path_factory.mktemp("standalone-rolling")
    b = start_broker(
        root / "data",
        root / "standalone.log",
        config={
            "managedLedgerMaxEntriesPerLedger": "4",
            "managedLedgerMinLedgerRolloverTimeMinutes": "0",
        },
    )
    try:
        wait_healthy(b)
        yield b
    finally:
        b.proc.send_signal(signal.SIGTERM)
        try:
            b.proc.wait(20)
        except subprocess.TimeoutExpired:
            b.proc.kill()
            b.proc.wait(10)
        if b.proc.stdout is not None:
            b.proc.stdout.close()


def _keep(broker: Broker, topic: str) -> None:
    """Create ``topic`` with a subscription, so its sealed ledgers are kept (its backlog)."""
    admin_put(broker, f"{T}/{topic}")
    admin_put(broker, f"{T}/{topic}/subscription/keep")


def _send(client: Any, topic: str, n: int, tag: str, **producer: Any) -> None:
    p = client.create_producer(f"persistent://public/default/{topic}", **producer)
    for i in range(n):
        kwargs: dict[str, Any] = {"properties": {"i": str(i), "tag": tag}}
        if i % 3:
            kwargs["partition_key"] = f"{tag}-k{i % 4}"
        if i % 2:
            kwargs["event_timestamp"] = 1_700_000_000_000 + i
        p.send_async(f"{tag}-{i}".encode() * (1 + i % 5), None, **kwargs)
    p.flush()
    p.close()


def _fill_mixed(broker: Broker, client: Any, topic: str) -> None:
    """Lone, batched, LZ4 and ZLIB batches over several sealed ledgers and an open one."""
    _keep(broker, topic)
    _send(client, topic, 9, "lone", batching_enabled=False)
    batched = {"batching_enabled": True, "batching_max_messages": 5}
    _send(client, topic, 23, "batch", batching_max_publish_delay_ms=20, **batched)
    for name in ("LZ4", "ZLib"):
        comp = getattr(pulsar.CompressionType, name)
        _send(client, topic, 17, name, compression_type=comp, **batched)
    _send(client, topic, 2, "tail", batching_enabled=False)
    # A ledger that filled up is sealed at once: end with entries in the open one.
    for _ in range(4):
        last = admin_get(broker, f"{T}/{topic}/internalStats?metadata=true")["ledgers"][-1]
        if not last["sealed"] and last["entries"] > 0:
            return
        _send(client, topic, 1, "more", batching_enabled=False)
    raise AssertionError("the open ledger stays empty")


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted(
        (
            r["__topic"],
            r["__messageId"],
            r.key,
            r.value,
            r["__publishTime"],
            r["__eventTime"],
            sorted((r["__messageProperties"] or {}).items()),
        )
        for r in df.collect()
    )


def _plan(broker: Broker, **options: str) -> list[PulsarPartition]:
    reader = PulsarBatchReader(_options(broker.options(**options)))
    return [p for p in reader.partitions() if isinstance(p, PulsarPartition)]


def _storage_only(broker: Broker, parts: list[PulsarPartition], **options: str) -> int:
    """Read the planned storage ranges with no broker to fall back on; the rows read."""
    dead = {**broker.options(**options), "service.url": "pulsar://127.0.0.1:1"}
    reader = PulsarBatchReader(_options(dead))
    return sum(b.num_rows for p in parts if p.layouts for b in reader.read(p))


def _broker_only(broker: Broker, parts: list[PulsarPartition], **options: str) -> int:
    """Read the same ranges through the broker; the rows read (more than none)."""
    reader = PulsarBatchReader(_options(broker.options(**options)))
    n = sum(b.num_rows for p in parts for b in reader.read(replace(p, layouts=())))
    assert n > 0
    return n


def test_internal_stats_with_metadata_describe_sealed_ledgers(
    broker: Broker, pulsar_client: Any
) -> None:
    """``internalStats?metadata=true``: sealed ledgers with quorums and bookies; the open one."""
    _keep(broker, "layout")
    _send(pulsar_client, "layout", 10, "x", batching_enabled=False)
    ledgers = admin_get(broker, f"{T}/layout/internalStats?metadata=true")["ledgers"]
    assert [x["sealed"] for x in ledgers] == [True, True, False]
    for x in ledgers[:2]:
        assert x["entries"] == 4
        assert x["lastEntryId"] == 3
        assert (x["ensembleSize"], x["writeQuorumSize"], x["ackQuorumSize"]) == (1, 1, 1)
        [fragment] = x["fragments"]
        assert fragment["firstEntryId"] == 0
        assert [b.rsplit(":", 1)[0] for b in fragment["bookies"]] == ["127.0.0.1"]
    plain = admin_get(broker, f"{T}/layout/internalStats")["ledgers"]
    assert "fragments" not in plain[0]


def test_storage_and_broker_reads_give_the_same_rows(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """Row for row (ids included) over lone, batched and compressed entries; split ranges."""
    topic = "mixed"
    _fill_mixed(broker, pulsar_client, topic)
    parts = _plan(broker, topic=topic, maxEntriesPerPartition="3")
    direct = [p for p in parts if p.layouts]
    assert len(direct) >= 3
    # The open ledger too, up to its last add confirmed.
    stats = admin_get(broker, f"{T}/{topic}/internalStats?metadata=true")
    assert not stats["ledgers"][-1]["sealed"]
    assert stats["ledgers"][-1]["ledgerId"] in {x.ledger_id for p in parts for x in p.layouts}
    assert not any(p.layouts for p in _plan(broker, topic=topic, readFromStorage="false"))
    assert _storage_only(broker, direct, topic=topic) == _broker_only(broker, direct, topic=topic)

    def read(**extra: str) -> list[tuple[Any, ...]]:
        options = broker.options(topic=topic, maxEntriesPerPartition="3", **extra)
        return _rows(spark.read.format("pulsar").options(**options).load())

    from_storage = read()
    through_broker = read(readFromStorage="false")
    assert 9 + 23 + 17 + 17 + 2 <= len(from_storage) <= 9 + 23 + 17 + 17 + 2 + 4
    assert from_storage == through_broker
    # Offsets inside a batch cut it the same way on both paths.
    mids = [pulsar.MessageId.deserialize(r[1]) for r in through_broker]
    inside = sorted(
        (m.ledger_id(), m.entry_id(), m.batch_index()) for m in mids if m.batch_index() > 0
    )
    lo, hi = inside[1], inside[-2]
    bounds = {
        "startingOffsets": f'{{"{topic}": "{lo[0]}:{lo[1]}:{lo[2]}"}}',
        "endingOffsets": f'{{"{topic}": "{hi[0]}:{hi[1]}:{hi[2]}"}}',
    }
    cut_storage, cut_broker = read(**bounds), read(readFromStorage="false", **bounds)
    assert cut_storage == cut_broker
    assert 0 < len(cut_storage) < len(from_storage)


def test_kafka_format_entries_read_the_same_from_storage(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """Entries stored in the Kafka handler's native format decode on the workers too."""
    from confluent_kafka import Producer

    create_partitioned(broker, "kt", 1)
    _keep(broker, "kt-partition-0")
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{broker.kafka_port}", "linger.ms": 5})
    for i in range(40):
        producer.produce(
            "kt",
            value=f"kafka-{i}".encode(),
            key=f"key-{i % 3}".encode(),
            headers=[("h", f"{i}".encode())],
            partition=0,
        )
        if i % 7 == 0:
            producer.flush(10)
    assert producer.flush(30) == 0
    topic = "persistent://public/default/kt-partition-0"
    direct = [p for p in _plan(broker, topic=topic) if p.layouts]
    assert direct
    assert _storage_only(broker, direct, topic=topic) == _broker_only(broker, direct, topic=topic)

    def read(**extra: str) -> list[tuple[Any, ...]]:
        options = broker.options(topic=topic, maxEntriesPerPartition="2", **extra)
        return _rows(spark.read.format("pulsar").options(**options).load())

    from_storage = read()
    assert len(from_storage) == 40
    assert from_storage == read(readFromStorage="false")


def test_unreachable_bookies_fall_back_to_the_broker(broker: Broker, pulsar_client: Any) -> None:
    """A range whose bookies refuse connections is read through the broker, whole and once."""
    topic = "fallback"
    _keep(broker, topic)
    _send(pulsar_client, topic, 30, "f", batching_enabled=True, batching_max_messages=4)

    def sealed() -> int:
        stats = admin_get(broker, f"{T}/{topic}/internalStats?metadata=true")
        return sum(x["sealed"] for x in stats["ledgers"])

    wait_for(lambda: sealed() >= 2, 10, "two sealed ledgers")
    reader = PulsarBatchReader(_options(broker.options(topic=topic)))
    parts = [p for p in reader.partitions() if isinstance(p, PulsarPartition)]
    gone = [
        replace(
            p,
            layouts=tuple(
                LedgerLayout(x.ledger_id, 1, 1, ((0, ("127.0.0.1:1",)),)) for x in p.layouts
            ),
        )
        for p in parts
    ]
    assert any(p.layouts for p in gone)

    def ids(partitions: list[PulsarPartition]) -> list[bytes]:
        out: list[bytes] = []
        for p in partitions:
            for batch in reader.read(p):
                out += batch.column("__messageId").to_pylist()
        return out

    expected = ids(parts)
    assert len(expected) == 30
    assert ids(gone) == expected


def test_streaming_reads_sealed_ranges_from_storage(
    spark: Any, broker: Broker, pulsar_client: Any, tmp_path: Path
) -> None:
    """availableNow micro-batches over a mostly sealed backlog see every message once."""
    topic = "streamed"
    _fill_mixed(broker, pulsar_client, topic)
    query = (
        spark.readStream.format("pulsar")
        .options(
            **broker.options(topic=topic, startingOffsets="earliest", maxEntriesPerTrigger="5")
        )
        .load()
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180)
    assert query.exception() is None
    streamed = _rows(spark.read.parquet(str(tmp_path / "out")))
    options = broker.options(topic=topic, readFromStorage="false")
    assert streamed == _rows(spark.read.format("pulsar").options(**options).load())
