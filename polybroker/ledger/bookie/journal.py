"""The bookie journal: a group-committed, fdatasync'd redo log of adds and ledger meta-records.

Rule 1 (I1, I2): a record's completion is delivered only after the group holding it was written
        (one ``os.write`` per group) and ``os.fdatasync``'d (unless ``sync_data`` is off, which
        the operator chose knowing it may lose data). One delivery per group, not per record.
Rule 2: one writer thread does the writes and syncs; the reactor stages records and hands
        them over, once per burst of input (``submit``). A group is written when its oldest record
        waited ``max_group_wait_s``, when ``buffered_writes_threshold`` bytes are queued, or at
        once when the submitter said nothing more is coming (no concurrency to wait for).
        A hand-off wakes the writer only when that changes what it does: when it waits for
        records, or waits out a group window the hand-off ends; a busy writer looks at the
        queue before it waits again. A group is written with ``writev`` of its parts.
Rule 2a: a lone group is written and synced by the submitter itself, with no hand-off: when
        nothing more is coming, the writer waits for records (so nothing is queued or being
        written), every completion handed over has run (so completions stay in journal
        order), the group is at most ``lone_max_bytes`` and one of the last ``_SYNCS_KEPT``
        group syncs took at most ``lone_max_sync_s`` (a slow disk keeps the reactor free; the
        fastest of them, since a measured sync also holds the wait for a core and the GIL
        after it, which a loaded machine adds). That saves the two thread wake-ups of a
        hand-off (the writer's and the reactor's), each a switch and, on a busy machine, a
        wait for a core; the reactor is blocked for one short sync instead. Its completion
        runs at once on the submitter's thread, not through ``deliver``: every completion
        handed over before it ran already, so journal order holds, and a ``deliver`` from the
        reactor to itself would cost a waker write and another reactor turn per group.
Rule 3 (I4): records are ``[u32 length][u32 crc32c(body)][body]`` with the body laid out as an
        ADD request body, ``[u64 ledger][i64 entry][i64 lac][u8 flags][data]``; meta-records use
        reserved negative entry ids (fence, explicit LAC, delete) and no data. Replay stops at the
        first record that is torn (short), zero (preallocated space) or corrupt, and truncates
        the file there; such a record was never acknowledged, because a group is written only
        after the previous one was synced.
Rule 4 (I3): journal files are named by increasing id and never appended to after a restart or
        a roll; the checkpoint mark (file id, offset) is replaced atomically, and files wholly
        before it are the only ones ever deleted.
Rule 5 (I2): a write or sync error fails the journal for good: nothing queued is acknowledged,
        every pending and later record fails.
Rule 5a: except when the file cannot grow for the group (``posix_fallocate`` finds the disk
        full): nothing of it was written, so only its records fail (``JournalFullError``) and
        the journal takes later groups, at the same offset, once there is room.
Rule 6: the space ahead of the writer is made of written blocks, not merely allocated ones: a
        second thread writes zeros there (``zero_ahead`` bytes ahead, through its own file
        descriptor, so a sync error it meets is still reported to the writer's) and syncs them.
        In a new file the distance starts at twice ``_ZERO_SYNC`` and grows to twice what the
        file holds, up to ``zero_ahead``: zeroing all of it at once, as fast as the disk takes
        it, made every group sync wait behind a zero sync for the first ~80 ms of each file.
        Writing into fallocated space converts unwritten extents, so every group sync would
        also commit the file system's journal; overwriting written blocks syncs data only.
        The zeros never reach a byte the writer reserved (both hold ``_space`` for that), and
        zeros read back as preallocated space, so replay is unchanged. An error there only
        stops the zeroing: groups then go to fallocated space as before. A disk found full
        (ENOSPC, EDQUOT) stops it for the current file only; the next file is zeroed again.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

from crc32c import crc32c

from polybroker.ledger.api import StorageError
from polybroker.ledger.wire import ADD_FIELDS, ADD_FIELDS_SIZE, Buffer
from polybroker.logs import kv
from polybroker.runtime import disk_full

log = logging.getLogger(__name__)

RECORD_HEADER = struct.Struct(">II")  # body length, crc32c(body)
RECORD_HEADER_SIZE = RECORD_HEADER.size

# Reserved entry ids of meta-records (BookKeeper uses the same idea and values for the first two).
META_FENCE = -0x2000
META_LAC = -0x8000
META_DELETE = -0x4000
META_ENTRY_IDS = frozenset({META_FENCE, META_LAC, META_DELETE})

FILE_MAGIC = b"PBJRNL\x00\x01"
FILE_HEADER = struct.Struct(">8sIIQ")  # magic, format version, reserved, file id
FILE_HEADER_SIZE = FILE_HEADER.size  # 24
FORMAT_VERSION = 1
FILE_SUFFIX = ".jnl"

MARK_FILE = "lastMark"
_MARK = struct.Struct(">4sQQ")
_MARK_MAGIC = b"PBMK"

DeliverFn = Callable[..., Any]

_ZERO_CHUNK = 256 * 1024  # zeros written at a time, holding ``_space`` (the writer may wait)
# Zeros synced at a time (each sync commits the extent changes). A journal sync made while one
# of these runs waits for it: 4 MiB at a time (2-3 ms each) put the journal's fdatasync p99 at
# 3-5 ms, 512 KiB at 1.9-3.7 ms (ml-1 add p99 lower in 6 of 6 alternating rounds).
_ZERO_SYNC = 512 * 1024
_ZEROS = memoryview(bytes(_ZERO_CHUNK))  # sliced without a copy
_SYNCS_KEPT = 8  # group syncs whose fastest decides whether a lone group may block (Rule 2a)


class JournalError(StorageError):
    """The journal failed (a write or sync error) or is corrupt before its end."""


class JournalFullError(JournalError):
    """A group was refused whole, as the disk had no room to extend the journal file: nothing
    of it was written, and later groups are taken (Rule 5a)."""


@dataclass(frozen=True, order=True, slots=True)
class JournalPosition:
    """A place in the journal: the byte after a record of file ``file_id``."""

    file_id: int
    offset: int


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """The journal's knobs (BookKeeper's names in the bookie config)."""

    max_group_wait_s: float = 0.001  # journalMaxGroupWaitMSec
    buffered_writes_threshold: int = 512 * 1024  # journalBufferedWritesThreshold
    max_file_size: int = 2048 * 1024 * 1024  # journalMaxSizeMB
    prealloc_size: int = 16 * 1024 * 1024  # journalPreAllocSizeMB
    sync_data: bool = True  # journalSyncData
    max_record_size: int = 6 * 1024 * 1024  # a record body never exceeds a wire frame
    zero_ahead: int = 32 * 1024 * 1024  # written (zeroed) space kept ahead (Rule 6); 0: off
    lone_max_bytes: int = 64 * 1024  # a lone group this small is written by the submitter; 0: off
    lone_max_sync_s: float = 0.002  # ... while a recent sync took at most this (Rule 2a)


def file_name(file_id: int) -> str:
    """The name of journal file ``file_id`` (hex, so names sort like ids)."""
    return f"{file_id:016x}{FILE_SUFFIX}"


def list_files(directory: Path) -> list[int]:
    """Return the ids of the journal files in ``directory``, ascending."""
    ids = []
    for p in directory.iterdir():
        if p.name.endswith(FILE_SUFFIX):
            try:
                ids.append(int(p.name[: -len(FILE_SUFFIX)], 16))
            except ValueError:
                continue
    return sorted(ids)


def meta_record(ledger_id: int, kind: int, lac: int = -1) -> tuple[bytes, bytes]:
    """Return (header, body) of a meta-record (``kind`` is one of the ``META_*`` ids)."""
    body = ADD_FIELDS.pack(ledger_id, kind, lac, 0)
    return RECORD_HEADER.pack(len(body), crc32c(body)), body


def entry_record(
    ledger_id: int, entry_id: int, lac: int, data: Buffer, flags: int = 0
) -> tuple[bytes, bytes]:
    """Return (header, body) of an add record (the server reuses the wire body instead)."""
    body = ADD_FIELDS.pack(ledger_id, entry_id, lac, flags) + data
    return RECORD_HEADER.pack(len(body), crc32c(body)), body


def fsync_dir(path: Path) -> None:
    """Make the names in a directory durable (a new file is not, until its directory is)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_mark(directory: Path) -> JournalPosition | None:
    """Return the persisted checkpoint mark, None if there is none yet."""
    path = directory / MARK_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) != _MARK.size + 4 or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "big"):
        raise JournalError(f"checkpoint mark {path} is corrupt")
    magic, file_id, offset = _MARK.unpack_from(raw)
    if magic != _MARK_MAGIC:
        raise JournalError(f"checkpoint mark {path} is corrupt")
    return JournalPosition(file_id, offset)


