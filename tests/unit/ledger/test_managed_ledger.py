"""Managed ledger over the fake ledger client: appends, rollover, failures, recovery, lookups."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred, fail

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger_client import Rig, failure_of, fired, result_of

from polybroker.ledger import entry_format
from polybroker.ledger.api import (
    BookieError,
    Entry,
    InitialPosition,
    LedgerState,
    ManagedLedgerClosedError,
    ManagedLedgerFencedError,
    ManagedLedgerTerminatedError,
    Position,
)
from polybroker.metadata.api import StoreClosedError

NAME = "t/ns/persistent/topic"


def payloads(n: int, start: int = 0) -> list[bytes]:
    return [b"m%d" % i for i in range(start, start + n)]


def read_all(ml, start: Position | None = None) -> list[Entry]:  # type: ignore[no-untyped-def]
    return result_of(ml.read(start or ml.first_position, 10_000))


# -- appends ----------------------------------------------------------------------------------


def test_appends_complete_in_order_with_dense_indexes() -> None:
    """Entries get consecutive positions and indexes that count messages, not entries."""
    rig = Rig()
    ml = rig.open()
    a = result_of(ml.append(b"a", 1))
    b = result_of(ml.append(b"b", 5))
    c = result_of(ml.append(b"c", 2))
    assert [e.position.entry_id for e in (a, b, c)] == [0, 1, 2]
    assert [e.index for e in (a, b, c)] == [0, 1, 6]
    assert ml.next_index == 8
    assert ml.entries == 3
    assert ml.last_confirmed == c.position


def test_a_group_of_completions_wakes_a_tailing_read_once_with_all_of_it() -> None:
    """Adds the bookies confirm together reach a waiting cursor in one read, not one each."""
    rig = Rig()
    ml = rig.open()
    cursor = result_of(ml.open_cursor("c"))
    rig.client.hold = True
    read = cursor.read(100, wait=True)
    appends = [ml.append(p) for p in payloads(5)]
    assert not read.called
    list(rig.client.writers.values())[-1].release()
    assert [e.data for e in result_of(read)] == payloads(5)
    assert all(fired(d) for d in appends)


def test_appends_complete_in_order_when_the_ledger_answers_late() -> None:
    """Adds answered after a delay still complete in append order, once each."""
    rig = Rig(add_delay=0.005)
    ml = rig.open()
    done: list[bytes] = []
    ds = [ml.append(p).addCallback(lambda e: done.append(e.data) or e) for p in payloads(20)]
    assert not any(fired(d) for d in ds)
    rig.clock.advance(0.01)
    assert done == payloads(20)


class _Calls:
    """Records what ``append_then`` tells, in order: ("done", token, entry) or ("failed", ...)."""

    def __init__(self) -> None:
        self.told: list[tuple[str, object, object]] = []

    def done(self, entry: Entry, token: object) -> None:
        self.told.append(("done", token, entry))

    def failed(self, error: Exception, token: object) -> None:
        self.told.append(("failed", token, error))


def test_append_then_completes_in_order_with_what_append_would_fire() -> None:
    """Callback-style appends interleaved with Deferred ones: one call each, in append order,
    with the same entries (positions, indexes) the Deferred appends get."""
    rig = Rig(add_delay=0.005)
    ml = rig.open()
    calls = _Calls()
    order: list[object] = []
    ml.append_then(b"a", lambda e, t: order.append(t), calls.failed, "a", 2)
    d = ml.append(b"b").addCallback(lambda e: order.append("b") or e)
    ml.append_then(b"c", lambda e, t: (order.append(t), calls.done(e, t)), calls.failed, "c")
    assert order == []
    rig.clock.advance(0.01)
    assert order == ["a", "b", "c"]
    assert result_of(d).index == 2
    [(kind, token, entry)] = calls.told
    assert (kind, token) == ("done", "c")
    assert isinstance(entry, Entry)
    assert (entry.data, entry.index, entry.position.entry_id) == (b"c", 3, 2)
    assert [e.data for e in read_all(ml)] == [b"a", b"b", b"c"]


def test_append_then_refused_at_once_calls_on_failed_before_returning() -> None:
    """A bad message count or a closed log: on_failed is called before append_then returns,
    and on_done never."""
    ml = Rig().open()
    calls = _Calls()
    ml.append_then(b"x", calls.done, calls.failed, 1, 0)
    assert [(k, t, type(e)) for k, t, e in calls.told] == [("failed", 1, ValueError)]
    result_of(ml.close())
    ml.append_then(b"y", calls.done, calls.failed, 2)
    assert [(k, t, type(e)) for k, t, e in calls.told[1:]] == [
        ("failed", 2, ManagedLedgerClosedError)
    ]


def test_append_then_failure_reaches_the_caller() -> None:
    """A fenced ledger fails a pending callback-style append through on_failed, once."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    calls = _Calls()
    ml.append_then(b"x", calls.done, calls.failed, "x")
    result_of(rig.client.open(ml.ledgers[-1].ledger_id, recovery=True))
    assert [(k, t, type(e)) for k, t, e in calls.told] == [
        ("failed", "x", ManagedLedgerFencedError)
    ]


