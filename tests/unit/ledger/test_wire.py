"""The bookie wire codec: round trips, framing across reads, and every kind of bad input."""

from __future__ import annotations

import random
import struct

import pytest
from crc32c import crc32c

from polybroker.ledger.api import BookieProtocolError
from polybroker.ledger.wire import (
    HEADER,
    HEADER_SIZE,
    WIRE_VERSION,
    AddRequest,
    AddResponse,
    DeleteLedgerRequest,
    DeleteLedgerResponse,
    ErrorResponse,
    FenceRequest,
    FenceResponse,
    FrameDecoder,
    FrameError,
    HelloRequest,
    HelloResponse,
    Message,
    MsgType,
    ReadLacRequest,
    ReadLacResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
    WriteLacRequest,
    WriteLacResponse,
    decode_all,
    encode_add_request,
    encode_add_response,
)

MESSAGES: list[Message] = [
    HelloRequest(1, 1, 3, "client-é"),
    AddRequest(2, 7, 0, -1, False, b"payload"),
    AddRequest(3, 2**63, 2**36, 41, True, b""),
    ReadRequest(4, 7, 5, fence=True),
    ReadRangeRequest(5, 7, 0, 99, 1 << 20),
    ReadLacRequest(6, 7),
    ReadLacRequest(7, 7, previous_lac=-1, timeout_ms=5000),
    FenceRequest(8, 7),
    DeleteLedgerRequest(9, 7),
    WriteLacRequest(10, 7, 12),
    HelloResponse(11, Status.OK, "", 1, "3f1c-uuid"),
    HelloResponse(12, Status.BAD_VERSION, "speaks 1", 1, "id"),
    AddResponse(13, Status.OK, "", 7, 3),
    AddResponse(14, Status.FENCED, "fenced by recovery", 7, 3),
    ReadResponse(15, Status.OK, "", 7, 3, b"\x00data"),
    ReadResponse(16, Status.NO_SUCH_ENTRY, "no entry", 7, 3, b""),
    ReadRangeResponse(17, Status.OK, "", 7, [(0, b"a"), (1, b""), (2, b"ccc")]),
    ReadRangeResponse(18, Status.NO_SUCH_LEDGER, "gone", 7, []),
    ReadLacResponse(19, Status.OK, "", 7, 10),
    FenceResponse(20, Status.OK, "", 7, 9, 10),
    DeleteLedgerResponse(21, Status.OK, "", 7),
    WriteLacResponse(22, Status.OK, "", 7),
    ErrorResponse(23, Status.BAD_REQUEST, "frame checksum mismatch"),
]


def _normalise(message: Message) -> Message:
    """Turn memoryviews into bytes so decoded and original messages compare."""
    if isinstance(message, AddRequest):
        return AddRequest(
            message.request_id,
            message.ledger_id,
            message.entry_id,
            message.lac,
            message.recovery,
            bytes(message.data),
        )
    if isinstance(message, ReadResponse):
        message.data = bytes(message.data)
    if isinstance(message, ReadRangeResponse):
        message.entries = [(e, bytes(d)) for e, d in message.entries]
    return message


def _frame(mtype: int, rid: int, body: bytes, *, version: int = WIRE_VERSION) -> bytes:
    return HEADER.pack(HEADER_SIZE - 4 + len(body), version, mtype, rid, crc32c(body)) + body


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    """Each request and response type decodes to what was encoded."""
    decoded = decode_all(message.encode())
    assert len(decoded) == 1
    assert _normalise(decoded[0]) == _normalise(message)


def test_add_request_hands_out_the_frame_body_and_client_checksum() -> None:
    """An ADD's data is a view of the frame's tail and its body/crc are what the client sent."""
    frame = encode_add_request(9, 3, 4, 2, b"x" * 1000, recovery=True)
    (req,) = decode_all(frame)
    assert isinstance(req, AddRequest)
    assert isinstance(req.data, memoryview)
    assert bytes(req.data) == b"x" * 1000
    assert bytes(req.body) == frame[HEADER_SIZE:]
    assert req.crc == crc32c(frame[HEADER_SIZE:])
    assert (req.ledger_id, req.entry_id, req.lac, req.recovery) == (3, 4, 2, True)


def test_fast_add_response_equals_the_generic_encoding() -> None:
    """The hot-path ADD answer is byte-identical to the message's encoding."""
    fast = encode_add_response(5, Status.OK, 7, 8)
    assert fast == AddResponse(5, Status.OK, "", 7, 8).encode()
    assert decode_all(fast) == [AddResponse(5, Status.OK, "", 7, 8)]


