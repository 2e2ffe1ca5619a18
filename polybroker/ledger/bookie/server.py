"""The bookie server: request logic (``Bookie``), Twisted glue and the embeddable ``BookieServer``.

Rule 1 (I1): an ADD is answered OK only when the journal delivered its group (written and
        fdatasync'd); then, and in journal order, the entry enters the write cache. An ADD_MULTI
        is one journal submission of its records, answered once, the same way.
Rule 2 (I16): a FENCE (and a READ with the fence flag) marks the ledger fenced at once, so later
        adds are refused, but is answered only after its journal meta-record is durable. Adds to a
        fenced ledger answer FENCED unless they carry the recovery flag (an ADD_MULTI: unless
        every record does).
Rule 3: journaled requests (fence, explicit LAC, delete) take effect in journal order, so an add
        accepted before a delete can never resurrect the ledger after it.
Rule 4: bad input gets an error frame (with the request id when the header held one) and the
        connection is closed; other connections and the stored data are untouched.
Rule 5: backpressure: a connection with too many journaled requests in flight, or any connection
        while the write cache is full and a checkpoint is still flushing, is not read from
        (``pauseProducing``) until that clears.
Rule 6: checkpoints (every ``flushInterval`` or when half the write cache is used), garbage
        collection (every ``gcWaitTime``) and compaction steps (minor and major, each on its own
        interval; one compaction at a time) run on one worker thread; the journal mark is
        persisted only after the entry logs and the index are durable, and older journal files
        are deleted only after that.
Rule 7: what requests journal in one reactor turn, over every connection, is handed to the
        journal writer at the end of that turn (``turns.at_turn_end``: in the same pass as an
        in-process client's flush that brought them), as one submission; closing the bookie
        hands over what is staged before stopping the journal.
Rule 8: a bookie whose disk fills past ``diskUsageThreshold`` turns read-only (checked every
        ``diskCheckInterval`` and at start): adds are refused (ERROR, saying why) so the ledger
        client writes elsewhere, before a full disk could tear a write; recovery adds, fences,
        explicit LACs, deletes and reads go on (they write little, and deletes free space).
        Below ``diskUsageLwmThreshold`` it takes adds again, with no restart. With a metadata
        store it announces the state under ``/bookies/readonly`` (re-asserted at every check,
        as the node is ephemeral), so new ensembles leave it out while the auditor still
        counts it available.
Rule 9: a full disk met despite Rule 8 (filled faster than checked, or by someone else) is
        not a failure, nor is a process out of file descriptors (``runtime.out_of_room``;
        the broker keeps some for storage, but a file system may still run out): a
        checkpoint that failed for want of room leaves everything in the
        journal and the write cache, turns the bookie read-only and is run again, the same
        job, at every checkpoint interval; the bookie takes adds again only once it went
        through. A journal group the disk had no room for fails alone (journal Rule 5a) and
        turns the bookie read-only. Either way, with the thresholds on, the disk check makes
        it writable again below the low-water mark; with them off, at the next check.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from twisted.internet import interfaces
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from typing_extensions import override
from zope.interface import implementer

from polybroker.config import Config, ConfigError
from polybroker.ledger.bookie import cookie as cookies
from polybroker.ledger.bookie.journal import (
    META_DELETE,
    META_FENCE,
    META_LAC,
    RECORD_HEADER,
    Journal,
    JournalConfig,
    JournalFullError,
    JournalPosition,
    JournalReplay,
    delete_files_before,
    list_files,
    meta_record,
    read_mark,
    write_mark,
)
from polybroker.ledger.bookie.storage import (
    MAX_ENTRY_ID,
    CheckpointJob,
    LedgerStorage,
    StorageCorruptError,
    release_entries,
)
from polybroker.ledger.wire import (
    FRAME_OVERHEAD,
    SUPPORTED_VERSIONS,
    WIRE_VERSION,
    AddRequest,
    AddResponse,
    Buffer,
    DeleteLedgerRequest,
    DeleteLedgerResponse,
    ErrorResponse,
    FenceRequest,
    FenceResponse,
    FrameDecoder,
    FrameError,
    HelloRequest,
    HelloResponse,
    Message,
    MultiAddRequest,
    MultiAddResponse,
    ReadLacRequest,
    ReadLacResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
    WriteLacRequest,
    WriteLacResponse,
    encode_add_response,
    encode_multi_add_response,
)
from polybroker.logs import kv
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError
from polybroker.netio import write_now
from polybroker.runtime import out_of_room
from polybroker.turns import at_turn_end

log = logging.getLogger(__name__)

T = TypeVar("T")
RunBlocking = Callable[[Callable[[], Any]], Deferred[Any]]

# Twisted reads at most this much per doRead: a full read suggests more is waiting.
_TWISTED_READ_SIZE = 65536
MAX_LONG_POLL_MS = 10 * 60 * 1000
MAX_WATCHERS_PER_CONNECTION = 10_000
_STALLED = (
    "a checkpoint found no room on the disk or no file descriptor (retried every flushInterval)"
)


class BlockingWorker:
    """One thread that runs blocking jobs in order, answering on the reactor thread."""

    def __init__(self, reactor: Any, name: str = "bookie-worker") -> None:
        self._reactor = reactor
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Deferred[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], T]) -> Deferred[T]:
        """Queue ``fn``; its result (or failure) fires the returned Deferred on the reactor."""
        d: Deferred[T] = Deferred()
        self._queue.put((fn, d))
        return d

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, d = item
            try:
                result = fn()
            except BaseException:
                self._reactor.callFromThread(d.errback, Failure())
            else:
                self._reactor.callFromThread(d.callback, result)

    def stop(self) -> Deferred[None]:
        """Finish queued jobs, then end the thread."""
        d = self.run(lambda: None)
        self._queue.put(None)

        def joined(_: object) -> None:
            self._thread.join()

        d.addCallback(joined)
        return d


class _Watcher:
    """A long-poll READ_LAC waiting for the LAC to pass ``previous``."""

    __slots__ = ("ledger_id", "previous", "proto", "request_id", "timer")

    def __init__(self, proto: BookieProtocol, request_id: int, ledger_id: int, previous: int):
        self.proto = proto
        self.request_id = request_id
        self.ledger_id = ledger_id
        self.previous = previous
        self.timer: Any = None


class Bookie:
    """The request logic of one bookie, on the reactor thread (see the module rules).

    ``deliver`` hands the journal's completions to the reactor (``reactor.callFromThread``);
    ``run_blocking`` runs checkpoint and GC jobs off the reactor (a ``BlockingWorker``); passing
    direct calls for both, and calling ``journal.write_pending()`` as the writer thread would,
    runs a bookie with no thread at all."""

    def __init__(
        self,
        storage: LedgerStorage,
        journal_dir: Path,
        journal_config: JournalConfig,
        reactor: Any,
        instance_id: str,
        *,
        deliver: Callable[..., Any],
        run_blocking: RunBlocking,
        max_in_flight_per_connection: int = 10_000,
    ) -> None:
        self.storage = storage
        self.journal_dir = journal_dir
        self.journal_config = journal_config
        self.reactor = reactor
        self.instance_id = instance_id
        self._deliver = deliver
        self._run_blocking = run_blocking
        self.max_in_flight = max_in_flight_per_connection
        self.journal: Journal | None = None
        self.failed: BaseException | None = None
        self.read_only: str | None = None  # why adds are refused for now (Rule 8), or None
        self.closing = False
        self._journal_pos: JournalPosition | None = None
        self._persisted_mark: JournalPosition | None = None
        self._checkpoint_d: Deferred[None] | None = None
        self._stalled: CheckpointJob | None = None  # a checkpoint a full disk failed (Rule 9)
        self._compaction_d: Deferred[list[int]] | None = None
        self._compaction_wanted = 0.0  # the threshold of the next compaction pass (0: none)
        self._watchers: dict[int, list[_Watcher]] = {}
        self._throttled: set[BookieProtocol] = set()
        self._submit_call: Any = None  # the end-of-turn hand-off to the journal, when due
        self._more_coming = False
        self.protocols: set[BookieProtocol] = set()

    # -- start-up -------------------------------------------------------------------------

    def recover(self) -> JournalReplay:
        """Replay the journal from the checkpoint mark into storage (cutting a torn tail),
        checkpointing whenever the write cache fills, then open a new journal file."""
        mark = read_mark(self.journal_dir)
        self._persisted_mark = mark
        replay = JournalReplay(self.journal_dir, mark, self.journal_config.max_record_size)
        storage = self.storage
        for rec in replay.records():
            entry = rec.entry_id
            if entry >= 0:
                storage.put_entry(rec.ledger_id, entry, rec.lac, rec.data)
            elif entry == META_FENCE:
                storage.fence(rec.ledger_id)
            elif entry == META_LAC:
                storage.set_lac(rec.ledger_id, rec.lac)
            elif entry == META_DELETE:
                storage.delete_ledger(rec.ledger_id)
            self._journal_pos = rec.end
            if storage.cache_bytes >= storage.write_cache_max_bytes // 2:
                self._checkpoint_now(rec.end)
        if self._journal_pos is None:
            self._journal_pos = replay.end
        ids = list_files(self.journal_dir)
        first = max([*ids, mark.file_id if mark else 0]) + 1
        self.journal = Journal(
            self.journal_dir,
            self.journal_config,
            deliver=self._deliver,
            on_group_done=self._journal_done,
            on_failure=self._journal_failed,
            first_file_id=first,
        )
        log.info(
            "journal replayed",
            extra=kv(
                records=replay.records_read,
                mark=str(mark),
                truncated=str(replay.truncated or ""),
                next_file=first,
            ),
        )
        return replay

    def _checkpoint_now(self, mark: JournalPosition) -> None:
        job = self.storage.begin_checkpoint(mark)
        self.storage.run_checkpoint(job)
        write_mark(self.journal_dir, mark)
        delete_files_before(self.journal_dir, mark.file_id)
        self._persisted_mark = mark
        self.storage.finish_checkpoint(job)

    def _refusal(self) -> str:
        """Why adds are refused now (failed, closing or read-only)."""
        if self.failed is not None:
            return f"bookie failed: {self.failed}"
        if self.closing:
            return "bookie is shutting down"
        return f"bookie is read-only: {self.read_only}"

    def set_read_only(self, reason: str | None) -> bool:
        """Refuse adds for ``reason`` from now on, or take them again with None (Rule 8; not
        while a checkpoint a full disk failed is still to be written, Rule 9); return whether
        the state changed."""
        if reason is None and self._stalled is not None:
            return False
        if (reason is None) == (self.read_only is None):
            if reason is not None:
                self.read_only = reason  # the newest figures
            return False
        self.read_only = reason
        if reason is None:
            log.info("bookie writable again")
        else:
            log.warning("bookie read-only: refusing adds", extra=kv(reason=reason))
        return True

    # -- requests -------------------------------------------------------------------------

    def add(self, proto: BookieProtocol, req: AddRequest) -> None:
        """Journal an add (the hot path; answered in ``_journal_done``)."""
        if self.failed is not None or self.closing or (self.read_only and not req.recovery):
            why = self._refusal()
            proto.send(
                AddResponse(req.request_id, Status.ERROR, why, req.ledger_id, req.entry_id).encode()
            )
            return
        ledger_id = req.ledger_id
        st = self.storage.state(ledger_id)
        if st is not None and st.fenced and not req.recovery:
            proto.send(encode_add_response(req.request_id, Status.FENCED, ledger_id, req.entry_id))
            return
        if not 0 <= req.entry_id <= MAX_ENTRY_ID:
            proto.send(
                encode_add_response(req.request_id, Status.BAD_REQUEST, ledger_id, req.entry_id)
            )
            return
        body = req.body
        assert self.journal is not None
        self.journal.add(RECORD_HEADER.pack(len(body), req.crc), body, (proto, req))
        if self._submit_call is None:
            self._submit_call = at_turn_end(self.reactor, self._submit_turn)
        proto.in_flight += 1
        if proto.in_flight >= self.max_in_flight:
            proto.set_paused("in_flight", True)

    def add_multi(self, proto: BookieProtocol, req: MultiAddRequest) -> None:
        """Journal the entries of an ADD_MULTI as one submission (answered together)."""
        ledger_id, rid, count = req.ledger_id, req.request_id, len(req.entries)
        status, why = Status.OK, ""
        if self.failed is not None or self.closing or (self.read_only and not req.recovery):
            status, why = Status.ERROR, self._refusal()
        else:
            st = self.storage.state(ledger_id)
            if st is not None and st.fenced and not req.recovery:
                status = Status.FENCED
            elif max(e[0] for e in req.entries) > MAX_ENTRY_ID:
                status = Status.BAD_REQUEST
        if status != Status.OK:
            proto.send(MultiAddResponse(rid, status, why, ledger_id, count).encode())
            return
        assert self.journal is not None
        self.journal.add_records(req.records, (proto, req))
        if self._submit_call is None:
            self._submit_call = at_turn_end(self.reactor, self._submit_turn)
        proto.in_flight += count
        if proto.in_flight >= self.max_in_flight:
            proto.set_paused("in_flight", True)

    def dispatch(self, proto: BookieProtocol, msg: Message) -> None:
        """Handle every request but ADD and ADD_MULTI."""
        t = type(msg)
        if t is ReadRequest:
            self._read(proto, msg)  # type: ignore[arg-type]
        elif t is ReadRangeRequest:
            self._read_range(proto, msg)  # type: ignore[arg-type]
        elif t is ReadLacRequest:
            self._read_lac(proto, msg)  # type: ignore[arg-type]
        elif t is FenceRequest:
            self._journal_meta(proto, msg, msg.ledger_id, META_FENCE)  # type: ignore[union-attr]
        elif t is WriteLacRequest:
            self._journal_meta(proto, msg, msg.ledger_id, META_LAC, msg.lac)  # type: ignore[union-attr]
        elif t is DeleteLedgerRequest:
            self._journal_meta(proto, msg, msg.ledger_id, META_DELETE)  # type: ignore[union-attr]
        elif t is HelloRequest:
            self._hello(proto, msg)  # type: ignore[arg-type]
        else:
            proto.protocol_error(
                FrameError(Status.BAD_REQUEST, f"{t.__name__} is not a request", msg.request_id)
            )

    def end_of_input(self, more_coming: bool) -> None:
        """The protocol handled a network read (``more_coming``: a full one). What requests
        journaled goes to the writer at the end of the reactor turn, with what every other
        connection read in the same turn: one group, one hand-off and one wake-up of the writer
        instead of one per connection."""
        if more_coming:
            self._more_coming = True

    def _submit_turn(self) -> None:
        self._submit_call = None
        more, self._more_coming = self._more_coming, False
        if self.journal is not None:
            self.journal.submit(more)

    def _hello(self, proto: BookieProtocol, req: HelloRequest) -> None:
        usable = [v for v in SUPPORTED_VERSIONS if req.min_version <= v <= req.max_version]
        if usable:
            resp = HelloResponse(req.request_id, Status.OK, "", max(usable), self.instance_id)
        else:
            resp = HelloResponse(
                req.request_id,
                Status.BAD_VERSION,
                f"client speaks {req.min_version}..{req.max_version}, bookie speaks "
                f"{sorted(SUPPORTED_VERSIONS)}",
                WIRE_VERSION,
                self.instance_id,
            )
        proto.send(resp.encode())

    def _read(self, proto: BookieProtocol, req: ReadRequest) -> None:
        if req.fence:
            self._journal_meta(proto, req, req.ledger_id, META_FENCE)
            return
        proto.send(self._read_answer(req).encode())

    def _read_answer(self, req: ReadRequest) -> ReadResponse:
        rid, lid, eid = req.request_id, req.ledger_id, req.entry_id
        if self.storage.state(lid) is None:
            return ReadResponse(rid, Status.NO_SUCH_LEDGER, f"no ledger {lid}", lid, eid)
        try:
            data = self.storage.read_entry(lid, eid)
        except (OSError, StorageCorruptError) as e:
            log.error("read failed", extra=kv(ledger=lid, entry=eid, error=str(e)))
            return ReadResponse(rid, Status.ERROR, str(e), lid, eid)
        if data is None:
            return ReadResponse(rid, Status.NO_SUCH_ENTRY, f"no entry {lid}:{eid}", lid, eid)
        return ReadResponse(rid, Status.OK, "", lid, eid, data)

    def _read_range(self, proto: BookieProtocol, req: ReadRangeRequest) -> None:
        rid, lid = req.request_id, req.ledger_id
        first, last = req.first_entry_id, req.last_entry_id
        if self.storage.state(lid) is None:
            proto.send(
                ReadRangeResponse(rid, Status.NO_SUCH_LEDGER, f"no ledger {lid}", lid).encode()
            )
            return
        if first < 0 or last < first:
            proto.send(
                ReadRangeResponse(
                    rid, Status.BAD_REQUEST, f"bad range {first}..{last}", lid
                ).encode()
            )
            return
        # The answer must fit in one frame whatever the client asked for.
        budget = min(req.max_bytes, proto.decoder.max_frame_size - FRAME_OVERHEAD)
        entries: list[tuple[int, Buffer]] = []
        used = 0
        try:
            for eid in range(first, min(last, MAX_ENTRY_ID) + 1, req.stride):
                data = self.storage.read_entry(lid, eid)
                if data is None:
                    break
                if entries and used + len(data) > budget:
                    break
                entries.append((eid, data))
                used += len(data)
        except (OSError, StorageCorruptError) as e:
            log.error("read failed", extra=kv(ledger=lid, entry=first, error=str(e)))
            proto.send(ReadRangeResponse(rid, Status.ERROR, str(e), lid).encode())
            return
        if not entries:
            proto.send(
                ReadRangeResponse(
                    rid, Status.NO_SUCH_ENTRY, f"no entry {lid}:{first}", lid
                ).encode()
            )
            return
        proto.send(ReadRangeResponse(rid, Status.OK, "", lid, entries).encode())

    def _read_lac(self, proto: BookieProtocol, req: ReadLacRequest) -> None:
        lid = req.ledger_id
        st = self.storage.state(lid)
        lac = st.lac if st is not None else -1
        previous = req.previous_lac
        if previous is None or req.timeout_ms <= 0 or lac > previous:
            proto.send(ReadLacResponse(req.request_id, Status.OK, "", lid, lac).encode())
            return
        if proto.watchers >= MAX_WATCHERS_PER_CONNECTION:
            proto.send(
                ReadLacResponse(
                    req.request_id, Status.ERROR, "too many long polls on this connection", lid, lac
                ).encode()
            )
            return
        w = _Watcher(proto, req.request_id, lid, previous)
        timeout_s = min(req.timeout_ms, MAX_LONG_POLL_MS) / 1000.0
        w.timer = self.reactor.callLater(timeout_s, self._watch_timeout, w)
        self._watchers.setdefault(lid, []).append(w)
        proto.watchers += 1

    def _watch_timeout(self, w: _Watcher) -> None:
        waiting = self._watchers.get(w.ledger_id)
        if waiting is None or w not in waiting:
            return
        waiting.remove(w)
        if not waiting:
            del self._watchers[w.ledger_id]
        w.timer = None
        self._answer_watcher(w)

    def _answer_watcher(self, w: _Watcher) -> None:
        w.proto.watchers -= 1
        st = self.storage.state(w.ledger_id)
        lac = st.lac if st is not None else -1
        w.proto.send(ReadLacResponse(w.request_id, Status.OK, "", w.ledger_id, lac).encode())

    def _notify_lac(self, ledger_id: int) -> None:
        waiting = self._watchers.get(ledger_id)
        if not waiting:
            return
        st = self.storage.state(ledger_id)
        lac = st.lac if st is not None else -1
        keep = []
        for w in waiting:
            if lac > w.previous:
                if w.timer is not None and w.timer.active():
                    w.timer.cancel()
                w.timer = None
                self._answer_watcher(w)
            else:
                keep.append(w)
        if keep:
            self._watchers[ledger_id] = keep
        else:
            del self._watchers[ledger_id]

    def _journal_meta(
        self, proto: BookieProtocol, req: Message, ledger_id: int, kind: int, lac: int = -1
    ) -> None:
        if self.failed is not None or self.closing:
            why = str(self.failed) if self.failed is not None else "bookie is shutting down"
            proto.send(ErrorResponse(req.request_id, Status.ERROR, why).encode())
            return
        if kind == META_FENCE:
            # Refuse later adds at once; the answer waits for durability (Rule 2).
            self.storage.fence(ledger_id)
        header, body = meta_record(ledger_id, kind, lac)
        assert self.journal is not None
        self.journal.add(header, body, (proto, req))
        if self._submit_call is None:
            self._submit_call = at_turn_end(self.reactor, self._submit_turn)
        proto.in_flight += 1

    # -- journal completions (reactor thread) ---------------------------------------------

    def _journal_done(
        self, tokens: list[tuple[BookieProtocol, Message]], position: JournalPosition
    ) -> None:
        self._journal_pos = position
        storage = self.storage
        watchers = self._watchers
        woken: set[int] | None = None
        out_proto: BookieProtocol | None = None
        out: list[bytes] = []
        touched: list[tuple[BookieProtocol, list[bytes]]] = []
        for proto, req in tokens:
            t = type(req)
            n = 1
            if t is MultiAddRequest:
                multi: MultiAddRequest = req  # type: ignore[assignment]
                lid, n = multi.ledger_id, len(multi.entries)
                storage.put_entries(lid, multi.entries)
                frame = encode_multi_add_response(multi.request_id, 0, lid, n)
                if watchers and lid in watchers:
                    if woken is None:
                        woken = set()
                    woken.add(lid)
            elif t is AddRequest:
                add: AddRequest = req  # type: ignore[assignment]
                lid = add.ledger_id
                storage.put_entry(lid, add.entry_id, add.lac, add.data)
                frame = encode_add_response(add.request_id, 0, lid, add.entry_id)
                if watchers and lid in watchers:
                    if woken is None:
                        woken = set()
                    woken.add(lid)
            else:
                frame, lid = self._meta_done(req)
                if lid >= 0:
                    if woken is None:
                        woken = set()
                    woken.add(lid)
            proto.in_flight -= n
            if proto is not out_proto:
                out = []
                out_proto = proto
                touched.append((proto, out))
            out.append(frame)
        for proto, frames in touched:
            proto.send_many(frames)
            if proto.paused_for and proto.in_flight < self.max_in_flight // 2:
                proto.set_paused("in_flight", False)
            proto.maybe_finish_half_close()
        if woken:
            for lid in woken:
                self._notify_lac(lid)
        self._after_writes()

    def _meta_done(self, req: Message) -> tuple[bytes, int]:
        """Apply a durable meta-record and return (answer, ledger whose LAC may have moved)."""
        storage = self.storage
        t = type(req)
        if t is FenceRequest or t is ReadRequest:
            lid = req.ledger_id  # type: ignore[union-attr]
            st = storage.fence(lid)
            if t is ReadRequest:
                return self._read_answer(req).encode(), -1  # type: ignore[arg-type]
            return FenceResponse(
                req.request_id, Status.OK, "", lid, st.lac, st.last_entry
            ).encode(), -1
        if t is WriteLacRequest:
            storage.set_lac(req.ledger_id, req.lac)  # type: ignore[union-attr]
            return WriteLacResponse(
                req.request_id, Status.OK, "", req.ledger_id
            ).encode(), req.ledger_id  # type: ignore[union-attr]
        if t is DeleteLedgerRequest:
            lid = req.ledger_id  # type: ignore[union-attr]
            storage.delete_ledger(lid)
            return DeleteLedgerResponse(req.request_id, Status.OK, "", lid).encode(), lid
        raise AssertionError(f"unexpected journal token {t.__name__}")

    def _journal_failed(
        self, error: BaseException, tokens: list[tuple[BookieProtocol, Message]]
    ) -> None:
        if isinstance(error, JournalFullError):
            self.set_read_only(str(error))  # Rule 9: those records only; nothing else failed
        elif self.failed is None:
            self.failed = error
            log.critical("bookie failed: refusing writes", extra=kv(error=str(error)))
        for proto, req in tokens:
            proto.in_flight -= len(req.entries) if type(req) is MultiAddRequest else 1  # type: ignore[union-attr]
            proto.send(ErrorResponse(req.request_id, Status.ERROR, str(error)).encode())

    # -- checkpoints and garbage collection -----------------------------------------------

    def _after_writes(self) -> None:
        storage = self.storage
        if storage.cache_bytes < storage.write_cache_max_bytes // 2:
            return  # the common case: nothing to start, nothing to throttle
        if not storage.flushing:
            # A failure fails the bookie and is logged there; nobody else waits for this one.
            self.checkpoint().addErrback(lambda _: None)
        # The flushing half and the active half together stay within the configured maximum.
        if storage.cache_bytes >= storage.write_cache_max_bytes // 2 and storage.flushing:
            for proto in self.protocols:
                if proto not in self._throttled:
                    self._throttled.add(proto)
                    proto.set_paused("cache", True)

    def checkpoint(self) -> Deferred[None]:
        """Flush the write cache to entry logs and index, then persist the journal mark and
        delete journal files before it (Rule 6). Fires when done; joins one in flight."""
        if self._checkpoint_d is not None:
            joined: Deferred[None] = Deferred()

            def tell(result: object) -> object:
                joined.callback(None)
                return result

            self._checkpoint_d.addBoth(tell)
            return joined
        if self.failed is not None:
            return fail(self.failed)
        storage = self.storage
        started = self.reactor.seconds()
        job = self._stalled
        if job is None:
            job = storage.begin_checkpoint(self._journal_pos)
        mark = job.mark
        persisted = self._persisted_mark
        journal_dir = self.journal_dir

        def work() -> None:
            storage.run_checkpoint(job)
            if mark is not None and mark != persisted:
                write_mark(journal_dir, mark)
                delete_files_before(journal_dir, mark.file_id)

        done: Deferred[None] = self._run_blocking(work)
        self._checkpoint_d = done

        def finished(_: object) -> None:
            self._checkpoint_d = None
            if mark is not None:
                self._persisted_mark = mark
            self._run_blocking(partial(release_entries, storage.finish_checkpoint(job)))
            if self._stalled is not None:
                self._stalled = None
                log.info("checkpoint written after a full disk")
                if self.read_only == _STALLED:
                    self.set_read_only(None)
            if job.entries_written:
                log.debug(
                    "checkpoint",
                    extra=kv(
                        entries=job.entries_written,
                        bytes=job.snapshot_bytes,
                        mark=str(mark),
                        seconds=round(self.reactor.seconds() - started, 4),
                    ),
                )
            for proto in self._throttled:
                proto.set_paused("cache", False)
            self._throttled.clear()

        def failed(f: Failure) -> Failure:
            self._checkpoint_d = None
            if out_of_room(f.value):
                # Rule 9: nothing is lost (the journal holds it all); wait for room (on the
                # disk, or file descriptors: a flood of connections may have taken the last).
                if self._stalled is None:
                    log.warning("checkpoint failed: out of room", extra=kv(error=str(f.value)))
                self._stalled = job
                self.set_read_only(_STALLED)
                return f
            self.failed = f.value
            log.critical("checkpoint failed: refusing writes", extra=kv(error=str(f.value)))
            return f

        done.addCallbacks(finished, failed)
        return done

    def collect_garbage(self) -> Deferred[list[int]]:
        """Delete entry logs that hold no live ledger (off the reactor)."""
        d: Deferred[list[int]] = self._run_blocking(self.storage.collect_garbage)

        def forget(ids: list[int]) -> list[int]:
            self.storage.forget_logs(ids)
            return ids

        return d.addCallback(forget)

    def compact(self, threshold: float) -> Deferred[list[int]]:
        """Compact the sealed entry logs whose live fraction is under ``threshold`` (Rule 6),
        one bounded step per worker job. Fires with the ids of the logs deleted. A call while
        a compaction runs is joined to it: one more pass follows, at the highest threshold
        asked for meanwhile (a major compaction is never lost behind a minor one)."""
        self._compaction_wanted = max(self._compaction_wanted, threshold)
        if self._compaction_d is None:

            def failed(f: Failure) -> list[int]:
                # The log being compacted stays whole and is tried again at the next interval.
                log.warning("compaction failed", extra=kv(error=str(f.value)))
                self._compaction_wanted = 0.0
                return []

            def over(result: list[int]) -> list[int]:
                self._compaction_d = None
                return result

            d = Deferred.fromCoroutine(self._compact())
            self._compaction_d = d.addErrback(failed).addCallback(over)
        joined: Deferred[list[int]] = Deferred()

        def tell(result: list[int]) -> list[int]:
            joined.callback(result)
            return result

        self._compaction_d.addCallback(tell)
        return joined

    async def _compact(self) -> list[int]:
        storage = self.storage
        deleted: list[int] = []
        while self._compaction_wanted > 0 and not (self.closing or self.failed):
            threshold, self._compaction_wanted = self._compaction_wanted, 0.0
            plans = await self._run_blocking(lambda t=threshold: storage.plan_compaction(t))
            for c in plans:
                while not (self.closing or self.failed):
                    if await self._run_blocking(lambda c=c: storage.compact_step(c)):
                        break
                else:
                    return deleted
                storage.forget_logs([c.log_id])
                if not c.unverified:
                    deleted.append(c.log_id)
        return deleted

    # -- connections ----------------------------------------------------------------------

    def connection_lost(self, proto: BookieProtocol) -> None:
        """Drop a connection's long polls and throttling."""
        self.protocols.discard(proto)
        self._throttled.discard(proto)
        if proto.watchers:
            for lid in list(self._watchers):
                keep = []
                for w in self._watchers[lid]:
                    if w.proto is proto:
                        if w.timer is not None and w.timer.active():
                            w.timer.cancel()
                    else:
                        keep.append(w)
                if keep:
                    self._watchers[lid] = keep
                else:
                    del self._watchers[lid]
            proto.watchers = 0

    def close(self) -> Deferred[None]:
        """Stop the journal (writing what is queued), then checkpoint everything."""
        self.closing = True
        for waiting in self._watchers.values():
            for w in waiting:
                if w.timer is not None and w.timer.active():
                    w.timer.cancel()
        self._watchers.clear()
        if self._submit_call is not None:
            # Records staged in this turn are written (and answered) with the last group.
            self._submit_call.cancel()
            self._submit_turn()
        if self.journal is not None:
            self.journal.stop()
        d: Deferred[None] = Deferred()

        def last_checkpoint(_: object) -> Deferred[None] | None:
            return None if self.failed is not None else self.checkpoint()

        # The journal's last completions were handed to the reactor: apply them first.
        def flush() -> None:
            running: Deferred[Any] = self._checkpoint_d or succeed(None)
            running.addBoth(last_checkpoint).addBoth(lambda _: d.callback(None))

        self.reactor.callLater(0, flush)
        return d