def test_append_then_resent_after_a_ledger_failure_completes_once() -> None:
    """Callback-style appends pending on a failed ledger go to the next one and complete
    once each, in order, with their indexes."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    calls = _Calls()
    for i, p in enumerate(payloads(4)):
        ml.append_then(p, calls.done, calls.failed, i)
    first = ml.ledgers[-1].ledger_id
    rig.client.writer(first).release(1)
    rig.client.fail_pending(first)
    rig.client.release()
    assert [(k, t) for k, t, _ in calls.told] == [("done", i) for i in range(4)]
    assert [e.index for _, _, e in calls.told] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert [e.data for e in read_all(ml)] == payloads(4)


def test_a_raising_append_callback_does_not_stop_the_completions_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A caller's on_done that raises is logged; the appends after it still complete."""
    rig = Rig(add_delay=0.001)
    ml = rig.open()
    calls = _Calls()

    def boom(entry: Entry, token: object) -> None:
        raise RuntimeError("caller bug")

    ml.append_then(b"a", boom, calls.failed, "a")
    ml.append_then(b"b", calls.done, calls.failed, "b")
    d = ml.append(b"c")
    rig.clock.advance(0.01)
    assert [(k, t) for k, t, _ in calls.told] == [("done", "b")]
    assert result_of(d).data == b"c"
    assert "append callback failed" in caplog.text


def test_the_api_default_append_then_rides_on_append() -> None:
    """A ManagedLedger without its own append_then gets one from append: the same calls."""
    from polybroker.ledger.api import ManagedLedger

    ml = Rig().open()
    calls = _Calls()
    ManagedLedger.append_then(ml, b"a", calls.done, calls.failed, "a", 3)
    ManagedLedger.append_then(ml, b"b", calls.done, calls.failed, "b", 0)
    assert [(k, t) for k, t, _ in calls.told] == [("done", "a"), ("failed", "b")]
    assert calls.told[0][2].num_messages == 3  # type: ignore[attr-defined]
    assert isinstance(calls.told[1][2], ValueError)


def test_each_stored_entry_carries_its_broker_metadata_header() -> None:
    """The ledger holds header + data; the header has the publish time, index and count."""
    rig = Rig()
    ml = rig.open()
    rig.clock.advance(12.5)
    result_of(ml.append(b"x", 3))
    entry = result_of(ml.append(b"payload", 4, publish_time_ms=777))
    raw = rig.client.confirmed(entry.position.ledger_id)[1]
    header, data = entry_format.decode(raw)
    assert data == b"payload"
    assert header == entry_format.EntryHeader(777, 3, 4)
    first = entry_format.decode_header(rig.client.confirmed(entry.position.ledger_id)[0])
    assert first.publish_time_ms == 12_500


def test_read_returns_entries_from_a_position_across_ledgers() -> None:
    """``read`` starts at the given position and crosses ledger boundaries in order."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=3)
    entries = rig.append(ml, *payloads(8))
    got = result_of(ml.read(entries[2].position, 4))
    assert [e.data for e in got] == payloads(4, 2)
    assert got == entries[2:6]


def test_bad_num_messages_is_refused() -> None:
    """An entry must hold at least one message."""
    ml = Rig().open()
    assert isinstance(failure_of(ml.append(b"x", 0)), ValueError)


# -- rollover ---------------------------------------------------------------------------------


def test_rollover_by_entries() -> None:
    """A ledger takes at most max_entries_per_ledger entries; the next starts a new ledger."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=4)
    entries = rig.append(ml, *payloads(10))
    ids = sorted({e.position.ledger_id for e in entries})
    assert len(ids) == 3
    assert [info.entries for info in ml.ledgers[:3]] == [4, 4, 2]
    assert [info.first_index for info in ml.ledgers[:3]] == [0, 4, 8]
    assert [e.data for e in read_all(ml)] == payloads(10)
    # The full ledgers were closed, not abandoned.
    assert rig.client.ledgers[ids[0]].state is LedgerState.CLOSED


def test_rollover_by_size() -> None:
    """A ledger that reached max_size_per_ledger_bytes is followed by a new one."""
    rig = Rig()
    ml = rig.open(max_size_per_ledger_bytes=100)
    entries = rig.append(ml, *[b"x" * 60 for _ in range(4)])
    assert [e.position.entry_id for e in entries] == [0, 1, 0, 1]
    assert entries[0].position.ledger_id != entries[2].position.ledger_id


