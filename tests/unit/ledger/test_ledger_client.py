"""BookKeeperClient over fake bookies: quorums, ordering, LAC, ensemble changes, reads, closing."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_bookie import FakeCluster, LedgerRig, failure_of, result_of
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from polybroker.ledger.api import (
    DigestMismatchError,
    LedgerClosedError,
    LedgerConfig,
    LedgerState,
    NoSuchEntryError,
    NoSuchLedgerError,
    NotEnoughBookiesError,
    StorageError,
)
from polybroker.ledger.client import (
    _WIRE_OVERHEAD,
    BookKeeperClient,
    decode_metadata,
    decode_record,
    encode_metadata,
    encode_record,
    encode_wire_parts,
    encode_wire_record,
)
from polybroker.ledger.placement import choose_ensemble, replace_bookies
from polybroker.ledger.registry import (
    BookieRegistry,
    MetadataBookieRegistry,
    StaticBookieRegistry,
)
from polybroker.ledger.wire import encode_add_record
from polybroker.metadata.memory import MemoryMetadataStore


@pytest.fixture(autouse=True, params=[False, True], ids=["deferred-adds", "batched-adds"])
def _both_add_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test over bookies answering adds by Deferred and by a batched-add listener."""
    monkeypatch.setattr(FakeCluster, "batched_default", request.param)


def data(i: int) -> bytes:
    return f"entry-{i}".encode() * (1 + i % 5)


# -- quorum arithmetic and placement ----------------------------------------------------------


def test_adds_go_to_their_write_sets() -> None:
    """Entry e goes to Qw bookies from position e mod E of the ensemble, and to no other."""
    rig = LedgerRig(4)
    w = rig.create(3, 2, 2)
    for i in range(7):
        assert result_of(w.append(data(i))) == i
    ensemble = w.metadata.fragments[0][1]
    assert len(ensemble) == 3
    for i in range(7):
        expected = {ensemble[i % 3], ensemble[(i + 1) % 3]}
        holders = {a for a, b in rig.cluster.bookies.items() if i in b.entry_ids(w.ledger_id)}
        assert holders == expected


def test_create_needs_enough_bookies_and_valid_quorums() -> None:
    """A create asking for more bookies than exist fails; E >= Qw >= Qa is enforced."""
    rig = LedgerRig(2)
    assert isinstance(failure_of(rig.client.create(LedgerConfig(3, 2, 2))), NotEnoughBookiesError)
    with pytest.raises(ValueError, match="ensemble size"):
        LedgerConfig(2, 3, 2)


def test_placement_keeps_positions_and_avoids_excluded() -> None:
    """A replacement takes the failed member's position and is never excluded or a member."""
    rng = random.Random(3)
    ensemble = choose_ensemble(["a", "b", "c", "d", "e"], 3, rng)
    assert len(set(ensemble)) == 3
    failed = {ensemble[1]}
    spare = [x for x in "abcde" if x not in ensemble]
    new = replace_bookies(ensemble, failed, list("abcde"), rng, exclude={spare[0]})
    assert (new[0], new[2]) == (ensemble[0], ensemble[2])
    assert new[1] == spare[1]
    with pytest.raises(NotEnoughBookiesError):
        replace_bookies(ensemble, failed, list("abcde"), rng, exclude=set(spare))


def test_ledger_ids_are_unique_across_clients() -> None:
    """Two clients on one store never hand out the same ledger id."""
    rig = LedgerRig(1)
    other = rig.new_client()
    ids = [rig.create(1, 1, 1).ledger_id for _ in range(3)]
    ids += [result_of(other.create(LedgerConfig())).ledger_id for _ in range(3)]
    assert len(set(ids)) == 6


# -- add completion and LAC -------------------------------------------------------------------


def test_adds_complete_in_order() -> None:
    """Entry 1 acknowledged by its quorum before entry 0 completes only after entry 0."""
    rig = LedgerRig(2)
    w = rig.create(2, 2, 2)
    for b in rig.cluster.bookies.values():
        b.hold = True
    done: list[int] = []
    d0, d1 = w.append(b"zero"), w.append(b"one")
    d0.addCallback(done.append)
    d1.addCallback(done.append)
    for b in rig.cluster.bookies.values():
        b.release_entry(w.ledger_id, 1)
    assert done == []
    assert w.last_add_confirmed == -1
    first = rig.bookie(w.metadata.fragments[0][1][0])
    first.release_entry(w.ledger_id, 0)
    assert done == [], "one ack of entry 0 is below the ack quorum"
    for b in rig.cluster.bookies.values():
        if b is not first:
            b.release_entry(w.ledger_id, 0)
    assert done == [0, 1]
    assert w.last_add_confirmed == 1
    assert w.length == len(b"zero") + len(b"one")


