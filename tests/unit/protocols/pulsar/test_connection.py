"""Unit tests of the Pulsar connection state machine over StringTransport, a Clock and the
fake ledger: no sockets, no threads."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of
from fake_tcp import SlowClient

from polybroker.broker_core.schemas import SchemaRegistry
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.ledger.api import Position
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    Frame,
    FrameDecoder,
    ack_set_bits,
    ack_set_words,
    build_tail,
    command,
    crc32c,
    encode_batch,
    encode_command,
    encode_payload_command,
    split_tail,
    to_signed64,
)
from polybroker.protocols.pulsar.connection import PulsarConnection, PulsarSettings
from polybroker.protocols.pulsar.inspector import PulsarEntryInspector

T = pb.BaseCommand
TOPIC = "persistent://public/default/t"
ML = "public/default/persistent/t"


class Peer:
    """A connection under test and the client end of its transport."""

    def __init__(self, max_message_size: int = 64 * 1024, **config: Any) -> None:
        self.clock = Clock()
        self.factory = FakeLedgerFactory(self.clock.seconds)
        self.store = FakeMetadataStore()
        self.service = BrokerService(
            self.factory,
            self.clock,
            Config({"statsUpdateFrequencyInSecs": 0, **config}),
            self.store,
            inspector=PulsarEntryInspector(),
        )
        self.settings = PulsarSettings(
            service=self.service,
            clock=self.clock,
            max_message_size=max_message_size,
            keep_alive_s=30.0,
            service_url=lambda: "pulsar://broker:6650",
            schemas=SchemaRegistry(self.store),
        )
        self.conn, self.transport = self.open()
        self.decoder = FrameDecoder(1 << 24)

    def open(self) -> tuple[PulsarConnection, StringTransport]:
        conn = PulsarConnection(self.settings)
        transport = StringTransport()
        conn.makeConnection(transport)
        return conn, transport

    def write(self, data: bytes) -> None:
        self.conn.dataReceived(data)

    def send(self, cmd: pb.BaseCommand, tail: bytes | None = None) -> None:
        self.write(encode_command(cmd) if tail is None else encode_payload_command(cmd, tail))

    def frames(self) -> list[Frame]:
        data = self.transport.value()
        self.transport.clear()
        return list(self.decoder.feed(data))

    def commands(self) -> list[pb.BaseCommand]:
        return [f.command for f in self.frames()]

    def one(self, type_: int) -> pb.BaseCommand:
        cmds = self.commands()
        assert [c.type for c in cmds] == [type_], [T.Type.Name(c.type) for c in cmds]
        return cmds[0]

    def connect(self, version: int = 20) -> pb.CommandConnected:
        self.send(command(T.CONNECT, "connect", client_version="test", protocol_version=version))
        return self.one(T.CONNECTED).connected

    def producer(
        self, pid: int = 1, name: str | None = None, mode: int = pb.Shared, topic: str = TOPIC
    ) -> pb.BaseCommand:
        self.send(
            command(
                T.PRODUCER,
                "producer",
                topic=topic,
                producer_id=pid,
                request_id=100 + pid,
                producer_name=name,
                producer_access_mode=mode,
            )
        )
        cmds = self.commands()
        assert len(cmds) == 1, cmds
        return cmds[0]

    def publish(self, pid: int, seq: int, data: bytes, **md: Any) -> None:
        tail = build_tail(
            pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1, **md), data
        )
        self.send(command(T.SEND, "send", producer_id=pid, sequence_id=seq), tail)

    def subscribe(
        self, cid: int = 1, sub: str = "s", sub_type: int = pb.CommandSubscribe.Exclusive, **kw: Any
    ) -> pb.BaseCommand:
        kw.setdefault("initialPosition", pb.CommandSubscribe.Earliest)
        expect_success = kw.pop("expect", True)
        self.send(
            command(
                T.SUBSCRIBE,
                "subscribe",
                topic=kw.pop("topic", TOPIC),
                subscription=sub,
                subType=sub_type,
                consumer_id=cid,
                request_id=200 + cid,
                **kw,
            )
        )
        return self.one(T.SUCCESS) if expect_success else self.commands()[0]

    def flow(self, cid: int = 1, permits: int = 100) -> None:
        self.send(command(T.FLOW, "flow", consumer_id=cid, messagePermits=permits))

    def messages(self) -> list[tuple[pb.CommandMessage, bytes]]:
        out = []
        for f in self.frames():
            assert f.command.type == T.MESSAGE, T.Type.Name(f.command.type)
            out.append((f.command.message, split_tail(f.payload or b"")[1]))
        return out

    @property
    def closed(self) -> bool:
        return self.transport.disconnecting


@pytest.fixture
def peer() -> Peer:
    p = Peer()
    p.connect()
    return p


# -- handshake, keep-alive, bad input ------------------------------------------------------


def test_connected_announces_version_and_max_message_size() -> None:
    """CONNECTED answers min(client, 20) and the configured max message size."""
    p = Peer(max_message_size=12345)
    connected = p.connect(version=25)
    assert connected.protocol_version == 20
    assert connected.max_message_size == 12345
    assert connected.server_version
    q = Peer()
    assert q.connect(version=9).protocol_version == 9


def test_command_before_connect_is_refused_and_closed() -> None:
    """Anything but CONNECT first gets ERROR and the connection closes."""
    p = Peer()
    p.send(command(T.LOOKUP, "lookupTopic", topic=TOPIC, request_id=1))
    assert [c.type for c in p.commands()] == [T.ERROR]
    assert p.closed


def test_silent_connection_without_connect_is_closed() -> None:
    """A socket that never sends CONNECT is closed after two keep-alive intervals."""
    p = Peer()
    p.clock.advance(30)
    assert not p.closed
    p.clock.advance(30)
    assert p.closed
    assert p.commands() == []  # no PING before the handshake


def test_ping_is_answered_with_pong(peer: Peer) -> None:
    """A client PING gets a PONG."""
    peer.send(command(T.PING, "ping"))
    peer.one(T.PONG)


def test_keep_alive_pings_then_closes_a_silent_client(peer: Peer) -> None:
    """The broker pings each interval and closes a client silent for a whole one after it."""
    peer.clock.advance(30)
    peer.one(T.PING)
    peer.send(command(T.PONG, "pong"))
    peer.clock.advance(30)
    peer.one(T.PING)
    assert not peer.closed
    peer.clock.advance(30)
    assert peer.closed


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # oversize
        b"\x00\x00\x00\x06\x00\x00\x00\x02\xff\xff",  # not protobuf
        b"\x00\x00\x00\x01",  # too small
    ],
)
def test_bad_frames_close_the_connection(peer: Peer, garbage: bytes) -> None:
    """Malformed or oversize frames get ERROR and a closed connection, no exception."""
    peer.write(garbage)
    assert peer.closed
    assert [c.type for c in peer.commands()] == [T.ERROR]


def test_unsupported_command_closes(peer: Peer) -> None:
    """A command the broker does not serve (a transaction command) closes the connection."""
    peer.send(pb.BaseCommand(type=T.NEW_TXN))
    assert peer.closed
    assert "unsupported" in peer.one(T.ERROR).error.message


def test_other_connections_are_unaffected_by_a_bad_one(peer: Peer) -> None:
    """A connection closed for garbage leaves another connection of the broker working."""
    bad, bad_transport = peer.open()
    bad.dataReceived(b"\x7f" * 64)
    assert bad_transport.disconnecting
    peer.send(command(T.PING, "ping"))
    peer.one(T.PONG)


# -- lookup ---------------------------------------------------------------------------------


def test_partitioned_metadata(peer: Peer) -> None:
    """PARTITIONED_METADATA answers 0 for a plain topic and N for a partitioned one."""
    result_of(peer.service.create_partitioned_topic("pt", 4))
    peer.send(command(T.PARTITIONED_METADATA, "partitionMetadata", topic="pt", request_id=1))
    peer.send(command(T.PARTITIONED_METADATA, "partitionMetadata", topic="plain", request_id=2))
    a, b = (c.partitionMetadataResponse for c in peer.commands())
    assert (a.request_id, a.partitions, a.response) == (1, 4, a.Success)
    assert (b.request_id, b.partitions) == (2, 0)


def test_partitioned_metadata_of_bad_name_fails(peer: Peer) -> None:
    """A bad topic name gets a Failed response with InvalidTopicName."""
    peer.send(command(T.PARTITIONED_METADATA, "partitionMetadata", topic="a/b", request_id=1))
    r = peer.one(T.PARTITIONED_METADATA_RESPONSE).partitionMetadataResponse
    assert (r.response, r.error) == (r.Failed, pb.InvalidTopicName)


def test_partitioned_metadata_of_unknown_namespace_is_topic_not_found(peer: Peer) -> None:
    """A topic in a namespace that does not exist gets Failed with TopicNotFound."""
    peer.service.namespace_exists = lambda ns: ns == "public/default"
    peer.send(command(T.PARTITIONED_METADATA, "partitionMetadata", topic="nope/ns/t", request_id=1))
    r = peer.one(T.PARTITIONED_METADATA_RESPONSE).partitionMetadataResponse
    assert (r.response, r.error) == (r.Failed, pb.TopicNotFound)
    peer.send(command(T.PARTITIONED_METADATA, "partitionMetadata", topic="t", request_id=2))
    assert peer.one(T.PARTITIONED_METADATA_RESPONSE).partitionMetadataResponse.response == 0


def test_lookup_answers_this_broker_authoritatively(peer: Peer) -> None:
    """LOOKUP answers Connect with this broker's URL, authoritative."""
    peer.send(command(T.LOOKUP, "lookupTopic", topic=TOPIC, request_id=9))
    r = peer.one(T.LOOKUP_RESPONSE).lookupTopicResponse
    assert (r.request_id, r.response, r.brokerServiceUrl, r.authoritative) == (
        9,
        r.Connect,
        "pulsar://broker:6650",
        True,
    )


