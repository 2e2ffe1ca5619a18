"""Unit tests of the sans-IO MQTT codec: round trips at levels 4 and 5, malformed input."""

from __future__ import annotations

import random
from typing import Any

import pytest

from polybroker.protocols.mqtt import codec as c


def _round_trip(packet: c.Packet, level: int) -> c.Packet:
    reader = c.PacketReader(level=level)
    reader.feed(c.encode(packet, level))
    (got,) = reader.packets()
    return got


def _server_reader() -> c.PacketReader:
    return c.PacketReader(max_packet_size=1024)


V5_PACKETS: list[c.Packet] = [
    c.ConnAck(True, 0, {c.ASSIGNED_CLIENT_ID: "x", c.SERVER_KEEP_ALIVE: 10}),
    c.Publish(
        "a/b",
        b"\x00payload",
        2,
        True,
        True,
        7,
        {c.USER_PROPERTY: [("k", "v"), ("k", "w")], c.SUBSCRIPTION_ID: [1, 300], c.TOPIC_ALIAS: 3},
    ),
    c.Publish("t", b"", 0, False, False, None, {c.MESSAGE_EXPIRY: 60}),
    c.PubAck(1),
    c.PubAck(1, c.NO_MATCHING_SUBSCRIBERS, {c.REASON_STRING: "none"}),
    c.PubRec(2, c.SUCCESS),
    c.PubRel(3, c.PACKET_ID_NOT_FOUND),
    c.PubComp(4),
    c.Subscribe(
        5,
        [c.Subscription("a/+", 1, True, True, 2), c.Subscription("#", 2)],
        {c.SUBSCRIPTION_ID: [42]},
    ),
    c.SubAck(5, [1, 2, 0x80]),
    c.Unsubscribe(6, ["a/+", "#"]),
    c.UnsubAck(6, [0, 0x11]),
    c.PingReq(),
    c.PingResp(),
    c.Disconnect(c.DISCONNECT_WITH_WILL, {c.SESSION_EXPIRY: 0}),
    c.Auth(0x18, {c.AUTH_METHOD: "m", c.AUTH_DATA: b"d"}),
]


@pytest.mark.parametrize("packet", V5_PACKETS, ids=lambda p: type(p).__name__)
def test_v5_round_trip(packet: c.Packet) -> None:
    """Every packet type with its properties decodes to what was encoded at level 5."""
    assert _round_trip(packet, c.LEVEL_5) == packet


def test_v311_round_trip_drops_properties() -> None:
    """At level 4 packets carry no properties and acks no reason codes."""
    p = c.Publish("a/b", b"x", 1, False, False, 9, {})
    assert _round_trip(p, c.LEVEL_311) == p
    assert c.encode(c.PubAck(9, c.NO_MATCHING_SUBSCRIBERS), c.LEVEL_311) == b"\x40\x02\x00\x09"
    assert _round_trip(c.UnsubAck(3, [0]), c.LEVEL_311) == c.UnsubAck(3, [])
    assert c.encode(c.ConnAck(False, 0), c.LEVEL_311) == b"\x20\x02\x00\x00"


@pytest.mark.parametrize("level", [c.LEVEL_311, c.LEVEL_5])
def test_connect_round_trip_sets_reader_level(level: int) -> None:
    """A CONNECT with will and credentials decodes and fixes the reader's protocol level."""
    props = {c.SESSION_EXPIRY: 30, c.RECEIVE_MAXIMUM: 10} if level == c.LEVEL_5 else {}
    will_props = {c.WILL_DELAY: 5} if level == c.LEVEL_5 else {}
    connect = c.Connect(
        "cid",
        level,
        False,
        30,
        c.Will("w/t", b"bye", 1, True, will_props),
        "user",
        b"pw",
        props,
    )
    reader = _server_reader()
    reader.feed(c.encode(connect, level))
    assert reader.packets() == [connect]
    assert reader.level == level


