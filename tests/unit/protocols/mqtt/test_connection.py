"""Unit tests of the MQTT connection and sessions over StringTransport, a Clock, the fake
ledger and the fake metadata store."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of
from fake_tcp import FakeTcp, SlowClient

from polybroker.broker_core.messages import Message, decode_entry, encode_entry
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.mqtt import codec as c
from polybroker.protocols.mqtt import topics
from polybroker.protocols.mqtt.connection import MqttConnection, MqttSettings
from polybroker.protocols.mqtt.session import MqttBroker

ML_AB = "public/default/persistent/a%252Fb"


class Env:
    """A service, the MQTT state over it, and helpers to open client connections."""

    def __init__(self, after: Env | None = None, **settings: Any) -> None:
        """A fresh broker, or (``after``) one restarted over ``after``'s logs and metadata."""
        self.clock = Clock()
        self.clock.advance(1_000_000 if after is None else after.clock.seconds())
        self.factory = FakeLedgerFactory(self.clock.seconds)
        self.store = FakeMetadataStore() if after is None else after.store
        if after is not None:
            self.factory.logs = after.factory.logs
        self.service = BrokerService(
            self.factory, self.clock, Config({"statsUpdateFrequencyInSecs": 0}), self.store
        )
        self.broker = MqttBroker(self.service, self.clock, settings.pop("deny", ()))
        result_of(self.broker.start())
        self.settings = MqttSettings(broker=self.broker, clock=self.clock, **settings)

    def peer(self, client_id: str = "c", level: int = c.LEVEL_311, **connect: Any) -> Peer:
        p = Peer(self, level)
        p.send(c.Connect(client_id, level, **connect))
        return p


class Peer:
    """A connection under test and the client end of its transport."""

    def __init__(self, env: Env, level: int) -> None:
        self.env = env
        self.level = level
        self.conn = MqttConnection(env.settings)
        self.transport = StringTransport()
        self.conn.makeConnection(self.transport)
        self.reader = c.PacketReader(level=level)

    def send(self, packet: c.Packet) -> None:
        self.conn.dataReceived(c.encode(packet, self.level))

    def packets(self) -> list[c.Packet]:
        data = self.transport.value()
        self.transport.clear()
        self.reader.feed(data)
        return self.reader.packets()

    def count_writes(self) -> list[bytes]:
        """What each later ``transport.write`` is given, one item per call."""
        writes: list[bytes] = []
        real = self.transport.write

        def write(data: bytes) -> None:
            writes.append(data)
            real(data)

        self.transport.write = write  # type: ignore[method-assign]
        return writes

    def one(self) -> c.Packet:
        got = self.packets()
        assert len(got) == 1, got
        return got[0]

    @property
    def closed(self) -> bool:
        return bool(self.transport.disconnecting)


def test_connack_and_session_present() -> None:
    """A persistent session is present on return; a clean one never is."""
    env = Env()
    p = env.peer("dev", clean_start=False)
    assert p.one() == c.ConnAck(False, 0)
    p.send(c.Disconnect())
    p2 = env.peer("dev", clean_start=False)
    assert p2.one() == c.ConnAck(True, 0)
    p3 = env.peer("dev", clean_start=True)
    assert p3.packets()[-1] == c.ConnAck(False, 0)


def test_puback_waits_for_the_durable_write() -> None:
    """PUBACK and PUBREC leave only after the append completes, in PUBLISH order (and an
    acknowledgement waits for the stores already under way when its own completed)."""
    env = Env()
    p = env.peer("pub")
    p.packets()
    p.send(c.Publish("a/b", b"first", 0))  # loads the topic
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    p.send(c.Publish("a/b", b"one", 1, packet_id=1))
    p.send(c.Publish("a/b", b"two", 2, packet_id=2))
    assert p.packets() == []
    ml.release_appends(1)
    assert p.packets() == []
    ml.release_appends()
    assert p.packets() == [c.PubAck(1), c.PubRec(2)]
    p.send(c.PubRel(2))
    assert p.packets() == [c.PubComp(2)]
    stored = [decode_entry(e.data)[0] for e in ml.data.entries]
    assert [m.payload for m in stored] == [b"first", b"one", b"two"]
    assert ("mqtt.qos", "2") in stored[2].properties


def test_failed_write_v5_gets_a_negative_ack_and_v311_a_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed durable write is PUBACK 0x80 for MQTT 5 and a closed connection for 3.1.1;
    the same failure is warned of once per interval, over every connection, with a count."""
    caplog.set_level(logging.WARNING, "polybroker.protocols.mqtt.connection")
    env = Env()
    p5 = env.peer("p5", c.LEVEL_5)
    p5.packets()
    p5.send(c.Publish("a/b", b"x", 0))
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    p5.send(c.Publish("a/b", b"y", 1, packet_id=1))
    ml.release_appends(error=RuntimeError("bookies gone"))
    assert p5.packets() == [c.PubAck(1, c.UNSPECIFIED_ERROR)]
    p3 = env.peer("p3")
    p3.packets()
    p3.send(c.Publish("a/b", b"y", 1, packet_id=1))
    ml.release_appends(error=RuntimeError("bookies gone"))
    assert p3.packets() == []
    assert p3.closed
    env.clock.advance(30)
    p5.send(c.Publish("a/b", b"z", 1, packet_id=2))
    ml.release_appends(error=RuntimeError("bookies gone"))
    assert [r.getMessage() for r in caplog.records] == [
        "mqtt publish failed",
        "mqtt publish failed (and 1 times more)",
    ]


def test_keep_alive_enforced_at_one_and_a_half_times() -> None:
    """A client silent for 1.5x its keep-alive is closed and its will published; traffic
    before the deadline keeps it alive."""
    env = Env()
    watcher = env.peer("w")
    watcher.send(c.Subscribe(1, [c.Subscription("will/#", 1)]))
    watcher.packets()
    p = env.peer("k", keep_alive=10, will=c.Will("will/k", b"bye", 1))
    p.packets()
    env.clock.advance(14)
    p.send(c.PingReq())
    assert p.packets() == [c.PingResp()]
    env.clock.advance(14.9)
    assert not p.closed
    env.clock.advance(0.2)
    assert p.closed
    (will,) = watcher.packets()
    assert isinstance(will, c.Publish)
    assert (will.topic, will.payload) == ("will/k", b"bye")


def test_nothing_but_connect_first_and_a_connect_timeout() -> None:
    """A PINGREQ before CONNECT closes the connection; so does silence past the timeout."""
    env = Env()
    early = Peer(env, c.LEVEL_311)
    early.send(c.PingReq())
    assert early.closed
    assert early.packets() == []
    silent = Peer(env, c.LEVEL_311)
    env.clock.advance(env.settings.connect_timeout_s + 0.1)
    assert silent.closed


def test_inflight_resent_with_dup_and_acked_on_return() -> None:
    """An unacknowledged QoS 1 delivery is resent with DUP and the same packet id when a
    persistent session returns; after its PUBACK the entry is acknowledged."""
    env = Env()
    sub = env.peer("s", clean_start=False)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    pub = env.peer("p")
    pub.send(c.Publish("a/b", b"m", 1, packet_id=9))
    (first,) = sub.packets()
    assert isinstance(first, c.Publish)
    assert (first.payload, first.qos, first.dup) == (b"m", 1, False)
    sub.conn.connectionLost(None)
    back = env.peer("s", clean_start=False)
    connack, again = back.packets()
    assert connack == c.ConnAck(True, 0)
    assert isinstance(again, c.Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"m", True, first.packet_id)
    assert again.packet_id is not None
    back.send(c.PubAck(again.packet_id))
    session = env.broker.sessions["s"]
    assert session.inflight == {}
    cursor = env.factory.ledger(ML_AB).cursors["mqtt-s"]
    assert cursor.backlog() == 0


def test_qos2_outbound_flow_and_pubrel_resent_after_reconnect() -> None:
    """QoS 2 delivery: PUBLISH, PUBREC -> PUBREL, PUBCOMP; a session that returns after PUBREC
    gets the PUBREL again, not the message."""
    env = Env()
    sub = env.peer("s", clean_start=False)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 2)]))
    sub.packets()
    env.peer("p").send(c.Publish("a/b", b"x", 2, packet_id=3))
    (pub,) = sub.packets()
    assert isinstance(pub, c.Publish)
    assert pub.packet_id is not None
    assert pub.qos == 2
    sub.send(c.PubRec(pub.packet_id))
    assert sub.packets() == [c.PubRel(pub.packet_id)]
    sub.conn.connectionLost(None)
    back = env.peer("s", clean_start=False)
    assert back.packets() == [c.ConnAck(True, 0), c.PubRel(pub.packet_id)]
    back.send(c.PubComp(pub.packet_id))
    assert env.broker.sessions["s"].inflight == {}


def test_client_receive_maximum_limits_inflight() -> None:
    """With Receive Maximum 1 the next QoS 1 message waits for the previous PUBACK."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5, properties={c.RECEIVE_MAXIMUM: 1})
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    pub = env.peer("p")
    for i in range(3):
        pub.send(c.Publish("a/b", str(i).encode(), 1, packet_id=i + 1))
    (one,) = sub.packets()
    assert isinstance(one, c.Publish)
    assert one.packet_id is not None
    sub.send(c.PubAck(one.packet_id))
    (two,) = sub.packets()
    assert isinstance(two, c.Publish)
    assert [one.payload, two.payload] == [b"0", b"1"]


def test_server_receive_maximum_exceeded_disconnects() -> None:
    """An MQTT 5 client with more unacknowledged QoS 1 publishes than allowed gets 0x93."""
    env = Env(receive_maximum=1)
    p = env.peer("p", c.LEVEL_5)
    p.packets()
    p.send(c.Publish("a/b", b"x", 0))
    env.factory.ledger(ML_AB).hold_appends = True
    p.send(c.Publish("a/b", b"1", 1, packet_id=1))
    p.send(c.Publish("a/b", b"2", 1, packet_id=2))
    (disconnect,) = p.packets()
    assert isinstance(disconnect, c.Disconnect)
    assert disconnect.reason_code == c.RECEIVE_MAXIMUM_EXCEEDED
    assert p.closed


