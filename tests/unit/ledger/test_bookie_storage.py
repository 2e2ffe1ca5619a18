"""Bookie entry storage: write cache, checkpoint to entry logs and index, restart, delete and GC."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from polybroker.ledger.bookie.journal import JournalPosition
from polybroker.ledger.bookie.storage import (
    ENTRY_HEADER,
    ENTRY_HEADER_SIZE,
    INDEX_HEADER_SIZE,
    INDEX_RECORD,
    LOG_HEADER_SIZE,
    MAX_ENTRY_ID,
    VIEW_MIN_BYTES,
    LedgerStorage,
    StorageCorruptError,
    release_entries,
)


def _storage(path: Path, **kw: int) -> LedgerStorage:
    return LedgerStorage(path, **kw)


def _checkpoint(s: LedgerStorage, mark: JournalPosition | None = None) -> None:
    job = s.begin_checkpoint(mark)
    s.run_checkpoint(job)
    s.finish_checkpoint(job)


def _data(ledger: int, entry: int) -> bytes:
    return f"{ledger}:{entry}:".encode() * (entry % 7 + 1)


def test_entries_are_readable_from_the_write_cache_at_once(tmp_path: Path) -> None:
    """A put entry reads back before any checkpoint (I7); unknown ones are None."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, memoryview(b"abc"))
    assert s.read_entry(1, 0) == b"abc"
    assert s.read_entry(1, 1) is None
    assert s.read_entry(2, 0) is None
    assert s.cache_bytes == 3
    st = s.state(1)
    assert st is not None
    assert (st.last_entry, st.lac, st.fenced) == (0, -1, False)
    s.close()


def test_checkpoint_moves_entries_to_logs_and_index(tmp_path: Path) -> None:
    """After a checkpoint the cache is empty and reads come from the index and entry log."""
    s = _storage(tmp_path)
    for e in range(100):
        s.put_entry(5, e, e - 1, _data(5, e))
    _checkpoint(s)
    assert s.cache_bytes == 0
    assert s.flushing is False
    assert all(s.read_entry(5, e) == _data(5, e) for e in range(100))
    assert s.read_entry(5, 100) is None
    assert (tmp_path / "index" / "5.idx").exists()
    s.close()


def test_finish_hands_over_the_flushed_half_and_release_frees_it(tmp_path: Path) -> None:
    """``finish_checkpoint`` returns the flushed entries (the job keeps none); freeing them in
    slices empties them all, and reads go on from the entry logs."""
    s = _storage(tmp_path)
    for e in range(600):
        s.put_entry(3, e, e - 1, _data(3, e))
    s.put_entry(4, 0, -1, b"lone")
    job = s.begin_checkpoint(None)
    s.run_checkpoint(job)
    flushed = s.finish_checkpoint(job)
    assert job.snapshot == {}
    assert sorted(flushed) == [3, 4]
    assert len(flushed[3]) == 600
    release_entries(flushed)
    assert flushed == {}
    assert all(s.read_entry(3, e) == _data(3, e) for e in range(600))
    assert s.read_entry(4, 0) == b"lone"
    s.close()


