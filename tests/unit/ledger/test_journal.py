"""The bookie journal: group writes, replay, torn and corrupt tails, rolling and the mark.

The writer thread is never started here: tests call ``write_pending`` as the thread would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from journal_recorder import Recorder, open_journal

from polybroker.ledger.bookie import journal as journal_mod
from polybroker.ledger.bookie.journal import (
    FILE_HEADER_SIZE,
    META_DELETE,
    META_FENCE,
    META_LAC,
    Journal,
    JournalConfig,
    JournalError,
    JournalPosition,
    JournalReplay,
    delete_files_before,
    entry_record,
    file_name,
    group_wait,
    list_files,
    meta_record,
    read_mark,
    write_mark,
)

SMALL = JournalConfig(prealloc_size=64 * 1024, max_file_size=1 << 30)


def _journal(path: Path, config: JournalConfig = SMALL, first: int = 1) -> tuple[Journal, Recorder]:
    return open_journal(path, config, first)


def _add(j: Journal, ledger: int, entry: int, data: bytes, token: Any = None) -> None:
    header, body = entry_record(ledger, entry, entry - 1, data)
    j.add(header, body, token if token is not None else (ledger, entry))


def _replay(path: Path, mark: JournalPosition | None = None) -> tuple[list[tuple], JournalReplay]:
    replay = JournalReplay(path, mark, SMALL.max_record_size)
    return [(r.ledger_id, r.entry_id, r.lac, r.data) for r in replay.records()], replay


def test_a_group_is_one_write_one_sync_and_one_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records submitted together are written by one os.writev, synced once, delivered once."""
    j, rec = _journal(tmp_path)
    calls = {"write": 0, "sync": 0}
    real_write, real_sync = os.writev, os.fdatasync

    def write(fd: int, data: Any) -> int:
        calls["write"] += 1
        return real_write(fd, data)

    def sync(fd: int) -> None:
        calls["sync"] += 1
        real_sync(fd)

    monkeypatch.setattr(journal_mod.os, "writev", write)
    monkeypatch.setattr(journal_mod.os, "fdatasync", sync)
    for e in range(50):
        _add(j, 1, e, b"d" * 100)
    j.submit()
    assert rec.groups == []  # nothing is acknowledged before the writer synced it
    assert j.write_pending() is True
    assert calls == {"write": 1, "sync": 1}
    assert len(rec.groups) == 1
    tokens, position = rec.groups[0]
    assert tokens == [(1, e) for e in range(50)]
    assert position == JournalPosition(1, FILE_HEADER_SIZE + 50 * (8 + 25 + 100))
    assert j.write_pending() is False
    j.close()


def test_several_submits_join_one_group(tmp_path: Path) -> None:
    """Everything queued when the writer takes a group goes into it, in submit order."""
    j, rec = _journal(tmp_path)
    _add(j, 1, 0, b"a")
    j.submit()
    _add(j, 2, 0, b"b")
    j.submit()
    j.write_pending()
    assert [t for t, _ in rec.groups] == [[(1, 0), (2, 0)]]
    j.close()


def test_sync_data_false_skips_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """journalSyncData=false writes without syncing (the operator's choice)."""
    synced = []
    monkeypatch.setattr(journal_mod.os, "fdatasync", lambda fd: synced.append(fd))
    j, rec = _journal(tmp_path, JournalConfig(prealloc_size=0, sync_data=False))
    _add(j, 1, 0, b"a")
    j.submit()
    j.write_pending()
    assert synced == []
    assert len(rec.groups) == 1
    j.close()


def test_replay_returns_records_and_meta_records_in_order(tmp_path: Path) -> None:
    """Adds, fences, explicit LACs and deletes come back as written."""
    j, _ = _journal(tmp_path)
    _add(j, 1, 0, b"zero")
    j.add(*meta_record(1, META_FENCE), "f")
    j.add(*meta_record(1, META_LAC, 7), "l")
    j.add(*meta_record(2, META_DELETE), "d")
    _add(j, 1, 1, b"")
    j.submit()
    j.write_pending()
    j.close()
    records, replay = _replay(tmp_path)
    assert records == [
        (1, 0, -1, b"zero"),
        (1, META_FENCE, -1, b""),
        (1, META_LAC, 7, b""),
        (2, META_DELETE, -1, b""),
        (1, 1, 0, b""),
    ]
    assert replay.truncated == []


def test_file_is_preallocated(tmp_path: Path) -> None:
    """A new journal file takes journalPreAllocSizeMB of space up front."""
    j, _ = _journal(tmp_path)
    assert (tmp_path / file_name(1)).stat().st_size == SMALL.prealloc_size
    j.close()