def test_rollover_waits_for_min_rollover_time() -> None:
    """A full ledger younger than min_ledger_rollover_time_s keeps taking entries."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2, min_ledger_rollover_time_s=60)
    entries = rig.append(ml, *payloads(5))
    assert {e.position.ledger_id for e in entries} == {entries[0].position.ledger_id}
    rig.clock.advance(61)
    later = result_of(ml.append(b"late"))
    assert later.position.ledger_id != entries[0].position.ledger_id


def test_rollover_by_time_of_a_ledger_with_entries() -> None:
    """After max_ledger_rollover_time_s a ledger with entries is closed and a new one made;
    an empty ledger is left alone."""
    rig = Rig()
    ml = rig.open(max_ledger_rollover_time_s=100)
    first = ml.ledgers[-1].ledger_id
    rig.clock.advance(150)
    assert ml.ledgers[-1].ledger_id == first  # empty: kept
    e = result_of(ml.append(b"a"))
    assert e.position.ledger_id == first
    rig.clock.advance(101)
    assert ml.ledgers[-1].ledger_id != first
    assert rig.client.ledgers[first].state is LedgerState.CLOSED
    assert result_of(ml.append(b"b")).position.ledger_id == ml.ledgers[-1].ledger_id


def test_rollover_waits_for_pending_adds_and_keeps_order() -> None:
    """While adds are pending on a full ledger, new appends queue; after the pending ones
    complete, the ledger closes and the queued ones go to the next ledger, in order."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2)
    rig.client.hold = True
    ds = [ml.append(p) for p in payloads(5)]
    first = ml.ledgers[-1].ledger_id
    assert len(rig.client.ledgers[first].entries) == 2  # the rest waits
    rig.client.writer(first).release()
    rig.client.release()  # second ledger's two
    rig.client.release()  # third ledger's one
    got = [result_of(d) for d in ds]
    assert [e.data for e in got] == payloads(5)
    assert [e.index for e in got] == [0, 1, 2, 3, 4]
    assert [e.position.entry_id for e in got] == [0, 1, 0, 1, 0]
    assert len({e.position.ledger_id for e in got}) == 3


# -- failures ---------------------------------------------------------------------------------


def test_failed_ledger_resends_pending_appends_to_a_new_ledger_in_order() -> None:
    """A ledger failure moves the unconfirmed appends, in order and with the same indexes,
    to a new ledger; nothing is lost or reordered and the old ledger keeps what it confirmed."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    ds = [ml.append(p) for p in payloads(6)]
    first = ml.ledgers[-1].ledger_id
    rig.client.writer(first).release(2)
    rig.client.fail_pending(first)
    later = ml.append(b"m6")
    rig.client.release()
    got = [result_of(d) for d in [*ds, later]]
    assert [e.data for e in got] == payloads(7)
    assert [e.index for e in got] == list(range(7))
    assert [e.position.ledger_id for e in got[:2]] == [first, first]
    assert {e.position.ledger_id for e in got[2:]} == {ml.ledgers[-1].ledger_id}
    assert [i.entries for i in ml.ledgers] == [2, 5]
    assert [e.data for e in read_all(ml)] == payloads(7)


def test_injected_add_failure_mid_stream_loses_nothing() -> None:
    """An add that fails while others complete: every append still completes, in order."""
    rig = Rig(add_delay=0.001)
    ml = rig.open()
    rig.client.fail_appends_after = 3
    ds = [ml.append(p) for p in payloads(8)]
    rig.clock.advance(0.01)
    rig.clock.advance(0.01)
    got = [result_of(d) for d in ds]
    assert [e.data for e in got] == payloads(8)
    assert [e.index for e in got] == list(range(8))
    assert [e.data for e in read_all(ml)] == payloads(8)


def test_no_new_ledger_fails_appends_cleanly_and_the_next_append_retries() -> None:
    """If no ledger can be created, pending appends fail (none is silently dropped) and the
    log recovers on the next append with the index where it left off."""
    rig = Rig()
    ml = rig.open()
    result_of(ml.append(b"ok"))
    rig.client.hold = True
    d = ml.append(b"lost")
    rig.client.fail_creates = 1
    rig.client.fail_pending(ml.ledgers[-1].ledger_id)
    assert isinstance(failure_of(d), BookieError)
    rig.client.hold = False
    e = result_of(ml.append(b"next"))
    assert e.index == 1
    assert [x.data for x in read_all(ml)] == [b"ok", b"next"]


def test_ledgers_that_refuse_every_add_are_not_made_and_failed_in_a_loop() -> None:
    """Bookies that take ledgers but refuse every add: after a second new ledger in a row
    fails before confirming anything, what waits fails (as when no ledger can be made) and
    each later append tries one more ledger; nothing confirmed before is lost."""
    rig = Rig()
    ml = rig.open()
    result_of(ml.append(b"ok"))
    rig.client.fail_all_adds = True
    creates = rig.client.creates
    ds = [ml.append(p) for p in payloads(5)]
    assert all(isinstance(failure_of(d), BookieError) for d in ds)
    assert rig.client.creates - creates == 2 + 4  # two for the first, one for each later
    again = ml.append(b"again")
    assert isinstance(failure_of(again), BookieError)
    assert rig.client.creates - creates == 7
    rig.client.fail_all_adds = False
    assert result_of(ml.append(b"fine")).index == 1
    assert [e.data for e in read_all(ml)] == [b"ok", b"fine"]


def test_appends_failing_for_want_of_a_ledger_warn_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every append retries the ledger creation; while it keeps failing the same way, the
    warning is logged once per 30 s with the count of the repeats, not once per append."""
    rig = Rig()
    ml = rig.open()
    result_of(ml.append(b"ok"))
    rig.client.fail_creates = 1000
    rig.client.hold = True
    d = ml.append(b"lost")
    rig.client.fail_pending(ml.ledgers[-1].ledger_id)
    assert isinstance(failure_of(d), BookieError)
    rig.client.hold = False
    with caplog.at_level("WARNING", logger="polybroker.ledger.managed"):
        for _ in range(50):
            assert isinstance(failure_of(ml.append(b"x")), BookieError)
        rig.clock.advance(31)
        assert isinstance(failure_of(ml.append(b"x")), BookieError)
    said = [r.getMessage() for r in caplog.records if "no ledger" in r.getMessage()]
    assert len(said) == 2, said
    assert said[1].endswith("(and 50 times more)")
    rig.client.fail_creates = 0
    assert result_of(ml.append(b"next")).index == 1


