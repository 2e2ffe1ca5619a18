"""Managed cursors: acknowledgements, persistence and recovery, backlog, reads, moves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from twisted.internet.defer import fail

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger_client import Rig, failure_of, fired, result_of

from polybroker.ledger.api import (
    EARLIEST,
    InitialPosition,
    ManagedLedgerClosedError,
    ManagedLedgerError,
    ManagedLedgerFencedError,
    Position,
)
from polybroker.ledger.cursor import ManagedCursorImpl, cursor_path
from polybroker.metadata.api import StoreClosedError

NAME = "t/ns/persistent/topic"


def setup(n: int = 10, *, per_ledger: int = 4, **config: object):  # type: ignore[no-untyped-def]
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=per_ledger, **config)
    cursor = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    entries = rig.append(ml, *[b"m%d" % i for i in range(n)])
    return rig, ml, cursor, entries


def settle(rig: Rig) -> None:
    """Let throttled cursor writes happen."""
    rig.clock.advance(1)
    rig.clock.advance(1)


def stored(rig: Rig, cursor: str = "sub") -> dict[str, object]:
    return json.loads(result_of(rig.store.get(cursor_path(NAME, cursor))).value)


# -- acknowledgement ranges -------------------------------------------------------------------


def test_individual_deletes_merge_into_ranges() -> None:
    """Acknowledged positions above the mark-delete merge into closed ranges, across ledgers."""
    _rig, _ml, c, e = setup()
    c.delete([e[2].position, e[6].position, e[4].position])
    assert c.individually_deleted() == [
        (e[2].position, e[2].position),
        (e[4].position, e[4].position),
        (e[6].position, e[6].position),
    ]
    c.delete([e[3].position, e[5].position])  # e3..e5 spans a ledger boundary (4 per ledger)
    assert c.individually_deleted() == [(e[2].position, e[6].position)]
    assert c.mark_delete_position < e[0].position
    assert c.is_deleted(e[5].position)
    assert not c.is_deleted(e[1].position)
    assert not c.is_deleted(e[7].position)


def test_mark_delete_advances_over_contiguous_deleted_ranges() -> None:
    """Acknowledging the gap below a range moves the mark-delete to the range's end."""
    _rig, _ml, c, e = setup()
    c.delete([e[1].position, e[2].position, e[3].position, e[5].position])
    c.delete([e[0].position])
    assert c.mark_delete_position == e[3].position
    assert c.individually_deleted() == [(e[5].position, e[5].position)]
    c.mark_delete(e[4].position)
    assert c.mark_delete_position == e[5].position
    assert c.individually_deleted() == []


def test_mark_delete_never_moves_back_and_stops_at_the_last_entry() -> None:
    """A cumulative ack below the mark-delete changes nothing; one beyond the end is capped."""
    _rig, _ml, c, e = setup()
    c.mark_delete(e[5].position)
    c.mark_delete(e[2].position)
    assert c.mark_delete_position == e[5].position
    c.mark_delete(Position(e[-1].position.ledger_id + 50, 0))
    assert c.mark_delete_position == e[-1].position
    assert c.backlog_entries() == 0


def test_mark_delete_drops_ranges_it_covers() -> None:
    """A cumulative ack over part of a range keeps only the range's part above it."""
    _rig, _ml, c, e = setup()
    c.delete([e[3].position, e[4].position, e[5].position, e[8].position])
    c.mark_delete(e[4].position)
    assert c.mark_delete_position == e[5].position
    assert c.individually_deleted() == [(e[8].position, e[8].position)]


def test_deletes_of_unknown_or_acknowledged_positions_are_ignored() -> None:
    """Positions that are not entries of the log, or already acknowledged, change nothing."""
    _rig, _ml, c, e = setup()
    c.mark_delete(e[2].position)
    c.delete([e[1].position, Position(e[0].position.ledger_id, 99), Position(999, 0)])
    assert c.individually_deleted() == []
    assert c.backlog_entries() == 7


def test_reads_skip_acknowledged_entries() -> None:
    """A read returns only unacknowledged entries, in order, and advances past them."""
    _rig, _ml, c, e = setup()
    c.delete([e[1].position, e[2].position, e[5].position])
    got = result_of(c.read(4))
    assert [x.data for x in got] == [b"m0", b"m3", b"m4", b"m6"]
    assert c.read_position == e[7].position
    assert [x.data for x in result_of(c.read(10))] == [b"m7", b"m8", b"m9"]
    assert result_of(c.read(10)) == []


# -- persistence --------------------------------------------------------------------------------