def _written(tmp_path: Path, count: int, size: int = 200) -> int:
    """Write ``count`` records in one group; return the end offset."""
    j, rec = _journal(tmp_path)
    for e in range(count):
        _add(j, 1, e, bytes([e % 256]) * size)
    j.submit()
    j.write_pending()
    j.close()
    return rec.groups[-1][1].offset


def test_torn_tail_is_cut_and_earlier_records_survive(tmp_path: Path) -> None:
    """A file cut inside its last record replays all complete records and is truncated there."""
    end = _written(tmp_path, 10)
    record = 8 + 25 + 200
    path = tmp_path / file_name(1)
    os.truncate(path, end - 50)  # the last record lost its last 50 bytes
    records, replay = _replay(tmp_path)
    assert [r[1] for r in records] == list(range(9))
    assert replay.truncated == [(1, end - record)]
    assert path.stat().st_size == end - record
    assert replay.end == JournalPosition(1, end - record)


def test_corrupt_record_ends_replay_there(tmp_path: Path) -> None:
    """A flipped byte in a record stops replay at that record and cuts the file."""
    end = _written(tmp_path, 10)
    record = 8 + 25 + 200
    path = tmp_path / file_name(1)
    bad_at = FILE_HEADER_SIZE + 6 * record + 40
    with open(path, "r+b") as f:
        f.seek(bad_at)
        byte = f.read(1)
        f.seek(bad_at)
        f.write(bytes([byte[0] ^ 0xFF]))
    records, replay = _replay(tmp_path)
    assert [r[1] for r in records] == list(range(6))
    assert path.stat().st_size == FILE_HEADER_SIZE + 6 * record
    assert replay.truncated == [(1, FILE_HEADER_SIZE + 6 * record)]
    assert end > FILE_HEADER_SIZE + 6 * record


def test_garbage_after_the_preallocated_zeros_is_dropped(tmp_path: Path) -> None:
    """Bytes beyond the zeroed tail are never read as records and are cut away."""
    end = _written(tmp_path, 3)
    path = tmp_path / file_name(1)
    with open(path, "ab") as f:
        f.write(os.urandom(5000))
    records, replay = _replay(tmp_path)
    assert len(records) == 3
    assert path.stat().st_size == end
    assert replay.truncated == []  # zeros mark the end of what was written: not damage


def test_torn_garbage_right_after_the_last_record_is_cut(tmp_path: Path) -> None:
    """A half-written record header claiming a huge length is treated as a torn tail."""
    end = _written(tmp_path, 3)
    path = tmp_path / file_name(1)
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(b"\xff\xff\xff\xff\x00\x01")
    records, replay = _replay(tmp_path)
    assert len(records) == 3
    assert replay.truncated == [(1, end)]
    assert path.stat().st_size == end


def test_corruption_before_the_last_file_refuses_to_guess(tmp_path: Path) -> None:
    """Damage in a file that later files follow is damage to acknowledged data: an error."""
    j, _ = _journal(tmp_path, JournalConfig(prealloc_size=0, max_file_size=1000))
    for e in range(20):
        _add(j, 1, e, b"x" * 200)
        j.submit()
        j.write_pending()
    j.close()
    first = tmp_path / file_name(1)
    assert len(list_files(tmp_path)) > 2
    with open(first, "r+b") as f:
        f.seek(FILE_HEADER_SIZE + 30)
        f.write(b"\x00\x01\x02")
    with pytest.raises(JournalError, match="acknowledged data is damaged"):
        _replay(tmp_path)


def test_files_roll_at_the_size_limit_and_replay_across_them(tmp_path: Path) -> None:
    """Groups never straddle files; rolled files are trimmed; replay reads them all in order."""
    j, rec = _journal(tmp_path, JournalConfig(prealloc_size=4096, max_file_size=1000))
    for e in range(12):
        _add(j, 3, e, b"y" * 150)
        j.submit()
        j.write_pending()
    j.close()
    ids = list_files(tmp_path)
    assert len(ids) >= 3
    for fid in ids[:-1]:
        assert (tmp_path / file_name(fid)).stat().st_size <= 1000
    records, _ = _replay(tmp_path)
    assert [r[1] for r in records] == list(range(12))
    assert rec.groups[-1][1].file_id == ids[-1]


def test_replay_from_a_mark_skips_what_was_checkpointed(tmp_path: Path) -> None:
    """Records before the mark are not replayed; the mark survives a reread."""
    j, rec = _journal(tmp_path)
    for e in range(5):
        _add(j, 1, e, b"z")
        j.submit()
        j.write_pending()
    j.close()
    mark = rec.groups[2][1]
    write_mark(tmp_path, mark)
    assert read_mark(tmp_path) == mark
    records, _ = _replay(tmp_path, read_mark(tmp_path))
    assert [r[1] for r in records] == [3, 4]