def test_fenced_ledger_fences_the_managed_ledger() -> None:
    """A fenced add means another owner: pending and later appends fail with
    ManagedLedgerFencedError."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    d = ml.append(b"x")
    result_of(rig.client.open(ml.ledgers[-1].ledger_id, recovery=True))
    assert isinstance(failure_of(d), ManagedLedgerFencedError)
    assert isinstance(failure_of(ml.append(b"y")), ManagedLedgerFencedError)
    assert ml.fenced


def test_metadata_cas_conflict_fences_the_log() -> None:
    """When another writer changed the ledger list, the next list update fails its CAS and
    the log stops with ManagedLedgerFencedError."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2)
    path = f"/managed-ledgers/{NAME}"
    node = result_of(rig.store.get(path))
    result_of(rig.store.put(path, node.value, node.stat.version))
    result_of(ml.append(b"a"))
    d = ml.append(b"b")  # fills the ledger: the rollover's CAS fails
    assert fired(d)
    e = failure_of(ml.append(b"c"))
    assert isinstance(e, ManagedLedgerFencedError)


def test_reopen_after_crash_recovers_and_fences_the_old_writer() -> None:
    """A new owner recovers the last ledger (fencing it) and appends after the old entries;
    the old owner's appends then fail and it can change nothing."""
    rig = Rig()
    old = rig.open()
    rig.append(old, *payloads(3))
    owner = rig.new_owner()
    new = owner.open()
    assert new.next_index == 3
    assert [e.data for e in read_all(new)] == payloads(3)
    e = result_of(new.append(b"m3"))
    assert e.index == 3
    assert isinstance(failure_of(old.append(b"stale")), ManagedLedgerFencedError)
    assert [x.data for x in read_all(new)] == payloads(4)
    assert (old.ledgers[0].ledger_id, True) in owner.client.opens


def test_reopen_recovers_entries_of_a_ledger_never_closed() -> None:
    """Entries confirmed to a crashed owner are all found by the next owner, with their
    lookups (time, index) intact."""
    rig = Rig()
    old = rig.open()
    for i, p in enumerate(payloads(5)):
        result_of(old.append(p, 2, publish_time_ms=1000 + i))
    new = rig.new_owner().open()
    assert new.next_index == 10
    info = new.ledgers[0]
    assert (info.entries, info.messages, info.first_publish_time_ms) == (5, 10, 1000)
    assert info.last_publish_time_ms == 1004
    assert result_of(new.position_of_index(7)) == Position(info.ledger_id, 3)
    assert result_of(new.position_of_time(1003)) == Position(info.ledger_id, 3)


def test_reopen_drops_an_empty_last_ledger() -> None:
    """A last ledger with no entries is removed from the list and deleted on recovery."""
    rig = Rig()
    old = rig.open()
    rig.append(old, *payloads(2))
    empty_owner = rig.new_owner()
    mid = empty_owner.open()
    empty = mid.ledgers[-1].ledger_id
    third_owner = rig.new_owner()
    third = third_owner.open()
    assert empty not in [i.ledger_id for i in third.ledgers]
    assert empty in third_owner.client.deleted
    assert [e.data for e in read_all(third)] == payloads(2)