def test_lookup_of_unknown_listener_name_fails(peer: Peer) -> None:
    """A lookup for a named listener this broker lacks fails with ServiceNotReady."""
    peer.send(
        command(T.LOOKUP, "lookupTopic", topic=TOPIC, request_id=3, advertised_listener_name="ext")
    )
    r = peer.one(T.LOOKUP_RESPONSE).lookupTopicResponse
    assert (r.response, r.error) == (r.Failed, pb.ServiceNotReady)
    assert "ext listener" in r.message


def test_topics_of_namespace(peer: Peer) -> None:
    """GET_TOPICS_OF_NAMESPACE lists the namespace's topics, unfiltered."""
    peer.producer(1, topic="persistent://public/default/a")
    peer.producer(2, topic="persistent://public/default/b")
    peer.send(
        command(
            T.GET_TOPICS_OF_NAMESPACE,
            "getTopicsOfNamespace",
            request_id=5,
            namespace="public/default",
        )
    )
    r = peer.one(T.GET_TOPICS_OF_NAMESPACE_RESPONSE).getTopicsOfNamespaceResponse
    assert list(r.topics) == ["persistent://public/default/a", "persistent://public/default/b"]
    assert r.filtered is False


# -- producers ------------------------------------------------------------------------------


def test_producer_gets_a_generated_name(peer: Peer) -> None:
    """A producer without a name gets one from the broker, and last sequence id -1."""
    r = peer.producer(1).producer_success
    assert r.producer_name
    assert r.last_sequence_id == -1
    assert r.producer_ready