def test_a_flood_of_acks_is_written_once_per_interval_and_acks_wait_for_it() -> None:
    """Acks coalesce: each Deferred fires only after a write holding it; one write per
    1/rate seconds, not one per ack."""
    rig, _ml, c, e = setup(cursor_mark_delete_rate_per_s=1.0)
    version = result_of(rig.store.get(cursor_path(NAME, "sub"))).stat.version
    ds = [c.delete([x.position]) for x in e[1:]]
    assert not any(fired(d) for d in ds)
    rig.clock.advance(0.5)
    assert not any(fired(d) for d in ds)
    rig.clock.advance(0.5)
    assert all(result_of(d) is None for d in ds)
    assert result_of(rig.store.get(cursor_path(NAME, "sub"))).stat.version == version + 1
    doc = stored(rig)
    first, last = e[1].position, e[-1].position
    assert doc["ranges"] == [[first.ledger_id, first.entry_id, last.ledger_id, last.entry_id]]


def test_an_ack_already_durable_fires_at_once() -> None:
    """Acknowledging what is acknowledged and persisted needs no write."""
    rig, _ml, c, e = setup()
    d = c.mark_delete(e[3].position)
    settle(rig)
    assert fired(d)
    assert fired(c.mark_delete(e[1].position))


def test_cursor_state_is_recovered_by_the_next_owner() -> None:
    """After a restart the cursor resumes after the mark-delete, skipping individually
    deleted entries."""
    rig, _ml, c, e = setup()
    c.mark_delete(e[1].position)
    c.delete([e[3].position, e[4].position, e[7].position])
    settle(rig)
    ml2 = rig.new_owner().open(max_entries_per_ledger=4)
    c2 = ml2.cursors["sub"]
    assert c2.durable
    assert c2.mark_delete_position == e[1].position
    assert c2.individually_deleted() == [
        (e[3].position, e[4].position),
        (e[7].position, e[7].position),
    ]
    assert [x.data for x in result_of(c2.read(10))] == [b"m2", b"m5", b"m6", b"m8", b"m9"]
    assert c2.backlog_entries() == 5


def test_acks_not_yet_persisted_come_again_after_a_crash() -> None:
    """Within the throttle window a crash loses acks (at-least-once), never unacked data."""
    rig, _ml, c, e = setup()
    durable = c.mark_delete(e[2].position)
    rig.clock.advance(1)
    assert fired(durable)
    later = c.mark_delete(e[6].position)  # due a second after the last write: the owner dies
    assert not fired(later)
    ml2 = rig.new_owner().open(max_entries_per_ledger=4)
    assert ml2.cursors["sub"].mark_delete_position == e[2].position


def test_close_flushes_at_once() -> None:
    """Closing a cursor writes its state now, whatever the rate limit."""
    rig, ml, c, e = setup(cursor_mark_delete_rate_per_s=0.001)
    settle(rig)
    c.mark_delete(e[4].position)
    result_of(c.close())
    assert stored(rig)["md"] == [e[4].position.ledger_id, e[4].position.entry_id]
    assert "sub" not in ml.cursors
    again = result_of(ml.open_cursor("sub"))
    assert again is not c
    assert again.mark_delete_position == e[4].position
    assert isinstance(failure_of(c.read(1)), ManagedLedgerClosedError)


def test_ranges_persisted_are_bounded() -> None:
    """Only the lowest max_unacked_ranges_to_persist ranges are written."""
    rig, _ml, c, e = setup(20, per_ledger=100, max_unacked_ranges_to_persist=3)
    c.delete([x.position for x in e[1::2]])
    settle(rig)
    assert len(stored(rig)["ranges"]) == 3
    assert len(c.individually_deleted()) == 10


def test_lost_cursor_cas_means_another_owner() -> None:
    """If another owner wrote the cursor, this one's acks fail with ManagedLedgerFencedError."""
    rig, _ml, c, e = setup()
    path = cursor_path(NAME, "sub")
    node = result_of(rig.store.get(path))
    result_of(rig.store.put(path, node.value, node.stat.version))
    d = c.mark_delete(e[1].position)
    settle(rig)
    assert isinstance(failure_of(d), ManagedLedgerFencedError)
    assert isinstance(failure_of(c.mark_delete(e[2].position)), ManagedLedgerFencedError)


def test_reset_moves_back_and_is_persisted() -> None:
    """reset makes a position the next read, moving the mark-delete back and clearing ranges."""
    rig, _ml, c, e = setup()
    c.mark_delete(e[6].position)
    c.delete([e[8].position])
    result_of(c.read(10))
    d = c.reset(e[2].position)
    settle(rig)
    assert fired(d)
    assert c.mark_delete_position == e[1].position
    assert c.individually_deleted() == []
    assert c.read_position == e[2].position
    assert c.backlog_entries() == 8
    assert stored(rig)["md"] == [e[1].position.ledger_id, e[1].position.entry_id]


