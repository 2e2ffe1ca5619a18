"""Unit tests of the forwarder's client state machine: a ``PulsarForwarder`` paired in memory
with a real owner-side ``PulsarConnection`` over the fake ledger (StringTransport both ways, a
Clock), plus hand-written owner frames for the failure cases. No sockets, no threads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, failure_of, result_of

from polybroker.broker_core.consumer import Delivery, SubType
from polybroker.broker_core.errors import NotAllowedError, TopicNotFoundError
from polybroker.broker_core.forwarding import ForwardingError
from polybroker.broker_core.messages import Message, decode_entry, encode_entry
from polybroker.broker_core.ownership import BrokerInfo
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.ledger.api import InitialPosition, Position
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    FrameDecoder,
    command,
    encode_command,
    encode_payload_command,
    message_id,
)
from polybroker.protocols.pulsar.connection import PulsarConnection, PulsarSettings
from polybroker.protocols.pulsar.forwarder import OwnerConnection, PulsarForwarder, owner_error
from polybroker.protocols.pulsar.inspector import PulsarEntryInspector

T = pb.BaseCommand
TOPIC = "persistent://public/default/t"
OWNER = BrokerInfo("owner:8080", "http://owner:8080", "pulsar://owner:6650")


class Recorder:
    """A handler's ``Consumer`` that records what it is given."""

    def __init__(self, name: str = "c") -> None:
        self.deliveries: list[Delivery] = []
        self.disconnected = 0
        self._name = name

    @property
    def consumer_id(self) -> int:
        return 1

    @property
    def consumer_name(self) -> str:
        return self._name

    @property
    def priority_level(self) -> int:
        return 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        self.deliveries.extend(deliveries)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        self.disconnected += 1