def test_session_expiry_deletes_the_durable_subscription() -> None:
    """An MQTT 5 session with expiry 30 s outlives its connection for 30 s, then its
    subscription is deleted and the session is gone."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5, clean_start=False, properties={c.SESSION_EXPIRY: 30})
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    sub.send(c.Disconnect())
    ml = env.factory.ledger(ML_AB)
    env.clock.advance(29)
    assert "mqtt-s" in ml.cursors
    env.clock.advance(2)
    assert "mqtt-s" not in ml.cursors
    assert "s" not in env.broker.sessions
    back = env.peer("s", c.LEVEL_5, clean_start=False)
    connack = back.one()
    assert isinstance(connack, c.ConnAck)
    assert (connack.session_present, connack.reason_code) == (False, 0)


def test_messages_from_other_protocols_are_delivered_at_granted_qos() -> None:
    """An entry written through the Broker API (as Pulsar or Kafka would) reaches a
    subscriber as QoS 1 when granted 1, with its properties as MQTT 5 user properties."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 2)]))
    sub.packets()
    data = encode_entry(
        [Message(b"raw", properties=[("h", "v")])],
        producer_name="other",
        sequence_id=0,
        publish_time_ms=0,
    )
    result_of(env.service.publish("persistent://public/default/a%2Fb", data))
    (pub,) = sub.packets()
    assert isinstance(pub, c.Publish)
    assert (pub.payload, pub.qos, pub.properties[c.USER_PROPERTY]) == (b"raw", 1, [("h", "v")])


def test_publishes_of_one_read_are_stored_as_one_batch_per_topic() -> None:
    """PUBLISHes arriving in one read become one entry per topic; their acks keep the order."""
    env = Env()
    p = env.peer("pub")
    p.packets()
    data = b"".join(
        c.encode(x)
        for x in (
            c.Publish("a/b", b"1", 1, packet_id=1),
            c.Publish("other", b"x", 0),
            c.Publish("a/b", b"2", 2, packet_id=2),
            c.Publish("a/b", b"3", 0),
        )
    )
    p.conn.dataReceived(data)
    assert p.packets() == [c.PubAck(1), c.PubRec(2)]
    (entry,) = env.factory.ledger(ML_AB).data.entries
    assert entry.num_messages == 3
    assert [m.payload for m in decode_entry(entry.data)] == [b"1", b"2", b"3"]


def test_deliveries_wait_while_the_socket_is_full() -> None:
    """While the transport has paused the connection nothing is sent (and the QoS 0 entry
    stays unacknowledged); resuming sends what waited."""
    env = Env()
    sub = env.peer("s")
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 0)]))
    sub.packets()
    assert sub.transport.producer is sub.conn
    sub.conn.pauseProducing()
    env.peer("p").send(c.Publish("a/b", b"held", 0))
    assert sub.packets() == []
    assert env.factory.ledger(ML_AB).cursors["mqtt-s"].backlog() == 1
    sub.conn.resumeProducing()
    (pub,) = sub.packets()
    assert isinstance(pub, c.Publish)
    assert pub.payload == b"held"
    assert env.factory.ledger(ML_AB).cursors["mqtt-s"].backlog() == 0


def test_no_local_skips_the_clients_own_messages() -> None:
    """With no-local a client does not receive what it published itself; others still do."""
    env = Env()
    me = env.peer("me", c.LEVEL_5)
    me.send(c.Subscribe(1, [c.Subscription("a/b", 0, no_local=True)]))
    me.packets()
    other = env.peer("other", c.LEVEL_5)
    me.send(c.Publish("a/b", b"mine", 0))
    other.send(c.Publish("a/b", b"theirs", 0))
    (got,) = me.packets()
    assert isinstance(got, c.Publish)
    assert got.payload == b"theirs"


def test_delayed_will_published_when_the_session_ends_first() -> None:
    """A will delayed beyond the session expiry is published when the session ends."""
    env = Env()
    watcher = env.peer("w")
    watcher.send(c.Subscribe(1, [c.Subscription("will/#", 0)]))
    watcher.packets()
    p = env.peer(
        "d",
        c.LEVEL_5,
        clean_start=False,
        properties={c.SESSION_EXPIRY: 5},
        will=c.Will("will/d", b"late", 0, properties={c.WILL_DELAY: 60}),
    )
    p.packets()
    p.conn.connectionLost(None)
    env.clock.advance(4)
    assert watcher.packets() == []
    env.clock.advance(2)
    (will,) = watcher.packets()
    assert isinstance(will, c.Publish)
    assert will.payload == b"late"


def test_partitioned_topics_are_one_mqtt_topic() -> None:
    """A partitioned topic (as Kafka clients create them) is one MQTT topic: exact and
    wildcard subscriptions cover every partition, and MQTT publishes land in one of them."""
    env = Env()
    result_of(env.service.create_partitioned_topic("persistent://public/default/kp", 3))
    exact = env.peer("exact")
    exact.send(c.Subscribe(1, [c.Subscription("kp", 1)]))
    assert exact.packets() == [c.ConnAck(False, 0), c.SubAck(1, [1])]
    wild = env.peer("wild")
    wild.send(c.Subscribe(1, [c.Subscription("+", 0)]))
    wild.packets()
    data = encode_entry([Message(b"p2")], producer_name="k", sequence_id=0, publish_time_ms=0)
    result_of(env.service.publish("persistent://public/default/kp-partition-2", data))
    pub = env.peer("pub")
    pub.send(c.Publish("kp", b"mqtt", 1, packet_id=1))
    assert pub.packets()[-1] == c.PubAck(1)
    got_exact = [(p.topic, p.payload) for p in exact.packets() if isinstance(p, c.Publish)]
    got_wild = [(p.topic, p.payload) for p in wild.packets() if isinstance(p, c.Publish)]
    assert got_exact == [("kp", b"p2"), ("kp", b"mqtt")]
    assert got_wild == got_exact


def test_a_topic_made_partitioned_while_a_subscription_is_made_is_covered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Kafka client makes the topic partitioned between the subscription's look at the
    partition count and its subscribe: the SUBSCRIBE still succeeds, on the partitions, and
    the refusal it recovered from is no warning."""
    caplog.set_level(logging.WARNING, "polybroker.protocols.mqtt")
    env = Env()
    full = "persistent://public/default/race"
    service = env.service
    counts = service.partitioned_topic_metadata

    def made_partitioned_now(topic: str) -> Deferred[int]:
        service.partitioned_topic_metadata = counts  # type: ignore[method-assign]
        result_of(service.create_partitioned_topic(full, 2))
        return succeed(0)  # what was read just before

    service.partitioned_topic_metadata = made_partitioned_now  # type: ignore[method-assign]
    sub = env.peer("sub")
    sub.send(c.Subscribe(1, [c.Subscription("race", 1)]))
    assert sub.packets() == [c.ConnAck(False, 0), c.SubAck(1, [1])]
    data = encode_entry([Message(b"k")], producer_name="k", sequence_id=0, publish_time_ms=0)
    result_of(service.publish(f"{full}-partition-1", data))
    assert [(p.topic, p.payload) for p in sub.packets() if isinstance(p, c.Publish)] == [
        ("race", b"k")
    ]
    assert caplog.records == []


def test_a_subscription_refused_as_partitioned_with_no_partitions_seen_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When the count read again still shows no partitions, the SUBSCRIBE is refused and
    that is warned of, once."""
    caplog.set_level(logging.WARNING, "polybroker.protocols.mqtt")
    env = Env()
    service = env.service
    result_of(service.create_partitioned_topic("persistent://public/default/stale", 2))
    service.partitioned_topic_metadata = lambda topic: succeed(0)  # type: ignore[method-assign]
    sub = env.peer("sub")
    sub.send(c.Subscribe(1, [c.Subscription("stale", 1)]))
    assert sub.packets() == [c.ConnAck(False, 0), c.SubAck(1, [c.UNSPECIFIED_ERROR])]
    assert [r.getMessage() for r in caplog.records] == ["mqtt subscription failed"]


def test_an_absent_share_group_member_holds_no_messages() -> None:
    """While a persistent member of a share group is away, the other members get everything;
    it rejoins the group when it returns."""
    env = Env()
    a = env.peer("a", clean_start=False)
    a.send(c.Subscribe(1, [c.Subscription("$share/g/a/b", 1)]))
    b = env.peer("b")
    b.send(c.Subscribe(1, [c.Subscription("$share/g/a/b", 1)]))
    a.packets()
    b.packets()
    a.conn.connectionLost(None)
    pub = env.peer("p")
    for i in range(4):
        pub.send(c.Publish("a/b", str(i).encode(), 1, packet_id=i + 1))
    got_b = [p for p in b.packets() if isinstance(p, c.Publish)]
    assert [p.payload for p in got_b] == [b"0", b"1", b"2", b"3"]
    for p in got_b:
        assert p.packet_id is not None
        b.send(c.PubAck(p.packet_id))
    back = env.peer("a", clean_start=False)
    assert back.packets() == [c.ConnAck(True, 0)]
    sub = env.factory.ledger(ML_AB).cursors["mqtt-share-g"]
    assert sub.backlog() == 0
    assert len(env.broker.sessions["a"].subs) == 1