def test_send_receipts_follow_send_order(peer: Peer) -> None:
    """Receipts leave in SEND order, each as its entry becomes durable."""
    peer.producer(1, name="p")
    ml = peer.factory.ledger(ML)
    ml.hold_appends = True
    for seq in range(3):
        peer.publish(1, seq, b"m%d" % seq)
    assert peer.commands() == []
    ml.release_appends(1)
    (r,) = (c.send_receipt for c in peer.commands())
    assert (r.sequence_id, r.message_id.entryId) == (0, 0)
    ml.release_appends()
    receipts = [c.send_receipt for c in peer.commands()]
    assert [(r.sequence_id, r.message_id.entryId) for r in receipts] == [(1, 1), (2, 2)]
    assert all(r.message_id.partition == -1 for r in receipts)


def test_sends_past_the_pending_bound_stop_the_reading() -> None:
    """Past maxPendingPublishRequestsPerConnection SENDs awaiting receipts the socket is not
    read and the rest of the read waits unparsed; once they are answered (half would do)
    reading resumes, and every SEND is stored and answered in order."""
    peer = Peer()
    peer.settings.max_pending_sends = 10
    peer.conn, peer.transport = peer.open()
    peer.connect()
    peer.producer(1, name="p")
    ml = peer.factory.ledger(ML)
    ml.hold_appends = True
    sends = b"".join(
        encode_payload_command(
            command(T.SEND, "send", producer_id=1, sequence_id=seq),
            build_tail(
                pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1), b"m"
            ),
        )
        for seq in range(30)
    )
    peer.write(sends)
    assert peer.transport.producerState == "paused"
    assert ml.held_appends == 11  # the 11th passed the bound; the rest wait
    ml.release_appends()
    assert peer.transport.producerState == "producing"
    assert ml.held_appends == 0
    peer.clock.advance(0)  # the rest of the read, up to the bound again
    assert peer.transport.producerState == "paused"
    assert ml.held_appends == 11
    ml.release_appends()
    peer.clock.advance(0)
    assert peer.transport.producerState == "producing"
    assert ml.held_appends == 8
    ml.release_appends()
    receipts = [c.send_receipt for c in peer.commands()]
    assert [(r.sequence_id, r.message_id.entryId) for r in receipts] == [
        (seq, seq) for seq in range(30)
    ]


def _send(producer_id: int, seq: int, data: bytes) -> bytes:
    md = pb.MessageMetadata(producer_name=f"p{producer_id}", sequence_id=seq, publish_time=1)
    return encode_payload_command(
        command(T.SEND, "send", producer_id=producer_id, sequence_id=seq), build_tail(md, data)
    )


def test_a_full_publish_buffer_stops_every_publishing_connection(peer: Peer) -> None:
    """Past the broker-wide publish buffer's limit every connection that published stops
    being read, the rest of a read waiting unparsed; when it drained to half they read on."""
    buffer = peer.service.publish_buffer
    buffer.limit = 2500
    other, other_transport = peer.open()
    other.dataReceived(
        encode_command(command(T.CONNECT, "connect", client_version="t", protocol_version=20))
        + encode_command(command(T.PRODUCER, "producer", topic=TOPIC, producer_id=2, request_id=2))
    )
    peer.producer(1, name="p1")
    ml = peer.factory.ledger(ML)
    ml.hold_appends = True
    other.dataReceived(_send(2, 0, b"x" * 1000))  # the other connection publishes: it watches
    peer.write(b"".join(_send(1, seq, b"y" * 1000) for seq in range(4)))
    assert buffer.full
    assert peer.transport.producerState == "paused"
    assert other_transport.producerState == "paused"
    assert ml.held_appends == 3  # the second SEND here passed the limit; the rest wait
    ml.release_appends()
    peer.clock.advance(0)  # the rest of the read
    assert not buffer.full
    assert other_transport.producerState == "producing"
    ml.release_appends()
    receipts = [c.send_receipt.sequence_id for c in peer.commands()]
    assert receipts == [0, 1, 2, 3]
    assert buffer.used == 0


def _producer_recording_groups(peer: Peer) -> list[int]:
    """Open producer 1 (``p``) on the topic; return the list that gets the size of every
    group of entries the topic's log is given from then on."""
    peer.producer(1, name="p")
    ml = peer.factory.ledger(ML)
    groups: list[int] = []
    append_many = ml.append_many

    def recording(datas: Any, *args: Any, **kwargs: Any) -> Any:
        groups.append(len(datas))
        return append_many(datas, *args, **kwargs)

    ml.append_many = recording  # type: ignore[method-assign]
    return groups


def test_sends_of_one_read_are_stored_together_before_a_later_command(peer: Peer) -> None:
    """SENDs arriving in one read go to storage as one group, and a CLOSE_PRODUCER later in
    that read is handled after them: every SEND is receipted, then the close answered."""
    groups = _producer_recording_groups(peer)
    tails = [
        build_tail(pb.MessageMetadata(producer_name="p", sequence_id=i, publish_time=1), b"m")
        for i in range(3)
    ]
    sends = b"".join(
        encode_payload_command(command(T.SEND, "send", producer_id=1, sequence_id=i), tails[i])
        for i in range(3)
    )
    close = encode_command(command(T.CLOSE_PRODUCER, "close_producer", producer_id=1, request_id=9))
    peer.write(sends + close)
    assert groups == [3]
    cmds = peer.commands()
    assert [c.type for c in cmds] == [T.SEND_RECEIPT] * 3 + [T.SUCCESS]
    assert [c.send_receipt.message_id.entryId for c in cmds[:3]] == [0, 1, 2]


