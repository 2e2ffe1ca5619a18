"""Unit tests of MQTT on a broker that does not own its topics: publishes and subscriptions go
through the Broker API's forwarding to an in-process owner (a second ``BrokerService`` behind a
``Forwarder``), QoS 1 is acknowledged only after the owner's durable write, and a forwarded
subscription the owner closes is attached again and reads on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))
sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of
from test_connection import Peer

from polybroker.broker_core.consumer import Consumer, SubType
from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.forwarding import Forwarder, ForwardingError, RemoteConsumer
from polybroker.broker_core.messages import Message, decode_entry, encode_entry
from polybroker.broker_core.ownership import BrokerInfo, NotOwnerError, Ownership
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.ledger.api import InitialPosition, Position
from polybroker.metadata.memory import MemoryMetadataStore
from polybroker.protocols.mqtt import codec as c
from polybroker.protocols.mqtt.connection import MqttSettings
from polybroker.protocols.mqtt.session import MqttBroker

OWNER = BrokerInfo("b:8080", "http://b:8080", "pulsar://b:6650")
FULL = "persistent://public/default/a%2Fb"
ML = "public/default/persistent/a%252Fb"


class ElsewhereOwnership(Ownership):
    """This broker owns nothing: every topic is the owner's (or ``refuse`` is raised)."""

    def __init__(self) -> None:
        self.local = BrokerInfo("a:8080", "http://a:8080", "pulsar://a:6650")
        self.refuse: Exception | None = None

    @property
    def clustered(self) -> bool:
        return True

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        return succeed(OWNER)

    def acquire(self, topic: str) -> Deferred[None]:
        if self.refuse is not None:
            return fail(self.refuse)
        return fail(NotOwnerError(f"{topic} is served by b", OWNER))

    def owns(self, topic: str) -> bool:
        return False

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([self.local, OWNER])


class InProcessForwarder(Forwarder):
    """Forwards to another ``BrokerService`` in this process (its ``ServerConsumer``s are
    driven exactly as a remote consumer is)."""

    def __init__(self, owner: BrokerService) -> None:
        self.owner = owner
        self.calls: list[str] = []
        #: The owner does not serve the topic now (as a real one answers: ServiceNotReady).
        self.refusing = False

    def publish(
        self, owner: BrokerInfo, topic: str, data: bytes, num_messages: int = 1
    ) -> Deferred[Position]:
        self.calls.append(f"publish {topic}")
        d = self.owner.publish(topic, data, num_messages)
        return d.addCallback(lambda e: e.position)  # type: ignore[no-any-return]

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
        self.calls.append(f"subscribe {topic} {subscription} {initial_position.value}")
        if self.refusing:
            return fail(ForwardingError("owner: not serving the topic now"))
        return self.owner.subscribe(  # type: ignore[return-value]
            topic,
            subscription,
            consumer,
            sub_type,
            initial_position,
            durable=durable,
            create_topic=create_topic,
        )

    def close(self) -> Deferred[None]:
        return succeed(None)


class Pair:
    """Broker A (MQTT, owns nothing) forwarding to broker B (the owner)."""

    def __init__(self, watching: bool = False) -> None:
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.store: Any = MemoryMetadataStore(self.clock) if watching else FakeMetadataStore()
        config = Config({"statsUpdateFrequencyInSecs": 0})
        self.owner_factory = FakeLedgerFactory(self.clock.seconds)
        self.owner = BrokerService(self.owner_factory, self.clock, config, self.store)
        self.service = BrokerService(
            FakeLedgerFactory(self.clock.seconds), self.clock, config, self.store
        )
        self.ownership = ElsewhereOwnership()
        self.service.ownership = self.ownership
        self.forwarder = InProcessForwarder(self.owner)
        self.service.forwarder = self.forwarder
        self.broker = MqttBroker(self.service, self.clock)
        result_of(self.broker.start())
        self.settings = MqttSettings(broker=self.broker, clock=self.clock)

    def peer(self, client_id: str, **connect: Any) -> Peer:
        p = Peer(self, c.LEVEL_311)  # type: ignore[arg-type]
        p.send(c.Connect(client_id, c.LEVEL_311, **connect))
        assert isinstance(p.packets()[0], c.ConnAck)
        return p


