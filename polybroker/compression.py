"""Facts about compressed data that decoders check before they decompress it."""

from __future__ import annotations


def snappy_length(block: bytes | bytearray | memoryview) -> int | None:
    """The uncompressed length a raw snappy block declares (its leading unsigned varint, at
    most 5 bytes), or None when it has none. Decompressors set aside that much at once, so a
    caller bounds it first."""
    value = 0
    for i, b in enumerate(block[:5]):
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return value
    return None