def test_a_message_mqtt_cannot_carry_is_skipped() -> None:
    """A property too long for MQTT (written through another protocol) skips that message;
    the next one is delivered."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 0)]))
    sub.packets()
    for props in ([("big", "x" * 70_000)], []):
        data = encode_entry(
            [Message(b"m", properties=props)], producer_name="o", sequence_id=0, publish_time_ms=0
        )
        result_of(env.service.publish("persistent://public/default/a%2Fb", data))
    (pub,) = sub.packets()
    assert isinstance(pub, c.Publish)
    assert c.USER_PROPERTY not in pub.properties
    assert env.factory.ledger(ML_AB).cursors["mqtt-s"].backlog() == 0


def test_a_restarted_broker_still_expires_an_absent_session() -> None:
    """The expiry of an absent session is stored: a broker restarted meanwhile ends the
    session (and deletes its durable subscription) when it expires."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5, clean_start=False, properties={c.SESSION_EXPIRY: 30})
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    sub.send(c.Disconnect())
    env.clock.advance(10)
    env.broker.stop()
    restarted = Env(after=env)
    restarted.clock.advance(19)
    assert "s" in restarted.broker.stored_ids
    restarted.clock.advance(2)
    assert "s" not in restarted.broker.stored_ids
    assert "mqtt-s" not in restarted.factory.ledger(ML_AB).cursors
    back = restarted.peer("s", c.LEVEL_5, clean_start=False)
    connack = back.one()
    assert isinstance(connack, c.ConnAck)
    assert not connack.session_present


def test_unloaded_topic_is_read_on_and_a_deleted_one_not_recreated() -> None:
    """A topic unloaded under a subscriber is subscribed again and delivery goes on; a
    wildcard never recreates a deleted topic."""
    env = Env()
    sub = env.peer("s")
    sub.send(c.Subscribe(1, [c.Subscription("a/#", 1)]))
    pub = env.peer("p")
    pub.send(c.Publish("a/b", b"1", 1, packet_id=1))
    (first,) = [p for p in sub.packets() if isinstance(p, c.Publish)]
    assert first.packet_id is not None
    sub.send(c.PubAck(first.packet_id))
    result_of(env.service.unload_topic("persistent://public/default/a%2Fb"))
    env.clock.advance(1)
    pub.send(c.Publish("a/b", b"2", 1, packet_id=2))
    got = [p.payload for p in sub.packets() if isinstance(p, c.Publish)]
    assert got == [b"2"]
    result_of(env.service.delete_topic("persistent://public/default/a%2Fb", force=True))
    env.clock.advance(1)
    names = result_of(env.service.topics_of_namespace("public/default"))
    assert "persistent://public/default/a%2Fb" not in names


def test_wildcard_subscribes_share_one_listing() -> None:
    """Wildcard SUBSCRIBEs within the listing's lifetime share one namespace listing; topics
    loaded meanwhile are covered without another; a later SUBSCRIBE lists again."""
    env = Env()
    calls: list[str] = []
    real = env.service.topics_of_namespace

    def counting(namespace: str, *args: Any) -> Any:
        calls.append(namespace)
        return real(namespace, *args)

    env.service.topics_of_namespace = counting  # type: ignore[method-assign]
    pub = env.peer("p")
    first = env.peer("first")
    first.send(c.Subscribe(1, [c.Subscription("a/#", 0)]))
    for i in range(3):
        pub.send(c.Publish(f"a/{i}", b"x", 0))
    late = env.peer("late")
    late.send(c.Subscribe(1, [c.Subscription("a/+", 0)]))
    late.packets()
    first.packets()
    pub.send(c.Publish("a/1", b"y", 0))
    assert [p.topic for p in late.packets() if isinstance(p, c.Publish)] == ["a/1"]
    assert [p.topic for p in first.packets() if isinstance(p, c.Publish)] == ["a/1"]
    assert len(calls) == 1
    env.clock.advance(6)
    env.peer("later").send(c.Subscribe(1, [c.Subscription("a/#", 0)]))
    assert len(calls) == 2
    assert sorted(env.broker._names) == [f"persistent://public/default/a%2F{i}" for i in range(3)]


def test_v5_connect_refusals_get_a_connack_reason() -> None:
    """A Receive Maximum of 0 is refused with CONNACK 0x82, an authentication method with
    0x8C (bad authentication method); the connection closes."""
    env = Env()
    zero = env.peer("z", c.LEVEL_5, properties={c.RECEIVE_MAXIMUM: 0})
    auth = env.peer("a", c.LEVEL_5, properties={c.AUTH_METHOD: "SCRAM-SHA-1"})
    for peer, code in ((zero, c.PROTOCOL_ERROR), (auth, c.BAD_AUTH_METHOD)):
        connack = peer.one()
        assert isinstance(connack, c.ConnAck)
        assert connack.reason_code == code
        assert peer.closed


def test_a_will_topic_over_the_name_bound_is_refused() -> None:
    """A will's topic is bounded as a PUBLISH topic is (each name is a managed ledger's): MQTT 5
    gets CONNACK 0x90, 3.1.1 a closed connection; a will at the bound is accepted."""
    env = Env()
    long = "w/" + "x" * topics.MAX_NAME_BYTES
    v5 = env.peer("a", c.LEVEL_5, will=c.Will(long, b"gone", 0, False, {}))
    connack = v5.one()
    assert isinstance(connack, c.ConnAck)
    assert connack.reason_code == c.TOPIC_NAME_INVALID
    assert v5.closed
    v3 = env.peer("b", will=c.Will(long, b"gone", 0, False, {}))
    assert v3.packets() == []
    assert v3.closed
    fits = env.peer("c", will=c.Will("x" * topics.MAX_NAME_BYTES, b"gone", 0, False, {}))
    connack = fits.one()
    assert isinstance(connack, c.ConnAck)
    assert connack.reason_code == 0
    assert not fits.closed


def test_a_session_made_non_persistent_still_deletes_its_durable_subscriptions() -> None:
    """A persistent session resumed with expiry 0 ends at disconnect: its durable
    subscription and its stored record are deleted."""
    env = Env()
    first = env.peer("s", c.LEVEL_5, clean_start=False, properties={c.SESSION_EXPIRY: 60})
    first.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    first.packets()
    first.send(c.Disconnect())
    assert "mqtt-s" in env.factory.ledger(ML_AB).cursors
    again = env.peer("s", c.LEVEL_5, clean_start=False)
    connack = again.packets()[0]
    assert isinstance(connack, c.ConnAck)
    assert connack.session_present
    again.send(c.Disconnect())
    assert "mqtt-s" not in env.factory.ledger(ML_AB).cursors
    assert "s" not in env.broker.stored_ids
    assert result_of(env.store.get("/mqtt/sessions/s")) is None


def _stored_payloads(env: Env) -> list[bytes]:
    ml = env.factory.ledger(ML_AB)
    return [m.payload for e in ml.data.entries for m in decode_entry(e.data)]


def test_qos2_id_stored_before_a_crash_is_not_stored_again() -> None:
    """A QoS 2 publish stored just before a crash (its PUBREC lost) and resent with DUP to the
    restarted broker gets PUBREC and is not stored twice; after PUBREL the id is free again."""
    env = Env()
    p = env.peer("dev", clean_start=False)
    p.packets()
    p.send(c.Publish("a/b", b"before", 1, packet_id=1))
    p.send(c.Publish("a/b", b"once", 2, packet_id=7))
    assert p.packets() == [c.PubAck(1), c.PubRec(7)]
    assert result_of(env.store.exists("/mqtt/qos2/dev"))
    restarted = Env(after=env)  # no clean stop: the in-memory state is gone
    back = restarted.peer("dev", clean_start=False)
    assert back.packets() == [c.ConnAck(True, 0)]
    back.send(c.Publish("a/b", b"once", 2, False, True, 7))
    assert back.packets() == [c.PubRec(7)]
    assert _stored_payloads(restarted) == [b"before", b"once"]
    back.send(c.PubRel(7))
    assert back.packets() == [c.PubComp(7)]
    assert not result_of(restarted.store.exists("/mqtt/qos2/dev"))
    back.send(c.Publish("a/b", b"new", 2, packet_id=7))
    assert back.packets() == [c.PubRec(7)]
    assert _stored_payloads(restarted) == [b"before", b"once", b"new"]


def test_qos2_id_recorded_but_never_stored_is_stored_on_resend() -> None:
    """A QoS 2 publish whose write never completed before a crash is stored when resent: its
    recorded id is not found in the log, so it is forgotten on restore."""
    env = Env()
    p = env.peer("dev", clean_start=False)
    p.packets()
    p.send(c.Publish("a/b", b"before", 0))
    env.factory.ledger(ML_AB).hold_appends = True
    p.send(c.Publish("a/b", b"lost", 2, packet_id=7))
    assert p.packets() == []
    assert result_of(env.store.exists("/mqtt/qos2/dev"))
    restarted = Env(after=env)
    back = restarted.peer("dev", clean_start=False)
    assert back.packets() == [c.ConnAck(True, 0)]
    assert not result_of(restarted.store.exists("/mqtt/qos2/dev"))
    back.send(c.Publish("a/b", b"lost", 2, False, True, 7))
    assert back.packets() == [c.PubRec(7)]
    assert _stored_payloads(restarted) == [b"before", b"lost"]


def test_an_absent_persistent_session_holds_nothing_in_memory() -> None:
    """While a persistent session's client is away its consumers are closed: 1,500 QoS 1
    messages published meanwhile wait in the log (the durable subscription's backlog), not in
    the session; the returning client gets every one, in order, once."""
    env = Env()
    sub = env.peer("s", clean_start=False)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    sub.send(c.Disconnect())
    pub = env.peer("p")
    pub.packets()
    n = 1500
    for i in range(n):
        pub.send(c.Publish("a/b", str(i).encode(), 1, packet_id=i % 65535 + 1))
    assert len(pub.packets()) == n
    session = env.broker.sessions["s"]
    assert (len(session.queue), session.subs, session.inflight) == (0, {}, {})
    cursor = env.factory.ledger(ML_AB).cursors["mqtt-s"]
    assert cursor.backlog() == n
    back = env.peer("s", clean_start=False)
    got = back.packets()
    assert got[0] == c.ConnAck(True, 0)
    pubs = [x for x in got[1:] if isinstance(x, c.Publish)]
    acked = 0
    while acked < len(pubs):
        for x in pubs[acked:]:
            assert x.packet_id is not None
            back.send(c.PubAck(x.packet_id))
        acked = len(pubs)
        pubs += [x for x in back.packets() if isinstance(x, c.Publish)]
    assert [x.payload for x in pubs] == [str(i).encode() for i in range(n)]
    assert cursor.backlog() == 0