def test_incremental_feed() -> None:
    """Packets split at every byte boundary come out whole, in order."""
    data = c.encode(c.Connect("a"), 4) + c.encode(c.Publish("t", b"x" * 200), 4)
    reader = _server_reader()
    got: list[c.Packet] = []
    for i in range(len(data)):
        reader.feed(data[i : i + 1])
        got.extend(reader.packets())
    assert got == [c.Connect("a"), c.Publish("t", b"x" * 200)]


def test_varint_bounds() -> None:
    """Variable byte integers encode in 1..4 bytes and refuse a fifth."""
    for value, size in [(0, 1), (127, 1), (128, 2), (16383, 2), (16384, 3), (268_435_455, 4)]:
        enc = c.encode_varint(value)
        assert len(enc) == size
        assert c.decode_varint(enc, 0) == (value, size)
    with pytest.raises(ValueError, match="range"):
        c.encode_varint(268_435_456)
    with pytest.raises(c.MqttError):
        c.decode_varint(b"\xff\xff\xff\xff\x01", 0)
    assert c.decode_varint(b"\x80", 0) is None


def _error(data: bytes, level: int = 0, max_size: int = 1024) -> c.MqttError:
    reader = c.PacketReader(max_size, level)
    reader.feed(data)
    with pytest.raises(c.MqttError) as info:
        reader.packets()
    return info.value


def test_oversize_refused_before_buffering() -> None:
    """A remaining length above the limit is refused from the header alone."""
    err = _error(b"\x30" + c.encode_varint(10_000))
    assert err.reason_code == c.PACKET_TOO_LARGE


def test_first_packet_must_be_connect() -> None:
    """Anything before CONNECT is a protocol error."""
    assert _error(c.encode(c.PingReq())).reason_code == c.PROTOCOL_ERROR


def test_second_connect_is_protocol_error() -> None:
    """A second CONNECT on one connection is a protocol error."""
    data = c.encode(c.Connect("a")) * 2
    assert _error(data).reason_code == c.PROTOCOL_ERROR


def test_unknown_protocol_level() -> None:
    """An unknown level raises UnsupportedProtocolError carrying the level."""
    data = bytearray(c.encode(c.Connect("a")))
    data[8] = 9
    err = _error(bytes(data))
    assert isinstance(err, c.UnsupportedProtocolError)
    assert err.level == 9


def _connect(name: str, level: int) -> bytes:
    """A CONNECT naming ``name`` at ``level`` with client id "x" (no properties below 5)."""
    body = c._string(name) + bytes([level, 0x02, 0x00, 0x3C])
    body += (b"\x00" if level == c.LEVEL_5 else b"") + c._string("x")
    return b"\x10" + c.encode_varint(len(body)) + body


@pytest.mark.parametrize(
    ("name", "level"), [("MQIsdp", 0), ("MQIsdp", 4), ("MQIsdp", 255), ("MQTT", 3), ("MQTT", 0)]
)
def test_a_protocol_name_goes_with_its_own_levels_only(name: str, level: int) -> None:
    """MQIsdp is level 3 (MQTT 3.1) and MQTT is 4 or 5: any other pair is unsupported."""
    err = _error(_connect(name, level))
    assert isinstance(err, c.UnsupportedProtocolError)
    assert err.level == level


def test_mqtt_31_connects_and_a_second_connect_is_refused() -> None:
    """MQIsdp at level 3 sets the reader's level, so a second CONNECT is a protocol error."""
    reader = c.PacketReader()
    reader.feed(_connect("MQIsdp", c.LEVEL_31) + _connect("MQTT", c.LEVEL_5))
    first = reader.next_packet()
    assert isinstance(first, c.Connect)
    assert reader.level == c.LEVEL_31
    with pytest.raises(c.MqttError) as info:
        reader.next_packet()
    assert info.value.reason_code == c.PROTOCOL_ERROR


