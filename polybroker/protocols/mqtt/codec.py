"""Sans-IO MQTT 3.1.1 and 5.0 codec: bytes in, typed packets out, and back. Never imports Twisted.

Rule 1: every packet is ``type<<4 | flags`` (one byte), a variable byte integer (at most four
bytes) giving the remaining length, then the variable header and payload.
Rule 2: every read is bounded: a remaining length above ``max_packet_size`` raises ``MqttError``
(0x95 packet too large) before the body is buffered; a truncated field, bad flags, an invalid
UTF-8 string, an unknown or repeated property raise ``MqttError`` with 0x81 (malformed packet)
or 0x82 (protocol error), the MQTT 5 reason codes a server sends in DISCONNECT.
Rule 3: the protocol level comes from CONNECT; properties are read and written only at level 5.

Properties are a ``dict[int, Any]`` keyed by property identifier; user properties (0x26) are a
list of ``(name, value)`` pairs and subscription identifiers (0x0B) a list of ints.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

# Packet types.
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

LEVEL_311 = 4
LEVEL_5 = 5
LEVEL_31 = 3

# Reason codes (MQTT 5 section 2.4) used by the broker.
SUCCESS = 0x00
GRANTED_QOS_1 = 0x01
GRANTED_QOS_2 = 0x02
DISCONNECT_WITH_WILL = 0x04
NO_MATCHING_SUBSCRIBERS = 0x10
NO_SUBSCRIPTION_EXISTED = 0x11
UNSPECIFIED_ERROR = 0x80
MALFORMED_PACKET = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC = 0x83
UNSUPPORTED_PROTOCOL_VERSION = 0x84
CLIENT_ID_NOT_VALID = 0x85
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_SHUTTING_DOWN = 0x8B
BAD_AUTH_METHOD = 0x8C
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_ID_IN_USE = 0x91
PACKET_ID_NOT_FOUND = 0x92
RECEIVE_MAXIMUM_EXCEEDED = 0x93
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
QUOTA_EXCEEDED = 0x97
PAYLOAD_FORMAT_INVALID = 0x99
SHARED_SUBS_NOT_SUPPORTED = 0x9E
SUB_IDS_NOT_SUPPORTED = 0xA1

# MQTT 3.1.1 CONNACK return codes.
V3_UNACCEPTABLE_PROTOCOL = 0x01
V3_IDENTIFIER_REJECTED = 0x02
V3_SERVER_UNAVAILABLE = 0x03

# Property identifiers.
PAYLOAD_FORMAT = 0x01
MESSAGE_EXPIRY = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_ID = 0x0B
SESSION_EXPIRY = 0x11
ASSIGNED_CLIENT_ID = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTH_METHOD = 0x15
AUTH_DATA = 0x16
REQUEST_PROBLEM_INFO = 0x17
WILL_DELAY = 0x18
REQUEST_RESPONSE_INFO = 0x19
RESPONSE_INFO = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUB_AVAILABLE = 0x28
SUB_ID_AVAILABLE = 0x29
SHARED_SUB_AVAILABLE = 0x2A

_BYTE, _INT2, _INT4, _VARINT, _STR, _BIN, _PAIR = range(7)
PROPERTY_TYPES: dict[int, int] = {
    PAYLOAD_FORMAT: _BYTE,
    MESSAGE_EXPIRY: _INT4,
    CONTENT_TYPE: _STR,
    RESPONSE_TOPIC: _STR,
    CORRELATION_DATA: _BIN,
    SUBSCRIPTION_ID: _VARINT,
    SESSION_EXPIRY: _INT4,
    ASSIGNED_CLIENT_ID: _STR,
    SERVER_KEEP_ALIVE: _INT2,
    AUTH_METHOD: _STR,
    AUTH_DATA: _BIN,
    REQUEST_PROBLEM_INFO: _BYTE,
    WILL_DELAY: _INT4,
    REQUEST_RESPONSE_INFO: _BYTE,
    RESPONSE_INFO: _STR,
    SERVER_REFERENCE: _STR,
    REASON_STRING: _STR,
    RECEIVE_MAXIMUM: _INT2,
    TOPIC_ALIAS_MAXIMUM: _INT2,
    TOPIC_ALIAS: _INT2,
    MAXIMUM_QOS: _BYTE,
    RETAIN_AVAILABLE: _BYTE,
    USER_PROPERTY: _PAIR,
    MAXIMUM_PACKET_SIZE: _INT4,
    WILDCARD_SUB_AVAILABLE: _BYTE,
    SUB_ID_AVAILABLE: _BYTE,
    SHARED_SUB_AVAILABLE: _BYTE,
}
#: Properties that may appear more than once.
_REPEATABLE = frozenset({USER_PROPERTY, SUBSCRIPTION_ID})
#: The properties each packet type may carry (MQTT 5.0 section 2.2.2.2); any other is malformed.
_MESSAGE_PROPS = frozenset(
    {PAYLOAD_FORMAT, MESSAGE_EXPIRY, CONTENT_TYPE, RESPONSE_TOPIC, CORRELATION_DATA}
)
_PUBLISH_PROPS = frozenset({*_MESSAGE_PROPS, SUBSCRIPTION_ID, TOPIC_ALIAS, USER_PROPERTY})
_WILL_PROPS = frozenset({*_MESSAGE_PROPS, WILL_DELAY, USER_PROPERTY})
_CONNECT_PROPS = frozenset(
    {
        SESSION_EXPIRY,
        AUTH_METHOD,
        AUTH_DATA,
        REQUEST_PROBLEM_INFO,
        REQUEST_RESPONSE_INFO,
        RECEIVE_MAXIMUM,
        TOPIC_ALIAS_MAXIMUM,
        USER_PROPERTY,
        MAXIMUM_PACKET_SIZE,
    }
)
_CONNACK_PROPS = frozenset(
    {
        SESSION_EXPIRY,
        ASSIGNED_CLIENT_ID,
        SERVER_KEEP_ALIVE,
        AUTH_METHOD,
        AUTH_DATA,
        RESPONSE_INFO,
        SERVER_REFERENCE,
        REASON_STRING,
        RECEIVE_MAXIMUM,
        TOPIC_ALIAS_MAXIMUM,
        MAXIMUM_QOS,
        RETAIN_AVAILABLE,
        USER_PROPERTY,
        MAXIMUM_PACKET_SIZE,
        WILDCARD_SUB_AVAILABLE,
        SUB_ID_AVAILABLE,
        SHARED_SUB_AVAILABLE,
    }
)
_ACK_PROPS = frozenset({REASON_STRING, USER_PROPERTY})  # PUBACK ... PUBCOMP, SUBACK, UNSUBACK
_SUBSCRIBE_PROPS = frozenset({SUBSCRIPTION_ID, USER_PROPERTY})
_UNSUBSCRIBE_PROPS = frozenset({USER_PROPERTY})
_DISCONNECT_PROPS = frozenset({SESSION_EXPIRY, REASON_STRING, SERVER_REFERENCE, USER_PROPERTY})
_AUTH_PROPS = frozenset({AUTH_METHOD, AUTH_DATA, REASON_STRING, USER_PROPERTY})
#: The largest remaining length a four-byte variable byte integer can express.
MAX_REMAINING_LENGTH = 268_435_455

Properties = dict[int, Any]


class MqttError(Exception):
    """Bad input: ``reason_code`` is the MQTT 5 reason code the server answers with."""

    def __init__(self, reason_code: int, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class UnsupportedProtocolError(MqttError):
    """A CONNECT with a protocol name or level this server does not speak."""

    def __init__(self, level: int, message: str) -> None:
        super().__init__(UNSUPPORTED_PROTOCOL_VERSION, message)
        self.level = level


# -- packets ---------------------------------------------------------------------------------


@dataclass
class Will:
    """The last will carried by CONNECT."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=dict)


