"""What the broker reads from a stored Pulsar entry: key, deliver-at time, producer sequence."""

from __future__ import annotations

from polybroker.ledger.api import Entry
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import CodecError, split_tail


def _metadata(entry: Entry) -> pb.MessageMetadata | None:
    try:
        return split_tail(entry.data)[0]
    except CodecError:
        return None


def key_of_metadata(md: pb.MessageMetadata) -> bytes | None:
    """Pulsar's routing key: the ordering key, else the partition key (a batch's first)."""
    if md.HasField("ordering_key"):
        return md.ordering_key
    if md.HasField("partition_key"):
        return md.partition_key.encode()
    return None


class PulsarEntryInspector:
    """An ``EntryInspector`` for entries in the Pulsar stored format; None for any other."""

    def key_of(self, entry: Entry) -> bytes | None:
        md = _metadata(entry)
        return None if md is None else key_of_metadata(md)

    def deliver_at_ms(self, entry: Entry) -> int | None:
        md = _metadata(entry)
        if md is None or not md.HasField("deliver_at_time"):
            return None
        return md.deliver_at_time

    def producer_sequence(self, entry: Entry) -> tuple[str, int] | None:
        md = _metadata(entry)
        if md is None:
            return None
        highest = md.highest_sequence_id if md.HasField("highest_sequence_id") else 0
        if md.num_messages_in_batch > 1 and highest <= md.sequence_id:
            highest = md.sequence_id + md.num_messages_in_batch - 1
        return md.producer_name, max(md.sequence_id, highest)
