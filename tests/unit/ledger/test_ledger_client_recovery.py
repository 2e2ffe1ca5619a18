"""Recovery opens over fake bookies: fencing quorums, reading past the LAC, re-replication,
the old writer stopped, and concurrent recoveries or metadata changes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_bookie import FakeCluster, LedgerRig, failure_of, result_of

from polybroker.ledger.api import (
    BookieUnavailableError,
    LedgerFencedError,
    LedgerState,
    ReadHandle,
)
from polybroker.ledger.client import decode_metadata, encode_metadata, encode_record


@pytest.fixture(autouse=True, params=[False, True], ids=["deferred-adds", "batched-adds"])
def _both_add_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test over bookies answering adds by Deferred and by a batched-add listener."""
    monkeypatch.setattr(FakeCluster, "batched_default", request.param)


def data(i: int) -> bytes:
    return f"payload-{i}".encode() * (1 + i % 3)


def recover(rig: LedgerRig, ledger_id: int) -> ReadHandle:
    return result_of(rig.new_client().open(ledger_id, recovery=True))


def test_recovery_closes_at_the_lac_and_fences_the_writer() -> None:
    """After a recovery open the ledger is CLOSED at the writer's LAC with its length, and the
    old writer's next add and its close fail with LedgerFencedError."""
    rig = LedgerRig(3)
    w = rig.create(3, 2, 2)
    for i in range(5):
        result_of(w.append(data(i)))
    handle = recover(rig, w.ledger_id)
    meta = rig.stored_metadata(w.ledger_id)
    assert (meta.state, meta.last_entry_id, meta.length) == (LedgerState.CLOSED, 4, w.length)
    assert handle.last_add_confirmed == 4
    assert result_of(handle.read(0, 4)) == [data(i) for i in range(5)]
    assert isinstance(failure_of(w.append(b"late")), LedgerFencedError)
    assert isinstance(failure_of(w.close_ledger()), LedgerFencedError)


def test_recovery_reads_past_the_lac_and_rewrites_what_it_finds() -> None:
    """Entries sent but not yet acknowledged are found by fencing reads past the LAC, written
    again with the recovery flag, and the ledger closes after the last of them."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 2)
    for i in range(5):
        result_of(w.append(data(i)))
    for b in rig.cluster.bookies.values():
        b.hold = True
    late = [w.append(data(i)) for i in (5, 6)]
    for b in rig.cluster.bookies.values():
        b.hold = False
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 6
    assert result_of(handle.read(5, 6)) == [data(5), data(6)]
    for b in rig.cluster.bookies.values():
        assert {e for _, e, _, rec in b.adds if rec} == {5, 6}
        b.release()  # the old writer's adds were taken before the fence: they may complete
    assert [result_of(d) for d in late] == [5, 6]
    assert isinstance(failure_of(w.append(b"x")), LedgerFencedError)
    assert rig.stored_metadata(w.ledger_id).last_entry_id >= w.last_add_confirmed


def test_entry_on_a_single_bookie_is_recovered_everywhere() -> None:
    """With Qa=1 an entry one bookie holds may have been acknowledged: recovery keeps it and
    copies it to its whole write set."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 1)
    for i in range(3):
        result_of(w.append(data(i)))
    meta = w.metadata
    only = rig.bookie(meta.write_set(3)[1])
    record = encode_record(w.ledger_id, 3, 2, w.length + len(data(3)), data(3))
    only.ledgers[w.ledger_id].entries[3] = record  # the writer died right after this bookie
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 3
    assert handle.metadata.length == w.length + len(data(3))
    for address in meta.write_set(3):
        assert 3 in rig.bookie(address).entry_ids(w.ledger_id)
    assert result_of(handle.read(3, 3)) == [data(3)]


