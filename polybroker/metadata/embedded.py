"""The embedded MetadataStore: a ``MemoryTree`` made durable by a log and snapshots on disk.

Files under the store's directory:

- ``LOCK``: held with ``flock`` while a store is open; a second opener fails with
  ``StoreLockedError`` (naming the holder's pid).
- ``snapshot``: the persistent nodes as of the start of log generation G, written as a temp
  file, fsync'd, renamed into place and the directory fsync'd; absent means G = 0 and no nodes.
- ``log.<G in hex>``: the operations since that snapshot, one record each:
  ``[u32 length][u32 crc32c(payload)][payload]``.

Rule E1: an operation that changes persistent nodes appends exactly one record (all of its
        changes, so replay applies an operation whole or not at all); its Deferred fires, on
        the reactor thread, only after that record was written and ``fdatasync``'d. One writer
        thread writes and syncs whatever queued up while it was busy (group commit).
Rule E2: changes are applied in memory at once (later operations are checked against them), but
        no outcome is delivered before every record submitted before it is durable: reads,
        failures and ephemeral-only changes wait behind earlier writes. So Deferreds fire in
        the order operations were issued, and nothing seen through the store can be lost by a
        crash. Watches fire when the change's outcome is delivered.
Rule E3: replay stops at the first torn, oversized or checksum-failing record and truncates the
        log there: a group is written with one ``write`` and acknowledged only after its sync,
        so the cut part was never acknowledged. A checksummed record that does not decode or
        does not fit the tree is corruption, not a torn tail, and fails the open.
Rule E4: when the log grows past ``max(compact_min_bytes, 2 * snapshot size)`` the state is
        snapshotted and a new log generation starts; the old log is deleted once the snapshot is
        durable. Disk use and load time stay proportional to the metadata, not its history.
Rule E5: ephemeral nodes are never written; the sequence counters and the sequence floor are.
Rule E6: a failed write or sync fails the store for good: pending and later operations fail
        with ``MetadataError``; ``close`` still releases the lock.
Rule E6a: except for want of room (a full disk): what the failed write left is cut off the
        log, and the writer tries the same group (or snapshot) again, after 0.1 s, then at
        most every second, until it goes through or the store closes. Outcomes wait meanwhile
        (Rule E2), so nothing is acknowledged before it is durable and nothing is lost; the
        store serves again once there is room, with no restart.
Rule E7: the store emits no session events; it only ever closes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from crc32c import crc32c
from twisted.internet.defer import Deferred, fail
from twisted.internet.threads import deferToThreadPool
from twisted.python.failure import Failure

from polybroker.logs import kv
from polybroker.metadata.api import MetadataError, Notification, StoreClosedError
from polybroker.metadata.memory import (
    MAX_PATH_BYTES,
    MAX_VALUE_BYTES,
    Changes,
    DeleteNode,
    MemoryTree,
    Mutation,
    SetNode,
    SetSequence,
    TreeSession,
    validate_path,
)
from polybroker.runtime import disk_full

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
SNAPSHOT_FILE = "snapshot"
LOG_PREFIX = "log."
FORMAT_VERSION = 1

RECORD_HEADER = struct.Struct(">II")  # payload length, crc32c(payload)
# One operation writes its node, at most one counter and its missing ancestors, each at most
# MAX_PATH_BYTES long and at most MAX_PATH_BYTES // 2 deep: about 9 MiB at worst.
MAX_RECORD_BYTES = 16 * 1024 * 1024

LOG_MAGIC = b"PBMDLOG\x00"
LOG_HEADER = struct.Struct(">8sIQ")  # magic, format version, generation
SNAPSHOT_MAGIC = b"PBMDSNAP"
SNAPSHOT_HEADER = struct.Struct(">8sIQQQ")  # magic, format version, generation, floor, nodes

DEFAULT_COMPACT_MIN_BYTES = 4 * 1024 * 1024

_TAG_SET = 1
_TAG_DELETE = 2
_TAG_SEQUENCE = 3
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_NODE_FIELDS = struct.Struct(">qqqQ")  # version, created ms, modified ms, next sequence
_U64 = struct.Struct(">Q")

_fdatasync = getattr(os, "fdatasync", os.fsync)


class StoreLockedError(MetadataError):
    """The store's directory is open in another store (this or another process)."""


