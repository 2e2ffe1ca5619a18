"""Real ``polybroker bookie`` processes driven by TcpBookieClient: crashes, torn journals,
fencing across restarts, bad input on the port, identity checks and long polls."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater

from polybroker.ledger.api import (
    BookieUnavailableError,
    FenceResult,
    LedgerFencedError,
    NoSuchLedgerError,
)
from polybroker.ledger.bookie.journal import JournalReplay, file_name, list_files, read_mark
from polybroker.ledger.bookie_client import TcpBookieClient
from polybroker.ledger.wire import (
    HEADER,
    WIRE_VERSION,
    ErrorResponse,
    MsgType,
    ReadRequest,
    Status,
    decode_all,
    encode_add_request,
    encode_multi_add,
)

# The fixture types live in this folder's conftest.py, which tests cannot import by name.
BookieProcessFactory = Any
BookieProcess = Any

# Checkpoints stay out of the way unless a test asks for them, so the journal is what restarts.
NO_CHECKPOINT = {"flushInterval": 600_000, "gcWaitTime": 600_000}


def payload(ledger: int, entry: int) -> bytes:
    """Deterministic, entry-specific bytes of varying size (1..8 KiB)."""
    seed = hashlib.sha256(f"{ledger}/{entry}".encode()).digest()
    return seed * (32 + (seed[0] % 224))


async def write_until_killed(
    client: TcpBookieClient,
    factory: BookieProcessFactory,
    bookie: BookieProcess,
    ledger: int,
    kill_after: int,
    window: int = 64,
) -> set[int]:
    """Stream adds with ``window`` outstanding; SIGKILL the bookie after ``kill_after`` acks.

    Returns the entry ids that were acknowledged."""
    acked: set[int] = set()
    done: Deferred[None] = Deferred()
    state = {"next": 0, "outstanding": 0, "killed": False}

    def issue() -> None:
        e = state["next"]
        state["next"] += 1
        state["outstanding"] += 1
        client.add_entry(ledger, e, e - 1, payload(ledger, e)).addCallbacks(
            ok, failed, callbackArgs=(e,)
        )

    def settle() -> None:
        state["outstanding"] -= 1
        if state["killed"] and state["outstanding"] == 0 and not done.called:
            done.callback(None)

    def ok(_: object, e: int) -> None:
        acked.add(e)
        if len(acked) >= kill_after and not state["killed"]:
            state["killed"] = True
            factory.kill(bookie.pid)  # mid-stream: other adds are still in flight
        elif not state["killed"]:
            issue()
        settle()

    def failed(f: Any) -> None:
        f.trap(BookieUnavailableError)
        settle()

    for _ in range(window):
        issue()
    await done
    assert state["next"] > len(acked), "the kill should have caught adds in flight"
    return acked


async def read_all(client: TcpBookieClient, ledger: int, entries: set[int]) -> None:
    """Every entry reads back byte-identical."""
    ids = sorted(entries)
    for start in range(0, len(ids), 200):
        batch = ids[start : start + 200]
        results = await DeferredList(
            [client.read_entry(ledger, e) for e in batch], fireOnOneErrback=True, consumeErrors=True
        )
        for e, (_, data) in zip(batch, results, strict=True):
            assert data == payload(ledger, e), f"entry {e} differs"


async def add_range(client: TcpBookieClient, ledger: int, first: int, last: int) -> None:
    await DeferredList(
        [client.add_entry(ledger, e, e - 1, payload(ledger, e)) for e in range(first, last + 1)],
        fireOnOneErrback=True,
        consumeErrors=True,
    )


@pytest.mark.parametrize(
    "config",
    [NO_CHECKPOINT, {"dbStorage_writeCacheMaxSizeMb": 1, "flushInterval": 200}],
    ids=["journal-only", "with-checkpoints"],
)
@pytest_twisted.ensureDeferred
async def test_kill_mid_stream_loses_no_acknowledged_entry(
    bookie_process_factory: BookieProcessFactory, config: dict[str, object]
) -> None:
    """SIGKILL during a write stream, restart on the same data dir: every acked entry is there."""
    bookie = bookie_process_factory(config=config)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    first_id = await client.instance_id()
    acked = await write_until_killed(client, bookie_process_factory, bookie, 1, kill_after=3000)
    assert len(acked) >= 3000

    again = bookie_process_factory(bookie.data_dir, port=bookie.port, config=config)
    assert await client.instance_id() == first_id  # same client, same identity: reconnects
    await read_all(client, 1, acked)
    await client.add_entry(1, 100_000, 0, b"after restart")
    assert await client.read_entry(1, 100_000) == b"after restart"
    await client.close()
    assert bookie_process_factory.stop(again.pid) == 0


COMPACTING = {
    "flushInterval": 100,
    "gcWaitTime": 600_000,
    "entryLogSizeLimit": 256 * 1024,
    "minorCompactionInterval": 0.05,
    "minorCompactionThreshold": 0.9,
    "majorCompactionInterval": 0,
}


async def poll_until(check: Any, what: str, timeout: float = 30.0) -> None:
    """Wait on the reactor, bounded, until ``check()`` is true."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await deferLater(reactor, 0.01, lambda: None)


