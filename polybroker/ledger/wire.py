"""The bookie wire protocol: length-prefixed, versioned, checksummed frames (sans-IO).

Every frame, requests and responses alike (big-endian)::

    [u32 length][u8 version][u8 type][u64 request_id][u32 crc32c(body)][body]

``length`` counts every byte after itself (``14 + len(body)``).

Rule 1: a decoder never buffers more than one frame's header before checking it: a length above
        ``max_frame_size``, a length too short for a header, an unknown version or type and a
        checksum mismatch raise ``FrameError`` (a ``BookieProtocolError``) that carries the
        request id when the header held one, so a server can answer it before closing.
Rule 2: after an error the decoder stays broken (every call raises the same error): a stream with
        one bad frame is not resynchronised, the connection is closed.
Rule 3: frames may arrive split across reads or several per read; each byte received is copied at
        most once more (when a frame straddles two reads).
Rule 4: the ADD request body is ``[u64 ledger][i64 entry][i64 lac][u8 flags][data]``, the data is
        its tail and is handed out as a ``memoryview`` of the received bytes (no copy). The bookie
        journals this body verbatim with the client's checksum, so the bytes a client checksummed
        are the bytes that reach the disk.
Rule 5: responses carry ``[u8 status][u16 len][utf-8 message]`` then the payload of their type;
        the payload is present whatever the status (empty data, zero entries on errors).
Rule 6: a HELLO is always sent in a version-1 frame; its body carries the range of versions the
        client speaks and the answer the version chosen (or ``BAD_VERSION``) and the bookie's
        instance id.
Rule 7: a frame's version byte is the version that defined its type: 1 for every type of
        version 1, 2 for ``ADD_MULTI`` and its answer, 3 for ``READ_STRIDE`` (a type in a
        header of another version is refused). A client sends ``ADD_MULTI`` only to a bookie
        that chose version 2 or later, and ``READ_STRIDE`` only to one that chose 3 or later.
Rule 8: the ``ADD_MULTI`` body is ``[u64 ledger][u32 count]`` then ``count`` journal records
        ``[u32 length][u32 crc32c(record body)][record body]``, each record body an ADD body of
        that ledger (entry id >= 0, no flag but recovery). Each record's checksum covers its own
        body and the frame checksum covers every other byte (the 12-byte head and each record's
        8-byte head, in order), so every byte is checked once and the records are journaled
        verbatim. The entries of one ``ADD_MULTI`` share one fate and one answer (the count).
Rule 9: ``READ_STRIDE`` is a ``READ_RANGE`` body followed by ``[u32 stride]`` (at least 1): it
        reads entries first, first + stride, ... up to last, with the range's bounds (byte
        budget, at least one entry, stop at the first entry missing), and is answered with a
        ``READ_RANGE_RESPONSE``. In a ledger striped over E bookies, the entries of one
        residue modulo E share one write set, so one strided read per bookie replaces one
        read per entry.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from crc32c import crc32c

from polybroker.ledger.api import BookieProtocolError

# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

WIRE_VERSION = 1  # the version of the base frame types (and of every HELLO)
MULTI_ADD_VERSION = 2  # adds ADD_MULTI and ADD_MULTI_RESPONSE (Rules 7, 8)
STRIDE_READ_VERSION = 3  # adds READ_STRIDE (Rules 7, 9)
LATEST_VERSION = STRIDE_READ_VERSION
SUPPORTED_VERSIONS = frozenset({WIRE_VERSION, MULTI_ADD_VERSION, STRIDE_READ_VERSION})

# Room for the ledger client's record header around a largest message, and for response fields.
FRAME_OVERHEAD = 64 * 1024
DEFAULT_MAX_MESSAGE_SIZE = 5 * 1024 * 1024
DEFAULT_MAX_FRAME_SIZE = DEFAULT_MAX_MESSAGE_SIZE + FRAME_OVERHEAD

HEADER = struct.Struct(">IBBQI")
HEADER_SIZE = HEADER.size  # 18
_LENGTH_AFTER_PREFIX = HEADER_SIZE - 4  # bytes of header counted by ``length``

ADD_FIELDS = struct.Struct(">QqqB")  # ledger, entry, lac, flags: the head of an ADD body
ADD_FIELDS_SIZE = ADD_FIELDS.size  # 25
FLAG_RECOVERY = 0x01
FLAG_FENCE = 0x01
FLAG_LONG_POLL = 0x01

_HELLO_REQ = struct.Struct(">BBH")
_READ_REQ = struct.Struct(">QqB")
_READ_RANGE_REQ = struct.Struct(">QqqI")
_READ_STRIDE_REQ = struct.Struct(">QqqII")
_READ_LAC_REQ = struct.Struct(">QqIB")
_LEDGER = struct.Struct(">Q")
_LEDGER_LAC = struct.Struct(">Qq")
_STATUS = struct.Struct(">BH")
_HELLO_RESP = struct.Struct(">BH")
_LEDGER_ENTRY = struct.Struct(">Qq")
_RANGE_HEAD = struct.Struct(">QI")
_RANGE_ITEM = struct.Struct(">qI")
_FENCE_RESP = struct.Struct(">Qqq")
# One struct for a whole ADD answer (the hot path): header, status, empty message, ledger, entry.
_ADD_RESP_BODY = struct.Struct(">BHQq")
MULTI_HEAD = struct.Struct(">QI")  # ledger, count: the head of an ADD_MULTI body
MULTI_HEAD_SIZE = MULTI_HEAD.size  # 12
RECORD_HEAD = struct.Struct(">II")  # a journal record's length and crc32c (Rule 8)
RECORD_HEAD_SIZE = RECORD_HEAD.size  # 8
_RECORD_AND_FIELDS = struct.Struct(">IIQqqB")  # a record head and the ADD fields after it
_MULTI_RESP = struct.Struct(">QI")  # ledger, count
# One struct for a whole ADD_MULTI answer's body: status, empty message, ledger, count.
_MULTI_RESP_BODY = struct.Struct(">BHQI")

_MAX_MESSAGE_TEXT = 1024


class MsgType(enum.IntEnum):
    """Frame types; a response is its request's type with ``RESPONSE`` set."""

    HELLO = 1
    ADD = 2
    READ = 3
    READ_RANGE = 4
    READ_LAC = 5
    FENCE = 6
    DELETE_LEDGER = 7
    WRITE_LAC = 8
    ADD_MULTI = 9  # version 2
    READ_STRIDE = 10  # version 3, answered with READ_RANGE_RESPONSE

    RESPONSE = 0x80
    HELLO_RESPONSE = 0x81
    ADD_RESPONSE = 0x82
    READ_RESPONSE = 0x83
    READ_RANGE_RESPONSE = 0x84
    READ_LAC_RESPONSE = 0x85
    FENCE_RESPONSE = 0x86
    DELETE_LEDGER_RESPONSE = 0x87
    WRITE_LAC_RESPONSE = 0x88
    ADD_MULTI_RESPONSE = 0x89  # version 2
    # An answer to a frame that could not be decoded far enough to know what it asked.
    ERROR_RESPONSE = 0xFF