@implementer(interfaces.IHalfCloseableProtocol)
class BookieProtocol(Protocol):
    """One client connection: frames in, requests to the ``Bookie``, answers out."""

    def __init__(self, bookie: Bookie, max_frame_size: int) -> None:
        self.bookie = bookie
        self.decoder = FrameDecoder(max_frame_size)
        self.in_flight = 0  # journaled requests not yet answered
        self.watchers = 0
        self.paused_for: set[str] = set()
        self.open = False
        self._half_closed = False

    @override
    def connectionMade(self) -> None:
        self.open = True
        self.bookie.protocols.add(self)
        # Add and read answers are small writes a client waits for: never hold them back.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

    @override
    def dataReceived(self, data: bytes) -> None:
        if not self.open:
            return
        self.decoder.receive_data(data)
        self._handle_input(more_coming=len(data) >= _TWISTED_READ_SIZE)

    def data_received_parts(self, parts: list[bytes]) -> None:
        """``dataReceived`` of ``parts`` joined, without joining them: the in-memory link's
        hand-over of what waited for a reactor turn (all of it, so nothing more is coming)."""
        if not self.open:
            return
        receive = self.decoder.receive_data
        for part in parts:
            receive(part)
        self._handle_input(more_coming=False)

    def _handle_input(self, more_coming: bool) -> None:
        decoder = self.decoder
        bookie = self.bookie
        add = bookie.add
        for msg in decoder.drain():
            t = type(msg)
            if t is MultiAddRequest:
                bookie.add_multi(self, msg)  # type: ignore[arg-type]
            elif t is AddRequest:
                add(self, msg)  # type: ignore[arg-type]
            else:
                bookie.dispatch(self, msg)
                if not self.open:
                    break
        if decoder.error is not None:
            self.protocol_error(decoder.error)
        bookie.end_of_input(more_coming)

    def protocol_error(self, error: FrameError) -> None:
        """Answer a bad frame and close the connection (Rule 4)."""
        if not self.open:
            return
        peer = self.transport.getPeer() if self.transport else None
        log.warning("bad input from client", extra=kv(peer=str(peer), error=str(error)))
        rid = error.request_id if error.request_id is not None else 0
        self.send(ErrorResponse(rid, error.status, str(error)).encode())
        self.open = False
        assert self.transport is not None
        self.transport.loseConnection()

    def readConnectionLost(self) -> None:
        """The peer will send no more: answer a truncated frame, or close once answered."""
        if not self.open:
            return
        if self.decoder.buffered():
            rid = self.decoder.partial_request_id()
            self.protocol_error(
                FrameError(
                    Status.BAD_REQUEST,
                    f"connection closed inside a frame ({self.decoder.buffered()} bytes)",
                    rid,
                )
            )
            return
        self._half_closed = True
        self.bookie.connection_lost(self)  # long polls cannot be answered usefully now
        self.maybe_finish_half_close()

    def writeConnectionLost(self) -> None:
        """The peer will read no more: nothing left to do on this connection."""
        self.open = False
        assert self.transport is not None
        self.transport.loseConnection()

    def maybe_finish_half_close(self) -> None:
        """Close a half-closed connection once everything it asked was answered."""
        if self._half_closed and self.in_flight == 0 and self.open:
            self.open = False
            assert self.transport is not None
            self.transport.loseConnection()

    @override
    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.open = False
        self.bookie.connection_lost(self)

    def send(self, frame: bytes) -> None:
        """Write one frame (dropped if the connection is gone)."""
        if self.transport is not None and self.connected:
            write_now(self.transport, frame)

    def send_many(self, frames: list[bytes]) -> None:
        """Write several frames in one call (one send when the socket takes them)."""
        if self.transport is not None and self.connected:
            write_now(self.transport, frames[0] if len(frames) == 1 else b"".join(frames))

    def set_paused(self, reason: str, paused: bool) -> None:
        """Stop or resume reading for ``reason``; reading resumes when no reason is left."""
        before = bool(self.paused_for)
        if paused:
            self.paused_for.add(reason)
        else:
            self.paused_for.discard(reason)
        after = bool(self.paused_for)
        if before != after and self.transport is not None and self.connected:
            if after:
                self.transport.pauseProducing()  # type: ignore[attr-defined]
            else:
                self.transport.resumeProducing()  # type: ignore[attr-defined]