class Owner:
    """A real owner broker (service + Pulsar connection) and the forwarder that reaches it."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.store = FakeMetadataStore()
        self.service = BrokerService(
            FakeLedgerFactory(self.clock.seconds),
            self.clock,
            Config({"statsUpdateFrequencyInSecs": 0}),
            self.store,
            inspector=PulsarEntryInspector(),
        )
        self.settings = PulsarSettings(service=self.service, clock=self.clock, keep_alive_s=0)
        self.server: PulsarConnection | None = None
        self.server_transport: StringTransport | None = None
        self.client: OwnerConnection | None = None
        self.client_transport: StringTransport | None = None
        self.connects = 0
        self.forwarder = PulsarForwarder(self.clock, connect=self.connect, request_timeout_s=5)

    def connect(self, host: str, port: int, factory: Factory) -> Deferred[Protocol]:
        assert (host, port) == ("owner", 6650)
        self.connects += 1
        self.server = PulsarConnection(self.settings)
        self.server_transport = StringTransport()
        self.server.makeConnection(self.server_transport)
        proto = factory.buildProtocol(None)
        assert isinstance(proto, OwnerConnection)
        self.client = proto
        self.client_transport = StringTransport()
        proto.makeConnection(self.client_transport)
        self.pump()
        return succeed(proto)

    def pump(self) -> None:
        """Move bytes both ways (and let the fake ledger complete) until nothing moves."""
        for _ in range(100):
            moved = False
            assert self.client_transport is not None
            assert self.server_transport is not None
            up = self.client_transport.value()
            if up:
                self.client_transport.clear()
                assert self.server is not None
                self.server.dataReceived(up)
                moved = True
            self.clock.advance(0)
            down = self.server_transport.value()
            if down:
                self.server_transport.clear()
                assert self.client is not None
                self.client.dataReceived(down)
                moved = True
            if not moved:
                return
        raise AssertionError("the pair never went quiet")

    def drop(self) -> None:
        """The owner dies: both ends see the connection lost."""
        assert self.client is not None
        assert self.server is not None
        self.server.connectionLost(None)
        self.client.connectionLost(None)


def entry(payload: bytes, key: bytes | None = None, **props: str) -> bytes:
    return encode_entry(
        [Message(payload, key=key, properties=list(props.items()), event_time_ms=42)],
        producer_name="mqtt-dev",
        sequence_id=0,
        publish_time_ms=1000,
    )


def fired(d: Deferred[Any], owner: Owner) -> Any:
    owner.pump()
    return result_of(d)


def test_publish_stores_the_entry_byte_for_byte_at_the_owner() -> None:
    """A forwarded publish is one SEND of the stored entry; it fires with the owner's position
    once durable, and the owner stores exactly those bytes."""
    o = Owner()
    data = entry(b"hello", key=b"k", colour="red")
    pos = fired(o.forwarder.publish(OWNER, TOPIC, data), o)
    assert isinstance(pos, Position)
    sub = Recorder()
    server = result_of(
        o.service.subscribe(TOPIC, "check", sub, initial_position=InitialPosition.EARLIEST)
    )
    server.flow(10)
    o.clock.advance(0)
    assert [d.entry.data for d in sub.deliveries] == [data]
    assert sub.deliveries[0].entry.position == pos
    [msg] = decode_entry(sub.deliveries[0].entry.data)
    assert (msg.payload, msg.key, msg.properties, msg.event_time_ms) == (
        b"hello",
        b"k",
        [("colour", "red")],
        42,
    )


def test_one_connection_and_one_producer_serve_many_publishes() -> None:
    """Publishes to one owner share its connection, and those of one topic one producer."""
    o = Owner()
    ds = [o.forwarder.publish(OWNER, TOPIC, entry(b"m%d" % i)) for i in range(5)]
    ds.append(o.forwarder.publish(OWNER, TOPIC + "2", entry(b"other")))
    o.pump()
    positions = [result_of(d) for d in ds]
    assert o.connects == 1
    assert [p.entry_id for p in positions[:5]] == sorted(p.entry_id for p in positions[:5])
    assert len({(p.ledger_id, p.entry_id) for p in positions[:5]}) == 5
    assert o.client is not None
    assert len(o.client.producers) == 2


def test_subscription_delivers_owner_positions_and_acks_reach_the_owner() -> None:
    """A forwarded consumer gets Deliveries with the owner's positions and data; its FLOW and
    ACK drive the owner's subscription (acknowledged entries are not redelivered)."""
    o = Owner()
    for i in range(3):
        fired(o.forwarder.publish(OWNER, TOPIC, entry(b"m%d" % i)), o)
    rec = Recorder()
    d = o.forwarder.subscribe(
        OWNER, TOPIC, "mqtt-dev", rec, SubType.EXCLUSIVE, InitialPosition.EARLIEST, durable=True
    )
    remote = fired(d, o)
    assert rec.deliveries == []
    remote.flow(2)
    o.pump()
    assert [decode_entry(x.entry.data)[0].payload for x in rec.deliveries] == [b"m0", b"m1"]
    remote.flow(5)
    o.pump()
    assert len(rec.deliveries) == 3
    positions = [x.entry.position for x in rec.deliveries]
    topic = result_of(o.service.get_topic(TOPIC))
    sub = topic.subscriptions["mqtt-dev"]
    [server] = sub.consumers
    assert set(server.pending) == set(positions)
    remote.ack(positions[:2])
    o.pump()
    assert set(server.pending) == {positions[2]}
    # A negative ack sends the rest again, with its redelivery count.
    remote.redeliver(None)
    o.pump()
    assert rec.deliveries[-1].entry.position == positions[2]
    assert rec.deliveries[-1].redelivery_count == 1


def test_close_and_unsubscribe_act_on_the_owner() -> None:
    """close detaches the consumer on the owner; unsubscribe deletes the subscription."""
    o = Owner()
    rec = Recorder()
    remote = fired(o.forwarder.subscribe(OWNER, TOPIC, "s1", rec), o)
    topic = result_of(o.service.get_topic(TOPIC))
    assert len(topic.subscriptions["s1"].consumers) == 1
    fired(remote.close(), o)
    assert remote.closed
    assert topic.subscriptions["s1"].consumers == []
    other = fired(o.forwarder.subscribe(OWNER, TOPIC, "s2", Recorder()), o)
    fired(other.unsubscribe(), o)
    assert "s2" not in topic.subscriptions
    assert rec.disconnected == 0


