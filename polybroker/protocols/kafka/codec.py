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
        ``KafkaCodecError`` (the connection then closes).
Rule 3: the advertised table lists only what the handler implements: ``API_VERSIONS`` (the
        Kafka 2.1-era table, plus DescribeCluster) or ``API_VERSIONS_MODERN`` (flexible versions
        and topic ids); ApiVersions above it gets error 35 and a v0 body.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
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
        self._buf += data
        frames: list[bytes] = []
        buf = self._buf
        pos = 0
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
    try:
        body = cls[version].decode(frame[pos:])
    except Exception as e:
        raise KafkaCodecError(f"malformed {cls.name} v{version}: {e!r}") from None
    return Request(api_key, version, correlation_id, client_id, body, len(frame))


def encode_response(api_key: int, api_version: int, correlation_id: int, body: Any) -> bytes:
    """Frame a response: size, header (v0, or v1 for flexible versions except ApiVersions) and
    ``body`` encoded at ``api_version``."""
    cls = RESPONSES[api_key]
    flexible = cls.flexible_version_q(api_version) and api_key != API_API_VERSIONS
    payload = bytes(body.encode(version=api_version))
    header = struct.pack(">i", correlation_id) + (b"\x00" if flexible else b"")
    return _SIZE.pack(len(header) + len(payload)) + header + payload


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
