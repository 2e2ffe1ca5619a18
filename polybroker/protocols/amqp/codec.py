"""Sans-IO AMQP 0-9-1 codec: bytes in, typed frames out, and back. Never imports Twisted.

Rule 1: a connection starts with the 8-byte protocol header ``AMQP\\x00\\x00\\x09\\x01``; after
it every frame is ``type(octet) channel(short) size(long) payload frame-end(0xCE)``.
Rule 2: every read is bounded: a frame larger than the negotiated frame-max, a missing frame-end
octet, a truncated argument or an unknown method raises ``AmqpError`` carrying the reply code the
spec prescribes (501 frame-error, 502 syntax-error, 503 command-invalid, 540 not-implemented).
Rule 3: methods are dataclasses whose field types (``Annotated`` tags) drive both encoding and
decoding; consecutive bits pack into one octet, least significant bit first.

Field tables accept the value types RabbitMQ and pika use (``t b B s u I i l f d D S x A T F V``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Annotated, Any, ClassVar, get_type_hints

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_MIN_SIZE = 4096
#: type + channel + size, and the frame-end octet.
FRAME_OVERHEAD = 8
#: Deepest nesting of tables and arrays a decoder follows.
MAX_TABLE_DEPTH = 32

# Reply codes (amqp0-9-1.xml "constant" elements).
REPLY_SUCCESS = 200
CONTENT_TOO_LARGE = 311
NO_ROUTE = 312
NO_CONSUMERS = 313
CONNECTION_FORCED = 320
INVALID_PATH = 402
ACCESS_REFUSED = 403
NOT_FOUND = 404
RESOURCE_LOCKED = 405
PRECONDITION_FAILED = 406
FRAME_ERROR = 501
SYNTAX_ERROR = 502
COMMAND_INVALID = 503
CHANNEL_ERROR = 504
UNEXPECTED_FRAME = 505
RESOURCE_ERROR = 506
NOT_ALLOWED = 530
NOT_IMPLEMENTED = 540
INTERNAL_ERROR = 541

#: Reply codes that close the whole connection rather than one channel.
CONNECTION_CODES = frozenset(
    {
        CONNECTION_FORCED,
        INVALID_PATH,
        FRAME_ERROR,
        SYNTAX_ERROR,
        COMMAND_INVALID,
        CHANNEL_ERROR,
        UNEXPECTED_FRAME,
        RESOURCE_ERROR,
        NOT_ALLOWED,
        NOT_IMPLEMENTED,
        INTERNAL_ERROR,
    }
)


class AmqpError(Exception):
    """A protocol error: ``code`` is the spec's reply code, ``text`` its reply text, and
    ``class_id``/``method_id`` the method that caused it (0 when none)."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(f"{code} {text}")
        self.code = code
        self.text = text
        self.class_id = class_id
        self.method_id = method_id

    @property
    def hard(self) -> bool:
        """Whether the error closes the connection (a hard error) instead of the channel."""
        return self.code in CONNECTION_CODES


# -- primitive types ---------------------------------------------------------------------------

Octet = Annotated[int, "octet"]
Short = Annotated[int, "short"]
Long = Annotated[int, "long"]
LongLong = Annotated[int, "longlong"]
ShortStr = Annotated[str, "shortstr"]
LongStr = Annotated[bytes, "longstr"]
Bit = Annotated[bool, "bit"]
Table = Annotated[dict[str, Any], "table"]

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_FRAME_HEAD = struct.Struct(">BHI")
#: A content header's class id, weight and body size.
_CONTENT_HEAD = struct.Struct(">HHQ")


