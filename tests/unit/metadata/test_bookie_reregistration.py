"""A bookie announces itself again after its metadata session expired (``Reregistration`` of
``polybroker bookie``), over the in-memory store's modelled expiry and a Clock."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.ledger.bookie.cookie import AVAILABLE_PATH, COOKIES_PATH, Cookie, register
from polybroker.ledger.bookie.main import REREGISTER_RETRY_S, Reregistration
from polybroker.metadata.api import ConnectionLossError, Stat
from polybroker.metadata.memory import MemoryMetadataStore

ADDRESS = "127.0.0.1:3181"
NODE = f"{AVAILABLE_PATH}/{ADDRESS}"


class FlakyStore(MemoryMetadataStore):
    """Fails the next ``failures`` puts with ConnectionLossError."""

    failures = 0

    def put(self, path: str, value: bytes, expected_version: int | None = None, **kw: Any):  # type: ignore[no-untyped-def,override]
        if self.failures:
            self.failures -= 1
            return fail(ConnectionLossError("down"))
        d: Deferred[Stat] = super().put(path, value, expected_version, **kw)
        return d


def setup(clock: Clock) -> tuple[FlakyStore, Cookie, list[Failure], Reregistration]:
    store = FlakyStore(clock)
    cookie = Cookie("bookie-1", 1, ("journal", "ledgers"), 0)
    register(store, ADDRESS, cookie)
    conflicts: list[Failure] = []
    rr = Reregistration(store, ADDRESS, cookie, clock, conflicts.append)
    return store, cookie, conflicts, rr


def node(store: MemoryMetadataStore) -> Any:
    got: list[Any] = []
    store.get(NODE).addCallback(got.append)
    return got[0]


def test_an_expired_session_is_followed_by_a_new_announcement() -> None:
    clock = Clock()
    store, _, conflicts, _ = setup(clock)
    old_session = store.session_id
    assert node(store).stat.ephemeral
    store.expire_session()
    assert store.session_id != old_session
    again = node(store)
    assert again is not None
    assert again.stat.ephemeral
    assert conflicts == []
    assert clock.getDelayedCalls() == []


def test_announcing_again_is_retried_while_the_store_fails() -> None:
    clock = Clock()
    store, _, conflicts, _ = setup(clock)
    store.failures = 2
    store.expire_session()
    assert node(store) is None
    clock.advance(REREGISTER_RETRY_S)
    assert node(store) is None
    clock.advance(REREGISTER_RETRY_S)
    assert node(store) is not None
    assert clock.getDelayedCalls() == []
    assert conflicts == []


def test_another_identity_at_the_address_stops_the_bookie() -> None:
    clock = Clock()
    store, _, conflicts, _ = setup(clock)
    other = store.new_session()

    def take_over(event: Any) -> None:
        # While the session is lost, a wiped bookie registers under the same address.
        if event.value == "session_lost":
            other.put(f"{COOKIES_PATH}/{ADDRESS}", Cookie("bookie-2", 1, (), 0).to_bytes())

    store._listeners.insert(0, take_over)
    store.expire_session()
    assert node(store) is None
    assert len(conflicts) == 1
    assert "bookie-2" in conflicts[0].getErrorMessage()
    assert clock.getDelayedCalls() == []


def test_a_stopped_reregistration_does_nothing() -> None:
    clock = Clock()
    store, _, _, rr = setup(clock)
    store.failures = 1
    store.expire_session()
    assert len(clock.getDelayedCalls()) == 1
    rr.stop()
    assert clock.getDelayedCalls() == []
    store.expire_session()
    assert node(store) is None