def test_sends_of_both_decodings_are_one_group_receipted_in_order(peer: Peer) -> None:
    """SENDs of the usual shape (decoded without protobuf) and of another shape (here a chunk
    flag, decoded by protobuf) mixed in one read: stored as one group in their order, each
    receipted with its sequence id and highest sequence id (0 when the SEND has none), batch
    counts kept."""
    groups = _producer_recording_groups(peer)

    def tail(seq: int) -> bytes:
        md = pb.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1)
        return build_tail(md, b"m%d" % seq)

    sends = [
        command(T.SEND, "send", producer_id=1, sequence_id=0),
        command(T.SEND, "send", producer_id=1, sequence_id=1, is_chunk=False),
        command(T.SEND, "send", producer_id=1, sequence_id=2, num_messages=3),
        command(T.SEND, "send", producer_id=1, sequence_id=5, highest_sequence_id=8),
    ]
    peer.write(b"".join(encode_payload_command(c, tail(c.send.sequence_id)) for c in sends))
    assert groups == [4]
    receipts = [c.send_receipt for c in peer.commands()]
    assert [(r.sequence_id, r.highest_sequence_id, r.message_id.entryId) for r in receipts] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (5, 8, 3),
    ]
    assert [e.num_messages for e in peer.factory.ledger(ML).data.entries] == [1, 1, 3, 1]


def test_send_before_connect_is_refused_and_closed() -> None:
    """A SEND of the usual shape as the first command gets ERROR and the connection closes,
    as any other command before CONNECT does; nothing is stored."""
    p = Peer()
    md = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    p.send(command(T.SEND, "send", producer_id=1, sequence_id=0), build_tail(md, b"x"))
    (error,) = p.commands()
    assert error.type == T.ERROR
    assert "CONNECT" in error.error.message
    assert p.closed


def test_a_failed_group_answers_a_send_error_for_each_send(peer: Peer) -> None:
    peer.producer(1, name="p")
    ml = peer.factory.ledger(ML)
    ml.hold_appends = True
    tails = [
        build_tail(pb.MessageMetadata(producer_name="p", sequence_id=i, publish_time=1), b"m")
        for i in range(2)
    ]
    peer.write(
        b"".join(
            encode_payload_command(command(T.SEND, "send", producer_id=1, sequence_id=i), t)
            for i, t in enumerate(tails)
        )
    )
    ml.release_appends(error=RuntimeError("disk gone"))
    errors = [c.send_error.sequence_id for c in peer.commands() if c.type == T.SEND_ERROR]
    assert errors == [0, 1]


def test_storage_failure_is_a_send_error(peer: Peer) -> None:
    """A failed append answers SEND_ERROR for that sequence id."""
    peer.producer(1)
    ml = peer.factory.ledger(ML)
    ml.hold_appends = True
    peer.publish(1, 0, b"x")
    ml.release_appends(error=RuntimeError("disk gone"))
    r = peer.one(T.SEND_ERROR).send_error
    assert r.sequence_id == 0


def test_bad_checksum_gets_checksum_error_and_stays_open(peer: Peer) -> None:
    """A corrupted SEND is refused with ChecksumError; nothing is stored; the link stays up."""
    peer.producer(1)
    tail = bytearray(
        build_tail(pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1), b"x")
    )
    tail[-1] ^= 1
    peer.send(command(T.SEND, "send", producer_id=1, sequence_id=0), bytes(tail))
    assert peer.one(T.SEND_ERROR).send_error.error == pb.ChecksumError
    assert not peer.closed
    assert peer.factory.ledger(ML).data.entries == []


def test_send_with_invalid_metadata_closes(peer: Peer) -> None:
    """A SEND whose metadata lacks required fields closes the connection with an error."""
    peer.producer(1)
    md = pb.MessageMetadata(producer_name="p").SerializePartialToString()
    rest = struct.pack(">I", len(md)) + md + b"x"
    tail = struct.pack(">HI", 0x0E01, crc32c(rest)) + rest
    peer.send(command(T.SEND, "send", producer_id=1, sequence_id=0), tail)
    assert peer.closed
    assert peer.one(T.ERROR).error.message.startswith("SEND whose message metadata")


def test_send_with_the_brokers_marker_is_refused_and_stays_open(peer: Peer) -> None:
    """``marker_type`` marks entries the broker stored in another protocol's format: a SEND
    carrying it gets NotAllowedError, nothing is stored, and the link stays up."""
    peer.producer(1)
    peer.publish(1, 0, b"not a record batch", marker_type=1000)
    error = peer.one(T.SEND_ERROR).send_error
    assert (error.sequence_id, error.error) == (0, pb.NotAllowedError)
    assert not peer.closed
    assert peer.factory.ledger(ML).data.entries == []
    peer.publish(1, 1, b"fine")
    assert peer.one(T.SEND_RECEIPT).send_receipt.sequence_id == 1


def test_send_to_unknown_producer_is_refused(peer: Peer) -> None:
    """A SEND naming no producer of this connection gets SEND_ERROR."""
    peer.publish(7, 0, b"x")
    assert peer.one(T.SEND_ERROR).send_error.producer_id == 7


def test_batch_is_one_entry_stored_untouched(peer: Peer) -> None:
    """A batch SEND is stored as one entry with its message count, bytes unchanged."""
    peer.producer(1)
    payload = encode_batch(
        [(pb.SingleMessageMetadata(payload_size=0), b"v%d" % i) for i in range(3)]
    )
    md = pb.MessageMetadata(
        producer_name="p", sequence_id=0, publish_time=1, num_messages_in_batch=3
    )
    tail = build_tail(md, payload)
    peer.send(command(T.SEND, "send", producer_id=1, sequence_id=0, num_messages=3), tail)
    peer.one(T.SEND_RECEIPT)
    (entry,) = peer.factory.ledger(ML).data.entries
    assert (entry.num_messages, entry.data) == (3, tail)