@pytest.mark.parametrize(
    "packet",
    [
        c.Connect("a", c.LEVEL_5, properties={c.TOPIC_ALIAS: 1}),
        c.Connect("a", c.LEVEL_5, will=c.Will("w", b"", 0, False, {c.SESSION_EXPIRY: 1})),
        c.Publish("t", b"", 0, False, False, None, {c.RECEIVE_MAXIMUM: 5}),
        c.Subscribe(1, [c.Subscription("t", 0)], {c.CONTENT_TYPE: "x"}),
        c.Unsubscribe(1, ["t"], {c.SUBSCRIPTION_ID: [3]}),
        c.PubAck(1, c.SUCCESS, {c.TOPIC_ALIAS: 2}),
        c.Disconnect(c.SUCCESS, {c.WILL_DELAY: 1}),
    ],
)
def test_a_property_outside_its_packet_types_is_malformed(packet: c.Packet) -> None:
    """Each property belongs to some packet types only (MQTT 5.0 2.2.2.2); elsewhere the packet
    is malformed."""
    reader = c.PacketReader(level=c.LEVEL_5)
    reader.feed(c.encode(packet, c.LEVEL_5))
    with pytest.raises(c.MqttError) as info:
        reader.next_packet()
    assert info.value.reason_code == c.MALFORMED_PACKET
    assert "not valid in this packet" in str(info.value)


class _CountingBytes(bytes):
    """Bytes that count what slicing them copies."""

    copied = 0

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        if isinstance(key, slice):
            _CountingBytes.copied += len(out)
        return out


def test_properties_are_read_without_copying_the_packet_per_property() -> None:
    """Reading a property block copies each field once, not the block per property: a packet
    of many small properties costs time in proportion to its size."""
    props = b"\x0b\x01" * 5000  # subscription identifiers
    data = _CountingBytes(c.encode_varint(len(props)) + props)
    _CountingBytes.copied = 0
    reader = c._Reader(data)
    c._read_properties(reader, c._SUBSCRIBE_PROPS)
    assert reader.remaining() == 0
    assert _CountingBytes.copied <= len(data)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x00\x00", c.MALFORMED_PACKET),  # reserved type 0
        (b"\xc1\x00", c.MALFORMED_PACKET),  # PINGREQ with flags
        (b"\x82\x03\x00\x01\x00", c.MALFORMED_PACKET),  # SUBSCRIBE ends inside a filter
        (b"\x82\x02\x00\x01", c.PROTOCOL_ERROR),  # SUBSCRIBE without filters
        (b"\x80\x05\x00\x01\x00\x01a", c.MALFORMED_PACKET),  # SUBSCRIBE without flags 0b0010
        (b"\x36\x05\x00\x01t\x00\x01", c.MALFORMED_PACKET),  # QoS 3
        (b"\x38\x03\x00\x01t", c.MALFORMED_PACKET),  # DUP on QoS 0
        (b"\x32\x05\x00\x01t\x00\x00", c.MALFORMED_PACKET),  # packet id 0
        (b"\x82\x06\x00\x00\x00\x01a\x00", c.MALFORMED_PACKET),  # SUBSCRIBE, packet id 0
        (b"\xa2\x05\x00\x00\x00\x01a", c.MALFORMED_PACKET),  # UNSUBSCRIBE, packet id 0
        (b"\x30\x04\x00\x02\xff\xfe", c.MALFORMED_PACKET),  # invalid UTF-8
        (b"\x30\x03\x00\x01\x00", c.MALFORMED_PACKET),  # U+0000 in a topic
        (b"\x30\x03\x00\x01+", c.TOPIC_NAME_INVALID),  # wildcard in a topic name
        (b"\x40\x03\x00\x01\x00", c.MALFORMED_PACKET),  # bytes after a 3.1.1 PUBACK
        (b"\x62\x02\x00\x01", None),  # PUBREL is fine
    ],
)
def test_malformed_after_connect(data: bytes, code: int | None) -> None:
    """Malformed packets after a 3.1.1 CONNECT raise the spec's reason code."""
    reader = c.PacketReader(1024, c.LEVEL_311)
    reader.feed(data)
    if code is None:
        assert reader.packets() == [c.PubRel(1)]
        return
    with pytest.raises(c.MqttError) as info:
        reader.packets()
    assert info.value.reason_code == code


