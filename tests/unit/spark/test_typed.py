"""Typed columns from JSON record schemas: type mapping and per-message extraction."""

from __future__ import annotations

import json

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from polybroker.spark.typed import extract, spark_type, typed_fields

DEFINITION = {
    "type": "record",
    "name": "R",
    "fields": [
        {"name": "s", "type": ["null", "string"]},
        {"name": "i", "type": "int"},
        {"name": "n", "type": "long"},
        {"name": "d", "type": "double"},
        {"name": "a", "type": {"type": "array", "items": "long"}},
        {"name": "m", "type": {"type": "map", "values": "string"}},
        {
            "name": "r",
            "type": {"type": "record", "name": "In", "fields": [{"name": "x", "type": "int"}]},
        },
        {"name": "u", "type": ["int", "string"]},
        {"name": "value", "type": "string"},
    ],
}


def test_json_schema_maps_fields_to_spark_types() -> None:
    """Each mappable field becomes a nullable column; unions of two types and taken names drop."""
    info = {"type": "JSON", "data": json.dumps(DEFINITION)}
    fields = typed_fields(info, {"value", "key"})
    assert [(f.name, f.dataType) for f in fields] == [
        ("s", StringType()),
        ("i", IntegerType()),
        ("n", LongType()),
        ("d", DoubleType()),
        ("a", ArrayType(LongType(), True)),
        ("m", MapType(StringType(), StringType(), True)),
        ("r", StructType([StructField("x", IntegerType(), True)])),
    ]
    assert typed_fields({"type": "AVRO", "data": json.dumps(DEFINITION)}, set()) == []
    assert typed_fields({"type": "JSON", "data": "not json"}, set()) == []
    assert typed_fields(None, set()) == []
    assert spark_type("bytes") == BinaryType()


def test_extract_fits_values_or_gives_null() -> None:
    """Values of the right type pass; wrong types, overflow and non-objects read as null."""
    fields = typed_fields({"type": "JSON", "data": json.dumps(DEFINITION)}, {"value"})
    doc = {"s": "x", "i": 1 << 40, "n": 5, "d": 2, "a": [1, "b"], "m": {"k": "v"}, "r": {"x": 3}}
    assert extract(json.dumps(doc).encode(), fields) == [
        "x", None, 5, 2.0, [1, None], [("k", "v")], {"x": 3},
    ]  # fmt: skip
    assert extract(b"[1, 2]", fields) == [None] * len(fields)
    assert extract(b"\xff", fields) == [None] * len(fields)
    assert extract(b'{"s": 7, "d": true}', fields)[:4] == [None, None, None, None]
