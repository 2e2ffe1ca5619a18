"""The one-log message format: how any protocol writes and reads a stored entry.

Every entry a topic stores is a Pulsar-format message or batch (DESIGN.md, "Data model"):

    magic 0x0e01 (u16) | crc32c (u32) | metadata size (u32) | Metadata | payload

where the payload is one message, or ``num_messages_in_batch`` messages each framed as
``size (u32) | SingleMetadata | bytes``, possibly compressed as a whole. The Pulsar handler sends
such an entry to its clients unchanged; every other protocol goes through this module, which is
protocol-neutral and imports no Twisted.

Foreign formats: a handler that stores its own native batches verbatim (cheaper than converting
each record on the write path) registers a decoder for a tag with ``register_format``; such an
entry carries the property ``entry.format=<tag>`` and the marker ``FOREIGN_ENTRY_MARKER`` (in
Pulsar's ``marker_type`` field, which clients never set on their messages) in its Metadata and the
native bytes as payload, and ``decode_entry`` converts it lazily for whoever reads it through
another protocol. A Pulsar message whose properties merely name ``entry.format`` stays a Pulsar
message.

Rule 1: decoders never read past the buffer they are given, bound every size they trust by
        ``max_size``, and raise ``MessageFormatError`` for anything malformed.
Rule 2: key, payload, properties, event time and publish time survive ``encode_entry`` ->
        ``decode_entry`` unchanged (keys that are not UTF-8 are stored base64-encoded, flagged).
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError, EncodeError

from polybroker.broker_core.stored import stored_message_pb2 as pb
from polybroker.compression import snappy_length

try:  # the checksum is in C when the crc32c package is there (a declared dependency)
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the dependency is declared
    _crc32c = None

MAGIC_CRC32C = 0x0E01
FORMAT_PROPERTY = "entry.format"
_FORMAT_KEY = FORMAT_PROPERTY.encode()
PULSAR_FORMAT = "pulsar"
#: ``marker_type`` of a foreign-format entry (beyond the values Pulsar uses for its markers).
FOREIGN_ENTRY_MARKER = 1000
DEFAULT_MAX_SIZE = 64 * 1024 * 1024

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_HEAD = struct.Struct(">HII")  # magic, checksum, metadata size

_COMPRESSIONS = {
    "none": pb.NONE,
    "lz4": pb.LZ4,
    "zlib": pb.ZLIB,
    "zstd": pb.ZSTD,
    "snappy": pb.SNAPPY,
}


class MessageFormatError(ValueError):
    """Stored bytes are not a well-formed entry (or exceed a size limit)."""


@dataclass(slots=True)
class Message:
    """One message, as every protocol sees it."""

    payload: bytes
    key: bytes | None = None
    properties: list[tuple[str, str]] = field(default_factory=list)
    event_time_ms: int = 0
    publish_time_ms: int = 0
    null_value: bool = False
    #: Set on decode: the producer's sequence id of this message (a batch's first + index).
    sequence_id: int = -1


#: A foreign-format decoder: (native payload, the entry-level fields as a template) -> messages.
FormatDecoder = Callable[[bytes, Message], list[Message]]

_FORMATS: dict[str, FormatDecoder] = {}


def register_format(tag: str, decoder: FormatDecoder) -> None:
    """Make entries tagged ``tag`` readable by ``decode_entry`` (idempotent per tag)."""
    if not tag or tag == PULSAR_FORMAT:
        raise ValueError(f"invalid entry format tag {tag!r}")
    _FORMATS[tag] = decoder


def crc32c(data: bytes) -> int:
    """The Castagnoli checksum Pulsar frames use."""
    if _crc32c is None:  # pragma: no cover
        raise RuntimeError("the crc32c package is required")
    return int(_crc32c(data))


# -- encoding ------------------------------------------------------------------------------


def _set_key(md: pb.Metadata | pb.SingleMetadata, key: bytes | None) -> None:
    if key is None:
        return
    try:
        md.partition_key = key.decode("utf-8")
    except UnicodeDecodeError:
        md.partition_key = base64.b64encode(key).decode("ascii")
        md.partition_key_b64_encoded = True


def _set_properties(md: pb.Metadata | pb.SingleMetadata, props: Sequence[tuple[str, str]]) -> None:
    for k, v in props:
        md.properties.add(key=k, value=v)


def _compress(kind: str, data: bytes) -> tuple[int, bytes]:
    code = _COMPRESSIONS.get(kind)
    if code is None:
        raise MessageFormatError(f"unknown compression {kind!r}")
    if code == pb.NONE:
        return code, data
    if code == pb.LZ4:
        import lz4.block

        return code, lz4.block.compress(data, store_size=False)
    if code == pb.ZLIB:
        return code, zlib.compress(data)
    if code == pb.ZSTD:
        import zstandard

        return code, zstandard.ZstdCompressor().compress(data)
    import snappy

    return code, snappy.compress(data)


def _frame(md: pb.Metadata, payload: bytes) -> bytes:
    raw = md.SerializeToString()
    rest = _U32.pack(len(raw)) + raw + payload
    return _U16.pack(MAGIC_CRC32C) + _U32.pack(crc32c(rest)) + rest


def encode_entry(
    messages: Sequence[Message],
    *,
    producer_name: str,
    sequence_id: int,
    publish_time_ms: int,
    compression: str = "none",
) -> bytes:
    """Encode messages as one stored entry: one message as a lone Pulsar message, several as a
    Pulsar batch (publish it with ``num_messages=len(messages)``)."""
    if not messages:
        raise MessageFormatError("an entry holds at least one message")
    md = pb.Metadata(
        producer_name=producer_name,
        sequence_id=max(sequence_id, 0),
        publish_time=max(publish_time_ms, 0),
    )
    if len(messages) == 1:
        m = messages[0]
        _set_key(md, m.key)
        _set_properties(md, m.properties)
        if m.event_time_ms > 0:
            md.event_time = m.event_time_ms
        if m.null_value:
            md.null_value = True
        body = m.payload
    else:
        md.num_messages_in_batch = len(messages)
        md.highest_sequence_id = max(sequence_id, 0) + len(messages) - 1
        parts: list[bytes] = []
        for i, m in enumerate(messages):
            smm = pb.SingleMetadata(payload_size=len(m.payload), sequence_id=sequence_id + i)
            _set_key(smm, m.key)
            _set_properties(smm, m.properties)
            if m.event_time_ms > 0:
                smm.event_time = m.event_time_ms
            if m.null_value:
                smm.null_value = True
            raw = smm.SerializeToString()
            parts += [_U32.pack(len(raw)), raw, m.payload]
        body = b"".join(parts)
    code, payload = _compress(compression, body)
    if code != pb.NONE:
        md.compression = code  # type: ignore[assignment]
        md.uncompressed_size = len(body)
    return _frame(md, payload)


def encode_native_entry(
    tag: str,
    native: bytes,
    *,
    num_messages: int,
    producer_name: str,
    sequence_id: int,
    publish_time_ms: int,
) -> bytes:
    """Wrap a foreign-format batch (``register_format``'s ``tag``) as a stored entry."""
    if tag == PULSAR_FORMAT or not tag:
        raise MessageFormatError(f"invalid entry format tag {tag!r}")
    md = pb.Metadata(
        producer_name=producer_name,
        sequence_id=max(sequence_id, 0),
        publish_time=max(publish_time_ms, 0),
        num_messages_in_batch=num_messages,
        marker_type=FOREIGN_ENTRY_MARKER,
    )
    md.properties.add(key=FORMAT_PROPERTY, value=tag)
    return _frame(md, native)


# -- decoding ------------------------------------------------------------------------------


def split_entry(data: bytes) -> tuple[pb.Metadata, bytes]:
    """Parse an entry into its Metadata and (still compressed) payload; the checksum is not
    verified here (``verify_checksum`` does)."""
    if len(data) < _HEAD.size:
        raise MessageFormatError("entry too short")
    magic, _, md_size = _HEAD.unpack_from(data, 0)
    if magic != MAGIC_CRC32C:
        raise MessageFormatError("not a stored message entry (bad magic)")
    if md_size > len(data) - _HEAD.size:
        raise MessageFormatError(f"metadata size {md_size} runs past the entry")
    md = pb.Metadata()
    try:
        md.ParseFromString(data[_HEAD.size : _HEAD.size + md_size])
    except (DecodeError, EncodeError, ValueError) as e:
        raise MessageFormatError(f"malformed message metadata: {e}") from None
    return md, data[_HEAD.size + md_size :]


def verify_checksum(data: bytes) -> bool:
    """Whether the entry's crc32c covers its metadata and payload."""
    if len(data) < _HEAD.size:
        return False
    _, checksum, _ = _HEAD.unpack_from(data, 0)
    return crc32c(data[6:]) == checksum


def entry_format(data: bytes) -> str:
    """The entry's format tag: ``"pulsar"`` or a ``register_format`` tag."""
    md, _ = split_entry(data)
    return metadata_format(md)


def metadata_format(md: pb.Metadata) -> str:
    """The format tag of an entry's parsed Metadata (``split_entry``)."""
    if md.marker_type != FOREIGN_ENTRY_MARKER:
        return PULSAR_FORMAT
    for p in md.properties:
        if p.key == FORMAT_PROPERTY:
            return p.value
    return PULSAR_FORMAT


def decompress(code: int, uncompressed_size: int, payload: bytes, limit: int) -> bytes:
    """Undo a payload's compression (``code`` as Pulsar numbers it: 0 none, 1 LZ4, 2 ZLIB,
    3 ZSTD, 4 SNAPPY); refuse a result above ``limit`` bytes, and a payload whose own header
    declares more than ``uncompressed_size`` (or ``limit``) before decompressing it (the zstd
    and snappy libraries set aside what the data declares)."""
    if code == pb.NONE:
        return payload
    if uncompressed_size > limit:
        raise MessageFormatError(
            f"uncompressed size {uncompressed_size} exceeds the limit of {limit}"
        )
    bound = uncompressed_size or limit
    try:
        if code == pb.LZ4:
            import lz4.block

            out = lz4.block.decompress(payload, uncompressed_size=uncompressed_size)
        elif code == pb.ZLIB:
            out = zlib.decompressobj().decompress(payload, uncompressed_size or limit)
        elif code == pb.ZSTD:
            import zstandard

            if zstandard.frame_content_size(payload) > bound:
                raise MessageFormatError(f"zstd frame declares more than {bound} bytes")
            out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=bound)
        elif code == pb.SNAPPY:
            import snappy

            declared = snappy_length(payload)
            if declared is None or declared > bound:
                raise MessageFormatError(f"snappy block declares {declared}, above {bound} bytes")
            out = snappy.uncompress(payload)
        else:
            raise MessageFormatError(f"unknown compression {code}")
    except MessageFormatError:
        raise
    except Exception as e:
        raise MessageFormatError(f"cannot decompress payload: {e}") from None
    if len(out) > limit:
        raise MessageFormatError(f"uncompressed payload exceeds the limit of {limit}")
    return bytes(out)


