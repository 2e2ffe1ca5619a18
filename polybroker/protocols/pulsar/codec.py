"""Sans-IO codec of the Pulsar binary protocol: frames in, frames out, no networking.

Rules this module keeps:

1. Every size read from the wire is bounded before anything is allocated for it: a frame never
   exceeds ``max_frame_size``, a command never exceeds its frame, metadata never exceeds its
   payload. A violation raises ``CodecError`` (or a subclass) with a clear message.
2. A payload command's tail is kept byte for byte as the entry the broker stores:
   ``[0x0e01][crc32c][metadataSize][MessageMetadata][payload]``. A tail that arrived without a
   checksum (protocol < 6) is given one, so every stored entry has the same shape.
3. A bad checksum is not a framing error: the frame decodes with ``checksum_ok=False`` so the
   connection can answer with the protocol's ChecksumError and keep going.

All integers are big-endian.
"""

from __future__ import annotations

import struct
from collections.abc import Generator, Iterable
from typing import NamedTuple

import crc32c as _crc32c
from google.protobuf.message import DecodeError, EncodeError

from polybroker.broker_core import messages
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb

MAGIC_CRC32C = 0x0E01
MAGIC_BROKER_ENTRY_METADATA = 0x0E02
#: Slack above ``maxMessageSize`` for the command and metadata of a full-size message.
FRAME_OVERHEAD = 10 * 1024
DEFAULT_MAX_MESSAGE_SIZE = 5 * 1024 * 1024
#: The newest protocol version this broker speaks.
MAX_PROTOCOL_VERSION = 20

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U32U32 = struct.Struct(">II")
_HEAD = struct.Struct(">HII")  # a stored entry's magic, checksum and metadata size

Type = pb.BaseCommand.Type


class CodecError(Exception):
    """The bytes are not a valid Pulsar frame; the connection must be closed."""


class FrameTooLargeError(CodecError):
    """A frame declares a size above the limit."""


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of ``data``."""
    return _crc32c.crc32c(data)


class Frame(NamedTuple):
    """One decoded frame: the command and, for payload commands, the normalized tail.

    A named tuple: one is built per frame, and a tuple costs less to build than a frozen
    dataclass."""

    command: pb.BaseCommand
    payload: bytes | None = None
    checksum_ok: bool = True


class SendFrame(NamedTuple):
    """A SEND of the usual shape, decoded without protobuf (``FrameDecoder(fast_send=True)``):
    what ``Frame.command.send`` would hold for it, and the frame's normalized tail.

    ``num_messages`` and ``highest_sequence_id`` are the protobuf defaults (1, 0) when absent."""

    producer_id: int
    sequence_id: int
    num_messages: int
    highest_sequence_id: int
    payload: bytes
    checksum_ok: bool = True


_new_tuple = tuple.__new__

# -- encoding ------------------------------------------------------------------------------


def encode_command(command: pb.BaseCommand) -> bytes:
    """Frame a simple command: ``[totalSize][commandSize][command]``."""
    body = command.SerializeToString()
    return _U32U32.pack(len(body) + 4, len(body)) + body


def encode_payload_command(command: pb.BaseCommand, tail: bytes) -> bytes:
    """Frame a payload command; ``tail`` is a stored entry (``0x0e01``, checksum, metadata,
    payload) and is sent unchanged."""
    body = command.SerializeToString()
    return _U32U32.pack(4 + len(body) + len(tail), len(body)) + body + tail


# Hand-built encodings of the two commands sent once per stored entry (SEND_RECEIPT and
# MESSAGE). They are byte for byte what ``command(...).SerializeToString()`` gives for the
# same fields (proto2 serializes set fields in field-number order; repeated int64 unpacked;
# a negative int32 or int64 is the ten-byte varint of its two's complement), without building
# protobuf objects. The unit tests compare both encodings over many values.

_VARINT_1 = [bytes([i]) for i in range(128)]
_MASK64 = (1 << 64) - 1


def _varint(value: int) -> bytes:
    """Protobuf varint of ``value``; a negative one as its 64-bit two's complement."""
    if 0 <= value < 0x80:
        return _VARINT_1[value]
    if 0 < value < 0x4000:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if 0 < value < 0x200000:
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ``partition`` and ``batch_index`` (-1) of the message ids sent, by partition.
_ID_TAIL_CACHE: dict[int, bytes] = {}
_NO_BATCH_INDEX = b"\x20" + _varint(-1)


