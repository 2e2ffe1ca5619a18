"""Per-topic schemas with versions, as Pulsar clients (and the admin API) register and fetch
them. Types are numbered as in Pulsar's wire protocol; the registry knows no protocol.

Storage: one metadata node per topic, ``/schemas/<tenant>/<namespace>/<url-encoded topic>``,
holding ``{"versions": [{"type", "name", "data" (base64), "properties"}, ...]}``; a version is
its index in that list. Partitions share their partitioned topic's schemas. Updates are
compare-and-set on the node's version, so concurrent registrations never lose one.

Compatibility: a new version must follow the existing ones under the topic's strategy
(``schema_compat``: Pulsar's strategies, record schemas checked by Avro's resolution rules). A
topic without schemas takes the first one it is given. Clients using plain bytes send no schema
and are never checked.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from polybroker.broker_core.errors import BrokerError, InvalidTopicNameError
from polybroker.broker_core.schema_compat import incompatibility
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError

ROOT = "/schemas"
_PARTITION = re.compile(r"^(.+)-partition-\d+$")
_RETRIES = 5
#: Schema types are numbered as Pulsar's wire ``Schema.Type`` numbers them.
JSON_TYPE = 2
AVRO_TYPE = 4
_RECORD_TYPES = {AVRO_TYPE, JSON_TYPE}


class IncompatibleSchemaError(BrokerError):
    """The schema does not fit the topic's schemas."""

    pulsar_error = "IncompatibleSchema"


class SchemaNotFoundError(BrokerError):
    """The topic has no schema (of that version)."""

    pulsar_error = "TopicNotFound"


@dataclass(frozen=True)
class StoredSchema:
    """One version of a topic's schema."""

    version: int
    type: int
    name: str
    data: bytes
    properties: dict[str, str] = field(default_factory=dict)
    timestamp_ms: int = 0  # when the version was registered (0: not recorded)


def version_bytes(version: int) -> bytes:
    """A schema version as clients carry it: an 8-byte big-endian integer."""
    return struct.pack(">q", version)


def version_of(raw: bytes) -> int:
    """Read a schema version; raise ``SchemaNotFoundError`` for a malformed one."""
    if len(raw) != 8:
        raise SchemaNotFoundError(f"malformed schema version {raw!r}")
    return int(struct.unpack(">q", raw)[0])


class SchemaRegistry:
    """Schemas of every topic, kept in the metadata store (see the module docstring)."""

    def __init__(self, store: MetadataStore, now: Callable[[], float] | None = None) -> None:
        self.store = store
        self.now = now  # seconds, stamping new versions (None: they carry no time)

    @staticmethod
    def path(topic: str) -> str:
        """The node of ``topic``'s schemas (a partition maps to its partitioned topic)."""
        name = topic.split("://", 1)[-1]
        if "/" not in name:
            name = f"public/default/{name}"
        parts = name.split("/")
        if len(parts) != 3 or not all(parts):
            raise InvalidTopicNameError(f"invalid topic name {topic!r}")
        tenant, ns, local = parts
        m = _PARTITION.match(local)
        if m:
            local = m.group(1)
        return f"{ROOT}/{tenant}/{ns}/{quote(local, safe='')}"

    async def _load(self, topic: str) -> tuple[list[dict[str, Any]], int]:
        found = await self.store.get(self.path(topic))
        if found is None:
            return [], -1
        return list(json.loads(found.value)["versions"]), found.stat.version

    @staticmethod
    def _stored(index: int, doc: dict[str, Any]) -> StoredSchema:
        return StoredSchema(
            index,
            int(doc["type"]),
            str(doc.get("name", "")),
            base64.b64decode(doc["data"]),
            dict(doc.get("properties", {})),
            int(doc.get("timestamp", 0)),
        )

    async def versions(self, topic: str) -> list[StoredSchema]:
        """Every version of ``topic``'s schema, oldest first."""
        docs, _ = await self._load(topic)
        return [self._stored(i, d) for i, d in enumerate(docs)]

    async def get(self, topic: str, version: int | None = None) -> StoredSchema:
        """The latest version, or ``version``; raise ``SchemaNotFoundError``."""
        found = await self.versions(topic)
        if not found:
            raise SchemaNotFoundError(f"topic {topic} has no schema")
        if version is None:
            return found[-1]
        if not 0 <= version < len(found):
            raise SchemaNotFoundError(f"topic {topic} has no schema version {version}")
        return found[version]

    async def get_or_create(
        self, topic: str, schema: StoredSchema, strategy: str = "FULL", *, add: bool = True
    ) -> int:
        """The version of ``schema`` (its own ``version`` is ignored) on ``topic``,
        registering it as a new version if ``strategy`` lets it follow the existing ones
        (``schema_compat``); raise
        ``IncompatibleSchemaError``. Without ``add`` a schema not registered yet is refused
        (as Pulsar's producers are when schema auto update is disabled)."""
        for _ in range(_RETRIES):
            docs, node_version = await self._load(topic)
            existing = [self._stored(i, d) for i, d in enumerate(docs)]
            for stored in existing:
                if stored.type == schema.type and stored.data == schema.data:
                    return stored.version
            if not add:
                raise IncompatibleSchemaError(
                    "Schema not found and schema auto updating is disabled."
                )
            why = incompatibility(
                strategy,
                [(v.type, v.data) for v in existing],
                (schema.type, schema.data),
                schema.type in _RECORD_TYPES,
            )
            if why:
                raise IncompatibleSchemaError(f"{why} ({strategy})")
            docs.append(
                {
                    "type": schema.type,
                    "name": schema.name,
                    "data": base64.b64encode(schema.data).decode(),
                    "properties": dict(schema.properties),
                    "timestamp": int(self.now() * 1000) if self.now else 0,
                }
            )
            body = json.dumps({"versions": docs}).encode()
            try:
                await self.store.put(self.path(topic), body, node_version)
            except BadVersionError:
                continue  # another registration won the race: look again
            return len(docs) - 1
        raise BrokerError(f"could not register a schema on {topic}: too much contention")

    async def delete(self, topic: str) -> int:
        """Delete every version of ``topic``'s schema; return how many there were (0: none).
        The next schema registered starts again at version 0."""
        for _ in range(_RETRIES):
            found = await self.store.get(self.path(topic))
            if found is None:
                return 0
            try:
                await self.store.delete(self.path(topic), found.stat.version)
            except BadVersionError:
                continue
            except NotFoundError:
                return 0
            return len(json.loads(found.value)["versions"])
        raise BrokerError(f"could not delete the schema of {topic}: too much contention")