def test_bad_properties() -> None:
    """Unknown, repeated and overlong properties are refused at level 5."""
    unknown = b"\x30\x06\x00\x01t\x02\x7f\x00"
    assert _error(unknown, c.LEVEL_5).reason_code == c.MALFORMED_PACKET
    repeated = b"\x30\x0e\x00\x01t" + b"\x0a" + b"\x02\x00\x00\x00\x01" * 2
    assert _error(repeated, c.LEVEL_5).reason_code == c.PROTOCOL_ERROR
    overlong = b"\x30\x05\x00\x01t\x09\x01"
    assert _error(overlong, c.LEVEL_5).reason_code == c.MALFORMED_PACKET


def test_random_bytes_never_crash() -> None:
    """Random input yields packets or MqttError, nothing else."""
    rnd = random.Random(5)
    codes: list[int] = []
    for _ in range(2000):
        reader = c.PacketReader(4096, rnd.choice([c.LEVEL_311, c.LEVEL_5]))
        reader.feed(bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 40))))
        try:
            reader.packets()
        except c.MqttError as e:
            codes.append(e.reason_code)
    assert len(codes) > 500
    assert all(0x80 <= code <= 0xA2 for code in codes)


FAST_PUBLISHES = [
    c.Publish("a/b", b"x" * 100, 0),
    c.Publish("a/b", b"", 1, True, False, 65535),
    c.Publish("\u00e9t\u00e9/\u2603", b"\x00\xff", 2, False, True, 1),
    c.Publish("", b"p", 0, True),
    c.Publish("t", b"y" * 20000, 1, False, False, 300),
]


@pytest.mark.parametrize("packet", FAST_PUBLISHES)
def test_fast_publish_decode_matches_the_general_decoder(packet: c.Publish) -> None:
    """A 3.1.1 PUBLISH decoded straight from the buffer equals the general decoder's."""
    data = c.encode(packet, c.LEVEL_311)
    reader = c.PacketReader(1 << 20, c.LEVEL_311)
    reader.feed(data + c.encode(c.PubAck(9)))
    got = reader.packets()
    body_start = c.decode_varint(data, 1)
    assert body_start is not None
    general = c._decode_body(c.PUBLISH, data[0] & 0x0F, data[body_start[1] :], c.LEVEL_311)
    assert got == [general, c.PubAck(9)]
    assert got[0] == packet


@pytest.mark.parametrize("size", [0, 100, 121, 122, 123, 16000, 16377, 16378, 20000])
@pytest.mark.parametrize("level", [c.LEVEL_311, c.LEVEL_5])
def test_encode_publish_matches_encode(size: int, level: int) -> None:
    """PUBLISHes built from ready fields are byte-identical to ``encode``'s, across the
    remaining length's one-, two- and three-byte encodings."""
    props = {c.USER_PROPERTY: [("k", "v")]} if level == c.LEVEL_5 else {}
    for qos, pid in ((0, None), (1, 7), (2, 65535)):
        packet = c.Publish("a/b", b"z" * size, qos, qos == 1, qos == 2, pid, props)
        fields = c.encode_properties(props) if level == c.LEVEL_5 else b""
        fast = c.encode_publish(
            c.string_field("a/b"), packet.payload, qos, packet.retain, packet.dup, pid, fields
        )
        assert fast == c.encode(packet, level)


def test_encode_ack_matches_encode() -> None:
    """The short acknowledgements are byte-identical to ``encode``'s at both levels."""
    acks = (
        (c.PUBACK, c.PubAck),
        (c.PUBREC, c.PubRec),
        (c.PUBREL, c.PubRel),
        (c.PUBCOMP, c.PubComp),
    )
    for ptype, cls in acks:
        for level in (c.LEVEL_311, c.LEVEL_5):
            assert c.encode_ack(ptype, 513) == c.encode(cls(513), level)