class CorruptStoreError(MetadataError):
    """The store's files are damaged beyond a torn log tail; nothing was changed."""


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def _put_path(out: list[bytes], path: str) -> None:
    raw = path.encode("utf-8")
    out.append(_U16.pack(len(raw)))
    out.append(raw)


def _put_node(out: list[bytes], m: SetNode) -> None:
    _put_path(out, m.path)
    out.append(_U32.pack(len(m.value)))
    out.append(m.value)
    out.append(_NODE_FIELDS.pack(m.version, m.created_ms, m.modified_ms, m.next_seq))


def encode_mutations(mutations: list[Mutation]) -> bytes:
    """Return the payload of one log record holding ``mutations``."""
    out: list[bytes] = [bytes((FORMAT_VERSION,))]
    for m in mutations:
        if isinstance(m, SetNode):
            out.append(bytes((_TAG_SET,)))
            _put_node(out, m)
        elif isinstance(m, DeleteNode):
            out.append(bytes((_TAG_DELETE,)))
            _put_path(out, m.path)
        else:
            out.append(bytes((_TAG_SEQUENCE,)))
            _put_path(out, m.path)
            out.append(_U64.pack(m.next_seq))
    return b"".join(out)


def frame(payload: bytes) -> bytes:
    """Return a log record: header and payload."""
    return RECORD_HEADER.pack(len(payload), crc32c(payload)) + payload


class _Reader:
    """Bounded reads from a buffer; running past its end is corruption."""

    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self._what = what

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int) -> memoryview:
        if n > self.remaining:
            raise CorruptStoreError(f"{self._what}: truncated field at byte {self._pos}")
        view = self._data[self._pos : self._pos + n]
        self._pos += n
        return view

    def unpack(self, s: struct.Struct) -> tuple[Any, ...]:
        return s.unpack(self.take(s.size))

    def path(self) -> str:
        (n,) = self.unpack(_U16)
        if n > MAX_PATH_BYTES:
            raise CorruptStoreError(f"{self._what}: path of {n} bytes")
        try:
            path = bytes(self.take(n)).decode("utf-8")
            return validate_path(path)
        except (UnicodeDecodeError, ValueError) as e:
            raise CorruptStoreError(f"{self._what}: bad path ({e})") from e

    def node(self) -> SetNode:
        path = self.path()
        (n,) = self.unpack(_U32)
        if n > MAX_VALUE_BYTES:
            raise CorruptStoreError(f"{self._what}: value of {n} bytes at {path}")
        value = bytes(self.take(n))
        version, created, modified, next_seq = self.unpack(_NODE_FIELDS)
        if version < 0:
            raise CorruptStoreError(f"{self._what}: negative version at {path}")
        return SetNode(path, value, version, created, modified, next_seq)


def decode_mutations(payload: bytes | memoryview, what: str) -> list[Mutation]:
    """Decode one record's payload; raise ``CorruptStoreError`` if it is malformed."""
    r = _Reader(payload, what)
    (version,) = r.take(1)
    if version != FORMAT_VERSION:
        raise CorruptStoreError(f"{what}: unknown record format {version}")
    out: list[Mutation] = []
    while r.remaining:
        (tag,) = r.take(1)
        if tag == _TAG_SET:
            out.append(r.node())
        elif tag == _TAG_DELETE:
            out.append(DeleteNode(r.path()))
        elif tag == _TAG_SEQUENCE:
            path = r.path()
            (next_seq,) = r.unpack(_U64)
            out.append(SetSequence(path, next_seq))
        else:
            raise CorruptStoreError(f"{what}: unknown mutation tag {tag}")
    return out