def test_fencing_needs_enough_bookies_of_every_write_set() -> None:
    """With E=3 Qw=3 Qa=2 recovery goes on with one bookie down (2 of 3 fenced in every write
    set) but not with two down; then it fails and nothing is closed."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 2)
    for i in range(4):
        result_of(w.append(data(i)))
    ensemble = w.metadata.fragments[0][1]
    rig.bookie(ensemble[0]).down = True
    rig.bookie(ensemble[1]).down = True
    error = failure_of(rig.new_client().open(w.ledger_id, recovery=True))
    assert isinstance(error, BookieUnavailableError)
    assert rig.stored_metadata(w.ledger_id).state is LedgerState.IN_RECOVERY
    rig.bookie(ensemble[1]).down = False
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 3
    assert result_of(handle.read(0, 3)) == [data(i) for i in range(4)]


def test_striped_fencing_quorum() -> None:
    """With E=3 Qw=2 Qa=2 one fenced bookie per write set is enough; two bookies down leave a
    write set unfenced and recovery refuses to decide."""
    rig = LedgerRig(3)
    w = rig.create(3, 2, 2)
    for i in range(6):
        result_of(w.append(data(i)))
    ensemble = w.metadata.fragments[0][1]
    rig.bookie(ensemble[0]).down = True
    rig.bookie(ensemble[1]).down = True
    assert isinstance(
        failure_of(rig.new_client().open(w.ledger_id, recovery=True)), BookieUnavailableError
    )
    rig.bookie(ensemble[0]).down = False
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 5
    assert result_of(handle.read(0, 5)) == [data(i) for i in range(6)]


def test_writer_ensemble_change_after_recovery_started_is_fenced() -> None:
    """A writer whose ensemble-change CAS finds the ledger IN_RECOVERY stops with
    LedgerFencedError instead of routing around the fence."""
    rig = LedgerRig(4)
    w = rig.create(3, 3, 2)
    result_of(w.append(b"a"))
    path = f"/ledgers/{w.ledger_id}"
    got = result_of(rig.store.get(path))
    meta = decode_metadata(got.value)
    recovering = meta.__class__(**{**meta.__dict__, "state": LedgerState.IN_RECOVERY})
    result_of(rig.store.put(path, encode_metadata(recovering), got.stat.version))
    rig.bookie(w.metadata.write_set(1)[0]).down = True  # it fails before any ack of entry 1
    assert isinstance(failure_of(w.append(b"b")), LedgerFencedError)
    assert isinstance(failure_of(w.append(b"c")), LedgerFencedError)
    assert len(rig.stored_metadata(w.ledger_id).fragments) == 1


def test_concurrent_recoveries_agree_on_the_end() -> None:
    """Two recoveries running at once both finish; the one losing the close CAS adopts the
    winner's end, so both handles see the same last entry."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    for i in range(3):
        result_of(w.append(data(i)))
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    w.append(data(3))  # stored, never acknowledged
    first = rig.new_client().open(w.ledger_id, recovery=True)
    second = rig.new_client().open(w.ledger_id, recovery=True)
    assert not first.called
    assert not second.called  # both wait on their recovery writes
    bookie.hold = False
    bookie.release()
    a, b = result_of(first), result_of(second)
    assert a.last_add_confirmed == b.last_add_confirmed == 3
    assert a.metadata == b.metadata == rig.stored_metadata(w.ledger_id)


def test_recovery_of_an_empty_ledger_and_of_a_closed_one() -> None:
    """An empty ledger recovers to last entry -1; opening a closed ledger fences nothing."""
    rig = LedgerRig(2)
    w = rig.create(2, 2, 2)
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == -1
    assert (handle.metadata.state, handle.metadata.length) == (LedgerState.CLOSED, 0)
    fences = sum(b.fences for b in rig.cluster.bookies.values())
    again = recover(rig, w.ledger_id)
    assert again.last_add_confirmed == -1
    assert sum(b.fences for b in rig.cluster.bookies.values()) == fences


def test_tailing_reader_sees_the_close() -> None:
    """A no-recovery reader learns the final LAC from the metadata once the ledger is closed."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    for i in range(3):
        result_of(w.append(data(i)))
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=False))
    assert reader.last_add_confirmed == 1
    result_of(w.close_ledger())
    assert result_of(reader.read_last_add_confirmed()) == 2
    assert result_of(reader.read(2, 2)) == [data(2)]


def test_recovery_replaces_a_dead_bookie_it_must_rewrite_to() -> None:
    """Entries past the LAC whose write set holds a dead bookie are rewritten to a replacement
    recorded in a new fragment (by CAS), so recovery completes and every entry is readable."""
    rig = LedgerRig(4)
    w = rig.create(3, 2, 2)
    for i in range(4):
        result_of(w.append(data(i)))
    for b in rig.cluster.bookies.values():
        b.hold = True
    for i in (4, 5, 6):
        w.append(data(i))
    ensemble = w.metadata.fragments[0][1]
    dead = ensemble[0]
    rig.bookie(dead).down = True  # its held adds stay unanswered: the writer is stuck, not failed
    for b in rig.cluster.bookies.values():
        b.hold = False
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 6
    spare = next(a for a in rig.cluster.addresses if a not in ensemble)
    meta = rig.stored_metadata(w.ledger_id)
    assert meta.state is LedgerState.CLOSED
    assert meta.fragments == ((0, ensemble), (4, (spare, ensemble[1], ensemble[2])))
    assert rig.bookie(spare).entry_ids(w.ledger_id) == [
        e for e in (4, 5, 6) if dead in w.metadata.write_set(e)
    ]
    assert result_of(handle.read(0, 6)) == [data(i) for i in range(7)]


def test_recovery_does_not_wait_for_a_silent_bookie() -> None:
    """Fencing and recovery reads go on once the quorums answered; a bookie that never answers
    does not hold recovery up until its timeout."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 2)
    for i in range(3):
        result_of(w.append(data(i)))
    rig.bookie(w.metadata.fragments[0][1][2]).silent = True
    handle = recover(rig, w.ledger_id)  # fired without the clock moving
    assert handle.last_add_confirmed == 2


def test_recovery_reads_past_a_corrupt_copy() -> None:
    """A recovery read refusing a corrupt replica takes the entry from an intact one."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 2)
    for i in range(3):
        result_of(w.append(data(i)))
    for b in rig.cluster.bookies.values():
        b.hold = True
    w.append(data(3))
    for b in rig.cluster.bookies.values():
        b.hold = False
    rig.bookie(w.metadata.write_set(3)[0]).corrupt(w.ledger_id, 3)
    handle = recover(rig, w.ledger_id)
    assert handle.last_add_confirmed == 3
    assert result_of(handle.read(3, 3)) == [data(3)]
