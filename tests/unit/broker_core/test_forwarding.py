"""Unit tests of the Broker API's forwarding routes: ``publish`` and ``subscribe`` with
``forward=True`` serve owned topics here and hand others to the ``Forwarder``, retrying what a new
lookup may cure; callers that do not opt in keep getting ``NotOwnerError``. Also the cluster-wide
topic watch that wildcard subscribers follow."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, failure_of, result_of

from polybroker.broker_core.consumer import Consumer, Delivery, SubType
from polybroker.broker_core.errors import ServiceNotReadyError, TopicNotFoundError
from polybroker.broker_core.forwarding import Forwarder, ForwardingError, RemoteConsumer
from polybroker.broker_core.ownership import BrokerInfo, NotOwnerError, Ownership
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.ledger.api import InitialPosition, Position
from polybroker.metadata.memory import MemoryMetadataStore

LOCAL = BrokerInfo("a:8080", "http://a:8080", "pulsar://a:6650")
OWNER = BrokerInfo("b:8080", "http://b:8080", "pulsar://b:6650")
MINE = "persistent://public/default/mine"
THEIRS = "persistent://public/default/theirs"


class FakeOwnership(Ownership):
    """Owns every topic but those in ``remote`` (topic -> owner, or an error to raise)."""

    def __init__(self) -> None:
        self.local = LOCAL
        self.remote: dict[str, BrokerInfo | Exception] = {}
        self.acquired: list[str] = []

    @property
    def clustered(self) -> bool:
        return True

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        raise NotImplementedError

    def acquire(self, topic: str) -> Deferred[None]:
        self.acquired.append(topic)
        got = self.remote.get(topic)
        if got is None:
            return succeed(None)
        if isinstance(got, Exception):
            return fail(got)
        return fail(NotOwnerError(f"{topic} is served by {got.broker_id}", got))

    def owns(self, topic: str) -> bool:
        return topic not in self.remote

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([LOCAL, OWNER])


class FakeRemote(RemoteConsumer):
    def __init__(self) -> None:
        self.flowed = 0

    @property
    def closed(self) -> bool:
        return False

    def flow(self, permits: int) -> None:
        self.flowed += permits

    def ack(self, positions: Any) -> Deferred[None]:
        return succeed(None)

    def ack_batch_index(self, position: Position, acked: int, size: int) -> Deferred[None]:
        return succeed(None)

    def ack_cumulative(self, position: Position, acked: int | None = None) -> Deferred[None]:
        return succeed(None)

    def redeliver(self, positions: Any = None) -> None:
        pass

    def close(self) -> Deferred[None]:
        return succeed(None)

    def unsubscribe(self) -> Deferred[None]:
        return succeed(None)


class FakeForwarder(Forwarder):
    """Records calls; answers from ``outcomes`` (one per call, then success)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str, bytes, int]] = []
        self.subscribed: list[tuple[str, str, str, SubType, InitialPosition, bool, bool]] = []
        self.outcomes: list[Exception] = []

    def _next(self) -> Exception | None:
        return self.outcomes.pop(0) if self.outcomes else None

    def publish(
        self, owner: BrokerInfo, topic: str, data: bytes, num_messages: int = 1
    ) -> Deferred[Position]:
        self.published.append((owner.broker_id, topic, data, num_messages))
        error = self._next()
        return fail(error) if error else succeed(Position(9, len(self.published)))

    def subscribe(
        self,
        owner: BrokerInfo,
        topic: str,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        initial_position: InitialPosition = InitialPosition.LATEST,
        *,
        durable: bool = True,
        create_topic: bool = True,
    ) -> Deferred[RemoteConsumer]:
        self.subscribed.append(
            (
                owner.broker_id,
                topic,
                subscription,
                sub_type,
                initial_position,
                durable,
                create_topic,
            )
        )
        error = self._next()
        return fail(error) if error else succeed(FakeRemote())

    def close(self) -> Deferred[None]:
        return succeed(None)