class Status(enum.IntEnum):
    """Outcome of a request."""

    OK = 0
    FENCED = 1
    NO_SUCH_ENTRY = 2
    NO_SUCH_LEDGER = 3
    BAD_REQUEST = 4
    BAD_VERSION = 5
    TOO_LARGE = 6
    ERROR = 7


class FrameError(BookieProtocolError):
    """A frame could not be decoded.

    ``request_id`` is the id from the frame's header when the header was readable (answer it),
    None otherwise; ``status`` is the status to answer with."""

    def __init__(self, status: Status, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.request_id = request_id


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------

Buffer = bytes | memoryview


def _text(message: str) -> bytes:
    raw = message.encode("utf-8", "replace")
    if len(raw) > _MAX_MESSAGE_TEXT:
        # Cut on a character boundary so the receiver can decode it.
        raw = raw[:_MAX_MESSAGE_TEXT].decode("utf-8", "ignore").encode("utf-8")
    return raw


def _frame(mtype: int, request_id: int, body: Buffer, version: int = WIRE_VERSION) -> bytes:
    return (
        HEADER.pack(_LENGTH_AFTER_PREFIX + len(body), version, mtype, request_id, crc32c(body))
        + body
    )


def _status_head(status: Status, message: str) -> bytes:
    raw = _text(message)
    return _STATUS.pack(status, len(raw)) + raw


@dataclass(slots=True)
class HelloRequest:
    """Open a session: the versions the client speaks and who it is."""

    request_id: int
    min_version: int = WIRE_VERSION
    max_version: int = WIRE_VERSION
    client_name: str = ""
    TYPE: ClassVar[MsgType] = MsgType.HELLO

    def encode(self) -> bytes:
        name = _text(self.client_name)
        body = _HELLO_REQ.pack(self.min_version, self.max_version, len(name)) + name
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class AddRequest:
    """Store one entry. ``body`` and ``crc`` are the frame's body and checksum (Rule 4)."""

    request_id: int
    ledger_id: int
    entry_id: int
    lac: int
    recovery: bool
    data: Buffer
    body: Buffer = b""
    crc: int = 0
    TYPE: ClassVar[MsgType] = MsgType.ADD

    def encode(self) -> bytes:
        return encode_add_request(
            self.request_id, self.ledger_id, self.entry_id, self.lac, self.data, self.recovery
        )


@dataclass(slots=True)
class ReadRequest:
    """Read one entry; ``fence`` fences the ledger first."""

    request_id: int
    ledger_id: int
    entry_id: int
    fence: bool = False
    TYPE: ClassVar[MsgType] = MsgType.READ

    def encode(self) -> bytes:
        flags = FLAG_FENCE if self.fence else 0
        return _frame(
            self.TYPE, self.request_id, _READ_REQ.pack(self.ledger_id, self.entry_id, flags)
        )


@dataclass(slots=True)
class ReadRangeRequest:
    """Read entries first..last, every ``stride``-th one, at most ``max_bytes`` of data (at
    least one). A stride of 1 is a ``READ_RANGE`` frame, any other a ``READ_STRIDE`` one
    (Rule 9)."""

    request_id: int
    ledger_id: int
    first_entry_id: int
    last_entry_id: int
    max_bytes: int
    stride: int = 1
    TYPE: ClassVar[MsgType] = MsgType.READ_RANGE

    def encode(self) -> bytes:
        first, last = self.first_entry_id, self.last_entry_id
        if self.stride == 1:
            body = _READ_RANGE_REQ.pack(self.ledger_id, first, last, self.max_bytes)
            return _frame(self.TYPE, self.request_id, body)
        body = _READ_STRIDE_REQ.pack(self.ledger_id, first, last, self.max_bytes, self.stride)
        return _frame(MsgType.READ_STRIDE, self.request_id, body, STRIDE_READ_VERSION)


@dataclass(slots=True)
class ReadLacRequest:
    """Ask for the LAC; with ``previous_lac`` and ``timeout_ms`` > 0 it is a long poll."""

    request_id: int
    ledger_id: int
    previous_lac: int | None = None
    timeout_ms: int = 0
    TYPE: ClassVar[MsgType] = MsgType.READ_LAC

    def encode(self) -> bytes:
        long_poll = self.previous_lac is not None
        body = _READ_LAC_REQ.pack(
            self.ledger_id,
            self.previous_lac if long_poll else -1,
            self.timeout_ms,
            FLAG_LONG_POLL if long_poll else 0,
        )
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class FenceRequest:
    """Fence a ledger durably."""

    request_id: int
    ledger_id: int
    TYPE: ClassVar[MsgType] = MsgType.FENCE

    def encode(self) -> bytes:
        return _frame(self.TYPE, self.request_id, _LEDGER.pack(self.ledger_id))


@dataclass(slots=True)
class DeleteLedgerRequest:
    """Forget a ledger."""

    request_id: int
    ledger_id: int
    TYPE: ClassVar[MsgType] = MsgType.DELETE_LEDGER

    def encode(self) -> bytes:
        return _frame(self.TYPE, self.request_id, _LEDGER.pack(self.ledger_id))


@dataclass(slots=True)
class WriteLacRequest:
    """Record an explicit LAC (a writer that is idle tells readers how far it got)."""

    request_id: int
    ledger_id: int
    lac: int
    TYPE: ClassVar[MsgType] = MsgType.WRITE_LAC

    def encode(self) -> bytes:
        return _frame(self.TYPE, self.request_id, _LEDGER_LAC.pack(self.ledger_id, self.lac))


@dataclass(slots=True)
class MultiAddRequest:
    """Store several entries of one ledger as one journal submission (Rule 8, version 2).

    ``entries`` holds (entry id, lac, data) with ``data`` a view of the received frame;
    ``records`` is the journal-ready tail of the body; ``recovery`` is set when every record
    carries the recovery flag."""

    request_id: int
    ledger_id: int
    entries: list[tuple[int, int, Buffer]]
    records: Buffer = b""
    recovery: bool = False
    TYPE: ClassVar[MsgType] = MsgType.ADD_MULTI

    def encode(self) -> bytes:
        flags = FLAG_RECOVERY if self.recovery else 0
        items = [(entry, lac, data, flags) for entry, lac, data in self.entries]
        return b"".join(encode_multi_add(self.request_id, self.ledger_id, items))


@dataclass(slots=True)
class HelloResponse:
    """The version chosen and the bookie's instance id."""

    request_id: int
    status: Status
    message: str = ""
    version: int = WIRE_VERSION
    instance_id: str = ""
    TYPE: ClassVar[MsgType] = MsgType.HELLO_RESPONSE

    def encode(self) -> bytes:
        ident = _text(self.instance_id)
        body = (
            _status_head(self.status, self.message)
            + _HELLO_RESP.pack(self.version, len(ident))
            + ident
        )
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class AddResponse:
    """The outcome of an add."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    entry_id: int = -1
    TYPE: ClassVar[MsgType] = MsgType.ADD_RESPONSE

    def encode(self) -> bytes:
        if not self.message:
            return encode_add_response(self.request_id, self.status, self.ledger_id, self.entry_id)
        body = _status_head(self.status, self.message) + _LEDGER_ENTRY.pack(
            self.ledger_id, self.entry_id
        )
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class ReadResponse:
    """One entry (empty data unless OK)."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    entry_id: int = -1
    data: Buffer = b""
    TYPE: ClassVar[MsgType] = MsgType.READ_RESPONSE

    def encode(self) -> bytes:
        body = (
            _status_head(self.status, self.message)
            + _LEDGER_ENTRY.pack(self.ledger_id, self.entry_id)
            + self.data
        )
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class ReadRangeResponse:
    """Consecutive entries as (entry id, data)."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    entries: list[tuple[int, Buffer]] = field(default_factory=list)
    TYPE: ClassVar[MsgType] = MsgType.READ_RANGE_RESPONSE

    def encode(self) -> bytes:
        parts: list[Buffer] = [
            _status_head(self.status, self.message),
            _RANGE_HEAD.pack(self.ledger_id, len(self.entries)),
        ]
        for entry_id, data in self.entries:
            parts.append(_RANGE_ITEM.pack(entry_id, len(data)))
            parts.append(data)
        return _frame(self.TYPE, self.request_id, b"".join(parts))


@dataclass(slots=True)
class ReadLacResponse:
    """The LAC the bookie knows for a ledger."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    lac: int = -1
    TYPE: ClassVar[MsgType] = MsgType.READ_LAC_RESPONSE

    def encode(self) -> bytes:
        body = _status_head(self.status, self.message) + _LEDGER_LAC.pack(self.ledger_id, self.lac)
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class FenceResponse:
    """The bookie's view of a fenced ledger's end."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    lac: int = -1
    last_entry_id: int = -1
    TYPE: ClassVar[MsgType] = MsgType.FENCE_RESPONSE

    def encode(self) -> bytes:
        body = _status_head(self.status, self.message) + _FENCE_RESP.pack(
            self.ledger_id, self.lac, self.last_entry_id
        )
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class DeleteLedgerResponse:
    """The outcome of a delete."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    TYPE: ClassVar[MsgType] = MsgType.DELETE_LEDGER_RESPONSE

    def encode(self) -> bytes:
        body = _status_head(self.status, self.message) + _LEDGER.pack(self.ledger_id)
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class WriteLacResponse:
    """The outcome of an explicit-LAC write."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    TYPE: ClassVar[MsgType] = MsgType.WRITE_LAC_RESPONSE

    def encode(self) -> bytes:
        body = _status_head(self.status, self.message) + _LEDGER.pack(self.ledger_id)
        return _frame(self.TYPE, self.request_id, body)


@dataclass(slots=True)
class MultiAddResponse:
    """The one outcome of every entry of an ADD_MULTI (``count`` of them)."""

    request_id: int
    status: Status
    message: str = ""
    ledger_id: int = 0
    count: int = 0
    TYPE: ClassVar[MsgType] = MsgType.ADD_MULTI_RESPONSE

    def encode(self) -> bytes:
        body = _status_head(self.status, self.message) + _MULTI_RESP.pack(
            self.ledger_id, self.count
        )
        return _frame(self.TYPE, self.request_id, body, MULTI_ADD_VERSION)


@dataclass(slots=True)
class ErrorResponse:
    """The answer to a frame that was not understood (bad checksum, unknown type, ...)."""

    request_id: int
    status: Status
    message: str = ""
    TYPE: ClassVar[MsgType] = MsgType.ERROR_RESPONSE

    def encode(self) -> bytes:
        return _frame(self.TYPE, self.request_id, _status_head(self.status, self.message))


Request = (
    HelloRequest
    | AddRequest
    | ReadRequest
    | ReadRangeRequest
    | ReadLacRequest
    | FenceRequest
    | DeleteLedgerRequest
    | WriteLacRequest
    | MultiAddRequest
)
Response = (
    HelloResponse
    | AddResponse
    | ReadResponse
    | ReadRangeResponse
    | ReadLacResponse
    | FenceResponse
    | DeleteLedgerResponse
    | WriteLacResponse
    | MultiAddResponse
    | ErrorResponse
)
Message = Request | Response


# ---------------------------------------------------------------------------------------------
# Hot-path encoders (no message object)
# ---------------------------------------------------------------------------------------------

_ADD_HEAD = struct.Struct(">IBBQIQqqB")  # frame header + ADD fields, packed at once
_ADD_RESP = struct.Struct(">IBBQIBHQq")  # frame header + status, empty message, ledger, entry


def encode_add_request(
    request_id: int, ledger_id: int, entry_id: int, lac: int, data: Buffer, recovery: bool = False
) -> bytes:
    """Return an ADD frame; the checksum covers the fields and the data without joining them."""
    flags = FLAG_RECOVERY if recovery else 0
    fields = ADD_FIELDS.pack(ledger_id, entry_id, lac, flags)
    crc = crc32c(data, crc32c(fields))
    head = _ADD_HEAD.pack(
        _LENGTH_AFTER_PREFIX + ADD_FIELDS_SIZE + len(data),
        WIRE_VERSION,
        MsgType.ADD,
        request_id,
        crc,
        ledger_id,
        entry_id,
        lac,
        flags,
    )
    return head + data


def encode_add_response(request_id: int, status: int, ledger_id: int, entry_id: int) -> bytes:
    """Return an ADD answer with no message (one pack and one checksum)."""
    body = _ADD_RESP_BODY.pack(status, 0, ledger_id, entry_id)
    return _ADD_RESP.pack(
        _LENGTH_AFTER_PREFIX + _ADD_RESP_BODY.size,
        WIRE_VERSION,
        MsgType.ADD_RESPONSE,
        request_id,
        crc32c(body),
        status,
        0,
        ledger_id,
        entry_id,
    )


def encode_multi_add(
    request_id: int, ledger_id: int, items: Sequence[tuple[int, int, Buffer, int]]
) -> list[Buffer]:
    """Return the parts of an ADD_MULTI frame of (entry id, lac, data, flags) items (Rule 8),
    for ``writeSequence``: the data are referenced, not copied."""
    fields_pack = ADD_FIELDS.pack
    head_pack = RECORD_HEAD.pack
    head = MULTI_HEAD.pack(ledger_id, len(items))
    frame_crc = crc32c(head)
    total = MULTI_HEAD_SIZE
    parts: list[Buffer] = [b""]  # the frame header, once the checksum is known
    append = parts.append
    for entry_id, lac, data, flags in items:
        fields = fields_pack(ledger_id, entry_id, lac, flags)
        n = ADD_FIELDS_SIZE + len(data)
        record_head = head_pack(n, crc32c(data, crc32c(fields)))
        frame_crc = crc32c(record_head, frame_crc)
        append(record_head + fields)
        append(data)
        total += RECORD_HEAD_SIZE + n
    parts[0] = (
        HEADER.pack(
            _LENGTH_AFTER_PREFIX + total,
            MULTI_ADD_VERSION,
            MsgType.ADD_MULTI,
            request_id,
            frame_crc,
        )
        + head
    )
    return parts


def encode_add_record(
    ledger_id: int, entry_id: int, lac: int, data: Buffer, flags: int = 0
) -> bytes:
    """Return one ADD_MULTI record ``[u32 length][u32 crc32c(body)][ADD body]`` (Rule 8): what
    a bookie journals verbatim, made once however many bookies it is sent to."""
    fields = ADD_FIELDS.pack(ledger_id, entry_id, lac, flags)
    head = RECORD_HEAD.pack(ADD_FIELDS_SIZE + len(data), crc32c(data, crc32c(fields)))
    return head + fields + data


def encode_multi_add_records(
    request_id: int, ledger_id: int, records: Sequence[bytes]
) -> list[Buffer]:
    """Return the parts of an ADD_MULTI frame of ready records (``encode_add_record``'s, of
    ``ledger_id``), for ``writeSequence``: the records are referenced, not copied."""
    head = MULTI_HEAD.pack(ledger_id, len(records))
    # The frame checksum covers the head and each record's head, in order (Rule 8).
    heads = b"".join([r[:RECORD_HEAD_SIZE] for r in records])
    total = MULTI_HEAD_SIZE + sum(map(len, records))
    frame = HEADER.pack(
        _LENGTH_AFTER_PREFIX + total,
        MULTI_ADD_VERSION,
        MsgType.ADD_MULTI,
        request_id,
        crc32c(heads, crc32c(head)),
    )
    return [frame + head, *records]


def encode_multi_add_parts(
    request_id: int, ledger_id: int, records: Sequence[Sequence[Buffer]], nbytes: int
) -> list[Buffer]:
    """``encode_multi_add_records`` of records given as parts (each record's first part
    starting with its 8-byte head, its parts ``nbytes`` bytes in all), for one join at the
    write: a record's data is copied once, into the frame written."""
    head = MULTI_HEAD.pack(ledger_id, len(records))
    heads = b"".join([r[0][:RECORD_HEAD_SIZE] for r in records])
    parts: list[Buffer] = [b""]
    extend = parts.extend
    for r in records:
        extend(r)
    parts[0] = (
        HEADER.pack(
            _LENGTH_AFTER_PREFIX + MULTI_HEAD_SIZE + nbytes,
            MULTI_ADD_VERSION,
            MsgType.ADD_MULTI,
            request_id,
            crc32c(heads, crc32c(head)),
        )
        + head
    )
    return parts


def encode_add_request_of_record(request_id: int, record: bytes) -> list[Buffer]:
    """Return the parts of a version-1 ADD frame carrying a record's body: an ADD frame's
    checksum covers its body as the record's does, so nothing is summed again."""
    length, crc = RECORD_HEAD.unpack_from(record)
    head = HEADER.pack(_LENGTH_AFTER_PREFIX + length, WIRE_VERSION, MsgType.ADD, request_id, crc)
    return [head, memoryview(record)[RECORD_HEAD_SIZE:]]


def stride_starts(first: int, last: int, stride: int, have: Container[int]) -> list[int]:
    """Where the strided reads of first..last start (Rule 9): for each residue modulo
    ``stride``, its first entry from ``first`` on that is not in ``have``, if up to ``last``."""
    starts = []
    for start in range(first, min(first + stride, last + 1)):
        while start <= last and start in have:
            start += stride
        if start <= last:
            starts.append(start)
    return starts


def multi_add_size(data_sizes: int, count: int) -> int:
    """The size of an ADD_MULTI frame of ``count`` entries holding ``data_sizes`` bytes of data."""
    return HEADER_SIZE + MULTI_HEAD_SIZE + count * (RECORD_HEAD_SIZE + ADD_FIELDS_SIZE) + data_sizes


def encode_multi_add_response(request_id: int, status: int, ledger_id: int, count: int) -> bytes:
    """Return an ADD_MULTI answer with no message."""
    body = _STATUS.pack(status, 0) + _MULTI_RESP.pack(ledger_id, count)
    return _frame(MsgType.ADD_MULTI_RESPONSE, request_id, body, MULTI_ADD_VERSION)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def _bad(request_id: int, message: str) -> FrameError:
    return FrameError(Status.BAD_REQUEST, message, request_id)


def _exact(body: memoryview, size: int, rid: int, what: str) -> None:
    if len(body) != size:
        raise _bad(rid, f"{what} body must be {size} bytes, got {len(body)}")


def _utf8(raw: memoryview, rid: int) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise _bad(rid, "text is not valid UTF-8") from None


def _read_status(body: memoryview, rid: int) -> tuple[Status, str, int]:
    if len(body) < _STATUS.size:
        raise _bad(rid, "response too short for a status")
    code, length = _STATUS.unpack_from(body, 0)
    end = _STATUS.size + length
    if end > len(body):
        raise _bad(rid, "status message runs past the frame")
    try:
        status = Status(code)
    except ValueError:
        raise _bad(rid, f"unknown status {code}") from None
    return status, _utf8(body[_STATUS.size : end], rid), end


def _dec_hello(rid: int, body: memoryview) -> HelloRequest:
    if len(body) < _HELLO_REQ.size:
        raise _bad(rid, "HELLO body too short")
    lo, hi, n = _HELLO_REQ.unpack_from(body, 0)
    _exact(body, _HELLO_REQ.size + n, rid, "HELLO")
    return HelloRequest(rid, lo, hi, _utf8(body[_HELLO_REQ.size :], rid))


def _dec_add(rid: int, body: memoryview) -> AddRequest:
    if len(body) < ADD_FIELDS_SIZE:
        raise _bad(rid, "ADD body too short")
    ledger, entry, lac, flags = ADD_FIELDS.unpack_from(body, 0)
    return AddRequest(
        rid, ledger, entry, lac, bool(flags & FLAG_RECOVERY), body[ADD_FIELDS_SIZE:], body
    )


def _pack_heads(fields: list[int]) -> bytes:
    """The record heads whose (length, crc) fields are ``fields``, as they are on the wire."""
    return struct.pack(f">{len(fields)}I", *fields)


def _dec_add_multi(rid: int, body: memoryview, frame_crc: int) -> MultiAddRequest:
    """Decode and check an ADD_MULTI body (Rule 8); every bound is checked before use."""
    size = len(body)
    if size < MULTI_HEAD_SIZE:
        raise _bad(rid, "ADD_MULTI body too short")
    ledger_id, count = MULTI_HEAD.unpack_from(body, 0)
    if count < 1 or count > (size - MULTI_HEAD_SIZE) // (RECORD_HEAD_SIZE + ADD_FIELDS_SIZE):
        raise _bad(rid, f"ADD_MULTI claims {count} records, impossible in {size} bytes")
    unpack = _RECORD_AND_FIELDS.unpack_from
    entries: list[tuple[int, int, Buffer]] = []
    append = entries.append
    # The frame's checksum covers the multi head and the record heads: their fields are kept
    # and summed once after the loop (one call, not one per record).
    heads: list[int] = []
    head_append = heads.append
    recovery = True
    off = MULTI_HEAD_SIZE
    for _ in range(count):
        start = off + RECORD_HEAD_SIZE
        if start + ADD_FIELDS_SIZE > size:
            raise _bad(rid, "ADD_MULTI record runs past the frame")
        length, crc, lid, entry_id, lac, flags = unpack(body, off)
        end = start + length
        if length < ADD_FIELDS_SIZE or end > size:
            raise _bad(rid, f"ADD_MULTI record of {length} bytes does not fit the frame")
        head_append(length)
        head_append(crc)
        if crc32c(body[start:end]) != crc:
            raise _bad(rid, "ADD_MULTI record checksum mismatch")
        if lid != ledger_id or entry_id < 0 or flags & ~FLAG_RECOVERY:
            raise _bad(rid, f"ADD_MULTI record {lid}:{entry_id} (flags {flags}) is not allowed")
        if not flags:
            recovery = False
        append((entry_id, lac, body[start + ADD_FIELDS_SIZE : end]))
        off = end
    if off != size:
        raise _bad(rid, "ADD_MULTI has trailing bytes")
    if crc32c(_pack_heads(heads), crc32c(body[:MULTI_HEAD_SIZE])) != frame_crc:
        raise _bad(rid, "frame checksum mismatch")
    return MultiAddRequest(rid, ledger_id, entries, body[MULTI_HEAD_SIZE:], recovery)


def _dec_read(rid: int, body: memoryview) -> ReadRequest:
    _exact(body, _READ_REQ.size, rid, "READ")
    ledger, entry, flags = _READ_REQ.unpack_from(body, 0)
    return ReadRequest(rid, ledger, entry, bool(flags & FLAG_FENCE))


def _dec_read_range(rid: int, body: memoryview) -> ReadRangeRequest:
    _exact(body, _READ_RANGE_REQ.size, rid, "READ_RANGE")
    return ReadRangeRequest(rid, *_READ_RANGE_REQ.unpack_from(body, 0))


def _dec_read_stride(rid: int, body: memoryview) -> ReadRangeRequest:
    _exact(body, _READ_STRIDE_REQ.size, rid, "READ_STRIDE")
    req = ReadRangeRequest(rid, *_READ_STRIDE_REQ.unpack_from(body, 0))
    if req.stride < 1:
        raise _bad(rid, "READ_STRIDE stride must be at least 1")
    return req


def _dec_read_lac(rid: int, body: memoryview) -> ReadLacRequest:
    _exact(body, _READ_LAC_REQ.size, rid, "READ_LAC")
    ledger, previous, timeout_ms, flags = _READ_LAC_REQ.unpack_from(body, 0)
    long_poll = bool(flags & FLAG_LONG_POLL)
    return ReadLacRequest(rid, ledger, previous if long_poll else None, timeout_ms)


def _dec_fence(rid: int, body: memoryview) -> FenceRequest:
    _exact(body, _LEDGER.size, rid, "FENCE")
    return FenceRequest(rid, _LEDGER.unpack_from(body, 0)[0])


def _dec_delete(rid: int, body: memoryview) -> DeleteLedgerRequest:
    _exact(body, _LEDGER.size, rid, "DELETE_LEDGER")
    return DeleteLedgerRequest(rid, _LEDGER.unpack_from(body, 0)[0])


def _dec_write_lac(rid: int, body: memoryview) -> WriteLacRequest:
    _exact(body, _LEDGER_LAC.size, rid, "WRITE_LAC")
    return WriteLacRequest(rid, *_LEDGER_LAC.unpack_from(body, 0))


def _dec_hello_resp(rid: int, body: memoryview) -> HelloResponse:
    status, message, off = _read_status(body, rid)
    if len(body) < off + _HELLO_RESP.size:
        raise _bad(rid, "HELLO response too short")
    version, n = _HELLO_RESP.unpack_from(body, off)
    off += _HELLO_RESP.size
    _exact(body, off + n, rid, "HELLO response")
    return HelloResponse(rid, status, message, version, _utf8(body[off:], rid))


def _dec_add_resp(rid: int, body: memoryview) -> AddResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _LEDGER_ENTRY.size, rid, "ADD response")
    return AddResponse(rid, status, message, *_LEDGER_ENTRY.unpack_from(body, off))