class _Reader:
    """Bounded reads over one frame payload; running past the end is a syntax error."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | memoryview, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise AmqpError(SYNTAX_ERROR, "truncated frame payload")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, s: struct.Struct) -> Any:
        if self.pos + s.size > self.end:
            raise AmqpError(SYNTAX_ERROR, "truncated frame payload")
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def octet(self) -> int:
        return int(self.unpack(_U8))

    def short(self) -> int:
        return int(self.unpack(_U16))

    def long(self) -> int:
        return int(self.unpack(_U32))

    def longlong(self) -> int:
        return int(self.unpack(_U64))

    def shortstr(self) -> str:
        raw = self.take(self.octet())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise AmqpError(SYNTAX_ERROR, "short string is not UTF-8") from None

    def longstr(self) -> bytes:
        return self.take(self.long())

    def table(self, depth: int = 0) -> dict[str, Any]:
        size = self.long()
        if self.pos + size > self.end:
            raise AmqpError(SYNTAX_ERROR, "field table overruns its frame")
        sub = _Reader(self.buf, self.pos, self.pos + size)
        self.pos += size
        out: dict[str, Any] = {}
        while sub.pos < sub.end:
            name = sub.shortstr()
            out[name] = sub.value(depth + 1)
        return out

    def array(self, depth: int) -> list[Any]:
        size = self.long()
        if self.pos + size > self.end:
            raise AmqpError(SYNTAX_ERROR, "field array overruns its frame")
        sub = _Reader(self.buf, self.pos, self.pos + size)
        self.pos += size
        out: list[Any] = []
        while sub.pos < sub.end:
            out.append(sub.value(depth + 1))
        return out

    def value(self, depth: int) -> Any:
        if depth > MAX_TABLE_DEPTH:
            raise AmqpError(SYNTAX_ERROR, "field table nested too deeply")
        kind = self.take(1)
        if kind == b"S":
            raw = self.longstr()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw
        if kind == b"t":
            return self.octet() != 0
        if kind == b"I":
            return struct.unpack(">i", self.take(4))[0]
        if kind == b"l":
            return struct.unpack(">q", self.take(8))[0]
        if kind == b"F":
            return self.table(depth)
        if kind == b"A":
            return self.array(depth)
        if kind == b"x":
            return self.longstr()
        if kind == b"b":
            return struct.unpack(">b", self.take(1))[0]
        if kind == b"B":
            return self.octet()
        if kind == b"s":
            return struct.unpack(">h", self.take(2))[0]
        if kind == b"u":
            return self.short()
        if kind == b"i":
            return self.long()
        if kind == b"L":
            return self.longlong()
        if kind == b"f":
            return struct.unpack(">f", self.take(4))[0]
        if kind == b"d":
            return struct.unpack(">d", self.take(8))[0]
        if kind == b"D":
            scale = self.octet()
            raw = struct.unpack(">i", self.take(4))[0]
            return Decimal(raw).scaleb(-scale)
        if kind == b"T":
            return _Timestamp(self.longlong())
        if kind == b"V":
            return None
        raise AmqpError(SYNTAX_ERROR, f"unknown field value type {kind!r}")


class _Timestamp(int):
    """A field-table timestamp (seconds since the epoch), re-encoded with type ``T``."""


def _shortstr(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    if len(raw) > 255:
        raise ValueError("short string longer than 255 bytes")
    return _U8.pack(len(raw)) + raw


def _longstr(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return _U32.pack(len(raw)) + raw


def encode_value(value: Any) -> bytes:
    """One tagged field value."""
    if isinstance(value, bool):
        return b"t" + _U8.pack(1 if value else 0)
    if isinstance(value, _Timestamp):
        return b"T" + _U64.pack(int(value))
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return b"I" + struct.pack(">i", value)
        return b"l" + struct.pack(">q", value)
    if isinstance(value, str):
        return b"S" + _longstr(value)
    if isinstance(value, bytes):
        return b"x" + _longstr(value)
    if isinstance(value, float):
        return b"d" + struct.pack(">d", value)
    if isinstance(value, Decimal):
        exponent = value.as_tuple().exponent
        scale = -int(exponent) if isinstance(exponent, int) and exponent < 0 else 0
        unscaled = int(value.scaleb(scale))
        return b"D" + _U8.pack(scale) + struct.pack(">i", unscaled)
    if isinstance(value, dict):
        return b"F" + encode_table(value)
    if isinstance(value, list | tuple):
        body = b"".join(encode_value(v) for v in value)
        return b"A" + _U32.pack(len(body)) + body
    if value is None:
        return b"V"
    raise ValueError(f"cannot encode {type(value).__name__} in a field table")


def encode_table(table: dict[str, Any] | None) -> bytes:
    """A field table with its long size prefix."""
    if not table:
        return b"\x00\x00\x00\x00"
    body = b"".join(_shortstr(k) + encode_value(v) for k, v in table.items())
    return _U32.pack(len(body)) + body


def decode_table(data: bytes) -> dict[str, Any]:
    """A field table with its size prefix (for stored headers)."""
    return _Reader(data).table()


# -- methods -----------------------------------------------------------------------------------

_METHODS: dict[tuple[int, int], type[Method]] = {}
_SPECS: dict[type[Method], list[tuple[str, str]]] = {}


@dataclass
class Method:
    """An AMQP method; subclasses set ``CLASS_ID``/``METHOD_ID`` and typed fields."""

    CLASS_ID: ClassVar[int] = 0
    METHOD_ID: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    #: Whether a content header and body follow this method.
    HAS_CONTENT: ClassVar[bool] = False

    def encode(self) -> bytes:
        """The method frame payload: class id, method id, arguments."""
        out = [_U16.pack(self.CLASS_ID), _U16.pack(self.METHOD_ID)]
        bits: list[bool] = []

        def flush() -> None:
            if bits:
                n = 0
                for i, b in enumerate(bits):
                    if b:
                        n |= 1 << i
                out.append(_U8.pack(n))
                bits.clear()

        for name, kind in _SPECS[type(self)]:
            value = getattr(self, name)
            if kind == "bit":
                if len(bits) == 8:
                    flush()
                bits.append(bool(value))
                continue
            flush()
            if kind == "octet":
                out.append(_U8.pack(value))
            elif kind == "short":
                out.append(_U16.pack(value))
            elif kind == "long":
                out.append(_U32.pack(value))
            elif kind == "longlong":
                out.append(_U64.pack(value))
            elif kind == "shortstr":
                out.append(_shortstr(value))
            elif kind == "longstr":
                out.append(_longstr(value))
            else:
                out.append(encode_table(value))
        flush()
        return b"".join(out)


def _register(cls: type[Method]) -> type[Method]:
    hints = get_type_hints(cls, include_extras=True)
    spec: list[tuple[str, str]] = []
    for f in fields(cls):
        meta = getattr(hints[f.name], "__metadata__", None)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} lacks an AMQP type")
        spec.append((f.name, meta[0]))
    _SPECS[cls] = spec
    _METHODS[(cls.CLASS_ID, cls.METHOD_ID)] = cls
    return cls


def _fast_publish(payload: bytes) -> BasicPublish | None:
    """basic.publish, the hottest inbound method, without the generic walk (None: let the
    generic decoder judge a payload this cannot take)."""
    end = len(payload)
    pos = 6
    if pos >= end:
        return None
    n = payload[pos]
    exchange_end = pos + 1 + n
    if exchange_end >= end:
        return None
    n = payload[exchange_end]
    key_end = exchange_end + 1 + n
    if key_end + 1 != end:
        return None
    try:
        exchange = payload[pos + 1 : exchange_end].decode("utf-8")
        key = payload[exchange_end + 1 : key_end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    bits = payload[key_end]
    return BasicPublish(
        int.from_bytes(payload[4:6], "big"), exchange, key, bool(bits & 1), bool(bits & 2)
    )


def decode_method(payload: bytes | memoryview) -> Method:
    """A method frame payload as its method object."""
    if isinstance(payload, bytes):
        head = payload[:4]
        if head == b"\x00\x3c\x00\x28":
            fast = _fast_publish(payload)
            if fast is not None:
                return fast
        elif head == b"\x00\x3c\x00\x50" and len(payload) == 13:
            # basic.ack, what every consumer sends per message or batch
            return BasicAck(_U64.unpack_from(payload, 4)[0], bool(payload[12] & 1))
    r = _Reader(payload)
    class_id = r.short()
    method_id = r.short()
    cls = _METHODS.get((class_id, method_id))
    if cls is None:
        raise AmqpError(COMMAND_INVALID, f"unknown method {class_id}.{method_id}")
    values: dict[str, Any] = {}
    bit_byte = 0
    bit_index = 8
    try:
        for name, kind in _SPECS[cls]:
            if kind == "bit":
                if bit_index == 8:
                    bit_byte = r.octet()
                    bit_index = 0
                values[name] = bool(bit_byte & (1 << bit_index))
                bit_index += 1
                continue
            bit_index = 8
            if kind == "octet":
                values[name] = r.octet()
            elif kind == "short":
                values[name] = r.short()
            elif kind == "long":
                values[name] = r.long()
            elif kind == "longlong":
                values[name] = r.longlong()
            elif kind == "shortstr":
                values[name] = r.shortstr()
            elif kind == "longstr":
                values[name] = r.longstr()
            else:
                values[name] = r.table()
    except AmqpError as e:
        raise AmqpError(e.code, e.text, class_id, method_id) from None
    return cls(**values)


def _m(class_id: int, method_id: int, name: str, content: bool = False) -> Any:
    def wrap(cls: type[Method]) -> type[Method]:
        cls.CLASS_ID = class_id
        cls.METHOD_ID = method_id
        cls.NAME = name
        cls.HAS_CONTENT = content
        return _register(dataclass(cls))

    return wrap


# connection (10)
@_m(10, 10, "connection.start")
class ConnectionStart(Method):
    version_major: Octet = 0
    version_minor: Octet = 9
    server_properties: Table = field(default_factory=dict)
    mechanisms: LongStr = b"PLAIN"
    locales: LongStr = b"en_US"


@_m(10, 11, "connection.start-ok")
class ConnectionStartOk(Method):
    client_properties: Table = field(default_factory=dict)
    mechanism: ShortStr = "PLAIN"
    response: LongStr = b""
    locale: ShortStr = "en_US"


@_m(10, 20, "connection.secure")
class ConnectionSecure(Method):
    challenge: LongStr = b""


@_m(10, 21, "connection.secure-ok")
class ConnectionSecureOk(Method):
    response: LongStr = b""


@_m(10, 30, "connection.tune")
class ConnectionTune(Method):
    channel_max: Short = 0
    frame_max: Long = 0
    heartbeat: Short = 0


@_m(10, 31, "connection.tune-ok")
class ConnectionTuneOk(Method):
    channel_max: Short = 0
    frame_max: Long = 0
    heartbeat: Short = 0


@_m(10, 40, "connection.open")
class ConnectionOpen(Method):
    virtual_host: ShortStr = "/"
    capabilities: ShortStr = ""
    insist: Bit = False


@_m(10, 41, "connection.open-ok")
class ConnectionOpenOk(Method):
    known_hosts: ShortStr = ""


@_m(10, 50, "connection.close")
class ConnectionClose(Method):
    reply_code: Short = 200
    reply_text: ShortStr = ""
    class_id: Short = 0
    method_id: Short = 0


@_m(10, 51, "connection.close-ok")
class ConnectionCloseOk(Method):
    pass


@_m(10, 60, "connection.blocked")
class ConnectionBlocked(Method):
    reason: ShortStr = ""


@_m(10, 61, "connection.unblocked")
class ConnectionUnblocked(Method):
    pass


@_m(10, 70, "connection.update-secret")
class ConnectionUpdateSecret(Method):
    new_secret: LongStr = b""
    reason: ShortStr = ""


@_m(10, 71, "connection.update-secret-ok")
class ConnectionUpdateSecretOk(Method):
    pass


# channel (20)
@_m(20, 10, "channel.open")
class ChannelOpen(Method):
    out_of_band: ShortStr = ""


@_m(20, 11, "channel.open-ok")
class ChannelOpenOk(Method):
    channel_id: LongStr = b""


@_m(20, 20, "channel.flow")
class ChannelFlow(Method):
    active: Bit = True


@_m(20, 21, "channel.flow-ok")
class ChannelFlowOk(Method):
    active: Bit = True


@_m(20, 40, "channel.close")
class ChannelClose(Method):
    reply_code: Short = 200
    reply_text: ShortStr = ""
    class_id: Short = 0
    method_id: Short = 0


@_m(20, 41, "channel.close-ok")
class ChannelCloseOk(Method):
    pass


# exchange (40)
@_m(40, 10, "exchange.declare")
class ExchangeDeclare(Method):
    ticket: Short = 0
    exchange: ShortStr = ""
    type: ShortStr = "direct"
    passive: Bit = False
    durable: Bit = False
    auto_delete: Bit = False
    internal: Bit = False
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(40, 11, "exchange.declare-ok")
class ExchangeDeclareOk(Method):
    pass


@_m(40, 20, "exchange.delete")
class ExchangeDelete(Method):
    ticket: Short = 0
    exchange: ShortStr = ""
    if_unused: Bit = False
    nowait: Bit = False


@_m(40, 21, "exchange.delete-ok")
class ExchangeDeleteOk(Method):
    pass


@_m(40, 30, "exchange.bind")
class ExchangeBind(Method):
    ticket: Short = 0
    destination: ShortStr = ""
    source: ShortStr = ""
    routing_key: ShortStr = ""
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(40, 31, "exchange.bind-ok")
class ExchangeBindOk(Method):
    pass


@_m(40, 40, "exchange.unbind")
class ExchangeUnbind(Method):
    ticket: Short = 0
    destination: ShortStr = ""
    source: ShortStr = ""
    routing_key: ShortStr = ""
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(40, 51, "exchange.unbind-ok")
class ExchangeUnbindOk(Method):
    pass


# queue (50)
@_m(50, 10, "queue.declare")
class QueueDeclare(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    passive: Bit = False
    durable: Bit = False
    exclusive: Bit = False
    auto_delete: Bit = False
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(50, 11, "queue.declare-ok")
class QueueDeclareOk(Method):
    queue: ShortStr = ""
    message_count: Long = 0
    consumer_count: Long = 0


@_m(50, 20, "queue.bind")
class QueueBind(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    exchange: ShortStr = ""
    routing_key: ShortStr = ""
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(50, 21, "queue.bind-ok")
class QueueBindOk(Method):
    pass


@_m(50, 30, "queue.purge")
class QueuePurge(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    nowait: Bit = False


@_m(50, 31, "queue.purge-ok")
class QueuePurgeOk(Method):
    message_count: Long = 0


@_m(50, 40, "queue.delete")
class QueueDelete(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    if_unused: Bit = False
    if_empty: Bit = False
    nowait: Bit = False


@_m(50, 41, "queue.delete-ok")
class QueueDeleteOk(Method):
    message_count: Long = 0


@_m(50, 50, "queue.unbind")
class QueueUnbind(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    exchange: ShortStr = ""
    routing_key: ShortStr = ""
    arguments: Table = field(default_factory=dict)


@_m(50, 51, "queue.unbind-ok")
class QueueUnbindOk(Method):
    pass


# basic (60)
@_m(60, 10, "basic.qos")
class BasicQos(Method):
    prefetch_size: Long = 0
    prefetch_count: Short = 0
    global_: Bit = False


@_m(60, 11, "basic.qos-ok")
class BasicQosOk(Method):
    pass


@_m(60, 20, "basic.consume")
class BasicConsume(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    consumer_tag: ShortStr = ""
    no_local: Bit = False
    no_ack: Bit = False
    exclusive: Bit = False
    nowait: Bit = False
    arguments: Table = field(default_factory=dict)


@_m(60, 21, "basic.consume-ok")
class BasicConsumeOk(Method):
    consumer_tag: ShortStr = ""


@_m(60, 30, "basic.cancel")
class BasicCancel(Method):
    consumer_tag: ShortStr = ""
    nowait: Bit = False


@_m(60, 31, "basic.cancel-ok")
class BasicCancelOk(Method):
    consumer_tag: ShortStr = ""


@_m(60, 40, "basic.publish", content=True)
class BasicPublish(Method):
    ticket: Short = 0
    exchange: ShortStr = ""
    routing_key: ShortStr = ""
    mandatory: Bit = False
    immediate: Bit = False


@_m(60, 50, "basic.return", content=True)
class BasicReturn(Method):
    reply_code: Short = 0
    reply_text: ShortStr = ""
    exchange: ShortStr = ""
    routing_key: ShortStr = ""


@_m(60, 60, "basic.deliver", content=True)
class BasicDeliver(Method):
    consumer_tag: ShortStr = ""
    delivery_tag: LongLong = 0
    redelivered: Bit = False
    exchange: ShortStr = ""
    routing_key: ShortStr = ""


@_m(60, 70, "basic.get")
class BasicGet(Method):
    ticket: Short = 0
    queue: ShortStr = ""
    no_ack: Bit = False


@_m(60, 71, "basic.get-ok", content=True)
class BasicGetOk(Method):
    delivery_tag: LongLong = 0
    redelivered: Bit = False
    exchange: ShortStr = ""
    routing_key: ShortStr = ""
    message_count: Long = 0


@_m(60, 72, "basic.get-empty")
class BasicGetEmpty(Method):
    cluster_id: ShortStr = ""


@_m(60, 80, "basic.ack")
class BasicAck(Method):
    delivery_tag: LongLong = 0
    multiple: Bit = False


@_m(60, 90, "basic.reject")
class BasicReject(Method):
    delivery_tag: LongLong = 0
    requeue: Bit = True


@_m(60, 100, "basic.recover-async")
class BasicRecoverAsync(Method):
    requeue: Bit = False


@_m(60, 110, "basic.recover")
class BasicRecover(Method):
    requeue: Bit = False


@_m(60, 111, "basic.recover-ok")
class BasicRecoverOk(Method):
    pass


@_m(60, 120, "basic.nack")
class BasicNack(Method):
    delivery_tag: LongLong = 0
    multiple: Bit = False
    requeue: Bit = True


# confirm (85)
@_m(85, 10, "confirm.select")
class ConfirmSelect(Method):
    nowait: Bit = False


@_m(85, 11, "confirm.select-ok")
class ConfirmSelectOk(Method):
    pass


# tx (90)
@_m(90, 10, "tx.select")
class TxSelect(Method):
    pass


@_m(90, 11, "tx.select-ok")
class TxSelectOk(Method):
    pass


@_m(90, 20, "tx.commit")
class TxCommit(Method):
    pass


@_m(90, 21, "tx.commit-ok")
class TxCommitOk(Method):
    pass


@_m(90, 30, "tx.rollback")
class TxRollback(Method):
    pass


@_m(90, 31, "tx.rollback-ok")
class TxRollbackOk(Method):
    pass


# -- content header ----------------------------------------------------------------------------

#: Basic content properties in wire order (flag bit 15 is the first).
_PROPERTIES: tuple[tuple[str, str], ...] = (
    ("content_type", "shortstr"),
    ("content_encoding", "shortstr"),
    ("headers", "table"),
    ("delivery_mode", "octet"),
    ("priority", "octet"),
    ("correlation_id", "shortstr"),
    ("reply_to", "shortstr"),
    ("expiration", "shortstr"),
    ("message_id", "shortstr"),
    ("timestamp", "longlong"),
    ("type", "shortstr"),
    ("user_id", "shortstr"),
    ("app_id", "shortstr"),
    ("cluster_id", "shortstr"),
)
PROPERTY_NAMES = tuple(name for name, _ in _PROPERTIES)


@dataclass
class BasicProperties:
    """Basic class content properties; None means absent."""

    content_type: str | None = None
    content_encoding: str | None = None
    headers: dict[str, Any] | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: int | None = None
    type: str | None = None
    user_id: str | None = None
    app_id: str | None = None
    cluster_id: str | None = None

    def encode(self) -> bytes:
        """Property flags followed by the present properties."""
        flags = 0
        out: list[bytes] = []
        for i, (name, kind) in enumerate(_PROPERTIES):
            value = getattr(self, name)
            if value is None:
                continue
            flags |= 1 << (15 - i)
            if kind == "shortstr":
                out.append(_shortstr(value))
            elif kind == "octet":
                out.append(_U8.pack(value))
            elif kind == "longlong":
                out.append(_U64.pack(value))
            else:
                out.append(encode_table(value))
        return _U16.pack(flags) + b"".join(out)

    @classmethod
    def decode(cls, r: _Reader) -> BasicProperties:
        flags = r.short()
        if flags & 1:
            # Continuation flags name properties beyond the fourteen basic ones: none exist.
            raise AmqpError(SYNTAX_ERROR, "unknown content property flags")
        props = cls()
        for i, (name, kind) in enumerate(_PROPERTIES):
            if not flags & (1 << (15 - i)):
                continue
            if kind == "shortstr":
                setattr(props, name, r.shortstr())
            elif kind == "octet":
                setattr(props, name, r.octet())
            elif kind == "longlong":
                setattr(props, name, r.longlong())
            else:
                setattr(props, name, r.table())
        if flags & 0b11:
            raise AmqpError(SYNTAX_ERROR, "unknown content property flags")
        return props


# -- frames ------------------------------------------------------------------------------------


@dataclass
class MethodFrame:
    channel: int
    method: Method


@dataclass
class HeaderFrame:
    channel: int
    class_id: int
    body_size: int
    properties: BasicProperties
    #: The property flags and list as received (re-sent as is on delivery).
    raw_properties: bytes = field(default=b"", compare=False)


@dataclass
class BodyFrame:
    channel: int
    data: bytes


@dataclass(slots=True)
class PublishFrame:
    """basic.publish, its content header and its whole body, read together: what
    ``FrameReader`` yields for a publish whose three frames (two when the body is empty) are
    all buffered, well formed and on one channel, in place of the three frame objects.

    ``properties`` may be shared with other publishes whose properties were the same bytes
    (those without headers): it is never changed in place."""

    channel: int
    method: BasicPublish
    body_size: int
    properties: BasicProperties
    raw_properties: bytes
    body: bytes

    def parts(self) -> list[MethodFrame | HeaderFrame | BodyFrame]:
        """The frames it stands for."""
        out: list[MethodFrame | HeaderFrame | BodyFrame] = [
            MethodFrame(self.channel, self.method),
            HeaderFrame(self.channel, 60, self.body_size, self.properties, self.raw_properties),
        ]
        if self.body_size:
            out.append(BodyFrame(self.channel, self.body))
        return out


@dataclass
class HeartbeatFrame:
    channel: int = 0


@dataclass
class ProtocolHeaderFrame:
    """The client's protocol header (always 0-9-1 when yielded)."""


