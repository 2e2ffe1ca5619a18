"""EphemeralClaim (Rules C1-C4 of ``polybroker/metadata/claim.py``) over the in-memory store,
whose sessions model ZooKeeper's (expiry included), driven synchronously."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from polybroker.metadata.api import ConnectionLossError, SessionEvent, Stat
from polybroker.metadata.claim import ClaimState, EphemeralClaim
from polybroker.metadata.memory import MemoryMetadataStore

PATH = "/bundles/public/default/0x00000000_0x40000000"


def result_of(d: Deferred[Any]) -> Any:
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    return out[0]


class Claimant:
    """A claim and the states it went through."""

    def __init__(self, store: MemoryMetadataStore, name: str, contend: bool = False) -> None:
        self.states: list[ClaimState] = []
        self.claim = EphemeralClaim(
            store, PATH, name.encode(), contend=contend, on_change=self.states.append
        )

    def start(self) -> ClaimState:
        return result_of(self.claim.start())


def holder(store: MemoryMetadataStore) -> bytes | None:
    got = result_of(store.get(PATH))
    return None if got is None else got.value


def test_the_first_claimant_holds_and_a_non_contending_second_is_released() -> None:
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    first, second = Claimant(a, "a"), Claimant(b, "b")
    assert first.start() is ClaimState.HELD
    assert first.claim.held
    assert result_of(a.get(PATH)).stat.ephemeral
    assert second.start() is ClaimState.RELEASED
    assert holder(a) == b"a"


def test_a_contending_claimant_takes_over_when_the_holder_releases() -> None:
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    first, second = Claimant(a, "a"), Claimant(b, "b", contend=True)
    first.start()
    assert second.start() is ClaimState.PENDING
    result_of(first.claim.release())
    assert first.claim.state is ClaimState.RELEASED
    assert second.states == [ClaimState.HELD]
    assert holder(a) == b"b"
    result_of(first.claim.release())  # idempotent


def test_a_lost_session_gives_the_claim_up_and_takes_it_again() -> None:
    """Nobody else wants it: PENDING on the loss, HELD again on the new session."""
    a = MemoryMetadataStore(Clock())
    first = Claimant(a, "a")
    first.start()
    a.expire_session()
    assert first.states == [ClaimState.HELD, ClaimState.PENDING, ClaimState.HELD]
    assert holder(a) == b"a"


def test_a_lost_session_lets_a_contender_win_and_the_old_holder_is_released() -> None:
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    first, second = Claimant(a, "a"), Claimant(b, "b", contend=True)
    first.start()
    second.start()
    a.expire_session()
    assert second.claim.held
    assert holder(a) == b"b"
    assert first.states == [ClaimState.HELD, ClaimState.PENDING, ClaimState.RELEASED]
    assert not first.claim.held


def test_a_contending_old_holder_waits_for_its_turn_again() -> None:
    a = MemoryMetadataStore(Clock())
    b = a.new_session()
    first, second = Claimant(a, "a", contend=True), Claimant(b, "b", contend=True)
    first.start()
    second.start()
    a.expire_session()
    assert first.claim.state is ClaimState.PENDING
    result_of(second.claim.release())
    assert first.claim.held
    assert holder(a) == b"a"


def test_a_lost_connection_suspends_the_claim_until_the_same_session_is_back() -> None:
    a = MemoryMetadataStore(Clock())
    first = Claimant(a, "a")
    first.start()
    a._emit(SessionEvent.CONNECTION_LOST)
    assert first.claim.state is ClaimState.SUSPENDED
    assert not first.claim.held
    a._emit(SessionEvent.RECONNECTED)
    assert first.claim.held


def test_a_node_deleted_by_someone_else_is_lost() -> None:
    """An admin deleting the node (an unload) ends a non-contending claim."""
    a = MemoryMetadataStore(Clock())
    admin = a.new_session()
    first = Claimant(a, "a")
    first.start()
    result_of(admin.delete(PATH))
    assert first.claim.state is ClaimState.RELEASED
    assert holder(a) is None


class LosingAnswers(MemoryMetadataStore):
    """Applies the next put but answers ConnectionLossError (an unknown outcome)."""

    lose_next = False

    def put(self, path: str, value: bytes, expected_version: int | None = None, **kw: Any):  # type: ignore[no-untyped-def,override]
        d: Deferred[Stat] = super().put(path, value, expected_version, **kw)
        if self.lose_next:
            self.lose_next = False
            result_of(d)
            return fail(ConnectionLossError("answer lost"))
        return d


def test_a_claim_whose_answer_was_lost_finds_its_own_node() -> None:
    a = LosingAnswers(Clock())
    a.lose_next = True
    first = Claimant(a, "a")
    assert first.start() is ClaimState.PENDING
    a._emit(SessionEvent.RECONNECTED)
    assert first.claim.held
    assert holder(a) == b"a"


def test_a_released_claim_stops_listening_to_the_session() -> None:
    """Claims come and go (bundles move): a finished one leaves no listener behind."""
    store = MemoryMetadataStore(Clock())
    for i in range(50):
        claim = EphemeralClaim(store, f"/b/{i}", b"me")
        result_of(claim.start())
        result_of(claim.release())
    assert len(store._listeners) == 0


def test_a_node_left_by_an_earlier_run_is_taken_over_at_once() -> None:
    """A restarted claimant (new session, new value) takes over the node its dead predecessor's
    still-live session holds (Rule C5), whether or not it contends; a node another claimant
    holds is left alone."""
    old = MemoryMetadataStore(Clock())
    Claimant(old, "b#1").start()
    for contend in (False, True):
        new = old.new_session()
        states: list[ClaimState] = []
        claim = EphemeralClaim(
            new,
            PATH,
            b"b#2",
            contend=contend,
            on_change=states.append,
            supersedes=lambda v: v.startswith(b"b#") and v != b"b#2",
        )
        assert result_of(claim.start()) is ClaimState.HELD
        assert holder(old) == b"b#2"
        assert result_of(new.get(PATH)).stat.ephemeral
        assert states == [ClaimState.HELD]
        result_of(claim.release())
        Claimant(old, "b#1").start()
    other = old.new_session()
    taker = EphemeralClaim(other, PATH, b"c#1", supersedes=lambda v: v.startswith(b"c#"))
    assert result_of(taker.start()) is ClaimState.RELEASED
    assert holder(old) == b"b#1"
