"""Schema compatibility, as Pulsar's strategies decide it for a new version of a topic's schema.

Record schemas (Avro and JSON, whose definitions are Avro records) are checked with Avro's
schema resolution: data written with the *writer* schema can be read with the *reader* schema
when, for each field the reader has, the writer has one of that name whose type resolves, or
the reader's field has a default; types resolve when equal, promoted (int to long, float or
double; long to float or double; float to double; string and bytes both ways), or through
unions (each writer branch must resolve to some reader branch); records and enums by name, an
enum's symbols within the reader's unless it has a default, fixed by name and size, arrays and
maps by their items and values.

Strategies: ``BACKWARD`` (the new schema reads data of the last one), ``FORWARD`` (the last
one reads the new one's), ``FULL`` (both), their ``_TRANSITIVE`` forms (against every
version), ``ALWAYS_COMPATIBLE`` and ``ALWAYS_INCOMPATIBLE`` (no new version). Schemas of
another type are always refused; other types are compatible with themselves. A definition that
is not JSON is not judged (compatible). Pure functions: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: Pulsar's strategies (a namespace's ``UNDEFINED`` means the broker's setting applies).
STRATEGIES = frozenset(
    {
        "ALWAYS_COMPATIBLE",
        "ALWAYS_INCOMPATIBLE",
        "BACKWARD",
        "FORWARD",
        "FULL",
        "BACKWARD_TRANSITIVE",
        "FORWARD_TRANSITIVE",
        "FULL_TRANSITIVE",
    }
)

_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
# (writer, reader) pairs Avro promotes.
_PROMOTIONS = frozenset(
    {
        ("int", "long"),
        ("int", "float"),
        ("int", "double"),
        ("long", "float"),
        ("long", "double"),
        ("float", "double"),
        ("string", "bytes"),
        ("bytes", "string"),
    }
)
_NAMED = frozenset({"record", "error", "enum", "fixed"})
_MAX_DEPTH = 64  # a definition nested deeper is not judged


def incompatibility(
    strategy: str, existing: Sequence[tuple[int, bytes]], new: tuple[int, bytes], records: bool
) -> str | None:
    """Why ``new`` (schema type, definition) may not follow the ``existing`` versions (oldest
    first) under ``strategy``, or None when it may. ``records``: the type is a record one."""
    if not existing or strategy == "ALWAYS_COMPATIBLE":
        return None
    if existing[-1][0] != new[0]:
        return "the schema type differs from the topic's"
    if strategy == "ALWAYS_INCOMPATIBLE":
        return "the topic's schema may not change (ALWAYS_INCOMPATIBLE)"
    if not records:
        return None
    against = existing if strategy.endswith("_TRANSITIVE") else existing[-1:]
    mode = strategy.removesuffix("_TRANSITIVE")
    new_doc = _parse(new[1])
    if new_doc is None:
        return None
    for _, data in reversed(against):
        old_doc = _parse(data)
        if old_doc is None:
            continue
        if mode in ("BACKWARD", "FULL"):
            why = can_read(new_doc, old_doc)
            if why:
                return f"the new schema cannot read data of an earlier one: {why}"
        if mode in ("FORWARD", "FULL"):
            why = can_read(old_doc, new_doc)
            if why:
                return f"an earlier schema cannot read data of the new one: {why}"
    return None


def can_read(reader: Any, writer: Any) -> str | None:
    """None if data written with ``writer`` can be read with ``reader`` (Avro schema JSON
    documents), else why not."""
    return _Resolution().resolve(reader, writer, "", 0)


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None


def _short(name: Any) -> str:
    return str(name).rpartition(".")[2]


class _Resolution:
    """One resolution: the named types each side defined so far."""

    def __init__(self) -> None:
        self.names: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        self.visiting: set[tuple[int, int]] = set()

    def _norm(self, schema: Any, side: int) -> Any:
        """The schema a type stands for: a name resolved, ``{"type": "int", ...}`` unwrapped,
        a named type remembered."""
        names = self.names[side]
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return schema
            return names.get(schema, names.get(_short(schema), schema))
        if isinstance(schema, dict):
            kind = schema.get("type")
            if kind in _NAMED:
                name = schema.get("name")
                if isinstance(name, str):
                    names[name] = schema
                    names[_short(name)] = schema
                return schema
            if kind in ("array", "map"):
                return schema
            if isinstance(kind, (str, list, dict)):
                return self._norm(kind, side)
        return schema

    def resolve(self, reader: Any, writer: Any, path: str, depth: int) -> str | None:
        if depth > _MAX_DEPTH:
            return None
        r, w = self._norm(reader, 0), self._norm(writer, 1)
        where = path or "the value"
        if isinstance(w, list):  # each branch the writer may have written must be readable
            for branch in w:
                why = self.resolve(r, branch, path, depth + 1)
                if why:
                    return why
            return None
        if isinstance(r, list):
            if any(self.resolve(b, w, path, depth + 1) is None for b in r):
                return None
            return f"{where}: no branch of the reader's union reads {_describe(w)}"
        rk, wk = _kind(r), _kind(w)
        if rk in _PRIMITIVES or wk in _PRIMITIVES:
            if rk == wk or (wk, rk) in _PROMOTIONS:
                return None
            return f"{where}: {_describe(w)} cannot be read as {_describe(r)}"
        if rk != wk:
            return f"{where}: {_describe(w)} cannot be read as {_describe(r)}"
        if rk in ("record", "error"):
            return self._records(r, w, path, depth)
        if rk == "enum":
            if _short(r.get("name")) != _short(w.get("name")):
                return f"{where}: enum {w.get('name')} cannot be read as {r.get('name')}"
            missing = set(w.get("symbols") or ()) - set(r.get("symbols") or ())
            if missing and "default" not in r:
                return f"{where}: the reader's enum lacks {', '.join(sorted(map(str, missing)))}"
            return None
        if rk == "fixed":
            if _short(r.get("name")) != _short(w.get("name")) or r.get("size") != w.get("size"):
                return f"{where}: {_describe(w)} cannot be read as {_describe(r)}"
            return None
        if rk == "array":
            return self.resolve(r.get("items"), w.get("items"), f"{where}[]", depth + 1)
        if rk == "map":
            return self.resolve(r.get("values"), w.get("values"), f"{where}{{}}", depth + 1)
        return None  # a kind this check does not know: not judged

    def _records(self, r: dict[str, Any], w: dict[str, Any], path: str, depth: int) -> str | None:
        if _short(r.get("name")) != _short(w.get("name")):
            where = path or "the value"
            return f"{where}: record {w.get('name')} cannot be read as {r.get('name')}"
        key = (id(r), id(w))
        if key in self.visiting:  # a recursive type: already being resolved
            return None
        self.visiting.add(key)
        try:
            written = {}
            for f in w.get("fields") or ():
                if isinstance(f, dict) and isinstance(f.get("name"), str):
                    written[f["name"]] = f
            for f in r.get("fields") or ():
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    continue
                name = f["name"]
                source = written.get(name)
                if source is None:
                    aliases = f.get("aliases") or ()
                    source = next((written[a] for a in aliases if a in written), None)
                field_path = f"{path}.{name}" if path else name
                if source is None:
                    if "default" not in f:
                        return f"{field_path}: the reader's field is not written and has no default"
                    continue
                why = self.resolve(f.get("type"), source.get("type"), field_path, depth + 1)
                if why:
                    return why
            return None
        finally:
            self.visiting.discard(key)


def _kind(schema: Any) -> str:
    if isinstance(schema, str):
        return schema if schema in _PRIMITIVES else "unknown"
    if isinstance(schema, dict) and isinstance(schema.get("type"), str):
        return str(schema["type"])
    return "unknown"


def _describe(schema: Any) -> str:
    kind = _kind(schema)
    if kind in _NAMED and isinstance(schema, dict):
        return f"{kind} {schema.get('name')}"
    return kind