def test_an_entry_read_again_after_a_return_sends_only_what_the_client_never_got() -> None:
    """Three messages stored as one entry, delivered one at a time (receive maximum 1): the
    first is acknowledged, the second in flight when the client vanishes. On return the
    second is resent with DUP, then only the third follows; the entry is then acknowledged."""
    env = Env()
    props = {c.SESSION_EXPIRY: 600, c.RECEIVE_MAXIMUM: 1}
    sub = env.peer("s", c.LEVEL_5, clean_start=False, properties=props)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    pub = env.peer("p")
    pub.packets()
    pub.conn.dataReceived(
        b"".join(
            c.encode(c.Publish("a/b", m, 1, packet_id=i + 1), c.LEVEL_311)
            for i, m in enumerate([b"m0", b"m1", b"m2"])
        )
    )
    ml = env.factory.ledger(ML_AB)
    assert len(ml.data.entries) == 1
    (first,) = sub.packets()
    assert isinstance(first, c.Publish)
    assert first.packet_id is not None
    sub.send(c.PubAck(first.packet_id))
    (second,) = sub.packets()
    assert isinstance(second, c.Publish)
    assert (first.payload, second.payload) == (b"m0", b"m1")
    sub.conn.connectionLost(None)
    session = env.broker.sessions["s"]
    assert len(session.queue) == 0
    assert list(session.inflight) == [second.packet_id]
    back = env.peer("s", c.LEVEL_5, clean_start=False, properties=props)
    got = back.packets()
    assert isinstance(got[0], c.ConnAck)
    assert got[0].session_present
    resent = [x for x in got[1:] if isinstance(x, c.Publish)]
    assert [(x.payload, x.dup, x.packet_id) for x in resent] == [(b"m1", True, second.packet_id)]
    assert second.packet_id is not None
    back.send(c.PubAck(second.packet_id))
    (third,) = back.packets()
    assert isinstance(third, c.Publish)
    assert (third.payload, third.dup) == (b"m2", False)
    assert third.packet_id is not None
    assert ml.cursors["mqtt-s"].backlog() == 3  # the entry is acknowledged as a whole
    back.send(c.PubAck(third.packet_id))
    assert back.packets() == []
    assert ml.cursors["mqtt-s"].backlog() == 0


def test_one_read_of_acknowledgements_is_answered_with_one_write() -> None:
    """Five PUBACKs in one read free five in-flight slots: the five next deliveries leave in
    one transport write, after the read; the publisher's PUBACKs of one stored batch also
    leave in one write."""
    env = Env()
    props = {c.RECEIVE_MAXIMUM: 5}
    sub = env.peer("s", c.LEVEL_5, properties=props)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    pub = env.peer("p")
    pub.packets()
    writes = pub.count_writes()
    pub.conn.dataReceived(
        b"".join(c.encode(c.Publish("a/b", b"%d" % i, 1, packet_id=i + 1)) for i in range(10))
    )
    assert len(writes) == 1
    assert pub.packets() == [c.PubAck(i + 1) for i in range(10)]
    first = [x for x in sub.packets() if isinstance(x, c.Publish)]
    assert [x.payload for x in first] == [b"%d" % i for i in range(5)]
    sub_writes = sub.count_writes()
    sub.conn.dataReceived(b"".join(c.encode(c.PubAck(x.packet_id or 0), c.LEVEL_5) for x in first))
    assert len(sub_writes) == 1
    assert [x.payload for x in sub.packets() if isinstance(x, c.Publish)] == [
        b"%d" % i for i in range(5, 10)
    ]


def test_the_cache_of_written_entries_is_bounded_in_bytes(monkeypatch: Any) -> None:
    """Entries this broker wrote are remembered for their readers only up to the cache's
    byte bound; entries it does not hold are delivered all the same (decoded)."""
    from polybroker.protocols.mqtt import session as s

    env = Env()
    sub = env.peer("s")
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 0)]))
    sub.packets()
    pub = env.peer("p")
    pub.packets()
    big = b"b" * (s.WRITTEN_CACHE_BYTES // 5)
    for _ in range(8):
        pub.send(c.Publish("a/b", big, 0))
    assert env.broker._written_bytes <= s.WRITTEN_CACHE_BYTES
    assert env.broker._written_bytes == sum(len(d) for d in env.broker.written)
    assert len(env.broker.written) < 8
    assert [x.payload for x in sub.packets() if isinstance(x, c.Publish)] == [big] * 8
    monkeypatch.setattr(s, "WRITTEN_CACHE_BYTES", 16)  # nothing is kept from now on
    env.broker.written.clear()
    env.broker._written_bytes = 0
    pub.send(c.Publish("a/b", b"not cached", 0))
    assert env.broker.written == {}
    assert [x.payload for x in sub.packets() if isinstance(x, c.Publish)] == [b"not cached"]


def test_a_topic_appearing_while_a_persistent_session_is_away_keeps_its_messages() -> None:
    """A wildcard filter's topic created while its persistent session's client is away gets
    the session's durable subscription (with no consumer reading it), so what is published
    there meanwhile is delivered when the client returns."""
    env = Env()
    sub = env.peer("s", clean_start=False)
    sub.send(c.Subscribe(1, [c.Subscription("w/#", 1)]))
    sub.packets()
    sub.send(c.Disconnect())
    env.clock.advance(1)
    pub = env.peer("p")
    pub.packets()
    pub.send(c.Publish("w/new", b"first", 1, packet_id=1))
    pub.send(c.Publish("w/new", b"second", 1, packet_id=2))
    assert pub.packets() == [c.PubAck(1), c.PubAck(2)]
    session = env.broker.sessions["s"]
    assert (session.subs, len(session.queue)) == ({}, 0)
    assert env.factory.ledger("public/default/persistent/w%252Fnew").cursors["mqtt-s"].backlog()
    back = env.peer("s", clean_start=False)
    got = back.packets()
    assert got[0] == c.ConnAck(True, 0)
    assert [x.payload for x in got[1:] if isinstance(x, c.Publish)] == [b"first", b"second"]


def test_pubrels_of_one_read_forget_their_ids_in_one_write() -> None:
    """Three PUBRELs in one read of a persistent session: one write of the QoS 2 record
    (which is then gone), then the three PUBCOMPs in order."""
    env = Env()
    p = env.peer("dev", clean_start=False)
    p.packets()
    p.conn.dataReceived(
        b"".join(c.encode(c.Publish("a/b", b"%d" % i, 2, packet_id=i)) for i in (1, 2, 3))
    )
    assert p.packets() == [c.PubRec(1), c.PubRec(2), c.PubRec(3)]
    writes = _record_writes(env, "put", "delete")
    p.conn.dataReceived(b"".join(c.encode(c.PubRel(i)) for i in (1, 2, 3)))
    assert p.packets() == [c.PubComp(1), c.PubComp(2), c.PubComp(3)]
    assert writes == ["/mqtt/qos2/dev"]
    assert not result_of(env.store.exists("/mqtt/qos2/dev"))


def _record_writes(env: Env, *methods: str) -> list[str]:
    """The paths of every later call of the store's ``methods`` (the calls still go through)."""
    writes: list[str] = []

    def recording(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: str, *args: Any, **kwargs: Any) -> Any:
            writes.append(path)
            return real(path, *args, **kwargs)

        return call

    for name in methods:
        setattr(env.store, name, recording(getattr(env.store, name)))
    return writes


def _divert(env: Env, method: str, prefix: str, fake: Callable[..., Any]) -> Callable[[], None]:
    """Calls of the store's ``method`` on paths under ``prefix`` go to ``fake`` (others reach
    the store) until the returned function is called."""
    real = getattr(env.store, method)

    def diverted(path: str, *args: Any, **kwargs: Any) -> Any:
        return (fake if path.startswith(prefix) else real)(path, *args, **kwargs)

    setattr(env.store, method, diverted)
    return lambda: setattr(env.store, method, real)


def _qos2_subscriber(env: Env, **connect: Any) -> Peer:
    sub = env.peer("s", clean_start=False, **connect)
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 2)]))
    sub.packets()
    return sub


def _three_qos2_deliveries(pub: Peer, sub: Peer) -> list[int]:
    """Publish three QoS 2 messages on a/b through ``pub``; the packet ids ``sub`` got them
    with."""
    pub.packets()
    for i in (1, 2, 3):
        pub.send(c.Publish("a/b", b"%d" % i, 2, packet_id=i))
    pids = [x.packet_id or 0 for x in _publishes(sub.packets())]
    assert len(pids) == 3
    return pids


def _out_nodes(env: Env) -> list[str]:
    return list(result_of(env.store.children("/mqtt/qos2-out/s")))


def _publishes(got: list[c.Packet]) -> list[c.Publish]:
    return [x for x in got if isinstance(x, c.Publish)]


def test_qos2_delivery_pubreced_before_a_crash_gets_only_pubrel_after_restart() -> None:
    """A QoS 2 message the client PUBRECed (PUBREL sent, no PUBCOMP) before a crash: the
    restarted broker sends PUBREL for the same packet id on return, never the message again;
    after PUBCOMP the entry is acknowledged, the record is gone and delivery goes on."""
    env = Env()
    sub = _qos2_subscriber(env)
    env.peer("p").send(c.Publish("a/b", b"once", 2, packet_id=3))
    (pub,) = _publishes(sub.packets())
    assert pub.packet_id is not None
    sub.send(c.PubRec(pub.packet_id))
    assert sub.packets() == [c.PubRel(pub.packet_id)]
    assert len(_out_nodes(env)) == 1
    restarted = Env(after=env)  # no clean stop: the in-memory state is gone
    back = restarted.peer("s", clean_start=False)
    assert back.packets() == [c.ConnAck(True, 0), c.PubRel(pub.packet_id)]
    back.send(c.PubComp(pub.packet_id))
    assert back.packets() == []
    assert restarted.broker.sessions["s"].inflight == {}
    assert restarted.factory.ledger(ML_AB).cursors["mqtt-s"].backlog() == 0
    assert _out_nodes(restarted) == []
    restarted.peer("p2").send(c.Publish("a/b", b"next", 2, packet_id=4))
    (nxt,) = _publishes(back.packets())
    assert (nxt.payload, nxt.dup) == (b"next", False)