def test_append_then_reports_in_order_and_a_failing_callback_stops_nothing() -> None:
    """The Deferred-free append calls back in entry order; a callback that raises is logged
    and the completions after it still happen."""
    rig = LedgerRig(2)
    w = rig.create(2, 2, 2)
    for b in rig.cluster.bookies.values():
        b.hold = True
    seen: list[tuple[str, int]] = []

    def done(entry_id: int, token: str, handle: object) -> None:
        assert handle is w
        seen.append((token, entry_id))
        if token == "boom":
            raise RuntimeError("a caller's bug")

    def failed(error: Exception, token: str, handle: object) -> None:
        seen.append((f"failed {token}", -1))

    w.append_then(b"zero", done, failed, "boom")
    w.append_then(b"one", done, failed, "fine")
    later = w.append(b"two")
    for b in rig.cluster.bookies.values():
        b.release()
    assert seen == [("boom", 0), ("fine", 1)]
    assert result_of(later) == 2
    assert w.last_add_confirmed == 2


def test_ack_quorum_smaller_than_write_quorum() -> None:
    """With Qw=3, Qa=2 an add completes on two acks while the third bookie is still silent."""
    rig = LedgerRig(3)
    w = rig.create(3, 3, 2)
    slow = rig.bookie(w.metadata.fragments[0][1][2])
    slow.hold = True
    assert result_of(w.append(b"x")) == 0
    assert len(slow.held) == 1