def test_clean_close_and_reopen_needs_no_recovery() -> None:
    """After close, the last ledger is recorded as sealed; reopening reads nothing to find
    its end and continues the indexes."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=3)
    rig.append(ml, *payloads(7))
    result_of(ml.close())
    assert isinstance(failure_of(ml.append(b"x")), ManagedLedgerClosedError)
    reads = rig.client.reads
    again = rig.open(max_entries_per_ledger=3)
    assert rig.client.reads == reads
    assert again is not ml
    assert again.next_index == 7
    assert result_of(again.append(b"m7")).index == 7
    assert [e.data for e in read_all(again)] == payloads(8)


def test_factory_opens_a_log_once() -> None:
    """Two opens of one name give the same instance, even while the first is in progress."""
    rig = Rig()
    d1 = rig.factory.open(NAME)
    d2 = rig.factory.open(NAME)
    assert result_of(d1) is result_of(d2)
    assert rig.client.creates == 1


# -- lookups ----------------------------------------------------------------------------------


def _batched_log(rig: Rig, **config: object):  # type: ignore[no-untyped-def]
    """Twelve entries of 1..3 messages, times 100 ms apart, over ledgers of 4 entries."""
    ml = rig.open(max_entries_per_ledger=4, **config)
    entries = []
    for i in range(12):
        d = ml.append(b"e%d" % i, i % 3 + 1, publish_time_ms=10_000 + 100 * i)
        entries.append(result_of(d))
    return ml, entries


@pytest.mark.parametrize("reopened", [False, True])
def test_index_and_position_lookups_are_exact_across_ledgers(reopened: bool) -> None:
    """position_of_index finds the entry holding each message; index_of_position is its
    inverse; both also after a restart (lookups then read entries, O(log n) of them)."""
    rig = Rig()
    ml, entries = _batched_log(rig)
    if reopened:
        result_of(ml.close())
        ml = rig.new_owner().open(max_entries_per_ledger=4)
    for e in entries:
        assert result_of(ml.index_of_position(e.position)) == e.index
        for index in range(e.index, e.last_index + 1):
            assert result_of(ml.position_of_index(index)) == e.position
    assert result_of(ml.position_of_index(ml.next_index)) is None
    assert result_of(ml.position_of_index(-1)) is None


def test_index_lookup_after_restart_reads_logarithmically_many_entries() -> None:
    """A lookup in a recovered ledger of batches reads O(log n) entries, not the ledger."""
    rig = Rig()
    ml = rig.open()
    for i in range(1000):
        result_of(ml.append(b"x", 1 + i % 2))
    result_of(ml.close())
    again = rig.new_owner()
    ml2 = again.open()
    before = again.client.entries_read
    position = result_of(ml2.position_of_index(1234))
    assert position is not None
    assert again.client.entries_read - before <= 12
    entry = result_of(ml2.read(position, 1))[0]
    assert entry.index <= 1234 <= entry.last_index


@pytest.mark.parametrize("reopened", [False, True])
def test_time_lookup_finds_the_first_entry_at_or_after(reopened: bool) -> None:
    """position_of_time returns the first entry published at or after the time."""
    rig = Rig()
    ml, entries = _batched_log(rig)
    if reopened:
        result_of(ml.close())
        ml = rig.new_owner().open(max_entries_per_ledger=4)
    assert result_of(ml.position_of_time(0)) == entries[0].position
    assert result_of(ml.position_of_time(10_500)) == entries[5].position
    assert result_of(ml.position_of_time(10_450)) == entries[5].position
    assert result_of(ml.position_of_time(11_100)) == entries[11].position
    assert result_of(ml.position_of_time(11_101)) is None


# -- consumed ledgers, terminate, delete, factory ---------------------------------------------


def test_consumed_ledgers_are_deleted_but_never_the_current_one() -> None:
    """Once every durable cursor passed a ledger, it leaves the list and the client."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2, retention_time_s=0)
    a = result_of(ml.open_cursor("a", InitialPosition.EARLIEST))
    b = result_of(ml.open_cursor("b", InitialPosition.EARLIEST))
    entries = rig.append(ml, *payloads(6))
    first = entries[0].position.ledger_id
    a.mark_delete(entries[5].position)
    rig.clock.advance(1)
    assert first in rig.client.ledgers  # b still needs it
    b.mark_delete(entries[2].position)
    rig.clock.advance(1)
    assert first not in rig.client.ledgers
    assert first in rig.client.deleted
    assert ml.ledgers[0].ledger_id == entries[2].position.ledger_id
    assert ml.first_position == entries[2].position
    assert ml.first_index == 2
    doc = json.loads(result_of(rig.store.get(f"/managed-ledgers/{NAME}")).value)
    assert first not in [item["id"] for item in doc["ledgers"]]
    b.mark_delete(entries[5].position)
    rig.clock.advance(1)
    assert ml.ledgers[-1].ledger_id in rig.client.ledgers
    assert len(ml.ledgers) == 1


def test_without_durable_cursors_every_closed_ledger_is_consumed() -> None:
    """With no subscription and no retention, closed ledgers are deleted (Pulsar's default)."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2, retention_time_s=0)
    entries = rig.append(ml, *payloads(5))
    assert [i.ledger_id for i in ml.ledgers] == [entries[4].position.ledger_id]
    assert ml.first_position == entries[4].position


def test_retention_time_keeps_consumed_ledgers() -> None:
    """With retention, consumed ledgers stay until they are older than the retention time."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2, retention_time_s=60)
    c = result_of(ml.open_cursor("c", InitialPosition.EARLIEST))
    entries = rig.append(ml, *payloads(4))
    c.mark_delete(entries[3].position)
    rig.clock.advance(1)
    assert entries[0].position.ledger_id in rig.client.ledgers
    rig.clock.advance(61)
    result_of(ml.append(b"more"))  # the rollover re-checks
    rig.clock.advance(1)
    c.mark_delete(ml.last_confirmed)
    rig.clock.advance(1)
    assert entries[0].position.ledger_id not in rig.client.ledgers