def test_reads_see_the_half_being_flushed(tmp_path: Path) -> None:
    """Between freezing a checkpoint and finishing it, its entries stay readable."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"frozen")
    job = s.begin_checkpoint(None)
    s.put_entry(1, 1, 0, b"fresh")
    assert s.read_entry(1, 0) == b"frozen"
    assert s.read_entry(1, 1) == b"fresh"
    s.run_checkpoint(job)
    s.finish_checkpoint(job)
    assert s.read_entry(1, 0) == b"frozen"
    s.begin_checkpoint(None)
    with pytest.raises(RuntimeError):
        s.begin_checkpoint(None)
    s.close()


def test_restart_reads_entries_and_ledger_state_from_disk(tmp_path: Path) -> None:
    """A new storage on the same directory serves checkpointed entries, fence flag and LAC."""
    s = _storage(tmp_path)
    for lid in (1, 2, 3):
        for e in range(20):
            s.put_entry(lid, e, e - 1, _data(lid, e))
    s.fence(2)
    s.set_lac(3, 30)
    _checkpoint(s)
    s.close()

    again = _storage(tmp_path)
    for lid in (1, 2, 3):
        assert [again.read_entry(lid, e) for e in range(20)] == [_data(lid, e) for e in range(20)]
    st1, st2, st3 = again.state(1), again.state(2), again.state(3)
    assert st1 is not None
    assert st2 is not None
    assert st3 is not None
    assert (st1.fenced, st1.lac, st1.last_entry) == (False, 18, 19)
    assert st2.fenced is True
    assert st3.lac == 30
    assert again.state(4) is None
    again.close()


def test_fence_of_an_empty_ledger_is_persisted(tmp_path: Path) -> None:
    """Fencing a ledger this bookie holds nothing of still survives a restart."""
    s = _storage(tmp_path)
    s.fence(9)
    _checkpoint(s)
    s.close()
    again = _storage(tmp_path)
    st = again.state(9)
    assert st is not None
    assert st.fenced is True
    assert st.last_entry == -1
    again.close()


def test_entry_logs_roll_at_their_size_limit(tmp_path: Path) -> None:
    """Entries spread over several entry logs when the limit is small; all read back."""
    s = _storage(tmp_path, entry_log_size_limit=4096)
    for e in range(60):
        s.put_entry(1, e, e - 1, bytes([e]) * 500)
    _checkpoint(s)
    for e in range(60, 80):
        s.put_entry(1, e, e - 1, bytes([e]) * 500)
    _checkpoint(s)
    assert len(s.log_ids()) >= 8
    for log_id in s.log_ids():
        assert (tmp_path / "entrylogs" / f"{log_id:08x}.log").stat().st_size <= 4096
    assert all(s.read_entry(1, e) == bytes([e]) * 500 for e in range(80))
    s.close()


def test_rewriting_an_entry_points_the_index_at_the_new_copy(tmp_path: Path) -> None:
    """An entry put again (a recovery rewrite or a replay) reads as the latest copy."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"first")
    _checkpoint(s)
    s.put_entry(1, 0, -1, b"second")
    _checkpoint(s)
    assert s.read_entry(1, 0) == b"second"
    s.close()


def test_delete_hides_the_ledger_and_gc_reclaims_its_log(tmp_path: Path) -> None:
    """A deleted ledger reads as unknown at once; its index goes at checkpoint, its log at GC."""
    # Five entries of ledger 1 fill the first log (16 + 5 * 320 bytes): ledger 2 starts another.
    s = _storage(tmp_path, entry_log_size_limit=1900)
    for e in range(5):
        s.put_entry(1, e, e - 1, b"a" * 300)
    _checkpoint(s)
    for e in range(5):
        s.put_entry(2, e, e - 1, b"b" * 300)
    _checkpoint(s)
    logs_before = s.log_ids()
    assert s.collect_garbage() == []

    s.delete_ledger(1)
    assert s.state(1) is None
    assert s.read_entry(1, 0) is None
    assert (tmp_path / "index" / "1.idx").exists()  # until the next checkpoint
    _checkpoint(s)
    assert not (tmp_path / "index" / "1.idx").exists()
    gone = s.collect_garbage()
    s.forget_logs(gone)
    assert gone
    assert set(gone) < set(logs_before)
    assert all(s.read_entry(2, e) == b"b" * 300 for e in range(5))
    s.close()