def test_frames_split_at_every_byte_and_many_per_read() -> None:
    """A stream fed one byte at a time, or all at once, yields the same messages in order."""
    stream = b"".join(m.encode() for m in MESSAGES)
    one_by_one = FrameDecoder()
    got = []
    for i in range(len(stream)):
        one_by_one.receive_data(stream[i : i + 1])
        while (m := one_by_one.next_frame()) is not None:
            got.append(_normalise(m))
    assert got == [_normalise(m) for m in MESSAGES]
    assert [_normalise(m) for m in decode_all(stream)] == got
    assert one_by_one.buffered() == 0


def test_frames_split_at_random_boundaries() -> None:
    """Random chunkings of a long stream of adds decode to every add, in order."""
    rng = random.Random(7)
    frames = [
        encode_add_request(i, 1, i, i - 1, rng.randbytes(rng.randrange(0, 3000)))
        for i in range(300)
    ]
    stream = b"".join(frames)
    decoder = FrameDecoder()
    ids = []
    pos = 0
    while pos < len(stream):
        step = rng.randrange(1, 9000)
        decoder.receive_data(stream[pos : pos + step])
        pos += step
        while (m := decoder.next_frame()) is not None:
            assert isinstance(m, AddRequest)
            assert bytes(m.data) == frames[m.request_id][HEADER_SIZE + 25 :]
            ids.append(m.request_id)
    assert ids == list(range(300))


def test_a_partial_frame_waits_for_more() -> None:
    """A frame missing its last byte is not returned, and its request id is known."""
    frame = ReadRequest(77, 1, 2).encode()
    decoder = FrameDecoder()
    decoder.receive_data(frame[:-1])
    assert decoder.next_frame() is None
    assert decoder.partial_request_id() == 77
    decoder.receive_data(frame[-1:])
    assert decoder.next_frame() == ReadRequest(77, 1, 2)


def _error_of(data: bytes, max_frame_size: int = 1 << 20) -> FrameError:
    decoder = FrameDecoder(max_frame_size)
    decoder.receive_data(data)

    def drain() -> None:
        while decoder.next_frame() is not None:
            pass

    with pytest.raises(FrameError) as info:
        drain()
    return info.value


def test_oversize_frame_is_refused_from_its_header_alone() -> None:
    """A length above the limit fails as soon as the header is in, with the request id."""
    header = HEADER.pack(10_000_000, WIRE_VERSION, MsgType.ADD, 42, 0)
    error = _error_of(header)
    assert error.status == Status.TOO_LARGE
    assert error.request_id == 42
    assert isinstance(error, BookieProtocolError)


def test_length_shorter_than_a_header_is_bad_request_without_id() -> None:
    """A length that cannot even hold the header is garbage with no trustworthy request id."""
    error = _error_of(struct.pack(">I", 3) + b"\x01" * 20)
    assert error.status == Status.BAD_REQUEST
    assert error.request_id is None


def test_wrong_version_is_bad_version_with_id() -> None:
    """A frame of an unknown version answers BAD_VERSION to its request id."""
    error = _error_of(_frame(MsgType.READ, 5, b"\x00" * 17, version=9))
    assert error.status == Status.BAD_VERSION
    assert error.request_id == 5


def test_bad_checksum_is_bad_request_with_id() -> None:
    """A flipped body byte is caught by the frame checksum."""
    frame = bytearray(encode_add_request(6, 1, 0, -1, b"abcdef"))
    frame[-1] ^= 0x01
    error = _error_of(bytes(frame))
    assert error.status == Status.BAD_REQUEST
    assert error.request_id == 6
    assert "checksum" in str(error)


def test_unknown_type_is_bad_request() -> None:
    """A frame type nobody defined is refused."""
    error = _error_of(_frame(0x42, 8, b""))
    assert (error.status, error.request_id) == (Status.BAD_REQUEST, 8)


