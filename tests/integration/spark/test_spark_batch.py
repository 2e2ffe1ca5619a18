"""Batch reads and writes of ``format("pulsar")`` on local[2] against a standalone broker."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import pulsar
import pytest
from spark_harness import Broker, create_partitioned, produce

pytestmark = pytest.mark.slow

UTC = dt.UTC


def _read(spark: Any, broker: Broker, **options: str) -> Any:
    return spark.read.format("pulsar").options(**broker.options(**options)).load()


def test_read_every_column_of_a_partitioned_topic_in_split_ranges(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """Keys, values, properties, times and ids of batched messages; >1 range per partition."""
    create_partitioned(broker, "orders", 2)
    before = int(time.time() * 1000)
    for p in range(2):
        produce(
            pulsar_client,
            f"persistent://public/default/orders-partition-{p}",
            [
                {
                    "value": f"v{i}".encode(),
                    "key": f"k{i % 5}",
                    "props": {"i": str(i)},
                    "event": 1000 + i,
                }
                for i in range(p, 60, 2)
            ],
        )
    df = _read(spark, broker, topic="orders", maxEntriesPerPartition="2")
    assert df.rdd.getNumPartitions() > 2
    rows = df.collect()
    assert sorted(r.value for r in rows) == sorted(f"v{i}".encode() for i in range(60))
    partitions = {f"persistent://public/default/orders-partition-{p}" for p in range(2)}
    assert {r["__topic"] for r in rows} == partitions
    for r in rows:
        i = int(r.value[1:])
        assert r.key == f"k{i % 5}".encode()
        assert r["__messageProperties"] == {"i": str(i)}
        assert r["__eventTime"] == dt.datetime.fromtimestamp((1000 + i) / 1000, UTC).replace(
            tzinfo=None
        )
        assert r["__publishTime"].replace(tzinfo=UTC).timestamp() * 1000 >= before - 1000
        mid = pulsar.MessageId.deserialize(r["__messageId"])
        assert mid.partition() == int(r["__topic"].rsplit("-", 1)[1])
    ids = [(r["__topic"], pulsar.MessageId.deserialize(r["__messageId"])) for r in rows]
    assert len({(t, m.ledger_id(), m.entry_id(), m.batch_index()) for t, m in ids}) == 60
    # A Spark aggregation over the rows.
    counts = {r.key: r["count"] for r in df.groupBy("key").count().collect()}
    assert counts == {f"k{k}".encode(): 12 for k in range(5)}


def test_offsets_json_bounds_a_read_and_pattern_finds_topics(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """startingOffsets/endingOffsets JSON pick [start, end); topicsPattern and topics list."""
    produce(
        pulsar_client,
        "persistent://public/default/bounded-a",
        [{"value": f"a{i}".encode()} for i in range(20)],
        batching=False,
    )
    produce(
        pulsar_client,
        "persistent://public/default/bounded-b",
        [{"value": f"b{i}".encode()} for i in range(3)],
        batching=False,
    )
    everything = _read(spark, broker, topicsPattern="persistent://public/default/bounded-.*")
    rows = sorted(everything.collect(), key=lambda r: (r["__topic"], r["__messageId"]))
    assert len(rows) == 23
    a_ids = {
        r.value: pulsar.MessageId.deserialize(r["__messageId"])
        for r in rows
        if r["__topic"].endswith("bounded-a")
    }
    start, end = a_ids[b"a5"], a_ids[b"a15"]
    bounded = _read(
        spark,
        broker,
        topics="bounded-a, bounded-b",
        startingOffsets=json.dumps(
            {"bounded-a": f"{start.ledger_id()}:{start.entry_id()}", "bounded-b": "latest"}
        ),
        endingOffsets=json.dumps(
            {"bounded-a": {"ledgerId": end.ledger_id(), "entryId": end.entry_id()}}
        ),
    )
    assert sorted(r.value for r in bounded.collect()) == sorted(
        f"a{i}".encode() for i in range(5, 15)
    )
    # The serialized id (the StreamNative form, a list of bytes) is accepted as well.
    from_bytes = _read(
        spark,
        broker,
        topic="bounded-a",
        startingOffsets=json.dumps({"bounded-a": list(end.serialize())}),
    )
    assert sorted(r.value for r in from_bytes.collect()) == sorted(
        f"a{i}".encode() for i in range(15, 20)
    )


def test_write_rows_with_every_column_then_read_them_back(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """__topic picks the topic; key, value, event time and properties arrive; all acked."""
    when = dt.datetime(2024, 5, 6, 7, 8, 9, 123000)
    data = [(f"out-{i % 2}", f"key{i}", f"val{i}".encode(), when, {"n": str(i)}) for i in range(40)]
    df = spark.createDataFrame(
        data,
        "__topic string, key string, value binary, __eventTime timestamp, "
        "__messageProperties map<string,string>",
    ).repartition(3)
    df.write.format("pulsar").mode("append").option("service.url", broker.service_url).save()
    for t in range(2):
        reader = pulsar_client.create_reader(
            f"persistent://public/default/out-{t}", pulsar.MessageId.earliest
        )
        got = []
        while len(got) < 20:
            got.append(reader.read_next(10_000))
        assert not reader.has_message_available()
        reader.close()
        assert sorted(m.data() for m in got) == sorted(f"val{i}".encode() for i in range(t, 40, 2))
        for m in got:
            i = int(m.data()[3:])
            assert m.partition_key() == f"key{i}"
            assert m.properties() == {"n": str(i)}
            assert m.event_timestamp() == int(when.replace(tzinfo=UTC).timestamp() * 1000)
    # The topic option overrides the column; string values are sent as UTF-8.
    spark.createDataFrame([("x", "hello")], "__topic string, value string").write.format(
        "pulsar"
    ).mode("append").option("service.url", broker.service_url).option("topic", "out-2").save()
    back = _read(spark, broker, topic="out-2").collect()
    assert [(r.value, r.key) for r in back] == [(b"hello", None)]


def test_bad_options_are_refused(spark: Any, broker: Broker) -> None:
    """No admin URL, two topic options, overwrite mode: each is an error, not a wrong result."""
    from pyspark.errors import PySparkException

    with pytest.raises(PySparkException, match=r"admin\.url"):
        spark.read.format("pulsar").option("service.url", broker.service_url).option(
            "topic", "x"
        ).load().collect()
    with pytest.raises(PySparkException, match="exactly one"):
        _read(spark, broker, topic="x", topics="y").collect()
    with pytest.raises(PySparkException, match="append"):
        spark.createDataFrame([("v",)], "value string").write.format("pulsar").mode(
            "overwrite"
        ).option("service.url", broker.service_url).option("topic", "x").save()


def test_json_schema_topic_reads_with_typed_columns(
    spark: Any, broker: Broker, pulsar_client: Any
) -> None:
    """A topic with a JSON record schema gets one typed column per field, next to value."""
    from pulsar.schema import Array, Double, Integer, JsonSchema, Record, String

    class Reading(Record):
        sensor = String()
        count = Integer()
        level = Double()
        tags = Array(String())

    producer = pulsar_client.create_producer(
        "persistent://public/default/typed", schema=JsonSchema(Reading)
    )
    for i in range(5):
        producer.send(Reading(sensor=f"s{i}", count=i, level=i / 2, tags=["a", str(i)]))
    producer.close()
    df = _read(spark, broker, topic="typed")
    types = dict(df.dtypes)
    assert types["sensor"] == "string"
    assert types["count"] == "int"
    assert types["level"] == "double"
    assert types["tags"] == "array<string>"
    assert types["value"] == "binary"
    rows = sorted(df.collect(), key=lambda r: r.sensor)
    assert [(r.sensor, r["count"], r.level, r.tags) for r in rows] == [
        (f"s{i}", i, i / 2, ["a", str(i)]) for i in range(5)
    ]
    # A topic without a schema keeps the fixed columns only.
    assert len(_read(spark, broker, topic="out-2").columns) == 7