def test_gc_keeps_a_log_while_any_of_its_ledgers_lives(tmp_path: Path) -> None:
    """A log shared by a deleted and a live ledger is kept whole (compaction copies it)."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"dead")
    s.put_entry(2, 0, -1, b"alive")
    _checkpoint(s)
    s.delete_ledger(1)
    _checkpoint(s)
    s.put_entry(3, 0, -1, b"x")
    s.close()
    again = _storage(tmp_path)  # the old log is sealed now
    assert again.collect_garbage() == []
    assert again.read_entry(2, 0) == b"alive"
    again.close()


def test_gc_scans_a_log_that_lost_its_usage(tmp_path: Path) -> None:
    """A log without its usage file (a crash) is scanned to learn its ledgers before deciding."""
    s = _storage(tmp_path)
    s.put_entry(7, 0, -1, b"live")
    s.put_entry(7, 1, 0, b"live!")
    _checkpoint(s)
    s.close()
    for p in (tmp_path / "entrylogs").glob("*.usage"):
        p.unlink()
    again = _storage(tmp_path)
    usage = again.log_usage(1)
    assert list(usage) == [7]
    assert (usage[7].bytes, usage[7].first, usage[7].last) == (2 * ENTRY_HEADER_SIZE + 9, 0, 1)
    assert (tmp_path / "entrylogs" / "00000001.usage").exists()  # written for next time
    assert again.collect_garbage() == []
    again.delete_ledger(7)
    _checkpoint(again)
    assert again.collect_garbage() == [1]
    again.close()


def test_delete_then_restart_does_not_resurrect(tmp_path: Path) -> None:
    """After the deletion's checkpoint, a restart knows nothing of the ledger."""
    s = _storage(tmp_path)
    s.put_entry(4, 0, -1, b"x")
    _checkpoint(s)
    s.delete_ledger(4)
    _checkpoint(s)
    s.close()
    again = _storage(tmp_path)
    assert again.state(4) is None
    assert again.read_entry(4, 0) is None
    again.close()


def test_a_wrong_index_record_is_detected(tmp_path: Path) -> None:
    """An index entry pointing at another entry's bytes raises instead of serving them."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"zero")
    s.put_entry(1, 1, 0, b"one!")
    _checkpoint(s)
    s.close()
    idx = tmp_path / "index" / "1.idx"
    with open(idx, "r+b") as f:
        f.seek(INDEX_HEADER_SIZE)
        rec0 = f.read(16)
        f.seek(INDEX_HEADER_SIZE + 16)
        f.write(rec0)  # entry 1 now points at entry 0's bytes
    again = _storage(tmp_path)
    assert INDEX_RECORD.unpack(rec0)[1] == 4
    with pytest.raises(StorageCorruptError):
        again.read_entry(1, 1)
    again.close()


def test_an_absurd_length_in_the_index_is_corruption_not_an_allocation(tmp_path: Path) -> None:
    """A damaged index record claiming gigabytes is reported without reading them."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"zero")
    _checkpoint(s)
    s.close()
    with open(tmp_path / "index" / "1.idx", "r+b") as f:
        f.seek(INDEX_HEADER_SIZE)
        log_id, _, offset = INDEX_RECORD.unpack(f.read(16))
        f.seek(INDEX_HEADER_SIZE)
        f.write(INDEX_RECORD.pack(log_id, 0xFFFFFFF0, offset))
    again = _storage(tmp_path, max_entry_size=1 << 20)
    with pytest.raises(StorageCorruptError, match="claims"):
        again.read_entry(1, 0)
    again.close()