def test_lac_is_piggybacked_on_later_adds() -> None:
    """Each add carries the LAC at send time, both to the bookie and inside its record."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    w.append(b"a")
    w.append(b"b")
    bookie.release()
    w.append(b"c")
    assert [lac for _, _, lac, _ in bookie.adds] == [-1, -1, 1]
    stored = bookie.ledgers[w.ledger_id].entries
    assert [decode_record(w.ledger_id, e, stored[e])[1] for e in range(3)] == [-1, -1, 1]


def test_records_detect_corruption_and_misplacement() -> None:
    """A record decodes only for its own ledger and entry and only with intact bytes."""
    raw = encode_record(5, 3, 2, 100, b"payload")
    assert decode_record(5, 3, raw) == (b"payload", 2, 100)
    for ledger, entry, bad in ((5, 4, raw), (6, 3, raw), (5, 3, raw[:-1] + b"X"), (5, 3, b"x")):
        with pytest.raises(DigestMismatchError):
            decode_record(ledger, entry, bad)


def test_metadata_round_trips_and_rejects_garbage() -> None:
    """Metadata survives encoding; malformed documents fail with StorageError."""
    rig = LedgerRig(3)
    meta = rig.create(3, 2, 1).metadata
    assert decode_metadata(encode_metadata(meta)) == meta
    for raw in (b"{", b"[]", b'{"ensemble_size": 1}', encode_metadata(meta).replace(b"3", b"0")):
        with pytest.raises(StorageError):
            decode_metadata(raw)


# -- ensemble changes ------------------------------------------------------------------------


def test_ensemble_change_resends_outstanding_adds() -> None:
    """A bookie crashing with adds outstanding is replaced in a new fragment (by CAS) and
    its adds are re-sent to the replacement; every entry is acknowledged and readable."""
    rig = LedgerRig(4)
    w = rig.create(3, 2, 2)
    ensemble = w.metadata.fragments[0][1]
    for i in range(4):
        result_of(w.append(data(i)))
    for b in rig.cluster.bookies.values():
        b.hold = True
    pending = [w.append(data(i)) for i in range(4, 10)]
    for a in w.metadata.write_set(4):
        rig.bookie(a).release_entry(w.ledger_id, 4)  # entry 4 completes before the crash
    assert result_of(pending[0]) == 4
    victim = rig.bookie(ensemble[1])
    victim.crash()
    spare = next(a for a in rig.cluster.addresses if a not in ensemble)
    stored = rig.stored_metadata(w.ledger_id)
    new_ensemble = tuple(spare if a == ensemble[1] else a for a in ensemble)
    assert stored.fragments == ((0, ensemble), (5, new_ensemble))
    assert w.metadata == stored
    for b in rig.cluster.bookies.values():
        b.hold = False
        b.release()
    assert [result_of(d) for d in pending] == list(range(4, 10))
    moved = [i for i in range(5, 10) if spare in stored.write_set(i)]
    assert rig.bookie(spare).entry_ids(w.ledger_id) == moved
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=True))
    assert reader.last_add_confirmed == 9
    assert result_of(reader.read(0, 9)) == [data(i) for i in range(10)]


def test_second_failure_during_change_is_handled_after_it() -> None:
    """Two bookies failing one after the other both get replaced and the adds go on."""
    rig = LedgerRig(5)
    w = rig.create(3, 3, 2)
    ensemble = w.metadata.fragments[0][1]
    rig.bookie(ensemble[0]).down = True
    rig.bookie(ensemble[1]).down = True
    assert [result_of(w.append(data(i))) for i in range(3)] == [0, 1, 2]
    final = rig.stored_metadata(w.ledger_id).fragments[-1][1]
    assert not {ensemble[0], ensemble[1]} & set(final)
    assert len(rig.stored_metadata(w.ledger_id).fragments) == 1, "no entry was in the old one"


def test_not_enough_bookies_fails_pending_and_later_adds() -> None:
    """Without a spare bookie the pending adds and every later one fail NotEnoughBookiesError;
    what was acknowledged stays readable."""
    rig = LedgerRig(3)
    w = rig.create(3, 2, 2)
    ensemble = w.metadata.fragments[0][1]
    result_of(w.append(b"kept"))
    for b in rig.cluster.bookies.values():
        b.hold = True
    pending = [w.append(data(i)) for i in range(3)]
    rig.bookie(ensemble[2]).crash()
    assert all(isinstance(failure_of(d), NotEnoughBookiesError) for d in pending)
    assert isinstance(failure_of(w.append(b"later")), NotEnoughBookiesError)
    for b in rig.cluster.bookies.values():
        b.hold = False
        b.release()
    assert result_of(w.read(0, 0)) == [b"kept"]


def test_a_bookie_that_failed_the_writer_is_taken_again_after_its_quarantine() -> None:
    """A bookie that failed a writer is not its replacement within the quarantine (it may be a
    dead bookie still listed), and is once the quarantine is over (it came back)."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 2)
    first = w.metadata.fragments[0][1]
    rig.bookie(first[0]).down = True
    assert result_of(w.append(b"a")) == 0
    spare = w.metadata.fragments[-1][1][0]
    assert spare not in first
    rig.bookie(first[0]).down = False  # it came back
    rig.bookie(spare).down = True
    assert isinstance(failure_of(w.append(b"b")), NotEnoughBookiesError)

    w = rig.create(2, 2, 2)
    first = w.metadata.fragments[0][1]
    rig.bookie(spare).down = False
    rig.bookie(first[0]).down = True
    assert result_of(w.append(b"a")) == 0
    spare = w.metadata.fragments[-1][1][0]
    rig.bookie(first[0]).down = False
    rig.clock.advance(30.5)  # the client's default quarantine
    rig.bookie(spare).down = True
    assert result_of(w.append(b"b")) == 1
    assert w.metadata.fragments[-1][1][0] == first[0]


def test_silent_bookie_is_replaced_after_the_add_timeout() -> None:
    """A bookie that never answers holds the adds only until the add timeout, then is replaced."""
    rig = LedgerRig(3, add_timeout_s=2.0)
    w = rig.create(2, 2, 2)
    ensemble = w.metadata.fragments[0][1]
    rig.bookie(ensemble[0]).silent = True
    d = w.append(b"x")
    rig.clock.advance(1.0)
    assert not d.called
    rig.clock.advance(1.5)
    assert result_of(d) == 0
    assert ensemble[0] not in rig.stored_metadata(w.ledger_id).fragments[-1][1]