def _dec_read_resp(rid: int, body: memoryview) -> ReadResponse:
    status, message, off = _read_status(body, rid)
    if len(body) < off + _LEDGER_ENTRY.size:
        raise _bad(rid, "READ response too short")
    ledger, entry = _LEDGER_ENTRY.unpack_from(body, off)
    return ReadResponse(rid, status, message, ledger, entry, body[off + _LEDGER_ENTRY.size :])


def _dec_read_range_resp(rid: int, body: memoryview) -> ReadRangeResponse:
    status, message, off = _read_status(body, rid)
    if len(body) < off + _RANGE_HEAD.size:
        raise _bad(rid, "READ_RANGE response too short")
    ledger, count = _RANGE_HEAD.unpack_from(body, off)
    off += _RANGE_HEAD.size
    # Each entry takes at least an item header: bound the count before looping on it.
    if count * _RANGE_ITEM.size > len(body) - off:
        raise _bad(rid, f"READ_RANGE response claims {count} entries, too many for its size")
    entries: list[tuple[int, Buffer]] = []
    for _ in range(count):
        if len(body) < off + _RANGE_ITEM.size:
            raise _bad(rid, "READ_RANGE entry header runs past the frame")
        entry, n = _RANGE_ITEM.unpack_from(body, off)
        off += _RANGE_ITEM.size
        if off + n > len(body):
            raise _bad(rid, "READ_RANGE entry runs past the frame")
        entries.append((entry, body[off : off + n]))
        off += n
    if off != len(body):
        raise _bad(rid, "READ_RANGE response has trailing bytes")
    return ReadRangeResponse(rid, status, message, ledger, entries)


