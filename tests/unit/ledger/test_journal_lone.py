"""The journal's lone groups (Rule 2a): written and synced by the submitter, with no hand-off,
only when that cannot reorder completions, skip a group window or block on a slow disk.

No writer thread is started: a test puts the writer's state where the thread would be
(``_IDLE``: parked, waiting for records) and calls ``write_pending`` as the thread would.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from journal_recorder import Recorder, open_journal, record_syncs

from polybroker.ledger.bookie import journal as journal_mod
from polybroker.ledger.bookie.journal import (
    FILE_HEADER_SIZE,
    Journal,
    JournalConfig,
    JournalError,
    JournalPosition,
    JournalReplay,
    entry_record,
)

CONFIG = JournalConfig(prealloc_size=64 * 1024, max_file_size=1 << 30, zero_ahead=0)


class HeldRecorder(Recorder):
    """Keeps deliveries until ``run`` (a reactor that has not had its turn yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[Any, tuple[Any, ...]]] = []

    def deliver(self, fn: Any, *args: Any) -> None:
        self.held.append((fn, args))

    def run(self) -> None:
        held, self.held = self.held, []
        for fn, args in held:
            fn(*args)


def _parked(path: Path, config: JournalConfig = CONFIG) -> tuple[Journal, Recorder]:
    j, rec = open_journal(path, config)
    j._writer_waiting = journal_mod._IDLE
    return j, rec


def _add(j: Journal, entry: int, size: int = 100) -> None:
    header, body = entry_record(1, entry, entry - 1, bytes([entry % 256]) * size)
    j.add(header, body, entry)


def _replayed(path: Path) -> list[int]:
    return [r.entry_id for r in JournalReplay(path, None, CONFIG.max_record_size).records()]


def _done(rec: Recorder) -> list[list[Any]]:
    return [tokens for tokens, _ in rec.groups]