def test_ensemble_change_survives_a_foreign_metadata_update() -> None:
    """A concurrent change of another field (lost CAS, still OPEN) is re-read and kept."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 2)
    result_of(w.append(b"a"))
    got = result_of(rig.store.get(f"/ledgers/{w.ledger_id}"))
    meta = decode_metadata(got.value)
    bumped = encode_metadata(meta.__class__(**{**meta.__dict__, "custom": {"k": "v"}}))
    result_of(rig.store.put(f"/ledgers/{w.ledger_id}", bumped, got.stat.version))
    rig.bookie(w.metadata.fragments[0][1][0]).down = True
    assert result_of(w.append(b"b")) == 1
    stored = rig.stored_metadata(w.ledger_id)
    assert stored.custom == {"k": "v"}
    assert len(stored.fragments) == 2


# -- reads -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("e", "qw"), [(2, 2), (3, 2)])
def test_digest_mismatch_falls_back_to_another_replica(e: int, qw: int) -> None:
    """A corrupt copy is refused and the entry is read from the next bookie of its write set."""
    rig = LedgerRig(3)
    w = rig.create(e, qw, qw)
    for i in range(6):
        result_of(w.append(data(i)))
    rig.bookie(w.metadata.write_set(2)[0]).corrupt(w.ledger_id, 2)
    assert result_of(w.read(0, 5)) == [data(i) for i in range(6)]
    rig.bookie(w.metadata.write_set(2)[1]).corrupt(w.ledger_id, 2)
    assert isinstance(failure_of(w.read(2, 2)), DigestMismatchError)


def test_read_falls_back_when_a_replica_is_down_or_silent() -> None:
    """Reads go on from other replicas when one bookie is down or never answers (timeout)."""
    rig = LedgerRig(2, add_timeout_s=1.0)
    w = rig.create(2, 2, 1)
    for i in range(3):
        result_of(w.append(data(i)))
    rig.bookie(w.metadata.write_set(0)[0]).down = True
    assert result_of(w.read(0, 2)) == [data(i) for i in range(3)]
    rig.bookie(w.metadata.write_set(0)[0]).down = False
    rig.bookie(w.metadata.write_set(0)[0]).silent = True
    d = w.read(0, 0)
    assert not d.called
    rig.clock.advance(1.0)
    assert result_of(d) == [data(0)]


def test_reads_beyond_the_lac_are_refused() -> None:
    """A read past the LAC fails with NoSuchEntryError (those entries may be truncated)."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    result_of(w.append(b"a"))
    assert isinstance(failure_of(w.read(0, 1)), NoSuchEntryError)


def test_tailing_reader_follows_the_lac_without_fencing() -> None:
    """A no-recovery open reads up to the bookies' LAC, and the writer keeps writing."""
    rig = LedgerRig(2)
    w = rig.create(2, 2, 2)
    for i in range(3):
        result_of(w.append(data(i)))
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=False))
    assert reader.last_add_confirmed == 1  # the LAC rode on entry 2's add
    assert result_of(reader.read(0, 1)) == [data(0), data(1)]
    result_of(w.append(data(3)))
    assert result_of(reader.read_last_add_confirmed()) == 2
    assert rig.stored_metadata(w.ledger_id).state is LedgerState.OPEN
    assert all(b.fences == 0 for b in rig.cluster.bookies.values())


# -- close, delete, connections --------------------------------------------------------------


def test_close_ledger_waits_for_pending_adds_then_seals() -> None:
    """close_ledger waits for outstanding adds, closes at the LAC by CAS; later adds fail."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    d = w.append(b"12345")
    closing = w.close_ledger()
    assert not closing.called
    assert isinstance(failure_of(w.append(b"late")), LedgerClosedError)
    bookie.release()
    assert result_of(d) == 0
    result_of(closing)
    stored = rig.stored_metadata(w.ledger_id)
    assert (stored.state, stored.last_entry_id, stored.length) == (LedgerState.CLOSED, 0, 5)
    result_of(w.close_ledger())  # idempotent
    reader = result_of(rig.client.open(w.ledger_id))
    assert result_of(reader.read(0, 0)) == [b"12345"]


def test_delete_removes_metadata_and_tells_every_bookie() -> None:
    """delete drops the metadata and asks each bookie of each fragment to forget the ledger."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 2)
    result_of(w.append(b"a"))
    rig.bookie(w.metadata.fragments[0][1][0]).down = True
    result_of(w.append(b"b"))
    rig.bookie(w.metadata.fragments[0][1][0]).down = False
    result_of(rig.client.delete(w.ledger_id))
    assert isinstance(failure_of(rig.client.get_metadata(w.ledger_id)), NoSuchLedgerError)
    assert all(w.ledger_id in b.deleted for b in rig.cluster.bookies.values())
    assert isinstance(failure_of(rig.client.delete(w.ledger_id)), NoSuchLedgerError)
    assert isinstance(failure_of(rig.client.open(w.ledger_id)), NoSuchLedgerError)


def test_one_connection_per_bookie_closed_with_the_client() -> None:
    """connect is called once per address however many ledgers use it; close closes them."""
    rig = LedgerRig(2)
    for _ in range(3):
        w = rig.create(2, 2, 2)
        result_of(w.append(b"a"))
    assert rig.cluster.connects == dict.fromkeys(rig.cluster.addresses, 1)
    result_of(rig.client.close())
    assert all(b.closed for b in rig.cluster.bookies.values())