def _key_of(md: pb.Metadata | pb.SingleMetadata) -> bytes | None:
    if md.HasField("ordering_key"):
        return bytes(md.ordering_key)
    if not md.HasField("partition_key"):
        return None
    if md.partition_key_b64_encoded:
        try:
            return base64.b64decode(md.partition_key, validate=True)
        except (binascii.Error, ValueError):
            raise MessageFormatError("partition key is not valid base64") from None
    return md.partition_key.encode("utf-8")


def decode_entry(data: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> list[Message]:
    """Decode any stored entry (lone, batch, compressed, or a registered foreign format)."""
    md, payload = split_entry(data)
    fmt = metadata_format(md)
    publish = int(md.publish_time)
    if fmt != PULSAR_FORMAT:
        decoder = _FORMATS.get(fmt)
        if decoder is None:
            raise MessageFormatError(f"entry format {fmt!r} has no registered decoder")
        template = Message(b"", publish_time_ms=publish, sequence_id=int(md.sequence_id))
        return decoder(payload, template)
    body = decompress(md.compression, md.uncompressed_size, payload, max_size)
    props = [(p.key, p.value) for p in md.properties]
    if not md.HasField("num_messages_in_batch"):  # a lone message; a batch always says so
        return [
            Message(
                body,
                key=_key_of(md),
                properties=props,
                event_time_ms=int(md.event_time),
                publish_time_ms=publish,
                null_value=md.null_value,
                sequence_id=int(md.sequence_id),
            )
        ]
    return _decode_batch(md, body, publish)


def decode_batch_payload(body: bytes, count: int) -> list[Message]:
    """Split the uncompressed payload of a batch of ``count`` messages (as the admin API shows
    a batched entry) into its messages."""
    return _decode_batch(pb.Metadata(num_messages_in_batch=count), body, 0)


def _decode_batch(md: pb.Metadata, body: bytes, publish: int) -> list[Message]:
    count = md.num_messages_in_batch
    if count < 0 or count > len(body) // 4 + 1:
        raise MessageFormatError(f"batch claims {count} messages in {len(body)} bytes")
    out: list[Message] = []
    pos = 0
    for i in range(count):
        if len(body) - pos < 4:
            raise MessageFormatError("truncated batch: no single-message metadata size")
        (size,) = _U32.unpack_from(body, pos)
        pos += 4
        if size > len(body) - pos:
            raise MessageFormatError("single-message metadata runs past the batch")
        smm = pb.SingleMetadata()
        try:
            smm.ParseFromString(body[pos : pos + size])
        except (DecodeError, EncodeError, ValueError) as e:
            raise MessageFormatError(f"malformed single-message metadata: {e}") from None
        pos += size
        n = smm.payload_size
        if n < 0 or n > len(body) - pos:
            raise MessageFormatError("message payload runs past the batch")
        seq = int(smm.sequence_id) if smm.HasField("sequence_id") else int(md.sequence_id) + i
        out.append(
            Message(
                body[pos : pos + n],
                key=_key_of(smm),
                properties=[(p.key, p.value) for p in smm.properties],
                event_time_ms=int(smm.event_time) or int(md.event_time),
                publish_time_ms=publish,
                null_value=smm.null_value,
                sequence_id=seq,
            )
        )
        pos += n
    return out


def to_pulsar_entry(data: bytes, *, max_size: int = DEFAULT_MAX_SIZE) -> bytes:
    """Return the entry in the Pulsar format: unchanged when it is, else converted through its
    registered decoder (for the Pulsar handler, whose clients read stored entries verbatim).

    Cheap for Pulsar-format entries: their metadata is parsed only if its bytes name the
    format property at all."""
    if len(data) >= _HEAD.size:
        magic, _, md_size = _HEAD.unpack_from(data, 0)
        # ``find`` within bounds: no copy of the metadata (this runs once per entry sent).
        if magic == MAGIC_CRC32C and data.find(_FORMAT_KEY, _HEAD.size, _HEAD.size + md_size) < 0:
            return data
    md, _ = split_entry(data)
    if metadata_format(md) == PULSAR_FORMAT:
        return data
    messages = decode_entry(data, max_size=max_size)
    return encode_entry(
        messages,
        producer_name=md.producer_name,
        sequence_id=int(md.sequence_id),
        publish_time_ms=int(md.publish_time),
    )