@pytest.mark.parametrize(
    ("mtype", "body"),
    [
        (MsgType.READ, b"\x00" * 5),
        (MsgType.READ, b"\x00" * 18),
        (MsgType.ADD, b"\x00" * 24),
        (MsgType.FENCE, b""),
        (MsgType.READ_LAC, b"\x00" * 22),
        (MsgType.HELLO, struct.pack(">BBH", 1, 1, 50) + b"short"),
        (MsgType.HELLO, struct.pack(">BBH", 1, 1, 2) + b"\xff\xfe"),
        (MsgType.ADD_RESPONSE, b"\x00"),
        (MsgType.READ_RESPONSE, struct.pack(">BH", 0, 100) + b"x"),
        (MsgType.ERROR_RESPONSE, struct.pack(">BH", 99, 0)),
        (MsgType.READ_RANGE_RESPONSE, struct.pack(">BHQI", 0, 0, 1, 1_000_000)),
        (MsgType.READ_RANGE_RESPONSE, struct.pack(">BHQIqI", 0, 0, 1, 1, 0, 500) + b"x"),
    ],
)
def test_malformed_bodies_are_bad_request(mtype: int, body: bytes) -> None:
    """Bodies too short, too long, with bad text, statuses or counts are refused, not crashed on."""
    error = _error_of(_frame(mtype, 3, body))
    assert error.status == Status.BAD_REQUEST
    assert error.request_id == 3


def test_decoder_stays_broken_after_an_error() -> None:
    """After one bad frame even a good one is refused: the stream is not resynchronised."""
    decoder = FrameDecoder()
    decoder.receive_data(_frame(0x42, 1, b""))
    with pytest.raises(FrameError):
        decoder.next_frame()
    decoder.receive_data(FenceRequest(2, 1).encode())
    with pytest.raises(FrameError):
        decoder.next_frame()


def test_random_bytes_never_crash_the_decoder() -> None:
    """Thousands of random streams end in a message, a wait or a FrameError, nothing else."""
    rng = random.Random(1234)
    outcomes = {"error": 0, "waiting": 0}
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(1, 200))
        if rng.random() < 0.5:
            # Make some streams look plausible so the deeper checks are reached too.
            body = data[HEADER_SIZE:] if len(data) > HEADER_SIZE else b""
            data = _frame(rng.randrange(0, 256), 1, body, version=rng.choice((1, 1, 2)))
        decoder = FrameDecoder(4096)
        decoder.receive_data(data)
        try:
            while decoder.next_frame() is not None:
                pass
            outcomes["waiting"] += 1
        except FrameError:
            outcomes["error"] += 1
    assert outcomes["error"] > 1000
    assert sum(outcomes.values()) == 3000


def test_long_status_messages_are_cut_on_a_character_boundary() -> None:
    """A huge error text is bounded and still valid UTF-8."""
    (msg,) = decode_all(ErrorResponse(1, Status.ERROR, "é" * 5000).encode())
    assert isinstance(msg, ErrorResponse)
    assert 0 < len(msg.message.encode()) <= 1024
    assert set(msg.message) == {"é"}


def test_max_frame_size_must_hold_a_header() -> None:
    """A decoder limit below one header is a programming error."""
    with pytest.raises(ValueError, match="max_frame_size"):
        FrameDecoder(10)


def test_drain_returns_the_good_frames_before_a_bad_one() -> None:
    """Frames ahead of a bad one are returned; the error is then set and stays set."""
    decoder = FrameDecoder()
    decoder.receive_data(FenceRequest(1, 9).encode() + ReadRequest(2, 9, 0).encode())
    decoder.receive_data(_frame(0x42, 3, b"") + FenceRequest(4, 9).encode())
    assert decoder.drain() == [FenceRequest(1, 9), ReadRequest(2, 9, 0)]
    assert decoder.error is not None
    assert decoder.error.request_id == 3
    assert decoder.drain() == []


def test_drain_across_random_chunkings_matches_the_stream() -> None:
    """Draining after each random-size chunk yields every frame once, in order, intact."""
    rng = random.Random(11)
    frames = [
        encode_add_request(i, 2, i, i - 1, rng.randbytes(rng.randrange(0, 70_000)))
        for i in range(120)
    ]
    stream = b"".join(frames)
    decoder = FrameDecoder()
    got: list[int] = []
    pos = 0
    while pos < len(stream):
        step = rng.choice((1, 7, 18, 100, 65_536, 200_000))
        decoder.receive_data(stream[pos : pos + step])
        pos += step
        for m in decoder.drain():
            assert isinstance(m, AddRequest)
            assert bytes(m.body) == frames[m.request_id][HEADER_SIZE:]
            assert m.crc == crc32c(m.body)
            got.append(m.request_id)
        assert decoder.error is None
    assert got == list(range(120))
    assert decoder.buffered() == 0