def test_owner_errors_map_to_broker_errors() -> None:
    """An owner's refusal carries the broker_core error of its code; ServiceNotReady is a
    ForwardingError (look up and retry)."""
    o = Owner()
    d = o.forwarder.subscribe(OWNER, TOPIC + "-missing", "s", Recorder(), create_topic=False)
    o.pump()
    assert isinstance(failure_of(d), TopicNotFoundError)
    assert isinstance(owner_error(pb.ServiceNotReady, "moved"), ForwardingError)
    assert isinstance(owner_error(pb.NotAllowedError, "no"), NotAllowedError)


def test_owner_closing_the_consumer_disconnects_the_handlers_consumer() -> None:
    """CLOSE_CONSUMER from the owner (unload, topic moved) reaches the handler's consumer as
    disconnect(); later MESSAGEs for it are ignored."""
    o = Owner()
    rec = Recorder()
    remote = fired(o.forwarder.subscribe(OWNER, TOPIC, "s", rec), o)
    fired(o.service.unload_topic(TOPIC), o)
    assert rec.disconnected == 1
    assert remote.closed
    # The connection itself stays for the others.
    assert fired(o.forwarder.publish(OWNER, TOPIC, entry(b"x")), o) is not None
    assert o.connects == 1


def test_owner_closing_the_producer_fails_its_sends_for_a_retry() -> None:
    """CLOSE_PRODUCER from the owner fails the unanswered sends with ForwardingError; the next
    publish creates the producer again."""
    o = Owner()
    fired(o.forwarder.publish(OWNER, TOPIC, entry(b"a")), o)
    assert o.client is not None
    pid = o.client.producers[TOPIC].producer_id
    pending = o.forwarder.publish(OWNER, TOPIC, entry(b"b"))  # not pumped: unanswered
    o.client.dataReceived(
        encode_command(command(T.CLOSE_PRODUCER, "close_producer", producer_id=pid, request_id=0))
    )
    assert isinstance(failure_of(pending), ForwardingError)
    assert TOPIC not in o.client.producers
    assert isinstance(fired(o.forwarder.publish(OWNER, TOPIC, entry(b"c")), o), Position)
    assert o.client.producers[TOPIC].producer_id != pid


def test_connection_lost_fails_requests_disconnects_consumers_and_reconnects() -> None:
    """When the owner goes away, pending publishes fail with ForwardingError, consumers are
    disconnected, and the next call opens a new connection."""
    o = Owner()
    rec = Recorder()
    fired(o.forwarder.subscribe(OWNER, TOPIC, "s", rec), o)
    pending = o.forwarder.publish(OWNER, TOPIC, entry(b"lost?"))
    o.drop()
    assert isinstance(failure_of(pending), ForwardingError)
    assert rec.disconnected == 1
    assert isinstance(fired(o.forwarder.publish(OWNER, TOPIC, entry(b"again")), o), Position)
    assert o.connects == 2


def test_requests_time_out_when_the_owner_is_silent() -> None:
    """A request the owner never answers fails after the request timeout (ForwardingError)."""
    o = Owner()
    fired(o.forwarder.publish(OWNER, TOPIC, entry(b"a")), o)
    d = o.forwarder.publish(OWNER, TOPIC, entry(b"b"))  # never pumped to the owner
    out: list[object] = []
    d.addBoth(lambda r: out.append(r) or r)
    o.clock.advance(4.9)
    assert out == []
    o.clock.advance(0.2)
    assert isinstance(failure_of(d), ForwardingError)


def test_connect_must_be_answered_in_time() -> None:
    """An owner that accepts the socket but never answers CONNECT fails the call in time."""
    clock = Clock()
    transports: list[StringTransport] = []

    def connect(host: str, port: int, factory: Factory) -> Deferred[Protocol]:
        proto = factory.buildProtocol(None)
        t = StringTransport()
        transports.append(t)
        proto.makeConnection(t)
        return succeed(proto)

    fwd = PulsarForwarder(clock, connect=connect, request_timeout_s=3)
    d = fwd.publish(OWNER, TOPIC, entry(b"x"))
    decoder = FrameDecoder()
    [frame] = list(decoder.feed(transports[0].value()))
    assert frame.command.type == T.CONNECT
    clock.advance(3.1)
    assert isinstance(failure_of(d), ForwardingError)
    assert fwd.connections == {}