def encode_snapshot(tree: MemoryTree, generation: int) -> bytes:
    """Return a snapshot of ``tree``'s persistent nodes, checksummed as a whole."""
    out: list[bytes] = [b""]
    count = 0
    for path, node in tree.persistent_nodes():
        _put_node(out, MemoryTree._set_mutation(path, node))
        count += 1
    out[0] = SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, FORMAT_VERSION, generation, tree.seq_floor, count)
    body = b"".join(out)
    return body + _U32.pack(crc32c(body))


def load_snapshot(data: bytes, tree: MemoryTree, what: str) -> int:
    """Fill an empty ``tree`` from a snapshot; return its generation."""
    if len(data) < SNAPSHOT_HEADER.size + _U32.size:
        raise CorruptStoreError(f"{what}: too short ({len(data)} bytes)")
    body, (crc,) = memoryview(data)[:-4], _U32.unpack(data[-4:])
    if crc32c(body) != crc:
        raise CorruptStoreError(f"{what}: checksum mismatch")
    r = _Reader(body, what)
    magic, version, generation, floor, count = r.unpack(SNAPSHOT_HEADER)
    if magic != SNAPSHOT_MAGIC or version != FORMAT_VERSION:
        raise CorruptStoreError(f"{what}: not a metadata snapshot of format {FORMAT_VERSION}")
    for _ in range(count):
        m = r.node()
        try:
            tree.apply(m)
        except MetadataError as e:
            raise CorruptStoreError(f"{what}: {e}") from e
    if r.remaining:
        raise CorruptStoreError(f"{what}: {r.remaining} bytes after the last node")
    tree.seq_floor = floor
    return int(generation)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make the names in a directory durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def log_name(generation: int) -> str:
    return f"{LOG_PREFIX}{generation:016x}"


def _log_generations(directory: Path) -> list[int]:
    gens = []
    for p in directory.iterdir():
        if p.name.startswith(LOG_PREFIX):
            try:
                gens.append(int(p.name[len(LOG_PREFIX) :], 16))
            except ValueError:
                continue
    return sorted(gens)