def test_an_entry_partly_completed_before_a_crash_sends_only_its_other_messages() -> None:
    """Three QoS 2 messages in one entry, one in flight at a time: the first PUBCOMPed, the
    second PUBRECed when the broker crashes (nothing of the entry acknowledged). After the
    restart the client gets PUBRELs (never the first two messages again) and then only the
    third, as a new PUBLISH; the entry is acknowledged once that completes."""
    env = Env()
    props = {c.SESSION_EXPIRY: 600, c.RECEIVE_MAXIMUM: 1}
    sub = _qos2_subscriber(env, level=c.LEVEL_5, properties=props)
    pub = env.peer("p")
    pub.packets()
    pub.conn.dataReceived(
        b"".join(
            c.encode(c.Publish("a/b", m, 2, packet_id=i + 1), c.LEVEL_311)
            for i, m in enumerate([b"m0", b"m1", b"m2"])
        )
    )
    assert len(env.factory.ledger(ML_AB).data.entries) == 1
    (m0,) = _publishes(sub.packets())
    assert m0.packet_id is not None
    sub.send(c.PubRec(m0.packet_id))
    sub.send(c.PubComp(m0.packet_id))
    (rel0, m1) = sub.packets()
    assert rel0 == c.PubRel(m0.packet_id)
    assert isinstance(m1, c.Publish)
    assert m1.packet_id is not None
    assert m1.payload == b"m1"
    sub.send(c.PubRec(m1.packet_id))
    assert sub.packets() == [c.PubRel(m1.packet_id)]
    restarted = Env(after=env)
    back = restarted.peer("s", c.LEVEL_5, clean_start=False, properties=props)
    got = back.packets()
    assert isinstance(got[0], c.ConnAck)
    assert got[0].session_present
    # PUBCOMP is not recorded: the first one's PUBREL comes again too (answered at once).
    assert got[1:] == [c.PubRel(m0.packet_id), c.PubRel(m1.packet_id)]
    back.send(c.PubComp(m0.packet_id))
    back.send(c.PubComp(m1.packet_id))
    (m2,) = _publishes(back.packets())
    assert (m2.payload, m2.dup) == (b"m2", False)
    assert m2.packet_id is not None
    ml = restarted.factory.ledger(ML_AB)
    assert ml.cursors["mqtt-s"].backlog() == 3
    back.send(c.PubRec(m2.packet_id))
    back.send(c.PubComp(m2.packet_id))
    assert back.packets() == [c.PubRel(m2.packet_id)]
    assert ml.cursors["mqtt-s"].backlog() == 0


def test_a_stale_record_of_an_acknowledged_entry_is_dropped_after_a_restart() -> None:
    """An entry completed and durably acknowledged whose record's deletion was lost in the
    crash: on return its PUBREL comes again (the client answers PUBCOMP), the cursor passes
    the entry over, and its record is dropped once the cursor has delivered a later entry
    and the PUBCOMP came."""
    env = Env()
    sub = _qos2_subscriber(env)
    env.peer("p").send(c.Publish("a/b", b"done", 2, packet_id=3))
    (pub,) = _publishes(sub.packets())
    assert pub.packet_id is not None
    # The record's deletion never reaches the store before the crash.
    restore = _divert(env, "delete", "/mqtt/qos2-out/", lambda *_, **__: Deferred())
    sub.send(c.PubRec(pub.packet_id))
    sub.send(c.PubComp(pub.packet_id))
    assert sub.packets() == [c.PubRel(pub.packet_id)]
    sub.send(c.Disconnect())  # the cursor's acknowledgement is stored; the record not dropped
    restore()
    assert len(_out_nodes(env)) == 1
    restarted = Env(after=env)
    restarted.peer("p").send(c.Publish("a/b", b"later", 2, packet_id=4))
    back = restarted.peer("s", clean_start=False)
    got = back.packets()
    assert got[0] == c.ConnAck(True, 0)
    assert got[1] == c.PubRel(pub.packet_id)
    assert [x.payload for x in _publishes(got[2:])] == [b"later"]
    session = restarted.broker.sessions["s"]
    assert session.qos2_out  # the stale row waits for its PUBCOMP
    back.send(c.PubComp(pub.packet_id))
    assert (session.held, session.qos2_out, session.restored_out) == ({}, {}, {})
    assert _out_nodes(restarted) == []


def test_pubrecs_of_one_read_are_recorded_in_one_write_before_their_pubrels() -> None:
    """Three PUBRECs in one read of a persistent session: one write of the outbound QoS 2
    record, then the three PUBRELs in order; a clean session records nothing."""
    env = Env()
    sub = _qos2_subscriber(env)
    pub = env.peer("p")
    pids = _three_qos2_deliveries(pub, sub)
    writes = _record_writes(env, "put")
    sub.conn.dataReceived(b"".join(c.encode(c.PubRec(pid)) for pid in pids))
    assert sub.packets() == [c.PubRel(pid) for pid in pids]
    assert writes == ["/mqtt/qos2-out/s/0000000000"]
    clean = env.peer("cl")
    clean.send(c.Subscribe(1, [c.Subscription("a/b", 2)]))
    clean.packets()
    pub.send(c.Publish("a/b", b"x", 2, packet_id=9))
    (x,) = _publishes(clean.packets())
    assert x.packet_id is not None
    writes.clear()
    clean.send(c.PubRec(x.packet_id))
    assert clean.packets() == [c.PubRel(x.packet_id)]
    assert writes == []


def test_a_pubrec_whose_record_cannot_be_written_gets_no_pubrel() -> None:
    """When the record of a PUBREC cannot be written the connection closes without PUBREL;
    the returning client gets the PUBLISH again with DUP, and its new PUBREC gets PUBREL."""
    from twisted.internet.defer import fail

    env = Env()
    sub = _qos2_subscriber(env)
    env.peer("p").send(c.Publish("a/b", b"x", 2, packet_id=3))
    (pub,) = _publishes(sub.packets())
    assert pub.packet_id is not None
    down = RuntimeError("metadata store down")
    restore = _divert(env, "put", "/mqtt/qos2-out/", lambda *_, **__: fail(down))
    sub.send(c.PubRec(pub.packet_id))
    assert sub.packets() == []
    assert sub.closed
    restore()
    back = env.peer("s", clean_start=False)
    got = back.packets()
    assert got[0] == c.ConnAck(True, 0)
    (again,) = _publishes(got[1:])
    assert (again.payload, again.dup, again.packet_id) == (b"x", True, pub.packet_id)
    back.send(c.PubRec(pub.packet_id))
    assert back.packets() == [c.PubRel(pub.packet_id)]
    assert len(_out_nodes(env)) == 1


def test_unsubscribing_drops_the_record_of_the_topic() -> None:
    """An UNSUBSCRIBE forgets the recorded QoS 2 deliveries of the topics it no longer
    covers; ending the session deletes the record."""
    env = Env()
    sub = _qos2_subscriber(env)
    env.peer("p").send(c.Publish("a/b", b"x", 2, packet_id=3))
    (pub,) = _publishes(sub.packets())
    assert pub.packet_id is not None
    sub.send(c.PubRec(pub.packet_id))
    sub.packets()
    session = env.broker.sessions["s"]
    assert session.qos2_out
    sub.send(c.Unsubscribe(2, ["a/b"]))
    sub.packets()
    assert session.qos2_out == {}
    assert _out_nodes(env) == []
    sub.send(c.Subscribe(3, [c.Subscription("a/b", 2)]))
    env.peer("p").send(c.Publish("a/b", b"y", 2, packet_id=4))
    (y,) = _publishes(sub.packets())
    assert y.packet_id is not None
    sub.send(c.PubRec(y.packet_id))
    assert len(_out_nodes(env)) == 1
    sub.send(c.Disconnect())
    env.peer("s", clean_start=True)
    assert not result_of(env.store.exists("/mqtt/qos2-out/s"))


