"""Structured Streaming with ``format("pulsar")``: checkpointed offsets, triggers, the sink."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pulsar
import pytest
from spark_harness import Broker, produce

pytestmark = pytest.mark.slow


def _run_available_now(spark: Any, broker: Broker, topic: str, out: Path, ckpt: Path) -> Any:
    query = (
        spark.readStream.format("pulsar")
        .options(
            **broker.options(topic=topic, startingOffsets="earliest", maxEntriesPerTrigger="4")
        )
        .load()
        .selectExpr("CAST(value AS STRING) AS v", "__topic", "__messageId")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    assert query.exception() is None
    return query


def test_restart_from_checkpoint_neither_loses_nor_repeats(
    spark: Any, broker: Broker, pulsar_client: Any, tmp_path: Path
) -> None:
    """Two availableNow runs on one checkpoint write every message exactly once, in batches."""
    topic = "persistent://public/default/stream-in"
    produce(pulsar_client, topic, [{"value": f"a{i}".encode()} for i in range(10)], batching=False)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = _run_available_now(spark, broker, topic, out, ckpt)
    # maxEntriesPerTrigger=4 over 10 entries: at least three micro-batches.
    batches = [p for p in first.recentProgress if p["numInputRows"] > 0]
    assert len(batches) >= 3
    assert max(p["numInputRows"] for p in batches) <= 4
    end = json.loads(batches[-1]["sources"][0]["endOffset"])
    assert set(end) == {topic}
    assert end[topic].count(":") == 2
    produce(pulsar_client, topic, [{"value": f"b{i}".encode()} for i in range(7)], batching=True)
    _run_available_now(spark, broker, topic, out, ckpt)
    values = [r.v for r in spark.read.parquet(str(out)).collect()]
    expected = [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(7)]
    assert sorted(values) == sorted(expected)
    # A third run with nothing new adds nothing.
    _run_available_now(spark, broker, topic, out, ckpt)
    assert spark.read.parquet(str(out)).count() == len(expected)


def test_processing_time_trigger_into_the_stream_sink(
    spark: Any, broker: Broker, pulsar_client: Any, tmp_path: Path
) -> None:
    """A running query moves messages produced after its start from one topic to another."""
    src, dst = "persistent://public/default/pipe-in", "persistent://public/default/pipe-out"
    query = (
        spark.readStream.format("pulsar")
        .options(**broker.options(topic=src, startingOffsets="earliest"))
        .load()
        .selectExpr("upper(CAST(value AS STRING)) AS value", "key")
        .writeStream.format("pulsar")
        .option("service.url", broker.service_url)
        .option("topic", dst)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    try:
        produce(
            pulsar_client, src, [{"value": f"m{i}".encode(), "key": f"k{i}"} for i in range(25)]
        )
        reader = pulsar_client.create_reader(dst, pulsar.MessageId.earliest)
        got = []
        while len(got) < 25:
            got.append(reader.read_next(60_000))
        assert sorted((m.data(), m.partition_key()) for m in got) == sorted(
            (f"M{i}".encode(), f"k{i}") for i in range(25)
        )
        assert query.exception() is None
        reader.close()
    finally:
        query.stop()


def _run_memory_stream(spark: Any, source: Any, ckpt: Path) -> list[dict]:
    """Register ``source`` and run it once (availableNow) into the memory sink of the same name;
    return the end offsets of its micro-batches (at least one)."""
    spark.dataSource.register(source)
    name = source.name()
    query = (
        spark.readStream.format(name)
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    assert query.exception() is None
    ends = [json.loads(p["sources"][0]["endOffset"]) for p in query.recentProgress]
    assert ends
    return ends


def test_a_stream_source_runner_imports_the_installed_pyspark(spark: Any, tmp_path: Path) -> None:
    """Spark starts each streaming query's source in a fresh Python process with pyspark.zip
    first on its path; through the session's launcher it imports the installed pyspark (compiled
    once) instead. Seen in the offsets that process returns and in the rows a worker reads."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    # Local, so that cloudpickle ships it by value (this module is not importable there).
    def _pyspark_origin() -> str:
        import pyspark

        return "zip" if ".zip" in pyspark.__file__ else "installed"

    class Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict:
            return {"n": 0, "runner": _pyspark_origin()}

        def latestOffset(self) -> dict:
            return {"n": 1, "runner": _pyspark_origin()}

        def partitions(self, start: dict, end: dict) -> list[InputPartition]:
            return [InputPartition(0)] if start["n"] < end["n"] else []

        def read(self, partition: InputPartition) -> Any:
            yield (_pyspark_origin(),)

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "pyspark_origin"

        def schema(self) -> str:
            return "origin string"

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return Reader()

    ends = _run_memory_stream(spark, Source, tmp_path / "ckpt")
    assert all(e["runner"] == "installed" for e in ends)
    assert [r.origin for r in spark.sql("SELECT origin FROM pyspark_origin").collect()] == [
        "installed"
    ]


def test_a_stream_source_runner_is_a_fork_of_the_session_fork_server(
    spark: Any, tmp_path: Path
) -> None:
    """The session's fork server serves the source runner's launch: the process that answers
    the query's offset calls is its child, and the query runs to its end."""
    import os

    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    from polybroker.spark.session import start_fork_server

    server = start_fork_server()
    assert server is not None

    class Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict:
            return {"n": 0, "parent": os.getppid()}

        def latestOffset(self) -> dict:
            return {"n": 2, "parent": os.getppid()}

        def partitions(self, start: dict, end: dict) -> list[InputPartition]:
            return [InputPartition(i) for i in range(start["n"], end["n"])]

        def read(self, partition: InputPartition) -> Any:
            yield (partition.value,)  # type: ignore[attr-defined]

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "runner_parent"

        def schema(self) -> str:
            return "n int"

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return Reader()

    ends = _run_memory_stream(spark, Source, tmp_path / "ckpt")
    assert all(e["parent"] == server.pid for e in ends)
    assert sorted(r.n for r in spark.sql("SELECT n FROM runner_parent").collect()) == [0, 1]