def test_metadata_registry_follows_available_bookies() -> None:
    """The registry lists /bookies/available and stays current as bookies come and go."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    registry = MetadataBookieRegistry(store)
    assert result_of(registry.writable_bookies()) == []
    bookie_session = store.new_session()
    result_of(bookie_session.put("/bookies/available/b1:1", b"{}", ephemeral=True))
    result_of(bookie_session.put("/bookies/available/b2:1", b"{}", ephemeral=True))
    assert result_of(registry.writable_bookies()) == ["b1:1", "b2:1"]
    result_of(bookie_session.delete("/bookies/available/b1:1"))
    assert result_of(registry.writable_bookies()) == ["b2:1"]
    result_of(bookie_session.close())
    assert result_of(registry.writable_bookies()) == []
    registry.close()
    assert result_of(StaticBookieRegistry(["x:1", "x:1", "y:1"]).writable_bookies()) == [
        "x:1",
        "y:1",
    ]


def test_client_over_metadata_registry_creates_ledgers() -> None:
    """A client choosing bookies from the metadata registry writes to announced bookies only."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    cluster = FakeCluster(clock, 3)
    for a in cluster.addresses[:2]:
        result_of(store.put(f"/bookies/available/{a}", b"{}", ephemeral=True))
    client = BookKeeperClient(store, MetadataBookieRegistry(store), cluster.connect, clock)
    w = result_of(client.create(LedgerConfig(2, 2, 2)))
    assert set(w.metadata.fragments[0][1]) == set(cluster.addresses[:2])


def test_storage_problem_counts_the_bookies_taking_writes() -> None:
    """A client names the problem while fewer bookies take writes than a new ledger's
    ensemble needs (read-only ones do not count), and None once enough do."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    cluster = FakeCluster(clock, 2)
    read_only: set[str] = {cluster.addresses[0]}
    registry = StaticBookieRegistry(cluster.addresses, lambda a: a not in read_only)
    client = BookKeeperClient(store, registry, cluster.connect, clock)
    assert result_of(client.storage_problem(1)) is None
    assert result_of(client.storage_problem(2)) == (
        f"writable bookies: 1 of the 2 a new ledger needs ['{cluster.addresses[1]}']"
    )
    read_only.clear()
    assert result_of(client.storage_problem(2)) is None


def test_closed_client_fails_adds_without_reconnecting() -> None:
    """After close, a writer's adds fail with LedgerClosedError and no bookie is reconnected."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 2)
    result_of(w.append(b"a"))
    connects = dict(rig.cluster.connects)
    result_of(rig.client.close())
    assert isinstance(failure_of(w.append(b"b")), LedgerClosedError)
    assert isinstance(failure_of(w.append(b"c")), LedgerClosedError)
    assert rig.cluster.connects == connects