def _message_id_body(ledger_id: int, entry_id: int, partition: int) -> bytes:
    """``MessageIdData`` with ledgerId, entryId, partition and batch_index (-1) set."""
    tail = _ID_TAIL_CACHE.get(partition)
    if tail is None:
        tail = b"\x18" + _varint(partition) + _NO_BATCH_INDEX
        if len(_ID_TAIL_CACHE) < 4096:
            _ID_TAIL_CACHE[partition] = tail
    return b"".join((b"\x08", _varint(ledger_id), b"\x10", _varint(entry_id), tail))


def _frame_command(field_key: bytes, body: bytes) -> bytes:
    """``BaseCommand`` bytes whose ``type`` and length-delimited sub-command lead with
    ``field_key`` (type varint, sub-command tag) and hold ``body``."""
    return field_key + _varint(len(body)) + body


_SEND_RECEIPT_KEY = b"\x08" + _varint(int(Type.SEND_RECEIPT)) + b"\x3a"  # field 7
_MESSAGE_KEY = b"\x08" + _varint(int(Type.MESSAGE)) + b"\x4a"  # field 9


def encode_send_receipt(
    producer_id: int,
    sequence_id: int,
    ledger_id: int,
    entry_id: int,
    partition: int,
    highest_sequence_id: int,
) -> bytes:
    """Frame a SEND_RECEIPT with every field set (message id batch index -1): the bytes of
    ``encode_command(command(T.SEND_RECEIPT, "send_receipt", ...))`` with ``message_id(...)``."""
    mid = _message_id_body(ledger_id, entry_id, partition)
    body = b"".join(
        (
            b"\x08",
            _varint(producer_id),
            b"\x10",
            _varint(sequence_id),
            b"\x1a",
            _varint(len(mid)),
            mid,
            b"\x20",
            _varint(highest_sequence_id),
        )
    )
    cmd = _frame_command(_SEND_RECEIPT_KEY, body)
    return _U32U32.pack(len(cmd) + 4, len(cmd)) + cmd


def encode_message(
    consumer_id: int,
    ledger_id: int,
    entry_id: int,
    partition: int,
    redelivery_count: int,
    ack_set: list[int],
    tail: bytes,
) -> bytes:
    """Frame a MESSAGE carrying the stored entry ``tail``: the bytes of
    ``encode_payload_command`` of a ``CommandMessage`` with consumer_id, message_id (batch
    index -1), redelivery_count and ``ack_set`` (signed 64-bit words) set."""
    mid = _message_id_body(ledger_id, entry_id, partition)
    parts = [
        b"\x08",
        _varint(consumer_id),
        b"\x12",
        _varint(len(mid)),
        mid,
        b"\x18",
        _varint(redelivery_count),
    ]
    for word in ack_set:
        parts += (b"\x20", _varint(word))
    cmd = _frame_command(_MESSAGE_KEY, b"".join(parts))
    return _U32U32.pack(4 + len(cmd) + len(tail), len(cmd)) + cmd + tail


def _id_tail(partition: int) -> bytes:
    """The ``partition`` and ``batch_index`` (-1) fields of a message id sent."""
    tail = _ID_TAIL_CACHE.get(partition)
    if tail is None:
        tail = b"\x18" + _varint(partition) + _NO_BATCH_INDEX
        if len(_ID_TAIL_CACHE) < 4096:
            _ID_TAIL_CACHE[partition] = tail
    return tail