class Sink:
    """A handler's consumer that keeps deliveries."""

    consumer_id = 1
    consumer_name = "sink"
    priority_level = 0

    def __init__(self) -> None:
        self.got: list[Delivery] = []

    def send_entries(self, deliveries: list[Delivery]) -> None:
        self.got.extend(deliveries)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        pass


class Broker:
    def __init__(self) -> None:
        self.clock = Clock()
        self.service = BrokerService(
            FakeLedgerFactory(self.clock.seconds),
            self.clock,
            Config({"statsUpdateFrequencyInSecs": 0}),
            FakeMetadataStore(),
        )
        self.ownership = FakeOwnership()
        self.ownership.remote[THEIRS] = OWNER
        self.service.ownership = self.ownership
        self.forwarder = FakeForwarder()
        self.service.forwarder = self.forwarder


def test_without_opting_in_a_foreign_topic_fails_with_not_owner() -> None:
    """Pulsar and Kafka callers do not opt in: they still get NotOwnerError (and redirect)."""
    b = Broker()
    err = failure_of(b.service.publish(THEIRS, b"x"))
    assert isinstance(err, NotOwnerError)
    assert err.owner == OWNER
    assert isinstance(failure_of(b.service.subscribe(THEIRS, "s", Sink())), NotOwnerError)
    assert b.forwarder.published == []
    assert b.forwarder.subscribed == []


def test_forwarded_publish_goes_to_the_owner_and_fires_with_its_position() -> None:
    """With forward=True a foreign topic's publish goes to its owner with the entry's bytes."""
    b = Broker()
    entry = result_of(b.service.publish(THEIRS, b"data", 3, forward=True, publish_time_ms=77))
    assert b.forwarder.published == [(OWNER.broker_id, THEIRS, b"data", 3)]
    assert entry is not None
    assert entry.position == Position(9, 1)
    assert (entry.num_messages, entry.publish_time_ms, entry.data) == (3, 77, b"data")
    assert THEIRS not in b.service.topics


def test_forwarding_callers_are_served_locally_for_owned_topics() -> None:
    """An owned topic is served here even with forward=True: nothing is forwarded."""
    b = Broker()
    entry = result_of(b.service.publish(MINE, b"local", forward=True))
    assert entry is not None
    assert entry.data == b"local"
    sink = Sink()
    server = result_of(
        b.service.subscribe(
            MINE, "s", sink, initial_position=InitialPosition.EARLIEST, forward=True
        )
    )
    server.flow(10)
    b.clock.advance(0)
    assert [d.entry.data for d in sink.got] == [b"local"]
    assert b.forwarder.published == []
    assert b.forwarder.subscribed == []


def test_forwarded_subscribe_returns_the_remote_consumer() -> None:
    """A foreign topic's subscribe is forwarded with its type, position, durability and
    creation flag, and fires with the forwarder's consumer."""
    b = Broker()
    remote = result_of(
        b.service.subscribe(
            THEIRS,
            "mqtt-x",
            Sink(),
            SubType.SHARED,
            InitialPosition.EARLIEST,
            durable=False,
            create_topic=False,
            forward=True,
        )
    )
    assert isinstance(remote, FakeRemote)
    assert b.forwarder.subscribed == [
        (OWNER.broker_id, THEIRS, "mqtt-x", SubType.SHARED, InitialPosition.EARLIEST, False, False)
    ]