Frame = MethodFrame | HeaderFrame | BodyFrame | PublishFrame | HeartbeatFrame | ProtocolHeaderFrame

#: Decoded content properties without headers, by their wire form (``PublishFrame``): a
#: publisher sends the same few sets again and again.
_SEEN_PROPERTIES: dict[bytes, BasicProperties] = {}
_SEEN_PROPERTIES_MAX = 1024
_HEADERS_FLAG = 1 << 13
_PUBLISH_HEAD = b"\x00\x3c\x00\x28"


class BadProtocolHeader(AmqpError):
    """The client did not open with the 0-9-1 header: answer with ours and close."""

    def __init__(self) -> None:
        super().__init__(FRAME_ERROR, "bad protocol header")


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HEAD.pack(kind, channel, len(payload)) + payload + b"\xce"


def encode_method(channel: int, method: Method) -> bytes:
    """One method frame."""
    if type(method) is BasicAck:
        # A publisher confirm (or a consumer's ack), packed directly.
        return (
            _FRAME_HEAD.pack(FRAME_METHOD, channel, 13)
            + b"\x00\x3c\x00\x50"
            + _U64.pack(method.delivery_tag)
            + (b"\x01\xce" if method.multiple else b"\x00\xce")
        )
    return _frame(FRAME_METHOD, channel, method.encode())