def _create_log(directory: Path, generation: int) -> int:
    """Create log ``generation`` with its header, durable (file and name); return its fd."""
    path = directory / log_name(generation)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        _write_all(fd, LOG_HEADER.pack(LOG_MAGIC, FORMAT_VERSION, generation))
        os.fsync(fd)
        fsync_dir(directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(directory: Path) -> int:
    """Take the directory's lock; return its fd or raise ``StoreLockedError``."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StoreLockedError(
                f"metadata store {directory} is already open (by process {holder}); "
                "only one store may use a directory at a time"
            ) from e
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclass(slots=True)
class _Loaded:
    directory: Path
    lock_fd: int
    tree: MemoryTree
    generation: int
    log_fd: int
    log_bytes: int
    snapshot_bytes: int


def _replay_log(f: BinaryIO, size: int, tree: MemoryTree, what: str) -> tuple[int, str | None]:
    """Apply a log's good records to ``tree``; return the offset after them and, if the
    rest was cut, why."""
    pos = LOG_HEADER.size
    f.seek(pos)
    while pos < size:
        head = f.read(RECORD_HEADER.size)
        if len(head) < RECORD_HEADER.size:
            return pos, "torn record header"
        length, crc = RECORD_HEADER.unpack(head)
        if length == 0 or length > MAX_RECORD_BYTES:
            return pos, f"bad record length {length}"
        payload = f.read(length)
        if len(payload) < length:
            return pos, "torn record"
        if crc32c(payload) != crc:
            return pos, "record checksum mismatch"
        where = f"{what} at byte {pos}"
        mutations = decode_mutations(payload, where)
        try:
            for m in mutations:
                tree.apply(m)
        except MetadataError as e:
            raise CorruptStoreError(f"{where}: {e}") from e
        pos += RECORD_HEADER.size + length
    return pos, None


def _open_log(directory: Path, generation: int, tree: MemoryTree) -> tuple[int, int]:
    """Replay log ``generation`` into ``tree`` (creating the log if missing, cutting a torn
    tail); return (fd open for appending, bytes of records in it)."""
    path = directory / log_name(generation)
    if not path.exists():
        return _create_log(directory, generation), 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = f.read(LOG_HEADER.size)
        if len(header) < LOG_HEADER.size or not header.strip(b"\x00"):
            # Created but its header never became durable: it held nothing acknowledged.
            log.warning("metadata log has a torn header; starting it afresh", extra=kv(path=path))
            return _create_log(directory, generation), 0
        magic, version, gen = LOG_HEADER.unpack(header)
        if magic != LOG_MAGIC or version != FORMAT_VERSION or gen != generation:
            raise CorruptStoreError(f"{path}: not a metadata log of generation {generation}")
        end, reason = _replay_log(f, size, tree, str(path))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        if end < size:
            log.warning(
                "metadata log tail cut",
                extra=kv(path=path, offset=end, dropped_bytes=size - end, reason=reason),
            )
            os.ftruncate(fd, end)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, end - LOG_HEADER.size


def load(directory: Path, clock: Any) -> _Loaded:
    """Lock ``directory`` and load the store's state from it (blocking: run off the reactor)."""
    directory.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock(directory)
    try:
        (directory / (SNAPSHOT_FILE + ".tmp")).unlink(missing_ok=True)
        tree = MemoryTree(clock)
        snapshot = directory / SNAPSHOT_FILE
        generation, snapshot_bytes = 0, 0
        if snapshot.exists():
            data = snapshot.read_bytes()
            generation = load_snapshot(data, tree, str(snapshot))
            snapshot_bytes = len(data)
        for gen in _log_generations(directory):
            if gen > generation:
                raise CorruptStoreError(
                    f"{directory / log_name(gen)} is newer than the snapshot (generation "
                    f"{generation}); the snapshot was lost or replaced"
                )
            if gen < generation:
                # Wholly contained in the snapshot; its deletion was cut short by a crash.
                (directory / log_name(gen)).unlink()
        log_fd, log_bytes = _open_log(directory, generation, tree)
    except BaseException:
        os.close(lock_fd)
        raise
    return _Loaded(directory, lock_fd, tree, generation, log_fd, log_bytes, snapshot_bytes)


# ---------------------------------------------------------------------------------------------
# The writer thread
# ---------------------------------------------------------------------------------------------

_RECORD, _SNAPSHOT, _STOP = 0, 1, 2
_FULL_RETRY_FIRST_S = 0.1  # Rule E6a: the first wait for room, doubled up to the next
_FULL_RETRY_MAX_S = 1.0
_T = TypeVar("_T")


class _LogWriter:
    """Owns the log fd; one thread writes and syncs queued records in groups (Rule E1) and
    writes snapshots in queue order (Rule E4). Reports back through ``reactor.callFromThread``:
    ``on_durable(ticket)`` after each group, ``on_failed(exc)`` once, ``on_stopped()`` last."""

    def __init__(
        self,
        directory: Path,
        log_fd: int,
        generation: int,
        reactor: Any,
        on_durable: Callable[[int], None],
        on_failed: Callable[[BaseException], None],
        on_stopped: Callable[[], None],
    ) -> None:
        self._directory = directory
        self._fd = log_fd
        self._generation = generation
        self._reactor = reactor
        self._on_durable = on_durable
        self._on_failed = on_failed
        self._on_stopped = on_stopped
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, bytes, int]] = []
        self._thread = threading.Thread(target=self._run, name="metadata-log-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def submit(self, kind: int, ticket: int, data: bytes = b"", generation: int = 0) -> None:
        with self._cond:
            self._queue.append((kind, ticket, data, generation))
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    items, self._queue = self._queue, []
                group: list[bytes] = []
                last, stop = 0, False
                for kind, ticket, data, generation in items:
                    if kind == _RECORD:
                        group.append(data)
                    elif kind == _SNAPSHOT:
                        self._flush(group)
                        group = []
                        self._write_snapshot(data, generation)
                    else:
                        stop = True
                    last = ticket
                self._flush(group)
                self._reactor.callFromThread(self._on_durable, last)
                if stop:
                    return
        except BaseException as e:
            self._reactor.callFromThread(self._on_failed, e)
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._reactor.callFromThread(self._on_stopped)

    def _flush(self, group: list[bytes]) -> None:
        if group:
            data = b"".join(group)
            self._while_full(lambda: self._append(data))

    def _append(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size  # the log is opened O_APPEND
        try:
            _write_all(self._fd, data)
            _fdatasync(self._fd)
        except OSError:
            # Cut what reached the log (a group is whole or absent), and the pages a failed
            # sync may have left marked clean: a retry writes and syncs them all again.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def _while_full(self, write: Callable[[], _T]) -> _T:
        """Run ``write``; while it fails for want of room, run it again (Rule E6a)."""
        delay, waited = _FULL_RETRY_FIRST_S, False
        while True:
            try:
                result = write()
            except OSError as e:
                if not disk_full(e):
                    raise
                if not waited:
                    log.warning(
                        "metadata log: disk full; operations wait for room",
                        extra=kv(directory=self._directory, error=str(e)),
                    )
                    waited = True
                with self._cond:
                    if self._stopping():
                        raise
                    self._cond.wait(delay)
                    if self._stopping():
                        raise
                delay = min(delay * 2, _FULL_RETRY_MAX_S)
                continue
            if waited:
                log.info("metadata log written again", extra=kv(directory=self._directory))
            return result

    def _stopping(self) -> bool:
        """Whether the store asked the writer to stop (under ``_cond``)."""
        return any(item[0] == _STOP for item in self._queue)

    def _write_snapshot(self, blob: bytes, generation: int) -> None:
        self._while_full(lambda: self._write_snapshot_file(blob))
        self._start_generation(generation)

    def _write_snapshot_file(self, blob: bytes) -> None:
        tmp = self._directory / (SNAPSHOT_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._directory / SNAPSHOT_FILE)
        fsync_dir(self._directory)

    def _start_generation(self, generation: int) -> None:
        new_fd = self._while_full(lambda: _create_log(self._directory, generation))
        old_fd, old_generation = self._fd, self._generation
        self._fd, self._generation = new_fd, generation
        os.close(old_fd)
        # No directory sync needed: a log that reappears after a crash is older than the
        # snapshot and is deleted at load.
        (self._directory / log_name(old_generation)).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    ticket: int
    d: Deferred[Any]
    outcome: Any
    notifications: list[Notification]


class EmbeddedMetadataStore(TreeSession):
    """A durable single-session store in one directory (see the module docstring).

    Open it with ``EmbeddedMetadataStore.open(directory, reactor)``."""

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        reactor: Any,
        *,
        compact_min_bytes: int = DEFAULT_COMPACT_MIN_BYTES,
    ) -> Deferred[EmbeddedMetadataStore]:
        """Lock and load ``directory`` off the reactor thread; fire with the open store, or
        fail with ``StoreLockedError`` / ``CorruptStoreError`` / ``OSError``."""
        d: Deferred[_Loaded] = deferToThreadPool(
            reactor, reactor.getThreadPool(), load, Path(directory), reactor
        )
        return d.addCallback(lambda loaded: cls(loaded, reactor, compact_min_bytes))

    def __init__(self, loaded: _Loaded, reactor: Any, compact_min_bytes: int) -> None:
        super().__init__(loaded.tree)
        self._reactor = reactor
        self._directory = loaded.directory
        self._lock_fd = loaded.lock_fd
        self._generation = loaded.generation
        self._log_bytes = loaded.log_bytes
        self._snapshot_bytes = loaded.snapshot_bytes
        self._compact_min_bytes = compact_min_bytes
        self._submitted = 0
        self._durable = 0
        self._waiting: deque[_Pending] = deque()
        self._failure: MetadataError | None = None
        self._writer_stopped = False
        self._close_waiters: list[Deferred[None]] | None = None
        self._writer = _LogWriter(
            loaded.directory,
            loaded.log_fd,
            loaded.generation,
            reactor,
            self._on_durable,
            self._on_failed,
            self._on_writer_stopped,
        )
        self._writer.start()

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def generation(self) -> int:
        """The current snapshot/log generation (grows by one per compaction)."""
        return self._generation

    def compact(self) -> Deferred[None]:
        """Snapshot the state now and start a new log; fire once the snapshot is durable."""
        if self._closed:
            return fail(StoreClosedError("the metadata store is closed"))
        if self._failure is not None:
            return fail(self._failure)
        self._snapshot()
        return self._after_durable(None, [])

    def close(self) -> Deferred[None]:
        """Drop ephemeral nodes, let every pending operation complete, stop the writer and
        release the lock. Idempotent: every call fires when the close is done."""
        d: Deferred[None] = Deferred()
        if self._close_waiters is not None:
            if self._lock_fd < 0:
                d.callback(None)
            else:
                self._close_waiters.append(d)
            return d
        self._close_waiters = [d]
        self._closed = True
        self._tree.detach(self._session_id)
        # Ephemeral nodes are never logged, so dropping them writes nothing (Rule E5).
        self._tree.remove_ephemerals(self._session_id, Changes())
        if self._writer_stopped:
            self._finish_close()
        else:
            self._writer.submit(_STOP, self._submitted)
        return d

    # -- TreeSession ----------------------------------------------------------------------------

    def _complete(self, outcome: Any, changes: Changes) -> Deferred[Any]:
        if self._failure is not None:
            return fail(self._failure)
        if changes.mutations:
            record = frame(encode_mutations(changes.mutations))
            self._submitted += 1
            self._writer.submit(_RECORD, self._submitted, record)
            self._log_bytes += len(record)
            if self._log_bytes >= max(self._compact_min_bytes, 2 * self._snapshot_bytes):
                self._snapshot()
        return self._after_durable(outcome, changes.notifications)

    # -- internals ------------------------------------------------------------------------------

    def _snapshot(self) -> None:
        # The tree holds exactly what the records submitted so far hold, and the writer
        # handles its queue in order: the snapshot replaces the log up to here (Rule E4).
        self._generation += 1
        blob = encode_snapshot(self._tree, self._generation)
        self._submitted += 1
        self._writer.submit(_SNAPSHOT, self._submitted, blob, self._generation)
        self._log_bytes = 0
        self._snapshot_bytes = len(blob)

    def _after_durable(self, outcome: Any, notifications: list[Notification]) -> Deferred[Any]:
        """Deliver once every record submitted so far is durable (Rule E2)."""
        d: Deferred[Any] = Deferred()
        pending = _Pending(self._submitted, d, outcome, notifications)
        if not self._waiting and pending.ticket <= self._durable:
            self._deliver(pending)
        else:
            self._waiting.append(pending)
        return d

    def _deliver(self, pending: _Pending) -> None:
        self._tree.notify(pending.notifications)
        if isinstance(pending.outcome, Failure):
            pending.d.errback(pending.outcome)
        else:
            pending.d.callback(pending.outcome)

    def _on_durable(self, ticket: int) -> None:
        self._durable = max(self._durable, ticket)
        while self._waiting and self._waiting[0].ticket <= self._durable:
            self._deliver(self._waiting.popleft())

    def _on_failed(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = MetadataError(f"metadata store {self._directory} failed: {exc!r}")
            log.error(
                "metadata log write failed; the store refuses further operations",
                extra=kv(directory=self._directory, error=repr(exc)),
            )
        while self._waiting:
            self._waiting.popleft().d.errback(self._failure)

    def _on_writer_stopped(self) -> None:
        self._writer_stopped = True
        self._writer.join()
        if self._waiting:
            self._on_failed(RuntimeError("the log writer stopped"))
        if self._close_waiters is not None:
            self._finish_close()

    def _finish_close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        waiters, self._close_waiters = self._close_waiters or [], []
        for d in waiters:
            d.callback(None)