def test_curable_failures_are_retried_with_a_new_lookup() -> None:
    """A ForwardingError (owner gone) is retried after a backoff; so is a topic not owned by
    anyone yet; the call succeeds once the route works."""
    b = Broker()
    b.forwarder.outcomes = [ForwardingError("owner gone"), ForwardingError("still gone")]
    d = b.service.publish(THEIRS, b"x", forward=True)
    assert not b.forwarder.published[1:]
    b.clock.advance(0.05)
    assert len(b.forwarder.published) == 2
    b.clock.advance(0.1)
    assert len(b.forwarder.published) == 3
    assert result_of(d) is not None
    # The owner died and this broker took the bundle over: the retry is served locally.
    b.forwarder.outcomes = [ForwardingError("owner gone")]
    d = b.service.publish(THEIRS, b"y", forward=True)
    del b.ownership.remote[THEIRS]
    b.clock.advance(0.05)
    entry = result_of(d)
    assert entry is not None
    assert b.service.topics[THEIRS] is not None
    assert len(b.forwarder.published) == 4


def test_retries_are_bounded_and_other_errors_are_not_retried() -> None:
    """Retries stop after forward_retry_s with the last error; an owner's refusal that a
    lookup cannot cure (topic not found) fails at once."""
    b = Broker()
    b.service.forward_retry_s = 2.0
    b.ownership.remote[THEIRS] = ServiceNotReadyError("bundle not available now")
    d = b.service.publish(THEIRS, b"x", forward=True)
    b.clock.pump([0.5] * 8)
    assert isinstance(failure_of(d), ServiceNotReadyError)
    b.ownership.remote[THEIRS] = OWNER
    b.forwarder.outcomes = [TopicNotFoundError("no such topic")]
    d = b.service.subscribe(THEIRS, "s", Sink(), create_topic=False, forward=True)
    assert isinstance(failure_of(d), TopicNotFoundError)
    assert len(b.forwarder.subscribed) == 1


def test_an_owner_without_a_pulsar_address_is_not_forwarded_to() -> None:
    """NotOwnerError without a usable owner is retried like an unowned bundle, then fails."""
    b = Broker()
    b.service.forward_retry_s = 0.5
    b.ownership.remote[THEIRS] = BrokerInfo("c:8080", "http://c:8080", "")
    d = b.service.publish(THEIRS, b"x", forward=True)
    b.clock.pump([0.1] * 10)
    assert isinstance(failure_of(d), NotOwnerError)
    assert b.forwarder.published == []


@pytest.mark.parametrize("root", ["/managed-ledgers", None])
def test_topics_created_anywhere_in_the_cluster_are_reported(root: str | None) -> None:
    """watch_namespace_topics reports each managed ledger that appears in the namespace, once,
    and nothing after it is stopped; without a ledger root nothing is watched."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    other = store.new_session()
    service = BrokerService(
        FakeLedgerFactory(clock.seconds), clock, Config({"statsUpdateFrequencyInSecs": 0}), store
    )
    service.ledger_names_root = root
    prefix = "/managed-ledgers/public/default/persistent"
    result_of(other.put("/managed-ledgers", b""))
    result_of(other.put("/managed-ledgers/public", b""))
    result_of(other.put("/managed-ledgers/public/default", b""))
    result_of(other.put(prefix, b""))
    result_of(other.put(f"{prefix}/old", b"{}"))
    clock.advance(0)
    seen: list[str] = []
    stop = service.watch_namespace_topics("public/default", seen.append)
    clock.advance(0)
    result_of(other.put(f"{prefix}/a%2Fb", b"{}"))
    clock.advance(0)
    result_of(other.put(f"{prefix}/a%2Fb", b"{1}"))
    result_of(other.put(f"{prefix}/c", b"{}"))
    clock.advance(0)
    if root is None:
        assert seen == []
        return
    assert seen == ["persistent://public/default/a/b", "persistent://public/default/c"]
    stop()
    result_of(other.put(f"{prefix}/d", b"{}"))
    clock.advance(0)
    assert seen[-1] == "persistent://public/default/c"


def test_the_owner_is_remembered_until_a_call_there_fails() -> None:
    """Forwarded calls after the first go straight to the owner (no ownership round trip per
    message); once a call there fails, the topic is looked up again."""
    b = Broker()
    for i in range(3):
        result_of(b.service.publish(THEIRS, b"m%d" % i, forward=True))
    result_of(b.service.subscribe(THEIRS, "s", Sink(), forward=True))
    assert b.ownership.acquired == [THEIRS]
    assert len(b.forwarder.published) == 3
    # The owner died; this broker took the bundle over.
    b.forwarder.outcomes = [ForwardingError("owner gone")]
    del b.ownership.remote[THEIRS]
    d = b.service.publish(THEIRS, b"after", forward=True)
    b.clock.advance(0.05)
    entry = result_of(d)
    assert entry is not None
    assert b.ownership.acquired == [THEIRS, THEIRS]
    assert THEIRS in b.service.topics
    assert len(b.forwarder.published) == 4


class HoldingForwarder(FakeForwarder):
    """Keeps each forwarded publish's Deferred for the test to answer."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Deferred[Position]] = []

    def publish(
        self, owner: BrokerInfo, topic: str, data: bytes, num_messages: int = 1
    ) -> Deferred[Position]:
        self.published.append((owner.broker_id, topic, data, num_messages))
        d: Deferred[Position] = Deferred()
        self.held.append(d)
        return d