def encode_heartbeat() -> bytes:
    return _frame(FRAME_HEARTBEAT, 0, b"")


def encode_content(
    channel: int, method: Method, properties: BasicProperties | bytes, body: bytes, frame_max: int
) -> bytes:
    """A content-bearing method, its header and its body split to fit ``frame_max``.

    ``properties`` may be pre-encoded (flags and property list) to skip re-encoding."""
    props = properties if isinstance(properties, bytes) else properties.encode()
    header = _U16.pack(60) + b"\x00\x00" + _U64.pack(len(body)) + props
    if type(method) is BasicDeliver:
        # The hottest outbound method, packed directly.
        m = method
        payload = b"".join(
            (
                b"\x00\x3c\x00\x3c",
                _shortstr(m.consumer_tag),
                _U64.pack(m.delivery_tag),
                b"\x01" if m.redelivered else b"\x00",
                _shortstr(m.exchange),
                _shortstr(m.routing_key),
            )
        )
        first = _frame(FRAME_METHOD, channel, payload)
    else:
        first = encode_method(channel, method)
    parts = [first, _frame(FRAME_HEADER, channel, header)]
    chunk = max(1, frame_max - FRAME_OVERHEAD) if frame_max else len(body) or 1
    for start in range(0, len(body), chunk):
        parts.append(_frame(FRAME_BODY, channel, body[start : start + chunk]))
    return b"".join(parts)


