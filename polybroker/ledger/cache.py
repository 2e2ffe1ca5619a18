"""The entry cache: recently appended entries kept in memory for tailing readers.

Rule 1: an entry is cached only once its append completed (never ahead of durability).
Rule 2: each log's cache holds entries in append order, so the oldest is always at the front:
        eviction behind the slowest reader and eviction by size both pop from the front.
Rule 3: the caches of one factory share one byte budget; when it is exceeded, the largest caches
        give back their oldest entries until the total is under 90% of the budget.
Rule 4: a log caches what it appends also with no cursor, for readers by position (Kafka
        fetches, readers without a cursor), and every log drops what it appended longer ago
        than its tail window, read or not (the log tracks when, by its clock), as Pulsar's
        cache evicts by age: a subscription that fell behind reads its backlog from the
        bookies rather than pinning it here up to Rule 3's budget.
Rule 5: nothing held per entry is an object the garbage collector tracks: an entry's numbers
        (ledger, entry, index, messages, publish time, bytes put before it) go to one array of
        64-bit ints, six per entry, and its data (bytes, never tracked) to a list; ``get``
        builds the ``Entry``. A tuple per entry stayed in the collector's youngest generation
        until a collection examined it, and since each new entry's tuple came with an old
        one's release, the collector's allocation count stayed low while that generation grew
        to tens of thousands of tuples: one young collection in a few hundred walked them all,
        a pause of 10-45 ms at 80k appends/s.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from polybroker.ledger.api import Entry, Position

_new = tuple.__new__  # builds a named tuple without the Python-level __new__ of namedtuple

# Per-entry bookkeeping (its ints and list slot) counted against the budget.
ENTRY_OVERHEAD = 96
EVICTION_WATERMARK = 0.9
FIELDS = 6  # ints per entry (Rule 5); the last is the bytes put before the entry


class EntryCacheManager:
    """Owns the byte budget shared by every log's ``EntryCache``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.size = 0
        self._caches: set[EntryCache] = set()
        self.evictions = 0  # times the budget made a cache give back entries (Rule 3)
        self.hits = 0  # entries read from a cache
        self.misses = 0  # entries read that a cache did not hold

    def stats(self) -> dict[str, int]:
        """Bytes used and allowed, the logs with a cache, and the counters since start."""
        return {
            "used_bytes": self.size,
            "max_bytes": self.max_bytes,
            "logs": len(self._caches),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }

    def new_cache(self, name: str) -> EntryCache:
        """Return a cache for one log; release it with ``EntryCache.close``."""
        cache = EntryCache(self, name)
        self._caches.add(cache)
        return cache

    def _forget(self, cache: EntryCache) -> None:
        self._caches.discard(cache)

    def _grew(self) -> None:
        if self.size <= self.max_bytes:
            return
        target = int(self.max_bytes * EVICTION_WATERMARK)
        # Few logs are hot at once, so sorting the caches on the rare overflow is cheap.
        for cache in sorted(self._caches, key=lambda c: c.size, reverse=True):
            if self.size <= target:
                break
            cache.evict_bytes(self.size - target)


