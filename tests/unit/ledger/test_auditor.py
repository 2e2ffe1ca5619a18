"""The auditor: its pure decisions, and whole audits over fake bookies, an in-memory metadata
store shared by several sessions (bookies, auditors, a writer) and a Clock."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from fake_bookie import FakeBookie, FakeCluster, result_of
from twisted.internet.task import Clock

from polybroker.ledger.api import LedgerConfig, LedgerMetadata, LedgerState
from polybroker.ledger.auditor import (
    AUDITOR_PATH,
    UNDERREPLICATED_PATH,
    Auditor,
    EntryCopy,
    FragmentRepair,
    copy_plan,
    current_auditor,
    ledger_ids,
    lost_bookies,
    marker_value,
    next_deadline,
    plan_ledger,
    with_fragment_replaced,
)
from polybroker.ledger.bookie.cookie import AVAILABLE_PATH
from polybroker.ledger.client import BookKeeperClient, decode_metadata, encode_metadata
from polybroker.ledger.registry import MetadataBookieRegistry
from polybroker.metadata.memory import MemoryMetadataStore


def meta(
    fragments: list[tuple[int, tuple[str, ...]]],
    state: LedgerState = LedgerState.CLOSED,
    last: int = 9,
    e: int = 3,
    qw: int = 2,
    qa: int = 2,
) -> LedgerMetadata:
    return LedgerMetadata(
        ledger_id=7,
        ensemble_size=e,
        write_quorum=qw,
        ack_quorum=qa,
        state=state,
        last_entry_id=last if state is LedgerState.CLOSED else -1,
        length=0,
        fragments=tuple(fragments),
        ctime_ms=0,
    )


# -- pure decisions ---------------------------------------------------------------------------


def test_ledger_ids_ignore_the_auditors_own_nodes() -> None:
    """Only numeric children of /ledgers are ledgers; the election and markers are not."""
    assert ledger_ids(["12", "auditor", "3", "underreplication"]) == [3, 12]


def test_a_bookie_is_lost_only_after_the_delay() -> None:
    """Absent bookies become lost once their delay passed; the next deadline is the earliest."""
    gone = {"a": 10.0, "b": 12.0}
    assert lost_bookies(gone, 13.0, 5.0) == set()
    assert next_deadline(gone, 13.0, 5.0) == 15.0
    assert lost_bookies(gone, 15.0, 5.0) == {"a"}
    assert next_deadline(gone, 15.0, 5.0) == 17.0
    assert lost_bookies(gone, 17.0, 5.0) == {"a", "b"}
    assert next_deadline(gone, 17.0, 5.0) is None
    assert lost_bookies(gone, 10.0, 0.0) == {"a"}


def test_a_closed_ledger_repairs_every_fragment_naming_the_lost_bookie() -> None:
    """Each fragment holding the lost bookie is planned with its own entry range."""
    m = meta([(0, ("a", "b", "c")), (5, ("a", "d", "c")), (8, ("e", "d", "c"))], last=9)
    plan = plan_ledger(m, {"a", "x"})
    assert plan.lost == ("a",)
    assert plan.repairs == (
        FragmentRepair(0, 4, ("a", "b", "c"), ("a",)),
        FragmentRepair(5, 7, ("a", "d", "c"), ("a",)),
    )
    assert not plan.waiting_for_writer
    last = plan_ledger(m, {"e"})
    assert last.repairs == (FragmentRepair(8, 9, ("e", "d", "c"), ("e",)),)
    assert not plan_ledger(m, {"x"}).under_replicated


def test_an_open_ledgers_last_fragment_is_left_to_its_writer() -> None:
    """The last fragment of an open (or recovering) ledger is never repaired, only waited on."""
    for state in (LedgerState.OPEN, LedgerState.IN_RECOVERY):
        m = meta([(0, ("a", "b", "c")), (5, ("a", "d", "c"))], state=state)
        plan = plan_ledger(m, {"a"})
        assert plan.repairs == (FragmentRepair(0, 4, ("a", "b", "c"), ("a",)),)
        assert plan.waiting_for_writer
        assert plan_ledger(m, {"d"}).repairs == ()
        assert plan_ledger(m, {"d"}).under_replicated


def test_an_empty_closed_ledger_is_repaired_without_copies() -> None:
    """A closed ledger with no entries still gets its dead bookie replaced, with nothing to copy."""
    m = meta([(0, ("a", "b", "c"))], last=-1)
    plan = plan_ledger(m, {"b"})
    assert plan.repairs == (FragmentRepair(0, -1, ("a", "b", "c"), ("b",)),)
    assert copy_plan(m, plan.repairs[0], {"b": "z"}) == []


def test_copies_are_the_entries_whose_write_set_held_the_lost_bookie() -> None:
    """E=3, Qw=2: entry e lives on positions e%3 and (e+1)%3; the lost one's entries go from the
    surviving member to the replacement."""
    m = meta([(0, ("a", "b", "c"))], last=5)
    repair = plan_ledger(m, {"b"}).repairs[0]
    copies = copy_plan(m, repair, {"b": "z"})
    # b is position 1: entries with e%3 == 1 (b first) or e%3 == 0 (b second).
    assert copies == [
        EntryCopy(0, ("a",), ("z",)),
        EntryCopy(1, ("c",), ("z",)),
        EntryCopy(3, ("a",), ("z",)),
        EntryCopy(4, ("c",), ("z",)),
    ]


def test_two_lost_bookies_of_one_write_set_leave_no_source() -> None:
    """When every member of a write set is lost there is nowhere to copy from: no sources."""
    m = meta([(0, ("a", "b", "c"))], last=2)
    repair = plan_ledger(m, {"a", "b"}).repairs[0]
    copies = copy_plan(m, repair, {"a": "y", "b": "z"})
    assert EntryCopy(0, (), ("y", "z")) in copies
    assert EntryCopy(1, ("c",), ("z",)) in copies


def test_the_switch_needs_the_fragment_unchanged() -> None:
    """The CAS content replaces exactly the planned fragment, and refuses one that moved on."""
    m = meta([(0, ("a", "b", "c")), (5, ("a", "d", "c"))], state=LedgerState.OPEN)
    new = with_fragment_replaced(m, 0, ("a", "b", "c"), ("z", "b", "c"))
    assert new is not None
    assert new.fragments == ((0, ("z", "b", "c")), (5, ("a", "d", "c")))
    assert with_fragment_replaced(m, 0, ("q", "b", "c"), ("z", "b", "c")) is None
    assert with_fragment_replaced(m, 3, ("a", "b", "c"), ("z", "b", "c")) is None
    # The open ledger's last fragment belongs to its writer.
    assert with_fragment_replaced(m, 5, ("a", "d", "c"), ("z", "d", "c")) is None


def test_the_marker_says_what_is_lost() -> None:
    """The marker names the lost bookies, since when, and whether a writer must act."""
    m = meta([(0, ("a", "b", "c")), (5, ("a", "d", "c"))], state=LedgerState.OPEN)
    doc = json.loads(marker_value(plan_ledger(m, {"a"}), 1234))
    assert doc == {"lostBookies": ["a"], "since": 1234, "fragments": [0], "waitingForWriter": True}


# -- whole audits -----------------------------------------------------------------------------


class Rig:
    """Fake bookies, each announced by a session of its own; a writer; auditors."""

    def __init__(self, bookies: int = 4, delay: float = 5.0) -> None:
        self.clock = Clock()
        self.store = MemoryMetadataStore(self.clock)
        self.cluster = FakeCluster(self.clock, bookies)
        self.delay = delay
        self.sessions: dict[str, MemoryMetadataStore] = {}
        for address in self.cluster.addresses:
            self.announce(address)
        self.registry = MetadataBookieRegistry(self.store)
        self.client = BookKeeperClient(
            self.store,
            self.registry,
            self.cluster.connect,
            self.clock,
            add_timeout_s=5.0,
            rng=random.Random(1),
        )
        self.auditors: list[Auditor] = []

    def announce(self, address: str) -> None:
        session = self.store.new_session()
        result_of(session.put(f"{AVAILABLE_PATH}/{address}", b"{}", ephemeral=True))
        self.sessions[address] = session

    def kill(self, address: str) -> None:
        """The bookie crashes: requests fail, its session ends (its node goes)."""
        self.cluster.bookies[address].crash()
        result_of(self.sessions.pop(address).close())

    def auditor(self, name: str = "auditor-1", **kw: Any) -> Auditor:
        session = self.store.new_session()
        a = Auditor(
            session,
            self.cluster.connect,
            self.clock,
            address=name,
            lost_bookie_recovery_delay_s=kw.pop("delay", self.delay),
            periodic_check_interval_s=kw.pop("interval", 60.0),
            rng=random.Random(len(self.auditors)),
            **kw,
        )
        result_of(a.start())
        self.auditors.append(a)
        return a

    def closed_ledger(self, entries: int = 12, cfg: tuple[int, int, int] = (3, 2, 2)) -> int:
        w = result_of(self.client.create(LedgerConfig(*cfg)))
        for i in range(entries):
            result_of(w.append(f"e{i}".encode()))
        result_of(w.close_ledger())
        return int(w.ledger_id)

    def metadata(self, ledger_id: int) -> LedgerMetadata:
        got = result_of(self.store.get(f"/ledgers/{ledger_id}"))
        return decode_metadata(got.value)

    def holders(self, ledger_id: int, entry_id: int) -> set[str]:
        return {
            a
            for a, b in self.cluster.bookies.items()
            if not b.down and entry_id in b.entry_ids(ledger_id)
        }

    def fully_replicated(self, ledger_id: int) -> bool:
        m = self.metadata(ledger_id)
        return all(
            set(m.write_set(e)) <= self.holders(ledger_id, e) for e in range(m.last_entry_id + 1)
        )

    def marker(self, ledger_id: int) -> dict[str, Any] | None:
        got = result_of(self.store.get(f"{UNDERREPLICATED_PATH}/{ledger_id}"))
        return None if got is None else json.loads(got.value)


def names(m: LedgerMetadata) -> set[str]:
    return {a for _, ens in m.fragments for a in ens}


def test_a_lost_bookie_is_re_replicated_after_the_delay() -> None:
    """Kill a bookie of a closed ledger: nothing moves before lostBookieRecoveryDelay; then the
    ledger is marked, every entry it held is copied from a survivor to a replacement, the
    metadata stops naming it and the marker is cleared."""
    rig = Rig(delay=5.0)
    ledger = rig.closed_ledger()
    auditor = rig.auditor()
    assert auditor.leading
    ensemble = rig.metadata(ledger).fragments[0][1]
    victim = ensemble[1]
    rig.kill(victim)
    rig.clock.advance(4.9)
    assert victim in names(rig.metadata(ledger))
    assert rig.marker(ledger) is None
    rig.clock.advance(0.2)
    m = rig.metadata(ledger)
    assert victim not in names(m)
    assert len(m.fragments) == 1
    assert rig.fully_replicated(ledger)
    assert rig.marker(ledger) is None
    assert auditor.last_result is not None
    assert auditor.last_result.repaired_fragments == 1
    assert auditor.last_result.copied_entries == 8  # two thirds of 12 entries held a copy
    (replacement,) = set(m.fragments[0][1]) - set(ensemble)
    assert replacement != victim
    # The copies were recovery adds (they pass fencing), of the very bytes a survivor held.
    adds = rig.cluster.bookies[replacement].adds
    assert adds
    assert all(recovery for (_, _, _, recovery) in adds)


def test_a_bookie_back_within_the_delay_is_not_re_replicated() -> None:
    """A bookie that announces itself again before its delay ended is no longer lost."""
    rig = Rig(delay=5.0)
    ledger = rig.closed_ledger()
    rig.auditor()
    before = rig.metadata(ledger)
    victim = before.fragments[0][1][0]
    result_of(rig.sessions.pop(victim).close())
    rig.clock.advance(3)
    rig.announce(victim)
    rig.clock.advance(10)
    assert rig.metadata(ledger) == before
    assert rig.marker(ledger) is None


def test_a_failed_copy_leaves_the_metadata_and_the_marker_and_is_redone() -> None:
    """Copies that cannot be made change no metadata (copy before switch); the ledger stays
    marked, and the retry completes the repair."""
    rig = Rig(bookies=4, delay=0.0)
    ledger = rig.closed_ledger()
    ensemble = rig.metadata(ledger).fragments[0][1]
    (spare,) = set(rig.cluster.addresses) - set(ensemble)
    rig.cluster.bookies[spare].fail_adds = 1
    auditor = rig.auditor()
    victim = ensemble[0]
    rig.kill(victim)
    assert rig.metadata(ledger).fragments[0][1] == ensemble
    marker = rig.marker(ledger)
    assert marker is not None
    assert marker["lostBookies"] == [victim]
    assert auditor.last_result is not None
    assert auditor.last_result.under_replicated == [ledger]
    rig.clock.advance(5.0)  # the retry
    m = rig.metadata(ledger)
    assert m.fragments[0][1] == tuple(spare if a == victim else a for a in ensemble)
    assert rig.fully_replicated(ledger)
    assert rig.marker(ledger) is None


def _repair_reads(rig: Rig, ledger: int, victim: str) -> tuple[int, int]:
    """Kill ``victim`` under a new auditor: (entries copied, reads the survivors served), once
    the ledger is fully replicated again."""
    ensemble = rig.metadata(ledger).fragments[0][1]
    survivors = [rig.cluster.bookies[a] for a in ensemble if a != victim]
    before = sum(b.reads for b in survivors)
    auditor = rig.auditor()
    rig.kill(victim)
    assert rig.fully_replicated(ledger)
    assert auditor.last_result is not None
    return auditor.last_result.copied_entries, sum(b.reads for b in survivors) - before


def test_copies_are_read_by_strided_chunks_from_the_survivors(monkeypatch: Any) -> None:
    """A residue's copies share their sources: they are read by strided reads, a bounded chunk
    at a time (here 10 entries), not one read per entry; every copy is made."""
    rig = Rig(bookies=4, delay=0.0)
    w = result_of(rig.client.create(LedgerConfig(3, 2, 2)))
    for i in range(300):
        result_of(w.append(b"%03d" % i))
    result_of(w.close_ledger())
    ledger = int(w.ledger_id)
    ensemble = rig.metadata(ledger).fragments[0][1]
    record = len(rig.cluster.bookies[ensemble[0]].ledgers[ledger].entries[0])
    monkeypatch.setattr("polybroker.ledger.auditor.COPY_CHUNK_BYTES", 10 * record)
    # Two residues of 100 entries each, 10 entries a chunk.
    assert _repair_reads(rig, ledger, ensemble[1]) == (200, 20)


def test_copies_from_bookies_refusing_strided_reads_are_read_entry_by_entry() -> None:
    """Survivors of an older wire version refuse strided reads: each entry is read alone, and
    the repair completes as before."""
    rig = Rig(bookies=4, delay=0.0)
    ledger = rig.closed_ledger(entries=30)
    ensemble = rig.metadata(ledger).fragments[0][1]
    for address in ensemble:
        rig.cluster.bookies[address].strided = False
    assert _repair_reads(rig, ledger, ensemble[0]) == (20, 20)


def test_a_corrupt_entry_in_a_strided_chunk_is_copied_from_another_source() -> None:
    """E=3, Qw=3: every entry has two survivors. An entry corrupt on the first one ends that
    chunk there (the entries before it are copied); it is read from the second, and the
    replacement gets the good bytes."""
    rig = Rig(bookies=4, delay=0.0)
    ledger = rig.closed_ledger(entries=30, cfg=(3, 3, 2))
    ensemble = rig.metadata(ledger).fragments[0][1]
    good = rig.cluster.bookies[ensemble[0]].ledgers[ledger].entries[12]
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    rig.cluster.bookies[ensemble[0]].ledgers[ledger].entries[12] = bytes(bad)
    auditor = rig.auditor()
    rig.kill(ensemble[2])
    assert rig.fully_replicated(ledger)
    assert auditor.last_result is not None
    assert auditor.last_result.copied_entries == 30
    (replacement,) = set(rig.metadata(ledger).fragments[0][1]) - set(ensemble)
    assert rig.cluster.bookies[replacement].ledgers[ledger].entries[12] == good


def test_no_spare_bookie_keeps_the_ledger_marked() -> None:
    """With no bookie outside the ensemble, nothing changes but the marker."""
    rig = Rig(bookies=3, delay=0.0)
    ledger = rig.closed_ledger()
    rig.auditor()
    before = rig.metadata(ledger)
    rig.kill(before.fragments[0][1][2])
    assert rig.metadata(ledger) == before
    assert rig.marker(ledger) is not None
    rig.announce("10.0.0.9:3181")  # a new bookie joins: the next audit uses it
    rig.cluster.bookies["10.0.0.9:3181"] = FakeBookie("10.0.0.9:3181", rig.clock)
    rig.clock.advance(5.0)
    assert "10.0.0.9:3181" in names(rig.metadata(ledger))
    assert rig.fully_replicated(ledger)
    assert rig.marker(ledger) is None


def test_only_one_auditor_leads_and_another_takes_over() -> None:
    """Two auditors: one leads; when its session ends the other leads and does the repair."""
    rig = Rig(delay=0.0)
    ledger = rig.closed_ledger()
    first = rig.auditor("bookie-a")
    second = rig.auditor("bookie-b")
    assert first.leading
    assert not second.leading
    assert result_of(_deferred(current_auditor(rig.store))) == "bookie-a"
    # The leader's session expires (its process froze or died): it stops acting at once.
    first_session = rig.auditors[0]._store
    assert isinstance(first_session, MemoryMetadataStore)
    first_session.expire_session(reestablish=False)
    assert not first.leading
    assert second.leading
    assert result_of(_deferred(current_auditor(rig.store))) == "bookie-b"
    victim = rig.metadata(ledger).fragments[0][1][0]
    rig.kill(victim)
    assert victim not in names(rig.metadata(ledger))
    assert rig.fully_replicated(ledger)


def test_a_stopped_auditor_gives_the_role_up() -> None:
    """stop() releases the election node at once, so the next contender leads."""
    rig = Rig()
    first = rig.auditor("bookie-a")
    second = rig.auditor("bookie-b")
    result_of(first.stop())
    assert not first.leading
    assert second.leading
    assert result_of(rig.store.get(AUDITOR_PATH)) is not None


def test_an_open_ledgers_old_fragment_is_repaired_and_its_writer_goes_on() -> None:
    """The writer replaced a dead bookie (ensemble change); the auditor re-replicates the
    fragment before the change; the writer keeps writing, survives a later ensemble change
    (the metadata version moved under it) and closes the ledger."""
    rig = Rig(bookies=5, delay=0.0)
    w = result_of(rig.client.create(LedgerConfig(3, 2, 2)))
    for i in range(6):
        result_of(w.append(f"e{i}".encode()))
    auditor = rig.auditor()
    victim = w.metadata.fragments[0][1][1]
    rig.kill(victim)
    for i in range(6, 12):
        result_of(w.append(f"e{i}".encode()))
    m = rig.metadata(w.ledger_id)
    assert len(m.fragments) == 2
    assert victim not in names(m)  # the old fragment was re-replicated, the writer did the rest
    assert auditor.last_result is not None
    assert rig.marker(w.ledger_id) is None
    # Another bookie of the live ensemble dies: the writer's ensemble change must still work.
    second = m.fragments[-1][1][0]
    rig.kill(second)
    for i in range(12, 18):
        assert result_of(w.append(f"e{i}".encode())) == i
    result_of(w.close_ledger())
    final = rig.metadata(w.ledger_id)
    assert final.state is LedgerState.CLOSED
    assert final.last_entry_id == 17
    assert second not in names(final)
    assert rig.fully_replicated(w.ledger_id)
    r = result_of(rig.client.open(w.ledger_id))
    assert result_of(r.read(0, 17)) == [f"e{i}".encode() for i in range(18)]


def test_an_open_last_fragment_waits_for_its_writer_then_is_repaired_once_closed() -> None:
    """A lost bookie in an open ledger's last fragment is only marked; when the ledger is closed
    (without a further add) the auditor sees the change and repairs it."""
    rig = Rig(delay=0.0)
    w = result_of(rig.client.create(LedgerConfig(3, 2, 2)))
    for i in range(6):
        result_of(w.append(f"e{i}".encode()))
    rig.auditor()
    victim = w.metadata.fragments[0][1][2]
    rig.kill(victim)
    marker = rig.marker(w.ledger_id)
    assert marker is not None
    assert marker["waitingForWriter"] is True
    assert victim in names(rig.metadata(w.ledger_id))
    result_of(w.close_ledger())
    m = rig.metadata(w.ledger_id)
    assert victim not in names(m)
    assert rig.fully_replicated(w.ledger_id)
    assert rig.marker(w.ledger_id) is None


def test_a_lost_cas_is_read_again_and_keeps_the_other_change() -> None:
    """A metadata change between the copy and the switch (custom field) is kept: the switch is
    retried on the new version."""
    rig = Rig(delay=0.0)
    ledger = rig.closed_ledger()
    path = f"/ledgers/{ledger}"
    original_put = rig.store.put
    bumped = [False]
    auditor = rig.auditor()
    session = auditor._store
    session_put = session.put

    def racing_put(p: str, value: bytes, expected_version: int | None = None, **kw: Any) -> Any:
        if p == path and not bumped[0]:
            bumped[0] = True
            got = result_of(rig.store.get(path))
            m = decode_metadata(got.value)
            changed = LedgerMetadata(**{**m.__dict__, "custom": {"k": "v"}})
            result_of(original_put(path, encode_metadata(changed), got.stat.version))
        return session_put(p, value, expected_version, **kw)

    session.put = racing_put  # type: ignore[method-assign]
    victim = rig.metadata(ledger).fragments[0][1][0]
    rig.kill(victim)
    m = rig.metadata(ledger)
    assert bumped[0]
    assert m.custom == {"k": "v"}
    assert victim not in names(m)
    assert rig.fully_replicated(ledger)


def _deferred(coro: Any) -> Any:
    from twisted.internet.defer import Deferred

    return Deferred.fromCoroutine(coro)


def test_a_deposed_auditor_writes_nothing_and_the_successor_repairs() -> None:
    """The leader loses its session while its copies are in flight: once they complete it
    switches nothing; the new leader copies again and makes the one metadata change."""
    rig = Rig(bookies=4, delay=0.0)
    ledger = rig.closed_ledger()
    ensemble = rig.metadata(ledger).fragments[0][1]
    (spare,) = set(rig.cluster.addresses) - set(ensemble)
    rig.cluster.bookies[spare].hold = True
    first = rig.auditor("bookie-a")
    second = rig.auditor("bookie-b")
    version = result_of(rig.store.get(f"/ledgers/{ledger}")).stat.version
    victim = ensemble[2]
    rig.kill(victim)
    assert rig.cluster.bookies[spare].held  # the leader's copies wait on the spare
    session = first._store
    assert isinstance(session, MemoryMetadataStore)
    session.expire_session(reestablish=False)
    assert not first.leading
    assert second.leading
    rig.cluster.bookies[spare].hold = False
    rig.cluster.bookies[spare].release()
    got = result_of(rig.store.get(f"/ledgers/{ledger}"))
    assert got.stat.version == version + 1  # one switch, by the successor
    m = decode_metadata(got.value)
    assert m.fragments[0][1] == tuple(spare if a == victim else a for a in ensemble)
    assert rig.fully_replicated(ledger)
    assert rig.marker(ledger) is None


def test_a_failed_audit_is_retried() -> None:
    """An audit that fails on the metadata store is run again after RETRY_S."""
    rig = Rig(delay=0.0)
    ledger = rig.closed_ledger()
    auditor = rig.auditor()
    session = auditor._store
    real_get = session.get
    failing = [True]

    def flaky_get(path: str) -> Any:
        from twisted.internet.defer import fail

        from polybroker.metadata.api import ConnectionLossError

        if failing[0] and path.startswith("/ledgers/"):
            return fail(ConnectionLossError("connection lost"))
        return real_get(path)

    session.get = flaky_get  # type: ignore[method-assign]
    victim = rig.metadata(ledger).fragments[0][1][0]
    audits = auditor.audits
    rig.kill(victim)
    assert auditor.audits == audits  # it failed
    assert victim in names(rig.metadata(ledger))
    failing[0] = False
    rig.clock.advance(5.0)
    assert auditor.audits == audits + 1
    assert victim not in names(rig.metadata(ledger))
    assert rig.fully_replicated(ledger)


def test_the_periodic_check_audits_again() -> None:
    """Every auditorPeriodicCheckInterval seconds the leader scans again, and only the leader."""
    rig = Rig()
    rig.closed_ledger()
    leader = rig.auditor("bookie-a", interval=60.0)
    other = rig.auditor("bookie-b", interval=60.0)
    before = leader.audits
    rig.clock.advance(59)
    assert leader.audits == before
    rig.clock.advance(1)
    assert leader.audits == before + 1
    rig.clock.advance(60)
    rig.clock.advance(60)
    assert leader.audits == before + 3
    assert other.audits == 0
    assert leader.last_result is not None
    assert leader.last_result.ledgers == 1
    assert leader.last_result.under_replicated == []


def test_a_write_set_lost_whole_waits_with_backoff_until_a_member_returns() -> None:
    """Two lost members of one write set leave some entries with no copy to read: the repair
    fails and is retried after 5, then 10 s (backing off), changing nothing; once one member
    comes back, the other's entries are copied from it and the ledger is whole again."""
    rig = Rig(bookies=5, delay=0.0)
    ledger = rig.closed_ledger()
    before = rig.metadata(ledger)
    a, b, _ = before.fragments[0][1]
    rig.kill(a)
    rig.kill(b)
    auditor = rig.auditor()  # both are gone when it first looks
    assert rig.metadata(ledger) == before
    assert rig.marker(ledger) is not None
    audits = auditor.audits
    rig.clock.advance(5.0)
    assert auditor.audits == audits + 1
    rig.clock.advance(5.0)
    assert auditor.audits == audits + 1  # backing off: the next retry is 10 s after
    rig.clock.advance(5.0)
    assert auditor.audits == audits + 2
    assert rig.metadata(ledger) == before
    rig.cluster.bookies[b].down = False  # b restarts with its data and announces itself
    rig.announce(b)
    m = rig.metadata(ledger)
    assert a not in names(m)
    assert b in names(m)
    assert rig.fully_replicated(ledger)
    assert rig.marker(ledger) is None