def _dec_read_lac_resp(rid: int, body: memoryview) -> ReadLacResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _LEDGER_LAC.size, rid, "READ_LAC response")
    return ReadLacResponse(rid, status, message, *_LEDGER_LAC.unpack_from(body, off))


def _dec_fence_resp(rid: int, body: memoryview) -> FenceResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _FENCE_RESP.size, rid, "FENCE response")
    return FenceResponse(rid, status, message, *_FENCE_RESP.unpack_from(body, off))


def _dec_delete_resp(rid: int, body: memoryview) -> DeleteLedgerResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _LEDGER.size, rid, "DELETE_LEDGER response")
    return DeleteLedgerResponse(rid, status, message, _LEDGER.unpack_from(body, off)[0])


def _dec_write_lac_resp(rid: int, body: memoryview) -> WriteLacResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _LEDGER.size, rid, "WRITE_LAC response")
    return WriteLacResponse(rid, status, message, _LEDGER.unpack_from(body, off)[0])


def _dec_add_multi_resp(rid: int, body: memoryview) -> MultiAddResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off + _MULTI_RESP.size, rid, "ADD_MULTI response")
    return MultiAddResponse(rid, status, message, *_MULTI_RESP.unpack_from(body, off))


def _dec_error_resp(rid: int, body: memoryview) -> ErrorResponse:
    status, message, off = _read_status(body, rid)
    _exact(body, off, rid, "ERROR response")
    return ErrorResponse(rid, status, message)


