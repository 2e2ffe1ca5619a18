"""The bookie wire codec: round trips, framing across reads, and every kind of bad input."""

from __future__ import annotations

import random
import re
import struct

import pytest
from crc32c import crc32c

from polybroker.ledger.api import BookieProtocolError
from polybroker.ledger.wire import (
    FLAG_RECOVERY,
    HEADER,
    HEADER_SIZE,
    MULTI_ADD_VERSION,
    STRIDE_READ_VERSION,
    SUPPORTED_VERSIONS,
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
    MultiAddRequest,
    MultiAddResponse,
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
    encode_add_record,
    encode_add_request,
    encode_add_request_of_record,
    encode_add_response,
    encode_multi_add,
    encode_multi_add_parts,
    encode_multi_add_records,
    encode_multi_add_response,
    multi_add_size,
    stride_starts,
)

MESSAGES: list[Message] = [
    HelloRequest(1, 1, 3, "client-é"),
    AddRequest(2, 7, 0, -1, False, b"payload"),
    AddRequest(3, 2**63, 2**36, 41, True, b""),
    ReadRequest(4, 7, 5, fence=True),
    ReadRangeRequest(5, 7, 0, 99, 1 << 20),
    ReadRangeRequest(24, 7, 2, 99, 1 << 20, 3),
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


# -- ADD_MULTI (wire version 2) -------------------------------------------------------------


def _multi(rid: int = 5, ledger: int = 7, entries: int = 3, flags: int = 0) -> bytes:
    items = [(e, e - 1, f"entry-{e}".encode() * (e + 1), flags) for e in range(entries)]
    return b"".join(bytes(p) for p in encode_multi_add(rid, ledger, items))


def _decode_one(data: bytes, max_frame_size: int = 1 << 20) -> Message:
    decoder = FrameDecoder(max_frame_size)
    decoder.receive_data(data)
    message = decoder.next_frame()
    assert message is not None
    return message


def _multi_error(data: bytes) -> FrameError:
    decoder = FrameDecoder()
    decoder.receive_data(data)
    with pytest.raises(FrameError) as info:
        decoder.next_frame()
    return info.value


def test_multi_add_round_trips_with_journal_ready_records() -> None:
    """An ADD_MULTI decodes to its entries, and its records tail is the journal's record
    format verbatim: each [length][crc32c(body)][body] with an ADD body of the ledger."""
    msg = _decode_one(_multi(rid=9, ledger=7, entries=3))
    assert isinstance(msg, MultiAddRequest)
    assert (msg.request_id, msg.ledger_id, msg.recovery) == (9, 7, False)
    assert [(e, lac, bytes(d)) for e, lac, d in msg.entries] == [
        (e, e - 1, f"entry-{e}".encode() * (e + 1)) for e in range(3)
    ]
    records = bytes(msg.records)
    off = 0
    for entry_id, lac, data in msg.entries:
        length, crc = struct.unpack_from(">II", records, off)
        body = records[off + 8 : off + 8 + length]
        assert crc32c(body) == crc
        assert body == struct.pack(">QqqB", 7, entry_id, lac, 0) + bytes(data)
        off += 8 + length
    assert off == len(records)


def test_multi_add_with_recovery_flags_and_its_answer_round_trip() -> None:
    """Records all flagged for recovery make a recovery frame; answers carry status and count."""
    msg = _decode_one(_multi(entries=2, flags=FLAG_RECOVERY))
    assert isinstance(msg, MultiAddRequest)
    assert msg.recovery
    assert decode_all(encode_multi_add_response(4, Status.OK, 7, 2)) == [
        MultiAddResponse(4, Status.OK, "", 7, 2)
    ]
    fenced = MultiAddResponse(5, Status.FENCED, "fenced", 7, 2)
    assert decode_all(fenced.encode()) == [fenced]


def test_multi_add_answers_are_checked_on_the_fast_path() -> None:
    """Several answers in one read decode in order; a bad checksum or an unknown status in a
    short answer is still a frame error."""
    frames = b"".join(encode_multi_add_response(i, Status.OK, 7, i) for i in range(1, 4))
    decoder = FrameDecoder()
    decoder.receive_data(frames)
    assert decoder.drain() == [MultiAddResponse(i, Status.OK, "", 7, i) for i in range(1, 4)]
    good = encode_multi_add_response(9, Status.OK, 7, 2)
    corrupt = good[:-1] + bytes([good[-1] ^ 1])
    unknown = bytearray(good)
    unknown[18] = 200  # the status byte, checksum fixed so only the status is wrong
    struct.pack_into(">I", unknown, 14, crc32c(bytes(unknown[18:])))
    for bad in (corrupt, bytes(unknown)):
        decoder = FrameDecoder()
        decoder.receive_data(bad)
        assert decoder.drain() == []
        assert decoder.error is not None
        assert decoder.error.request_id == 9


def test_multi_add_split_across_reads_decodes() -> None:
    """An ADD_MULTI arriving byte by byte (with a base frame after it) decodes in order."""
    data = _multi(rid=3) + FenceRequest(4, 7).encode()
    decoder = FrameDecoder()
    out: list[Message] = []
    for i in range(len(data)):
        decoder.receive_data(data[i : i + 1])
        out.extend(decoder.drain())
    assert decoder.error is None
    assert [type(m) for m in out] == [MultiAddRequest, FenceRequest]
    first = out[0]
    assert isinstance(first, MultiAddRequest)
    assert [bytes(d) for _, _, d in first.entries][2] == b"entry-2" * 3


def test_every_corrupted_byte_of_a_multi_add_body_is_refused() -> None:
    """Flipping any byte of the body (heads, fields, data) is a FrameError naming the request:
    record checksums cover the records, the frame checksum the rest."""
    data = _multi(rid=77)
    for i in range(HEADER_SIZE, len(data)):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x40
        decoder = FrameDecoder()
        decoder.receive_data(bytes(corrupt))
        assert decoder.drain() == [], i
        assert decoder.error is not None, i
        assert decoder.error.request_id == 77


def test_multi_adds_of_any_count_pass_and_the_frame_checksum_covers_every_record_head() -> None:
    """The frame checksum (multi head and record heads, summed once after the records) holds
    for every count; a frame whose records are intact but whose checksum leaves out a record
    head is refused."""
    for count in (1, 2, 51, 130, 257):
        message = _decode_one(_multi(rid=3, entries=count), max_frame_size=1 << 24)
        assert isinstance(message, MultiAddRequest)
        assert [e for e, _, _ in message.entries] == list(range(count))
    records = [_record(7, e) for e in range(4)]
    assert isinstance(_decode_one(_raw_multi(records)), MultiAddRequest)
    head = struct.pack(">QI", 7, len(records))
    body = head + b"".join(records)
    short = crc32c(head + b"".join(r[:8] for r in records[:3]))
    frame = HEADER.pack(HEADER_SIZE - 4 + len(body), 2, MsgType.ADD_MULTI, 6, short) + body
    error = _multi_error(frame)
    assert (error.status, error.request_id) == (Status.BAD_REQUEST, 6)
    assert re.search("frame checksum", str(error))


def _raw_multi(records: list[bytes], ledger: int = 7, count: int | None = None) -> bytes:
    """An ADD_MULTI with hand-made records and a correct frame checksum."""
    head = struct.pack(">QI", ledger, len(records) if count is None else count)
    heads = head + b"".join(r[:8] for r in records)
    body = head + b"".join(records)
    return HEADER.pack(HEADER_SIZE - 4 + len(body), 2, MsgType.ADD_MULTI, 6, crc32c(heads)) + body


def _record(ledger: int, entry: int, flags: int = 0, data: bytes = b"x") -> bytes:
    body = struct.pack(">QqqB", ledger, entry, entry - 1, flags) + data
    return struct.pack(">II", len(body), crc32c(body)) + body


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (_raw_multi([_record(7, 0)], count=10**9), "claims"),
        (_raw_multi([_record(7, 0)], count=0), "claims"),
        (_raw_multi([_record(8, 0)]), "not allowed"),
        (_raw_multi([_record(7, -0x2000)]), "not allowed"),
        (_raw_multi([_record(7, 0, flags=0x02)]), "not allowed"),
        (_raw_multi([_record(7, 0) + b"\x00"]), "does not fit|trailing"),
        (_raw_multi([_record(7, 0)[:-1] + b"y"]), "record checksum"),
        (_raw_multi([b"\x00\x00\x00\x05" + _record(7, 0)[4:]]), "does not fit"),
    ],
    ids=[
        "huge-count",
        "zero-count",
        "other-ledger",
        "meta-entry-id",
        "unknown-flag",
        "trailing-bytes",
        "record-crc",
        "short-record",
    ],
)
def test_bad_multi_adds_are_refused_before_any_entry_is_used(frame: bytes, match: str) -> None:
    """Counts, lengths, checksums, ledgers, entry ids and flags are all bounded and checked;
    negative (journal meta-record) entry ids never pass."""
    error = _multi_error(frame)
    assert error.status == Status.BAD_REQUEST
    assert error.request_id == 6
    assert re.search(match, str(error))