def test_range_reads_cross_fragments() -> None:
    """With E == Qw reads go by ranges, each within one fragment's ensemble, and still fall
    back to the other replica when a bookie of an old fragment is gone."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 2)
    for i in range(5):
        result_of(w.append(data(i)))
    first = w.metadata.fragments[0][1]
    rig.bookie(first[0]).down = True
    for i in range(5, 10):
        result_of(w.append(data(i)))
    assert [start for start, _ in w.metadata.fragments] == [0, 5]
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=True))
    assert result_of(reader.read(0, 9)) == [data(i) for i in range(10)]
    assert result_of(reader.read(3, 6)) == [data(i) for i in range(3, 7)]


def test_striped_reads_go_one_per_residue_and_around_a_missing_bookie() -> None:
    """With E > Qw the entries of one residue modulo E share a write set: a read takes one
    strided read per residue, not one per entry, within each fragment, and a residue whose
    first bookie is gone is read from its next one."""
    rig = LedgerRig(4)
    w = rig.create(3, 2, 2)
    for i in range(20):
        result_of(w.append(data(i)))
    before = sum(b.reads for b in rig.cluster.bookies.values())
    assert result_of(w.read(0, 19)) == [data(i) for i in range(20)]
    assert result_of(w.read(4, 5)) == [data(4), data(5)]
    assert sum(b.reads for b in rig.cluster.bookies.values()) - before == 3 + 2
    first = w.metadata.fragments[0][1]
    rig.bookie(first[1]).down = True
    for i in range(20, 30):
        result_of(w.append(data(i)))
    assert len(w.metadata.fragments) == 2  # the ensemble changed without first[1]
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=True))
    assert result_of(reader.read(0, 29)) == [data(i) for i in range(30)]
    assert result_of(reader.read(17, 23)) == [data(i) for i in range(17, 24)]


def test_striped_reads_from_bookies_too_old_for_strides_go_entry_by_entry() -> None:
    """Bookies that refuse strided reads (an older wire version) are read one entry at a
    time, all in parallel; an entry no replica has still fails the read."""
    rig = LedgerRig(3)
    w = rig.create(3, 2, 2)
    for i in range(12):
        result_of(w.append(data(i)))
    for b in rig.cluster.bookies.values():
        b.strided = False
    before = sum(b.reads for b in rig.cluster.bookies.values())
    assert result_of(w.read(0, 11)) == [data(i) for i in range(12)]
    assert sum(b.reads for b in rig.cluster.bookies.values()) - before == 12
    for address in w.metadata.write_set(7):
        rig.bookie(address).ledgers[w.ledger_id].entries.pop(7)
    assert isinstance(failure_of(w.read(0, 11)), NoSuchEntryError)


def test_delayed_acks_complete_on_the_clock_without_a_timeout() -> None:
    """Acks that take less than the add timeout complete when they arrive and replace no one."""
    rig = LedgerRig(3, add_timeout_s=2.0)
    w = rig.create(3, 3, 3)
    for b in rig.cluster.bookies.values():
        b.add_delay = 1.5
    ds = [w.append(data(i)) for i in range(20)]
    rig.clock.advance(1.0)
    assert not any(d.called for d in ds)
    rig.clock.advance(0.5)
    assert [result_of(d) for d in ds] == list(range(20))
    rig.clock.advance(10.0)
    assert len(rig.stored_metadata(w.ledger_id).fragments) == 1


class HeldRegistry(BookieRegistry):
    """Answers ``writable_bookies`` at once, or, once ``hold`` is set, when the test says so."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.hold = False
        self.waiting: list[Deferred[list[str]]] = []

    def writable_bookies(self) -> Deferred[list[str]]:
        if not self.hold:
            return succeed(list(self.addresses))
        d: Deferred[list[str]] = Deferred()
        self.waiting.append(d)
        return d

    def answer(self) -> None:
        self.waiting.pop(0).callback(list(self.addresses))


def test_failure_after_completion_still_replaces_the_bookie() -> None:
    """A bookie failing an add that already completed on the others is replaced anyway, from
    the next entry on, so later entries get their full write quorum."""
    rig = LedgerRig(4)
    w = rig.create(3, 3, 2)
    ensemble = w.metadata.fragments[0][1]
    rig.bookie(w.metadata.write_set(0)[2]).fail_adds = 1
    assert result_of(w.append(b"a")) == 0
    meta = rig.stored_metadata(w.ledger_id)
    assert [start for start, _ in meta.fragments] == [0, 1]
    assert w.metadata.write_set(0)[2] not in meta.fragments[1][1]
    assert set(ensemble) - set(meta.fragments[1][1]) == {w.metadata.write_set(0)[2]}