def test_pubrecs_arriving_while_their_record_is_written_share_the_next_write() -> None:
    """While one node of the record is being written, the PUBRECs of the next reads wait
    and are recorded together in one more node; each read's PUBRELs leave once their own
    node is stored."""
    env = Env()
    sub = _qos2_subscriber(env)
    pub = env.peer("p")
    pids = _three_qos2_deliveries(pub, sub)
    held: list[tuple[str, Deferred[Any]]] = []
    real_put = env.store.put

    def slow_put(path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        d: Deferred[Any] = Deferred()
        held.append((path, d))
        d.addCallback(lambda _: result_of(real_put(path, value, *args, **kwargs)))
        return d

    _divert(env, "put", "/mqtt/qos2-out/", slow_put)
    sub.send(c.PubRec(pids[0]))
    sub.send(c.PubRec(pids[1]))
    sub.send(c.PubRec(pids[2]))
    assert [p for p, _ in held] == ["/mqtt/qos2-out/s/0000000000"]
    assert sub.packets() == []
    held[0][1].callback(None)
    assert sub.packets() == [c.PubRel(pids[0])]
    assert [p for p, _ in held] == [
        "/mqtt/qos2-out/s/0000000000",
        "/mqtt/qos2-out/s/0000000001",
    ]
    held[1][1].callback(None)
    assert sub.packets() == [c.PubRel(pids[1]), c.PubRel(pids[2])]
    for pid in pids:
        sub.send(c.PubComp(pid))
    assert _out_nodes(env) == []


def test_a_puback_after_a_durable_write_goes_to_the_socket_at_once() -> None:
    """The PUBACK of a QoS 1 publish whose write completes after the read goes to the kernel
    when the write completes, not when the reactor next polls (the publisher waits for it)."""
    env = Env()
    pub = env.peer("p")
    pub.packets()
    pub.send(c.Publish("a/b", b"first", 1, packet_id=1))  # the topic's log now exists
    assert pub.packets() == [c.PubAck(1)]
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    tcp_transport = FakeTcp(pub.transport)
    pub.conn.transport = tcp_transport
    pub.send(c.Publish("a/b", b"second", 1, packet_id=2))
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (0, [])
    ml.release_appends()
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (1, [])
    assert pub.packets() == [c.PubAck(2)]


def test_a_delivery_after_a_durable_write_goes_to_the_socket_at_once() -> None:
    """A subscriber's PUBLISH, sent when the message's write completes, goes to the kernel
    then, not when the reactor next polls; what a read of the subscriber's bytes lets go
    (deliveries waiting for its PUBACKs) leaves at the read's end in one send."""
    env = Env(receive_maximum=1024)
    sub = env.peer("s", c.LEVEL_5, properties={c.RECEIVE_MAXIMUM: 1})
    sub.send(c.Subscribe(1, [c.Subscription("a/b", 1)]))
    sub.packets()
    pub = env.peer("p")
    pub.send(c.Publish("a/b", b"first", 0))  # the topic's log now exists
    (first,) = sub.packets()
    assert isinstance(first, c.Publish)
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    tcp_transport = FakeTcp(sub.transport)
    sub.conn.transport = tcp_transport
    pub.send(c.Publish("a/b", b"second", 1, packet_id=1))
    pub.send(c.Publish("a/b", b"third", 1, packet_id=2))
    assert tcp_transport.socket.sends == 0
    ml.release_appends(1)
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (1, [])
    (second,) = sub.packets()
    assert isinstance(second, c.Publish)
    assert second.payload == b"second"
    ml.release_appends()
    assert tcp_transport.socket.sends == 1  # receive maximum 1: "third" waits for a PUBACK
    sub.send(c.PubAck(second.packet_id))
    assert (tcp_transport.socket.sends, tcp_transport.queued) == (2, [])
    (third,) = sub.packets()
    assert isinstance(third, c.Publish)
    assert third.payload == b"third"


def _send_together(peer: Peer, *packets: c.Packet) -> None:
    """Deliver ``packets`` to the connection in one read."""
    peer.conn.dataReceived(b"".join(c.encode(p, peer.level) for p in packets))


def _qos1(first_pid: int, n: int) -> list[c.Packet]:
    return [c.Publish("a/b", b"m%d" % i, 1, packet_id=i) for i in range(first_pid, first_pid + n)]


#: The fewest publishes in flight whose answers to acknowledgements wait for each other.
ROUND = MqttSettings.publish_group_min_window


def _first_round(**settings: Any) -> tuple[Env, Peer, list[c.Packet]]:
    """A connected publisher ``pub`` whose first ``ROUND`` QoS 1 PUBLISHes (ids 1 to ROUND,
    one read) were handled, with what it received for them."""
    env = Env(**settings)
    p = env.peer("pub")
    p.packets()
    _send_together(p, *_qos1(1, ROUND))
    return env, p, p.packets()


def test_publishes_held_together_make_entries_of_bounded_size() -> None:
    """PUBLISHes held while a store is under way (and those of one read) are stored as
    entries of at most MAX_ENTRY_BYTES each, in order: one entry of all of them could pass
    the size a bookie takes, fail, and close the connection again at every resend."""
    from polybroker.protocols.mqtt.connection import MAX_ENTRY_BYTES

    env = Env()
    p = env.peer("pub")
    p.packets()
    body = b"x" * (MAX_ENTRY_BYTES // 10)
    p.send(c.Publish("a/b", b"first", 1, packet_id=1))
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    _send_together(p, *[c.Publish("a/b", body, 1, packet_id=i) for i in range(2, 42)])
    ml.release_appends()
    sizes = [len(e.data) for e in ml.data.entries]
    assert len(sizes) >= 5
    assert max(sizes) <= MAX_ENTRY_BYTES + 64 * 1024
    assert _stored_payloads(env) == [b"first"] + [body] * 40
    assert [a.packet_id for a in p.packets()] == list(range(1, 42))


def test_acks_written_together_wait_only_for_stores_begun_before_their_completion() -> None:
    """A store that completes while earlier-begun ones are under way waits for them and all
    their acknowledgements leave in one write; a store begun after that completion does not
    hold them back."""
    env = Env()
    p = env.peer("pub")
    p.packets()
    p.send(c.Publish("a/b", b"first", 0))  # loads the topic
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    writes = p.count_writes()
    p.send(c.Publish("a/b", b"one", 1, packet_id=1))
    p.send(c.Publish("a/b", b"two", 1, packet_id=2))
    ml.release_appends(1)  # "one" is durable, "two" is under way: PUBACK 1 waits
    p.send(c.Publish("a/b", b"three", 1, packet_id=3))  # begun after: not waited for
    assert writes == []
    ml.release_appends(1)
    assert len(writes) == 1
    assert p.packets() == [c.PubAck(1), c.PubAck(2)]
    ml.release_appends()
    assert p.packets() == [c.PubAck(3)]
    assert [e.num_messages for e in ml.data.entries] == [1, 1, 1, 1]


def test_publishes_wait_for_those_answering_the_acks_and_make_one_entry() -> None:
    """After N PUBACKs, the PUBLISHes that answer them are stored together once N arrived,
    although they came in several reads; acknowledgements follow the one durable write."""
    env, p, acks = _first_round()
    assert acks == [c.PubAck(i) for i in range(1, ROUND + 1)]
    ml = env.factory.ledger(ML_AB)
    assert [e.num_messages for e in ml.data.entries] == [ROUND]
    p.send(_qos1(ROUND + 1, 1)[0])
    assert len(ml.data.entries) == 1
    assert p.packets() == []
    _send_together(p, *_qos1(ROUND + 2, 2))
    p.send(_qos1(ROUND + 4, 1)[0])
    assert len(ml.data.entries) == 1
    _send_together(p, *_qos1(ROUND + 5, ROUND - 4))
    assert [e.num_messages for e in ml.data.entries] == [ROUND, ROUND]
    assert p.packets() == [c.PubAck(i) for i in range(ROUND + 1, 2 * ROUND + 1)]
    env.clock.advance(1.0)  # the wait ended with the last one: nothing more is stored
    assert [e.num_messages for e in ml.data.entries] == [ROUND, ROUND]


def test_held_publishes_are_stored_when_the_wait_ends() -> None:
    """PUBLISHes waiting for more are stored after ``publish_group_wait_s`` if the rest does
    not come, and the next ones are then stored at once."""
    env, p, acks = _first_round(publish_group_wait_s=0.002)
    assert len(acks) == ROUND
    ml = env.factory.ledger(ML_AB)
    p.send(_qos1(ROUND + 1, 1)[0])
    env.clock.advance(0.001)
    assert len(ml.data.entries) == 1
    assert p.packets() == []
    env.clock.advance(0.001)
    assert [e.num_messages for e in ml.data.entries] == [ROUND, 1]
    assert p.packets() == [c.PubAck(ROUND + 1)]
    p.send(_qos1(ROUND + 2, 1)[0])  # one was in flight during that round: stored at once
    assert [e.num_messages for e in ml.data.entries] == [ROUND, 1, 1]
    assert p.packets() == [c.PubAck(ROUND + 2)]


def test_old_acks_make_no_publish_wait() -> None:
    """Acknowledgements the client did not answer for a while are not waited on: a PUBLISH
    arriving later is stored at once."""
    env, p, acks = _first_round(publish_group_wait_s=0.001)
    assert len(acks) == ROUND
    env.clock.advance(1.0)
    p.send(_qos1(ROUND + 1, 1)[0])
    assert p.packets() == [c.PubAck(ROUND + 1)]
    assert [e.num_messages for e in env.factory.ledger(ML_AB).data.entries] == [ROUND, 1]


def test_publishes_of_a_client_with_few_in_flight_are_stored_at_once() -> None:
    """A client that had fewer than ``publish_group_min_window`` publishes in flight during
    the last round (one pacing its publishes) has its answers stored as they arrive; once it
    had that many, its answers wait for each other again."""
    env = Env(publish_group_wait_s=0.002)
    p = env.peer("pub")
    p.packets()
    ml = env.factory.ledger
    small = ROUND - 1
    _send_together(p, *_qos1(1, small))
    assert p.packets() == [c.PubAck(i) for i in range(1, small + 1)]
    p.send(_qos1(small + 1, 1)[0])
    assert p.packets() == [c.PubAck(small + 1)]
    p.send(_qos1(small + 2, 1)[0])
    assert p.packets() == [c.PubAck(small + 2)]
    first = small + 3
    _send_together(p, *_qos1(first, ROUND))
    assert p.packets() == [c.PubAck(i) for i in range(first, first + ROUND)]
    p.send(_qos1(first + ROUND, 1)[0])
    assert p.packets() == []
    _send_together(p, *_qos1(first + ROUND + 1, ROUND - 1))
    assert p.packets() == [c.PubAck(i) for i in range(first + ROUND, first + 2 * ROUND)]
    assert [e.num_messages for e in ml(ML_AB).data.entries] == [small, 1, 1, ROUND, ROUND]


def test_a_round_cut_short_by_the_wait_still_makes_its_late_answer_wait() -> None:
    """A client that kept its window full stays one whose answers wait: when the wait ran out
    before its last answer, that answer, arriving after the others were acknowledged, waits
    for the answers to those acknowledgements and makes one entry with them."""
    env = Env(publish_group_wait_s=0.002)
    p = env.peer("pub")
    p.packets()
    n = 2 * ROUND
    _send_together(p, *_qos1(1, n))
    assert len(p.packets()) == n
    ml = env.factory.ledger(ML_AB)
    _send_together(p, *_qos1(n + 1, n - 1))  # every answer but the last: they wait
    assert len(ml.data.entries) == 1
    env.clock.advance(0.002)  # the wait runs out: stored without the last
    assert [e.num_messages for e in ml.data.entries] == [n, n - 1]
    assert len(p.packets()) == n - 1
    p.send(_qos1(2 * n, 1)[0])
    assert p.packets() == []
    _send_together(p, *_qos1(2 * n + 1, n - 2))
    assert [e.num_messages for e in ml.data.entries] == [n, n - 1, n - 1]
    assert p.packets() == [c.PubAck(i) for i in range(2 * n, 3 * n - 1)]


def test_paced_publishes_whose_acks_meet_do_not_start_waiting_in_pairs() -> None:
    """A paced client's two stores under way at once are acknowledged together; its next
    PUBLISHes are still stored one by one as they arrive, none waiting for the next."""
    env = Env(publish_group_wait_s=0.002)
    p = env.peer("pub")
    p.packets()
    p.send(c.Publish("a/b", b"first", 0))  # loads the topic
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    p.send(_qos1(1, 1)[0])
    p.send(_qos1(2, 1)[0])
    ml.release_appends()
    ml.hold_appends = False
    assert p.packets() == [c.PubAck(1), c.PubAck(2)]
    for pid in range(3, 7):
        p.send(_qos1(pid, 1)[0])
        assert p.packets() == [c.PubAck(pid)]
    assert [e.num_messages for e in ml.data.entries] == [1] * 7


def test_no_wait_when_the_group_wait_is_zero() -> None:
    """``publish_group_wait_s=0`` stores every read's PUBLISHes at once."""
    _, p, _ = _first_round(publish_group_wait_s=0)
    p.send(_qos1(ROUND + 1, 1)[0])
    assert p.packets() == [c.PubAck(ROUND + 1)]


def test_a_retained_publish_is_stored_after_the_held_ones() -> None:
    """A retained PUBLISH arriving while earlier ones wait is stored after them (the topic
    keeps the client's order)."""
    env, p, _ = _first_round(publish_group_wait_s=0.002)
    p.send(_qos1(ROUND + 1, 1)[0])
    p.send(c.Publish("a/b", b"kept", 1, retain=True, packet_id=ROUND + 2))
    payloads = [
        m.payload for e in env.factory.ledger(ML_AB).data.entries for m in decode_entry(e.data)
    ]
    assert payloads == [b"m%d" % i for i in range(1, ROUND + 2)] + [b"kept"]
    assert p.packets() == [c.PubAck(ROUND + 1), c.PubAck(ROUND + 2)]


def test_held_publishes_are_stored_when_the_connection_drops() -> None:
    """PUBLISHes waiting for more are stored if the connection is lost meanwhile."""
    env, p, _ = _first_round(publish_group_wait_s=0.002)
    p.send(_qos1(ROUND + 1, 1)[0])
    p.conn.connectionLost(None)
    assert [e.num_messages for e in env.factory.ledger(ML_AB).data.entries] == [ROUND, 1]
    env.clock.advance(1.0)  # the wait's timer is gone: nothing is stored twice
    assert [e.num_messages for e in env.factory.ledger(ML_AB).data.entries] == [ROUND, 1]


def _half_stored(level: int = c.LEVEL_311) -> tuple[Env, Peer, int]:
    """A publisher that had ``2 * ROUND`` QoS 1 PUBLISHes acknowledged and answered half of
    them, the wait for the other half ran out: that half's store is under way (appends
    held). Returns the environment, the peer and the next packet id."""
    env = Env(publish_group_wait_s=0.002)
    p = env.peer("pub", level)
    p.packets()
    p.send(c.Publish("a/b", b"first", 0))  # loads the topic
    n = 2 * ROUND
    _send_together(p, *_qos1(1, n))
    assert p.packets() == [c.PubAck(i) for i in range(1, n + 1)]
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    _send_together(p, *_qos1(n + 1, ROUND))
    env.clock.advance(0.002)
    assert ml.held_appends == 1
    return env, p, n + ROUND + 1


def test_publishes_sent_while_a_store_is_under_way_wait_for_it() -> None:
    """A client keeping a full window in flight has one store under way at a time: what it
    sends meanwhile waits for that store (however long it takes), then for the answers to the
    store's acknowledgements, and all of them make one entry."""
    env, p, pid = _half_stored()
    ml = env.factory.ledger(ML_AB)
    _send_together(p, *_qos1(pid, ROUND))
    env.clock.advance(1.0)
    assert ml.held_appends == 1
    assert p.packets() == []
    ml.hold_appends = False
    ml.release_appends()
    assert p.packets() == [c.PubAck(i) for i in range(pid - ROUND, pid)]
    assert [e.num_messages for e in ml.data.entries] == [1, 2 * ROUND, ROUND]
    _send_together(p, *_qos1(pid + ROUND, ROUND))  # the answers to those acknowledgements
    assert [e.num_messages for e in ml.data.entries] == [1, 2 * ROUND, ROUND, 2 * ROUND]
    assert p.packets() == [c.PubAck(i) for i in range(pid, pid + 2 * ROUND)]


def test_publishes_waiting_for_a_failed_store_are_stored_after_it() -> None:
    """When the store under way fails (an MQTT 5 client hears 0x80), the PUBLISHes that
    waited for it are still stored and acknowledged, in order."""
    env, p, pid = _half_stored(c.LEVEL_5)
    ml = env.factory.ledger(ML_AB)
    _send_together(p, *_qos1(pid, ROUND))
    ml.hold_appends = False
    ml.release_appends(error=RuntimeError("bookies gone"))
    failed = [c.PubAck(i, c.UNSPECIFIED_ERROR) for i in range(pid - ROUND, pid)]
    assert p.packets() == failed + [c.PubAck(i) for i in range(pid, pid + ROUND)]
    assert [e.num_messages for e in ml.data.entries] == [1, 2 * ROUND, ROUND]
    assert not p.closed


class _QuickAckSocket:
    """A TCP socket handle that records its ``setsockopt`` calls (or refuses them)."""

    def __init__(self, refuse: bool = False) -> None:
        self.family = socket.AF_INET
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse

    def setsockopt(self, level: int, option: int, value: int) -> None:
        if self.refuse:
            raise OSError("not supported")
        self.calls.append((level, option, value))


def test_reads_with_qos1_publishes_ask_the_kernel_to_ack_at_once() -> None:
    """A read bringing a QoS 1/2 PUBLISH sets TCP_QUICKACK on the connection's socket (the
    client's next writes are not held by Nagle's algorithm behind a delayed ACK); other
    reads do not; a socket refusing it is left be and the connection goes on."""
    env = Env()
    option = (socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    for refuse in (False, True):
        handle = _QuickAckSocket(refuse)
        transport = StringTransport()
        transport.getHandle = lambda h=handle: h  # type: ignore[attr-defined]
        conn = MqttConnection(env.settings)
        conn.makeConnection(transport)
        conn.dataReceived(c.encode(c.Connect(f"q{refuse}", c.LEVEL_311), c.LEVEL_311))
        conn.dataReceived(c.encode(c.PingReq(), c.LEVEL_311))
        conn.dataReceived(c.encode(c.Publish("a/b", b"x", 0), c.LEVEL_311))
        assert handle.calls == []
        conn.dataReceived(c.encode(c.Publish("a/b", b"y", 1, packet_id=1), c.LEVEL_311))
        conn.dataReceived(c.encode(c.Publish("a/b", b"z", 2, packet_id=2), c.LEVEL_311))
        assert handle.calls == ([] if refuse else [option, option])
        assert not transport.disconnecting
        reader = c.PacketReader(level=c.LEVEL_311)
        reader.feed(transport.value())
        assert reader.packets()[-2:] == [c.PubAck(1), c.PubRec(2)]


def test_publishes_answering_pubcomps_are_also_stored_together() -> None:
    """QoS 2: the PUBLISHes that answer a round of PUBCOMPs wait for each other as those
    answering PUBACKs do, and make one entry."""
    env = Env(publish_group_wait_s=0.002)
    p = env.peer("pub")
    p.packets()
    first = range(1, ROUND + 1)
    _send_together(p, *(c.Publish("a/b", b"q%d" % i, 2, packet_id=i) for i in first))
    assert p.packets() == [c.PubRec(i) for i in first]
    _send_together(p, *(c.PubRel(i) for i in first))
    assert p.packets() == [c.PubComp(i) for i in first]
    ml = env.factory.ledger(ML_AB)
    p.send(c.Publish("a/b", b"q", 2, packet_id=ROUND + 1))
    assert [e.num_messages for e in ml.data.entries] == [ROUND]
    rest = range(ROUND + 2, 2 * ROUND + 1)
    _send_together(p, *(c.Publish("a/b", b"q%d" % i, 2, packet_id=i) for i in rest))
    assert [e.num_messages for e in ml.data.entries] == [ROUND, ROUND]
    assert p.packets() == [c.PubRec(i) for i in range(ROUND + 1, 2 * ROUND + 1)]


def test_one_matching_filter_gives_its_granted_qos_and_subscription_id() -> None:
    """A delivery matched by one filter carries that filter's subscription identifier, at
    min(publish QoS, granted QoS)."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5)
    sub.send(c.Subscribe(1, [c.Subscription("a/+", 1)], {c.SUBSCRIPTION_ID: [9]}))
    sub.packets()
    env.peer("p").send(c.Publish("a/b", b"x", 2, packet_id=1))
    (got,) = sub.packets()
    assert isinstance(got, c.Publish)
    assert (got.payload, got.qos, got.properties[c.SUBSCRIPTION_ID]) == (b"x", 1, [9])


def test_overlapping_filters_deliver_once_at_the_highest_qos_with_every_id() -> None:
    """A message matching two filters of one client is delivered once, at the higher granted
    QoS, with both subscription identifiers."""
    env = Env()
    sub = env.peer("s", c.LEVEL_5)
    sub.send(c.Subscribe(1, [c.Subscription("a/#", 0)], {c.SUBSCRIPTION_ID: [7]}))
    sub.send(c.Subscribe(2, [c.Subscription("a/b", 1)], {c.SUBSCRIPTION_ID: [3]}))
    sub.packets()
    env.peer("p").send(c.Publish("a/b", b"y", 1, packet_id=1))
    (got,) = sub.packets()
    assert isinstance(got, c.Publish)
    assert (got.payload, got.qos, got.properties[c.SUBSCRIPTION_ID]) == (b"y", 1, [3, 7])


def test_subscription_identifiers_where_a_client_may_not_send_them_are_refused() -> None:
    """A client's PUBLISH carrying a subscription identifier, and a SUBSCRIBE carrying two,
    are protocol errors: DISCONNECT 0x82 and a closed connection, nothing stored."""
    env = Env()
    pub = env.peer("p", c.LEVEL_5)
    pub.packets()
    pub.send(c.Publish("a/b", b"x", 1, False, False, 1, {c.SUBSCRIPTION_ID: [7]}))
    sub = env.peer("s", c.LEVEL_5)
    sub.packets()
    sub.send(c.Subscribe(1, [c.Subscription("a/#", 1)], {c.SUBSCRIPTION_ID: [1, 2]}))
    for peer in (pub, sub):
        (disconnect,) = peer.packets()
        assert isinstance(disconnect, c.Disconnect)
        assert disconnect.reason_code == c.PROTOCOL_ERROR
        assert peer.closed
    assert env.factory.logs.get(ML_AB) is None or env.factory.ledger(ML_AB).data.entries == []


def test_a_property_another_packet_type_owns_is_malformed() -> None:
    """A CONNACK-only property in a client's PUBLISH is a malformed packet: DISCONNECT 0x81."""
    env = Env()
    pub = env.peer("p", c.LEVEL_5)
    pub.packets()
    pub.send(c.Publish("a/b", b"x", 0, False, False, None, {c.MAXIMUM_QOS: 1}))
    (disconnect,) = pub.packets()
    assert isinstance(disconnect, c.Disconnect)
    assert disconnect.reason_code == c.MALFORMED_PACKET
    assert pub.closed


def test_stores_past_the_pending_bound_stop_the_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """QoS 0 PUBLISHes faster than storage: past MAX_PENDING_STORES stores under way the
    socket is not read and the rest of a read waits in the reader; once half completed
    reading resumes, and every message is stored in order."""
    from polybroker.protocols.mqtt import connection

    monkeypatch.setattr(connection, "MAX_PENDING_STORES", 4)
    env = Env()
    p = env.peer("p")
    p.packets()
    p.send(c.Publish("a/b", b"m0", 0))  # creates the topic
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    for i in range(1, 6):
        assert p.transport.producerState == "producing"
        p.send(c.Publish("a/b", b"m%d" % i, 0))  # a read each: a store each
    assert p.transport.producerState == "paused"
    # Bytes read before the pause took effect: the first packet is taken, the rest wait.
    p.conn.dataReceived(
        b"".join(c.encode(c.Publish("a/b", b"m%d" % i, 0), c.LEVEL_311) for i in range(6, 9))
    )
    assert ml.held_appends == 6
    ml.release_appends(2)
    env.clock.advance(0)
    assert p.transport.producerState == "paused"  # 4 under way: more than half
    ml.release_appends(2)
    assert p.transport.producerState == "producing"
    env.clock.advance(0)  # the rest of the read
    ml.release_appends()
    assert _stored_payloads(env) == [b"m%d" % i for i in range(9)]


def test_a_full_publish_buffer_stops_the_reading() -> None:
    """Past the broker-wide publish buffer's limit a publishing client stops being read, the
    rest of a read waiting in the reader; when it drained to half it reads on."""
    env = Env()
    buffer = env.service.publish_buffer
    buffer.limit = 2500
    p = env.peer("p")
    p.packets()
    p.send(c.Publish("a/b", b"m0", 0))  # creates the topic
    ml = env.factory.ledger(ML_AB)
    ml.hold_appends = True
    p.send(c.Publish("a/b", b"1" * 1000, 0))
    p.send(c.Publish("a/b", b"2" * 1000, 0))
    assert p.transport.producerState == "producing"
    p.send(c.Publish("a/b", b"3" * 1000, 0))
    assert buffer.full
    assert p.transport.producerState == "paused"
    # Bytes read before the pause took effect: the first packet is taken, the rest wait.
    p.conn.dataReceived(
        b"".join(c.encode(c.Publish("a/b", b"%d" % i * 1000, 0), c.LEVEL_311) for i in (4, 5))
    )
    assert ml.held_appends == 4
    ml.release_appends()
    env.clock.advance(0)  # the rest of the read
    assert p.transport.producerState == "producing"
    ml.release_appends()
    assert [x[:1] for x in _stored_payloads(env)] == [b"m", b"1", b"2", b"3", b"4", b"5"]
    assert buffer.used == 0


def test_resubscribing_without_reading_queues_one_copy_of_each_retained_message() -> None:
    """A client that subscribes to the same filter again and again and does not read: each
    SUBSCRIBE's retained copies replace those of the one before that have not left, so the
    session holds one copy of each; every SUBACK arrives in order, and after the last one
    every retained message."""
    env = Env()
    pub = env.peer("p")
    for i in range(50):
        pub.send(c.Publish(f"r/{i:02d}", b"%02d" % i + b"x" * 198, 0, retain=True))
    conn = MqttConnection(env.settings)
    slow = SlowClient(limit=1000)
    conn.makeConnection(slow)
    conn.dataReceived(c.encode(c.Connect("s", c.LEVEL_311), c.LEVEL_311))
    slow.drain()
    subscribe = b"".join(
        c.encode(c.Subscribe(i, [c.Subscription("r/#", 0)]), c.LEVEL_311) for i in range(1, 201)
    )
    conn.dataReceived(subscribe)
    assert conn.session is not None
    assert len(conn.session.queue) <= 50  # 200 SUBSCRIBEs taken, one copy of each queued
    reader = c.PacketReader(level=c.LEVEL_311)
    got: list[c.Packet] = []
    rounds = 0
    while slow.producerState == "paused" or conn.session.queue or slow.unsent:
        reader.feed(slow.value())
        slow.clear()
        got += reader.packets()
        rounds += 1
        assert rounds < 1000, "no progress"
        slow.drain()
    reader.feed(slow.value())
    got += reader.packets()
    assert got[0] == c.ConnAck(False, 0)
    assert [p for p in got if isinstance(p, c.SubAck)] == [c.SubAck(i, [0]) for i in range(1, 201)]
    last_suback = max(i for i, p in enumerate(got) if isinstance(p, c.SubAck))
    after = got[last_suback + 1 :]
    assert [p.topic for p in after if isinstance(p, c.Publish)] == [f"r/{n:02d}" for n in range(50)]
    retained = [p for p in got if isinstance(p, c.Publish)]
    assert all(p.retain for p in retained)
    assert len(retained) < 200 * 50 // 4  # the copies that left before the next SUBSCRIBE


def test_resubscribing_without_acknowledging_queues_one_copy_of_each_retained_message() -> None:
    """An MQTT 5 client that reads but acknowledges nothing has its receive maximum in flight,
    and the rest waits in its session: SUBSCRIBEs of the same filter sent again and again
    leave one copy of each retained message waiting, not one per SUBSCRIBE; acknowledged,
    the last SUBSCRIBE's copies all arrive."""
    env = Env()
    pub = env.peer("p")
    for i in range(50):
        pub.send(c.Publish(f"r/{i:02d}", b"%02d" % i, 1, retain=True, packet_id=i + 1))
    p = env.peer("s", c.LEVEL_5, properties={c.RECEIVE_MAXIMUM: 5})
    p.packets()
    for pid in range(1, 1001):
        p.send(c.Subscribe(pid, [c.Subscription("r/#", 1)]))
    session = p.conn.session
    assert session is not None
    assert (len(session.inflight), len(session.queue)) == (5, 50)
    topics: list[str] = []
    got = [x for x in p.packets() if isinstance(x, c.Publish)]
    while got:
        for x in got:
            assert x.packet_id is not None
            topics.append(x.topic)
            p.send(c.PubAck(x.packet_id))
        got = [x for x in p.packets() if isinstance(x, c.Publish)]
    # The first SUBSCRIBE's five in flight, then the last one's copies.
    assert topics == [f"r/{n:02d}" for n in range(5)] + [f"r/{n:02d}" for n in range(50)]
    assert (len(session.queue), len(session.inflight)) == (0, 0)


def test_a_client_that_does_not_read_its_answers_stops_being_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the answers waiting for a client pass MAX_UNREAD the socket is not read; it is
    read again once they were sent, and every answer is there."""
    from polybroker.protocols.mqtt import connection

    monkeypatch.setattr(connection, "MAX_UNREAD", 10_000)
    env = Env()
    conn = MqttConnection(env.settings)
    slow = SlowClient(limit=1000)
    conn.makeConnection(slow)
    conn.dataReceived(c.encode(c.Connect("pinger", c.LEVEL_311), c.LEVEL_311))
    conn.dataReceived(c.encode(c.PingReq(), c.LEVEL_311) * 3000)  # 6000 bytes of answers
    assert slow.producerState == "producing"
    conn.dataReceived(c.encode(c.PingReq(), c.LEVEL_311) * 3000)
    assert slow.producerState == "paused"
    slow.drain()
    assert slow.producerState == "producing"
    reader = c.PacketReader(level=c.LEVEL_311)
    reader.feed(slow.value())
    assert reader.packets()[1:] == [c.PingResp()] * 6000
