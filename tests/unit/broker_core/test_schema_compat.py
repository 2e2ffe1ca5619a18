"""Unit tests of Pulsar's schema compatibility strategies and Avro's resolution rules."""

from __future__ import annotations

import json
from typing import Any

import pytest

from polybroker.broker_core.schema_compat import can_read, incompatibility

AVRO = 4


def record(*fields: dict[str, Any], name: str = "Book") -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": list(fields)}


def field(name: str, type_: Any, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": type_, **extra}


V1 = record(field("title", ["null", "string"]), field("pages", "int"))
ADDED_WITH_DEFAULT = record(*V1["fields"], field("isbn", ["null", "string"], default=None))
ADDED_WITHOUT_DEFAULT = record(*V1["fields"], field("isbn", "string"))
REMOVED = record(field("title", ["null", "string"]))
PROMOTED = record(field("title", ["null", "string"]), field("pages", "long"))
RETYPED = record(field("title", ["null", "string"]), field("pages", "string"))


def check(strategy: str, *versions: dict[str, Any]) -> str | None:
    *old, new = [(AVRO, json.dumps(v).encode()) for v in versions]
    return incompatibility(strategy, old, new, records=True)


def test_avro_resolution_rules() -> None:
    """Fields by name (a reader's new field needs a default), promotions, unions, names."""
    assert can_read(ADDED_WITH_DEFAULT, V1) is None
    assert "isbn" in (can_read(ADDED_WITHOUT_DEFAULT, V1) or "")
    assert can_read(V1, ADDED_WITHOUT_DEFAULT) is None  # the reader ignores a field
    assert can_read(PROMOTED, V1) is None  # int is read as long
    assert can_read(V1, PROMOTED) is not None  # long is not read as int
    assert can_read(RETYPED, V1) is not None
    assert can_read(record(field("t", ["null", "string"])), record(field("t", "string"))) is None
    assert can_read(record(field("t", "string")), record(field("t", ["null", "string"])))
    assert can_read(record(name="Other"), record()) is not None
    enum = {"type": "enum", "name": "E", "symbols": ["A", "B"]}
    wider = {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}
    assert can_read(wider, enum) is None
    assert can_read(enum, wider) is not None
    assert can_read({**enum, "default": "A"}, wider) is None
    assert can_read({"type": "array", "items": "long"}, {"type": "array", "items": "int"}) is None
    assert can_read({"type": "map", "values": "int"}, {"type": "map", "values": "string"})


def test_recursive_and_named_references_resolve() -> None:
    """A recursive record (a linked list) and a named type used twice resolve."""
    node = record(field("value", "int"), field("next", ["null", "Node"]), name="Node")
    assert can_read(node, node) is None
    point = record(field("x", "int"), name="Point")
    line = record(field("a", point), field("b", "Point"), name="Line")
    assert can_read(line, json.loads(json.dumps(line))) is None


@pytest.mark.parametrize(
    ("strategy", "new", "refused"),
    [
        ("FULL", ADDED_WITH_DEFAULT, False),
        ("FULL", ADDED_WITHOUT_DEFAULT, True),
        ("BACKWARD", ADDED_WITHOUT_DEFAULT, True),
        ("FORWARD", ADDED_WITHOUT_DEFAULT, False),
        ("BACKWARD", REMOVED, False),
        ("FORWARD", REMOVED, True),  # the old schema has no default for the removed field
        ("BACKWARD", PROMOTED, False),
        ("FULL", PROMOTED, True),
        ("ALWAYS_COMPATIBLE", RETYPED, False),
        ("ALWAYS_INCOMPATIBLE", ADDED_WITH_DEFAULT, True),
    ],
)
def test_strategies_against_the_last_version(
    strategy: str, new: dict[str, Any], refused: bool
) -> None:
    assert (check(strategy, V1, new) is not None) is refused


def test_transitive_strategies_check_every_version() -> None:
    """A version compatible with the last one but not with an older one passes BACKWARD and
    fails BACKWARD_TRANSITIVE."""
    v2 = record(field("title", ["null", "string"]))  # pages removed
    v3 = record(field("title", ["null", "string"]), field("pages", "string", default=""))
    assert check("BACKWARD", V1, v2, v3) is None
    assert check("BACKWARD_TRANSITIVE", V1, v2, v3) is not None


def test_other_types_and_unreadable_definitions() -> None:
    """A schema of another type is refused whatever the strategy judges; non-record types
    and definitions that are not JSON are not judged; a first version is always taken."""
    string, json_type = 1, 2
    assert incompatibility("FULL", [(string, b"")], (json_type, b"{}"), records=True)
    assert incompatibility("FULL", [(string, b"")], (string, b"x"), records=False) is None
    assert incompatibility("FULL", [(AVRO, b"not json")], (AVRO, b"{"), records=True) is None
    assert incompatibility("FULL", [], (AVRO, b"{}"), records=True) is None