def encode_messages(
    consumer_id: int,
    partition: int,
    rows: Iterable[tuple[int, int, int, list[int], bytes]],
) -> bytes:
    """The MESSAGE frames of ``rows`` (ledger id, entry id, redelivery count, ack set, stored
    entry), joined: for each the bytes of ``encode_message`` with these arguments. What is
    the same for every frame of the consumer (or of a ledger) is encoded once."""
    varint = _varint
    small = _VARINT_1
    pack = _U32U32.pack
    head = b"\x08" + varint(consumer_id) + b"\x12"
    id_tail = _id_tail(partition)
    last_ledger: int | None = None
    ledger_part = b""
    fixed = 0
    out: list[bytes] = []
    append = out.append
    for ledger_id, entry_id, redelivery_count, ack_set, tail in rows:
        if ledger_id != last_ledger:
            last_ledger = ledger_id
            ledger_part = b"\x08" + varint(ledger_id) + b"\x10"
            fixed = len(ledger_part) + len(id_tail)
        entry = varint(entry_id)
        if redelivery_count or ack_set:
            rest = b"\x18" + varint(redelivery_count)
            if ack_set:
                rest += b"".join([b"\x20" + varint(word) for word in ack_set])
        else:
            rest = b"\x18\x00"
        # The message id is at most 44 bytes: its size is one varint byte.
        body = head + small[fixed + len(entry)] + ledger_part + entry + id_tail + rest
        size = len(body)
        cmd = _MESSAGE_KEY + (small[size] if size < 0x80 else varint(size)) + body
        append(pack(4 + len(cmd) + len(tail), len(cmd)))
        append(cmd)
        append(tail)
    return b"".join(out)


def encode_send_receipts(
    producer_id: int, partition: int, rows: Iterable[tuple[int, int, int, int]]
) -> bytes:
    """The SEND_RECEIPT frames of ``rows`` (sequence id, ledger id, entry id, highest
    sequence id), joined: for each the bytes of ``encode_send_receipt`` with these
    arguments. What is the same for every receipt of the producer (or of a ledger) is
    encoded once."""
    varint = _varint
    small = _VARINT_1
    pack = _U32U32.pack
    head = b"\x08" + varint(producer_id) + b"\x10"
    id_tail = _id_tail(partition)
    last_ledger: int | None = None
    ledger_part = b""
    fixed = 0
    out: list[bytes] = []
    append = out.append
    for sequence_id, ledger_id, entry_id, highest in rows:
        if ledger_id != last_ledger:
            last_ledger = ledger_id
            ledger_part = b"\x08" + varint(ledger_id) + b"\x10"
            fixed = len(ledger_part) + len(id_tail)
        entry = varint(entry_id)
        body = (
            head
            + varint(sequence_id)
            + b"\x1a"
            + small[fixed + len(entry)]  # a message id is at most 44 bytes
            + ledger_part
            + entry
            + id_tail
            + b"\x20"
            + varint(highest)
        )
        # At most 12 + 10 + 2 + 44 + 11 bytes: the body's size is one varint byte, and the
        # command is the 3-byte key, that byte and the body.
        size = len(body)
        append(pack(size + 8, size + 4))
        append(_SEND_RECEIPT_KEY)
        append(small[size])
        append(body)
    return b"".join(out)


def build_tail(metadata: pb.MessageMetadata, payload: bytes) -> bytes:
    """Build a stored entry from metadata and (possibly compressed, possibly batched) payload."""
    md = metadata.SerializeToString()
    rest = _U32.pack(len(md)) + md + payload
    return _U16.pack(MAGIC_CRC32C) + _U32.pack(crc32c(rest)) + rest


def command(type_: int, field: str | None = None, **fields: object) -> pb.BaseCommand:
    """Build a ``BaseCommand`` of ``type_`` whose sub-command ``field`` holds ``fields``.

    Message-typed values are copied in; lists extend repeated fields."""
    cmd = pb.BaseCommand(type=type_)  # type: ignore[arg-type]
    if field is not None:
        sub = getattr(cmd, field)
        sub.SetInParent()
        for name, value in fields.items():
            if value is None:
                continue
            target = getattr(sub, name)
            if isinstance(value, list | tuple):
                for item in value:
                    if hasattr(item, "SerializeToString"):
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)
            elif hasattr(value, "SerializeToString"):
                target.CopyFrom(value)
            else:
                setattr(sub, name, value)
    return cmd


# -- decoding ------------------------------------------------------------------------------


def _parse_command(data: bytes) -> pb.BaseCommand:
    cmd = pb.BaseCommand()
    try:
        cmd.ParseFromString(data)
    except (DecodeError, EncodeError, ValueError) as e:
        raise CodecError(f"malformed command: {e}") from None
    if not cmd.IsInitialized():
        missing = ", ".join(cmd.FindInitializationErrors())
        raise CodecError(f"command lacks required fields: {missing}")
    return cmd