def test_terminate_refuses_appends_durably() -> None:
    """terminate returns the last position; appends then fail, also after a reopen."""
    rig = Rig()
    ml = rig.open()
    entries = rig.append(ml, *payloads(3))
    assert result_of(ml.terminate()) == entries[-1].position
    assert ml.terminated
    assert isinstance(failure_of(ml.append(b"x")), ManagedLedgerTerminatedError)
    result_of(ml.close())
    again = rig.open()
    assert again.terminated
    assert isinstance(failure_of(again.append(b"x")), ManagedLedgerTerminatedError)
    assert [e.data for e in read_all(again)] == payloads(3)


def test_terminate_waits_for_pending_appends() -> None:
    """Pending appends complete before the log ends; the end position includes them."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    d = ml.append(b"a")
    t = ml.terminate()
    assert not fired(t)
    rig.client.release()
    assert result_of(t) == result_of(d).position


def test_close_waits_for_pending_appends() -> None:
    """close lets pending appends complete, then seals the ledger."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    d = ml.append(b"a")
    closing = ml.close()
    assert not fired(closing)
    rig.client.release()
    result_of(closing)
    assert result_of(d).data == b"a"
    assert rig.client.ledgers[ml.ledgers[-1].ledger_id].state is LedgerState.CLOSED


def test_delete_removes_ledgers_cursors_and_metadata() -> None:
    """delete drops every ledger and the log's metadata; the name no longer exists."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2)
    result_of(ml.open_cursor("c"))
    rig.append(ml, *payloads(5))
    ids = [i.ledger_id for i in ml.ledgers]
    result_of(rig.factory.delete(NAME))
    assert not any(i in rig.client.ledgers for i in ids)
    assert not result_of(rig.factory.exists(NAME))
    assert result_of(rig.store.get(f"/managed-ledgers/{NAME}")) is None


def test_factory_list_and_exists() -> None:
    """list finds logs by name prefix, without mistaking cursors for logs."""
    rig = Rig()
    for name in ("a/ns/persistent/x", "a/ns/persistent/y", "b/ns/persistent/x"):
        ml = rig.open(name)
        result_of(ml.open_cursor("sub/with/slashes"))
    assert result_of(rig.factory.list()) == [
        "a/ns/persistent/x",
        "a/ns/persistent/y",
        "b/ns/persistent/x",
    ]
    assert result_of(rig.factory.list("a/")) == ["a/ns/persistent/x", "a/ns/persistent/y"]
    assert result_of(rig.factory.list("a/ns/persistent/y")) == ["a/ns/persistent/y"]
    assert result_of(rig.factory.exists("a/ns/persistent/x"))
    assert not result_of(rig.factory.exists("a/ns/persistent/z"))
    assert not result_of(rig.factory.exists("a/ns"))


def test_factory_close_closes_logs_and_client() -> None:
    """Closing the factory closes its logs and the ledger client."""
    rig = Rig()
    ml = rig.open()
    result_of(rig.factory.close())
    assert rig.client.closed
    assert isinstance(failure_of(ml.append(b"x")), ManagedLedgerClosedError)
    assert isinstance(failure_of(rig.factory.open("x/y")), ManagedLedgerClosedError)


def test_invalid_names_are_refused() -> None:
    """Names that would break the metadata layout are refused."""
    rig = Rig()
    for name in ("", "a//b", "a/cursors/b", "/a"):
        assert isinstance(failure_of(rig.factory.open(name)), ValueError)


def test_open_fails_when_the_last_ledger_cannot_be_recovered() -> None:
    """If the last ledger cannot be opened the log does not open (nothing is guessed)."""
    rig = Rig()
    ml = rig.open()
    rig.append(ml, b"a")
    del rig.client.ledgers[ml.ledgers[-1].ledger_id]
    d: Deferred[object] = rig.new_owner().factory.open(NAME)
    assert failure_of(d) is not None


# -- more failure paths -----------------------------------------------------------------------


def test_appends_made_while_a_ledger_is_created_wait_and_keep_order() -> None:
    """Appends during a slow ledger creation queue and go out in order once it exists."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2)
    rig.client.create_delay = 1.0
    first = rig.append(ml, b"m0", b"m1")  # fills the ledger: the next one is being created
    ds = [ml.append(p) for p in payloads(3, 2)]
    assert not any(fired(d) for d in ds)
    rig.clock.advance(1.0)
    rig.clock.advance(1.0)
    got = first + [result_of(d) for d in ds]
    assert [e.index for e in got] == list(range(5))
    assert [e.data for e in read_all(ml)] == payloads(5)