def test_exclusive_producer_fences_a_second_one(peer: Peer) -> None:
    """A second Exclusive producer is refused with ProducerFenced."""
    peer.producer(1, mode=pb.Exclusive)
    r = peer.producer(2, mode=pb.Exclusive)
    assert (r.type, r.error.error) == (T.ERROR, pb.ProducerFenced)


def test_wait_for_exclusive_becomes_ready_when_the_holder_leaves(peer: Peer) -> None:
    """WaitForExclusive gets PRODUCER_SUCCESS not ready, then ready once the topic is free."""
    peer.producer(1, name="a", mode=pb.Exclusive)
    first = peer.producer(2, name="b", mode=pb.WaitForExclusive).producer_success
    assert first.producer_ready is False
    peer.send(command(T.CLOSE_PRODUCER, "close_producer", producer_id=1, request_id=1))
    cmds = {c.type: c for c in peer.commands()}
    assert sorted(cmds) == [T.SUCCESS, T.PRODUCER_SUCCESS]
    assert cmds[T.PRODUCER_SUCCESS].producer_success.producer_ready is True


def test_last_sequence_id_returned_on_reconnect_with_dedup() -> None:
    """With deduplication on, a re-created producer learns its last persisted sequence id."""
    p = Peer(brokerDeduplicationEnabled=True)
    p.connect()
    p.producer(1, name="prod")
    for seq in range(5):
        p.publish(1, seq, b"x")
    assert len(p.commands()) == 5
    p.send(command(T.CLOSE_PRODUCER, "close_producer", producer_id=1, request_id=1))
    p.one(T.SUCCESS)
    assert p.producer(2, name="prod").producer_success.last_sequence_id == 4
    p.publish(2, 3, b"dup")
    r = p.one(T.SEND_RECEIPT).send_receipt
    assert to_signed64(r.message_id.entryId) == -1
    assert len(p.factory.ledger(ML).data.entries) == 5


def test_duplicates_in_a_group_are_receipted_in_order_with_no_position() -> None:
    """With deduplication on, one read of SENDs mixing already stored sequence ids and new
    ones: every SEND is receipted in order, the duplicates at (-1, -1), the new ones at their
    entries; only the new ones are stored."""
    p = Peer(brokerDeduplicationEnabled=True)
    p.connect()
    p.producer(1, name="prod")
    for seq in range(3):
        p.publish(1, seq, b"x")
    assert len(p.commands()) == 3

    def send(seq: int) -> bytes:
        md = pb.MessageMetadata(producer_name="prod", sequence_id=seq, publish_time=1)
        cmd = command(T.SEND, "send", producer_id=1, sequence_id=seq)
        return encode_payload_command(cmd, build_tail(md, b"y"))

    p.write(b"".join(send(seq) for seq in (1, 3, 2, 4)))
    receipts = [c.send_receipt for c in p.commands()]
    assert [(r.sequence_id, to_signed64(r.message_id.entryId)) for r in receipts] == [
        (1, -1),
        (3, 3),
        (2, -1),
        (4, 4),
    ]
    assert len(p.factory.ledger(ML).data.entries) == 5


def test_unload_closes_producers_and_consumers(peer: Peer) -> None:
    """Unloading a topic sends CLOSE_PRODUCER and CLOSE_CONSUMER so clients come back."""
    peer.producer(1)
    peer.subscribe(1)
    result_of(peer.service.unload_topic(TOPIC))
    types = sorted(c.type for c in peer.commands())
    assert types == sorted([T.CLOSE_PRODUCER, T.CLOSE_CONSUMER])
    peer.publish(1, 0, b"late")  # in flight when the producer was closed: dropped silently
    assert peer.commands() == []
    assert not peer.closed


def test_connection_lost_releases_producers_and_consumers(peer: Peer) -> None:
    """When the client goes away its producer and consumer are removed from the topic."""
    peer.producer(1)
    peer.subscribe(1)
    topic = peer.service.topics[TOPIC]
    peer.conn.connectionLost(None)
    assert topic.producers == {}
    assert topic.subscriptions["s"].consumers == []


# -- consumers ------------------------------------------------------------------------------


def test_subscribe_flow_message_ack(peer: Peer) -> None:
    """Messages flow within permits with the stored payload; acks remove them from pending."""
    peer.subscribe(1)
    peer.producer(1)
    for seq in range(3):
        peer.publish(1, seq, b"m%d" % seq)
    peer.commands()
    peer.flow(1, 2)
    msgs = peer.messages()
    assert [d for _, d in msgs] == [b"m0", b"m1"]
    assert [m.redelivery_count for m, _ in msgs] == [0, 0]
    peer.flow(1, 1)
    assert [d for _, d in peer.messages()] == [b"m2"]
    ids = [
        pb.MessageIdData(ledgerId=m.message_id.ledgerId, entryId=m.message_id.entryId)
        for m, _ in msgs
    ]
    peer.send(
        command(T.ACK, "ack", consumer_id=1, ack_type=pb.CommandAck.Individual, message_id=ids)
    )
    server = peer.conn.consumers[1].server
    assert server is not None
    assert len(server.pending) == 1


def test_nothing_is_delivered_while_the_send_buffer_is_full(peer: Peer) -> None:
    """The connection is its transport's producer: while the transport says its buffer is
    full, its consumers (also one subscribed meanwhile) take nothing, whatever their
    permits; once it drained, what waited comes in order."""
    assert peer.transport.producer is peer.conn
    peer.subscribe(1)
    peer.producer(1)
    peer.commands()
    peer.conn.pauseProducing()  # as the transport does past its buffer size
    peer.subscribe(2, sub="other")
    peer.flow(1, 1000)
    peer.flow(2, 1000)
    for seq in range(3):
        peer.publish(1, seq, b"m%d" % seq)
    assert [c.type for c in peer.commands()] == [T.SEND_RECEIPT] * 3
    peer.conn.resumeProducing()
    msgs = peer.messages()
    assert sorted((m.consumer_id, d) for m, d in msgs) == [
        (cid, b"m%d" % i) for cid in (1, 2) for i in range(3)
    ]


