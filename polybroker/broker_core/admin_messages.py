"""One stored message as the admin API shows it (peek-messages, get-message-by-id).

Pulsar answers with the entry's payload, decompressed, as the body (for a batch: its messages,
each framed as ``size (u32) | SingleMessageMetadata | bytes``, which clients split) and the
entry's metadata in ``X-Pulsar-*`` headers; times are ISO-8601 in UTC, properties one JSON
object in ``X-Pulsar-PROPERTY``. Entries stored in another protocol's format are shown as the
Pulsar messages a Pulsar consumer would get.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

from polybroker.broker_core.messages import (
    DEFAULT_MAX_SIZE,
    decompress,
    split_entry,
    to_pulsar_entry,
)
from polybroker.broker_core.stored import stored_message_pb2 as pb
from polybroker.ledger.api import Entry

#: Pulsar's names of ``CompressionType`` values.
_COMPRESSION_NAMES = {pb.NONE: "NONE", pb.LZ4: "LZ4", pb.ZLIB: "ZLIB", pb.ZSTD: "ZSTD"}
_COMPRESSION_NAMES[pb.SNAPPY] = "SNAPPY"


def iso_time(ms: int) -> str:
    """``ms`` since the epoch as ISO-8601 in UTC with milliseconds (``...T12:00:00.000Z``)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def message_id(entry: Entry) -> str:
    """The ``X-Pulsar-Message-ID`` of an entry: ``ledgerId:entryId``."""
    return f"{entry.position.ledger_id}:{entry.position.entry_id}"


def render_message(entry: Entry, max_size: int = DEFAULT_MAX_SIZE) -> tuple[dict[str, str], bytes]:
    """The headers and body that show ``entry``. Raises ``MessageFormatError`` for an entry
    that cannot be decoded (or whose payload decompresses to more than ``max_size``)."""
    data = to_pulsar_entry(entry.data, max_size=max_size)
    md, payload = split_entry(data)
    body = decompress(md.compression, md.uncompressed_size, payload, max_size)
    headers = {
        "X-Pulsar-Message-ID": message_id(entry),
        "X-Pulsar-publish-time": iso_time(int(md.publish_time)),
        "X-Pulsar-producer-name": md.producer_name,
        "X-Pulsar-sequence-id": str(int(md.sequence_id)),
        "X-Pulsar-batch-size": str(len(payload)),
        "X-Pulsar-Broker-Entry-METADATA-timestamp": iso_time(entry.publish_time_ms),
        "X-Pulsar-Broker-Entry-METADATA-index": str(entry.last_index),
    }
    if md.properties:
        headers["X-Pulsar-PROPERTY"] = json.dumps({p.key: p.value for p in md.properties})
    if md.event_time:
        headers["X-Pulsar-event-time"] = iso_time(int(md.event_time))
    if md.HasField("partition_key"):
        headers["X-Pulsar-partition-key"] = md.partition_key
        if md.partition_key_b64_encoded:
            headers["X-Pulsar-partition-key-b64-encoded"] = "true"
    if md.HasField("ordering_key"):
        headers["X-Pulsar-Base64-ordering-key"] = base64.b64encode(md.ordering_key).decode()
    if md.null_value:
        headers["X-Pulsar-null-value"] = "true"
    if md.compression != pb.NONE:
        headers["X-Pulsar-compression"] = _COMPRESSION_NAMES.get(md.compression, "NONE")
        headers["X-Pulsar-uncompressed-size"] = str(md.uncompressed_size)
    if md.HasField("num_messages_in_batch"):
        headers["X-Pulsar-num-batch-message"] = str(md.num_messages_in_batch)
    return headers, body