def test_forwarded_publishes_keep_their_order_across_a_failover() -> None:
    """Publishes in flight when their owner goes are sent again in call order, whichever was
    refused first, and one made meanwhile waits behind them instead of overtaking them."""
    b = Broker()
    fwd = HoldingForwarder()
    b.service.forwarder = fwd
    results = [b.service.publish(THEIRS, b"m%d" % i, forward=True) for i in range(3)]
    assert [p[2] for p in fwd.published] == [b"m0", b"m1", b"m2"]
    fwd.held[1].errback(ForwardingError("owner gone"))
    fwd.held[0].errback(ForwardingError("owner gone"))
    results.append(b.service.publish(THEIRS, b"m3", forward=True))
    b.clock.advance(1.0)
    assert len(fwd.published) == 3, "nothing is sent while a publish in flight may be refused"
    fwd.held[2].errback(ForwardingError("owner gone"))
    b.clock.advance(0.05)
    assert [p[2] for p in fwd.published[3:]] == [b"m0", b"m1", b"m2", b"m3"]
    assert b.ownership.acquired == [THEIRS, THEIRS], "looked up again once"
    for i, d in enumerate(fwd.held[3:]):
        d.callback(Position(9, i))
    entries = [result_of(d) for d in results]
    assert [e.position for e in entries if e is not None] == [Position(9, i) for i in range(4)]
    assert THEIRS not in b.service._lines, "a line that holds nothing is dropped"


def test_a_forwarded_publish_waits_behind_a_retry_when_the_topic_comes_here() -> None:
    """The topic moves to this broker while a publish waits for its retry: the later publish,
    which would find the topic loaded here, is stored after it, not before."""
    b = Broker()
    fwd = HoldingForwarder()
    b.service.forwarder = fwd
    first = b.service.publish(THEIRS, b"first", forward=True)
    fwd.held[0].errback(ForwardingError("owner gone"))
    del b.ownership.remote[THEIRS]
    result_of(b.service.get_topic(THEIRS))  # loaded here by another caller meanwhile
    second = b.service.publish(THEIRS, b"second", forward=True)
    assert not second.called
    b.clock.advance(0.05)
    a, c = result_of(first), result_of(second)
    assert a is not None
    assert c is not None
    assert a.position < c.position


def test_stopping_the_broker_fails_the_forwarded_publishes_that_wait() -> None:
    """A publish waiting for its retry fails when the broker stops, and is not sent."""
    b = Broker()
    fwd = HoldingForwarder()
    b.service.forwarder = fwd
    d = b.service.publish(THEIRS, b"x", forward=True)
    fwd.held[0].errback(ForwardingError("owner gone"))
    result_of(b.service.close())
    assert isinstance(failure_of(d), ServiceNotReadyError)
    b.clock.advance(1.0)
    assert len(fwd.published) == 1
