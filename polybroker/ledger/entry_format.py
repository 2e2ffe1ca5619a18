"""Broker entry metadata: the small header a managed ledger writes in front of each entry.

Layout (big-endian, 24 bytes, then the entry's data):

    magic        u16  0x0EB1
    version      u8   1
    flags        u8   0 (reserved; decoders of version 1 refuse other values)
    publish_time i64  milliseconds since the epoch
    index        i64  offset of the entry's first message within the log
    num_messages i32  messages in the entry (>= 1)

Rule 1: the header is fixed-size per version, so encoding is one ``struct.pack`` and decoding
        reads exactly ``HEADER_SIZE`` bytes before trusting any field.
Rule 2: a decoder never reads past the buffer it is given and raises ``EntryFormatError`` for a
        short buffer, a wrong magic, an unknown version or out-of-range fields.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from polybroker.ledger.api import StorageError

MAGIC = 0x0EB1
VERSION = 1
_HEADER = struct.Struct(">HBBqqi")
HEADER = _HEADER  # for writers that checked the fields already (the managed ledger's hot path)
HEADER_SIZE = _HEADER.size
MAX_NUM_MESSAGES = 2**31 - 1


class EntryFormatError(StorageError):
    """Stored bytes are not an entry this version of the format can read."""


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """The decoded broker entry metadata of one entry."""

    publish_time_ms: int
    index: int
    num_messages: int


def encode(data: bytes, index: int, publish_time_ms: int, num_messages: int) -> bytes:
    """Return ``data`` with its header in front.

    Raises ``ValueError`` for fields out of range (a caller bug, never bad input)."""
    if not 1 <= num_messages <= MAX_NUM_MESSAGES:
        raise ValueError(f"num_messages must be in 1..{MAX_NUM_MESSAGES}, got {num_messages}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return _HEADER.pack(MAGIC, VERSION, 0, publish_time_ms, index, num_messages) + data


def decode_header(raw: bytes | memoryview) -> EntryHeader:
    """Return the header of a stored entry; raise ``EntryFormatError`` if it is not one."""
    if len(raw) < HEADER_SIZE:
        raise EntryFormatError(f"entry of {len(raw)} bytes is shorter than its header")
    magic, version, flags, publish_time, index, num = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise EntryFormatError(f"bad entry magic 0x{magic:04x}")
    if version != VERSION:
        raise EntryFormatError(f"unknown entry format version {version}")
    if flags != 0:
        raise EntryFormatError(f"unknown entry flags 0x{flags:02x}")
    if index < 0 or num < 1:
        raise EntryFormatError(f"entry header out of range: index={index} messages={num}")
    return EntryHeader(publish_time, index, num)


def decode(raw: bytes) -> tuple[EntryHeader, bytes]:
    """Split a stored entry into its header and data; raise ``EntryFormatError`` if bad."""
    return decode_header(raw), raw[HEADER_SIZE:]