def test_a_ledger_that_cannot_be_closed_on_rollover_stays_readable() -> None:
    """If sealing a full ledger fails, its confirmed entries are still read back (the read
    path recovers it) and appends go on in the next ledger."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2)
    rig.client.fail_close = 1
    entries = rig.append(ml, *payloads(4))
    first = entries[0].position.ledger_id
    assert rig.client.ledgers[first].state is LedgerState.OPEN
    ml._cache.clear()
    assert [e.data for e in read_all(ml)] == payloads(4)
    assert (first, True) in rig.client.opens
    assert rig.client.ledgers[first].state is LedgerState.CLOSED


def test_fencing_during_a_rollover_stops_the_log_and_drops_the_new_ledger() -> None:
    """Another owner fencing the log while a new ledger is created: queued appends fail and
    the half-made ledger is deleted, never written."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=1)
    rig.client.create_delay = 1.0
    result_of(ml.append(b"a"))
    d = ml.append(b"b")
    path = f"/managed-ledgers/{NAME}"
    node = result_of(rig.store.get(path))
    result_of(rig.store.put(path, node.value, node.stat.version))  # another owner
    rig.clock.advance(1.0)
    assert isinstance(failure_of(d), ManagedLedgerFencedError)
    newest = max(rig.client.writers)
    assert newest in rig.client.deleted
    assert rig.client.writers[newest].ledger.entries == []


def test_reads_of_ledgers_fail_cleanly_on_garbage() -> None:
    """An entry that is not in the managed-ledger format fails the read with a clear error."""
    rig = Rig(cache_size_bytes=0)
    ml = rig.open()
    entry = result_of(ml.append(b"x"))
    rig.client.ledgers[entry.position.ledger_id].entries[0] = b"garbage"
    err = failure_of(ml.read(entry.position, 1))
    assert isinstance(err, entry_format.EntryFormatError)


def test_reopening_while_closing_waits_for_the_close() -> None:
    """An open during a close gets a fresh instance after the close recorded its state,
    so the two never race on the ledger list."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    d = ml.append(b"a")
    closing = ml.close()
    second = ml.close()
    reopened = rig.factory.open(NAME)
    assert not fired(reopened)
    rig.client.hold = False
    rig.client.release()
    result_of(closing)
    result_of(second)
    fresh = result_of(reopened)
    assert fresh is not ml
    assert not fresh.fenced
    assert result_of(fresh.append(b"b")).index == result_of(d).index + 1


def test_unreadable_metadata_fails_the_open_clearly() -> None:
    """Garbage in the log's metadata node is reported, not guessed around."""
    rig = Rig()
    for garbage in (b"{not json", b'{"ledgers": [{"id": 1}]}', b"[1]", b'{"terminated": [1]}'):
        result_of(rig.store.put(f"/managed-ledgers/{NAME}", garbage))
        err = failure_of(rig.factory.open(NAME))
        assert "unreadable" in str(err)


def test_limits_of_zero_still_write_one_entry_per_ledger() -> None:
    """Degenerate limits never spin creating empty ledgers."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=0)
    entries = rig.append(ml, *payloads(3))
    assert len({e.position.ledger_id for e in entries}) == 3
    assert rig.client.creates <= 4


def test_time_lookup_in_a_sealed_ledger_reads_one_sparse_window() -> None:
    """A sealed ledger keeps every 64th publish time: a lookup reads at most one window of
    entries, with one request, and is exact."""
    rig = Rig(cache_size_bytes=0)
    ml = rig.open(max_entries_per_ledger=300)
    entries = [result_of(ml.append(b"x", 1, publish_time_ms=1000 + 10 * i)) for i in range(600)]
    assert entries[0].position.ledger_id != entries[-1].position.ledger_id
    for i in (0, 1, 63, 64, 65, 200, 299, 300, 301, 450, 599):
        reads, read_entries = rig.client.reads, rig.client.entries_read
        assert result_of(ml.position_of_time(1000 + 10 * i - 5)) == entries[i].position
        assert rig.client.reads - reads <= 1
        assert rig.client.entries_read - read_entries <= 64
    assert result_of(ml.position_of_time(1000 + 10 * 600)) is None


def test_an_append_from_the_completion_that_fills_a_ledger_rolls_over_once() -> None:
    """Appending from inside the callback of the append that filled the ledger, while sealing
    takes time, starts exactly one rollover and keeps the order."""
    rig = Rig()
    rig.client.close_delay = 0.5
    ml = rig.open(max_entries_per_ledger=2)
    chained: list[Deferred[Entry]] = []

    def again(entry: Entry) -> Entry:
        if entry.data == b"m1":
            chained.append(ml.append(b"m2"))
        return entry

    first = [ml.append(b"m0"), ml.append(b"m1").addCallback(again)]
    creates = rig.client.creates
    rig.clock.advance(0.5)
    assert rig.client.creates == creates + 1
    got = [result_of(d) for d in first + chained]
    assert [e.index for e in got] == [0, 1, 2]
    assert got[2].position.ledger_id != got[0].position.ledger_id
    assert [e.data for e in read_all(ml)] == payloads(3)


def test_a_failed_trim_keeps_the_ledger_list_whole() -> None:
    """If writing the shortened list fails, no ledger is deleted and the list is as before;
    a later trim succeeds."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=2, retention_time_s=0)
    c = result_of(ml.open_cursor("c", InitialPosition.EARLIEST))
    entries = rig.append(ml, *payloads(5))
    before = [i.ledger_id for i in ml.ledgers]
    real_put = rig.store.put
    failures = [1]  # fail the next write of the ledger list once

    def failing_put(path: str, value: bytes, expected_version: int | None = None, **kw: object):  # type: ignore[no-untyped-def]
        if path == f"/managed-ledgers/{NAME}" and failures[0]:
            failures[0] -= 1
            return fail(StoreClosedError("store down"))
        return real_put(path, value, expected_version, **kw)  # type: ignore[arg-type]

    rig.store.put = failing_put  # type: ignore[method-assign]
    c.mark_delete(entries[3].position)
    rig.clock.advance(1)
    assert failures == [0]
    assert [i.ledger_id for i in ml.ledgers] == before
    assert not rig.client.deleted
    assert [e.data for e in result_of(ml.read(entries[4].position, 1))] == [b"m4"]
    result_of(ml.append(b"m5"))  # the rollover trims again
    rig.clock.advance(1)
    assert entries[0].position.ledger_id in rig.client.deleted
    assert [e.data for e in read_all(ml)][-2:] == [b"m4", b"m5"]