def test_out_of_range_entry_ids_read_as_absent(tmp_path: Path) -> None:
    """Negative and huge entry ids never reach the index file."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"x")
    _checkpoint(s)
    assert s.read_entry(1, -1) is None
    assert s.read_entry(1, MAX_ENTRY_ID + 1) is None
    s.close()


def test_memory_holds_only_a_bounded_number_of_ledger_states(tmp_path: Path) -> None:
    """Clean ledger states are evicted past the bound and reload from disk on demand."""
    s = _storage(tmp_path, max_cached_states=10, max_open_files=4)
    for lid in range(40):
        s.put_entry(lid, 0, -1, b"v")
    _checkpoint(s)
    assert len(s._states) <= 10
    assert all(s.read_entry(lid, 0) == b"v" for lid in range(40))
    st = s.state(3)
    assert st is not None
    assert st.last_entry == 0
    assert len(s._index_fds) <= 4
    s.close()


def test_write_cache_accounts_bytes(tmp_path: Path) -> None:
    """The cache size follows puts, overwrites and deletes."""
    s = _storage(tmp_path)
    s.put_entry(1, 0, -1, b"1234")
    s.put_entry(1, 0, -1, b"12")
    s.put_entry(2, 0, -1, b"123")
    assert s.cache_bytes == 5
    s.delete_ledger(1)
    assert s.cache_bytes == 3
    s.close()


def test_index_files_are_small_for_dense_ledgers(tmp_path: Path) -> None:
    """The index of n entries takes a 32-byte header plus 16 bytes per entry."""
    s = _storage(tmp_path)
    for e in range(1000):
        s.put_entry(1, e, e - 1, b"")
    _checkpoint(s)
    assert os.path.getsize(tmp_path / "index" / "1.idx") == INDEX_HEADER_SIZE + 1000 * 16
    assert s.read_entry(1, 999) == b""
    s.close()


def test_put_entries_is_put_entry_for_a_group(tmp_path: Path) -> None:
    """A group put owns its bytes, replaces duplicates, and moves last entry and LAC up only."""
    s = _storage(tmp_path)
    s.put_entry(3, 5, 4, b"old")
    buffer = bytearray(b"aaabbbccc")
    s.put_entries(3, [(0, -1, memoryview(buffer)[0:3]), (1, 0, memoryview(buffer)[3:6])])
    s.put_entries(3, [(5, 2, memoryview(buffer)[6:9])])
    buffer[:] = b"zzzzzzzzz"  # the network buffer is reused: the cache kept copies
    assert [s.read_entry(3, e) for e in (0, 1, 5)] == [b"aaa", b"bbb", b"ccc"]
    assert s.cache_bytes == 9
    st = s.state(3)
    assert st is not None
    assert (st.last_entry, st.lac) == (5, 4)
    s.close()


def test_put_entries_keeps_views_only_of_a_frame_they_mostly_are(tmp_path: Path) -> None:
    """Views of one immutable frame the entries make most of are cached as they are (no copy
    on the reactor); views of a frame they are a small part of, or of a mutable buffer, are
    copied (a view would pin the rest). Reads return bytes, and a checkpoint writes both."""
    s = _storage(tmp_path)
    a, b = b"A" * VIEW_MIN_BYTES, b"B" * VIEW_MIN_BYTES
    frame = b"h" * 16 + a + b"h" * 16 + b
    view = memoryview(frame)
    s.put_entries(4, [(0, -1, view[16 : 16 + len(a)]), (1, 0, view[32 + len(a) :])])
    held = s._cache[4]
    assert isinstance(held[0], memoryview)
    assert held[0].obj is frame
    big_read = b"x" * 100_000 + b"C" * VIEW_MIN_BYTES
    s.put_entries(4, [(2, 1, memoryview(big_read)[100_000:])])
    assert type(held[2]) is bytes
    mutable = bytearray(b"D" * VIEW_MIN_BYTES)
    s.put_entries(4, [(3, 2, memoryview(mutable))])
    assert type(held[3]) is bytes
    expected = [a, b, b"C" * VIEW_MIN_BYTES, b"D" * VIEW_MIN_BYTES]
    assert [s.read_entry(4, e) for e in range(4)] == expected
    assert all(type(s.read_entry(4, e)) is bytes for e in range(4))
    assert s.cache_bytes == 4 * VIEW_MIN_BYTES
    _checkpoint(s)
    assert [s.read_entry(4, e) for e in range(4)] == expected
    s.close()


def test_small_entries_of_a_frame_are_copied_so_the_collector_does_not_track_them(
    tmp_path: Path,
) -> None:
    """Entries under VIEW_MIN_BYTES are cached as bytes even when they make up their whole
    frame: a cached view is an object every full collection walks, a copy is not."""
    s = _storage(tmp_path)
    frame = b"E" * 1024 * 64
    view = memoryview(frame)
    s.put_entries(5, [(e, e - 1, view[e * 1024 : (e + 1) * 1024]) for e in range(64)])
    held = s._cache[5]
    assert all(type(held[e]) is bytes for e in range(64))
    assert not any(gc.is_tracked(held[e]) for e in range(64))
    assert s.read_entry(5, 63) == b"E" * 1024
    assert s.cache_bytes == 64 * 1024
    _checkpoint(s)
    assert s.read_entry(5, 7) == b"E" * 1024
    s.close()


def test_checkpoint_syncs_entry_logs_as_it_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megabytes of entries are synced a chunk at a time, not all by the final fsync (a journal
    sync would otherwise wait behind them), and every entry reads back from its log."""
    s = _storage(tmp_path)
    blob = os.urandom(1000)
    for e in range(3000):  # about 3 MB
        s.put_entry(8, e, e - 1, blob[: 500 + e % 500])
    synced: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    _checkpoint(s)
    assert len(synced) >= 2
    assert all(s.read_entry(8, e) == blob[: 500 + e % 500] for e in range(3000))
    s.close()