_DECODERS = {
    MsgType.HELLO: _dec_hello,
    MsgType.ADD: _dec_add,
    MsgType.READ: _dec_read,
    MsgType.READ_RANGE: _dec_read_range,
    MsgType.READ_STRIDE: _dec_read_stride,
    MsgType.READ_LAC: _dec_read_lac,
    MsgType.FENCE: _dec_fence,
    MsgType.DELETE_LEDGER: _dec_delete,
    MsgType.WRITE_LAC: _dec_write_lac,
    MsgType.HELLO_RESPONSE: _dec_hello_resp,
    MsgType.ADD_RESPONSE: _dec_add_resp,
    MsgType.READ_RESPONSE: _dec_read_resp,
    MsgType.READ_RANGE_RESPONSE: _dec_read_range_resp,
    MsgType.READ_LAC_RESPONSE: _dec_read_lac_resp,
    MsgType.FENCE_RESPONSE: _dec_fence_resp,
    MsgType.DELETE_LEDGER_RESPONSE: _dec_delete_resp,
    MsgType.WRITE_LAC_RESPONSE: _dec_write_lac_resp,
    MsgType.ERROR_RESPONSE: _dec_error_resp,
    MsgType.ADD_MULTI_RESPONSE: _dec_add_multi_resp,
}
# The version that defines each type (Rule 7); ADD_MULTI has its own checksum rule (Rule 8).
_TYPE_VERSION = {int(t): WIRE_VERSION for t in _DECODERS}
_TYPE_VERSION[MsgType.ADD_MULTI] = MULTI_ADD_VERSION
_TYPE_VERSION[MsgType.ADD_MULTI_RESPONSE] = MULTI_ADD_VERSION
_TYPE_VERSION[MsgType.READ_STRIDE] = STRIDE_READ_VERSION
_STATUSES = tuple(Status(i) for i in range(len(Status)))
# Plain-int keys: the lookup runs once per frame.
_DECODE_BY_INT = {int(k): v for k, v in _DECODERS.items()}


