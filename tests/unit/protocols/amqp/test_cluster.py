"""Unit tests of AMQP in cluster mode (``handler`` Rules V1-V3, ``proxy`` Rules P1-P4): a vhost
served here is claimed through its control topic and dropped with 320 when that topic's bundle
leaves; a connection to a vhost another broker serves is relayed there after its handshake is
replayed, with bounded, spec-shaped failures. StringTransport on both sides, a Clock."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parent))

from amqp_peer import Peer
from fake_ledger import result_of

from polybroker.broker_core.consumer import Delivery
from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.messages import Message, encode_entry
from polybroker.broker_core.ownership import BrokerInfo, NotOwnerError, Ownership
from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.handler import CONTROL_TOPIC, control_topic
from polybroker.protocols.amqp.proxy import PROXIED, OwnerLink, parse_listener
from polybroker.protocols.amqp.vhost import REATTACH_S

LOCAL = BrokerInfo("a:8080", "http://a:8080", "pulsar://a:6650", {"amqp": "a:5672"})
OWNER = BrokerInfo("b:8080", "http://b:8080", "pulsar://b:6650", {"amqp": "10.0.0.2:5673"})
CONTROL = control_topic("public/default")
CREDENTIALS = b"\x00guest\x00guest"


class FakeOwnership(Ownership):
    """Owns what it is asked to acquire, but the topics in ``remote`` (owner or error)."""

    def __init__(self) -> None:
        self.local = LOCAL
        self.remote: dict[str, BrokerInfo | Exception] = {}
        self.held: set[str] = set()

    @property
    def clustered(self) -> bool:
        return True

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        raise NotImplementedError

    def acquire(self, topic: str) -> Deferred[None]:
        got = self.remote.get(topic)
        if got is None:
            self.held.add(topic)
            return succeed(None)
        if isinstance(got, Exception):
            return fail(got)
        return fail(NotOwnerError(f"{topic} is served by {got.broker_id}", got))

    def owns(self, topic: str) -> bool:
        return topic in self.held and topic not in self.remote

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([LOCAL, OWNER])


class Sink:
    """A Broker API consumer that keeps nothing."""

    consumer_id = 99
    consumer_name = "sink"
    priority_level = 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        pass

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        pass


class FakeConnect:
    """Connects relays to StringTransports (or fails, or never answers)."""

    def __init__(self, outcome: str = "connect") -> None:
        self.outcome = outcome
        self.calls: list[tuple[str, int, Any]] = []

    def __call__(self, host: str, port: int, proto: Protocol) -> Deferred[Any]:
        self.calls.append((host, port, proto))
        if self.outcome == "refuse":
            return fail(ConnectionRefusedError("connection refused"))
        if self.outcome == "hang":
            return Deferred()
        proto.makeConnection(StringTransport())
        return succeed(proto)

    @property
    def link(self) -> OwnerLink:
        link = self.calls[-1][2]
        assert isinstance(link, OwnerLink)
        return link


def cluster_peer(owner: BrokerInfo | Exception | None = OWNER, outcome: str = "connect") -> Any:
    """A broker of a cluster whose vhost ``/`` is served by ``owner`` (None: by nobody yet,
    so this broker claims it)."""
    own = FakeOwnership()
    if owner is not None:
        own.remote[CONTROL] = owner
    peer = Peer(ownership=own)
    connect = FakeConnect(outcome)
    peer.handler.factory.settings.connect = connect
    peer.own, peer.connect_fake = own, connect
    return peer


def frames_of(data: bytes, header: bool = False) -> list[Any]:
    reader = c.FrameReader(1 << 20, expect_header=header)
    reader.feed(data)
    return reader.frames()


def owner_says(link: OwnerLink, *methods: c.Method) -> None:
    link.dataReceived(b"".join(c.encode_method(0, m) for m in methods))


def sent_by_link(link: OwnerLink) -> list[c.Method]:
    transport = link.transport
    data = transport.value()
    transport.clear()
    header = data.startswith(c.PROTOCOL_HEADER)
    return [f.method for f in frames_of(data, header) if isinstance(f, c.MethodFrame)]


def relayed_peer() -> tuple[Any, OwnerLink]:
    """A client relayed to the vhost's broker, handshake done on both sides."""
    peer = cluster_peer()
    peer.handshake()
    link = peer.connect_fake.link
    owner_says(link, c.ConnectionStart(), c.ConnectionTune(2047, 131072, 60))
    owner_says(link, c.ConnectionOpenOk())
    sent_by_link(link)
    assert isinstance(peer.methods()[0], c.ConnectionOpenOk)
    return peer, link