def payloads(p: Peer) -> list[bytes]:
    return [x.payload for x in p.packets() if isinstance(x, c.Publish)]


def test_qos1_publish_is_stored_at_the_owner_and_acked_after_its_durable_write() -> None:
    """A QoS 1 PUBLISH of a topic the broker does not own is stored at the owner (not here),
    and PUBACK leaves only once the owner's append completed."""
    env = Pair()
    p = env.peer("pub")
    p.send(c.Publish("a/b", b"first", 0))
    ml = env.owner_factory.ledger(ML)
    ml.hold_appends = True
    p.send(c.Publish("a/b", b"one", 1, packet_id=1))
    assert p.packets() == []
    ml.release_appends()
    assert p.packets() == [c.PubAck(1)]
    assert [decode_entry(e.data)[0].payload for e in ml.data.entries] == [b"first", b"one"]
    assert FULL not in env.service.topics
    assert env.forwarder.calls == [f"publish {FULL}", f"publish {FULL}"]


def test_subscriptions_are_attached_at_the_owner_and_acks_reach_it() -> None:
    """SUBSCRIBE attaches the session's subscription at the owner; messages published there
    (by anyone) reach the client, and its PUBACKs acknowledge them at the owner."""
    env = Pair()
    sub = env.peer("sub", clean_start=False)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    assert sub.packets() == [c.SubAck(1, [1])]
    topic = result_of(env.owner.get_topic(FULL))
    assert "mqtt-sub" in topic.subscriptions
    pub = env.peer("pub")
    pub.send(c.Publish("a/b", b"hello", 1, packet_id=7))
    env.clock.advance(0)
    [delivered] = [x for x in sub.packets() if isinstance(x, c.Publish)]
    assert delivered.payload == b"hello"
    [server] = topic.subscriptions["mqtt-sub"].consumers
    assert len(server.pending) == 1
    assert delivered.packet_id is not None
    sub.send(c.PubAck(delivered.packet_id))
    assert server.pending == {}


def test_a_forwarded_subscription_closed_by_the_owner_is_attached_again() -> None:
    """When the owner closes the forwarded consumer (topic moved, owner gone), the session
    subscribes again, retrying while no broker serves the topic, and reads on from where it
    was: nothing skipped, nothing repeated (a clean session's non-durable subscription)."""
    env = Pair()
    sub = env.peer("sub")
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 0)]))
    sub.packets()
    pub = env.peer("pub")
    pub.send(c.Publish("a/b", b"1", 1, packet_id=1))
    env.clock.advance(0)
    assert payloads(sub) == [b"1"]
    env.ownership.refuse = ServiceNotReadyError("bundle not available now")
    env.forwarder.refusing = True
    env.service.forward_retry_s = 1.0
    result_of(env.owner.unload_topic(FULL))
    # Published while the subscription is gone: it must still arrive.
    result_of(env.owner.publish(FULL, _entry_like(env, b"2")))
    env.clock.pump([0.25] * 20)
    assert payloads(sub) == []
    env.ownership.refuse = None
    env.forwarder.refusing = False
    env.clock.pump([1.0] * 8)
    assert payloads(sub) == [b"2"]
    pub.send(c.Publish("a/b", b"3", 1, packet_id=2))
    env.clock.advance(0)
    assert payloads(sub) == [b"3"]


def _entry_like(env: Pair, payload: bytes) -> bytes:
    """A stored MQTT message, as another broker's MQTT handler would write it."""
    return encode_entry(
        [Message(payload, properties=[("mqtt.qos", "1")])],
        producer_name="mqtt-elsewhere",
        sequence_id=0,
        publish_time_ms=int(env.clock.seconds() * 1000),
    )


def owner_side(env: Pair) -> MqttSettings:
    """MQTT served by the owner broker too (same metadata store), started after A."""
    broker = MqttBroker(env.owner, env.clock)
    result_of(broker.start())
    return MqttSettings(broker=broker, clock=env.clock)