class FrameDecoder:
    """Turn a byte stream into messages (sans-IO, see the module rules).

    Usage: ``receive_data(chunk)``, then either ``drain()`` for every complete message (and
    check ``error``), or call ``next_frame()`` until it returns None."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < HEADER_SIZE:
            raise ValueError(f"max_frame_size must be at least {HEADER_SIZE}")
        self._max = max_frame_size
        self._buf = b""  # the chunk being parsed, from _pos on
        self._view = memoryview(self._buf)
        self._pos = 0
        self._more: deque[bytes] = deque()  # chunks received after _buf
        self._more_len = 0
        self.error: FrameError | None = None  # set once a bad frame was met (Rule 2)

    @property
    def max_frame_size(self) -> int:
        """The largest frame (its ``length`` + 4) accepted."""
        return self._max

    def receive_data(self, data: bytes) -> None:
        """Buffer received bytes (no parsing happens here)."""
        if not data:
            return
        data = bytes(data)
        if self._pos >= len(self._buf) and not self._more:
            self._buf = data
            self._view = memoryview(data)
            self._pos = 0
        else:
            self._more.append(data)
            self._more_len += len(data)

    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buf) - self._pos + self._more_len

    def partial_request_id(self) -> int | None:
        """The request id of a partly received frame, if its header is complete enough."""
        if self.buffered() < 14:
            return None
        return int.from_bytes(self._peek(14)[6:14], "big")

    def _peek(self, n: int) -> bytes:
        """The next ``n`` buffered bytes (the caller checked they are there); copies only them."""
        head = self._buf[self._pos : self._pos + n]
        for chunk in self._more:
            if len(head) >= n:
                break
            head += chunk[: n - len(head)]
        return head

    def _take(self, n: int) -> bytes:
        """Remove and return the next ``n`` bytes, which run past the current chunk: only they
        are copied, and parsing goes on in place in the chunk where they end (Rule 3)."""
        parts: list[Buffer] = [self._view[self._pos :]]
        need = n - (len(self._buf) - self._pos)
        rest = b""
        while need > 0:
            chunk = self._more.popleft()
            self._more_len -= len(chunk)
            if len(chunk) <= need:
                parts.append(chunk)
                need -= len(chunk)
            else:
                parts.append(memoryview(chunk)[:need])
                rest = chunk
                break
        taken = b"".join(parts)
        if rest:
            self._buf = rest
            self._pos = len(parts[-1])
        elif self._more:
            self._buf = self._more.popleft()
            self._more_len -= len(self._buf)
            self._pos = 0
        else:
            self._buf = b""
            self._pos = 0
        self._view = memoryview(self._buf)
        return taken

    def _check(self, length: int, version: int, mtype: int, rid: int) -> None:
        if length < _LENGTH_AFTER_PREFIX:
            raise FrameError(Status.BAD_REQUEST, f"frame length {length} too short")
        if length + 4 > self._max:
            raise FrameError(
                Status.TOO_LARGE, f"frame of {length + 4} bytes exceeds the limit {self._max}", rid
            )
        if version not in SUPPORTED_VERSIONS:
            raise FrameError(
                Status.BAD_VERSION,
                f"wire version {version} not supported (speaks {sorted(SUPPORTED_VERSIONS)})",
                rid,
            )
        defined_in = _TYPE_VERSION.get(mtype)
        if defined_in is None:
            raise FrameError(Status.BAD_REQUEST, f"unknown frame type {mtype}", rid)
        if defined_in != version:
            raise FrameError(
                Status.BAD_REQUEST,
                f"frame type {mtype} belongs to wire version {defined_in}, not {version}",
                rid,
            )

    def next_frame(self) -> Message | None:
        """Return the next complete message, None if more bytes are needed.

        Raises ``FrameError`` on a bad frame (and on every later call)."""
        if self.error is None:
            out = self._decode(1)
            if out:
                return out[0]
        if self.error is not None:
            raise self.error
        return None

    def drain(self) -> list[Message]:
        """Return every complete message buffered, in order. If a bad frame follows them,
        ``error`` is set (and stays set): the caller handles the messages, then the error."""
        if self.error is not None:
            return []
        return self._decode(-1)

    def _decode(self, limit: int) -> list[Message]:
        out: list[Message] = []
        buf, view, pos = self._buf, self._view, self._pos
        unpack_header = HEADER.unpack_from
        unpack_add = ADD_FIELDS.unpack_from
        unpack_add_resp = _ADD_RESP_BODY.unpack_from
        unpack_multi_resp = _MULTI_RESP_BODY.unpack_from
        statuses = _STATUSES
        n_statuses = len(statuses)
        max_frame = self._max
        type_version = _TYPE_VERSION.get
        try:
            while len(out) != limit:
                avail = len(buf) - pos
                if avail >= HEADER_SIZE:
                    length, version, mtype, rid, crc = unpack_header(buf, pos)
                    total = length + 4
                    if total <= avail and length >= _LENGTH_AFTER_PREFIX and total <= max_frame:
                        end = pos + total
                        body = view[pos + HEADER_SIZE : end]
                        if version != type_version(mtype):
                            self._check(length, version, mtype, rid)  # raises
                        if mtype == _ADD_MULTI:
                            out.append(_dec_add_multi(rid, body, crc))
                            pos = end
                            continue
                        if crc32c(body) != crc:
                            raise FrameError(Status.BAD_REQUEST, "frame checksum mismatch", rid)
                        if mtype == _ADD and length >= _MIN_ADD_LENGTH:
                            # The hot path: one unpack and one object per entry.
                            ledger, entry, lac, flags = unpack_add(buf, pos + HEADER_SIZE)
                            out.append(
                                AddRequest(
                                    rid,
                                    ledger,
                                    entry,
                                    lac,
                                    bool(flags & FLAG_RECOVERY),
                                    body[ADD_FIELDS_SIZE:],
                                    body,
                                    crc,
                                )
                            )
                        elif mtype == _ADD_RESPONSE and length == _ADD_RESPONSE_LENGTH:
                            code, text_len, ledger, entry = unpack_add_resp(buf, pos + HEADER_SIZE)
                            if text_len == 0 and code < n_statuses:
                                out.append(AddResponse(rid, statuses[code], "", ledger, entry))
                            else:
                                out.append(_decode_body(mtype, rid, body, buf, pos, crc))
                        elif mtype == _ADD_MULTI_RESPONSE and length == _MULTI_RESPONSE_LENGTH:
                            code, text_len, ledger, count = unpack_multi_resp(
                                buf, pos + HEADER_SIZE
                            )
                            if text_len == 0 and code < n_statuses:
                                out.append(MultiAddResponse(rid, statuses[code], "", ledger, count))
                            else:
                                out.append(_decode_body(mtype, rid, body, buf, pos, crc))
                        else:
                            out.append(_decode_body(mtype, rid, body, buf, pos, crc))
                        pos = end
                        continue
                if avail == 0 and self._more:
                    # This chunk is used up: parse the next one in place (no copy).
                    buf = self._buf = self._more.popleft()
                    self._more_len -= len(buf)
                    view = self._view = memoryview(buf)
                    pos = 0
                    continue
                # The next frame is incomplete, runs into the next chunk, or is bad.
                self._pos = pos
                if avail + self._more_len < HEADER_SIZE:
                    break
                head = self._peek(HEADER_SIZE)
                length, version, mtype, rid, crc = HEADER.unpack(head)
                self._check(length, version, mtype, rid)
                total = length + 4
                if avail + self._more_len < total:
                    break
                frame = self._take(total)
                body = memoryview(frame)[HEADER_SIZE:]
                if mtype == _ADD_MULTI:
                    out.append(_dec_add_multi(rid, body, crc))
                else:
                    if crc32c(body) != crc:
                        raise FrameError(Status.BAD_REQUEST, "frame checksum mismatch", rid)
                    out.append(_decode_body(mtype, rid, body, frame, 0, crc))
                buf, view, pos = self._buf, self._view, self._pos
        except FrameError as e:
            self.error = e
        self._pos = pos
        return out


_ADD = int(MsgType.ADD)
_ADD_MULTI = int(MsgType.ADD_MULTI)
_MIN_ADD_LENGTH = _LENGTH_AFTER_PREFIX + ADD_FIELDS_SIZE
_ADD_RESPONSE_LENGTH = _LENGTH_AFTER_PREFIX + _ADD_RESP_BODY.size
_ADD_MULTI_RESPONSE = int(MsgType.ADD_MULTI_RESPONSE)
_MULTI_RESPONSE_LENGTH = _LENGTH_AFTER_PREFIX + _MULTI_RESP_BODY.size


def _decode_body(mtype: int, rid: int, body: memoryview, buf: bytes, pos: int, crc: int) -> Message:
    """Decode a checked frame's body (``buf[pos:]`` is the frame, for in-place unpacking)."""
    if mtype == _ADD:
        req = _dec_add(rid, body)
        req.crc = crc
        return req
    if mtype == _ADD_RESPONSE and len(body) == _ADD_RESP_BODY.size:
        code, text_len, ledger, entry = _ADD_RESP_BODY.unpack_from(buf, pos + HEADER_SIZE)
        if text_len == 0 and code < len(_STATUSES):
            return AddResponse(rid, _STATUSES[code], "", ledger, entry)
    return _DECODE_BY_INT[mtype](rid, body)


_ADD_RESPONSE = int(MsgType.ADD_RESPONSE)


def decode_all(data: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> list[Message]:
    """Decode every complete frame of ``data`` (a convenience for tests and tools)."""
    decoder = FrameDecoder(max_frame_size)
    decoder.receive_data(data)
    out: list[Message] = []
    while (message := decoder.next_frame()) is not None:
        out.append(message)
    return out