def test_close_waits_for_a_running_ensemble_change() -> None:
    """close_ledger during an ensemble change seals only after the change's CAS, at the LAC."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    cluster = FakeCluster(clock, 4)
    registry = HeldRegistry(cluster.addresses)
    client = BookKeeperClient(store, registry, cluster.connect, clock, rng=random.Random(2))
    w = result_of(client.create(LedgerConfig(3, 3, 2)))
    registry.hold = True
    cluster.bookies[w.metadata.write_set(0)[2]].fail_adds = 1
    assert result_of(w.append(b"a")) == 0
    assert registry.waiting, "the ensemble change waits for the registry"
    closing = w.close_ledger()
    assert not closing.called
    registry.answer()
    result_of(closing)
    meta = result_of(client.get_metadata(w.ledger_id))
    assert (meta.state, meta.last_entry_id, len(meta.fragments)) == (LedgerState.CLOSED, 0, 2)


def test_tailing_reader_follows_the_writer_to_a_new_ensemble() -> None:
    """A tailing reader whose whole known ensemble was replaced finds the LAC and the entries
    on the new one (the metadata is read after the LAC, so it covers it)."""
    rig = LedgerRig(4)
    w = rig.create(2, 2, 2)
    result_of(w.append(data(0)))
    reader = result_of(rig.new_client().open(w.ledger_id, recovery=False))
    old = w.metadata.fragments[0][1]
    for i, address in enumerate(old, start=1):
        rig.bookie(address).down = True
        assert result_of(w.append(data(i))) == i
    for i in range(3, 6):
        assert result_of(w.append(data(i))) == i
    assert not set(old) & set(w.metadata.fragments[-1][1])
    assert result_of(reader.read_last_add_confirmed()) == 4
    assert result_of(reader.read(1, 4)) == [data(i) for i in range(1, 5)]


def test_late_acks_of_a_replaced_bookie_are_ignored() -> None:
    """A slow bookie replaced after the add timeout answering later changes nothing: entries
    complete once, in order, and later adds go to the new ensemble only."""
    rig = LedgerRig(3, add_timeout_s=1.0)
    w = rig.create(2, 2, 2)
    slow = rig.bookie(w.metadata.fragments[0][1][0])
    slow.hold = True
    done: list[int] = []
    for i in range(3):
        w.append(data(i)).addCallback(done.append)
    rig.clock.advance(1.5)
    assert done == [0, 1, 2]
    slow.release()
    assert done == [0, 1, 2]
    adds_before = len(slow.adds)
    assert result_of(w.append(data(3))) == 3
    assert len(slow.adds) == adds_before


class _Listener:
    """Records what a ``WriteListener`` hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def adds_done(self, handle: object, last_entry_id: int) -> None:
        self.heard.append(("done", last_entry_id))

    def adds_failed(self, handle: object, error: Exception) -> None:
        self.heard.append(("failed", type(error).__name__))


def test_append_quiet_tells_its_listener_once_per_run_of_completions() -> None:
    """Adds acknowledged together are reported in one call naming the last of them; an add
    with a Deferred in between splits the run, and everything completes in entry order."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    listener = _Listener()
    order: list[object] = []
    w.append_quiet(b"a", listener)
    w.append_quiet(b"b", listener)
    w.append(b"c").addCallback(lambda e: order.append(("deferred", e)))
    w.append_quiet(b"d", listener)
    listener.heard = order  # one log of both kinds of completion
    w.entries_acked(bookie.address, [0, 1, 2, 3])  # one ADD_MULTI answer for all four
    assert order == [("done", 1), ("deferred", 2), ("done", 3)]
    assert w.last_add_confirmed == 3
    assert w.length == 4


def test_listeners_alternating_in_one_answer_each_hear_their_runs() -> None:
    """Runs of two listeners acknowledged together: each hears the last entry of each of its
    runs, in entry order, and sees the handle's LAC and length at least that far."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    heard: list[tuple[str, int, int, int]] = []

    class Seeing:
        def __init__(self, name: str) -> None:
            self.name = name

        def adds_done(self, handle: Any, last_entry_id: int) -> None:
            heard.append((self.name, last_entry_id, handle.last_add_confirmed, handle.length))

        def adds_failed(self, handle: object, error: Exception) -> None:
            raise AssertionError(error)

    a, b = Seeing("a"), Seeing("b")
    for listener, payload in ((a, b"1"), (a, b"22"), (b, b"333"), (b, b"4"), (a, b"55")):
        w.append_quiet(payload, listener)
    w.entries_acked(bookie.address, [0, 1, 2, 3, 4])
    assert [(n, e) for n, e, _, _ in heard] == [("a", 1), ("b", 3), ("a", 4)]
    assert all(lac >= e for _, e, lac, _ in heard)
    assert w.last_add_confirmed == 4
    assert w.length == 9