def test_a_checkpoint_lays_out_ledgers_in_order_across_log_rolls(tmp_path: Path) -> None:
    """Several ledgers, entry ids with gaps, logs rolled mid-ledger and an entry larger than a
    log: each log holds whole records sorted by (ledger, entry), its usage counts what it holds
    of each ledger, and after a restart every entry reads back through the index."""
    limit = 6000
    s = _storage(tmp_path, entry_log_size_limit=limit)
    written: dict[tuple[int, int], bytes] = {}
    for ledger in (3, 1, 2):
        for e in [*range(0, 12), *range(15, 30), 40]:
            data = _data(ledger, e) * (1 + (e * ledger) % 40)
            s.put_entry(ledger, e, e - 1, data)
            written[ledger, e] = data
    big = os.urandom(limit + 100)
    s.put_entry(4, 0, -1, big)
    written[4, 0] = big
    s.put_entry(4, 1, 0, b"after the big one")
    written[4, 1] = b"after the big one"
    _checkpoint(s)
    laid_out: list[tuple[int, int]] = []
    for log_id in s.log_ids():
        raw = (tmp_path / "entrylogs" / f"{log_id:08x}.log").read_bytes()
        at = LOG_HEADER_SIZE
        held: dict[int, list[int]] = {}
        while at < len(raw):
            n, ledger, entry = ENTRY_HEADER.unpack_from(raw, at)
            assert (
                raw[at + ENTRY_HEADER_SIZE : at + ENTRY_HEADER_SIZE + n] == written[ledger, entry]
            )
            laid_out.append((ledger, entry))
            held.setdefault(ledger, [0, entry, entry])
            held[ledger][0] += ENTRY_HEADER_SIZE + n
            held[ledger][2] = entry
            at += ENTRY_HEADER_SIZE + n
        assert at == len(raw)
        assert len(raw) <= limit or held == {4: [ENTRY_HEADER_SIZE + len(big), 0, 0]}
        usage = s.log_usage(log_id)
        assert {k: [u.bytes, u.first, u.last] for k, u in usage.items()} == held
    assert laid_out == sorted(written)
    assert len(s.log_ids()) >= 5
    s.close()
    again = _storage(tmp_path, entry_log_size_limit=limit)
    assert all(again.read_entry(lid, e) == data for (lid, e), data in written.items())
    assert again.read_entry(1, 13) is None
    again.close()
