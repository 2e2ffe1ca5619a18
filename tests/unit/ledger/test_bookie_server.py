"""The bookie's request logic over StringTransport: durability before answers, fencing, long
polls, bad input, backpressure, deletion and restart (journal pumped by hand, Clock timers)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from polybroker.ledger.bookie import journal as journal_mod
from polybroker.ledger.bookie import storage as storage_mod
from polybroker.ledger.bookie.journal import JournalConfig, list_files, read_mark
from polybroker.ledger.bookie.server import Bookie, BookieProtocol
from polybroker.ledger.bookie.storage import LedgerStorage
from polybroker.ledger.wire import (
    FLAG_RECOVERY,
    HEADER,
    LATEST_VERSION,
    WIRE_VERSION,
    AddResponse,
    DeleteLedgerRequest,
    DeleteLedgerResponse,
    ErrorResponse,
    FenceRequest,
    FenceResponse,
    HelloRequest,
    HelloResponse,
    Message,
    MsgType,
    MultiAddResponse,
    ReadLacRequest,
    ReadLacResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
    WriteLacRequest,
    decode_all,
    encode_add_request,
    encode_multi_add,
)

FRAME = 1 << 20


def run_now(fn: Callable[[], Any]) -> Deferred[Any]:
    """Run a blocking job on the spot (the worker thread's stand-in)."""
    try:
        return succeed(fn())
    except Exception:
        return fail(Failure())


class Harness:
    """One bookie on a directory, with connections over StringTransport."""

    def __init__(
        self,
        root: Path,
        *,
        cache_bytes: int = 1 << 20,
        run_blocking: Callable[[Callable[[], Any]], Deferred[Any]] | None = None,
        journal: JournalConfig | None = None,
        **kw: Any,
    ) -> None:
        self.clock = Clock()
        self.storage = LedgerStorage(root / "ledgers", write_cache_max_bytes=cache_bytes)
        self.bookie = Bookie(
            self.storage,
            root / "journal",
            journal or JournalConfig(prealloc_size=0),
            self.clock,
            "instance-1",
            deliver=lambda fn, *args: fn(*args),
            run_blocking=run_blocking or run_now,
            **kw,
        )
        (root / "journal").mkdir(exist_ok=True)
        self.replay = self.bookie.recover()

    def connect(self) -> tuple[BookieProtocol, StringTransport]:
        proto = BookieProtocol(self.bookie, FRAME)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def flush(self) -> None:
        """End the reactor turn (the hand-off to the journal), then let the journal writer
        write and sync what is queued."""
        assert self.bookie.journal is not None
        self.clock.advance(0)
        while self.bookie.journal.write_pending():
            pass

    def crash(self) -> None:
        """Drop everything in memory, as kill -9 would (queued records are lost)."""
        assert self.bookie.journal is not None
        self.bookie.journal.close()
        self.storage.close()


def send(proto: BookieProtocol, *frames: bytes) -> None:
    proto.dataReceived(b"".join(frames))


def answers(transport: StringTransport) -> list[Message]:
    out = decode_all(transport.value())
    transport.clear()
    return out


def add(rid: int, ledger: int, entry: int, data: bytes = b"", *, recovery: bool = False) -> bytes:
    return encode_add_request(rid, ledger, entry, entry - 1, data or f"e{entry}".encode(), recovery)


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_add_is_answered_only_after_the_journal_synced_it(h: Harness) -> None:
    """No ADD answer leaves before its group is durable; then it is readable (I1, I7)."""
    proto, t = h.connect()
    send(proto, add(1, 10, 0, b"hello"), add(2, 10, 1, b"world"))
    assert t.value() == b""
    h.flush()
    assert answers(t) == [
        AddResponse(1, Status.OK, "", 10, 0),
        AddResponse(2, Status.OK, "", 10, 1),
    ]
    send(proto, ReadRequest(3, 10, 1).encode())
    (resp,) = answers(t)
    assert isinstance(resp, ReadResponse)
    assert (resp.status, bytes(resp.data)) == (Status.OK, b"world")


def test_hello_answers_instance_id_and_negotiates(h: Harness) -> None:
    """HELLO picks a common version and names the bookie; no common version is BAD_VERSION."""
    proto, t = h.connect()
    send(
        proto,
        HelloRequest(1, 1, 5).encode(),
        HelloRequest(2, 1, 1).encode(),
        HelloRequest(3, 6, 9).encode(),
    )
    ok, old, bad = answers(t)
    assert ok == HelloResponse(1, Status.OK, "", LATEST_VERSION, "instance-1")
    assert old == HelloResponse(2, Status.OK, "", WIRE_VERSION, "instance-1")
    assert isinstance(bad, HelloResponse)
    assert bad.status == Status.BAD_VERSION
    assert bad.instance_id == "instance-1"


def test_reads_of_missing_things(h: Harness) -> None:
    """An unknown ledger is NO_SUCH_LEDGER, a missing entry of a known one NO_SUCH_ENTRY."""
    proto, t = h.connect()
    send(proto, add(1, 1, 0))
    h.flush()
    answers(t)
    send(proto, ReadRequest(2, 2, 0).encode(), ReadRequest(3, 1, 5).encode())
    a, b = answers(t)
    assert isinstance(a, ReadResponse)
    assert isinstance(b, ReadResponse)
    assert (a.status, b.status) == (Status.NO_SUCH_LEDGER, Status.NO_SUCH_ENTRY)


def test_fence_is_durable_before_its_answer_and_refuses_adds(h: Harness) -> None:
    """Adds after a fence are refused at once; the fence answers after its sync with the
    bookie's view of the end; a recovery add still goes through (I16)."""
    proto, t = h.connect()
    send(proto, add(1, 7, 0), add(2, 7, 1))
    h.flush()
    answers(t)
    send(proto, FenceRequest(3, 7).encode(), add(4, 7, 2))
    assert answers(t) == [AddResponse(4, Status.FENCED, "", 7, 2)]
    h.flush()
    assert answers(t) == [FenceResponse(3, Status.OK, "", 7, 0, 1)]
    send(proto, add(5, 7, 2, recovery=True))
    h.flush()
    assert answers(t) == [AddResponse(5, Status.OK, "", 7, 2)]


def test_adds_accepted_before_a_fence_count_in_its_answer(h: Harness) -> None:
    """An add journaled before the fence completes first and is in the fence's last entry."""
    proto, t = h.connect()
    send(proto, add(1, 7, 0), FenceRequest(2, 7).encode())
    h.flush()
    assert answers(t) == [
        AddResponse(1, Status.OK, "", 7, 0),
        FenceResponse(2, Status.OK, "", 7, -1, 0),
    ]


def test_fence_and_lac_survive_a_crash_without_checkpoint(tmp_path: Path) -> None:
    """Replaying the journal restores entries, the fence and the LAC (I5)."""
    h = Harness(tmp_path)
    proto, t = h.connect()
    send(proto, add(1, 3, 0), add(2, 3, 1), add(3, 3, 2), FenceRequest(4, 3).encode())
    h.flush()
    assert len(answers(t)) == 4
    h.crash()

    again = Harness(tmp_path)
    assert again.replay.records_read == 4
    proto, t = again.connect()
    send(proto, add(5, 3, 3), ReadLacRequest(6, 3).encode(), ReadRequest(7, 3, 2).encode())
    fenced, lac, read = answers(t)
    assert fenced == AddResponse(5, Status.FENCED, "", 3, 3)
    assert lac == ReadLacResponse(6, Status.OK, "", 3, 1)
    assert isinstance(read, ReadResponse)
    assert bytes(read.data) == b"e2"


def test_unsynced_adds_are_lost_by_a_crash_and_were_never_answered(tmp_path: Path) -> None:
    """What the journal had not synced is gone after a crash, and nobody was told it was stored."""
    h = Harness(tmp_path)
    proto, t = h.connect()
    send(proto, add(1, 3, 0))
    h.flush()
    send(proto, add(2, 3, 1))
    assert [m.request_id for m in answers(t)] == [1]
    h.crash()
    again = Harness(tmp_path)
    proto, t = again.connect()
    send(proto, ReadRequest(3, 3, 0).encode(), ReadRequest(4, 3, 1).encode())
    a, b = answers(t)
    assert isinstance(a, ReadResponse)
    assert isinstance(b, ReadResponse)
    assert (a.status, b.status) == (Status.OK, Status.NO_SUCH_ENTRY)


def test_fencing_read_fences_then_reads(h: Harness) -> None:
    """A READ with the fence flag fences durably first, then answers the read."""
    proto, t = h.connect()
    send(proto, add(1, 4, 0))
    h.flush()
    answers(t)
    send(proto, ReadRequest(2, 4, 0, fence=True).encode(), add(3, 4, 1))
    assert answers(t) == [AddResponse(3, Status.FENCED, "", 4, 1)]
    h.flush()
    (read,) = answers(t)
    assert isinstance(read, ReadResponse)
    assert (read.request_id, read.status, bytes(read.data)) == (2, Status.OK, b"e0")


def test_long_poll_fires_when_the_lac_passes(h: Harness) -> None:
    """A READ_LAC long poll answers as soon as an add carries a higher LAC."""
    proto, t = h.connect()
    reader, rt = h.connect()
    send(reader, ReadLacRequest(1, 9, previous_lac=-1, timeout_ms=5000).encode())
    send(proto, add(1, 9, 0))  # carries LAC -1: not past the reader's -1
    h.flush()
    answers(t)
    assert rt.value() == b""
    send(proto, add(2, 9, 1))  # carries LAC 0
    h.flush()
    assert answers(rt) == [ReadLacResponse(1, Status.OK, "", 9, 0)]
    assert h.clock.getDelayedCalls() == []


def test_long_poll_times_out_with_the_current_lac(h: Harness) -> None:
    """With no progress the long poll answers at its timeout, not before."""
    reader, rt = h.connect()
    send(reader, ReadLacRequest(1, 9, previous_lac=5, timeout_ms=2000).encode())
    h.clock.advance(1.9)
    assert rt.value() == b""
    h.clock.advance(0.2)
    assert answers(rt) == [ReadLacResponse(1, Status.OK, "", 9, -1)]


def test_long_poll_already_satisfied_answers_at_once(h: Harness) -> None:
    """A long poll behind the current LAC does not wait."""
    proto, t = h.connect()
    send(proto, add(1, 9, 0), add(2, 9, 1))
    h.flush()
    send(proto, ReadLacRequest(3, 9, previous_lac=-1, timeout_ms=2000).encode())
    assert answers(t)[-1] == ReadLacResponse(3, Status.OK, "", 9, 0)


def test_explicit_lac_is_journaled_and_wakes_long_polls(h: Harness) -> None:
    """WRITE_LAC raises the LAC once durable and answers waiting readers."""
    proto, t = h.connect()
    reader, rt = h.connect()
    send(reader, ReadLacRequest(1, 9, previous_lac=-1, timeout_ms=2000).encode())
    send(proto, WriteLacRequest(2, 9, 4).encode())
    assert rt.value() == b""
    h.flush()
    assert answers(rt) == [ReadLacResponse(1, Status.OK, "", 9, 4)]
    assert [m.status for m in answers(t)] == [Status.OK]


def test_closed_connection_drops_its_long_polls(h: Harness) -> None:
    """A long poll of a connection that went away leaves no timer behind."""
    reader, _ = h.connect()
    send(reader, ReadLacRequest(1, 9, previous_lac=5, timeout_ms=2000).encode())
    assert len(h.clock.getDelayedCalls()) == 1
    reader.connectionLost()
    assert h.clock.getDelayedCalls() == []


def test_read_range_honours_max_bytes_and_gaps(h: Harness) -> None:
    """A range stops at max_bytes (but returns at least one entry) and at the first gap."""
    proto, t = h.connect()
    send(proto, *(add(i, 2, e, b"x" * 100) for i, e in enumerate((0, 1, 2, 3, 5))))
    h.flush()
    answers(t)
    send(
        proto,
        ReadRangeRequest(10, 2, 0, 9, 250).encode(),
        ReadRangeRequest(11, 2, 0, 9, 10).encode(),
        ReadRangeRequest(12, 2, 2, 9, 10_000).encode(),
        ReadRangeRequest(13, 2, 4, 9, 10_000).encode(),
    )
    a, b, c, d = answers(t)
    assert isinstance(a, ReadRangeResponse)
    assert isinstance(b, ReadRangeResponse)
    assert isinstance(c, ReadRangeResponse)
    assert [e for e, _ in a.entries] == [0, 1]
    assert [e for e, _ in b.entries] == [0]
    assert [e for e, _ in c.entries] == [2, 3]
    assert d.status == Status.NO_SUCH_ENTRY  # type: ignore[union-attr]


def test_strided_read_takes_every_kth_entry_with_the_range_bounds(h: Harness) -> None:
    """A strided read answers first, first + stride, ... and, like a range, stops at
    max_bytes (one entry at least) and at the first entry it lacks."""
    proto, t = h.connect()
    have = (0, 1, 2, 3, 4, 6, 9, 12)
    send(proto, *(add(i, 2, e, b"x" * 100) for i, e in enumerate(have)))
    h.flush()
    answers(t)
    send(
        proto,
        ReadRangeRequest(10, 2, 0, 12, 10_000, 3).encode(),
        ReadRangeRequest(11, 2, 0, 12, 250, 3).encode(),
        ReadRangeRequest(12, 2, 1, 12, 10_000, 3).encode(),
        ReadRangeRequest(13, 2, 5, 12, 10_000, 3).encode(),
    )
    a, b, c, d = answers(t)
    assert isinstance(a, ReadRangeResponse)
    assert [e for e, _ in a.entries] == [0, 3, 6, 9, 12]
    assert [bytes(x) for _, x in a.entries] == [
        h.storage.read_entry(2, e) for e in (0, 3, 6, 9, 12)
    ]
    assert [e for e, _ in b.entries] == [0, 3]  # type: ignore[union-attr]
    assert [e for e, _ in c.entries] == [1, 4]  # type: ignore[union-attr]
    assert d.status == Status.NO_SUCH_ENTRY  # type: ignore[union-attr]
    assert not t.disconnecting


def test_delete_in_journal_order_never_resurrects(tmp_path: Path) -> None:
    """An add journaled before a delete completes first; the delete wins, also after a crash."""
    h = Harness(tmp_path)
    proto, t = h.connect()
    send(proto, add(1, 6, 0))
    h.flush()
    send(proto, add(2, 6, 1), DeleteLedgerRequest(3, 6).encode())
    h.flush()
    assert answers(t)[-1] == DeleteLedgerResponse(3, Status.OK, "", 6)
    send(proto, ReadRequest(4, 6, 0).encode())
    assert answers(t)[0].status == Status.NO_SUCH_LEDGER  # type: ignore[union-attr]
    h.crash()
    again = Harness(tmp_path)
    proto, t = again.connect()
    send(proto, ReadRequest(5, 6, 1).encode())
    assert answers(t)[0].status == Status.NO_SUCH_LEDGER  # type: ignore[union-attr]


def test_random_bytes_get_an_error_and_a_close_and_others_go_on(h: Harness) -> None:
    """Garbage on one connection closes it with an error frame; another keeps working."""
    bad, bt = h.connect()
    good, gt = h.connect()
    bad.dataReceived(os.urandom(64) + b"\xff" * 4)
    (err,) = answers(bt)
    assert isinstance(err, ErrorResponse)
    assert err.status in (Status.BAD_REQUEST, Status.TOO_LARGE, Status.BAD_VERSION)
    assert bt.disconnecting
    bad.dataReceived(add(9, 1, 0))  # ignored: the connection is closing
    h.flush()
    assert bt.value() == b""
    send(good, add(1, 1, 0))
    h.flush()
    assert answers(gt) == [AddResponse(1, Status.OK, "", 1, 0)]
    assert not gt.disconnecting


@pytest.mark.parametrize(
    ("frame", "status", "rid"),
    [
        (HEADER.pack(50_000_000, WIRE_VERSION, MsgType.ADD, 21, 0), Status.TOO_LARGE, 21),
        (HEADER.pack(14, 9, MsgType.FENCE, 22, 0), Status.BAD_VERSION, 22),
        (
            HEADER.pack(14 + 8, WIRE_VERSION, MsgType.FENCE, 23, 1) + b"\x00" * 8,
            Status.BAD_REQUEST,
            23,
        ),
        (AddResponse(24, Status.OK).encode(), Status.BAD_REQUEST, 24),
    ],
    ids=["oversize", "wrong-version", "bad-crc", "response-as-request"],
)
def test_bad_frames_answer_their_request_id(
    h: Harness, frame: bytes, status: Status, rid: int
) -> None:
    """Each kind of bad frame is answered with its status and request id, then closed."""
    proto, t = h.connect()
    send(proto, add(1, 1, 0), frame)
    (err,) = answers(t)
    assert err == ErrorResponse(rid, status, err.message)  # type: ignore[union-attr]
    assert t.disconnecting
    h.flush()  # the good add before the bad frame is still stored
    send(h.connect()[0], ReadRequest(2, 1, 0).encode())
    assert h.storage.read_entry(1, 0) == b"e0"


def test_truncated_frame_at_half_close_is_answered(h: Harness) -> None:
    """A peer that stops sending inside a frame gets an error naming its request, then a close."""
    proto, t = h.connect()
    frame = ReadRequest(31, 1, 0).encode()
    proto.dataReceived(frame[:20])
    proto.readConnectionLost()
    (err,) = answers(t)
    assert isinstance(err, ErrorResponse)
    assert (err.request_id, err.status) == (31, Status.BAD_REQUEST)
    assert t.disconnecting


def test_half_close_waits_for_answers_in_flight(h: Harness) -> None:
    """A peer that stops sending still gets its journaled answers before the close."""
    proto, t = h.connect()
    send(proto, add(1, 1, 0))
    proto.readConnectionLost()
    assert not t.disconnecting
    h.flush()
    assert answers(t) == [AddResponse(1, Status.OK, "", 1, 0)]
    assert t.disconnecting


def test_too_many_adds_in_flight_pause_reading(tmp_path: Path) -> None:
    """A connection with max in-flight adds is not read from until half of them are answered."""
    h = Harness(tmp_path, max_in_flight_per_connection=4)
    proto, t = h.connect()
    send(proto, *(add(i, 1, i) for i in range(3)))
    assert t.producerState == "producing"
    send(proto, add(3, 1, 3))
    assert t.producerState == "paused"
    h.flush()
    assert t.producerState == "producing"
    assert len(answers(t)) == 4


def test_full_write_cache_throttles_until_the_checkpoint_ends(tmp_path: Path) -> None:
    """While a checkpoint flushes and the cache is full, connections are paused (never dropped)."""
    jobs: list[tuple[Callable[[], Any], Deferred[Any]]] = []

    def later(fn: Callable[[], Any]) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        jobs.append((fn, d))
        return d

    h = Harness(tmp_path, cache_bytes=4000, run_blocking=later)
    proto, t = h.connect()
    send(proto, *(add(i, 1, i, b"x" * 1000) for i in range(2)))
    h.flush()
    assert len(jobs) == 1  # half the cache used: a checkpoint started
    send(proto, *(add(10 + i, 1, 2 + i, b"y" * 1000) for i in range(4)))
    h.flush()
    assert t.producerState == "paused"
    assert len(answers(t)) == 6  # every add was still answered
    fn, d = jobs.pop()
    d.callback(fn())
    assert t.producerState == "producing"
    assert h.storage.read_entry(1, 0) == b"x" * 1000
    assert h.storage.read_entry(1, 5) == b"y" * 1000


def test_the_worker_frees_the_flushed_half_of_the_write_cache(tmp_path: Path) -> None:
    """A checkpoint's entries are freed by a job of the worker after it, not by the reactor
    (freed there at once, 30,000 of them held it for milliseconds)."""
    jobs: list[tuple[Callable[[], Any], Deferred[Any]]] = []

    def later(fn: Callable[[], Any]) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        jobs.append((fn, d))
        return d

    h = Harness(tmp_path, run_blocking=later)
    proto, _t = h.connect()
    send(proto, *(add(i, 1, i, bytes([i % 256]) * 100) for i in range(300)))
    h.flush()
    h.bookie.checkpoint()
    fn, d = jobs.pop()
    d.callback(fn())  # the checkpoint itself
    assert not h.storage.flushing
    assert len(jobs) == 1  # the release, queued behind it
    release, _ = jobs.pop()
    flushed = release.args[0]  # type: ignore[attr-defined]
    assert sum(map(len, flushed.values())) == 300  # still held, off the reactor's hands
    release()
    assert flushed == {}
    assert all(h.storage.read_entry(1, i) == bytes([i % 256]) * 100 for i in range(300))


def test_checkpoint_persists_the_mark_and_drops_old_journal_files(tmp_path: Path) -> None:
    """After a checkpoint the mark is durable, older journal files are gone, nothing replays."""
    h = Harness(tmp_path)
    proto, _ = h.connect()
    send(proto, add(1, 1, 0, b"kept"))
    h.flush()
    h.crash()
    h = Harness(tmp_path)  # a restart opens journal file 2
    proto, _t = h.connect()
    send(proto, add(2, 1, 1, b"also"))
    h.flush()
    assert list_files(tmp_path / "journal") == [1, 2]
    done = h.bookie.checkpoint()
    assert done.called
    mark = read_mark(tmp_path / "journal")
    assert mark is not None
    assert mark.file_id == 2
    assert list_files(tmp_path / "journal") == [2]
    h.crash()
    again = Harness(tmp_path)
    assert again.replay.records_read == 0
    assert again.storage.read_entry(1, 0) == b"kept"
    assert again.storage.read_entry(1, 1) == b"also"


def test_replay_checkpoints_when_the_cache_fills(tmp_path: Path) -> None:
    """A long journal is replayed with bounded memory: checkpoints run during the replay."""
    h = Harness(tmp_path, cache_bytes=1 << 30)
    proto, _t = h.connect()
    send(proto, *(add(i, 1, i, bytes([i]) * 1000) for i in range(100)))
    h.flush()
    h.crash()
    again = Harness(tmp_path, cache_bytes=8000)
    assert again.storage.cache_bytes < 8000
    assert read_mark(tmp_path / "journal") is not None
    assert all(again.storage.read_entry(1, i) == bytes([i]) * 1000 for i in range(100))


def test_journal_failure_fails_the_bookie_for_writes(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync error answers ERROR to the group and every later write; reads go on."""
    proto, t = h.connect()
    send(proto, add(1, 1, 0))
    h.flush()
    answers(t)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fdatasync", broken)
    send(proto, add(2, 1, 1))
    h.flush()
    (err,) = answers(t)
    assert (err.request_id, err.status) == (2, Status.ERROR)  # type: ignore[union-attr]
    send(proto, add(3, 1, 2), FenceRequest(4, 1).encode(), ReadRequest(5, 1, 0).encode())
    a, f, r = answers(t)
    assert a.status == Status.ERROR  # type: ignore[union-attr]
    assert f.status == Status.ERROR  # type: ignore[union-attr]
    assert r.status == Status.OK  # type: ignore[union-attr]


def test_bad_entry_ids_are_refused(h: Harness) -> None:
    """Negative or absurd entry ids are BAD_REQUEST, not journaled."""
    proto, t = h.connect()
    send(proto, encode_add_request(1, 1, -5, -1, b"x"), encode_add_request(2, 1, 1 << 40, 0, b"x"))
    assert [m.status for m in answers(t)] == [Status.BAD_REQUEST, Status.BAD_REQUEST]  # type: ignore[union-attr]
    assert h.bookie.journal is not None
    h.clock.advance(0)
    assert h.bookie.journal.write_pending() is False


# -- ADD_MULTI ------------------------------------------------------------------------------


def multi(rid: int, ledger: int, entries: range, *, recovery: bool = False) -> bytes:
    flags = FLAG_RECOVERY if recovery else 0
    items = [(e, e - 1, f"m{e}".encode(), flags) for e in entries]
    return b"".join(bytes(p) for p in encode_multi_add(rid, ledger, items))


def test_multi_add_is_one_journal_record_run_answered_once_after_the_sync(h: Harness) -> None:
    """An ADD_MULTI is answered once, after its group is durable; then every entry is readable
    and the LAC moved with the highest one it carried."""
    proto, t = h.connect()
    send(proto, multi(1, 4, range(0, 5)))
    assert t.value() == b""
    assert proto.in_flight == 5
    h.flush()
    assert answers(t) == [MultiAddResponse(1, Status.OK, "", 4, 5)]
    assert proto.in_flight == 0
    assert [h.storage.read_entry(4, e) for e in range(5)] == [f"m{e}".encode() for e in range(5)]
    send(proto, ReadLacRequest(2, 4).encode())
    assert answers(t) == [ReadLacResponse(2, Status.OK, "", 4, 3)]


def test_multi_adds_survive_a_crash_through_journal_replay(tmp_path: Path) -> None:
    """The records of an ADD_MULTI are journal records: a replay restores every entry."""
    h = Harness(tmp_path)
    proto, t = h.connect()
    send(proto, multi(1, 4, range(0, 3)), add(2, 4, 3), multi(3, 4, range(4, 6)))
    h.flush()
    assert len(answers(t)) == 3
    h.crash()
    again = Harness(tmp_path)
    assert again.replay.records_read == 6
    assert again.storage.read_entry(4, 5) == b"m5"
    assert again.storage.read_entry(4, 3) == b"e3"


def test_multi_add_to_a_fenced_ledger_is_refused_whole(h: Harness) -> None:
    """After a fence an ADD_MULTI answers FENCED and stores nothing; one whose records all
    carry the recovery flag goes through (I16)."""
    proto, t = h.connect()
    send(proto, FenceRequest(1, 4).encode())
    h.flush()
    answers(t)
    send(proto, multi(2, 4, range(0, 3)))
    assert answers(t) == [MultiAddResponse(2, Status.FENCED, "", 4, 3)]
    assert h.storage.read_entry(4, 0) is None
    send(proto, multi(3, 4, range(0, 3), recovery=True))
    h.flush()
    assert answers(t) == [MultiAddResponse(3, Status.OK, "", 4, 3)]
    assert h.storage.read_entry(4, 2) == b"m2"


def test_multi_add_with_an_absurd_entry_id_is_refused(h: Harness) -> None:
    """An entry id above the index's bound makes the whole frame BAD_REQUEST, not journaled."""
    proto, t = h.connect()
    send(proto, multi(1, 4, range((1 << 40) - 1, (1 << 40) + 1)))
    assert answers(t) == [MultiAddResponse(1, Status.BAD_REQUEST, "", 4, 2)]
    assert h.bookie.journal is not None
    h.clock.advance(0)
    assert h.bookie.journal.write_pending() is False


def test_multi_add_counts_every_entry_in_flight(tmp_path: Path) -> None:
    """Backpressure counts the entries of an ADD_MULTI, not the frame."""
    h = Harness(tmp_path, max_in_flight_per_connection=4)
    proto, t = h.connect()
    send(proto, multi(1, 1, range(0, 4)))
    assert t.producerState == "paused"
    h.flush()
    assert t.producerState == "producing"
    assert answers(t) == [MultiAddResponse(1, Status.OK, "", 1, 4)]


def test_journal_failure_answers_a_multi_add_with_an_error(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync error answers the ADD_MULTI with ERROR and releases its in-flight count."""

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fdatasync", broken)
    proto, t = h.connect()
    send(proto, multi(1, 1, range(0, 3)))
    h.flush()
    (err,) = answers(t)
    assert isinstance(err, ErrorResponse)
    assert (err.request_id, err.status) == (1, Status.ERROR)
    assert proto.in_flight == 0
    send(proto, multi(2, 1, range(3, 4)))
    why = "bookie failed: journal write failed: [Errno 5] Input/output error"
    assert answers(t) == [MultiAddResponse(2, Status.ERROR, why, 1, 1)]


def test_a_read_only_bookie_refuses_adds_saying_why_and_serves_the_rest(h: Harness) -> None:
    """Read-only (a full disk): adds and ADD_MULTIs answer ERROR with the reason and store
    nothing; recovery adds, fences, deletes and reads go on; writable again, adds are taken."""
    proto, t = h.connect()
    send(proto, add(1, 7, 0), add(2, 8, 0))
    h.flush()
    answers(t)
    assert h.bookie.set_read_only("disk 96.0% used") is True
    assert h.bookie.set_read_only("disk 97.0% used") is False  # no change of state
    send(proto, add(3, 7, 1), multi(4, 7, range(1, 3)))
    why = "bookie is read-only: disk 97.0% used"
    assert answers(t) == [
        AddResponse(3, Status.ERROR, why, 7, 1),
        MultiAddResponse(4, Status.ERROR, why, 7, 2),
    ]
    h.flush()
    assert h.storage.read_entry(7, 1) is None
    send(proto, FenceRequest(5, 7).encode(), add(6, 7, 1, recovery=True))
    send(proto, DeleteLedgerRequest(7, 8).encode(), ReadRequest(8, 7, 0).encode())
    h.flush()
    by_id = {m.request_id: m for m in answers(t)}
    assert by_id[5] == FenceResponse(5, Status.OK, "", 7, -1, 0)
    assert by_id[6] == AddResponse(6, Status.OK, "", 7, 1)
    assert by_id[7] == DeleteLedgerResponse(7, Status.OK, "", 8)
    assert isinstance(by_id[8], ReadResponse)
    assert (by_id[8].status, bytes(by_id[8].data)) == (Status.OK, b"e0")
    assert h.bookie.set_read_only(None) is True
    send(proto, add(9, 9, 0))
    h.flush()
    assert answers(t) == [AddResponse(9, Status.OK, "", 9, 0)]


def _disk_full(*_: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    ("code", "why"),
    [(errno.ENOSPC, "No space left on device"), (errno.EMFILE, "Too many open files")],
)
def test_a_checkpoint_a_full_disk_fails_stalls_read_only_until_it_goes_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, why: str
) -> None:
    """A checkpoint whose entry-log write finds the disk full (part-way), or the process out
    of file descriptors, is no failure: the bookie turns read-only, keeps serving reads from
    memory and stays read-only whatever the disk check says, until the same checkpoint runs
    again and goes through; the log holds whole records only, and a restart finds every
    acknowledged entry."""
    h = Harness(tmp_path)
    proto, t = h.connect()
    send(proto, *(add(i + 1, 1, i, bytes([i]) * 3000) for i in range(4)))
    h.flush()
    assert len(answers(t)) == 4
    real_write = storage_mod.write_parts

    def half_then_full(fd: int, parts: list[Any]) -> None:
        os.write(fd, bytes(parts[0]) + bytes(parts[1])[:100])  # a torn record, then no room
        raise OSError(code, why)

    monkeypatch.setattr(storage_mod, "write_parts", half_then_full)
    failed: list[Failure] = []
    h.bookie.checkpoint().addErrback(failed.append)
    assert [f.value.errno for f in failed] == [code]
    assert h.bookie.failed is None
    assert h.bookie.read_only is not None
    assert "no room" in h.bookie.read_only
    assert read_mark(tmp_path / "journal") is None
    (log_file,) = (tmp_path / "ledgers" / "entrylogs").glob("*.log")
    assert log_file.stat().st_size == 16  # the torn record was cut off: the header alone
    send(proto, add(10, 1, 4), ReadRequest(11, 1, 2).encode())
    refused, read = answers(t)
    assert refused.status == Status.ERROR
    assert "no room" in refused.message
    assert isinstance(read, ReadResponse)
    assert bytes(read.data) == bytes([2]) * 3000
    assert h.bookie.set_read_only(None) is False  # the disk check cannot end it yet

    monkeypatch.setattr(storage_mod, "write_parts", real_write)
    assert h.bookie.checkpoint().called
    assert h.bookie.read_only is None
    assert read_mark(tmp_path / "journal") is not None
    send(proto, add(12, 1, 4, b"after"))
    h.flush()
    assert answers(t) == [AddResponse(12, Status.OK, "", 1, 4)]
    h.crash()
    again = Harness(tmp_path)
    assert again.replay.records_read == 1  # the add after the checkpoint
    assert [again.storage.read_entry(1, i) for i in range(5)] == [
        *(bytes([i]) * 3000 for i in range(4)),
        b"after",
    ]


def test_a_journal_group_the_disk_has_no_room_for_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the journal file cannot grow for a group, only that group's adds fail, saying so;
    the bookie turns read-only instead of failing, takes adds again once made writable, and
    the journal stays whole: a restart replays exactly the acknowledged entries."""
    h = Harness(tmp_path, journal=JournalConfig(prealloc_size=8192, zero_ahead=0))
    proto, t = h.connect()
    send(proto, add(1, 1, 0, b"a" * 3000))
    h.flush()
    assert answers(t) == [AddResponse(1, Status.OK, "", 1, 0)]
    monkeypatch.setattr(journal_mod.os, "posix_fallocate", _disk_full)
    send(proto, add(2, 1, 1, b"b" * 9000))
    h.flush()
    (err,) = answers(t)
    assert (err.request_id, err.status) == (2, Status.ERROR)  # type: ignore[union-attr]
    assert "journal cannot grow" in err.message  # type: ignore[union-attr]
    assert h.bookie.failed is None
    assert h.bookie.read_only is not None
    assert h.storage.read_entry(1, 1) is None
    monkeypatch.undo()
    assert h.bookie.set_read_only(None) is True
    send(proto, add(3, 1, 1, b"c" * 9000))
    h.flush()
    assert answers(t) == [AddResponse(3, Status.OK, "", 1, 1)]
    h.crash()
    again = Harness(tmp_path)
    assert again.replay.records_read == 2
    assert again.storage.read_entry(1, 1) == b"c" * 9000
