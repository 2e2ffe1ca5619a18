"""Broker entry metadata: encoding, and decoders that refuse what is not an entry."""

from __future__ import annotations

import contextlib
import random
import struct

import pytest

from polybroker.ledger import entry_format
from polybroker.ledger.entry_format import EntryFormatError, EntryHeader


def test_round_trip() -> None:
    """What is encoded decodes to the same header and data."""
    raw = entry_format.encode(b"hello", 123, 1_700_000_000_000, 7)
    assert len(raw) == entry_format.HEADER_SIZE + 5
    header, data = entry_format.decode(raw)
    assert header == EntryHeader(1_700_000_000_000, 123, 7)
    assert data == b"hello"


def test_empty_data_is_fine() -> None:
    """An entry may carry no data."""
    assert entry_format.decode(entry_format.encode(b"", 0, 0, 1)) == (EntryHeader(0, 0, 1), b"")


@pytest.mark.parametrize("length", [0, 1, entry_format.HEADER_SIZE - 1])
def test_short_buffers_are_refused(length: int) -> None:
    """A buffer shorter than the header is an error, never a partial read."""
    raw = entry_format.encode(b"", 1, 2, 3)[:length]
    with pytest.raises(EntryFormatError, match="shorter"):
        entry_format.decode_header(raw)


def test_wrong_magic_version_and_flags_are_refused() -> None:
    """Bytes that are not this format (or a newer version of it) are refused."""
    good = entry_format.encode(b"d", 1, 2, 3)
    with pytest.raises(EntryFormatError, match="magic"):
        entry_format.decode(b"\x00\x00" + good[2:])
    with pytest.raises(EntryFormatError, match="version"):
        entry_format.decode(good[:2] + b"\x09" + good[3:])
    with pytest.raises(EntryFormatError, match="flags"):
        entry_format.decode(good[:3] + b"\x01" + good[4:])


def test_out_of_range_fields_are_refused() -> None:
    """A negative index or a message count below one is corrupt."""
    bad_index = struct.pack(">HBBqqi", entry_format.MAGIC, entry_format.VERSION, 0, 0, -5, 1)
    bad_count = struct.pack(">HBBqqi", entry_format.MAGIC, entry_format.VERSION, 0, 0, 5, 0)
    for raw in (bad_index, bad_count):
        with pytest.raises(EntryFormatError, match="out of range"):
            entry_format.decode(raw)


def test_encode_refuses_caller_bugs() -> None:
    """Encoding checks its own arguments."""
    with pytest.raises(ValueError, match="index"):
        entry_format.encode(b"", -1, 0, 1)
    with pytest.raises(ValueError, match="num_messages"):
        entry_format.encode(b"", 0, 0, 0)


def test_random_bytes_never_crash_the_decoder() -> None:
    """Arbitrary bytes either decode or raise EntryFormatError."""
    rng = random.Random(7)
    for _ in range(2000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        with contextlib.suppress(EntryFormatError):
            entry_format.decode(raw)