def test_reset_past_the_end_reads_only_new_entries() -> None:
    """Resetting to the position after the last entry leaves nothing to read until appends."""
    _rig, ml, c, _e = setup()
    last = ml.last_confirmed
    c.reset(Position(last.ledger_id, last.entry_id + 1))
    assert c.backlog_entries() == 0
    assert result_of(c.read(5)) == []
    new = result_of(ml.append(b"new"))
    assert result_of(c.read(5)) == [new]


def test_seek_moves_only_the_read_position() -> None:
    """seek rereads from a position without changing acknowledgements (not below mark-delete)."""
    _rig, _ml, c, e = setup()
    c.mark_delete(e[1].position)
    c.delete([e[3].position])
    result_of(c.read(10))
    c.seek(e[0].position)
    assert c.read_position == e[2].position
    assert [x.data for x in result_of(c.read(3))] == [b"m2", b"m4", b"m5"]
    assert c.mark_delete_position == e[1].position


# -- backlog --------------------------------------------------------------------------------


def test_backlog_counts_messages_and_entries() -> None:
    """backlog counts messages of unacknowledged entries; backlog_entries counts entries."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=3)
    c = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    entries = [result_of(ml.append(b"x", n)) for n in (1, 5, 2, 3, 1, 4)]
    assert (c.backlog(), c.backlog_entries()) == (16, 6)
    c.delete([entries[1].position, entries[3].position])
    assert (c.backlog(), c.backlog_entries()) == (8, 4)
    c.mark_delete(entries[2].position)
    assert (c.backlog(), c.backlog_entries()) == (5, 2)
    result_of(c.read(10))  # reading does not acknowledge
    assert c.backlog_entries() == 2


def test_backlog_of_batches_is_exact_after_a_restart_for_single_messages() -> None:
    """After a restart the backlog counts are exact for entries of one message each."""
    rig, _ml, c, e = setup()
    c.delete([e[3].position])
    settle(rig)
    ml2 = rig.new_owner().open(max_entries_per_ledger=4)
    c2 = ml2.cursors["sub"]
    assert (c2.backlog(), c2.backlog_entries()) == (9, 9)


def test_open_cursor_latest_and_earliest_and_existing() -> None:
    """A new cursor starts at the end (LATEST) or the beginning (EARLIEST); an existing one
    keeps its position whatever is asked."""
    _rig, ml, c, e = setup()
    latest = result_of(ml.open_cursor("late"))
    assert latest.backlog_entries() == 0
    assert latest.mark_delete_position == e[-1].position
    c.mark_delete(e[3].position)
    same = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    assert same is c
    assert same.backlog_entries() == 6


def test_delete_cursor_removes_its_state() -> None:
    """A deleted cursor is gone from the log and the store; its waiting read gets []."""
    rig, ml, c, _e = setup()
    result_of(c.read(100))
    waiting = c.read(1, wait=True)
    result_of(ml.delete_cursor("sub"))
    assert result_of(waiting) == []
    assert "sub" not in ml.cursors
    assert result_of(rig.store.get(cursor_path(NAME, "sub"))) is None
    result_of(ml.delete_cursor("nope"))  # idempotent, as the broker may retry
    ml2 = rig.new_owner().open(max_entries_per_ledger=4)
    assert "sub" not in ml2.cursors


# -- non-durable cursors ------------------------------------------------------------------


def test_non_durable_cursor_starts_after_the_given_position_and_is_not_persisted() -> None:
    """A reader reads from the entry after its start; it writes nothing to the store."""
    rig, ml, _c, e = setup()
    reader = ml.new_non_durable_cursor(e[4].position)
    assert not reader.durable
    assert [x.data for x in result_of(reader.read(2))] == [b"m5", b"m6"]
    beginning = ml.new_non_durable_cursor(EARLIEST, "from-start")
    assert result_of(beginning.read(1))[0].data == b"m0"
    assert "from-start" in ml.cursors
    d = reader.mark_delete(e[8].position)
    assert fired(d)
    assert result_of(rig.store.children(f"/managed-ledgers/{NAME}/cursors")) == ["sub"]
    result_of(reader.close())
    assert reader.name not in ml.cursors


def test_non_durable_cursor_does_not_hold_ledgers() -> None:
    """Only durable cursors keep consumed ledgers from deletion."""
    rig, ml, c, e = setup(retention_time_s=0)
    reader = ml.new_non_durable_cursor(EARLIEST)
    c.mark_delete(e[-1].position)
    settle(rig)
    assert e[0].position.ledger_id not in rig.client.ledgers
    # The reader skips what is gone and goes on with what is stored.
    got = result_of(reader.read(100))
    assert [x.data for x in got] == [b"m8", b"m9"]


# -- waiting reads ----------------------------------------------------------------------------


def test_waiting_read_fires_on_the_next_append() -> None:
    """read(wait=True) with nothing to read parks until an entry is appended."""
    _rig, ml, c, _e = setup()
    result_of(c.read(100))
    d = c.read(5, wait=True)
    assert not fired(d)
    new = result_of(ml.append(b"tail"))
    assert result_of(d) == [new]
    assert c.read_position > new.position


def test_cancel_pending_read_fires_with_nothing() -> None:
    """cancel_pending_read answers a parked read with [] and the next append is not lost."""
    _rig, ml, c, _e = setup()
    result_of(c.read(100))
    d = c.read(5, wait=True)
    c.cancel_pending_read()
    assert result_of(d) == []
    new = result_of(ml.append(b"x"))
    assert result_of(c.read(5)) == [new]


def test_close_answers_a_waiting_read() -> None:
    """Closing a cursor fires its waiting read with []."""
    _rig, _ml, c, _e = setup()
    result_of(c.read(100))
    d = c.read(5, wait=True)
    result_of(c.close())
    assert result_of(d) == []


def test_one_read_at_a_time() -> None:
    """A second read while one is parked is refused."""
    _rig, _ml, c, _e = setup()
    result_of(c.read(100))
    c.read(1, wait=True)
    assert isinstance(failure_of(c.read(1)), ManagedLedgerError)


def test_seek_back_wakes_a_waiting_read() -> None:
    """A parked read answers at once when a seek makes entries readable again."""
    _rig, _ml, c, e = setup()
    result_of(c.read(100))
    d = c.read(2, wait=True)
    c.seek(e[7].position)
    assert [x.data for x in result_of(d)] == [b"m7", b"m8"]


def test_recover_rejects_garbage_state() -> None:
    """Unreadable persisted cursor state is reported, not guessed."""
    _rig, ml, _c, _e = setup()
    for garbage in (b'{"x": 1}', b"not json", b'{"name": "a", "md": [1]}', b"[]"):
        with pytest.raises(ManagedLedgerError, match="unreadable"):
            ManagedCursorImpl.recover(ml, garbage, 0)
    bad_ranges = b'{"name": "a", "md": [1, 0], "ranges": [[1, "x"]]}'
    with pytest.raises(ManagedLedgerError, match="unreadable"):
        ManagedCursorImpl.recover(ml, bad_ranges, 0)


def test_cursors_of_a_fenced_log_write_nothing() -> None:
    """Once another owner took the log, the old owner's acks fail instead of overwriting the
    new owner's cursor state."""
    rig, ml, c, e = setup()
    rig.new_owner().open(max_entries_per_ledger=4)
    failure_of(ml.append(b"x"))  # the old owner learns it was fenced
    assert ml.fenced
    assert isinstance(failure_of(c.mark_delete(e[5].position)), ManagedLedgerFencedError)
    settle(rig)
    assert stored(rig)["md"] != [e[5].position.ledger_id, e[5].position.entry_id]