@pytest_twisted.ensureDeferred
async def test_kill_during_compaction_loses_no_entry(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """SIGKILL while entry logs are being compacted (after the first one was): every entry of
    the live ledger reads back after a restart, and the compaction goes on from where it was."""
    bookie = bookie_process_factory(config=COMPACTING)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    journal = bookie.data_dir / "journal"
    for first in range(0, 400, 40):
        # Ledger 1 (to be deleted) and ledger 2 (kept) share each checkpoint, so every log
        # holds some of both.
        await add_range(client, 1, first, first + 39)
        await add_range(client, 2, first // 4, first // 4 + 9)
        mark = read_mark(journal)
        await poll_until(lambda m=mark: read_mark(journal) != m, "no checkpoint")
    logs = bookie.data_dir / "ledgers" / "entrylogs"
    before = {p.name for p in logs.glob("*.log")}
    assert len(before) >= 6
    await client.delete_ledger(1)
    await poll_until(
        lambda: "entry log compacted" in bookie_process_factory.log(bookie.pid), "no compaction"
    )
    bookie_process_factory.kill(bookie.pid)
    with pytest.raises(BookieUnavailableError):
        await client.read_entry(2, 0)

    again = bookie_process_factory(bookie.data_dir, port=bookie.port, config=COMPACTING)
    await read_all(client, 2, set(range(100)))
    with pytest.raises(NoSuchLedgerError):
        await client.read_entry(1, 0)
    await poll_until(
        lambda: len(before & {p.name for p in logs.glob("*.log")}) <= 1,
        "the compaction did not go on after the restart",
    )
    await read_all(client, 2, set(range(100)))
    await client.close()
    assert bookie_process_factory.stop(again.pid) == 0


def _valid_end(journal_dir: Path, scratch: Path) -> tuple[Path, int]:
    """The last journal file and the end of its good records (read from a copy)."""
    copy = scratch / "journal-copy"
    shutil.copytree(journal_dir, copy)
    replay = JournalReplay(copy, None, 1 << 30)
    for _ in replay.records():
        pass
    assert replay.end is not None
    last = list_files(journal_dir)[-1]
    assert replay.end.file_id == last
    return journal_dir / file_name(last), replay.end.offset


@pytest.mark.parametrize("damage", ["torn-record", "garbage-appended"])
@pytest_twisted.ensureDeferred
async def test_torn_journal_tail_is_cut_and_acknowledged_data_kept(
    bookie_process_factory: BookieProcessFactory, tmp_path: Path, damage: str
) -> None:
    """A kill, then a half-written record (or trailing garbage) in the journal: the restart cuts
    the tail, keeps every acknowledged entry, and takes new writes."""
    bookie = bookie_process_factory(config=NO_CHECKPOINT)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    await add_range(client, 2, 0, 499)
    bookie_process_factory.kill(bookie.pid)
    path, end = _valid_end(bookie.data_dir / "journal", tmp_path)
    with open(path, "r+b") as f:
        if damage == "torn-record":
            f.seek(end)
            f.write(struct.pack(">II", 4096, 0xDEADBEEF) + os.urandom(100))
            f.truncate(end + 108)
        else:
            f.seek(0, os.SEEK_END)
            f.write(os.urandom(3000))

    again = bookie_process_factory(bookie.data_dir, port=bookie.port, config=NO_CHECKPOINT)
    assert path.stat().st_size == end
    if damage == "torn-record":
        assert "journal tail cut" in bookie_process_factory.log(again.pid)
    await client.close()
    client = TcpBookieClient(again.address, reactor, timeout_s=20)
    await read_all(client, 2, set(range(500)))
    await add_range(client, 2, 500, 520)
    await read_all(client, 2, set(range(521)))
    await client.close()


@pytest_twisted.ensureDeferred
async def test_fence_survives_kill_and_restart(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """Fence, kill -9, restart: the ledger is still fenced, adds refused, the LAC kept."""
    bookie = bookie_process_factory(config=NO_CHECKPOINT)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    await add_range(client, 3, 0, 9)
    assert await client.fence(3) == FenceResult(lac=8, last_entry_id=9)
    with pytest.raises(LedgerFencedError):
        await client.add_entry(3, 10, 9, b"old writer")
    bookie_process_factory.kill(bookie.pid)
    await client.close()

    again = bookie_process_factory(bookie.data_dir, port=bookie.port, config=NO_CHECKPOINT)
    client = TcpBookieClient(again.address, reactor, timeout_s=20)
    with pytest.raises(LedgerFencedError):
        await client.add_entry(3, 10, 9, b"old writer, again")
    assert await client.read_lac(3) == 8
    await read_all(client, 3, set(range(10)))
    await client.add_entry(3, 10, 9, payload(3, 10), recovery=True)
    assert await client.read_entry(3, 10) == payload(3, 10)
    assert await client.fence(3) == FenceResult(lac=9, last_entry_id=10)
    await client.close()


def _exchange(address: str, data: bytes, *, half_close: bool = False) -> bytes:
    """Send raw bytes, then read until the bookie closes (bounded by a socket timeout)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
        return received


def _frame(
    mtype: int, rid: int, body: bytes, *, version: int = WIRE_VERSION, crc: int = 0
) -> bytes:
    return HEADER.pack(14 + len(body), version, mtype, rid, crc) + body


def _multi(rid: int, ledger: int, items: list[tuple[int, int, bytes]]) -> bytes:
    parts = encode_multi_add(rid, ledger, [(e, lac, data, 0) for e, lac, data in items])
    return b"".join(bytes(p) for p in parts)


def _corrupt_last_byte(frame: bytes) -> bytes:
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


@pytest_twisted.ensureDeferred
async def test_bad_input_closes_that_connection_only(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """Random bytes, a truncated frame, an oversize length, a wrong version, a bad checksum and
    bad ADD_MULTI frames each get an error frame and a close; a second client keeps working
    (so the ledger was not fenced); data stays intact."""
    bookie = bookie_process_factory(config=NO_CHECKPOINT)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    await add_range(client, 4, 0, 49)
    good_add = encode_add_request(77, 4, 1000, 0, b"never stored")
    cases: list[tuple[str, bytes, bool, int | None, set[Status]]] = [
        (
            "random",
            random.Random(5).randbytes(512),
            False,
            None,
            {Status.BAD_REQUEST, Status.TOO_LARGE, Status.BAD_VERSION},
        ),
        ("truncated", good_add[:-10], True, 77, {Status.BAD_REQUEST}),
        (
            "oversize",
            HEADER.pack(64 << 20, WIRE_VERSION, MsgType.ADD, 78, 0),
            False,
            78,
            {Status.TOO_LARGE},
        ),
        (
            "version",
            _frame(MsgType.READ, 79, b"\x00" * 17, version=42),
            False,
            79,
            {Status.BAD_VERSION},
        ),
        (
            "checksum",
            _frame(MsgType.READ, 80, ReadRequest(80, 4, 0).encode()[18:], crc=1),
            False,
            80,
            {Status.BAD_REQUEST},
        ),
        (
            "multi-add-record-checksum",
            _corrupt_last_byte(_multi(81, 4, [(1001, 0, b"never stored either")])),
            False,
            81,
            {Status.BAD_REQUEST},
        ),
        (
            # A record with a journal meta-record's entry id (a fence) must never be journaled.
            "multi-add-meta-entry-id",
            _multi(82, 4, [(1002, 0, b"x"), (-0x2000, 0, b"")]),
            False,
            82,
            {Status.BAD_REQUEST},
        ),
    ]
    for i, (name, data, half_close, rid, statuses) in enumerate(cases):
        answer = _exchange(bookie.address, data, half_close=half_close)
        (err,) = decode_all(answer)
        assert isinstance(err, ErrorResponse), name
        assert err.status in statuses, (name, err)
        if rid is not None:
            assert err.request_id == rid, name
        # Meanwhile the well-behaved client goes on as if nothing happened.
        await client.add_entry(4, 50 + i, 49 + i, payload(4, 50 + i))
    await read_all(client, 4, set(range(50 + len(cases))))
    for never in (1000, 1001, 1002):
        with pytest.raises(Exception, match="no entry"):
            await client.read_entry(4, never)
    await client.close()
    assert bookie_process_factory.stop(bookie.pid) == 0


@pytest_twisted.ensureDeferred
async def test_long_poll_read_lac_fires_on_a_new_add(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """A tailing reader's long poll answers when a writer's add moves the LAC, long before its
    timeout; with no progress it answers at the timeout with the current LAC."""
    bookie = bookie_process_factory(config=NO_CHECKPOINT)
    writer = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    reader = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    await add_range(writer, 5, 0, 2)
    assert await reader.read_lac(5) == 1
    started = time.monotonic()
    poll = reader.read_lac(5, previous_lac=1, timeout_ms=30_000)
    await writer.add_entry(5, 3, 2, b"three")
    assert await poll == 2
    assert time.monotonic() - started < 10
    started = time.monotonic()
    assert await reader.read_lac(5, previous_lac=2, timeout_ms=300) == 2
    assert time.monotonic() - started >= 0.25
    await writer.close()
    await reader.close()


@pytest_twisted.ensureDeferred
async def test_clean_stop_checkpoints_and_restart_replays_nothing(
    bookie_process_factory: BookieProcessFactory,
) -> None:
    """SIGTERM exits 0 after a final checkpoint; the restart serves everything from the index."""
    bookie = bookie_process_factory(config=NO_CHECKPOINT)
    client = TcpBookieClient(bookie.address, reactor, timeout_s=20)
    await add_range(client, 6, 0, 299)
    await client.delete_ledger(6)
    await add_range(client, 7, 0, 99)
    assert bookie_process_factory.stop(bookie.pid) == 0
    await client.close()
    again = bookie_process_factory(bookie.data_dir, port=bookie.port, config=NO_CHECKPOINT)
    assert "journal replayed records=0" in bookie_process_factory.log(again.pid)
    client = TcpBookieClient(again.address, reactor, timeout_s=20)
    await read_all(client, 7, set(range(100)))
    with pytest.raises(NoSuchLedgerError):
        await client.read_entry(6, 0)
    await client.close()


def test_wiped_or_foreign_data_dirs_refuse_to_start(
    bookie_process_factory: BookieProcessFactory, tmp_path: Path
) -> None:
    """A wiped ledgers directory, data without a cookie and a swapped journal directory each
    refuse to start with a non-zero exit and a message saying what is wrong."""
    a = bookie_process_factory(config=NO_CHECKPOINT)
    b = bookie_process_factory(config=NO_CHECKPOINT)
    assert bookie_process_factory.stop(a.pid) == 0
    assert bookie_process_factory.stop(b.pid) == 0

    wiped = tmp_path / "wiped"
    shutil.copytree(a.data_dir, wiped)
    shutil.rmtree(wiped / "ledgers")
    code, err = bookie_process_factory.run_to_exit(wiped)
    assert code != 0
    assert "wiped or replaced" in err

    orphan = tmp_path / "orphan"
    shutil.copytree(a.data_dir, orphan)
    (orphan / "cookie").unlink()
    code, err = bookie_process_factory.run_to_exit(orphan)
    assert code != 0
    assert "no cookie" in err

    swapped = tmp_path / "swapped"
    shutil.copytree(a.data_dir, swapped)
    shutil.rmtree(swapped / "journal")
    shutil.copytree(b.data_dir / "journal", swapped / "journal")
    code, err = bookie_process_factory.run_to_exit(swapped)
    assert code != 0
    assert "swapped" in err

    # The untouched data dir still starts.
    again = bookie_process_factory(a.data_dir, config=NO_CHECKPOINT)
    assert bookie_process_factory.stop(again.pid) == 0


def test_port_in_use_fails_with_a_message(
    bookie_process_factory: BookieProcessFactory, tmp_path: Path
) -> None:
    """A bookie that cannot listen exits non-zero and says why."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = bookie_process_factory.run_to_exit(tmp_path / "busy", port=port)
    assert code != 0
    assert "cannot start" in err
