"""Bookie entry log compaction: live entries copied, the index moved, the old log deleted, and
every entry readable at each point a crash could stop it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polybroker.ledger.bookie import storage as storage_module
from polybroker.ledger.bookie.storage import (
    ENTRY_HEADER_SIZE,
    Compaction,
    LedgerStorage,
)

LIMIT = 8 * 1024  # entry log size limit: each checkpoint below spans a few logs


def _checkpoint(s: LedgerStorage) -> None:
    job = s.begin_checkpoint(None)
    s.run_checkpoint(job)
    s.finish_checkpoint(job)


def _data(ledger: int, entry: int) -> bytes:
    return bytes([ledger, entry % 256]) * (100 + entry % 50)


def _fill(s: LedgerStorage, ledgers: dict[int, int], rounds: int = 4) -> None:
    """Write ``ledgers`` (id -> entries per round) interleaved, one checkpoint per round."""
    for r in range(rounds):
        for lid, n in ledgers.items():
            for e in range(r * n, (r + 1) * n):
                s.put_entry(lid, e, e - 1, _data(lid, e))
        _checkpoint(s)


def _log_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "entrylogs").glob("*.log"))


def _finish(s: LedgerStorage, c: Compaction, budget: int = 1 << 30) -> None:
    while not s.compact_step(c, budget):
        pass
    s.forget_logs([c.log_id])


def _compact(s: LedgerStorage, threshold: float, budget: int = 1 << 30) -> list[Compaction]:
    plans = s.plan_compaction(threshold)
    for c in plans:
        _finish(s, c, budget)
    return plans


def _sealed_with_a_dead_ledger(path: Path) -> LedgerStorage:
    """Ledger 1 (live, 5 entries a round) shares its logs with ledger 2 (deleted, 30 a round);
    the storage is reopened so that those logs are sealed."""
    s = LedgerStorage(path, entry_log_size_limit=LIMIT)
    _fill(s, {1: 5, 2: 30})
    s.delete_ledger(2)
    _checkpoint(s)
    s.close()
    return LedgerStorage(path, entry_log_size_limit=LIMIT)


def test_compaction_copies_live_entries_and_deletes_mostly_dead_logs(tmp_path: Path) -> None:
    s = _sealed_with_a_dead_ledger(tmp_path)
    before_logs, before_bytes = set(s.log_ids()), _log_bytes(tmp_path)
    # Logs holding entries of ledger 1 keep them; the others were entirely ledger 2's.
    gone = s.collect_garbage()
    plans = _compact(s, 0.5)
    assert plans
    assert all(c.copied_entries > 0 for c in plans)
    assert not set(s.log_ids()) & {c.log_id for c in plans}
    assert not set(s.log_ids()) & set(gone)
    assert _log_bytes(tmp_path) < before_bytes / 2
    assert set(s.log_ids()) - before_logs  # the copies went to a new log
    assert all(s.read_entry(1, e) == _data(1, e) for e in range(20))
    s.close()
    again = LedgerStorage(tmp_path, entry_log_size_limit=LIMIT)
    assert all(again.read_entry(1, e) == _data(1, e) for e in range(20))
    # The copies' log (sealed now) names ledger 1 in its usage: live, and all of it.
    assert again.collect_garbage() == []
    assert again.plan_compaction(1.0) == []  # all live: never worth copying
    again.close()


def test_logs_above_the_threshold_are_left_alone(tmp_path: Path) -> None:
    """Only logs whose live fraction is under the threshold are planned, emptiest first."""
    s = _sealed_with_a_dead_ledger(tmp_path)
    everything = s.plan_compaction(1.01)
    fractions = [c.live_bytes / c.log_bytes for c in everything]
    assert fractions == sorted(fractions)
    assert fractions[-1] > 0
    lowest_live = min(f for f in fractions if f > 0)
    below = s.plan_compaction(lowest_live)
    assert below
    assert all(c.live_bytes == 0 for c in below)
    live_logs = {c.log_id for c in everything if c.live_bytes}
    _compact(s, lowest_live)
    assert live_logs <= set(s.log_ids())
    assert s.plan_compaction(lowest_live) == []
    s.close()


def test_steps_stay_within_their_budget_and_checkpoints_run_between_them(
    tmp_path: Path,
) -> None:
    """A step copies about its budget; entries written by a checkpoint between two steps and
    the copies share the current log, and both read back after a restart."""
    s = _sealed_with_a_dead_ledger(tmp_path)
    (c,) = [c for c in s.plan_compaction(0.5) if c.live_bytes][:1]
    budget = 400
    assert not s.compact_step(c, budget)
    assert 0 < c.copied_bytes < budget + 300
    for e in range(20, 30):
        s.put_entry(1, e, e - 1, _data(1, e))
    s.put_entry(3, 0, -1, b"new ledger")
    _checkpoint(s)
    while not s.compact_step(c, budget):
        pass
    s.forget_logs([c.log_id])
    assert c.log_id not in s.log_ids()
    s.close()
    again = LedgerStorage(tmp_path, entry_log_size_limit=LIMIT)
    assert all(again.read_entry(1, e) == _data(1, e) for e in range(30))
    assert again.read_entry(3, 0) == b"new ledger"
    again.close()


def test_a_ledger_deleted_during_a_compaction_is_skipped_not_recreated(tmp_path: Path) -> None:
    s = LedgerStorage(tmp_path, entry_log_size_limit=LIMIT)
    _fill(s, {1: 5, 2: 30, 4: 5})
    s.delete_ledger(2)
    _checkpoint(s)
    s.close()
    s = LedgerStorage(tmp_path, entry_log_size_limit=LIMIT)
    plans = [c for c in s.plan_compaction(0.5) if any(lid == 4 for lid, _ in c.todo)]
    assert plans
    s.delete_ledger(4)
    _checkpoint(s)
    for c in plans:
        _finish(s, c)
    assert not (tmp_path / "index" / "4.idx").exists()
    assert s.read_entry(4, 0) is None
    assert all(s.read_entry(1, e) == _data(1, e) for e in range(20))
    s.close()


@pytest.mark.parametrize("stop", ["before-the-index-moves", "before-the-old-log-goes"])
def test_a_crash_in_a_compaction_loses_nothing_and_the_next_one_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """Stopped before the index names the copies, the old log is still what is read and the
    next compaction copies again; stopped after, the copies are read and the next compaction
    only deletes the old log."""
    s = _sealed_with_a_dead_ledger(tmp_path)
    (c,) = [c for c in s.plan_compaction(0.5) if c.live_bytes][:1]

    def crash(*args: object) -> None:
        raise OSError("power cut")

    if stop == "before-the-index-moves":
        monkeypatch.setattr(storage_module.os, "pwrite", crash)
    else:
        monkeypatch.setattr(s, "_delete_log", crash)
    with pytest.raises(OSError, match="power cut"):
        _finish(s, c)
    monkeypatch.undo()
    s.close()
    again = LedgerStorage(tmp_path, entry_log_size_limit=LIMIT)
    assert c.log_id in again.log_ids()
    assert all(again.read_entry(1, e) == _data(1, e) for e in range(20))
    (redo,) = [p for p in _compact(again, 0.5) if p.log_id == c.log_id]
    assert (redo.copied_entries > 0) == (stop == "before-the-index-moves")
    assert c.log_id not in again.log_ids()
    assert all(again.read_entry(1, e) == _data(1, e) for e in range(20))
    again.close()


def test_a_read_that_raced_a_compaction_looks_the_entry_up_again(tmp_path: Path) -> None:
    """The index record named the old log, which the compaction then deleted (Rule 3a)."""
    s = _sealed_with_a_dead_ledger(tmp_path)
    plans = s.plan_compaction(0.5)
    real = s._read_log
    raced = []

    def racing(log_id: int, offset: int, length: int, ledger_id: int, entry_id: int) -> bytes:
        if not raced:
            raced.append(log_id)
            for c in plans:
                _finish(s, c)
        return real(log_id, offset, length, ledger_id, entry_id)

    s._read_log = racing  # type: ignore[method-assign]
    assert s.read_entry(1, 0) == _data(1, 0)
    assert raced
    assert raced[0] not in s.log_ids()
    s.close()


def test_an_entry_that_is_not_what_the_index_says_keeps_its_log(tmp_path: Path) -> None:
    s = _sealed_with_a_dead_ledger(tmp_path)
    (c,) = [c for c in s.plan_compaction(0.5) if c.live_bytes][:1]
    path = tmp_path / "entrylogs" / f"{c.log_id:08x}.log"
    # Damage the first entry header of ledger 1 in that log: its ledger id field.
    raw = bytearray(path.read_bytes())
    at = raw.find(bytes(7) + b"\x01", 16)  # the u64 ledger id 1, after a u32 length
    assert at > 0
    raw[at + 7] = 9
    path.write_bytes(bytes(raw))
    while not s.compact_step(c):
        pass
    assert c.unverified == 1
    assert c.log_id in s.log_ids()
    s.close()


def test_a_log_of_the_older_form_is_scanned_and_compacted(tmp_path: Path) -> None:
    """A log whose only list is the older ``.ledgers`` file (ids, no sizes) is scanned once."""
    s = _sealed_with_a_dead_ledger(tmp_path)
    logs = tmp_path / "entrylogs"
    for usage in logs.glob("*.usage"):
        usage.with_suffix(".ledgers").write_bytes((1).to_bytes(8, "big"))
        usage.unlink()
    plans = _compact(s, 0.5)
    assert plans
    assert not list(logs.glob("*.ledgers"))
    assert all(s.read_entry(1, e) == _data(1, e) for e in range(20))
    s.close()


def test_usage_counts_each_ledgers_bytes_and_entry_range(tmp_path: Path) -> None:
    s = LedgerStorage(tmp_path)
    for e in range(3, 6):
        s.put_entry(5, e, e - 1, b"x" * 10)
    _checkpoint(s)
    s.close()
    (log_id,) = LedgerStorage(tmp_path).log_ids()
    usage = LedgerStorage(tmp_path).log_usage(log_id)
    assert (usage[5].bytes, usage[5].first, usage[5].last) == (3 * (ENTRY_HEADER_SIZE + 10), 3, 5)
    assert os.path.getsize(tmp_path / "entrylogs" / f"{log_id:08x}.log") == 16 + usage[5].bytes