@dataclass
class Connect:
    client_id: str
    level: int = LEVEL_311
    clean_start: bool = True
    keep_alive: int = 60
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = field(default_factory=dict)
    protocol_name: str = "MQTT"


@dataclass
class ConnAck:
    session_present: bool = False
    reason_code: int = SUCCESS
    properties: Properties = field(default_factory=dict)


@dataclass
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = field(default_factory=dict)


@dataclass
class PubAck:
    packet_id: int
    reason_code: int = SUCCESS
    properties: Properties = field(default_factory=dict)


@dataclass
class PubRec(PubAck):
    pass


@dataclass
class PubRel(PubAck):
    pass


@dataclass
class PubComp(PubAck):
    pass


@dataclass
class Subscription:
    """One topic filter of a SUBSCRIBE with its options."""

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription]
    properties: Properties = field(default_factory=dict)


@dataclass
class SubAck:
    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=dict)


@dataclass
class Unsubscribe:
    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=dict)


@dataclass
class UnsubAck:
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=dict)


@dataclass
class PingReq:
    pass


@dataclass
class PingResp:
    pass


@dataclass
class Disconnect:
    reason_code: int = SUCCESS
    properties: Properties = field(default_factory=dict)


@dataclass
class Auth:
    reason_code: int = SUCCESS
    properties: Properties = field(default_factory=dict)