class BookieFactory(Factory):
    """Builds a ``BookieProtocol`` per connection."""

    noisy = False

    def __init__(self, bookie: Bookie, max_frame_size: int) -> None:
        self.bookie = bookie
        self.max_frame_size = max_frame_size

    @override
    def buildProtocol(self, addr: Any) -> BookieProtocol:
        return BookieProtocol(self.bookie, self.max_frame_size)


def journal_config(config: Config) -> JournalConfig:
    """The journal settings of a config."""
    mb = 1024 * 1024
    return JournalConfig(
        max_group_wait_s=config["journalMaxGroupWaitMSec"] / 1000.0,
        buffered_writes_threshold=config["journalBufferedWritesThreshold"],
        max_file_size=config["journalMaxSizeMB"] * mb,
        prealloc_size=config["journalPreAllocSizeMB"] * mb,
        sync_data=config["journalSyncData"],
        max_record_size=config["maxMessageSize"] + FRAME_OVERHEAD,
    )


def used_fraction(path: Path) -> float:
    """The used fraction of the file system holding ``path``, as an unprivileged writer sees
    it (space reserved for root counts as used)."""
    st = os.statvfs(path)
    if st.f_blocks == 0:
        return 0.0
    return 1.0 - st.f_bavail / st.f_blocks


