"""MurmurHash3 (x86, 32-bit, seed 0): the hash Pulsar's Key_Shared maps keys with.

``key_hash(key)`` is ``(murmur3_32(key) & 0x7FFFFFFF) % 65536``, the slot of a key in the hash
range 0..65535 that Key_Shared consumers own, so a key lands on the same slot as in Pulsar.
"""

from __future__ import annotations

from functools import lru_cache

_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_MASK = 0xFFFFFFFF

HASH_RANGE_SIZE = 65536


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """Return the unsigned 32-bit MurmurHash3 of ``data``."""
    h = seed & _MASK
    length = len(data)
    body = length - (length & 3)
    for i in range(0, body, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _C1) & _MASK
        k = ((k << 15) | (k >> 17)) & _MASK
        k = (k * _C2) & _MASK
        h ^= k
        h = ((h << 13) | (h >> 19)) & _MASK
        h = (h * 5 + 0xE6546B64) & _MASK
    tail = length & 3
    if tail:
        k = int.from_bytes(data[body:], "little")
        k = (k * _C1) & _MASK
        k = ((k << 15) | (k >> 17)) & _MASK
        k = (k * _C2) & _MASK
        h ^= k
    h ^= length
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    h ^= h >> 16
    return h


@lru_cache(maxsize=65536)
def key_hash(key: bytes) -> int:
    """Return the Key_Shared slot (0..65535) of ``key``; cached, since keys repeat."""
    return (murmur3_32(key) & 0x7FFFFFFF) % HASH_RANGE_SIZE