Packet = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)

_ACK_TYPES: dict[type, int] = {PubAck: PUBACK, PubRec: PUBREC, PubRel: PUBREL, PubComp: PUBCOMP}
_ACK_CLASSES: dict[int, type[PubAck]] = {v: k for k, v in _ACK_TYPES.items()}


# -- primitives ------------------------------------------------------------------------------


def encode_varint(value: int) -> bytes:
    """A variable byte integer (1 to 4 bytes)."""
    if not 0 <= value <= MAX_REMAINING_LENGTH:
        raise ValueError(f"variable byte integer out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(
    data: bytes | bytearray | memoryview, pos: int, end: int | None = None
) -> tuple[int, int] | None:
    """``(value, next_pos)``, or None when ``data`` (or ``data[:end]``) ends first;
    ``MqttError`` past 4 bytes."""
    limit = len(data) if end is None else end
    value = 0
    for i in range(4):
        if pos + i >= limit:
            return None
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i > 0 and byte == 0:
                raise MqttError(MALFORMED_PACKET, "non-minimal variable byte integer")
            return value, pos + i + 1
    raise MqttError(MALFORMED_PACKET, "variable byte integer longer than 4 bytes")


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("string longer than 65535 bytes")
    return struct.pack(">H", len(raw)) + raw