def test_the_handshake_is_replayed_at_the_vhost_broker_then_bytes_are_relayed() -> None:
    """The relay sends the owner the protocol header, the client's start-ok (same mechanism
    and credentials, marked relayed), the negotiated tune-ok and the open; the owner's open-ok
    reaches the client, and from then on bytes pass unchanged both ways."""
    peer = cluster_peer()
    out = peer.handshake()
    assert [type(m) for m in out] == [c.ConnectionTune]  # no open-ok before the owner's
    host, port, link = peer.connect_fake.calls[0]
    assert (host, port) == ("10.0.0.2", 5673)
    assert link.transport.value() == c.PROTOCOL_HEADER
    link.transport.clear()
    owner_says(link, c.ConnectionStart(0, 9, {"product": "x"}, b"PLAIN", b"en_US"))
    (start_ok,) = sent_by_link(link)
    assert isinstance(start_ok, c.ConnectionStartOk)
    assert (start_ok.mechanism, start_ok.response) == ("PLAIN", CREDENTIALS)
    assert start_ok.client_properties[PROXIED] is True
    owner_says(link, c.ConnectionTune(2047, 131072, 60))
    tune_ok, open_ = sent_by_link(link)
    assert (tune_ok.channel_max, tune_ok.frame_max, tune_ok.heartbeat) == (100, 8192, 10)
    assert isinstance(open_, c.ConnectionOpen)
    assert open_.virtual_host == "/"
    assert peer.transport.value() == b""
    # The owner's open-ok, and a heartbeat right behind it in the same read.
    link.dataReceived(c.encode_method(0, c.ConnectionOpenOk()) + c.encode_heartbeat())
    assert peer.transport.value() == c.encode_method(0, c.ConnectionOpenOk()) + (
        c.encode_heartbeat()
    )
    peer.transport.clear()
    peer.send(b"client bytes, as they are")
    assert link.transport.value() == b"client bytes, as they are"
    link.dataReceived(b"owner bytes")
    assert peer.transport.value() == b"owner bytes"
    peer.transport.clear()
    # The relay sends no heartbeats of its own: the two ends exchange theirs.
    peer.clock.advance(60)
    assert peer.transport.value() == b""


def test_what_the_client_sends_during_the_replay_follows_the_open() -> None:
    """The client's socket is not read while the owner's handshake is under way (nothing is
    kept in memory for it); bytes read with the open reach the owner after it, in order, and
    reading resumes once the relay runs."""
    peer = cluster_peer()
    peer.handshake()
    assert peer.transport.producerState == "paused"
    link = peer.connect_fake.link
    owner_says(link, c.ConnectionStart(), c.ConnectionTune(2047, 131072, 60))
    sent_by_link(link)
    early = c.encode_method(1, c.ChannelOpen())
    peer.send(early[:5])  # what the kernel had already read
    assert link.transport.value() == b""
    owner_says(link, c.ConnectionOpenOk())
    assert link.transport.value() == early[:5]
    assert peer.transport.producerState == "producing"
    peer.send(early[5:])
    assert link.transport.value() == early


def test_a_refused_relay_reads_the_clients_close_ok() -> None:
    """When the owner refuses, reading resumes so that the client's close-ok is heard."""
    peer = cluster_peer(outcome="refuse")
    close = peer.handshake()[-1]
    assert isinstance(close, c.ConnectionClose)
    assert peer.transport.producerState == "producing"
    peer.method(0, c.ConnectionCloseOk())
    assert peer.transport.disconnecting


def test_either_side_closing_closes_the_other() -> None:
    """The owner's side closing closes the client's, and the other way round."""
    peer, link = relayed_peer()
    link.connectionLost()
    assert peer.transport.disconnecting
    peer, link = relayed_peer()
    peer.conn.connectionLost()
    assert link.transport.disconnecting


def test_the_owner_refusing_the_handshake_is_the_clients_refusal() -> None:
    """A connection.close from the owner during the replay reaches the client with its code
    and text; the owner gets close-ok."""
    peer = cluster_peer()
    peer.handshake()
    link = peer.connect_fake.link
    owner_says(link, c.ConnectionStart(), c.ConnectionTune(2047, 131072, 60))
    sent_by_link(link)
    owner_says(link, c.ConnectionClose(530, "NOT_ALLOWED - vhost '/' not found", 10, 40))
    assert isinstance(sent_by_link(link)[0], c.ConnectionCloseOk)
    assert link.transport.disconnecting
    (close,) = peer.methods()
    assert isinstance(close, c.ConnectionClose)
    assert (close.reply_code, close.reply_text) == (530, "NOT_ALLOWED - vhost '/' not found")
    peer.method(0, c.ConnectionCloseOk())
    assert peer.transport.disconnecting


def test_an_unreachable_owner_gives_connection_forced() -> None:
    """No connection to the owner: the client gets connection.close 320 and may reconnect."""
    peer = cluster_peer(outcome="refuse")
    close = peer.handshake()[-1]
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.CONNECTION_FORCED
    assert "cannot reach" in close.reply_text