def write_mark(directory: Path, mark: JournalPosition) -> None:
    """Persist the checkpoint mark atomically (Rule 4)."""
    raw = _MARK.pack(_MARK_MAGIC, mark.file_id, mark.offset)
    write_atomically(directory / MARK_FILE, raw + crc32c(raw).to_bytes(4, "big"))


def delete_files_before(directory: Path, file_id: int) -> list[int]:
    """Delete the journal files whose id is below ``file_id`` (wholly before a mark)."""
    gone = []
    for fid in list_files(directory):
        if fid < file_id:
            (directory / file_name(fid)).unlink(missing_ok=True)
            gone.append(fid)
    return gone


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplayRecord:
    """One journal record read back; ``end`` is the position after it."""

    ledger_id: int
    entry_id: int
    lac: int
    data: bytes
    end: JournalPosition


class JournalReplay:
    """Read the journal from a mark: iterate ``records()``; afterwards ``end`` is the position
    after the last good record and ``truncated`` tells whether a torn or corrupt tail was cut."""

    def __init__(self, directory: Path, mark: JournalPosition | None, max_record_size: int) -> None:
        self.directory = directory
        self.mark = mark
        self.max_record_size = max_record_size
        self.end: JournalPosition | None = mark
        self.truncated: list[tuple[int, int]] = []  # (file id, offset) where a tail was cut
        self.records_read = 0

    def records(self) -> Iterator[ReplayRecord]:
        """Yield every good record after the mark, in journal order."""
        ids = list_files(self.directory)
        start = self.mark.file_id if self.mark else -1
        ids = [i for i in ids if i >= start]
        for n, file_id in enumerate(ids):
            last = n == len(ids) - 1
            offset = self.mark.offset if self.mark and file_id == self.mark.file_id else 0
            yield from self._file(file_id, offset, last)

    def _file(self, file_id: int, offset: int, last: bool) -> Iterator[ReplayRecord]:
        path = self.directory / file_name(file_id)
        size = path.stat().st_size
        with open(path, "rb", buffering=1 << 20) as f:
            header = f.read(FILE_HEADER_SIZE)
            if len(header) < FILE_HEADER_SIZE or header.count(0) == len(header):
                # A file whose header never reached the disk holds nothing acknowledged.
                self._cut(path, file_id, 0, size, last, "torn file header")
                return
            magic, version, _, fid = FILE_HEADER.unpack(header)
            if magic != FILE_MAGIC or version != FORMAT_VERSION or fid != file_id:
                raise JournalError(f"journal file {path} has a bad header")
            pos = max(offset, FILE_HEADER_SIZE)
            f.seek(pos)
            self.end = JournalPosition(file_id, pos)
            while True:
                head = f.read(RECORD_HEADER_SIZE)
                if len(head) < RECORD_HEADER_SIZE:
                    if head:
                        self._cut(path, file_id, pos, size, last, "torn record header")
                    return
                length, crc = RECORD_HEADER.unpack(head)
                if length == 0:
                    # Preallocated space: the end of what was written.
                    self._cut(path, file_id, pos, size, last, None)
                    return
                if length < ADD_FIELDS_SIZE or length > self.max_record_size:
                    self._cut(path, file_id, pos, size, last, f"bad record length {length}")
                    return
                body = f.read(length)
                if len(body) < length:
                    self._cut(path, file_id, pos, size, last, "torn record")
                    return
                if crc32c(body) != crc:
                    self._cut(path, file_id, pos, size, last, "record checksum mismatch")
                    return
                ledger, entry, lac, _flags = ADD_FIELDS.unpack_from(body)
                if entry < 0 and entry not in META_ENTRY_IDS:
                    self._cut(path, file_id, pos, size, last, f"bad entry id {entry}")
                    return
                pos += RECORD_HEADER_SIZE + length
                end = JournalPosition(file_id, pos)
                self.end = end
                self.records_read += 1
                yield ReplayRecord(ledger, entry, lac, body[ADD_FIELDS_SIZE:], end)

    def _cut(
        self, path: Path, file_id: int, pos: int, size: int, last: bool, why: str | None
    ) -> None:
        if why is not None and not last:
            # Files roll only after everything in them was synced and acknowledged: damage
            # before the journal's end is damage to acknowledged data. Refuse to guess.
            raise JournalError(
                f"journal file {path} is corrupt at offset {pos} ({why}) and later journal "
                "files exist: acknowledged data is damaged"
            )
        if pos < size:
            if why is not None:
                log.warning("journal tail cut", extra=kv(file=path.name, offset=pos, reason=why))
                self.truncated.append((file_id, pos))
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, pos)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.end = JournalPosition(file_id, pos)


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------