def test_persisted_mark_delete_lags_until_the_write() -> None:
    """persisted_mark_delete_position shows what a restart would resume after."""
    rig, _ml, c, e = setup()
    c.mark_delete(e[1].position)
    rig.clock.advance(1)
    assert c.persisted_mark_delete_position == e[1].position
    c.mark_delete(e[5].position)
    assert c.mark_delete_position == e[5].position
    assert c.persisted_mark_delete_position == e[1].position
    rig.clock.advance(1)
    assert c.persisted_mark_delete_position == e[5].position


def test_a_failed_state_write_is_retried_later() -> None:
    """A store error fails the acks waiting on that write; the state is written again a
    moment later, without spinning."""
    rig, _ml, c, e = setup(cursor_mark_delete_rate_per_s=0)
    real_put = rig.store.put
    failures = [1]

    def flaky_put(path: str, value: bytes, expected_version: int | None = None, **kw: object):  # type: ignore[no-untyped-def]
        if failures[0]:
            failures[0] -= 1
            return fail(StoreClosedError("store down"))
        return real_put(path, value, expected_version, **kw)  # type: ignore[arg-type]

    rig.store.put = flaky_put  # type: ignore[method-assign]
    d = c.mark_delete(e[3].position)
    assert isinstance(failure_of(d), StoreClosedError)
    assert stored(rig)["md"] != [e[3].position.ledger_id, e[3].position.entry_id]
    rig.clock.advance(1)
    assert stored(rig)["md"] == [e[3].position.ledger_id, e[3].position.entry_id]
    assert c.persisted_mark_delete_position == e[3].position
