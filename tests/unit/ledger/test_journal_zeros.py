"""The journal's zeroing ahead of the writer (Rule 6 of the journal): written space ahead, never
a byte of a record overwritten, rolls and errors.

No thread is started: tests call ``zero_step`` and ``write_pending`` as the two threads would.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from journal_recorder import Recorder, open_journal, record_syncs

from polybroker.ledger.bookie import journal as journal_mod
from polybroker.ledger.bookie.journal import (
    Journal,
    JournalConfig,
    JournalReplay,
    entry_record,
    file_name,
)

AHEAD = 64 * 1024
CONFIG = JournalConfig(prealloc_size=0, zero_ahead=AHEAD, max_file_size=1 << 30)


def _journal(path: Path, config: JournalConfig = CONFIG) -> tuple[Journal, Recorder]:
    return open_journal(path, config)


def _group(j: Journal, first: int, count: int, size: int = 300) -> None:
    for e in range(first, first + count):
        header, body = entry_record(7, e, e - 1, bytes([e % 251]) * size)
        j.add(header, body, e)
    j.submit()
    assert j.write_pending() is True


def _replayed(path: Path) -> list[tuple[int, bytes]]:
    replay = JournalReplay(path, None, CONFIG.max_record_size)
    return [(r.entry_id, r.data) for r in replay.records()]


def _expected(count: int, size: int = 300) -> list[tuple[int, bytes]]:
    return [(e, bytes([e % 251]) * size) for e in range(count)]


def test_zeros_are_written_and_synced_ahead_of_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a group, zeroing fills the space ahead with synced zeros through its own file
    descriptor, up to ``zero_ahead`` past the group; replay still ends at the last record."""
    j, rec = _journal(tmp_path)
    _group(j, 0, 150)  # past half the zeroed space: the target moves to ``AHEAD`` past it
    end = rec.groups[-1][1].offset
    synced = record_syncs(monkeypatch)
    while j.zero_step():
        pass
    path = tmp_path / file_name(1)
    assert path.stat().st_size == end + AHEAD
    assert j._zeroed == end + AHEAD
    assert synced
    assert all(fd != j._fd for fd in synced)  # a sync error is still the writer's to meet
    with open(path, "rb") as f:
        f.seek(end)
        assert f.read() == bytes(AHEAD)
    assert _replayed(tmp_path) == _expected(150)
    j.stop()


def test_records_written_into_zeroed_space_are_never_overwritten(tmp_path: Path) -> None:
    """Groups into zeroed space, zeroing between them and past them: every record replays
    intact, and a group within the zeroed space allocates nothing."""
    j, rec = _journal(tmp_path)
    assert j.zero_step() is False  # no zeros before the first group asks for them
    _group(j, 0, 1)
    while j.zero_step():
        pass
    assert j._zeroed == rec.groups[-1][1].offset + AHEAD
    allocated = j._allocated
    count = 1
    for _ in range(12):
        _group(j, count, 20)
        count += 20
        j.zero_step()  # one step only: the writer overtakes the zeros now and then
        assert _replayed(tmp_path) == _expected(count)
    assert j._allocated == allocated  # no fallocate: the blocks were there already
    while j.zero_step():
        pass
    j.stop()
    assert _replayed(tmp_path) == _expected(count)


def test_a_new_file_zeroes_ahead_by_what_it_holds_up_to_zero_ahead(tmp_path: Path) -> None:
    """A new file is zeroed ahead by twice ``_ZERO_SYNC`` at first, then by twice what it
    holds, never more than ``zero_ahead``: its first groups do not wait behind megabytes of
    zeros being synced."""
    step = journal_mod._ZERO_SYNC
    config = JournalConfig(prealloc_size=0, zero_ahead=16 * step, max_file_size=1 << 30)
    j, rec = _journal(tmp_path, config)
    _group(j, 0, 1)
    while j.zero_step():
        pass
    first_end = rec.groups[-1][1].offset
    assert j._zeroed == first_end + 2 * step
    _group(j, 1, 3, size=step)  # the file now holds over 1.5 steps: ahead grows past 2 steps
    while j.zero_step():
        pass
    end = rec.groups[-1][1].offset
    assert j._zeroed == end + 2 * end
    _group(j, 4, 16, size=step)  # twice this would pass ``zero_ahead``: capped there
    while j.zero_step():
        pass
    end = rec.groups[-1][1].offset
    assert j._zeroed == end + 16 * step
    j.stop()
    assert _replayed(tmp_path) == [
        (e, bytes([e % 251]) * (300 if e == 0 else step)) for e in range(20)
    ]


