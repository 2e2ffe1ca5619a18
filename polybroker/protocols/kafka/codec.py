"""Kafka wire framing and request/response encoding (sans-IO: bytes in, typed frames out).

A Kafka frame is ``size (i32) | header | body``. Requests carry header v1
(``api_key i16, api_version i16, correlation_id i32, client_id nullable string``) or, for
flexible versions, header v2 (v1 plus tagged fields); responses carry header v0
(``correlation_id``) or v1 (plus tagged fields). ApiVersions responses always use header v0.

Bodies are encoded and decoded with the classes that kafka-python declares from Kafka's own JSON
message schemas (``kafka.protocol``), so every version of every API we serve, flexible or not,
follows the schema rather than hand-written packing.

Rule 1: ``FrameDecoder`` refuses a frame larger than its limit before buffering it.
Rule 2: ``parse_request`` never reads past the frame it is given; anything malformed raises
        ``KafkaCodecError`` (the connection then closes). That includes a null where the schema
        does not allow one (an array, string, bytes or struct outside its ``nullableVersions``):
        the schema classes decode it as None, which the handler never has to expect; Kafka
        refuses such a request as malformed too.
Rule 3: the advertised table lists only what the handler implements: ``API_VERSIONS`` (the
        Kafka 2.1-era table, plus DescribeCluster) or ``API_VERSIONS_MODERN`` (flexible versions
        and topic ids); ApiVersions above it gets error 35 and a v0 body.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

# kafka-python reads its JSON schemas with importlib.resources calls that Python 3.11 deprecates.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka.protocol.admin
    import kafka.protocol.consumer
    import kafka.protocol.metadata
    import kafka.protocol.producer  # noqa: F401 - imported so every API class registers
    from kafka.protocol.api_message import ApiMessage

# Kafka's error codes used by the handler.
NONE = 0
OFFSET_OUT_OF_RANGE = 1
CORRUPT_MESSAGE = 2
UNKNOWN_TOPIC_OR_PARTITION = 3
LEADER_NOT_AVAILABLE = 5
NOT_LEADER_OR_FOLLOWER = 6
MESSAGE_TOO_LARGE = 10
COORDINATOR_NOT_AVAILABLE = 15
NOT_COORDINATOR = 16
INVALID_TOPIC_EXCEPTION = 17
ILLEGAL_GENERATION = 22
INCONSISTENT_GROUP_PROTOCOL = 23
UNKNOWN_MEMBER_ID = 25
INVALID_SESSION_TIMEOUT = 26
REBALANCE_IN_PROGRESS = 27
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_REQUEST = 42
UNSUPPORTED_VERSION = 35
INVALID_REQUIRED_ACKS = 21
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
DUPLICATE_SEQUENCE_NUMBER = 46
INVALID_PRODUCER_EPOCH = 47
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
NOT_CONTROLLER = 41
UNKNOWN_SERVER_ERROR = -1
GROUP_ID_NOT_FOUND = 69
NON_EMPTY_GROUP = 68
INVALID_GROUP_ID = 24
MEMBER_ID_REQUIRED = 79
UNKNOWN_PRODUCER_ID = 59
UNKNOWN_TOPIC_ID = 100
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
INVALID_RECORD = 87
KAFKA_STORAGE_ERROR = 56  # retriable: the client tries again until its delivery timeout

API_PRODUCE = 0
API_FETCH = 1
API_LIST_OFFSETS = 2
API_METADATA = 3
API_OFFSET_COMMIT = 8
API_OFFSET_FETCH = 9
API_FIND_COORDINATOR = 10
API_JOIN_GROUP = 11
API_HEARTBEAT = 12
API_LEAVE_GROUP = 13
API_SYNC_GROUP = 14
API_DESCRIBE_GROUPS = 15
API_LIST_GROUPS = 16
API_API_VERSIONS = 18
API_CREATE_TOPICS = 19
API_DELETE_TOPICS = 20
API_INIT_PRODUCER_ID = 22
API_DESCRIBE_CONFIGS = 32
API_CREATE_PARTITIONS = 37
API_DELETE_GROUPS = 42
API_DESCRIBE_CLUSTER = 60

#: What the broker advertises: (min, max) per API key. The maxima are Kafka 2.1's, which all of
#: kafka-python 3, librdkafka 2.x and the Java 3.x/4.x clients accept; the minima are the oldest
#: versions whose bodies the handler serves (record batches v2 only). Produce keeps min 0 as Kafka
#: does (older librdkafka turns compression off when it is higher) and refuses v0-2 per request.
API_VERSIONS: dict[int, tuple[int, int]] = {
    API_PRODUCE: (0, 7),
    API_FETCH: (4, 10),
    API_LIST_OFFSETS: (1, 4),
    API_METADATA: (0, 7),
    API_OFFSET_COMMIT: (2, 6),
    API_OFFSET_FETCH: (1, 5),
    API_FIND_COORDINATOR: (0, 2),
    API_JOIN_GROUP: (0, 3),
    API_HEARTBEAT: (0, 2),
    API_LEAVE_GROUP: (0, 2),
    API_SYNC_GROUP: (0, 2),
    API_DESCRIBE_GROUPS: (0, 2),
    API_LIST_GROUPS: (0, 2),
    API_API_VERSIONS: (0, 2),
    API_CREATE_TOPICS: (2, 3),
    API_DELETE_TOPICS: (1, 3),
    API_INIT_PRODUCER_ID: (0, 1),
    API_DESCRIBE_CONFIGS: (1, 2),
    API_CREATE_PARTITIONS: (0, 1),
    API_DELETE_GROUPS: (0, 1),
    API_DESCRIBE_CLUSTER: (0, 2),
}

#: The modern table (``kafkaApiVersions=modern``): flexible versions and topic ids, up to what
#: kafka-python 3, librdkafka 2.16 and the Java 3.9 clients send, minus what the handler does
#: not implement (Produce by topic id, KIP-848 member epochs, transactions).
API_VERSIONS_MODERN: dict[int, tuple[int, int]] = {
    API_PRODUCE: (0, 11),
    API_FETCH: (4, 17),
    API_LIST_OFFSETS: (1, 7),
    API_METADATA: (0, 12),
    API_OFFSET_COMMIT: (2, 9),
    API_OFFSET_FETCH: (1, 9),
    API_FIND_COORDINATOR: (0, 4),
    API_JOIN_GROUP: (0, 9),
    API_HEARTBEAT: (0, 4),
    API_LEAVE_GROUP: (0, 5),
    API_SYNC_GROUP: (0, 5),
    API_DESCRIBE_GROUPS: (0, 5),
    API_LIST_GROUPS: (0, 4),
    API_API_VERSIONS: (0, 4),
    API_CREATE_TOPICS: (2, 7),
    API_DELETE_TOPICS: (1, 6),
    API_INIT_PRODUCER_ID: (0, 4),
    API_DESCRIBE_CONFIGS: (1, 4),
    API_CREATE_PARTITIONS: (0, 3),
    API_DELETE_GROUPS: (0, 2),
    API_DESCRIBE_CLUSTER: (0, 2),
}
TABLES = {"2.1": API_VERSIONS, "modern": API_VERSIONS_MODERN}

_SIZE = struct.Struct(">i")
_HEADER = struct.Struct(">hhih")  # api key, api version, correlation id, client id length


class KafkaCodecError(ValueError):
    """Bytes that are not a well-formed Kafka request; the connection closes."""


class FrameTooLargeError(KafkaCodecError):
    """A frame larger than the limit (or of negative size)."""


def _message_classes() -> tuple[dict[int, type[ApiMessage]], dict[int, type[ApiMessage]]]:
    requests: dict[int, type[ApiMessage]] = {}
    responses: dict[int, type[ApiMessage]] = {}
    todo: list[type] = [ApiMessage]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "_class_version", 0) is not None or getattr(cls, "_json", None) is None:
            continue
        key = cls.API_KEY
        if key in API_VERSIONS_MODERN:
            (requests if cls.is_request() else responses)[key] = cls
    return requests, responses


REQUESTS, RESPONSES = _message_classes()
_missing = set(API_VERSIONS_MODERN) - set(REQUESTS) | set(API_VERSIONS_MODERN) - set(RESPONSES)
if _missing:  # pragma: no cover - a kafka-python without these schemas
    raise ImportError(f"kafka.protocol lacks the schemas of API keys {sorted(_missing)}")


def response_class(api_key: int) -> Any:
    """The response message class of ``api_key`` (build one with ``cls(...)``)."""
    return RESPONSES[api_key]


def request_class(api_key: int) -> Any:
    """The request message class of ``api_key``."""
    return REQUESTS[api_key]


class FrameDecoder:
    """Split a byte stream into frames (without their size prefix), bounded by ``max_frame``."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the complete frames. Raise ``FrameTooLargeError``."""
        frames: list[bytes] = []
        buf = self._buf
        pos = 0
        if not buf:  # nothing pending: frames come straight out of ``data``, copied once
            n = len(data)
            while n - pos >= 4:
                (size,) = _SIZE.unpack_from(data, pos)
                if size < 0 or size > self.max_frame:
                    raise FrameTooLargeError(f"frame of {size} bytes exceeds {self.max_frame}")
                if n - pos - 4 < size:
                    break
                frames.append(data[pos + 4 : pos + 4 + size])
                pos += 4 + size
            if pos < n:
                buf += memoryview(data)[pos:]
            return frames
        buf += data
        while len(buf) - pos >= 4:
            (size,) = _SIZE.unpack_from(buf, pos)
            if size < 0 or size > self.max_frame:
                raise FrameTooLargeError(f"frame of {size} bytes exceeds {self.max_frame}")
            if len(buf) - pos - 4 < size:
                break
            frames.append(bytes(buf[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)


@dataclass
class Request:
    """One decoded request. ``body`` is None when the version is not supported (ApiVersions)."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any
    size: int

    @property
    def supported(self) -> bool:
        return self.body is not None


def _read_uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise KafkaCodecError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise KafkaCodecError("varint too long")


def _skip_tagged_fields(data: bytes, pos: int) -> int:
    count, pos = _read_uvarint(data, pos)
    for _ in range(count):
        _, pos = _read_uvarint(data, pos)
        size, pos = _read_uvarint(data, pos)
        pos += size
        if pos > len(data):
            raise KafkaCodecError("tagged field runs past the frame")
    return pos


def is_supported(
    api_key: int, api_version: int, table: dict[int, tuple[int, int]] = API_VERSIONS
) -> bool:
    """Whether the broker serves ``api_version`` of ``api_key`` (with ``table``)."""
    found = table.get(api_key)
    return found is not None and found[0] <= api_version <= found[1]


def parse_request(frame: bytes, table: dict[int, tuple[int, int]] = API_VERSIONS) -> Request:
    """Decode a request frame (without its size prefix).

    An unknown API key, or an unsupported version of any API other than ApiVersions, raises
    ``KafkaCodecError`` (Kafka closes the connection then); an unsupported ApiVersions version
    gives a ``Request`` whose ``body`` is None, to be answered with error 35."""
    if len(frame) < _HEADER.size:
        raise KafkaCodecError("request header truncated")
    api_key, version, correlation_id, client_len = _HEADER.unpack_from(frame, 0)
    pos = _HEADER.size
    client_id: str | None = None
    if client_len >= 0:
        if pos + client_len > len(frame):
            raise KafkaCodecError("client id runs past the frame")
        try:
            client_id = frame[pos : pos + client_len].decode("utf-8")
        except UnicodeDecodeError:
            raise KafkaCodecError("client id is not UTF-8") from None
        pos += client_len
    elif client_len != -1:
        raise KafkaCodecError("negative client id length")
    if api_key not in table:
        raise KafkaCodecError(f"unknown API key {api_key}")
    if not is_supported(api_key, version, table):
        if api_key == API_API_VERSIONS:
            return Request(api_key, version, correlation_id, client_id, None, len(frame))
        raise KafkaCodecError(f"API key {api_key} version {version} is not supported")
    cls = REQUESTS[api_key]
    if cls.flexible_version_q(version):
        pos = _skip_tagged_fields(frame, pos)
    if api_key == API_PRODUCE and 3 <= version <= 12:
        body = decode_produce_request(frame, pos, version)
        return Request(api_key, version, correlation_id, client_id, body, len(frame))
    try:
        body = cls[version].decode(frame[pos:])
    except Exception as e:
        raise KafkaCodecError(f"malformed {cls.name} v{version}: {e!r}") from None
    plan = _NULL_PLANS.get((api_key, version))
    if plan is None:
        plan = _NULL_PLANS[api_key, version] = _null_plan(cls._struct._fields, version)
    if plan:
        null = _first_null(body, plan, "")
        if null is not None:
            raise KafkaCodecError(f"malformed {cls.name} v{version}: {null} is null")
    return Request(api_key, version, correlation_id, client_id, body, len(frame))


# -- nulls the schema does not allow (Rule 2) ------------------------------------------------

# (attribute, schema name, whether it may not be null, checks inside it, whether it is an array)
_NullCheck = tuple[str, str, bool, tuple[Any, ...], bool]
_NULL_PLANS: dict[tuple[int, int], tuple[_NullCheck, ...]] = {}
_NULLABLE_TYPES = frozenset({"string", "bytes", "records"})  # besides arrays and structs


def _null_plan(fields: Any, version: int) -> tuple[_NullCheck, ...]:
    """The checks that find a forbidden null in a body of ``version`` with these schema fields:
    only fields that may decode as None, and structs holding such fields (tagged fields are
    optional, so never checked)."""
    plan: list[_NullCheck] = []
    for f in fields:
        if not f.for_version_q(version) or f.tagged_field_q(version):
            continue
        composite = f.is_struct_array() or f.is_struct()
        inner = _null_plan(f._fields, version) if composite else ()
        forbidden = (
            f.is_array() or f.is_struct() or f.type_str in _NULLABLE_TYPES
        ) and not f.nullable_for_version_q(version)
        if forbidden or inner:
            plan.append((f.name, f._name, forbidden, inner, f.is_struct_array()))
    return tuple(plan)


def _first_null(obj: Any, plan: tuple[_NullCheck, ...], where: str) -> str | None:
    """The schema path of the first forbidden null in ``obj``, or None."""
    for attr, name, forbidden, inner, many in plan:
        value = getattr(obj, attr, None)
        if value is None:
            if forbidden:
                return where + name
            continue
        if inner:
            for item in value if many else (value,):
                found = _first_null(item, inner, f"{where}{name}.")
                if found is not None:
                    return found
    return None


# -- direct decoding of Produce requests (the hot path) ------------------------------------


@dataclass(slots=True)
class ProducePartitionData:
    """One partition's records in a Produce request (a view into the request frame)."""

    index: int
    records: memoryview | None


@dataclass(slots=True)
class ProduceTopicData:
    name: str
    partition_data: list[ProducePartitionData]


@dataclass(slots=True)
class ProduceRequestBody:
    """A Produce request body (v3-12), with the schema class's field names."""

    transactional_id: str | None
    acks: int
    timeout_ms: int
    topic_data: list[ProduceTopicData]


class _Reader:
    """Bounded reads from one frame; anything past its end raises ``KafkaCodecError``."""

    __slots__ = ("data", "end", "flexible", "pos", "view")

    def __init__(self, data: bytes, pos: int, flexible: bool) -> None:
        self.data = data
        self.view = memoryview(data)
        self.pos = pos
        self.end = len(data)
        self.flexible = flexible

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise KafkaCodecError("field runs past the frame")
        self.pos = start + n
        return start

    def int16(self) -> int:
        return int(_I16.unpack_from(self.data, self.take(2))[0])

    def int32(self) -> int:
        return int(_I32.unpack_from(self.data, self.take(4))[0])

    def length(self) -> int:
        """A string, bytes or array length: -1 for null."""
        if self.flexible:
            n, self.pos = _read_uvarint(self.data, self.pos)
            return n - 1
        return self.int32()

    def string(self) -> str | None:
        if self.flexible:
            n, self.pos = _read_uvarint(self.data, self.pos)
            n -= 1
        else:
            n = self.int16()
        if n < 0:
            return None
        start = self.take(n)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise KafkaCodecError("string is not UTF-8") from None

    def count(self) -> int:
        """The length of an array the schema does not let be null."""
        n = self.length()
        if n < 0:
            raise KafkaCodecError("null array")
        if n > self.end - self.pos:  # every element takes at least one byte
            raise KafkaCodecError(f"array of {n} elements cannot fit the frame")
        return n

    def tags(self) -> None:
        if self.flexible:
            self.pos = _skip_tagged_fields(self.data, self.pos)


def decode_produce_request(frame: bytes, pos: int, version: int) -> ProduceRequestBody:
    """The Produce request body (v3-12) starting at ``pos``: records stay views into
    ``frame``; raise ``KafkaCodecError`` on anything malformed."""
    r = _Reader(frame, pos, version >= 9)
    transactional_id = r.string()
    acks = r.int16()
    timeout_ms = r.int32()
    topics = []
    for _ in range(r.count()):
        name = r.string()
        if name is None:
            raise KafkaCodecError("null topic name")
        partitions = []
        for _ in range(r.count()):
            index = r.int32()
            n = r.length()
            records = None
            if n >= 0:
                start = r.take(n)
                records = r.view[start : start + n]
            r.tags()
            partitions.append(ProducePartitionData(index, records))
        r.tags()
        topics.append(ProduceTopicData(name, partitions))
    r.tags()
    if r.pos != r.end:
        raise KafkaCodecError("bytes left over after the Produce request")
    return ProduceRequestBody(transactional_id, acks, timeout_ms, topics)


def encode_response(api_key: int, api_version: int, correlation_id: int, body: Any) -> bytes:
    """Frame a response: size, header (v0, or v1 for flexible versions except ApiVersions) and
    ``body`` encoded at ``api_version``.

    ``body`` is a schema message, or a ``DirectBody`` (the hot APIs, encoded without walking
    the schema) whose parts are joined once with the frame head."""
    cls = RESPONSES[api_key]
    flexible = cls.flexible_version_q(api_version) and api_key != API_API_VERSIONS
    header = _SIZE.pack(correlation_id) + (b"\x00" if flexible else b"")
    if isinstance(body, DirectBody):
        parts = body.encode_parts(api_version)
        size = len(header) + sum(len(x) for x in parts)
        return b"".join([_SIZE.pack(size), header, *parts])
    payload = bytes(body.encode(version=api_version))
    return _SIZE.pack(len(header) + len(payload)) + header + payload


# -- direct encoding of the hot responses (Produce, Fetch) ---------------------------------
#
# Byte for byte what the schema classes write (tests compare both), for the versions the
# handler serves. Tagged fields are all left at their defaults, so each flexible struct ends
# with an empty tag section (one zero byte).

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_PRODUCE_PART = struct.Struct(">ihq")  # index, error code, base offset
_I64 = struct.Struct(">q")
_FETCH_PART = struct.Struct(">ihqqq")  # index, error, high watermark, last stable, log start
_FETCH_PART_V4 = struct.Struct(">ihqq")
_EMPTY_ARRAY = _I32.pack(0)
_NULL_STRING = _I16.pack(-1)


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string(value: str, flexible: bool) -> bytes:
    raw = value.encode("utf-8")
    if flexible:
        return _uvarint(len(raw) + 1) + raw
    return _I16.pack(len(raw)) + raw


def _array_head(n: int, flexible: bool) -> bytes:
    return _uvarint(n + 1) if flexible else _I32.pack(n)


class DirectBody:
    """A response body that encodes itself into parts (joined by ``encode_response``)."""

    def encode_parts(self, version: int) -> list[bytes | memoryview]:
        raise NotImplementedError

    def encode(self, version: int) -> bytes:
        """The body's bytes at ``version`` (as a schema message's ``encode``)."""
        return b"".join(self.encode_parts(version))


@dataclass(slots=True)
class ProducedPartition:
    """One partition's answer to a Produce."""

    index: int
    error: int
    base_offset: int
    log_start: int


class ProduceResponse(DirectBody):
    """A Produce response (v0-12): per topic name, its partitions' answers."""

    __slots__ = ("topics",)

    def __init__(self, topics: list[tuple[str, list[ProducedPartition]]]) -> None:
        self.topics = topics

    def encode_parts(self, version: int) -> list[bytes | memoryview]:
        if not 0 <= version <= 12:
            raise ValueError(f"Produce response v{version} is not encoded directly")
        flexible = version >= 9
        # Per partition after the base offset: log append time (v2+), log start (v5+),
        # record errors and error message (v8+), tags (v9+).
        tail_v8 = b""
        if version >= 8:
            tail_v8 = b"\x01\x00" if flexible else _EMPTY_ARRAY + _NULL_STRING
        tag = b"\x00" if flexible else b""
        out: list[bytes | memoryview] = [_array_head(len(self.topics), flexible)]
        for name, partitions in self.topics:
            out.append(_string(name, flexible))
            out.append(_array_head(len(partitions), flexible))
            for p in partitions:
                out.append(_PRODUCE_PART.pack(p.index, p.error, p.base_offset))
                if version >= 2:
                    out.append(_I64.pack(-1))
                if version >= 5:
                    out.append(_I64.pack(p.log_start))
                out.append(tail_v8)
                out.append(tag)
            out.append(tag)
        if version >= 1:
            out.append(_I32.pack(0))  # throttle time
        out.append(tag)
        return out


@dataclass(slots=True)
class FetchedPartition:
    """One partition's answer to a Fetch: its record batches as they go on the wire."""

    partition: int
    error: int = NONE
    high_watermark: int = -1
    log_start: int = -1
    records: list[bytes | memoryview] = field(default_factory=list)
    size: int = 0


class FetchResponse(DirectBody):
    """A Fetch response (v4-17) with no session, no aborted transactions and every partition's
    last stable offset at its high watermark; per topic (name, 16-byte id, partitions)."""

    __slots__ = ("topics",)

    def __init__(self, topics: list[tuple[str, bytes, list[FetchedPartition]]]) -> None:
        self.topics = topics

    def encode_parts(self, version: int) -> list[bytes | memoryview]:
        if not 4 <= version <= 17:
            raise ValueError(f"Fetch response v{version} is not encoded directly")
        flexible = version >= 12
        tag = b"\x00" if flexible else b""
        empty = b"\x01" if flexible else _EMPTY_ARRAY  # no aborted transactions
        out: list[bytes | memoryview] = [_I32.pack(0)]  # throttle time
        if version >= 7:
            out.append(b"\x00\x00\x00\x00\x00\x00")  # error code, session id 0
        out.append(_array_head(len(self.topics), flexible))
        for name, topic_id, partitions in self.topics:
            out.append(topic_id if version >= 13 else _string(name, flexible))
            out.append(_array_head(len(partitions), flexible))
            for p in partitions:
                hw = p.high_watermark
                if version >= 5:
                    out.append(_FETCH_PART.pack(p.partition, p.error, hw, hw, p.log_start))
                else:
                    out.append(_FETCH_PART_V4.pack(p.partition, p.error, hw, hw))
                out.append(empty)
                if version >= 11:
                    out.append(_I32.pack(-1))  # preferred read replica
                out.append(_uvarint(p.size + 1) if flexible else _I32.pack(p.size))
                out.extend(p.records)
                out.append(tag)
            out.append(tag)
        out.append(tag)
        return out


def api_versions_body(
    version: int, error_code: int = NONE, table: dict[int, tuple[int, int]] = API_VERSIONS
) -> Any:
    """The ApiVersions response body listing ``table``."""
    cls = RESPONSES[API_API_VERSIONS]
    keys = [
        cls.ApiVersion(api_key=k, min_version=lo, max_version=hi)
        for k, (lo, hi) in sorted(table.items())
    ]
    return cls(version=version, error_code=error_code, api_keys=keys, throttle_time_ms=0)


def encode_unsupported_api_versions(
    correlation_id: int, table: dict[int, tuple[int, int]] = API_VERSIONS
) -> bytes:
    """Error 35 with a v0 body listing our range of ApiVersions, so the client retries lower."""
    cls = RESPONSES[API_API_VERSIONS]
    lo, hi = table[API_API_VERSIONS]
    body = cls(
        version=0,
        error_code=UNSUPPORTED_VERSION,
        api_keys=[cls.ApiVersion(api_key=API_API_VERSIONS, min_version=lo, max_version=hi)],
    )
    return encode_response(API_API_VERSIONS, 0, correlation_id, body)