def peer_on(settings: MqttSettings, client_id: str, **connect: Any) -> tuple[Peer, Any]:
    holder = type("Holder", (), {"settings": settings})()
    p = Peer(holder, c.LEVEL_311)  # type: ignore[arg-type]
    p.send(c.Connect(client_id, c.LEVEL_311, **connect))
    ack = p.packets()[0]
    assert isinstance(ack, c.ConnAck)
    return p, ack


def test_retained_messages_stored_by_another_broker_are_delivered() -> None:
    """A retained message published through the other broker (after this one started) is
    delivered on SUBSCRIBE here; clearing it there clears it here too."""
    env = Pair()
    other = owner_side(env)
    pub, _ = peer_on(other, "pub")
    pub.send(c.Publish("a/b", b"kept", 1, retain=True, packet_id=1))
    env.clock.advance(0)
    assert pub.packets() == [c.PubAck(1)]
    sub = env.peer("sub")
    sub.send(c.Subscribe(1, [c.Subscription("a/#", 1)]))
    env.clock.advance(0)
    got = [x for x in sub.packets() if isinstance(x, c.Publish)]
    assert [(x.topic, x.payload, x.retain) for x in got] == [("a/b", b"kept", True)]
    pub.send(c.Publish("a/b", b"", 1, retain=True, packet_id=2))
    env.clock.advance(0)
    again = env.peer("sub2")
    again.send(c.Subscribe(1, [c.Subscription("a/#", 1)]))
    env.clock.advance(0)
    assert [x for x in again.packets() if isinstance(x, c.Publish)] == []


def test_a_persistent_session_stored_by_another_broker_is_resumed_here() -> None:
    """A device whose persistent session another broker stored (after this one started)
    connects here: the session is present, its filters are back, and what was published
    meanwhile is delivered."""
    env = Pair()
    other = owner_side(env)
    dev, ack = peer_on(other, "dev", clean_start=False)
    assert ack == c.ConnAck(False, 0)
    dev.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    env.clock.advance(0)
    dev.packets()
    dev.send(c.Disconnect())
    # Its broker goes away, and the session's consumers with it.
    other.broker.stop()
    for session in list(other.broker.sessions.values()):
        for sub in list(session.subs.values()):
            session._close_sub(sub, delete=False)
    env.clock.advance(0)
    result_of(env.owner.publish(FULL, _entry_like(env, b"meanwhile")))
    back = Peer(env, c.LEVEL_311)  # type: ignore[arg-type]
    back.send(c.Connect("dev", c.LEVEL_311, clean_start=False))
    env.clock.advance(0)
    got = back.packets()
    assert got[0] == c.ConnAck(True, 0)
    assert list(env.broker.sessions["dev"].filters) == ["a/b"]
    assert [x.payload for x in got[1:] if isinstance(x, c.Publish)] == [b"meanwhile"]


def test_a_session_taken_over_on_another_broker_is_let_go_here() -> None:
    """A device that left this broker with a persistent session connects to another broker:
    the other broker stores the session as its own, this broker lets its subscriptions go, and
    the device gets, there, what was published meanwhile (no subscription stays busy)."""
    env = Pair(watching=True)
    dev = env.peer("dev", clean_start=False)
    dev.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    env.clock.advance(0)
    dev.packets()
    dev.send(c.Disconnect())
    env.clock.advance(0)
    assert "dev" in env.broker.sessions  # kept, its consumer still attached at the owner
    result_of(env.owner.publish(FULL, _entry_like(env, b"meanwhile")))
    env.clock.advance(0)
    other = owner_side(env)
    moved = Peer(type("Holder", (), {"settings": other})(), c.LEVEL_311)  # type: ignore[arg-type]
    moved.send(c.Connect("dev", c.LEVEL_311, clean_start=False))
    env.clock.pump([0.1] * 20)
    got = moved.packets()
    assert got[0] == c.ConnAck(True, 0)
    assert "dev" not in env.broker.sessions
    assert [x.payload for x in got[1:] if isinstance(x, c.Publish)] == [b"meanwhile"]
    topic = result_of(env.owner.get_topic(FULL))
    assert len(topic.subscriptions["mqtt-dev"].consumers) == 1