def test_frame_types_live_in_their_own_wire_version() -> None:
    """An ADD_MULTI in a version-1 header, or a version-1 type in a version-2 header, is refused."""
    multi = bytearray(_multi(rid=8))
    multi[4] = WIRE_VERSION
    error = _multi_error(bytes(multi))
    assert (error.status, error.request_id) == (Status.BAD_REQUEST, 8)
    fence = bytearray(FenceRequest(9, 7).encode())
    fence[4] = MULTI_ADD_VERSION
    error = _multi_error(bytes(fence))
    assert (error.status, error.request_id) == (Status.BAD_REQUEST, 9)
    stride = bytearray(ReadRangeRequest(10, 7, 0, 9, 100, 2).encode())
    assert stride[4:6] == bytes([STRIDE_READ_VERSION, MsgType.READ_STRIDE])
    stride[4] = MULTI_ADD_VERSION
    error = _multi_error(bytes(stride))
    assert (error.status, error.request_id) == (Status.BAD_REQUEST, 10)
    assert {WIRE_VERSION, MULTI_ADD_VERSION, STRIDE_READ_VERSION} == SUPPORTED_VERSIONS


def test_a_range_read_is_a_read_range_frame_unless_strided() -> None:
    """Stride 1 keeps the version-1 READ_RANGE frame (old bookies read it); a stride below 1
    is refused with the request's id."""
    plain = ReadRangeRequest(11, 7, 0, 9, 100).encode()
    assert plain[4:6] == bytes([WIRE_VERSION, MsgType.READ_RANGE])
    body = struct.pack(">QqqII", 7, 0, 9, 100, 0)
    with pytest.raises(FrameError) as e:
        decode_all(_frame(MsgType.READ_STRIDE, 12, body, version=STRIDE_READ_VERSION))
    assert (e.value.status, e.value.request_id) == (Status.BAD_REQUEST, 12)
    assert "stride" in str(e.value)