def normalize_tail(tail: bytes) -> tuple[bytes, bool]:
    """Return the tail as stored (checksummed) and whether its checksum matched.

    Skips a leading broker entry metadata block; raises ``CodecError`` if the layout is bad."""
    if len(tail) >= 10:
        # The usual tail, already checksummed: one read of its header.
        magic, checksum, md_size = _HEAD.unpack_from(tail, 0)
        if magic == MAGIC_CRC32C:
            if md_size > len(tail) - 10:
                raise CodecError(f"metadata size {md_size} runs past the frame")
            return tail, _crc32c.crc32c(tail[6:]) == checksum
    pos = 0
    if len(tail) >= 6 and _U16.unpack_from(tail, 0)[0] == MAGIC_BROKER_ENTRY_METADATA:
        (bem_size,) = _U32.unpack_from(tail, 2)
        pos = 6 + bem_size
        if pos > len(tail):
            raise CodecError("broker entry metadata runs past the frame")
    if len(tail) - pos >= 2 and _U16.unpack_from(tail, pos)[0] == MAGIC_CRC32C:
        if len(tail) - pos < 10:
            raise CodecError("truncated payload header")
        (checksum,) = _U32.unpack_from(tail, pos + 2)
        rest = tail[pos + 6 :]
        _check_metadata_size(rest)
        return (tail[pos:] if pos else tail), crc32c(rest) == checksum
    rest = tail[pos:]
    _check_metadata_size(rest)
    return _U16.pack(MAGIC_CRC32C) + _U32.pack(crc32c(rest)) + rest, True


def _check_metadata_size(rest: bytes) -> None:
    if len(rest) < 4:
        raise CodecError("truncated payload: no metadata size")
    (md_size,) = _U32.unpack_from(rest, 0)
    if md_size > len(rest) - 4:
        raise CodecError(f"metadata size {md_size} runs past the frame")


# A BaseCommand holding only ``type`` = SEND (field 1) then ``send`` (field 6, one length byte).
_SEND_PREFIX = bytes((0x08, int(Type.SEND), 0x32))
_U64_LIMIT = 1 << 64
_INT32_LIMIT = 1 << 31