class EntryCache:
    """One log's cached entries, keyed by the log's entry sequence number (append order).

    The numbers cached are consecutive (Rule 2, and a log numbers its entries one by one), so
    entry ``seq`` is at ``i = seq - _base`` from ``_head`` on: its data ``_data[i]`` and its
    fields ``_ints[FIELDS * i:][:FIELDS]`` (Rule 5). Evicting is moving ``_head`` (the dropped
    data is released at once, both columns are compacted now and then). Each entry's fields
    end with the bytes put before it, so the bytes of any run of entries are one subtraction."""

    def __init__(self, manager: EntryCacheManager, name: str) -> None:
        self.name = name
        self.size = 0
        self._manager = manager
        self._ints = array("q")
        self._data: list[bytes | None] = []  # None once evicted
        self._base = 0  # the number of the entry at index 0
        self._head = 0  # the index of the oldest cached entry
        self._put_bytes = 0  # the cost of everything ever put

    def __len__(self) -> int:
        return len(self._data) - self._head

    def put(self, seq: int, entry: Entry) -> None:
        """Cache ``entry`` as number ``seq``; ``seq`` must exceed every cached one (Rule 2)."""
        position = entry.position
        self.put_fields(
            seq,
            position.ledger_id,
            position.entry_id,
            entry.index,
            entry.num_messages,
            entry.publish_time_ms,
            entry.data,
        )

    def put_fields(
        self,
        seq: int,
        ledger_id: int,
        entry_id: int,
        index: int,
        num_messages: int,
        publish_time_ms: int,
        data: bytes,
    ) -> None:
        """``put`` of an entry given by its fields (no ``Entry`` needed)."""
        before = self._put_bytes
        self.put_run(
            seq,
            [ledger_id, entry_id, index, num_messages, publish_time_ms, before],
            [data],
            before + len(data) + ENTRY_OVERHEAD,
        )

    @property
    def put_bytes(self) -> int:
        """The cost of everything ever put: the bytes before the next entry ``put_run`` takes."""
        return self._put_bytes

    def put_run(self, seq: int, ints: list[int], data: list[bytes], end: int) -> None:
        """``put_fields`` of consecutive entries numbered from ``seq``: ``data`` holds each
        one's data and ``ints`` its ``FIELDS`` numbers (ledger id, entry id, index, num
        messages, publish time ms, bytes put before it) one entry after the other; the first
        entry's bytes before are ``put_bytes``, each next one's its predecessor's plus
        ``len(data) + ENTRY_OVERHEAD``, and ``end`` what follows the last (the caller builds
        them while it walks its adds); the budget is checked once."""
        manager = self._manager
        if manager.max_bytes == 0 or not data:
            return
        self._continue_at(seq)
        self._ints.extend(ints)
        self._data.extend(data)
        cost = end - self._put_bytes
        self._put_bytes = end
        self.size += cost
        manager.size += cost
        if manager.size > manager.max_bytes:
            manager._grew()

    def _continue_at(self, seq: int) -> None:
        """Make ``seq`` the next number: a gap (or nothing cached yet) starts afresh from it."""
        if seq != self._base + len(self._data):
            self.clear()
            self._base = seq

    def get(self, seq: int) -> Entry | None:
        """Return the cached entry number ``seq``, or None."""
        i = seq - self._base
        if i < self._head or i >= len(self._data):
            return None
        ints = self._ints
        o = FIELDS * i
        position = _new(Position, (ints[o], ints[o + 1]))
        return _new(Entry, (position, ints[o + 2], ints[o + 3], ints[o + 4], self._data[i]))

    def count_reads(self, hits: int, misses: int) -> None:
        """Count a read of ``hits`` entries found here and ``misses`` not (for metrics)."""
        manager = self._manager
        manager.hits += hits
        manager.misses += misses

    def first_seq(self) -> int | None:
        """The oldest cached entry's number, or None if empty."""
        if self._head == len(self._data):
            return None
        return self._base + self._head

    def evict_before(self, seq: int) -> None:
        """Drop every entry numbered below ``seq`` (no reader needs them from memory)."""
        self._drop_to(min(seq - self._base, len(self._data)))

    def evict_bytes(self, wanted: int) -> None:
        """Drop the oldest entries until ``wanted`` bytes were freed or the cache is empty."""
        head, n = self._head, len(self._data)
        if head < n:
            ints = self._ints
            last = FIELDS - 1
            # Keep the first entry with at least ``wanted`` bytes put between it and the oldest.
            goal = ints[FIELDS * head + last] + wanted
            kept = bisect_left(range(head, n), goal, key=lambda i: ints[FIELDS * i + last])
            self._drop_to(head + kept)
        self._manager.evictions += 1

    def clear(self) -> None:
        """Drop everything."""
        self._manager.size -= self.size
        self.size = 0
        self._base += len(self._data)
        self._ints = array("q")
        self._data = []
        self._head = 0

    def close(self) -> None:
        """Drop everything and leave the manager."""
        self.clear()
        self._manager._forget(self)

    def _drop_to(self, end: int) -> None:
        """Drop the entries before index ``end``."""
        head, data, ints = self._head, self._data, self._ints
        if end <= head:
            return
        last = FIELDS - 1
        first = ints[FIELDS * head + last]
        after = ints[FIELDS * end + last] if end < len(data) else self._put_bytes
        freed = after - first
        data[head:end] = [None] * (end - head)
        self.size -= freed
        self._manager.size -= freed
        if end >= 4096 and end * 2 >= len(data):
            del data[:end]
            del ints[: FIELDS * end]
            self._base += end
            end = 0
        self._head = end