_IOV_MAX = 1024  # the least IOV_MAX POSIX systems give; writev takes at most this many parts


def write_parts(fd: int, parts: list[Buffer]) -> None:
    """Write ``parts`` in order at ``fd``'s offset with ``os.writev``: the kernel gathers them,
    so no joined copy is made (one on the writer thread held the GIL the reactor needs for as
    long as the copy of a group took). Raises ``OSError`` as ``os.write`` does. Only a short
    write is accounted part by part: a checkpoint's chunk has hundreds of parts."""
    pending: list[Buffer] = parts
    while pending:
        batch = pending if len(pending) <= _IOV_MAX else pending[:_IOV_MAX]
        written = os.writev(fd, batch)
        if written == sum(map(len, batch)):
            pending = pending[len(batch) :]
            continue
        # A short write: the parts written whole are done, the rest of the next goes first.
        i = 0
        for part in batch:
            size = len(part)
            if written < size:
                break
            written -= size
            i += 1
        pending = [memoryview(batch[i])[written:], *pending[i + 1 :]]


def group_wait(
    now: float,
    oldest: float,
    queued_bytes: int,
    burst_done: bool,
    max_wait: float,
    threshold: int,
) -> float:
    """Return how long the writer should still wait before writing the queued group (0: now).

    Now when nothing more is coming, when the threshold is reached, or when the oldest record
    has waited ``max_wait``; otherwise the rest of that window."""
    if burst_done or queued_bytes >= threshold:
        return 0.0
    return max(0.0, oldest + max_wait - now)