def test_a_client_that_does_not_read_its_answers_stops_being_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the answers waiting for a client pass MAX_UNREAD the socket is not read, and
    what came in the same read waits unparsed; it is all answered, in order, as the client
    reads."""
    from polybroker.protocols.pulsar import connection

    monkeypatch.setattr(connection, "MAX_UNREAD", 10_000)
    peer = Peer()
    slow = SlowClient(limit=1000)
    peer.conn = PulsarConnection(peer.settings)
    peer.conn.makeConnection(slow)
    peer.transport = slow
    peer.connect()
    slow.drain()
    ping = encode_command(command(T.PING, "ping"))
    pong = len(encode_command(command(T.PONG, "pong")))
    peer.write(ping * 500)
    assert slow.producerState == "producing"
    slow.drain()
    peer.write(ping * 10_000)
    assert slow.producerState == "paused"
    assert 10_000 < slow.unsent <= 10_000 + pong
    drains = 0
    while slow.producerState == "paused":
        assert slow.unsent <= 10_000 + pong
        slow.drain()
        drains += 1
    assert drains >= 10_000 * pong // (10_000 + pong)  # each drain answered a share
    assert [c.type for c in peer.commands()] == [T.PONG] * 10_500


def test_redeliver_raises_redelivery_count(peer: Peer) -> None:
    """REDELIVER_UNACKNOWLEDGED_MESSAGES sends pending messages again, counted."""
    peer.subscribe(1, sub_type=pb.CommandSubscribe.Shared)
    peer.producer(1)
    peer.publish(1, 0, b"x")
    peer.commands()
    peer.flow(1, 10)
    ((m, _),) = peer.messages()
    peer.send(
        command(
            T.REDELIVER_UNACKNOWLEDGED_MESSAGES,
            "redeliverUnacknowledgedMessages",
            consumer_id=1,
            message_ids=[m.message_id],
        )
    )
    ((again, data),) = peer.messages()
    assert (again.redelivery_count, data) == (1, b"x")


def test_batch_index_ack_then_redelivery_carries_ack_set(peer: Peer) -> None:
    """Acking some messages of a batch: its redelivery tells the client which remain."""
    peer.subscribe(1, sub_type=pb.CommandSubscribe.Shared)
    peer.producer(1)
    payload = encode_batch(
        [(pb.SingleMessageMetadata(payload_size=0), b"v%d" % i) for i in range(3)]
    )
    md = pb.MessageMetadata(
        producer_name="p", sequence_id=0, publish_time=1, num_messages_in_batch=3
    )
    peer.send(
        command(T.SEND, "send", producer_id=1, sequence_id=0, num_messages=3),
        build_tail(md, payload),
    )
    peer.commands()
    peer.flow(1, 10)
    ((m, _),) = peer.messages()
    acked_mid = pb.MessageIdData(
        ledgerId=m.message_id.ledgerId, entryId=m.message_id.entryId, batch_size=3
    )
    acked_mid.ack_set.extend(ack_set_words(0b110, 3))  # bits still unacked: 1 and 2
    peer.send(
        command(
            T.ACK, "ack", consumer_id=1, ack_type=pb.CommandAck.Individual, message_id=[acked_mid]
        )
    )
    peer.send(
        command(
            T.REDELIVER_UNACKNOWLEDGED_MESSAGES, "redeliverUnacknowledgedMessages", consumer_id=1
        )
    )
    ((again, _),) = peer.messages()
    assert ack_set_bits(list(again.ack_set)) == 0b110


def test_cumulative_ack_on_shared_is_refused_with_ack_response(peer: Peer) -> None:
    """A cumulative ack on Shared fails; with a request id the client hears why."""
    peer.subscribe(1, sub_type=pb.CommandSubscribe.Shared)
    mid = pb.MessageIdData(ledgerId=0, entryId=0)
    peer.send(
        command(
            T.ACK,
            "ack",
            consumer_id=1,
            ack_type=pb.CommandAck.Cumulative,
            message_id=[mid],
            request_id=3,
        )
    )
    r = peer.one(T.ACK_RESPONSE).ackResponse
    assert (r.request_id, r.error) == (3, pb.NotAllowedError)


def test_second_exclusive_consumer_is_busy(peer: Peer) -> None:
    """A second consumer on an Exclusive subscription gets ERROR ConsumerBusy."""
    peer.subscribe(1)
    r = peer.subscribe(2, expect=False)
    assert (r.type, r.error.error) == (T.ERROR, pb.ConsumerBusy)


def test_failover_tells_consumers_who_is_active(peer: Peer) -> None:
    """Failover consumers get ACTIVE_CONSUMER_CHANGE."""
    peer.send(
        command(
            T.SUBSCRIBE,
            "subscribe",
            topic=TOPIC,
            subscription="s",
            subType=pb.CommandSubscribe.Failover,
            consumer_id=1,
            request_id=1,
            consumer_name="a",
        )
    )
    cmds = peer.commands()
    changes = [c.active_consumer_change for c in cmds if c.type == T.ACTIVE_CONSUMER_CHANGE]
    assert [(c.consumer_id, c.is_active) for c in changes] == [(1, True)]
    assert T.SUCCESS in [c.type for c in cmds]


def test_key_shared_meta_reaches_the_broker(peer: Peer) -> None:
    """A STICKY Key_Shared consumer gets exactly the hash ranges it asked for."""
    meta = pb.KeySharedMeta(
        keySharedMode=pb.KeySharedMeta.STICKY, hashRanges=[pb.IntRange(start=0, end=100)]
    )
    peer.subscribe(1, sub_type=pb.CommandSubscribe.Key_Shared, keySharedMeta=meta)
    server = peer.conn.consumers[1].server
    assert server is not None
    assert server.hash_ranges == [(0, 100)]


def test_reader_from_message_id(peer: Peer) -> None:
    """A non-durable subscription starting at an id gets that entry and the later ones."""
    peer.producer(1)
    for seq in range(4):
        peer.publish(1, seq, b"m%d" % seq)
    peer.commands()
    start = pb.MessageIdData(
        ledgerId=peer.factory.ledger(ML).data.entries[2].position.ledger_id, entryId=2
    )
    peer.subscribe(1, sub="reader", durable=False, start_message_id=start)
    peer.flow(1)
    assert [d for _, d in peer.messages()] == [b"m2", b"m3"]


def test_reader_from_earliest_sentinel(peer: Peer) -> None:
    """The earliest sentinel (-1:-1 as uint64) starts a reader at the first entry."""
    peer.producer(1)
    peer.publish(1, 0, b"first")
    peer.commands()
    earliest = pb.MessageIdData(ledgerId=(1 << 64) - 1, entryId=(1 << 64) - 1)
    peer.subscribe(1, sub="reader", durable=False, start_message_id=earliest)
    peer.flow(1)
    assert [d for _, d in peer.messages()] == [b"first"]


def test_seek_closes_consumer_then_succeeds(peer: Peer) -> None:
    """SEEK resets the cursor, closes the consumer (the client comes back), then SUCCESS."""
    peer.subscribe(1)
    peer.producer(1)
    for seq in range(3):
        peer.publish(1, seq, b"m%d" % seq)
    peer.commands()
    first = peer.factory.ledger(ML).data.entries[0].position
    peer.send(
        command(
            T.SEEK,
            "seek",
            consumer_id=1,
            request_id=77,
            message_id=pb.MessageIdData(ledgerId=first.ledger_id, entryId=1),
        )
    )
    cmds = peer.commands()
    assert [c.type for c in cmds] == [T.CLOSE_CONSUMER, T.SUCCESS]
    peer.subscribe(1)
    peer.flow(1)
    assert [d for _, d in peer.messages()] == [b"m1", b"m2"]


def test_get_last_message_id(peer: Peer) -> None:
    """GET_LAST_MESSAGE_ID answers the last entry (no batch index for a lone message)."""
    peer.subscribe(1)
    peer.send(command(T.GET_LAST_MESSAGE_ID, "getLastMessageId", consumer_id=1, request_id=4))
    empty = peer.one(T.GET_LAST_MESSAGE_ID_RESPONSE).getLastMessageIdResponse
    assert to_signed64(empty.last_message_id.entryId) == -1
    peer.producer(1)
    peer.publish(1, 0, b"x")
    peer.commands()
    peer.send(command(T.GET_LAST_MESSAGE_ID, "getLastMessageId", consumer_id=1, request_id=5))
    r = peer.one(T.GET_LAST_MESSAGE_ID_RESPONSE).getLastMessageIdResponse
    assert (r.request_id, r.last_message_id.entryId, r.last_message_id.batch_index) == (5, 0, -1)


def test_close_consumer_while_subscribing_detaches_it(peer: Peer) -> None:
    """A consumer closed before its SUBSCRIBE completes never stays attached."""
    held: list[Any] = []
    real_get_topic = peer.service.get_topic

    def slow_get_topic(name: str, create: bool = True) -> Any:
        from twisted.internet.defer import Deferred

        d: Deferred[Any] = Deferred()
        held.append((d, name, create))
        return d

    peer.service.get_topic = slow_get_topic  # type: ignore[method-assign]
    peer.send(
        command(
            T.SUBSCRIBE,
            "subscribe",
            topic="persistent://public/default/slow",
            subscription="s",
            subType=pb.CommandSubscribe.Exclusive,
            consumer_id=5,
            request_id=1,
        )
    )
    peer.send(command(T.CLOSE_CONSUMER, "close_consumer", consumer_id=5, request_id=2))
    assert peer.one(T.SUCCESS).success.request_id == 2
    peer.service.get_topic = real_get_topic  # type: ignore[method-assign]
    d, name, create = held[0]
    real_get_topic(name, create).chainDeferred(d)
    topic = peer.service.topics["persistent://public/default/slow"]
    assert topic.subscriptions["s"].consumers == []
    assert 5 not in peer.conn.consumers


def test_unsubscribe_and_close_consumer(peer: Peer) -> None:
    """UNSUBSCRIBE deletes the subscription; CLOSE_CONSUMER answers SUCCESS."""
    peer.subscribe(1, sub="gone")
    peer.subscribe(2, sub="kept")
    peer.send(command(T.UNSUBSCRIBE, "unsubscribe", consumer_id=1, request_id=8))
    assert peer.one(T.SUCCESS).success.request_id == 8
    peer.send(command(T.CLOSE_CONSUMER, "close_consumer", consumer_id=2, request_id=9))
    assert peer.one(T.SUCCESS).success.request_id == 9
    assert set(peer.service.topics[TOPIC].subscriptions) == {"kept"}


def test_consumer_stats(peer: Peer) -> None:
    """CONSUMER_STATS reports the consumer's permits and name."""
    peer.subscribe(1, consumer_name="me")
    peer.flow(1, 42)
    peer.send(command(T.CONSUMER_STATS, "consumerStats", consumer_id=1, request_id=6))
    r = peer.one(T.CONSUMER_STATS_RESPONSE).consumerStatsResponse
    assert (r.consumerName, r.availablePermits) == ("me", 42)