def test_a_silent_owner_gives_connection_forced_after_the_bound() -> None:
    """An owner that connects but never answers, or a connection that never completes, is
    given up after ``link_timeout_s`` with 320."""
    for outcome in ("connect", "hang"):
        peer = cluster_peer(outcome=outcome)
        peer.handshake()
        peer.clock.advance(peer.handler.factory.settings.link_timeout_s - 0.1)
        assert peer.methods() == []
        peer.clock.advance(0.2)
        (close,) = peer.methods()
        assert isinstance(close, c.ConnectionClose)
        assert close.reply_code == c.CONNECTION_FORCED
        if outcome == "connect":
            assert peer.connect_fake.link.transport.disconnecting


def test_an_owner_answering_out_of_turn_gives_connection_forced() -> None:
    """Anything but the handshake from the owner (or bytes that are no frames) ends the relay
    with 320."""
    for answer in (c.encode_method(0, c.ConnectionOpenOk()), b"HTTP/1.1 400 Bad Request\r\n"):
        peer = cluster_peer()
        peer.handshake()
        link = peer.connect_fake.link
        link.dataReceived(answer)
        (close,) = peer.methods()
        assert close.reply_code == c.CONNECTION_FORCED
        assert link.transport.disconnecting


def test_a_relayed_connection_is_not_relayed_again() -> None:
    """A connection marked relayed that reaches a broker not serving its vhost is refused with
    320 instead of being relayed once more (no loops while a vhost moves)."""
    peer = cluster_peer()
    peer.send(c.PROTOCOL_HEADER)
    peer.methods()
    peer.method(0, c.ConnectionStartOk({PROXIED: True}, "PLAIN", CREDENTIALS))
    peer.method(0, c.ConnectionTuneOk(100, 8192, 0))
    peer.methods()
    peer.method(0, c.ConnectionOpen("/"))
    (close,) = peer.methods()
    assert close.reply_code == c.CONNECTION_FORCED
    assert peer.connect_fake.calls == []


def test_an_unowned_vhost_is_claimed_and_served_here() -> None:
    """With nobody serving the vhost, this broker claims its control topic and serves it."""
    peer = cluster_peer(owner=None)
    out = peer.handshake()
    assert isinstance(out[-1], c.ConnectionOpenOk)
    assert peer.own.held == {CONTROL}
    assert CONTROL.endswith(CONTROL_TOPIC)
    assert peer.handler.serves("public/default")
    assert peer.connect_fake.calls == []
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.QueueDeclare(queue="q", durable=True))
    assert isinstance(peer.methods()[-1], c.QueueDeclareOk)


def test_a_vhost_that_moves_away_closes_its_connections_and_reloads_on_next_use() -> None:
    """When the control topic's bundle leaves (its topic unloaded), the vhost's connections
    get 320 and its state is dropped; the next connection claims it again and finds its
    durable queue in the metadata store."""
    peer = cluster_peer(owner=None)
    peer.handshake()
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.QueueDeclare(queue="kept", durable=True))
    peer.publish(1, "", "kept", b"hello", delivery_mode=2)
    peer.clock.advance(0)
    peer.methods()
    old = peer.handler.vhosts["public/default"]
    peer.own.held.discard(CONTROL)
    peer.service.unload_topic(CONTROL)
    (close,) = peer.methods()
    assert isinstance(close, c.ConnectionClose)
    assert close.reply_code == c.CONNECTION_FORCED
    assert old.closed
    assert peer.handler.vhosts == {}
    assert not peer.handler.serves("public/default")
    peer.conn.connectionLost()
    peer.conn = peer.connect()
    peer.transport = peer.conn.transport
    assert isinstance(peer.handshake()[-1], c.ConnectionOpenOk)
    assert peer.handler.vhosts["public/default"] is not old
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.BasicGet(queue="kept"))
    peer.clock.advance(0)
    got = [f for f in peer.received() if isinstance(f, c.MethodFrame)]
    assert any(isinstance(f.method, c.BasicGetOk) for f in got)


def test_a_vhost_nobody_can_serve_now_is_refused_after_the_bound() -> None:
    """While the control topic's bundle is not available anywhere, routing retries; past
    ``route_timeout_s`` the client gets 320; once it is available the vhost is served."""
    peer = cluster_peer(owner=ServiceNotReadyError("bundle moving"))
    peer.handshake()
    peer.clock.pump([0.5] * int(peer.handler.route_timeout_s * 2 + 4))
    (close,) = peer.methods()
    assert close.reply_code == c.CONNECTION_FORCED
    peer.conn = peer.connect()
    peer.transport = peer.conn.transport
    peer.handshake()
    peer.clock.advance(1)
    del peer.own.remote[CONTROL]
    peer.clock.advance(1)
    assert isinstance(peer.methods()[-1], c.ConnectionOpenOk)