def test_a_lone_group_is_written_and_synced_by_the_submitter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing more coming, the writer parked: submit writes, syncs and delivers the group
    itself, without waking the writer, which stays parked."""
    synced = record_syncs(monkeypatch)
    j, rec = _parked(tmp_path)
    _add(j, 0)
    _add(j, 1)
    j.submit(more_coming=False)
    assert len(synced) == 1
    assert rec.groups == [([0, 1], JournalPosition(1, FILE_HEADER_SIZE + 2 * (8 + 25 + 100)))]
    assert (j.wakeups, j.lone_groups, j.groups_written) == (0, 1, 1)
    assert j._writer_waiting == journal_mod._IDLE
    assert j.write_pending() is False  # nothing was queued for the writer
    j.close()
    assert _replayed(tmp_path) == [0, 1]


def test_a_lone_groups_completion_runs_at_once_not_through_deliver(tmp_path: Path) -> None:
    """The submitter runs a lone group's completion itself, inside ``submit``: a ``deliver``
    from the reactor to itself would cost a waker write and another reactor turn. A group
    the writer wrote still goes through ``deliver``."""
    j, rec = _parked(tmp_path)
    held = HeldRecorder()
    j._deliver = held.deliver
    _add(j, 0)
    j.submit()
    assert j.lone_groups == 1
    assert held.held == []
    assert _done(rec) == [[0]]
    assert j._handed == j._ran == 1
    _add(j, 1)
    j.submit(more_coming=True)
    assert j.write_pending() is True
    assert _done(rec) == [[0]]
    assert len(held.held) == 1
    held.run()
    assert _done(rec) == [[0], [1]]
    j.close()
    assert _replayed(tmp_path) == [0, 1]


def test_no_lone_group_when_more_is_coming(tmp_path: Path) -> None:
    """More input on its way: the records go to the writer, whose window may gather more."""
    j, rec = _parked(tmp_path)
    _add(j, 0)
    j.submit(more_coming=True)
    assert rec.groups == []
    assert (j.wakeups, j.lone_groups) == (1, 0)
    assert j.write_pending() is True
    assert _done(rec) == [[0]]
    j.close()


def test_no_lone_group_while_the_writer_is_busy_or_records_are_queued(tmp_path: Path) -> None:
    """A writer writing (not parked), or records queued before: the group queues behind them,
    in submit order."""
    j, rec = open_journal(tmp_path, CONFIG)
    _add(j, 0)
    j.submit()  # the writer is busy (``_NOT_WAITING``): queued
    j._writer_waiting = journal_mod._IDLE  # pretend it parked with records still queued
    _add(j, 1)
    j.submit()
    assert rec.groups == []
    assert j.lone_groups == 0
    assert j.write_pending() is True
    assert _done(rec) == [[0, 1]]
    j.close()


def test_no_lone_group_before_the_writers_completions_ran(tmp_path: Path) -> None:
    """A completion the writer handed over has not run yet: a lone group's completion would
    overtake it, so the group goes to the writer, and completions run in journal order."""
    j, rec = open_journal(tmp_path, CONFIG)
    held = HeldRecorder()
    j._deliver = held.deliver
    _add(j, 0)
    j.submit()
    assert j.write_pending() is True  # the writer's completion is on its way
    j._writer_waiting = journal_mod._IDLE
    _add(j, 1)
    j.submit()
    assert j.lone_groups == 0
    assert j.wakeups == 1
    assert j.write_pending() is True
    held.run()
    assert _done(rec) == [[0], [1]]
    # Now every completion ran: the next lone group is the submitter's.
    j._writer_waiting = journal_mod._IDLE
    _add(j, 2)
    j.submit()
    assert j.lone_groups == 1
    held.run()
    assert _done(rec) == [[0], [1], [2]]
    positions = [p.offset for _, p in rec.groups]
    assert positions == sorted(positions)
    j.close()
    assert _replayed(tmp_path) == [0, 1, 2]


@pytest.mark.parametrize(
    ("config", "size", "sync_s"),
    [
        (CONFIG, CONFIG.lone_max_bytes, 0.0),  # too large
        (CONFIG, 100, CONFIG.lone_max_sync_s * 2),  # every recent sync was slow
        (JournalConfig(prealloc_size=0, lone_max_bytes=0, zero_ahead=0), 100, 0.0),  # off
    ],
)
def test_no_lone_group_when_large_slow_or_turned_off(
    tmp_path: Path, config: JournalConfig, size: int, sync_s: float
) -> None:
    """Beyond ``lone_max_bytes``, with recent syncs slower than ``lone_max_sync_s``, or with
    lone groups turned off, the writer does the group."""
    j, rec = _parked(tmp_path, config)
    if sync_s:
        j._syncs.extend([sync_s] * journal_mod._SYNCS_KEPT)
    _add(j, 0, size)
    j.submit()
    assert rec.groups == []
    assert j.lone_groups == 0
    assert j.wakeups == 1
    assert j.write_pending() is True
    assert _done(rec) == [[0]]
    j.close()


def test_slow_syncs_turn_lone_groups_off_until_one_is_fast_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone group may block the submitter while one of the last group syncs (whoever wrote
    it) was fast: a few slow ones (a loaded machine's waits) keep it on, a run of slow ones
    turns it off, and one fast sync turns it on again."""
    took = {"s": 0.05}
    now = {"t": 0.0}

    def clock() -> float:
        now["t"] += took["s"] / 2  # two readings per group: its write and sync take took["s"]
        return now["t"]

    monkeypatch.setattr(journal_mod, "perf_counter", clock)
    j, _rec = _parked(tmp_path)
    for e in range(journal_mod._SYNCS_KEPT):
        j._writer_waiting = journal_mod._IDLE
        _add(j, e)
        j.submit()
        assert j.lone_groups == e + 1  # at least one recent sync was fast enough
        if e == 0:
            j._syncs.appendleft(0.0001)  # a fast one before the slow run
    j._writer_waiting = journal_mod._IDLE
    _add(j, 100)
    j.submit()
    assert j.lone_groups == journal_mod._SYNCS_KEPT  # every kept sync was slow: the writer's
    assert j.wakeups == 1
    took["s"] = 0.0001
    assert j.write_pending() is True
    j._writer_waiting = journal_mod._IDLE
    _add(j, 101)
    j.submit()
    assert j.lone_groups == journal_mod._SYNCS_KEPT + 1
    j.close()


def test_a_lone_group_write_error_fails_the_journal_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync error in a lone group acknowledges nothing of it, and fails every later record."""

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fdatasync", broken)
    j, rec = _parked(tmp_path)
    _add(j, 0)
    j.submit()
    assert rec.groups == []
    assert [t for _, t in rec.failures] == [[0]]
    assert isinstance(j.failed, JournalError)
    monkeypatch.undo()
    _add(j, 1)
    j.submit()
    assert [t for _, t in rec.failures] == [[0], [1]]
    assert rec.groups == []
    j.close()