def test_a_roll_moves_the_zeros_to_the_new_file(tmp_path: Path) -> None:
    """The file rolled away from is closed at its last record and gets no zeros after that."""
    config = JournalConfig(prealloc_size=0, zero_ahead=AHEAD, max_file_size=8 * 1024)
    j, rec = _journal(tmp_path, config)
    _group(j, 0, 20)
    old_end = rec.groups[-1][1].offset
    j.zero_step()  # zeros past the end of file 1, cut away when it is closed
    assert (tmp_path / file_name(1)).stat().st_size > old_end
    _group(j, 20, 5)  # past max_file_size: rolls to file 2
    assert rec.groups[-1][1].file_id == 2
    while j.zero_step():
        pass
    assert (tmp_path / file_name(1)).stat().st_size == old_end
    assert j._zeroed == rec.groups[-1][1].offset + AHEAD  # asked for by file 2's first group
    assert (tmp_path / file_name(2)).stat().st_size == rec.groups[-1][1].offset + AHEAD
    j.stop()
    assert _replayed(tmp_path) == _expected(25)


def test_a_zeroing_error_stops_only_the_zeroing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while writing zeros is remembered and ends the zeroing; adds go on into
    allocated space and are acknowledged after their sync as before."""
    config = JournalConfig(prealloc_size=16 * 1024, zero_ahead=AHEAD, max_file_size=1 << 30)
    j, rec = _journal(tmp_path, config)

    def broken(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EIO, "injected")

    _group(j, 0, 1)  # asks for zeros
    monkeypatch.setattr(journal_mod.os, "pwrite", broken)
    j._zero_run()  # returns at once: the error ends the loop
    assert isinstance(j.zero_error, OSError)
    assert j.zero_step() is False
    _group(j, 1, 99)
    assert rec.failures == []
    assert len(rec.groups) == 2
    assert j._allocated >= rec.groups[-1][1].offset
    j.stop()
    assert _replayed(tmp_path) == _expected(100)


def test_zero_ahead_zero_turns_it_off(tmp_path: Path) -> None:
    """With ``zero_ahead=0`` nothing is zeroed and the journal preallocates as before."""
    config = JournalConfig(prealloc_size=16 * 1024, zero_ahead=0, max_file_size=1 << 30)
    j, _ = _journal(tmp_path, config)
    _group(j, 0, 10)
    assert j.zero_step() is False
    assert j._zero_target <= j._reserved
    assert (tmp_path / file_name(1)).stat().st_size == 16 * 1024
    j.stop()
    assert _replayed(tmp_path) == _expected(10)


def test_a_full_disk_pauses_the_zeroing_until_the_next_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room for zeros stops the zeroing of the current file only: a short write claims only
    what it wrote, the writer fallocates past it as before, and the next file is zeroed again."""
    config = JournalConfig(prealloc_size=16 * 1024, zero_ahead=AHEAD, max_file_size=256 * 1024)
    j, rec = _journal(tmp_path, config)
    real_pwrite = journal_mod.os.pwrite
    calls: list[int] = []

    def full(fd: int, data: Any, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            return real_pwrite(fd, data[:4096], offset)  # room for one block only
        raise OSError(errno.ENOSPC, "injected")

    _group(j, 0, 1)  # asks for zeros
    first_end = rec.groups[-1][1].offset
    monkeypatch.setattr(journal_mod.os, "pwrite", full)
    assert j.zero_step() is True  # the short write, then ENOSPC: paused, not stopped
    assert isinstance(j.zero_error, OSError)
    assert j._zero_written == first_end + 4096
    assert j._zeroed < first_end  # nothing of it was synced as zeros
    assert j.zero_step() is False  # file 1 is not zeroed again
    _group(j, 1, 99)  # into fallocated space past the short write
    assert rec.failures == []
    assert j.zero_step() is False
    monkeypatch.setattr(journal_mod.os, "pwrite", real_pwrite)
    entry = 100
    while rec.groups[-1][1].file_id == 1:
        _group(j, entry, 1, size=8000)
        entry += 1
    assert j.zero_step() is True  # file 2: zeroed again
    assert j._zeroed > rec.groups[-1][1].offset
    j.stop()
    assert [e for e, _ in _replayed(tmp_path)] == list(range(entry))