def test_multi_add_size_predicts_the_frame_size() -> None:
    """``multi_add_size`` is exact, so a client can keep frames under the limit."""
    items = [(e, -1, b"z" * (10 * e), 0) for e in range(5)]
    frame = b"".join(bytes(p) for p in encode_multi_add(1, 2, items))
    assert len(frame) == multi_add_size(sum(10 * e for e in range(5)), 5)


def test_frames_of_ready_records_are_the_frames_of_their_adds() -> None:
    """An ADD_MULTI of ready records, and a version-1 ADD of one record, are byte for byte
    the frames made from the adds' fields (one checksum of each record serves both)."""
    items = [(3, 2, b"hello", 0), (4, 3, b"", 0), (5, 4, b"x" * 3000, 0)]
    records = [encode_add_record(7, e, lac, data, flags) for e, lac, data, flags in items]
    joined = b"".join(bytes(p) for p in encode_multi_add_records(9, 7, records))
    assert joined == b"".join(bytes(p) for p in encode_multi_add(9, 7, items))
    single = b"".join(bytes(p) for p in encode_add_request_of_record(5, records[0]))
    assert single == encode_add_request(5, 7, 3, 2, b"hello")
    (decoded,) = decode_all(joined)
    assert isinstance(decoded, MultiAddRequest)
    assert [(e, lac, bytes(d)) for e, lac, d in decoded.entries] == [i[:3] for i in items]


def test_frames_of_records_in_parts_are_the_frames_of_the_joined_records() -> None:
    """An ADD_MULTI of records given as parts (split anywhere after their 8-byte head, or
    whole) is byte for byte the frame of the joined records."""
    items = [(3, 2, b"hello", 0), (4, 3, b"", 0), (5, 4, b"x" * 3000, 0)]
    records = [encode_add_record(7, e, lac, data, flags) for e, lac, data, flags in items]
    parts = [(records[0][:8], records[0][8:20], records[0][20:]), (records[1],)]
    parts.append((records[2][:8], memoryview(records[2])[8:]))
    nbytes = sum(map(len, records))
    joined = b"".join(bytes(p) for p in encode_multi_add_parts(9, 7, parts, nbytes))
    assert joined == b"".join(bytes(p) for p in encode_multi_add_records(9, 7, records))


def test_whole_frames_in_several_chunks_are_decoded_in_place() -> None:
    """Chunks received before one drain, each holding whole frames, are parsed where they lie:
    an entry's data is a view of the chunk it came in, not of a copy (Rule 3)."""
    first = b"".join(encode_multi_add_records(1, 7, [encode_add_record(7, 0, -1, b"one")]))
    second = b"".join(encode_multi_add_records(2, 7, [encode_add_record(7, 1, 0, b"two")]))
    decoder = FrameDecoder()
    decoder.receive_data(first)
    decoder.receive_data(second)
    out = decoder.drain()
    assert decoder.error is None
    assert [type(m) for m in out] == [MultiAddRequest, MultiAddRequest]
    views = [m.entries[0][2] for m in out]  # type: ignore[union-attr]
    assert [bytes(v) for v in views] == [b"one", b"two"]
    assert [v.obj for v in views] == [first, second]  # type: ignore[union-attr]
    assert views[1].obj is second  # type: ignore[union-attr]
    assert decoder.buffered() == 0


def test_stride_starts_skip_what_is_had_and_stop_at_the_end() -> None:
    """Each residue modulo the stride starts at its first entry not had, within first..last."""
    assert stride_starts(10, 30, 3, set()) == [10, 11, 12]
    assert stride_starts(10, 30, 3, {10, 13, 11}) == [16, 14, 12]
    assert stride_starts(10, 11, 3, set()) == [10, 11]
    assert stride_starts(10, 14, 3, {10, 13}) == [11, 12]