# Where the writer waits (``Journal._writer_waiting``).
_NOT_WAITING = 0  # writing, syncing or delivering: it looks at the queue before waiting again
_IDLE = 1  # for records (nothing queued)
_WINDOW = 2  # for the group window to end (records queued)


class _Batch:
    """Records handed over in one ``submit``."""

    __slots__ = ("nbytes", "parts", "tokens")

    def __init__(self, parts: list[Buffer], tokens: list[Any], nbytes: int) -> None:
        self.parts = parts
        self.tokens = tokens
        self.nbytes = nbytes


class Journal:
    """The journal writer (see the module rules).

    Reactor side: ``add`` stages a record with an opaque token, ``submit`` hands the staged
    records to the writer. Writer side: ``start`` runs ``write_pending`` on a dedicated thread;
    tests call ``write_pending`` directly instead. Completions are delivered through
    ``deliver(fn, on_group_done, tokens, position)`` (``reactor.callFromThread`` in a server),
    and a failure through ``deliver(fn, on_failure, error, tokens)``: ``fn`` counts the
    completion as run (Rule 2a) and calls the callback with the rest. A lone group's completion
    (Rule 2a) runs at once instead, inside ``submit``."""

    def __init__(
        self,
        directory: Path,
        config: JournalConfig,
        *,
        deliver: DeliverFn,
        on_group_done: Callable[[list[Any], JournalPosition], None],
        on_failure: Callable[[BaseException, list[Any]], None],
        first_file_id: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.config = config
        self._deliver = deliver
        self._on_group_done = on_group_done
        self._on_failure = on_failure
        self._clock = clock
        # Reactor-side staging.
        self._staged_parts: list[Buffer] = []
        self._staged_tokens: list[Any] = []
        self._staged_bytes = 0
        # Shared with the writer, under _cond.
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Batch] = []
        self._queued_bytes = 0
        self._oldest = 0.0
        self._burst_done = False
        self._stopping = False
        self._writer_waiting = _NOT_WAITING  # where the writer waits, if it does
        self.wakeups = 0  # writer wake-ups ``submit`` made (for tests and profiles)
        self.lone_groups = 0  # groups ``submit`` wrote itself (Rule 2a; for tests and profiles)
        self._handed = 0  # completions handed to ``deliver`` (by whoever wrote the group)
        self._ran = 0  # ... and run (reactor side); equal: none is still on its way
        self._syncs: deque[float] = deque(maxlen=_SYNCS_KEPT)  # recent write+sync times
        self.failed: BaseException | None = None
        # Writer-side file state.
        self._fd = -1
        self._file_id = first_file_id - 1
        self._offset = 0
        self._allocated = 0
        self._thread: threading.Thread | None = None
        self.groups_written = 0
        # Shared by the writer and the zeroing thread (Rule 6), under _space.
        self._space = threading.Condition(threading.Lock())
        self._space_file = -1  # the file the fields below are about
        self._reserved = 0  # the writer wrote or is writing everything before this offset
        self._zero_written = 0  # blocks before this are written (zeros or records)
        self._zeroed = 0  # ... and synced (for stats and tests)
        self._zero_target = 0  # the zeroing thread writes zeros up to here
        self._zero_fd = -1  # the zeroing side's own descriptor of file _zero_fd_file
        self._zero_fd_file = -1
        self._zero_stopped = False
        self._zero_paused_file = -1  # the file the disk had no room to zero (Rule 6)
        self._zero_thread: threading.Thread | None = None
        self.zero_error: BaseException | None = None
        self._open_file(first_file_id)

    # -- reactor side ---------------------------------------------------------------------

    def add(self, header: bytes, body: Buffer, token: Any) -> None:
        """Stage one record (``header`` from ``RECORD_HEADER``); it is queued by ``submit``."""
        self._staged_parts.append(header)
        self._staged_parts.append(body)
        self._staged_tokens.append(token)
        self._staged_bytes += RECORD_HEADER_SIZE + len(body)

    def add_records(self, records: Buffer, token: Any) -> None:
        """Stage several ready-made, checked records (an ADD_MULTI's tail) under one token."""
        self._staged_parts.append(records)
        self._staged_tokens.append(token)
        self._staged_bytes += len(records)

    def submit(self, more_coming: bool = False) -> None:
        """Hand the staged records to the writer; ``more_coming`` lets it wait for more."""
        if not self._staged_tokens:
            return
        parts, tokens, nbytes = self._staged_parts, self._staged_tokens, self._staged_bytes
        self._staged_parts = []
        self._staged_tokens = []
        self._staged_bytes = 0
        refused: BaseException | None = None
        lone = False
        with self._cond:
            if self.failed is not None or self._stopping:
                refused = self.failed or JournalError("journal is stopping")
            elif (
                not more_coming
                # Parked first: only then are the writer-side fields below still.
                and self._writer_waiting == _IDLE
                and not self._queue
                and self._handed == self._ran
                and nbytes <= self.config.lone_max_bytes
                and self._offset + nbytes <= self.config.max_file_size  # no roll here
                and (not self._syncs or min(self._syncs) <= self.config.lone_max_sync_s)
            ):
                # Rule 2a: the writer stays parked (it waits for a queued record) while
                # this thread writes; nothing else submits meanwhile (one submitter).
                lone = True
            else:
                if not self._queue:
                    self._oldest = self._clock()
                self._queue.append(_Batch(parts, tokens, nbytes))
                self._queued_bytes += nbytes
                self._burst_done = not more_coming
                # Wake the writer only when this changes what it does (Rule 2): a wake-up is
                # a futex call and, on a busy machine, often a switch away from the reactor.
                waiting = self._writer_waiting
                if waiting == _IDLE or (
                    waiting == _WINDOW
                    and (
                        self._burst_done
                        or self._queued_bytes >= self.config.buffered_writes_threshold
                    )
                ):
                    self._cond.notify()
                    self._writer_waiting = _NOT_WAITING
                    self.wakeups += 1
        if refused is not None:
            self._hand(self._on_failure, refused, tokens)
        elif lone:
            self.lone_groups += 1
            self._write_and_hand(parts, tokens, nbytes, self._run_now)

    def _hand(self, fn: Callable[..., None], *args: Any) -> None:
        self._handed += 1
        self._deliver(self._completion, fn, *args)

    def _run_now(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a lone group's completion on the submitter's thread (Rule 2a)."""
        self._handed += 1
        self._ran += 1
        fn(*args)

    def _completion(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a delivered completion (reactor side)."""
        self._ran += 1
        fn(*args)

    # -- writer side ----------------------------------------------------------------------

    def start(self) -> None:
        """Run the writer on its own thread (and the zeroing of Rule 6 on another)."""
        self._thread = threading.Thread(target=self._run, name="bookie-journal", daemon=True)
        self._thread.start()
        if self.config.zero_ahead > 0:
            self._zero_thread = threading.Thread(
                target=self._zero_run, name="bookie-journal-zeros", daemon=True
            )
            self._zero_thread.start()

    def stop(self) -> None:
        """Write what is queued, stop the writer and close the file (blocks; call off-reactor
        or at shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        else:
            while self.write_pending(block=False):
                pass
        self._stop_zeroing()
        self._close_file(trim=True)

    def close(self) -> None:
        """Close the file without writing what is queued (what a crash leaves behind)."""
        with self._cond:
            self._stopping = True
        self._stop_zeroing()
        self._close_file(trim=False)

    def _run(self) -> None:
        while self.write_pending(block=True):
            pass

    def _take(self, block: bool) -> list[_Batch] | None:
        with self._cond:
            while not self._queue:
                if self._stopping or not block:
                    return None
                self._writer_waiting = _IDLE
                self._cond.wait()
                self._writer_waiting = _NOT_WAITING
            while block and not self._stopping:
                wait = group_wait(
                    self._clock(),
                    self._oldest,
                    self._queued_bytes,
                    self._burst_done,
                    self.config.max_group_wait_s,
                    self.config.buffered_writes_threshold,
                )
                if wait <= 0:
                    break
                self._writer_waiting = _WINDOW
                self._cond.wait(wait)
                self._writer_waiting = _NOT_WAITING
            batches = self._queue
            self._queue = []
            self._queued_bytes = 0
            self._burst_done = False
            return batches

    def write_pending(self, block: bool = False) -> bool:
        """Write and sync one group of everything queued, then deliver its completion.

        Returns False when there was nothing to write (and, with ``block``, the journal is
        stopping). With ``block`` it waits for records and for the group window."""
        batches = self._take(block)
        if batches is None:
            return False
        if len(batches) == 1:
            parts, tokens = batches[0].parts, batches[0].tokens
            nbytes = batches[0].nbytes
        else:
            parts, tokens, nbytes = [], [], 0
            for b in batches:
                parts.extend(b.parts)
                tokens.extend(b.tokens)
                nbytes += b.nbytes
        if self.failed is not None:
            self._hand(self._on_failure, self.failed, tokens)
            return True
        self._write_and_hand(parts, tokens, nbytes)
        return True

    def _write_and_hand(
        self,
        parts: list[Buffer],
        tokens: list[Any],
        nbytes: int,
        hand: Callable[..., None] | None = None,
    ) -> None:
        """Write and sync one group, then hand its completion (or the failure) to ``deliver``
        (or to ``hand``)."""
        if hand is None:
            hand = self._hand
        try:
            position = self._write_group(parts, nbytes)
        except JournalFullError as e:
            log.warning("journal group refused: disk full", extra=kv(error=str(e)))
            hand(self._on_failure, e, tokens)
            return
        except OSError as e:
            error = JournalError(f"journal write failed: {e}")
            log.critical("journal failed; no further adds", extra=kv(error=str(e)))
            with self._cond:
                self.failed = error
                rest = [t for b in self._queue for t in b.tokens]
                self._queue = []
                self._queued_bytes = 0
            hand(self._on_failure, error, tokens + rest)
            return
        self.groups_written += 1
        hand(self._on_group_done, tokens, position)

    def _write_group(self, parts: list[Buffer], nbytes: int) -> JournalPosition:
        if self._offset + nbytes > self.config.max_file_size and self._offset > FILE_HEADER_SIZE:
            self._roll()
        end = self._offset + nbytes
        ahead = self.config.zero_ahead
        if ahead > 0:
            ahead = min(ahead, max(2 * _ZERO_SYNC, 2 * end))  # a new file ramps up (Rule 6)
        with self._space:
            # From here on the zeroing thread keeps off these bytes (Rule 6).
            self._reserved = end
            written = self._zero_written
            if ahead > 0 and end + ahead // 2 > self._zero_target:
                self._zero_target = end + ahead
                self._space.notify()
        if end > self._allocated and end > written and self.config.prealloc_size > 0:
            grow = max(self.config.prealloc_size, end - self._allocated)
            try:
                os.posix_fallocate(self._fd, self._allocated, grow)
            except OSError as e:
                if disk_full(e):  # Rule 5a: nothing of the group is written yet
                    raise JournalFullError(f"journal cannot grow: {e}") from e
                raise
            self._allocated += grow
        started = perf_counter()
        write_parts(self._fd, parts)
        if self.config.sync_data:
            os.fdatasync(self._fd)
        self._syncs.append(perf_counter() - started)
        self._offset = end
        return JournalPosition(self._file_id, end)

    def _open_file(self, file_id: int) -> None:
        path = self.directory / file_name(file_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            header = FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, file_id)
            os.write(fd, header)
            allocated = FILE_HEADER_SIZE
            if self.config.prealloc_size > 0:
                os.posix_fallocate(fd, 0, self.config.prealloc_size)
                allocated = max(allocated, self.config.prealloc_size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        # Records acknowledged in this file must not vanish with its name.
        fsync_dir(self.directory)
        self._fd = fd
        self._file_id = file_id
        self._offset = FILE_HEADER_SIZE
        self._allocated = allocated
        with self._space:
            self._space_file = file_id
            self._reserved = FILE_HEADER_SIZE
            self._zero_written = self._zeroed = FILE_HEADER_SIZE
            # Nothing yet: the first group asks for zeros, so an idle bookie writes none.
            self._zero_target = FILE_HEADER_SIZE

    def _close_file(self, trim: bool) -> None:
        if self._fd < 0:
            return
        with self._space:
            self._space_file = -1  # no zeros after the end of a file being closed
        try:
            if trim:
                os.ftruncate(self._fd, self._offset)
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def _roll(self) -> None:
        self._close_file(trim=True)
        self._open_file(self._file_id + 1)
        log.info("journal rolled", extra=kv(file=file_name(self._file_id)))

    # -- zeroing side (Rule 6) ------------------------------------------------------------

    def _zero_run(self) -> None:
        try:
            while self.zero_step(block=True):
                pass
        except OSError as e:
            # Only an optimisation stops: the writer's own syncs still report any loss.
            self.zero_error = e
            log.warning("journal zeroing stopped", extra=kv(error=str(e)))
        finally:
            with self._space:
                self._zero_stopped = True
                self._close_zero_fd()

    def zero_step(self, block: bool = False) -> bool:
        """Write zeros ahead of the writer up to ``_ZERO_SYNC`` bytes, then sync them.

        Returns False when there is nothing to zero (and, with ``block``, the journal stops);
        with ``block`` it waits for the writer to ask for more. Runs on the zeroing thread;
        tests call it directly."""
        with self._space:
            while True:
                if self._zero_stopped or self._stopping:
                    return False
                start = max(self._zero_written, self._reserved)
                wanted = self._space_file >= 0 and self._space_file != self._zero_paused_file
                if wanted and start < self._zero_target:
                    break
                if not block:
                    return False
                self._space.wait()
            file_id = self._space_file
            if self._zero_fd_file != file_id:
                self._close_zero_fd()
                self._zero_fd = os.open(self.directory / file_name(file_id), os.O_WRONLY)
                self._zero_fd_file = file_id
            fd = self._zero_fd
        try:
            end = self._write_zeros(fd, file_id, start)
            if end == start:
                return True  # the writer got there first, or moved to another file
            os.fdatasync(fd)
        except OSError as e:
            if not disk_full(e):
                raise
            self.zero_error = e
            with self._space:
                self._zero_paused_file = file_id
            log.warning("journal zeroing paused until the next file", extra=kv(error=str(e)))
            return True
        with self._space:
            if self._space_file == file_id:
                self._zeroed = max(self._zeroed, min(end, self._zero_written))
        return True

    def _write_zeros(self, fd: int, file_id: int, start: int) -> int:
        """Write zeros into file ``file_id`` from ``start`` on, at most ``_ZERO_SYNC`` bytes, off
        what the writer reserves; return the end written (``start`` when nothing was, or when
        the writer moved to another file meanwhile)."""
        stop = start + _ZERO_SYNC
        end = start
        while True:
            with self._space:
                # The writer may have reserved more, or moved to another file, meanwhile.
                if self._space_file != file_id or self._stopping:
                    return start
                pos = max(self._zero_written, self._reserved)
                chunk_end = min(pos + _ZERO_CHUNK, self._zero_target, stop)
                if pos >= chunk_end:
                    return end
                # A short write claims only what it wrote; the next one reports the error.
                self._zero_written = end = pos + os.pwrite(fd, _ZEROS[: chunk_end - pos], pos)

    def _close_zero_fd(self) -> None:
        if self._zero_fd >= 0:
            os.close(self._zero_fd)
            self._zero_fd = -1
            self._zero_fd_file = -1

    def _stop_zeroing(self) -> None:
        with self._space:
            self._zero_stopped = True
            self._space.notify_all()
        if self._zero_thread is not None:
            self._zero_thread.join()
            self._zero_thread = None
        with self._space:
            self._close_zero_fd()

    @property
    def position(self) -> JournalPosition:
        """Where the next group goes (writer side; for tests and logs)."""
        return JournalPosition(self._file_id, self._offset)