def test_corrupt_mark_is_an_error(tmp_path: Path) -> None:
    """A damaged mark file is reported, never read as some other position."""
    write_mark(tmp_path, JournalPosition(3, 100))
    raw = bytearray((tmp_path / "lastMark").read_bytes())
    raw[6] ^= 1
    (tmp_path / "lastMark").write_bytes(bytes(raw))
    with pytest.raises(JournalError, match="corrupt"):
        read_mark(tmp_path)
    (tmp_path / "fresh").mkdir()
    assert read_mark(tmp_path / "fresh") is None


def test_only_files_wholly_before_the_mark_are_deleted(tmp_path: Path) -> None:
    """The file holding the mark and later ones stay."""
    for fid in (1, 2, 3, 4):
        (tmp_path / file_name(fid)).write_bytes(b"")
    assert delete_files_before(tmp_path, 3) == [1, 2]
    assert list_files(tmp_path) == [3, 4]


def test_write_error_fails_the_journal_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fdatasync error acknowledges nothing of the group and fails every later record."""
    j, rec = _journal(tmp_path)

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fdatasync", broken)
    _add(j, 1, 0, b"a", "t0")
    j.submit()
    j.write_pending()
    assert rec.groups == []
    assert [t for _, t in rec.failures] == [["t0"]]
    monkeypatch.undo()
    _add(j, 1, 1, b"b", "t1")
    j.submit()
    assert [t for _, t in rec.failures] == [["t0"], ["t1"]]
    assert isinstance(j.failed, JournalError)
    j.close()


def test_stop_writes_what_is_queued(tmp_path: Path) -> None:
    """A clean stop acknowledges queued records and trims the preallocated tail."""
    j, rec = _journal(tmp_path)
    _add(j, 1, 0, b"last")
    j.submit()
    j.stop()
    assert len(rec.groups) == 1
    assert (tmp_path / file_name(1)).stat().st_size == rec.groups[0][1].offset


def test_group_window_policy() -> None:
    """Write now when nothing more is coming or the threshold is met; else wait out the window."""
    assert group_wait(10.0, 10.0, 100, True, 0.001, 1000) == 0.0
    assert group_wait(10.0, 10.0, 1000, False, 0.001, 1000) == 0.0
    assert group_wait(10.0004, 10.0, 100, False, 0.001, 1000) == pytest.approx(0.0006)
    assert group_wait(10.002, 10.0, 100, False, 0.001, 1000) == 0.0


def test_write_parts_gathers_many_parts_and_resumes_after_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of more parts than one writev takes, each call cut short by the kernel, still
    lands whole and in order."""
    parts: list[Any] = [bytes([i % 251]) * (1 + i % 7) for i in range(3000)]
    parts[5] = memoryview(b"view-part")
    calls: list[int] = []

    def short_writev(fd: int, buffers: list[Any]) -> int:
        calls.append(len(buffers))
        return os.write(fd, b"".join(buffers)[:777])

    monkeypatch.setattr(journal_mod.os, "writev", short_writev)
    path = tmp_path / "out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        journal_mod.write_parts(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)
    assert max(calls) <= 1024
    assert len(calls) >= len(b"".join(parts)) // 777


def test_submit_wakes_the_writer_only_when_that_changes_what_it_does(tmp_path: Path) -> None:
    """Waiting for records: woken. Busy: not woken (it looks at the queue next). Waiting out a
    group window: woken only by a hand-off that ends the window."""
    j, _ = _journal(tmp_path)
    config = SMALL

    def hand_off(more_coming: bool, size: int = 10) -> int:
        before = j.wakeups
        _add(j, 1, 0, b"x" * size)
        j.submit(more_coming)
        return j.wakeups - before

    j._writer_waiting = journal_mod._NOT_WAITING
    assert hand_off(False) == 0
    j._writer_waiting = journal_mod._IDLE
    assert hand_off(True) == 1
    assert j._writer_waiting == journal_mod._NOT_WAITING  # one wake-up per wait
    assert hand_off(False) == 0
    j._writer_waiting = journal_mod._WINDOW
    assert hand_off(True) == 0  # more is coming and the group is small: the window stands
    assert hand_off(True, size=config.buffered_writes_threshold) == 1  # the threshold ends it
    j._writer_waiting = journal_mod._WINDOW
    assert hand_off(False) == 1  # nothing more is coming: write now
    while j.write_pending():
        pass