def test_a_session_ended_on_another_broker_is_ended_here_too() -> None:
    """The device comes back with a clean start on another broker: its old session ends there
    (record deleted), and this broker, which still held its subscriptions, deletes them."""
    env = Pair(watching=True)
    dev = env.peer("dev", clean_start=False)
    dev.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    env.clock.advance(0)
    dev.send(c.Disconnect())
    env.clock.advance(0)
    topic = result_of(env.owner.get_topic(FULL))
    assert "mqtt-dev" in topic.subscriptions
    other = owner_side(env)
    fresh = Peer(type("Holder", (), {"settings": other})(), c.LEVEL_311)  # type: ignore[arg-type]
    fresh.send(c.Connect("dev", c.LEVEL_311, clean_start=True))
    env.clock.pump([0.1] * 20)
    assert fresh.packets()[0] == c.ConnAck(False, 0)
    assert "dev" not in env.broker.sessions
    assert "mqtt-dev" not in topic.subscriptions


class OwnsAll(Ownership):
    """The owner broker of a cluster: it serves every topic."""

    def __init__(self) -> None:
        self.local = OWNER

    @property
    def clustered(self) -> bool:
        return True

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        return succeed(OWNER)

    def acquire(self, topic: str) -> Deferred[None]:
        return succeed(None)

    def owns(self, topic: str) -> bool:
        return True

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([OWNER])


def test_a_clean_session_connected_here_is_taken_over_by_another_broker() -> None:
    """A device still connected here (a half-open connection) connects to another broker with
    a clean session: this broker closes its old connection and lets its subscriptions go, so
    the device's SUBSCRIBE there succeeds and messages go to the new connection only."""
    env = Pair(watching=True)
    env.owner.ownership = OwnsAll()
    old = env.peer("dev")
    old.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    env.clock.advance(0)
    assert old.packets() == [c.SubAck(1, [1])]
    other = owner_side(env)
    assert other.broker.clustered
    new = Peer(type("Holder", (), {"settings": other})(), c.LEVEL_311)  # type: ignore[arg-type]
    new.send(c.Connect("dev", c.LEVEL_311, clean_start=True))
    env.clock.advance(0)
    new.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    env.clock.pump([0.1] * 10)
    assert old.closed
    got = new.packets()
    assert got == [c.ConnAck(False, 0), c.SubAck(1, [1])]
    result_of(env.owner.publish(FULL, _entry_like(env, b"to-new")))
    env.clock.advance(0)
    assert payloads(new) == [b"to-new"]
    assert payloads(old) == []


def test_a_stored_session_that_came_back_elsewhere_is_not_expired_here() -> None:
    """A broker that found an absent session at start does not end it at its expiry time if
    the device came back meanwhile (to another broker): only a record still absent and past
    its expiry ends the session."""
    env = Pair(watching=True)
    env.owner.ownership = OwnsAll()
    now_ms = int(env.clock.seconds() * 1000)
    record = {
        "expiry": 30,
        "expires_at_ms": now_ms + 10_000,
        "filters": [["a/b", 1, 0, False, False, 0, now_ms]],
        "holder": "gone",
    }
    result_of(env.store.put("/mqtt", b""))
    result_of(env.store.put("/mqtt/sessions", b""))
    result_of(env.store.put("/mqtt/sessions/dev", json.dumps(record).encode()))
    watcher = MqttBroker(env.service, env.clock)  # found the absent session at start
    result_of(watcher.start())
    other = owner_side(env)
    dev = Peer(type("Holder", (), {"settings": other})(), c.LEVEL_5)  # type: ignore[arg-type]
    dev.send(c.Connect("dev", c.LEVEL_5, clean_start=False, properties={c.SESSION_EXPIRY: 30}))
    env.clock.advance(0)
    assert dev.packets()[0].session_present  # type: ignore[attr-defined]
    env.clock.pump([1.0] * 12)
    assert not dev.closed
    assert "dev" in other.broker.sessions
    topic = result_of(env.owner.get_topic(FULL))
    assert "mqtt-dev" in topic.subscriptions