def test_standalone_connections_are_not_routed() -> None:
    """Without a clustered ownership nothing is claimed or relayed: no route at all."""
    peer = Peer()
    assert peer.handler.factory.settings.route is None
    assert isinstance(peer.handshake()[-1], c.ConnectionOpenOk)


def test_listener_addresses_are_parsed_strictly() -> None:
    """Only ``host:port`` with a port in range names a listener."""
    assert parse_listener("10.0.0.2:5673") == ("10.0.0.2", 5673)
    assert parse_listener("[::1]:5672") == ("::1", 5672)
    for bad in ("", "host", "host:0", "host:70000", ":5672", "host:x"):
        assert parse_listener(bad) is None


def stored(payload: bytes) -> bytes:
    """A stored entry of one message, as another protocol would write it."""
    return encode_entry([Message(payload)], producer_name="p", sequence_id=0, publish_time_ms=1)


def get_body(peer: Any, queue: str) -> bytes | None:
    """basic.get on channel 1; the body, or None for get-empty."""
    peer.method(1, c.BasicGet(queue=queue, no_ack=True))
    peer.clock.advance(0)
    frames = peer.received()
    methods = [f.method for f in frames if isinstance(f, c.MethodFrame)]
    if any(isinstance(m, c.BasicGetEmpty) for m in methods):
        return None
    assert any(isinstance(m, c.BasicGetOk) for m in methods), methods
    return b"".join(f.data for f in frames if isinstance(f, c.BodyFrame))


def test_a_queue_subscription_still_held_elsewhere_is_tried_again() -> None:
    """A queue whose subscription another consumer still holds (the vhost's previous broker
    letting go) subscribes again until it is free, within its bound."""
    peer = cluster_peer(owner=None)
    peer.handshake()
    topic = "persistent://public/default/amqp.queue.held"
    blocker = result_of(peer.service.subscribe(topic, "amqp", Sink()))
    result_of(peer.service.publish(topic, stored(b"old")))  # in the subscription, unread
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.QueueDeclare(queue="held", durable=True))
    peer.clock.advance(1)
    assert not any(isinstance(m, c.QueueDeclareOk) for m in peer.methods())
    blocker.close()
    peer.clock.advance(1)
    assert any(isinstance(m, c.QueueDeclareOk) for m in peer.methods())
    assert get_body(peer, "held") == b"old"


def test_a_queue_that_lost_its_log_subscribes_again_until_it_can() -> None:
    """A queue whose topic was unloaded and cannot be served for a while (its bundle moving)
    subscribes again every few seconds and then delivers what the topic holds."""
    peer = cluster_peer(owner=None)
    peer.handshake()
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.QueueDeclare(queue="moves", durable=True))
    peer.clock.advance(0)
    peer.methods()
    topic = "persistent://public/default/amqp.queue.moves"
    peer.own.remote[topic] = ServiceNotReadyError("bundle moving")
    peer.own.held.discard(topic)
    peer.service.unload_topic(topic)
    peer.clock.advance(REATTACH_S * 3)
    assert get_body(peer, "moves") is None
    del peer.own.remote[topic]
    result_of(peer.service.publish(topic, stored(b"later")))
    peer.clock.advance(REATTACH_S)
    peer.clock.advance(0)
    assert get_body(peer, "moves") == b"later"


def test_an_owner_offering_smaller_limits_than_the_client_agreed_is_refused() -> None:
    """The client may use the frame-max it agreed with this broker: an owner offering less
    (brokers configured differently) gives the client 541 instead of later frame errors."""
    peer = cluster_peer()
    peer.handshake()  # the client agreed to frame-max 8192
    link = peer.connect_fake.link
    owner_says(link, c.ConnectionStart(), c.ConnectionTune(2047, 4096, 60))
    sent = sent_by_link(link)
    assert isinstance(sent[-1], c.ConnectionClose)
    assert link.transport.disconnecting
    (close,) = peer.methods()
    assert close.reply_code == c.INTERNAL_ERROR


def test_standalone_a_held_queue_subscription_fails_the_declare_at_once() -> None:
    """Outside a cluster nobody else may be letting go of a queue's subscription: a busy one
    fails the declare at once, as before (no retries)."""
    peer = Peer()
    peer.handshake()
    topic = "persistent://public/default/amqp.queue.held"
    result_of(peer.service.subscribe(topic, "amqp", Sink()))
    peer.method(1, c.ChannelOpen())
    peer.method(1, c.QueueDeclare(queue="held", durable=True))
    methods = peer.methods()
    assert not any(isinstance(m, c.QueueDeclareOk) for m in methods)
    assert any(isinstance(m, c.ChannelClose | c.ConnectionClose) for m in methods), methods