class FrameReader:
    """Turns received bytes into frames: ``feed(data)`` then iterate ``frames()``.

    Until the protocol header arrives only it is accepted. ``frame_max`` bounds every frame
    (payload plus the 8 bytes of framing); raise it after tune-ok."""

    def __init__(self, frame_max: int = FRAME_MIN_SIZE, expect_header: bool = True) -> None:
        self.frame_max = frame_max
        self._buf = bytearray()
        self._need_header = expect_header

    def feed(self, data: bytes) -> None:
        self._buf += data

    def take_rest(self) -> bytes:
        """The bytes buffered and not yet returned as frames (a partial frame), removed:
        whoever stops reading frames here passes them on as they are."""
        rest = bytes(self._buf)
        self._buf.clear()
        return rest

    def frames(self, limit: int = 0) -> list[Frame]:
        """Every complete frame buffered so far (at most ``limit`` of them when it is not 0;
        the rest stays buffered); raise ``AmqpError`` on the first bad one."""
        out: list[Frame] = []
        buf = self._buf
        pos = 0
        try:
            if self._need_header:
                if len(buf) < 8:
                    if PROTOCOL_HEADER[: len(buf)] != bytes(buf):
                        raise BadProtocolHeader()
                    return out
                if bytes(buf[:8]) != PROTOCOL_HEADER:
                    raise BadProtocolHeader()
                self._need_header = False
                pos = 8
                out.append(ProtocolHeaderFrame())
            while len(buf) - pos >= 7 and (not limit or len(out) < limit):
                kind, channel, size = _FRAME_HEAD.unpack_from(buf, pos)
                if size + FRAME_OVERHEAD > self.frame_max:
                    raise AmqpError(FRAME_ERROR, f"frame of {size} bytes exceeds frame-max")
                end = pos + 7 + size
                if len(buf) < end + 1:
                    break
                if buf[end] != FRAME_END:
                    raise AmqpError(FRAME_ERROR, "frame-end octet missing")
                if kind == FRAME_METHOD and not limit and buf[pos + 7 : pos + 11] == _PUBLISH_HEAD:
                    fused = self._publish(buf, channel, bytes(buf[pos + 7 : end]), end + 1)
                    if fused is not None:
                        out.append(fused[0])
                        pos = fused[1]
                        continue
                out.append(self._decode(kind, channel, bytes(buf[pos + 7 : end])))
                pos = end + 1
        finally:
            del buf[:pos]
        return out

    def _publish(
        self, buf: bytearray, channel: int, payload: bytes, at: int
    ) -> tuple[PublishFrame, int] | None:
        """The publish whose method ``payload`` ends before ``at``, with its content header and
        body frames from ``at`` on, and where the next frame starts; None unless all of them
        are buffered and well formed (the frames are then read one by one, which reports
        whatever is wrong where it is)."""
        method = _fast_publish(payload)
        if method is None or len(buf) - at < 7:
            return None
        kind, ch, size = _FRAME_HEAD.unpack_from(buf, at)
        if kind != FRAME_HEADER or ch != channel or size < 14:
            return None
        end = at + 7 + size
        if size + FRAME_OVERHEAD > self.frame_max or len(buf) < end + 1 or buf[end] != FRAME_END:
            return None
        class_id, _weight, body_size = _CONTENT_HEAD.unpack_from(buf, at + 7)
        if class_id != 60:
            return None
        raw = bytes(buf[at + 19 : end])
        props = _SEEN_PROPERTIES.get(raw)
        if props is None:
            r = _Reader(raw)
            try:
                props = BasicProperties.decode(r)
            except AmqpError:
                return None
            if r.pos != r.end:
                return None
            if not raw[0] << 8 & _HEADERS_FLAG:
                if len(_SEEN_PROPERTIES) >= _SEEN_PROPERTIES_MAX:
                    _SEEN_PROPERTIES.clear()
                _SEEN_PROPERTIES[raw] = props
        at = end + 1
        if not body_size:
            return PublishFrame(channel, method, 0, props, raw, b""), at
        if len(buf) - at < 7:
            return None
        kind, ch, size = _FRAME_HEAD.unpack_from(buf, at)
        end = at + 7 + size
        if (
            kind != FRAME_BODY
            or ch != channel
            or size != body_size
            or size + FRAME_OVERHEAD > self.frame_max
            or len(buf) < end + 1
            or buf[end] != FRAME_END
        ):
            return None
        body = bytes(buf[at + 7 : end])
        return PublishFrame(channel, method, body_size, props, raw, body), end + 1

    @staticmethod
    def _decode(kind: int, channel: int, payload: bytes) -> Frame:
        if kind == FRAME_METHOD:
            return MethodFrame(channel, decode_method(payload))
        if kind == FRAME_HEADER:
            r = _Reader(payload)
            class_id = r.short()
            r.short()  # weight, unused
            size = r.longlong()
            props = BasicProperties.decode(r)
            if r.pos != r.end:
                raise AmqpError(FRAME_ERROR, "content header has trailing bytes")
            return HeaderFrame(channel, class_id, size, props, payload[12:])
        if kind == FRAME_BODY:
            return BodyFrame(channel, payload)
        if kind == FRAME_HEARTBEAT:
            if channel != 0:
                raise AmqpError(COMMAND_INVALID, "heartbeat on a channel other than 0")
            return HeartbeatFrame(channel)
        raise AmqpError(FRAME_ERROR, f"unknown frame type {kind}")