def parse_send(buf: bytes, start: int, end: int) -> tuple[int, int, int, int] | None:
    """Decode the command ``buf[start:end]`` as a SEND of the usual shape, without protobuf.

    The usual shape: ``type`` SEND, then ``send`` and nothing else, the ``CommandSend`` holding
    only varint fields among ``producer_id``, ``sequence_id`` (both present), ``num_messages``
    (0 to 2**31-1) and ``highest_sequence_id``, each at most 64 bits (a repeated field: the
    last wins, as in protobuf). Return (producer id, sequence id, num_messages,
    highest_sequence_id), the values protobuf would give; None for any other command or shape
    (protobuf then decides: another command, other fields, or bad bytes). Reads only within
    ``buf[start:end]``."""
    size = end - start - 4  # the CommandSend's, when its length is one byte
    if not 4 <= size < 0x80 or buf[start + 3] != size or buf[start : start + 3] != _SEND_PREFIX:
        return None
    pos = start + 4
    producer_id = sequence_id = -1
    num_messages = 1
    highest = 0
    while pos < end:
        key = buf[pos]
        value = buf[pos + 1] if pos + 1 < end else 0x80
        pos += 2
        if value >= 0x80:
            value &= 0x7F
            shift = 7
            while True:
                if pos >= end or shift > 63:
                    return None
                byte = buf[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                shift += 7
            if value >= _U64_LIMIT:
                return None
        if key == 0x08:
            producer_id = value
        elif key == 0x10:
            sequence_id = value
        elif key == 0x18:
            if value >= _INT32_LIMIT:
                return None  # a negative int32 (or one protobuf would truncate)
            num_messages = value
        elif key == 0x30:
            highest = value
        else:
            return None
    if pos != end or producer_id < 0 or sequence_id < 0:
        return None
    return producer_id, sequence_id, num_messages, highest


def decode_frame(frame: bytes) -> Frame:
    """Decode one frame's body (everything after ``totalSize``)."""
    return _decode_body(frame, 0, len(frame))


def _decode_body(buf: bytes, start: int, end: int) -> Frame:
    """Decode the frame body ``buf[start:end]`` without copying it first."""
    if end - start < 4:
        raise CodecError("frame shorter than its command size field")
    (cmd_size,) = _U32.unpack_from(buf, start)
    if cmd_size > end - start - 4:
        raise CodecError(f"command size {cmd_size} runs past the frame of {end - start} bytes")
    cmd_end = start + 4 + cmd_size
    cmd = _parse_command(buf[start + 4 : cmd_end])
    # ``tuple.__new__`` builds the named tuple without its Python-level ``__new__``.
    if cmd_end == end:
        return _new_tuple(Frame, (cmd, None, True))
    stored, ok = normalize_tail(buf[cmd_end:end])
    return _new_tuple(Frame, (cmd, stored, ok))


class FrameDecoder:
    """Accumulates bytes and yields complete frames.

    ``feed`` raises ``CodecError`` on the first bad frame; the decoder is then unusable. With
    ``fast_send``, a SEND of the usual shape (``parse_send``) comes as a ``SendFrame``, built
    without protobuf; every other frame as a ``Frame``."""

    def __init__(
        self,
        max_frame_size: int = DEFAULT_MAX_MESSAGE_SIZE + FRAME_OVERHEAD,
        *,
        fast_send: bool = False,
    ) -> None:
        self.max_frame_size = max_frame_size
        self.fast_send = fast_send
        self._buf = bytearray()

    def feed(self, data: bytes) -> Generator[Frame | SendFrame, None, None]:
        """Add ``data``; yield every frame now complete. Closed early, the generator leaves
        the frames it did not yield buffered, for the next ``feed`` (``b""`` to take them)."""
        pending = self._buf
        if pending:
            pending += data
            if len(pending) >= 4:
                (size,) = _U32.unpack_from(pending, 0)
                if 4 <= size <= self.max_frame_size and len(pending) - 4 < size:
                    return  # the first frame is still incomplete: nothing to copy yet
            buf = bytes(pending)
            pending.clear()
        else:
            # The usual case: frames are decoded straight from the bytes received.
            buf = bytes(data)
        start = 0
        n = len(buf)
        fast = self.fast_send
        unpack_u32 = _U32.unpack_from
        try:
            while n - start >= 4:
                (size,) = unpack_u32(buf, start)
                if size > self.max_frame_size:
                    raise FrameTooLargeError(
                        f"frame of {size} bytes exceeds the limit of {self.max_frame_size}"
                    )
                if size < 4:
                    raise CodecError(f"frame size {size} is too small")
                end = start + 4 + size
                if end > n:
                    break
                if fast and size > 12:
                    (cmd_size,) = unpack_u32(buf, start + 4)
                    cmd_end = start + 8 + cmd_size
                    if cmd_end < end:  # a payload command whose command fits the frame
                        send = parse_send(buf, start + 8, cmd_end)
                        if send is not None:
                            stored, ok = normalize_tail(buf[cmd_end:end])
                            start = end
                            yield _new_tuple(SendFrame, (*send, stored, ok))
                            continue
                frame = _decode_body(buf, start + 4, end)
                start = end
                yield frame
        finally:
            if start < n:
                self._buf += buf[start:] if start else buf

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


# -- stored entries ------------------------------------------------------------------------


def split_tail(tail: bytes) -> tuple[pb.MessageMetadata, bytes]:
    """Parse a stored entry into its ``MessageMetadata`` and payload; raise ``CodecError``."""
    if len(tail) < 10 or _U16.unpack_from(tail, 0)[0] != MAGIC_CRC32C:
        raise CodecError("not a Pulsar entry")
    (md_size,) = _U32.unpack_from(tail, 6)
    if md_size > len(tail) - 10:
        raise CodecError(f"metadata size {md_size} runs past the entry")
    md = pb.MessageMetadata()
    try:
        md.ParseFromString(tail[10 : 10 + md_size])
    except (DecodeError, ValueError) as e:
        raise CodecError(f"malformed message metadata: {e}") from None
    return md, tail[10 + md_size :]


def metadata_is_complete(tail: bytes, scratch: pb.MessageMetadata) -> bool:
    """Whether a stored entry's ``MessageMetadata`` has every required field, parsed into
    ``scratch`` (its previous content is replaced; reusing one spares an allocation per
    message); raise ``CodecError`` where ``split_tail`` would."""
    if len(tail) < 10:
        raise CodecError("not a Pulsar entry")
    magic, _, md_size = _HEAD.unpack_from(tail, 0)
    if magic != MAGIC_CRC32C:
        raise CodecError("not a Pulsar entry")
    if md_size > len(tail) - 10:
        raise CodecError(f"metadata size {md_size} runs past the entry")
    try:
        scratch.ParseFromString(tail[10 : 10 + md_size])
    except (DecodeError, ValueError) as e:
        raise CodecError(f"malformed message metadata: {e}") from None
    return scratch.IsInitialized()


def decompress(metadata: pb.MessageMetadata, payload: bytes, limit: int) -> bytes:
    """Undo the payload's compression; refuse an uncompressed size above ``limit``."""
    try:
        return messages.decompress(metadata.compression, metadata.uncompressed_size, payload, limit)
    except messages.MessageFormatError as e:
        raise CodecError(str(e)) from None


def decode_batch(
    metadata: pb.MessageMetadata, payload: bytes
) -> list[tuple[pb.SingleMessageMetadata, bytes]]:
    """Split an uncompressed batch payload into its messages; raise ``CodecError``."""
    count = metadata.num_messages_in_batch
    out: list[tuple[pb.SingleMessageMetadata, bytes]] = []
    pos = 0
    for _ in range(count):
        if len(payload) - pos < 4:
            raise CodecError("truncated batch: no single-message metadata size")
        (size,) = _U32.unpack_from(payload, pos)
        pos += 4
        if size > len(payload) - pos:
            raise CodecError("single-message metadata runs past the batch")
        smm = pb.SingleMessageMetadata()
        try:
            smm.ParseFromString(payload[pos : pos + size])
        except (DecodeError, ValueError) as e:
            raise CodecError(f"malformed single-message metadata: {e}") from None
        pos += size
        n = smm.payload_size
        if n < 0 or n > len(payload) - pos:
            raise CodecError("message payload runs past the batch")
        out.append((smm, payload[pos : pos + n]))
        pos += n
    return out


def encode_batch(messages: list[tuple[pb.SingleMessageMetadata, bytes]]) -> bytes:
    """Build an uncompressed batch payload (the inverse of ``decode_batch``)."""
    parts: list[bytes] = []
    for smm, data in messages:
        smm.payload_size = len(data)
        raw = smm.SerializeToString()
        parts += [_U32.pack(len(raw)), raw, data]
    return b"".join(parts)


# -- message ids ---------------------------------------------------------------------------

_U64 = 1 << 64


def to_signed64(value: int) -> int:
    """Read a uint64 wire value as the int64 the client meant (2**64-1 is -1)."""
    return value - _U64 if value >= 1 << 63 else value


def to_unsigned64(value: int) -> int:
    """Write an int64 (possibly -1) into a uint64 field."""
    return value + _U64 if value < 0 else value


def message_id(
    ledger_id: int, entry_id: int, partition: int = -1, batch_index: int = -1
) -> pb.MessageIdData:
    """A ``MessageIdData``; negative ledger/entry ids are written as the client expects."""
    return pb.MessageIdData(
        ledgerId=to_unsigned64(ledger_id),
        entryId=to_unsigned64(entry_id),
        partition=partition,
        batch_index=batch_index,
    )


def ack_set_words(bits: int, size: int) -> list[int]:
    """Pack a bitset of ``size`` bits into signed 64-bit words (BitSet.toLongArray order)."""
    words: list[int] = []
    for start in range(0, size, 64):
        word = (bits >> start) & ((1 << 64) - 1)
        words.append(word - _U64 if word >= 1 << 63 else word)
    while words and words[-1] == 0:
        words.pop()
    return words


def ack_set_bits(words: list[int]) -> int:
    """Unpack signed 64-bit words into a bitset."""
    bits = 0
    for i, word in enumerate(words):
        bits |= (word & ((1 << 64) - 1)) << (64 * i)
    return bits