def test_reached_end_of_topic(peer: Peer) -> None:
    """A consumer that read everything of a terminated topic hears REACHED_END_OF_TOPIC."""
    peer.subscribe(1)
    result_of(peer.service.terminate_topic(TOPIC))
    peer.flow(1)
    assert T.REACHED_END_OF_TOPIC in [c.type for c in peer.commands()]


def test_inspector_reads_keys_delays_and_sequences() -> None:
    """The entry inspector reads ordering/partition key, deliver-at and producer sequence."""
    from polybroker.ledger.api import Entry

    md = pb.MessageMetadata(
        producer_name="p",
        sequence_id=5,
        publish_time=1,
        partition_key="pk",
        deliver_at_time=99,
        num_messages_in_batch=3,
    )
    entry = Entry(Position(1, 0), 0, 3, 1, build_tail(md, b""))
    inspector = PulsarEntryInspector()
    assert inspector.key_of(entry) == b"pk"
    assert inspector.deliver_at_ms(entry) == 99
    assert inspector.producer_sequence(entry) == ("p", 7)
    md.ordering_key = b"ok"
    assert inspector.key_of(Entry(Position(1, 0), 0, 1, 1, build_tail(md, b""))) == b"ok"
    assert inspector.key_of(Entry(Position(1, 0), 0, 1, 1, b"not pulsar")) is None


