"""Entry storage of a bookie: a write cache, append-only entry logs and an on-disk index.

Layout under the ledgers directory::

    entrylogs/<id:08x>.log      16-byte header, then [u32 length][u64 ledger][i64 entry][data]...
    entrylogs/<id:08x>.ledgers  the ledger ids an entry log holds (u64 each), for garbage collection
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
reactor keeps reading from until ``finish_checkpoint`` drops it.

Rule 1 (I7): an entry is readable as soon as ``put_entry`` returned: reads consult the write
        cache, then the half being flushed, then the index and the entry logs.
Rule 2 (I6, I3): a checkpoint writes and fsyncs the entry logs, then the ledgers' lists of each
        log, then the index files (locations and ledger headers) and their directory; only after
        that may the caller persist the journal mark and delete older journal files.
Rule 3 (I8): an entry log is deleted only when none of the ledgers it holds has an index file
        (they were all deleted); compacting partly live logs is not done yet (TODO): a log with one
        live ledger is kept whole.
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
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
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
_LEDGER_ID = struct.Struct(">Q")

_CHUNK = 1024 * 1024  # bytes buffered before one write (and sync) of an entry log


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
    logs_touched: list[int] = field(default_factory=list)


def _log_name(log_id: int) -> str:
    return f"{log_id:08x}.log"


def _ledgers_name(log_id: int) -> str:
    return f"{log_id:08x}.ledgers"


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
        self._log_ledgers: set[int] = set()

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
        raw = os.pread(fd, INDEX_RECORD_SIZE, INDEX_HEADER_SIZE + entry_id * INDEX_RECORD_SIZE)
        if len(raw) < INDEX_RECORD_SIZE:
            return None
        log_id, length, offset = INDEX_RECORD.unpack(raw)
        if log_id == 0:
            return None
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
        """Write a job to disk in the order of Rule 2 (worker thread; blocking)."""
        for ledger_id in job.deletions:
            (self.index_dir / f"{ledger_id}.idx").unlink(missing_ok=True)
        runs = self._write_entries(job)
        headers = {lid: (fenced, lac, last) for lid, fenced, lac, last in job.states}
        created = False
        for ledger_id in sorted(set(runs) | set(headers)):
            created |= self._write_index(ledger_id, runs.get(ledger_id, ()), headers.get(ledger_id))
        if created or job.deletions:
            fsync_dir(self.index_dir)

    def finish_checkpoint(self, job: CheckpointJob) -> None:
        """Drop the flushed half of the write cache (reactor side, after the job ran)."""
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

    def _write_entries(self, job: CheckpointJob) -> dict[int, list[tuple[int, list[bytes]]]]:
        """Append the snapshot, sorted by (ledger, entry), to entry logs; fsync them; persist
        their ledger lists. Return per ledger its runs of consecutive entries as (first entry,
        packed index records), ready for ``_write_index``."""
        runs: dict[int, list[tuple[int, list[bytes]]]] = {}
        if not job.snapshot:
            return runs
        pack_header = ENTRY_HEADER.pack
        pack_index = INDEX_RECORD.pack
        limit = self.entry_log_size_limit
        chunk: list[Buffer] = []
        append = chunk.append
        chunk_bytes = 0
        if self._log_fd < 0:
            self._roll_log(job)
        log_id = self._log_id
        for ledger_id in sorted(job.snapshot):
            entries = job.snapshot[ledger_id]
            ledger_runs = runs[ledger_id] = []
            listed = False  # in the ledger list of the current log
            job.entries_written += len(entries)
            records: list[bytes] = []
            expected = -2
            for entry_id in sorted(entries):
                data = entries[entry_id]
                n = len(data)
                offset = self._log_size + chunk_bytes
                if offset + ENTRY_HEADER_SIZE + n > limit and offset > LOG_HEADER_SIZE:
                    self._write_chunk(chunk)
                    chunk, chunk_bytes = [], 0
                    append = chunk.append
                    self._roll_log(job)
                    listed = False
                    log_id = self._log_id
                    offset = self._log_size
                if not listed:
                    self._log_ledgers.add(ledger_id)
                    listed = True
                if entry_id != expected:
                    records = []
                    ledger_runs.append((entry_id, records))
                expected = entry_id + 1
                append(pack_header(n, ledger_id, entry_id))
                append(data)
                records.append(pack_index(log_id, n, offset))
                chunk_bytes += ENTRY_HEADER_SIZE + n
                if chunk_bytes >= _CHUNK:
                    self._write_chunk(chunk)
                    chunk, chunk_bytes = [], 0
                    append = chunk.append
        self._write_chunk(chunk)
        os.fsync(self._log_fd)
        self._write_ledger_list(self._log_id, self._log_ledgers)
        return runs

    def _write_chunk(self, chunk: list[Buffer]) -> None:
        """Write a chunk and sync it at once: a journal sync that had to flush many megabytes
        of entry log with it (one file system journal) would stall every add behind it."""
        if not chunk:
            return
        # Gathered by the kernel: a joined copy would hold the GIL the reactor needs.
        try:
            write_parts(self._log_fd, chunk)
        finally:
            # What reached the file, even if a write failed part-way (as ``os.write`` kept it).
            self._log_size = os.lseek(self._log_fd, 0, os.SEEK_CUR)
        os.fdatasync(self._log_fd)

    def _roll_log(self, job: CheckpointJob) -> None:
        """Seal the current entry log (fsync'd, ledger list written) and start the next."""
        if self._log_fd >= 0:
            os.fsync(self._log_fd)
            self._write_ledger_list(self._log_id, self._log_ledgers)
            os.close(self._log_fd)
        log_id = self._next_log_id
        self._next_log_id += 1
        fd = os.open(self.log_dir / _log_name(log_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, LOG_HEADER.pack(_LOG_MAGIC, 1, log_id))
        fsync_dir(self.log_dir)
        self._log_fd = fd
        self._log_id = log_id
        self._log_size = LOG_HEADER_SIZE
        self._log_ledgers = set()
        job.logs_touched.append(log_id)

    def _write_ledger_list(self, log_id: int, ledgers: Iterable[int]) -> None:
        raw = b"".join(_LEDGER_ID.pack(lid) for lid in sorted(ledgers))
        write_atomically(self.log_dir / _ledgers_name(log_id), raw)

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

    def ledgers_of_log(self, log_id: int) -> set[int]:
        """Return the ledgers an entry log holds, from its list or by scanning it."""
        try:
            raw = (self.log_dir / _ledgers_name(log_id)).read_bytes()
        except FileNotFoundError:
            return self._scan_log(log_id)
        return {v for (v,) in _LEDGER_ID.iter_unpack(raw[: len(raw) // 8 * 8])}

    def _scan_log(self, log_id: int) -> set[int]:
        """Read a log's entry headers (a crash left it without a ledger list)."""
        ledgers: set[int] = set()
        path = self.log_dir / _log_name(log_id)
        size = path.stat().st_size
        with open(path, "rb") as f:
            pos = LOG_HEADER_SIZE
            while pos + ENTRY_HEADER_SIZE <= size:
                f.seek(pos)
                length, ledger_id, _ = ENTRY_HEADER.unpack(f.read(ENTRY_HEADER_SIZE))
                if pos + ENTRY_HEADER_SIZE + length > size:
                    break
                ledgers.add(ledger_id)
                pos += ENTRY_HEADER_SIZE + length
        return ledgers

    def collect_garbage(self) -> list[int]:
        """Delete sealed entry logs none of whose ledgers has an index any more (Rule 3).

        Returns the deleted log ids (pass them to ``forget_logs`` on the reactor)."""
        deleted = []
        for log_id in self.log_ids():
            if log_id == self._log_id:
                continue
            ledgers = self.ledgers_of_log(log_id)
            if any((self.index_dir / f"{lid}.idx").exists() for lid in ledgers):
                continue
            (self.log_dir / _log_name(log_id)).unlink(missing_ok=True)
            (self.log_dir / _ledgers_name(log_id)).unlink(missing_ok=True)
            deleted.append(log_id)
            log.info("entry log collected", extra=kv(log=log_id, ledgers=len(ledgers)))
        return deleted

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