def test_message_with_ack_set_reports_acked_indexes_and_pings_are_answered() -> None:
    """A MESSAGE whose ack_set marks some batch messages acknowledged is delivered with those
    indexes set; PING is answered with PONG; garbage from the owner drops the connection."""
    o = Owner()
    rec = Recorder()
    remote = fired(o.forwarder.subscribe(OWNER, TOPIC, "s", rec), o)
    assert o.client is not None
    assert o.client_transport is not None
    batch = encode_entry(
        [Message(b"a"), Message(b"b"), Message(b"c")],
        producer_name="p",
        sequence_id=0,
        publish_time_ms=5,
    )
    msg = command(T.MESSAGE, "message", consumer_id=remote.consumer_id, message_id=message_id(7, 3))
    msg.message.ack_set.extend([0b110])  # messages 1 and 2 still unacknowledged
    o.client.dataReceived(encode_payload_command(msg, batch))
    [got] = rec.deliveries
    assert got.entry.position == Position(7, 3)
    assert got.entry.num_messages == 3
    assert got.acked_indexes == 0b001
    o.client_transport.clear()
    o.client.dataReceived(encode_command(command(T.PING, "ping")))
    [frame] = list(FrameDecoder().feed(o.client_transport.value()))
    assert frame.command.type == T.PONG
    o.client.dataReceived(b"\x00\x00\x00\x02zz")
    assert o.client.lost
    assert rec.disconnected == 1


@pytest.mark.parametrize("url", ["http://owner:8080", "", "pulsar://owner"])
def test_an_owner_without_a_pulsar_url_is_a_forwarding_error(url: str) -> None:
    """An owner whose Pulsar address is missing or malformed fails with ForwardingError."""
    fwd = PulsarForwarder(Clock(), connect=lambda *a: succeed(None))  # type: ignore[arg-type,return-value]
    d = fwd.publish(BrokerInfo("x", "", url), TOPIC, entry(b"x"))
    assert isinstance(failure_of(d), ForwardingError)


def test_keep_alive_pings_and_drops_a_silent_owner() -> None:
    """The forwarder pings the owner every keep-alive interval; an owner that answers stays,
    one silent for a whole interval after a PING is dropped and its consumers disconnected."""
    o = Owner()
    o.forwarder.keep_alive_s = 10
    rec = Recorder()
    fired(o.forwarder.subscribe(OWNER, TOPIC, "s", rec), o)
    client = o.client
    assert client is not None
    for _ in range(3):
        o.clock.advance(10)
        o.pump()  # the owner's PONG arrives
    assert not client.lost
    o.clock.advance(10)  # PING sent, never answered
    o.clock.advance(10)
    assert client.lost
    assert rec.disconnected == 1
    assert o.forwarder.connections == {}


def test_batch_index_and_cumulative_acks_reach_the_owner() -> None:
    """Acknowledging some messages of a batch leaves the entry pending at the owner until the
    last one is acknowledged; a cumulative ack acknowledges everything up to its position."""
    o = Owner()
    batch = encode_entry(
        [Message(b"a"), Message(b"b"), Message(b"c")],
        producer_name="p",
        sequence_id=0,
        publish_time_ms=5,
    )
    fired(o.forwarder.publish(OWNER, TOPIC, batch, 3), o)
    for i in range(3):
        fired(o.forwarder.publish(OWNER, TOPIC, entry(b"m%d" % i)), o)
    rec = Recorder()
    remote = fired(
        o.forwarder.subscribe(OWNER, TOPIC, "s", rec, SubType.EXCLUSIVE, InitialPosition.EARLIEST),
        o,
    )
    remote.flow(100)
    o.pump()
    assert [d.entry.num_messages for d in rec.deliveries] == [3, 1, 1, 1]
    server = result_of(o.service.get_topic(TOPIC)).subscriptions["s"].consumers[0]
    first = rec.deliveries[0].entry.position
    remote.ack_batch_index(first, 0b011, 3)
    o.pump()
    assert first in server.pending
    remote.ack_batch_index(first, 0b111, 3)
    o.pump()
    assert first not in server.pending
    remote.ack_cumulative(rec.deliveries[2].entry.position)
    o.pump()
    assert set(server.pending) == {rec.deliveries[3].entry.position}