# -- schemas --------------------------------------------------------------------------------

STRING = pb.Schema(name="s", schema_data=b"", type=pb.Schema.Type.Value("String"))
JSON_V1 = pb.Schema(
    name="j",
    schema_data=b'{"type":"record","name":"R","fields":[{"name":"a","type":"string"}]}',
    type=pb.Schema.Type.Value("Json"),
)


def test_producer_schema_versions_and_get_schema(peer: Peer) -> None:
    """Producers register schema versions; GET_SCHEMA returns the latest or a given one."""
    peer.send(
        command(T.PRODUCER, "producer", topic=TOPIC, producer_id=1, request_id=1, schema=JSON_V1)
    )
    first = peer.one(T.PRODUCER_SUCCESS).producer_success
    assert first.schema_version == bytes(8)
    v2 = pb.Schema()
    v2.CopyFrom(JSON_V1)
    # A field with a default: both versions read each other's data (FULL, the default).
    v2.schema_data = JSON_V1.schema_data.replace(
        b"}]}", b'},{"name":"b","type":"int","default":0}]}'
    )
    peer.send(command(T.PRODUCER, "producer", topic=TOPIC, producer_id=2, request_id=2, schema=v2))
    assert peer.one(T.PRODUCER_SUCCESS).producer_success.schema_version == struct.pack(">q", 1)
    peer.send(command(T.GET_SCHEMA, "getSchema", request_id=3, topic=TOPIC))
    latest = peer.one(T.GET_SCHEMA_RESPONSE).getSchemaResponse
    assert (latest.schema.schema_data, latest.schema_version) == (
        v2.schema_data,
        struct.pack(">q", 1),
    )
    peer.send(
        command(T.GET_SCHEMA, "getSchema", request_id=4, topic=TOPIC, schema_version=bytes(8))
    )
    assert (
        peer.one(T.GET_SCHEMA_RESPONSE).getSchemaResponse.schema.schema_data == JSON_V1.schema_data
    )


def test_schema_of_another_type_is_incompatible(peer: Peer) -> None:
    """A producer or consumer with a schema of another type is refused (IncompatibleSchema)."""
    peer.send(
        command(T.PRODUCER, "producer", topic=TOPIC, producer_id=1, request_id=1, schema=STRING)
    )
    peer.one(T.PRODUCER_SUCCESS)
    peer.send(
        command(T.PRODUCER, "producer", topic=TOPIC, producer_id=2, request_id=2, schema=JSON_V1)
    )
    assert peer.one(T.ERROR).error.error == pb.IncompatibleSchema
    r = peer.subscribe(1, schema=JSON_V1, expect=False)
    assert (r.type, r.error.error) == (T.ERROR, pb.IncompatibleSchema)


def test_changed_field_type_is_incompatible(peer: Peer) -> None:
    """A record schema changing a field's type is refused."""
    peer.send(
        command(
            T.GET_OR_CREATE_SCHEMA, "getOrCreateSchema", request_id=1, topic=TOPIC, schema=JSON_V1
        )
    )
    assert peer.one(
        T.GET_OR_CREATE_SCHEMA_RESPONSE
    ).getOrCreateSchemaResponse.schema_version == bytes(8)
    changed = pb.Schema()
    changed.CopyFrom(JSON_V1)
    changed.schema_data = JSON_V1.schema_data.replace(b'"string"', b'"int"')
    peer.send(
        command(
            T.GET_OR_CREATE_SCHEMA, "getOrCreateSchema", request_id=2, topic=TOPIC, schema=changed
        )
    )
    r = peer.one(T.GET_OR_CREATE_SCHEMA_RESPONSE).getOrCreateSchemaResponse
    assert r.error_code == pb.IncompatibleSchema


def test_get_schema_of_topic_without_one(peer: Peer) -> None:
    """GET_SCHEMA of a topic with no schema answers TopicNotFound."""
    peer.send(command(T.GET_SCHEMA, "getSchema", request_id=1, topic=TOPIC))
    assert peer.one(T.GET_SCHEMA_RESPONSE).getSchemaResponse.error_code == pb.TopicNotFound


def test_partitions_share_their_topic_schema(peer: Peer) -> None:
    """A schema registered through one partition is the schema of every partition."""
    peer.send(
        command(
            T.PRODUCER,
            "producer",
            topic=TOPIC + "-partition-0",
            producer_id=1,
            request_id=1,
            schema=STRING,
        )
    )
    peer.one(T.PRODUCER_SUCCESS)
    peer.send(command(T.GET_SCHEMA, "getSchema", request_id=2, topic=TOPIC + "-partition-3"))
    assert peer.one(T.GET_SCHEMA_RESPONSE).getSchemaResponse.schema.type == STRING.type