def _binary(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    return struct.pack(">H", len(value)) + value


class _Reader:
    """Bounded reads over one packet's body; every overrun is a malformed packet."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise MqttError(MALFORMED_PACKET, "packet ends inside a field")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def int2(self) -> int:
        return int(struct.unpack(">H", self.take(2))[0])

    def int4(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def varint(self) -> int:
        got = decode_varint(self.data, self.pos, self.end)
        if got is None:
            raise MqttError(MALFORMED_PACKET, "packet ends inside a variable byte integer")
        value, self.pos = got
        return value

    def binary(self) -> bytes:
        return self.take(self.int2())

    def string(self) -> str:
        raw = self.binary()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MqttError(MALFORMED_PACKET, "invalid UTF-8 string") from None
        if "\x00" in text:
            raise MqttError(MALFORMED_PACKET, "string holds U+0000")
        return text


def _read_properties(r: _Reader, allowed: frozenset[int]) -> Properties:
    """The property block at ``r``: a property outside ``allowed`` (those of the packet type)
    is a malformed packet."""
    length = r.varint()
    if length > r.remaining():
        raise MqttError(MALFORMED_PACKET, "property length exceeds the packet")
    end = r.pos + length
    sub = _Reader(r.data, r.pos, end)
    props: Properties = {}
    while sub.remaining():
        pid = sub.varint()
        kind = PROPERTY_TYPES.get(pid)
        if kind is None:
            raise MqttError(MALFORMED_PACKET, f"unknown property 0x{pid:02x}")
        if pid not in allowed:
            raise MqttError(MALFORMED_PACKET, f"property 0x{pid:02x} is not valid in this packet")
        value: Any
        if kind == _BYTE:
            value = sub.byte()
        elif kind == _INT2:
            value = sub.int2()
        elif kind == _INT4:
            value = sub.int4()
        elif kind == _VARINT:
            value = sub.varint()
        elif kind == _STR:
            value = sub.string()
        elif kind == _BIN:
            value = sub.binary()
        else:
            value = (sub.string(), sub.string())
        if pid in _REPEATABLE:
            props.setdefault(pid, []).append(value)
        elif pid in props:
            raise MqttError(PROTOCOL_ERROR, f"property 0x{pid:02x} repeated")
        else:
            props[pid] = value
    r.pos = end
    return props


def encode_properties(props: Properties) -> bytes:
    """The property block (length + properties) of an MQTT 5 packet."""
    out = bytearray()
    for pid, value in props.items():
        kind = PROPERTY_TYPES[pid]
        values = value if pid in _REPEATABLE else [value]
        for v in values:
            out += encode_varint(pid)
            if kind == _BYTE:
                out.append(v)
            elif kind == _INT2:
                out += struct.pack(">H", v)
            elif kind == _INT4:
                out += struct.pack(">I", v)
            elif kind == _VARINT:
                out += encode_varint(v)
            elif kind == _STR:
                out += _string(v)
            elif kind == _BIN:
                out += _binary(v)
            else:
                out += _string(v[0]) + _string(v[1])
    return encode_varint(len(out)) + bytes(out)


# -- decoding --------------------------------------------------------------------------------


def _nonzero_id(packet_id: int) -> int:
    """A SUBSCRIBE's or UNSUBSCRIBE's packet identifier, which may not be 0 (MQTT-2.3.1-1)."""
    if packet_id == 0:
        raise MqttError(MALFORMED_PACKET, "packet identifier 0")
    return packet_id


def _check_qos(qos: int) -> int:
    if qos > 2:
        raise MqttError(MALFORMED_PACKET, "QoS 3")
    return qos


#: The (protocol name, level) pairs of MQTT 3.1, 3.1.1 and 5.0 in CONNECT.
_PROTOCOLS = frozenset({("MQIsdp", LEVEL_31), ("MQTT", LEVEL_311), ("MQTT", LEVEL_5)})


def _decode_connect(r: _Reader) -> Connect:
    name = r.string()
    level = r.byte()
    if (name, level) not in _PROTOCOLS:
        raise UnsupportedProtocolError(level, f"protocol {name!r} level {level}")
    flags = r.byte()
    if flags & 0x01:
        raise MqttError(MALFORMED_PACKET, "reserved CONNECT flag set")
    keep_alive = r.int2()
    props = _read_properties(r, _CONNECT_PROPS) if level == LEVEL_5 else {}
    client_id = r.string()
    will: Will | None = None
    will_qos = _check_qos((flags >> 3) & 0x03)
    will_retain = bool(flags & 0x20)
    if flags & 0x04:
        will_props = _read_properties(r, _WILL_PROPS) if level == LEVEL_5 else {}
        topic = r.string()
        _check_topic_name(topic)
        will = Will(topic, r.binary(), will_qos, will_retain, will_props)
    elif will_qos or will_retain:
        raise MqttError(MALFORMED_PACKET, "will QoS or retain without a will")
    username = r.string() if flags & 0x80 else None
    password = r.binary() if flags & 0x40 else None
    if password is not None and username is None and level != LEVEL_5:
        raise MqttError(MALFORMED_PACKET, "password without user name")
    if r.remaining():
        raise MqttError(MALFORMED_PACKET, "bytes after the CONNECT payload")
    return Connect(
        client_id=client_id,
        level=level,
        clean_start=bool(flags & 0x02),
        keep_alive=keep_alive,
        will=will,
        username=username,
        password=password,
        properties=props,
        protocol_name=name,
    )


def _check_topic_name(topic: str) -> None:
    if "+" in topic or "#" in topic:
        raise MqttError(TOPIC_NAME_INVALID, "wildcard in a topic name")


def _decode_body(ptype: int, flags: int, body: bytes, level: int) -> Packet:
    r = _Reader(body)
    v5 = level == LEVEL_5
    if ptype == PUBLISH:
        qos = _check_qos((flags >> 1) & 0x03)
        dup = bool(flags & 0x08)
        if qos == 0 and dup:
            raise MqttError(MALFORMED_PACKET, "DUP set on a QoS 0 PUBLISH")
        topic = r.string()
        _check_topic_name(topic)
        packet_id = None
        if qos:
            packet_id = r.int2()
            if packet_id == 0:
                raise MqttError(MALFORMED_PACKET, "packet identifier 0")
        props = _read_properties(r, _PUBLISH_PROPS) if v5 else {}
        return Publish(topic, r.take(r.remaining()), qos, bool(flags & 0x01), dup, packet_id, props)
    expected_flags = 0x02 if ptype in (PUBREL, SUBSCRIBE, UNSUBSCRIBE) else 0
    if flags != expected_flags:
        raise MqttError(MALFORMED_PACKET, f"bad fixed-header flags for packet type {ptype}")
    if ptype == CONNECT:
        return _decode_connect(r)
    if ptype in _ACK_CLASSES:
        packet_id = r.int2()
        code = SUCCESS
        props = {}
        if v5 and r.remaining():
            code = r.byte()
            if r.remaining():
                props = _read_properties(r, _ACK_PROPS)
        _expect_end(r)
        return _ACK_CLASSES[ptype](packet_id, code, props)
    if ptype == CONNACK:
        ack_flags = r.byte()
        if ack_flags & 0xFE:
            raise MqttError(MALFORMED_PACKET, "reserved CONNACK flags set")
        code = r.byte()
        props = _read_properties(r, _CONNACK_PROPS) if v5 and r.remaining() else {}
        _expect_end(r)
        return ConnAck(bool(ack_flags & 1), code, props)
    if ptype == SUBSCRIBE:
        packet_id = _nonzero_id(r.int2())
        props = _read_properties(r, _SUBSCRIBE_PROPS) if v5 else {}
        subs = []
        while r.remaining():
            topic_filter = r.string()
            options = r.byte()
            if options & 0xC0 or (not v5 and options & 0xFC):
                raise MqttError(MALFORMED_PACKET, "reserved subscription options set")
            retain_handling = (options >> 4) & 0x03
            if retain_handling == 3:
                raise MqttError(PROTOCOL_ERROR, "retain handling 3")
            subs.append(
                Subscription(
                    topic_filter,
                    _check_qos(options & 0x03),
                    bool(options & 0x04),
                    bool(options & 0x08),
                    retain_handling,
                )
            )
        if not subs:
            raise MqttError(PROTOCOL_ERROR, "SUBSCRIBE without a topic filter")
        return Subscribe(packet_id, subs, props)
    if ptype == SUBACK:
        packet_id = r.int2()
        props = _read_properties(r, _ACK_PROPS) if v5 else {}
        return SubAck(packet_id, list(r.take(r.remaining())), props)
    if ptype == UNSUBSCRIBE:
        packet_id = _nonzero_id(r.int2())
        props = _read_properties(r, _UNSUBSCRIBE_PROPS) if v5 else {}
        filters = []
        while r.remaining():
            filters.append(r.string())
        if not filters:
            raise MqttError(PROTOCOL_ERROR, "UNSUBSCRIBE without a topic filter")
        return Unsubscribe(packet_id, filters, props)
    if ptype == UNSUBACK:
        packet_id = r.int2()
        props = _read_properties(r, _ACK_PROPS) if v5 else {}
        codes = list(r.take(r.remaining())) if v5 else []
        return UnsubAck(packet_id, codes, props)
    if ptype in (PINGREQ, PINGRESP):
        _expect_end(r)
        return PingReq() if ptype == PINGREQ else PingResp()
    if ptype in (DISCONNECT, AUTH):
        code = SUCCESS
        props = {}
        if v5 and r.remaining():
            code = r.byte()
            if r.remaining():
                props = _read_properties(
                    r, _DISCONNECT_PROPS if ptype == DISCONNECT else _AUTH_PROPS
                )
        _expect_end(r)
        if ptype == AUTH:
            if not v5:
                raise MqttError(PROTOCOL_ERROR, "AUTH below MQTT 5")
            return Auth(code, props)
        return Disconnect(code, props)
    raise MqttError(MALFORMED_PACKET, f"reserved packet type {ptype}")


def _publish_311(buf: bytearray, first: int, start: int, end: int) -> Publish | None:
    """A well-formed MQTT 3.1.1 PUBLISH in ``buf[start:end]``, or None for anything the
    general decoder must look at (and refuse)."""
    qos = (first >> 1) & 0x03
    if qos == 3 or (qos == 0 and first & 0x08) or end - start < 2:
        return None
    topic_end = start + 2 + ((buf[start] << 8) | buf[start + 1])
    if topic_end > end:
        return None
    try:
        topic = buf[start + 2 : topic_end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in topic or "+" in topic or "#" in topic:
        return None
    packet_id = None
    if qos:
        if topic_end + 2 > end:
            return None
        packet_id = (buf[topic_end] << 8) | buf[topic_end + 1]
        if packet_id == 0:
            return None
        topic_end += 2
    return Publish(
        topic, bytes(buf[topic_end:end]), qos, bool(first & 0x01), bool(first & 0x08), packet_id, {}
    )


def encode_publish(
    topic_field: bytes,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    properties_field: bytes = b"",
) -> bytes:
    """A PUBLISH from ready fields: ``topic_field`` is ``string_field(topic)``,
    ``properties_field`` the encoded MQTT 5 properties (empty for 3.1.1)."""
    first = 0x30 | (qos << 1) | (1 if retain else 0) | (8 if dup else 0)
    n = len(topic_field) + len(properties_field) + len(payload)
    if qos:
        if packet_id is None:
            raise ValueError("QoS > 0 PUBLISH without a packet identifier")
        n += 2
        head = topic_field + packet_id.to_bytes(2, "big")
    else:
        head = topic_field
    if n < 128:
        fixed = bytes((first, n))
    elif n < 16384:
        fixed = bytes((first, (n & 0x7F) | 0x80, n >> 7))
    else:
        fixed = bytes((first,)) + encode_varint(n)
    return b"".join((fixed, head, properties_field, payload))


def string_field(value: str) -> bytes:
    """A UTF-8 string field (two-byte length, then the bytes)."""
    return _string(value)


def encode_ack(ptype: int, packet_id: int) -> bytes:
    """A PUBACK, PUBREC, PUBREL or PUBCOMP with reason code 0 and no properties (both
    levels)."""
    return bytes(((ptype << 4) | (2 if ptype == PUBREL else 0), 2)) + packet_id.to_bytes(2, "big")


def _expect_end(r: _Reader) -> None:
    if r.remaining():
        raise MqttError(MALFORMED_PACKET, "bytes after the end of the packet")


class PacketReader:
    """Incremental decoder: ``feed`` bytes, then take complete packets from ``packets``.

    ``level`` is set from the first CONNECT decoded (or by the caller for a client-side
    reader). After an ``MqttError`` the stream is unusable: close the connection.
    """

    def __init__(self, max_packet_size: int = MAX_REMAINING_LENGTH + 5, level: int = 0) -> None:
        self.max_packet_size = max_packet_size
        self.level = level
        self._buf = bytearray()
        self._pos = 0  # start of the first unread packet in ``_buf``

    def feed(self, data: bytes) -> None:
        if self._pos:
            # Drop what was read once per feed, not once per packet (a read holds many).
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def next_packet(self) -> Packet | None:
        """The next complete packet, or None until more bytes arrive."""
        buf = self._buf
        pos = self._pos
        if pos + 1 >= len(buf):
            return None
        length = buf[pos + 1]
        if length < 0x80:
            # One length byte (a packet under 128 bytes), read without decode_varint's call.
            start = pos + 2
        else:
            got = decode_varint(buf, pos + 1)
            if got is None:
                return None
            length, start = got
        if start - pos + length > self.max_packet_size:
            raise MqttError(PACKET_TOO_LARGE, f"packet of {start - pos + length} bytes")
        end = start + length
        if len(buf) < end:
            return None
        first = buf[pos]
        if first == 0x40 and length == 2 and self.level:
            # PUBACK with no reason code: the other common packet.
            self._pos = end
            return PubAck((buf[start] << 8) | buf[start + 1])
        if first >> 4 == PUBLISH and self.level == LEVEL_311:
            # The common packet, decoded straight from the buffer (same checks as below).
            fast = _publish_311(buf, first, start, end)
            if fast is not None:
                self._pos = end
                return fast
        body = bytes(buf[start:end])
        self._pos = end
        ptype = first >> 4
        if ptype == 0:
            raise MqttError(MALFORMED_PACKET, "reserved packet type 0")
        if self.level == 0 and ptype != CONNECT:
            raise MqttError(PROTOCOL_ERROR, "first packet is not CONNECT")
        packet = _decode_body(ptype, first & 0x0F, body, self.level or LEVEL_311)
        if isinstance(packet, Connect):
            if self.level:
                raise MqttError(PROTOCOL_ERROR, "second CONNECT")
            self.level = packet.level
        return packet

    def packets(self) -> list[Packet]:
        """Every complete packet buffered so far."""
        out = []
        while (p := self.next_packet()) is not None:
            out.append(p)
        return out


# -- encoding --------------------------------------------------------------------------------


def _fixed(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_varint(len(body)) + body


def encode(packet: Packet, level: int = LEVEL_311) -> bytes:
    """The wire bytes of ``packet`` at protocol ``level`` (properties only at level 5)."""
    v5 = level == LEVEL_5
    if isinstance(packet, Publish):
        body = _string(packet.topic)
        if packet.qos:
            if packet.packet_id is None:
                raise ValueError("QoS > 0 PUBLISH without a packet identifier")
            body += struct.pack(">H", packet.packet_id)
        if v5:
            body += encode_properties(packet.properties)
        first = (PUBLISH << 4) | (packet.qos << 1) | int(packet.retain) | (8 if packet.dup else 0)
        return _fixed(first, body + packet.payload)
    if isinstance(packet, PubAck):
        ptype = _ACK_TYPES[type(packet)]
        body = struct.pack(">H", packet.packet_id)
        if v5 and (packet.reason_code or packet.properties):
            body += bytes((packet.reason_code,))
            if packet.properties:
                body += encode_properties(packet.properties)
        return _fixed((ptype << 4) | (2 if ptype == PUBREL else 0), body)
    if isinstance(packet, Connect):
        flags = 0x02 if packet.clean_start else 0
        will_part = b""
        if packet.will is not None:
            w = packet.will
            flags |= 0x04 | (w.qos << 3) | (0x20 if w.retain else 0)
            will_part = (encode_properties(w.properties) if v5 else b"") + _string(w.topic)
            will_part += _binary(w.payload)
        if packet.username is not None:
            flags |= 0x80
        if packet.password is not None:
            flags |= 0x40
        body = _string(packet.protocol_name) + bytes((packet.level, flags))
        body += struct.pack(">H", packet.keep_alive)
        if v5:
            body += encode_properties(packet.properties)
        body += _string(packet.client_id) + will_part
        if packet.username is not None:
            body += _string(packet.username)
        if packet.password is not None:
            body += _binary(packet.password)
        return _fixed(CONNECT << 4, body)
    if isinstance(packet, ConnAck):
        body = bytes((int(packet.session_present), packet.reason_code))
        if v5:
            body += encode_properties(packet.properties)
        return _fixed(CONNACK << 4, body)
    if isinstance(packet, Subscribe):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += encode_properties(packet.properties)
        for s in packet.subscriptions:
            options = s.qos
            if v5:
                options |= (
                    (4 if s.no_local else 0)
                    | (8 if s.retain_as_published else 0)
                    | (s.retain_handling << 4)
                )
            body += _string(s.topic_filter) + bytes((options,))
        return _fixed((SUBSCRIBE << 4) | 2, body)
    if isinstance(packet, SubAck):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += encode_properties(packet.properties)
        return _fixed(SUBACK << 4, body + bytes(packet.reason_codes))
    if isinstance(packet, Unsubscribe):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += encode_properties(packet.properties)
        for f in packet.topic_filters:
            body += _string(f)
        return _fixed((UNSUBSCRIBE << 4) | 2, body)
    if isinstance(packet, UnsubAck):
        body = struct.pack(">H", packet.packet_id)
        if v5:
            body += encode_properties(packet.properties) + bytes(packet.reason_codes)
        return _fixed(UNSUBACK << 4, body)
    if isinstance(packet, PingReq):
        return bytes((PINGREQ << 4, 0))
    if isinstance(packet, PingResp):
        return bytes((PINGRESP << 4, 0))
    if isinstance(packet, Disconnect | Auth):
        ptype = DISCONNECT if isinstance(packet, Disconnect) else AUTH
        body = b""
        if v5 and (packet.reason_code or packet.properties or ptype == AUTH):
            body = bytes((packet.reason_code,)) + encode_properties(packet.properties)
        return _fixed(ptype << 4, body)
    raise TypeError(f"not an MQTT packet: {packet!r}")
