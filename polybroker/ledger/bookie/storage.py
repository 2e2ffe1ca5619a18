"""Entry storage of a bookie: a write cache, append-only entry logs and an on-disk index.

Layout under the ledgers directory::

    entrylogs/<id:08x>.log      16-byte header, then [u32 length][u64 ledger][i64 entry][data]...
    entrylogs/<id:08x>.usage    8-byte header, then per ledger the log holds [u64 ledger][u64 bytes]
                                [i64 first entry][i64 last entry], for garbage collection and
                                compaction (``.ledgers``, a bare list of ledger ids, is the older
                                form: read by scanning the log once)
    index/<ledger>.idx          32-byte ledger header (fenced, LAC, last entry), then the location
                                of entry e at offset 32 + 16*e: [u32 log id][u32 length][u64 offset]

Why one small file of fixed-size records per ledger for the index: a ledger's entry ids are dense
from 0 (I10), so a direct-mapped array is the cheapest index there is. A lookup is one 16-byte
``pread``; a checkpoint writes a ledger's new locations as one ``pwrite`` per contiguous run; a
ledger's state lives in the same file's header, so one ``fsync`` covers both; deleting a ledger
is one ``unlink``; and nothing of it is held in memory or read at start, so memory and restart
time do not grow with the data held. (sqlite3 would keep the same bounds at a higher cost per
lookup.) Entry ids are bounded by ``MAX_ENTRY_ID`` so that no index file can grow absurdly sparse.

Threads: the reactor thread owns the write cache, the ledger states and every read; a single
worker thread runs ``run_checkpoint`` and ``collect_garbage`` (file writes, fsyncs, unlinks).
They share only what a checkpoint job freezes: the flushed half of the write cache, which the
reactor keeps reading from until ``finish_checkpoint`` drops it; the worker then frees it
(``release_entries``).

Rule 1 (I7): an entry is readable as soon as ``put_entry`` returned: reads consult the write
        cache, then the half being flushed, then the index and the entry logs.
Rule 2 (I6, I3): a checkpoint writes and fsyncs the entry logs, then the ledgers' lists of each
        log, then the index files (locations and ledger headers) and their directory; only after
        that may the caller persist the journal mark and delete older journal files.
Rule 2a: a checkpoint that failed (a full disk) may run again with the same job, and only it:
        its deletions are idempotent, its entries are appended again (a write that failed
        part-way is cut off the log first, so logs hold whole records) and the index then
        points at the new copies; copies a failed run left become dead bytes for compaction.
Rule 3 (I8): an entry log is deleted only when none of the ledgers it holds has an index file
        (they were all deleted), or when a compaction has copied every entry the index locates in
        it into the current log: the copies are fsync'd, then the current log's usage lists their
        ledgers, then the index points at them (fsync'd), and only then is the old log unlinked.
        A crash at any point leaves every entry located by the index in a log that exists.
Rule 3a: a compaction works in steps of bounded size, each one worker job, so checkpoints queue
        between them rather than behind a whole log. It never creates an index file (a ledger
        deleted meanwhile is skipped) and leaves a log whose entries it could not verify in place.
        A read that raced a compaction's step (its index record named the old log, since
        deleted, or was read half-written) looks the entry up once more.
Rule 4: the write cache holds bytes it owns, or read-only views of one received frame that the
        entries put together make at least half of (``put_entries``), each of ``VIEW_MIN_BYTES``
        or more: those pin at most as much again as they count, and copying every entry once
        more on the reactor is what they save. Smaller entries are copied: a view is an object
        the garbage collector tracks and a copy is not, and every full collection walked each
        cached view (60k views of 1 KiB entries: 6-19 ms a collection, one a second, the
        bookie's reactor and journal stalled meanwhile), while a 1 KiB copy costs no more
        instructions than the collections it avoids. Reads return bytes either way.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, repeat
from pathlib import Path

from polybroker.ledger.api import StorageError
from polybroker.ledger.bookie.journal import (
    JournalPosition,
    fsync_dir,
    write_atomically,
    write_parts,
)
from polybroker.ledger.wire import Buffer
from polybroker.logs import kv

log = logging.getLogger(__name__)

MAX_ENTRY_ID = (1 << 36) - 1  # keeps an index file under 1 TiB even if written sparsely

INDEX_HEADER = struct.Struct(">4sIqqq")  # magic, flags, lac, last entry, reserved
INDEX_HEADER_SIZE = 32
INDEX_RECORD = struct.Struct(">IIQ")  # log id, length, offset
INDEX_RECORD_SIZE = INDEX_RECORD.size  # 16
_INDEX_MAGIC = b"PBIX"
_FLAG_FENCED = 0x1

LOG_HEADER = struct.Struct(">4sIQ")  # magic, version, log id
LOG_HEADER_SIZE = LOG_HEADER.size  # 16
_LOG_MAGIC = b"PBEL"
ENTRY_HEADER = struct.Struct(">IQq")  # data length, ledger, entry
ENTRY_HEADER_SIZE = ENTRY_HEADER.size  # 20
USAGE_HEADER = struct.Struct(">4sI")  # magic, version
USAGE_RECORD = struct.Struct(">QQqq")  # ledger, bytes (headers included), first entry, last entry
_USAGE_MAGIC = b"PBLU"

COMPACTION_STEP_BYTES = 8 * 1024 * 1024  # live bytes one compaction step copies at most
_COMPACTION_INDEX_BLOCK = 4096  # index records one read of a ledger's index covers
_COMPACTION_STEP_RECORDS = 256 * 1024  # index records one step scans at most

# Bytes buffered before one write (and sync) of an entry log. A journal sync that lands on one of
# these syncs waits for it: at 1 MiB the managed-ledger add p99 of the storage benchmark was
# 4.1x the raw loop's (median of 7 alternating rounds), at 256 KiB 3.6x (10 rounds) at the same
# throughput; 128 KiB gained little more (3.4x, 7 rounds) for twice the syncs.
_CHUNK = 256 * 1024
# Entries laid out by one round of whole-list operations (``_write_entries``).
_LAYOUT_BATCH = 256
# Entries ``release_entries`` frees between two hand-overs of the GIL.
_RELEASE_SLICE = 256


def release_entries(flushed: dict[int, dict[int, Buffer]]) -> None:
    """Free the entries ``finish_checkpoint`` returned (worker thread), ``_RELEASE_SLICE`` at a
    time, handing the GIL over between slices. Freed at once on the reactor, a 32 MB half of
    the write cache (30,000 1 KiB entries) held it for up to 4 ms, and every add in flight
    waited that long."""
    while flushed:
        _, entries = flushed.popitem()
        while entries:
            for _ in range(min(len(entries), _RELEASE_SLICE)):
                entries.popitem()
            time.sleep(0)  # lets a waiting reactor take the GIL


class StorageCorruptError(StorageError):
    """The index points at bytes that are not the entry it claims."""


class LedgerState:
    """What a bookie knows about one ledger besides its entries."""

    __slots__ = ("dirty", "fenced", "lac", "last_entry", "ledger_id")

    def __init__(
        self, ledger_id: int, fenced: bool = False, lac: int = -1, last_entry: int = -1
    ) -> None:
        self.ledger_id = ledger_id
        self.fenced = fenced
        self.lac = lac
        self.last_entry = last_entry
        self.dirty = False  # changed since the last checkpoint took it


@dataclass
class CheckpointJob:
    """What one checkpoint writes: frozen on the reactor by ``begin_checkpoint``."""

    mark: JournalPosition | None
    snapshot: dict[int, dict[int, Buffer]]
    snapshot_bytes: int
    states: list[tuple[int, bool, int, int]]  # ledger, fenced, lac, last entry
    deletions: list[int]
    entries_written: int = 0


def _log_name(log_id: int) -> str:
    return f"{log_id:08x}.log"


def _ledgers_name(log_id: int) -> str:
    return f"{log_id:08x}.ledgers"


def _usage_name(log_id: int) -> str:
    return f"{log_id:08x}.usage"


@dataclass
class LedgerUsage:
    """What one entry log holds of one ledger."""

    bytes: int
    first: int
    last: int

    def add(self, nbytes: int, first: int, last: int) -> None:
        self.bytes += nbytes
        self.first = min(self.first, first)
        self.last = max(self.last, last)


@dataclass
class Compaction:
    """One sealed entry log being compacted (worker side; see Rules 3 and 3a)."""

    log_id: int
    log_bytes: int
    live_bytes: int
    todo: list[tuple[int, LedgerUsage]]  # live ledgers left to copy, ascending
    next_entry: int = -1  # where the scan of ``todo[0]``'s index resumes (-1: its first)
    copied_bytes: int = 0
    copied_entries: int = 0
    unverified: int = 0  # entries left in place because their bytes were not what was indexed


VIEW_MIN_BYTES = 8 * 1024  # smaller entries are copied into the write cache (Rule 4)


def _views_pin_little(entries: list[tuple[int, int, Buffer]]) -> bool:
    """True if every entry's data is a view of one ``bytes`` object (immutable) that they make
    at least half of, each of ``VIEW_MIN_BYTES`` or more (Rule 4): cached as they are, they pin
    at most twice what they count, and the collector tracks few of them (at most
    ``write_cache_max_bytes / VIEW_MIN_BYTES``)."""
    if not entries:
        return False
    first = entries[0][2]
    if type(first) is not memoryview:
        return False
    base = first.obj
    if type(base) is not bytes:
        return False
    total = 0
    view_min = VIEW_MIN_BYTES
    for _, _, data in entries:
        if type(data) is not memoryview or data.obj is not base:
            return False
        n = len(data)
        if n < view_min:
            return False
        total += n
    return total * 2 >= len(base)


def _runs(eids: list[int], records: list[bytes]) -> list[tuple[int, list[bytes]]]:
    """Split sorted entry ids and their index records into runs of consecutive ids, as
    (first entry id, records)."""
    if not eids:
        return []
    if eids[-1] - eids[0] == len(eids) - 1:
        return [(eids[0], records)]
    out = []
    start = 0
    for r in range(1, len(eids)):
        if eids[r] != eids[r - 1] + 1:
            out.append((eids[start], records[start:r]))
            start = r
    out.append((eids[start], records[start:]))
    return out


class LedgerStorage:
    """The write cache, entry logs and index of one bookie (see the module rules)."""

    def __init__(
        self,
        directory: Path,
        *,
        entry_log_size_limit: int = 1024 * 1024 * 1024,
        write_cache_max_bytes: int = 64 * 1024 * 1024,
        max_cached_states: int = 10_000,
        max_open_files: int = 128,
        max_entry_size: int = 64 * 1024 * 1024,
    ) -> None:
        self.directory = directory
        self.index_dir = directory / "index"
        self.log_dir = directory / "entrylogs"
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.entry_log_size_limit = entry_log_size_limit
        self.write_cache_max_bytes = write_cache_max_bytes
        self._max_states = max_cached_states
        self._max_open = max_open_files
        self._max_entry = max_entry_size  # a bigger length in the index is corruption
        # Reactor side.
        self._states: dict[int, LedgerState] = {}
        self._cache: dict[int, dict[int, Buffer]] = {}
        self._cache_bytes = 0
        self._flushing: dict[int, dict[int, Buffer]] | None = None
        self._flushing_bytes = 0
        self._pending_deletes: list[int] = []
        self._deleting: set[int] = set()  # deleted; their index file may not be unlinked yet
        self._index_fds: OrderedDict[int, int] = OrderedDict()
        self._log_fds: OrderedDict[int, int] = OrderedDict()
        # Worker side.
        existing = self.log_ids()
        self._next_log_id = (existing[-1] + 1) if existing else 1
        self._log_id = 0  # the log being appended to, 0 = none open
        self._log_fd = -1
        self._log_size = 0
        self._log_usage: dict[int, LedgerUsage] = {}  # of the log being appended to

    # -- reactor side: state ----------------------------------------------------------------

    @property
    def cache_bytes(self) -> int:
        """Bytes in the write cache (not counting the half being flushed)."""
        return self._cache_bytes

    @property
    def flushing(self) -> bool:
        """Whether a checkpoint job is in flight."""
        return self._flushing is not None

    def state(self, ledger_id: int) -> LedgerState | None:
        """Return the ledger's state (loading it from its index header), None if unknown."""
        st = self._states.get(ledger_id)
        if st is not None or ledger_id in self._deleting:
            return st
        fd = self._index_fd(ledger_id)
        if fd < 0:
            return None
        raw = os.pread(fd, INDEX_HEADER_SIZE, 0)
        if len(raw) < INDEX_HEADER_SIZE:
            return None
        magic, flags, lac, last, _ = INDEX_HEADER.unpack(raw)
        if magic != _INDEX_MAGIC:
            raise StorageCorruptError(f"index of ledger {ledger_id} has a bad header")
        st = LedgerState(ledger_id, bool(flags & _FLAG_FENCED), lac, last)
        self._states[ledger_id] = st
        return st

    def state_or_create(self, ledger_id: int) -> LedgerState:
        """Return the ledger's state, creating an empty one for a ledger new to this bookie."""
        st = self.state(ledger_id)
        if st is None:
            st = self._states[ledger_id] = LedgerState(ledger_id)
        return st

    def put_entry(self, ledger_id: int, entry_id: int, lac: int, data: Buffer) -> None:
        """Put an entry (already journaled) in the write cache; it is readable at once."""
        st = self._states.get(ledger_id) or self.state_or_create(ledger_id)
        cache = self._cache.get(ledger_id)
        if cache is None:
            cache = self._cache[ledger_id] = {}
        # Own the bytes: a view would pin the whole network read it came from.
        owned = bytes(data)
        old = cache.get(entry_id)
        cache[entry_id] = owned
        self._cache_bytes += len(owned) - (len(old) if old is not None else 0)
        if entry_id > st.last_entry:
            st.last_entry = entry_id
        if lac > st.lac:
            st.lac = lac
        st.dirty = True

    def put_entries(self, ledger_id: int, entries: Iterable[tuple[int, int, Buffer]]) -> None:
        """Put (entry id, lac, data) entries of one ledger (already journaled) in the write
        cache, as ``put_entry`` does for each (Rule 4: views kept when they pin little)."""
        st = self._states.get(ledger_id) or self.state_or_create(ledger_id)
        cache = self._cache.get(ledger_id)
        if cache is None:
            cache = self._cache[ledger_id] = {}
        if not isinstance(entries, list):
            entries = list(entries)
        own = not _views_pin_little(entries)
        added = 0
        last, top_lac = st.last_entry, st.lac
        for entry_id, lac, data in entries:
            owned = bytes(data) if own else data
            old = cache.get(entry_id)
            cache[entry_id] = owned
            added += len(owned) - (len(old) if old is not None else 0)
            if entry_id > last:
                last = entry_id
            if lac > top_lac:
                top_lac = lac
        self._cache_bytes += added
        st.last_entry, st.lac = last, top_lac
        st.dirty = True

    def fence(self, ledger_id: int) -> LedgerState:
        """Mark the ledger fenced (the caller journals it first)."""
        st = self.state_or_create(ledger_id)
        if not st.fenced:
            st.fenced = True
            st.dirty = True
        return st

    def set_lac(self, ledger_id: int, lac: int) -> LedgerState:
        """Raise the ledger's LAC to ``lac`` (an explicit LAC; never lowers it)."""
        st = self.state_or_create(ledger_id)
        if lac > st.lac:
            st.lac = lac
            st.dirty = True
        return st

    def delete_ledger(self, ledger_id: int) -> None:
        """Forget a ledger now; its index file goes at the next checkpoint, its entry logs at
        garbage collection."""
        self._states.pop(ledger_id, None)
        dropped = self._cache.pop(ledger_id, None)
        if dropped:
            self._cache_bytes -= sum(len(d) for d in dropped.values())
        self._pending_deletes.append(ledger_id)
        self._deleting.add(ledger_id)
        fd = self._index_fds.pop(ledger_id, None)
        if fd is not None:
            os.close(fd)

    # -- reactor side: reads ----------------------------------------------------------------

    def read_entry(self, ledger_id: int, entry_id: int) -> bytes | None:
        """Return the entry's data, None if this bookie does not hold it (Rule 1)."""
        cache = self._cache.get(ledger_id)
        if cache is not None:
            data = cache.get(entry_id)
            if data is not None:
                return bytes(data)
        if self._flushing is not None:
            cache = self._flushing.get(ledger_id)
            if cache is not None:
                data = cache.get(entry_id)
                if data is not None:
                    return bytes(data)
        if ledger_id in self._deleting or not 0 <= entry_id <= MAX_ENTRY_ID:
            return None
        fd = self._index_fd(ledger_id)
        if fd < 0:
            return None
        at = INDEX_HEADER_SIZE + entry_id * INDEX_RECORD_SIZE
        raw = os.pread(fd, INDEX_RECORD_SIZE, at)
        if len(raw) < INDEX_RECORD_SIZE:
            return None
        log_id, length, offset = INDEX_RECORD.unpack(raw)
        if log_id == 0:
            return None
        try:
            return self._read_log(log_id, offset, length, ledger_id, entry_id)
        except StorageCorruptError:
            # Rule 3a: a compaction may have moved the entry since its record was read.
            again = os.pread(fd, INDEX_RECORD_SIZE, at)
            if again == raw or len(again) < INDEX_RECORD_SIZE:
                raise
            log_id, length, offset = INDEX_RECORD.unpack(again)
            return self._read_log(log_id, offset, length, ledger_id, entry_id)

    def _read_log(
        self, log_id: int, offset: int, length: int, ledger_id: int, entry_id: int
    ) -> bytes:
        fd = self._log_fds.get(log_id)
        if fd is None:
            try:
                fd = os.open(self.log_dir / _log_name(log_id), os.O_RDONLY)
            except FileNotFoundError:
                raise StorageCorruptError(
                    f"entry {ledger_id}:{entry_id} points into missing entry log {log_id}"
                ) from None
            self._remember(self._log_fds, log_id, fd)
        else:
            self._log_fds.move_to_end(log_id)
        if length > self._max_entry:
            raise StorageCorruptError(
                f"index of {ledger_id}:{entry_id} claims {length} bytes, above any entry's size"
            )
        raw = os.pread(fd, ENTRY_HEADER_SIZE + length, offset)
        if len(raw) != ENTRY_HEADER_SIZE + length or ENTRY_HEADER.unpack_from(raw) != (
            length,
            ledger_id,
            entry_id,
        ):
            raise StorageCorruptError(
                f"entry log {log_id} at {offset} does not hold entry {ledger_id}:{entry_id}"
            )
        return raw[ENTRY_HEADER_SIZE:]

    def _index_fd(self, ledger_id: int) -> int:
        fd = self._index_fds.get(ledger_id)
        if fd is not None:
            self._index_fds.move_to_end(ledger_id)
            return fd
        try:
            fd = os.open(self.index_dir / f"{ledger_id}.idx", os.O_RDONLY)
        except FileNotFoundError:
            return -1
        self._remember(self._index_fds, ledger_id, fd)
        return fd

    def _remember(self, fds: OrderedDict[int, int], key: int, fd: int) -> None:
        fds[key] = fd
        while len(fds) > self._max_open:
            _, old = fds.popitem(last=False)
            os.close(old)

    # -- checkpoint -------------------------------------------------------------------------

    def begin_checkpoint(self, mark: JournalPosition | None) -> CheckpointJob:
        """Freeze the write cache, dirty states and deletions into a job (reactor side).

        ``mark`` is the journal position up to which every record is reflected in them."""
        if self._flushing is not None:
            raise RuntimeError("a checkpoint is already in flight")
        snapshot = self._cache
        self._flushing = snapshot
        self._flushing_bytes = self._cache_bytes
        self._cache = {}
        self._cache_bytes = 0
        states = []
        for st in self._states.values():
            if st.dirty:
                states.append((st.ledger_id, st.fenced, st.lac, st.last_entry))
                st.dirty = False
        deletions = self._pending_deletes
        self._pending_deletes = []
        return CheckpointJob(mark, snapshot, self._flushing_bytes, states, deletions)

    def run_checkpoint(self, job: CheckpointJob) -> None:
        """Write a job to disk in the order of Rule 2 (worker thread; blocking); run it again
        after it failed (Rule 2a)."""
        job.entries_written = 0
        for ledger_id in job.deletions:
            (self.index_dir / f"{ledger_id}.idx").unlink(missing_ok=True)
        runs = self._write_entries(job)
        headers = {lid: (fenced, lac, last) for lid, fenced, lac, last in job.states}
        created = False
        for ledger_id in sorted(set(runs) | set(headers)):
            created |= self._write_index(ledger_id, runs.get(ledger_id, ()), headers.get(ledger_id))
        if created or job.deletions:
            fsync_dir(self.index_dir)

    def finish_checkpoint(self, job: CheckpointJob) -> dict[int, dict[int, Buffer]]:
        """Drop the flushed half of the write cache (reactor side, after the job ran) and
        return it, taken out of the job, for ``release_entries`` off the reactor."""
        flushed, job.snapshot = job.snapshot, {}
        self._flushing = None
        self._flushing_bytes = 0
        for ledger_id in job.deletions:
            if ledger_id not in self._pending_deletes:
                self._deleting.discard(ledger_id)
        if len(self._states) > self._max_states:
            for lid in [lid for lid, st in self._states.items() if not st.dirty]:
                if lid not in self._cache:
                    del self._states[lid]
                if len(self._states) <= self._max_states // 2:
                    break
        return flushed

    def _write_entries(self, job: CheckpointJob) -> dict[int, list[tuple[int, list[bytes]]]]:
        """Append the snapshot, sorted by (ledger, entry), to entry logs; fsync them; persist
        their usage. Return per ledger its runs of consecutive entries as (first entry, packed
        index records), ready for ``_write_index``.

        A ledger's entries are laid out ``_LAYOUT_BATCH`` at a time with whole-list operations
        (offsets by ``accumulate``, headers and index records by ``map``), not a Python loop
        per entry: this runs on the worker thread, and each entry's bytecode held the GIL the
        reactor needs (a checkpoint cost the bookie about a third of its CPU per entry). The
        batches are small because a C call keeps the GIL for its whole length: over a whole
        32 MB checkpoint at once they held the reactor off for milliseconds (add p99 up)."""
        runs: dict[int, list[tuple[int, list[bytes]]]] = {}
        if not job.snapshot:
            return runs
        pack_header = ENTRY_HEADER.pack
        pack_index = INDEX_RECORD.pack
        limit = self.entry_log_size_limit
        chunk: list[Buffer] = []  # holds the log's bytes from ``_log_size`` on, not yet written
        chunk_bytes = 0
        if self._log_fd < 0:
            self._roll_log()
        for ledger_id in sorted(job.snapshot):
            entries = job.snapshot[ledger_id]
            eids = sorted(entries)
            k = len(eids)
            job.entries_written += k
            records: list[bytes] = []
            i = 0
            while i < k:
                # Up to _LAYOUT_BATCH entries from i, from where the current log ends: as many
                # as it has room for.
                ids = eids[i : i + _LAYOUT_BATCH]
                datas = [entries[e] for e in ids]
                lens = list(map(len, datas))
                base = self._log_size + chunk_bytes
                offs = list(accumulate([n + ENTRY_HEADER_SIZE for n in lens], initial=base))
                fit = bisect_right(offs, limit, 1) - 1
                if fit == 0:
                    if base > LOG_HEADER_SIZE:
                        self._write_chunk(chunk)
                        chunk, chunk_bytes = [], 0
                        self._roll_log()
                        continue
                    fit = 1  # an entry larger than a log gets a log of its own
                self._account(ledger_id, offs[fit] - base, ids[0], ids[fit - 1])
                records.extend(map(pack_index, repeat(self._log_id), lens[:fit], offs))
                parts: list[Buffer] = [b""] * (2 * fit)
                parts[0::2] = map(pack_header, lens[:fit], repeat(ledger_id), ids[:fit])
                parts[1::2] = datas[:fit]
                # Written a chunk at a time: each time the entries gathered reach _CHUNK bytes.
                p = 0
                while p < fit:
                    t = bisect_left(offs, self._log_size + _CHUNK, p + 1, fit + 1)
                    if t > fit:
                        chunk += parts[2 * p :]
                        chunk_bytes = offs[fit] - self._log_size
                        break
                    chunk += parts[2 * p : 2 * t]
                    self._write_chunk(chunk)  # the log now ends at offs[t]
                    chunk, chunk_bytes = [], 0
                    p = t
                i += fit
            runs[ledger_id] = _runs(eids, records)
        self._write_chunk(chunk)
        os.fsync(self._log_fd)
        self._write_usage(self._log_id, self._log_usage)
        return runs

    def _account(self, ledger_id: int, nbytes: int, first: int, last: int) -> None:
        """Count ``nbytes`` of entries ``first``..``last`` of a ledger in the current log."""
        usage = self._log_usage.get(ledger_id)
        if usage is None:
            self._log_usage[ledger_id] = LedgerUsage(nbytes, first, last)
        else:
            usage.add(nbytes, first, last)

    def _write_chunk(self, chunk: list[Buffer]) -> None:
        """Write a chunk and sync it at once: a journal sync that had to flush many megabytes
        of entry log with it (one file system journal) would stall every add behind it."""
        if not chunk:
            return
        start = self._log_size
        # Gathered by the kernel: a joined copy would hold the GIL the reactor needs.
        try:
            write_parts(self._log_fd, chunk)
        except OSError:
            # A write failed part-way (a full disk): cut what reached the file, so that the
            # log holds whole records only and the retried checkpoint appends at ``start``.
            try:
                os.ftruncate(self._log_fd, start)
                os.lseek(self._log_fd, start, os.SEEK_SET)
            except OSError:
                self._log_size = os.lseek(self._log_fd, 0, os.SEEK_CUR)
            raise
        self._log_size = os.lseek(self._log_fd, 0, os.SEEK_CUR)
        os.fdatasync(self._log_fd)

    def _roll_log(self) -> None:
        """Seal the current entry log (fsync'd, usage written) and start the next."""
        if self._log_fd >= 0:
            os.fsync(self._log_fd)
            self._write_usage(self._log_id, self._log_usage)
            os.close(self._log_fd)
        log_id = self._next_log_id
        self._next_log_id += 1
        fd = os.open(self.log_dir / _log_name(log_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, LOG_HEADER.pack(_LOG_MAGIC, 1, log_id))
        fsync_dir(self.log_dir)
        self._log_fd = fd
        self._log_id = log_id
        self._log_size = LOG_HEADER_SIZE
        self._log_usage = {}

    def _write_usage(self, log_id: int, usage: dict[int, LedgerUsage]) -> None:
        raw = [USAGE_HEADER.pack(_USAGE_MAGIC, 1)]
        for lid in sorted(usage):
            u = usage[lid]
            raw.append(USAGE_RECORD.pack(lid, u.bytes, u.first, u.last))
        write_atomically(self.log_dir / _usage_name(log_id), b"".join(raw))

    def _write_index(
        self,
        ledger_id: int,
        runs: Iterable[tuple[int, list[bytes]]],
        header: tuple[bool, int, int] | None,
    ) -> bool:
        """Write a ledger's new locations (one pwrite per run of consecutive entries) and its
        header, fsync. Return whether the file was created."""
        path = self.index_dir / f"{ledger_id}.idx"
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for first, records in runs:
                os.pwrite(fd, b"".join(records), INDEX_HEADER_SIZE + first * INDEX_RECORD_SIZE)
            if header is None and created:
                header = (False, -1, -1)
            if header is not None:
                fenced, lac, last = header
                flags = _FLAG_FENCED if fenced else 0
                os.pwrite(fd, INDEX_HEADER.pack(_INDEX_MAGIC, flags, lac, last, 0), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        return created

    # -- garbage collection (worker thread) -------------------------------------------------

    def log_ids(self) -> list[int]:
        """Return the ids of the entry logs on disk, ascending."""
        ids = []
        for p in self.log_dir.iterdir():
            if p.name.endswith(".log"):
                try:
                    ids.append(int(p.name[:-4], 16))
                except ValueError:
                    continue
        return sorted(ids)

    def log_usage(self, log_id: int) -> dict[int, LedgerUsage]:
        """Return what an entry log holds of each ledger, from its usage file or, when that is
        missing (a crash before it was written) or of the older form, by scanning the log once
        (and writing the usage file for next time)."""
        try:
            raw = (self.log_dir / _usage_name(log_id)).read_bytes()
        except FileNotFoundError:
            raw = b""
        body = raw[USAGE_HEADER.size :]
        if raw[: USAGE_HEADER.size] == USAGE_HEADER.pack(_USAGE_MAGIC, 1) and not (
            len(body) % USAGE_RECORD.size
        ):
            return {
                lid: LedgerUsage(nbytes, first, last)
                for lid, nbytes, first, last in USAGE_RECORD.iter_unpack(body)
            }
        usage = self._scan_log(log_id)
        self._write_usage(log_id, usage)
        (self.log_dir / _ledgers_name(log_id)).unlink(missing_ok=True)
        return usage

    def _scan_log(self, log_id: int) -> dict[int, LedgerUsage]:
        """Read a log's entry headers to learn what it holds of each ledger."""
        usage: dict[int, LedgerUsage] = {}
        path = self.log_dir / _log_name(log_id)
        size = path.stat().st_size
        with open(path, "rb") as f:
            pos = LOG_HEADER_SIZE
            while pos + ENTRY_HEADER_SIZE <= size:
                f.seek(pos)
                length, ledger_id, entry_id = ENTRY_HEADER.unpack(f.read(ENTRY_HEADER_SIZE))
                n = ENTRY_HEADER_SIZE + length
                if pos + n > size:
                    break
                u = usage.get(ledger_id)
                if u is None:
                    usage[ledger_id] = LedgerUsage(n, entry_id, entry_id)
                else:
                    u.add(n, entry_id, entry_id)
                pos += n
        return usage

    def _live(self, usage: dict[int, LedgerUsage]) -> list[tuple[int, LedgerUsage]]:
        return [
            (lid, u) for lid, u in sorted(usage.items()) if (self.index_dir / f"{lid}.idx").exists()
        ]

    def _delete_log(self, log_id: int) -> None:
        for name in (_log_name(log_id), _usage_name(log_id), _ledgers_name(log_id)):
            (self.log_dir / name).unlink(missing_ok=True)

    def collect_garbage(self) -> list[int]:
        """Delete sealed entry logs none of whose ledgers has an index any more (Rule 3).

        Returns the deleted log ids (pass them to ``forget_logs`` on the reactor)."""
        deleted = []
        for log_id in self.log_ids():
            if log_id == self._log_id:
                continue
            usage = self.log_usage(log_id)
            if self._live(usage):
                continue
            self._delete_log(log_id)
            deleted.append(log_id)
            log.info("entry log collected", extra=kv(log=log_id, ledgers=len(usage)))
        return deleted

    # -- compaction (worker thread) ---------------------------------------------------------

    def plan_compaction(self, threshold: float) -> list[Compaction]:
        """Return a compaction for each sealed entry log whose live bytes (those of ledgers
        that still have an index) are under ``threshold`` of its entries' bytes, emptiest
        first."""
        plans = []
        for log_id in self.log_ids():
            if log_id == self._log_id:
                continue
            try:
                size = (self.log_dir / _log_name(log_id)).stat().st_size
            except FileNotFoundError:
                continue
            live = self._live(self.log_usage(log_id))
            live_bytes = sum(u.bytes for _, u in live)
            # Of its entries' bytes: a log all live never qualifies, whatever the threshold.
            if live_bytes < threshold * (size - LOG_HEADER_SIZE):
                plans.append(Compaction(log_id, size, live_bytes, live))
        plans.sort(key=lambda c: c.live_bytes / c.log_bytes)
        return plans

    def compact_step(self, c: Compaction, budget: int = COMPACTION_STEP_BYTES) -> bool:
        """Copy up to about ``budget`` bytes of the entries the index locates in ``c``'s log
        into the current log and point the index at the copies (Rules 3, 3a). Once none is
        left, delete the log. Return whether the compaction is over (``forget_logs`` then)."""
        copied = scanned = 0
        while c.todo and copied < budget and scanned < _COMPACTION_STEP_RECORDS:
            ledger_id, usage = c.todo[0]
            first = max(c.next_entry, usage.first)
            count = min(_COMPACTION_INDEX_BLOCK, usage.last - first + 1)
            resume = -1
            if count > 0:
                moved, resume = self._compact_block(c, ledger_id, first, count, budget - copied)
                copied += moved
                scanned += count
            if resume < 0:
                c.todo.pop(0)
            c.next_entry = resume
        if c.todo:
            return False
        if c.unverified:
            log.warning(
                "entry log kept: some of its entries are not what the index says",
                extra=kv(log=c.log_id, entries=c.unverified),
            )
        else:
            self._delete_log(c.log_id)
            log.info(
                "entry log compacted",
                extra=kv(
                    log=c.log_id,
                    bytes=c.log_bytes,
                    copied_bytes=c.copied_bytes,
                    copied_entries=c.copied_entries,
                ),
            )
        return True

    def _compact_block(
        self, c: Compaction, ledger_id: int, first: int, count: int, budget: int
    ) -> tuple[int, int]:
        """Move those of one ledger's entries ``first``..``first+count-1`` that the index
        locates in ``c``'s log, stopping once ``budget`` bytes are copied. Return the bytes
        copied and the entry to resume at (-1: the ledger is done)."""
        try:
            fd = os.open(self.index_dir / f"{ledger_id}.idx", os.O_RDWR)
        except FileNotFoundError:
            return 0, -1  # deleted meanwhile: nothing of it is needed
        try:
            at = INDEX_HEADER_SIZE + first * INDEX_RECORD_SIZE
            raw = os.pread(fd, count * INDEX_RECORD_SIZE, at)
            whole = len(raw) // INDEX_RECORD_SIZE
            resume = first + count if whole == count else -1  # a short index: nothing after
            found = []
            for i, (log_id, length, offset) in enumerate(
                INDEX_RECORD.iter_unpack(raw[: whole * INDEX_RECORD_SIZE])
            ):
                if log_id == c.log_id:
                    found.append((first + i, length, offset))
            if not found:
                return 0, resume
            copies, copied, stopped_at = self._copy_entries(c, ledger_id, found, budget)
            if stopped_at >= 0:
                resume = stopped_at
            if copies:
                # Rule 3: the copies are durable (``_write_chunk`` syncs), then the current
                # log's usage names their ledger, then the index points at them.
                self._write_usage(self._log_id, self._log_usage)
                records = bytearray(raw)
                for entry_id, record in copies:
                    i = (entry_id - first) * INDEX_RECORD_SIZE
                    records[i : i + INDEX_RECORD_SIZE] = record
                os.pwrite(fd, records, at)
                os.fsync(fd)
            return copied, resume
        finally:
            os.close(fd)

    def _copy_entries(
        self, c: Compaction, ledger_id: int, found: list[tuple[int, int, int]], budget: int
    ) -> tuple[list[tuple[int, bytes]], int, int]:
        """Append the entries ``found`` (entry, length, offset in ``c``'s log) to the current
        log, each after checking its header, until ``budget`` bytes are copied. Return (entry,
        new index record) of each copy, the bytes copied, and the first entry not looked at
        (-1 if none was left)."""
        src = os.open(self.log_dir / _log_name(c.log_id), os.O_RDONLY)
        copies: list[tuple[int, bytes]] = []
        chunk: list[Buffer] = []
        chunk_bytes = copied = 0
        stopped_at = -1
        try:
            for entry_id, length, offset in found:
                if copied >= budget:
                    stopped_at = entry_id
                    break
                raw = os.pread(src, ENTRY_HEADER_SIZE + length, offset)
                if len(raw) != ENTRY_HEADER_SIZE + length or ENTRY_HEADER.unpack_from(raw) != (
                    length,
                    ledger_id,
                    entry_id,
                ):
                    c.unverified += 1
                    continue
                if self._log_fd < 0:
                    self._roll_log()
                at = self._log_size + chunk_bytes
                if at + len(raw) > self.entry_log_size_limit and at > LOG_HEADER_SIZE:
                    self._write_chunk(chunk)
                    chunk, chunk_bytes = [], 0
                    self._roll_log()
                    at = self._log_size
                chunk.append(raw)
                chunk_bytes += len(raw)
                copied += len(raw)
                self._account(ledger_id, len(raw), entry_id, entry_id)
                copies.append((entry_id, INDEX_RECORD.pack(self._log_id, length, at)))
                if chunk_bytes >= _CHUNK:
                    self._write_chunk(chunk)
                    chunk, chunk_bytes = [], 0
            self._write_chunk(chunk)
        finally:
            os.close(src)
        c.copied_bytes += copied
        c.copied_entries += len(copies)
        return copies, copied, stopped_at

    def forget_logs(self, log_ids: Iterable[int]) -> None:
        """Close read handles of deleted entry logs (reactor side)."""
        for log_id in log_ids:
            fd = self._log_fds.pop(log_id, None)
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        """Close every file (after the worker stopped)."""
        for fds in (self._index_fds, self._log_fds):
            for fd in fds.values():
                os.close(fd)
            fds.clear()
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
            self._log_id = 0
