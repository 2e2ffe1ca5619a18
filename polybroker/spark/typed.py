"""Typed columns for topics whose registered schema is a JSON record.

Pulsar's JSON schema definition is an Avro record; each top-level field becomes a column of the
matching Spark type, filled from the message's JSON value. A value that is not a JSON object, or
a field that does not fit its type, reads as null; ``value`` keeps the raw bytes either way.
Other schema types (Avro binary, Protobuf, primitives) add no columns.
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

_PRIMITIVES: dict[str, DataType] = {
    "string": StringType(),
    "int": IntegerType(),
    "long": LongType(),
    "float": FloatType(),
    "double": DoubleType(),
    "boolean": BooleanType(),
    "bytes": BinaryType(),
}


def spark_type(avro: Any) -> DataType | None:
    """The Spark type of an Avro type (as JSON-decoded), or None when it has no mapping."""
    if isinstance(avro, str):
        return _PRIMITIVES.get(avro)
    if isinstance(avro, list):
        options = [t for t in avro if t != "null"]
        return spark_type(options[0]) if len(options) == 1 else None
    if isinstance(avro, dict):
        kind = avro.get("type")
        if kind == "record":
            fields = record_fields(avro)
            return StructType(fields) if fields else None
        if kind == "array":
            inner = spark_type(avro.get("items"))
            return ArrayType(inner, True) if inner is not None else None
        if kind == "map":
            inner = spark_type(avro.get("values"))
            return MapType(StringType(), inner, True) if inner is not None else None
        if kind == "enum":
            return StringType()
        return spark_type(kind)
    return None


def record_fields(record: dict[str, Any]) -> list[StructField]:
    """The mappable fields of an Avro record definition, all nullable."""
    out = []
    for f in record.get("fields", []):
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            t = spark_type(f.get("type"))
            if t is not None:
                out.append(StructField(f["name"], t, True))
    return out


def typed_fields(schema_info: dict[str, Any] | None, taken: set[str]) -> list[StructField]:
    """Columns for an admin schema answer (``type``, ``data``); none unless it is JSON."""
    if not schema_info or str(schema_info.get("type", "")).upper() != "JSON":
        return []
    try:
        definition = json.loads(schema_info.get("data") or "")
    except ValueError:
        return []
    if not isinstance(definition, dict) or definition.get("type") != "record":
        return []
    return [f for f in record_fields(definition) if f.name not in taken]


def _fit(value: Any, t: DataType) -> Any:
    """``value`` as ``t`` wants it, or None when it does not fit."""
    if value is None:
        return None
    if isinstance(t, StringType):
        return value if isinstance(value, str) else None
    if isinstance(t, BooleanType):
        return value if isinstance(value, bool) else None
    if isinstance(t, IntegerType | LongType):
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        limit = 1 << (31 if isinstance(t, IntegerType) else 63)
        return value if -limit <= value < limit else None
    if isinstance(t, FloatType | DoubleType):
        return (
            float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )
    if isinstance(t, BinaryType):
        return value.encode() if isinstance(value, str) else None
    if isinstance(t, ArrayType):
        return [_fit(v, t.elementType) for v in value] if isinstance(value, list) else None
    if isinstance(t, MapType):
        if not isinstance(value, dict):
            return None
        return [(str(k), _fit(v, t.valueType)) for k, v in value.items()]
    if isinstance(t, StructType):
        if not isinstance(value, dict):
            return None
        return {f.name: _fit(value.get(f.name), f.dataType) for f in t.fields}
    return None


def extract(data: bytes, fields: list[StructField]) -> list[Any]:
    """The typed field values of one message's JSON value, in ``fields`` order."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return [None] * len(fields)
    if not isinstance(doc, dict):
        return [None] * len(fields)
    return [_fit(doc.get(f.name), f.dataType) for f in fields]