def test_closing_a_full_ledger_seals_it_without_rolling_over() -> None:
    """A close that waits for the append filling the ledger makes no new ledger, and the
    rollover timer does not fire after it."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=1, max_ledger_rollover_time_s=10)
    rig.client.hold = True
    d = ml.append(b"last")
    creates = rig.client.creates
    closing = ml.close()
    rig.client.release()
    result_of(closing)
    rig.clock.advance(60)
    assert rig.client.creates == creates
    entry = result_of(d)
    assert entry.data == b"last"
    assert rig.client.ledgers[entry.position.ledger_id].state is LedgerState.CLOSED


# -- append_many ------------------------------------------------------------------------------


def test_append_many_completes_once_with_every_entry_in_order() -> None:
    """One completion for the group, its entries in order, indexes counting messages, and
    appends before and after it keep their places."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    before = ml.append(b"first", 2)
    group = ml.append_many([b"a", b"b", b"c"], [1, 3, 1])
    after = ml.append(b"last")
    assert not group.called
    rig.client.release()
    entries = result_of(group)
    assert [e.data for e in entries] == [b"a", b"b", b"c"]
    assert [e.index for e in entries] == [2, 3, 6]
    assert [e.position.entry_id for e in entries] == [1, 2, 3]
    assert result_of(before).index == 0
    assert result_of(after).index == 7
    assert [e.data for e in read_all(ml)] == [b"first", b"a", b"b", b"c", b"last"]


def test_append_many_crosses_rollovers() -> None:
    """A group larger than a ledger goes on over the next ledgers and completes whole."""
    rig = Rig()
    ml = rig.open(max_entries_per_ledger=3)
    entries = result_of(ml.append_many(payloads(8)))
    assert [e.data for e in entries] == payloads(8)
    assert [e.index for e in entries] == list(range(8))
    assert len({e.position.ledger_id for e in entries}) == 3
    assert [e.data for e in read_all(ml)] == payloads(8)


def test_append_many_is_resent_whole_after_a_ledger_failure() -> None:
    """Entries of a group pending on a failed ledger go to the next one with the same
    indexes; the group completes once, nothing lost or reordered."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    group = ml.append_many(payloads(6))
    first = ml.ledgers[-1].ledger_id
    rig.client.writer(first).release(2)
    assert not group.called
    rig.client.fail_pending(first)
    rig.client.release()
    entries = result_of(group)
    assert [e.index for e in entries] == list(range(6))
    assert [e.position.ledger_id for e in entries[:2]] == [first, first]
    assert [e.data for e in read_all(ml)] == payloads(6)


def test_append_many_fails_once_when_the_log_is_fenced() -> None:
    """Another owner fencing the ledger fails the group's one completion."""
    rig = Rig()
    ml = rig.open()
    rig.client.hold = True
    group = ml.append_many(payloads(3))
    result_of(rig.client.open(ml.ledgers[-1].ledger_id, recovery=True))
    assert isinstance(failure_of(group), ManagedLedgerFencedError)
    assert isinstance(failure_of(ml.append_many(payloads(1))), ManagedLedgerFencedError)


def test_append_many_checks_its_arguments() -> None:
    """Counts must match the entries and be >= 1; an empty group completes at once."""
    ml = Rig().open()
    assert isinstance(failure_of(ml.append_many([b"a", b"b"], [1])), ValueError)
    assert isinstance(failure_of(ml.append_many([b"a"], [0])), ValueError)
    assert result_of(ml.append_many([])) == []
    assert ml.entries == 0