def test_append_quiet_failures_reach_the_listener_once() -> None:
    """When the ledger fails, the listener hears it once for its pending adds, and at once
    for an add made after."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    bookie = rig.bookie(w.metadata.fragments[0][1][0])
    bookie.hold = True
    listener = _Listener()
    for payload in (b"a", b"b", b"c"):
        w.append_quiet(payload, listener)
    bookie.crash()  # no spare bookie: the ensemble change fails every pending add
    rig.clock.advance(0)
    assert listener.heard == [("failed", "NotEnoughBookiesError")]
    w.append_quiet(b"d", listener)
    assert listener.heard[1:] == [("failed", "NotEnoughBookiesError")]
    assert w.last_add_confirmed == -1


def test_the_wire_record_is_the_stored_record_inside_an_add_record() -> None:
    """What the writer sends (made with one copy of the data) is the bookie wire's ADD record
    of the digest-protected record, so bookies store exactly what ``decode_record`` checks."""
    wire = encode_wire_record(5, 3, 2, 100, b"payload")
    assert wire == encode_add_record(5, 3, 2, encode_record(5, 3, 2, 100, b"payload"))


def test_a_prefixed_wire_record_is_the_record_of_prefix_and_data() -> None:
    """A prefix (a header the caller did not copy the data to prepend) makes the same wire
    record, checksums included, as the joined entry would."""
    wire = encode_wire_record(5, 3, 2, 100, b"load", b"pay")
    assert wire == encode_wire_record(5, 3, 2, 100, b"payload")


def test_the_wire_parts_are_the_wire_record_and_leave_the_data_uncopied() -> None:
    """``encode_wire_parts`` is ``encode_wire_record`` cut after its 8-byte head and before
    the data, whose object it hands on as is; its size is the overhead plus prefix and data."""
    data = b"load" * 100
    head, body, tail = encode_wire_parts(5, 3, 2, 100, data, b"pay")
    assert head + body + tail == encode_wire_record(5, 3, 2, 100, b"pay" + data)
    assert len(head) == 8
    assert tail is data
    assert len(head + body + tail) == _WIRE_OVERHEAD + 3 + len(data)


def test_append_quiet_with_prefixes_stores_prefix_and_data_as_one_entry() -> None:
    """Entries added with a prefix (one at a time or many) are stored, counted and read
    back as ``prefix + data``."""
    rig = LedgerRig(1)
    w = rig.create(1, 1, 1)
    listener = _Listener()
    w.append_quiet(b"-one", listener, b"h1")
    w.append_quiet_many([b"-two", b"-three"], listener, [b"h2", b"h3"])
    w.append_quiet(b"plain", listener)
    rig.clock.advance(0)
    assert listener.heard[-1] == ("done", 3)
    assert w.length == len(b"h1-oneh2-twoh3-threeplain")
    assert result_of(w.read(0, 3)) == [b"h1-one", b"h2-two", b"h3-three", b"plain"]


def test_append_quiet_many_adds_in_order_and_is_refused_whole_once_closing() -> None:
    """A group of quiet adds gets consecutive entries, each sent to its write set and
    reported by runs in entry order; after ``close_ledger`` the listener hears a refusal
    at once."""
    rig = LedgerRig(3)
    w = rig.create(3, 2, 2)
    for b in rig.cluster.bookies.values():
        b.hold = True
    listener = _Listener()
    w.append_quiet_many([b"a", b"b", b"c"], listener)
    for b in rig.cluster.bookies.values():
        assert sorted(e for _, e, _, _ in b.adds) == sorted(
            e for e in range(3) if b.address in w.metadata.write_set(e)
        )
    for b in rig.cluster.bookies.values():
        w.entries_acked(b.address, [0, 1, 2])  # each bookie answers its frame at once
    assert [kind for kind, _ in listener.heard] == ["done"] * len(listener.heard)
    done = [last for _, last in listener.heard]
    assert done == sorted(set(done))
    assert done[-1] == 2
    assert w.length == 3
    heard = len(listener.heard)
    w.close_ledger()
    w.append_quiet_many([b"d", b"e"], listener)
    assert listener.heard[heard:] == [("failed", "LedgerClosedError")]


def test_batched_answers_with_ack_quorum_one_complete_in_order_and_only_from_members() -> None:
    """With Qa 1 and every write set the whole ensemble, a bookie's answer completes the run
    it covers once the entries before it are complete, an answer ahead of a gap waits for it,
    and answers of a non-member or repeated by the second bookie change nothing."""
    rig = LedgerRig(3)
    w = rig.create(2, 2, 1)
    first, second = w.metadata.fragments[0][1]
    outsider = next(a for a in rig.cluster.bookies if a not in (first, second))
    for b in rig.cluster.bookies.values():
        b.hold = True
    listener = _Listener()
    for i in range(6):
        w.append_quiet(data(i), listener)
    w.entries_acked(outsider, [0, 1, 2])
    w.entries_acked(first, [2, 3])
    assert (listener.heard, w.last_add_confirmed) == ([], -1)
    w.entries_acked(second, [0, 1])
    assert (listener.heard, w.last_add_confirmed) == ([("done", 3)], 3)
    w.entries_acked(first, [0, 1, 2, 3])
    w.entries_acked(outsider, [4, 5])
    assert (listener.heard, w.last_add_confirmed) == ([("done", 3)], 3)
    w.entries_acked(second, [2, 3, 4, 5])
    assert (listener.heard, w.last_add_confirmed) == ([("done", 3), ("done", 5)], 5)
    assert w.length == sum(len(data(i)) for i in range(6))