class BookieServer:
    """A bookie embeddable in any process: ``start()`` listens, ``stop()`` shuts down cleanly.

    With a ``metadata_store`` it registers its cookie (refusing to start if another identity is
    registered for its address) and announces itself under ``/bookies/available``. It serves
    only under the address its data dir recorded (``port`` 0: the recorded port), unless
    ``allow_address_change`` (default: the config's ``allowBookieAddressChange``); see the
    cookie module's Rule 5."""

    def __init__(
        self,
        config: Config,
        data_dir: str | Path,
        reactor: Any,
        *,
        port: int = 0,
        bind: str = "127.0.0.1",
        metadata_store: MetadataStore | None = None,
        allow_address_change: bool | None = None,
        disk_usage: Callable[[Path], float] | None = None,
    ) -> None:
        self.config = config
        threshold, lwm = config["diskUsageThreshold"], config["diskUsageLwmThreshold"]
        if not 0 < lwm <= threshold:
            raise ConfigError(
                f"diskUsageLwmThreshold ({lwm}) must be above 0 and at most diskUsageThreshold "
                f"({threshold})"
            )
        #: The used fraction of the file system holding a path (Rule 8); tests inject one.
        self.disk_usage = disk_usage or used_fraction
        self._announced_read_only: bool | None = None  # None: not known (a marker may be left)
        self.data_dir = Path(data_dir)
        if allow_address_change is None:
            allow_address_change = bool(config["allowBookieAddressChange"])
        self.allow_address_change = allow_address_change
        self.reactor = reactor
        self.port = port
        self.bind = bind
        self.metadata_store = metadata_store
        self.max_frame_size = config["maxMessageSize"] + FRAME_OVERHEAD
        self.bookie: Bookie | None = None
        self.cookie: cookies.Cookie | None = None
        self._worker: BlockingWorker | None = None
        self._listening: Any = None
        self._loops: list[LoopingCall] = []
        self._registered = False

    @property
    def address(self) -> str:
        """``host:port`` as clients and the metadata store know this bookie."""
        host = self.config["advertisedAddress"] or self.bind
        return f"{host}:{self.port}"

    @property
    def read_only(self) -> bool:
        """Whether the bookie refuses adds now (Rule 8)."""
        return self.bookie is not None and self.bookie.read_only is not None

    @property
    def instance_id(self) -> str:
        """The identity of the data dir (its cookie)."""
        assert self.cookie is not None
        return self.cookie.instance_id

    def start(self) -> Deferred[int]:
        """Check the cookie, replay the journal, listen, register; fire with the bound port."""
        try:
            port = self._start_local()
        except Exception:
            failure = Failure()
            self._teardown_local()
            return fail(failure)
        assert self.cookie is not None
        previous = self.cookie
        try:
            self.cookie = cookies.check_address(
                previous, self.address, allow_change=self.allow_address_change
            )
        except cookies.CookieError:
            # Checked before listening already unless the port was picked just now.
            failure = Failure()
            return self._shutdown().addBoth(lambda _: failure)
        if self.metadata_store is None:
            self._record_address(previous)
            self._start_timers()
            return succeed(port)
        d = cookies.register(
            self.metadata_store,
            self.address,
            self.cookie,
            allow_address_change=self.allow_address_change,
        )

        def registered(_: object) -> int:
            self._registered = True
            self._record_address(previous)
            self._start_timers()
            return port

        def refused(f: Failure) -> Deferred[Any]:
            return self._shutdown().addBoth(lambda _: f)

        return d.addCallbacks(registered, refused)

    def _record_address(self, previous: cookies.Cookie) -> None:
        assert self.cookie is not None
        if self.cookie.address != previous.address:
            if previous.address:
                log.warning(
                    "bookie moved to another address: ledgers naming the old one will be "
                    "re-replicated by the auditor",
                    extra=kv(old=previous.address, new=self.cookie.address),
                )
            cookies.record_address(self.data_dir, self.cookie)

    def _start_local(self) -> int:
        self.cookie = cookies.check_or_create(self.data_dir)
        # Rule 5 of the cookie module: refuse another address before anything changes.
        if self.port == 0:
            self.port = cookies.recorded_port(self.cookie)
        if self.port != 0:
            cookies.check_address(self.cookie, self.address, allow_change=self.allow_address_change)
        storage = LedgerStorage(
            self.data_dir / cookies.LEDGERS_DIR,
            entry_log_size_limit=self.config["entryLogSizeLimit"],
            write_cache_max_bytes=self.config["dbStorage_writeCacheMaxSizeMb"] * 1024 * 1024,
            max_entry_size=self.max_frame_size,
        )
        self._worker = BlockingWorker(self.reactor)
        bookie = Bookie(
            storage,
            self.data_dir / cookies.JOURNAL_DIR,
            journal_config(self.config),
            self.reactor,
            self.cookie.instance_id,
            deliver=self.reactor.callFromThread,
            run_blocking=self._worker.run,
        )
        self.bookie = bookie
        self._check_disk_usage()  # a full disk at start: read-only from the first add
        bookie.recover()
        assert bookie.journal is not None
        bookie.journal.start()
        factory = BookieFactory(bookie, self.max_frame_size)
        self._listening = self.reactor.listenTCP(self.port, factory, interface=self.bind)
        self.port = self._listening.getHost().port
        log.info(
            "bookie started",
            extra=kv(address=self.address, instance_id=self.cookie.instance_id),
        )
        return self.port

    def _start_timers(self) -> None:
        assert self.bookie is not None
        bookie = self.bookie
        config = self.config
        jobs: list[tuple[float, Callable[[], Deferred[Any]]]] = [
            (config["flushInterval"] / 1000.0, bookie.checkpoint),
            (config["gcWaitTime"] / 1000.0, bookie.collect_garbage),
        ]
        for kind in ("minor", "major"):
            threshold = min(1.0, config[f"{kind}CompactionThreshold"])
            if threshold > 0:
                jobs.append(
                    (config[f"{kind}CompactionInterval"], partial(bookie.compact, threshold))
                )
        if config["diskUsageThreshold"] < 1:
            jobs.append((config["diskCheckInterval"] / 1000.0, self.check_disk))
        for interval_s, fn in jobs:
            if interval_s > 0:
                loop = LoopingCall(self._quietly(fn))
                loop.clock = self.reactor
                loop.start(interval_s, now=False)
                self._loops.append(loop)

    def check_disk(self) -> Deferred[None]:
        """Compare the disk's used fraction with the thresholds and announce the outcome
        (Rule 8); fires when the announcement is written (at once without a store)."""
        if self.bookie is None:
            return succeed(None)
        self._check_disk_usage()
        return self._announce_read_only()

    def _check_disk_usage(self) -> None:
        assert self.bookie is not None
        threshold = self.config["diskUsageThreshold"]
        if threshold >= 1:
            # No thresholds: only a full disk (Rule 9) made it read-only; try again.
            self.bookie.set_read_only(None)
            return
        try:
            used = max(
                self.disk_usage(self.data_dir / d)
                for d in (cookies.JOURNAL_DIR, cookies.LEDGERS_DIR)
            )
        except OSError as e:
            log.warning("cannot read the disk usage", extra=kv(error=str(e)))
            return
        if used >= threshold:
            self.bookie.set_read_only(
                f"disk {used:.1%} used, diskUsageThreshold is {threshold:.1%}"
            )
        elif used < self.config["diskUsageLwmThreshold"]:
            self.bookie.set_read_only(None)

    def _announce_read_only(self) -> Deferred[None]:
        """Keep ``/bookies/readonly/<address>`` in step with the bookie's state: put (again,
        as an ephemeral node goes with a lost session) while read-only, deleted once writable
        (also at the first check, in case an earlier run of this bookie left one)."""
        store, bookie = self.metadata_store, self.bookie
        if store is None or not self._registered or bookie is None:
            return succeed(None)
        path = f"{cookies.READONLY_PATH}/{self.address}"
        read_only = bookie.read_only is not None
        if read_only:
            d: Deferred[Any] = store.put(path, b"", expected_version=-1, ephemeral=True)
            d.addErrback(lambda f: f.trap(BadVersionError))  # there already
        elif self._announced_read_only is False:
            return succeed(None)
        else:
            d = store.delete(path)
            d.addErrback(lambda f: f.trap(NotFoundError))

        def done(_: object) -> None:
            self._announced_read_only = read_only

        def failed(f: Failure) -> None:
            log.warning(
                "cannot announce the bookie's read-only state",
                extra=kv(read_only=read_only, error=f.getErrorMessage()),
            )

        return d.addCallbacks(done, failed)

    @staticmethod
    def _quietly(fn: Callable[[], Deferred[Any]]) -> Callable[[], None]:
        def run() -> None:
            # A failed checkpoint was logged (and failed the bookie or stalled, Rule 9).
            fn().addErrback(lambda f: None)

        return run

    def _teardown_local(self) -> None:
        if self.bookie is not None and self.bookie.journal is not None:
            self.bookie.journal.stop()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self.bookie is not None:
            self.bookie.storage.close()
        if self._listening is not None:
            self._listening.stopListening()
            self._listening = None

    def stop(self) -> Deferred[None]:
        """Stop listening, answer what is journaled, checkpoint, unregister."""
        return self._shutdown()

    def _shutdown(self) -> Deferred[None]:
        for loop in self._loops:
            if loop.running:
                loop.stop()
        self._loops.clear()
        d: Deferred[Any] = succeed(None)
        if self._listening is not None:
            d.addCallback(lambda _: self._listening.stopListening())
        bookie = self.bookie
        if bookie is not None:

            def close_bookie(_: object) -> Deferred[None]:
                for proto in list(bookie.protocols):
                    if proto.transport is not None:
                        proto.transport.loseConnection()
                return bookie.close()

            d.addCallback(close_bookie)
        if self._registered and self.metadata_store is not None:
            store = self.metadata_store
            d.addCallback(lambda _: cookies.unregister(store, self.address))

        def release(_: object) -> Deferred[None] | None:
            self._listening = None
            self._registered = False
            worker, self._worker = self._worker, None
            if worker is None:
                return None
            return worker.stop()

        def close_files(_: object) -> None:
            if bookie is not None:
                bookie.storage.close()
            self.bookie = None

        d.addBoth(release)
        d.addBoth(close_files)
        return d
