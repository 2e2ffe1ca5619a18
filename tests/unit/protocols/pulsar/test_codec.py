"""Unit tests of the sans-IO Pulsar codec: round trips and bad input."""

from __future__ import annotations

import contextlib
import itertools
import random
import struct
import zlib

import lz4.block
import pytest
import snappy
import zstandard

from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    MAGIC_BROKER_ENTRY_METADATA,
    MAGIC_CRC32C,
    CodecError,
    FrameDecoder,
    FrameTooLargeError,
    SendFrame,
    _varint,
    ack_set_bits,
    ack_set_words,
    build_tail,
    command,
    crc32c,
    decode_batch,
    decode_frame,
    decompress,
    encode_batch,
    encode_command,
    encode_message,
    encode_messages,
    encode_payload_command,
    encode_send_receipt,
    encode_send_receipts,
    message_id,
    metadata_is_complete,
    normalize_tail,
    parse_send,
    split_tail,
    to_signed64,
)

T = pb.BaseCommand


def metadata(**kw: object) -> pb.MessageMetadata:
    fields: dict[str, object] = {"producer_name": "p", "sequence_id": 7, "publish_time": 1000}
    fields.update(kw)
    return pb.MessageMetadata(**fields)  # type: ignore[arg-type]


def send_frame(tail: bytes, seq: int = 7) -> bytes:
    return encode_payload_command(command(T.SEND, "send", producer_id=1, sequence_id=seq), tail)


def test_simple_command_round_trip() -> None:
    """A simple command decodes to the command that was encoded, with no payload."""
    cmd = command(T.LOOKUP, "lookupTopic", topic="persistent://a/b/c", request_id=42)
    frames = list(FrameDecoder().feed(encode_command(cmd)))
    assert len(frames) == 1
    assert frames[0].command == cmd
    assert frames[0].payload is None


def test_simple_command_layout() -> None:
    """totalSize counts the command size field and the command; both are big-endian."""
    raw = encode_command(command(T.PING, "ping"))
    total, size = struct.unpack(">II", raw[:8])
    assert total == len(raw) - 4
    assert size == len(raw) - 8


def test_payload_command_round_trip_keeps_tail_bytes() -> None:
    """A SEND's tail (magic, checksum, metadata, payload) comes back byte for byte."""
    tail = build_tail(metadata(partition_key="k"), b"hello")
    frame = decode_frame(send_frame(tail)[4:])
    assert frame.payload == tail
    assert frame.checksum_ok
    md, payload = split_tail(tail)
    assert (md.partition_key, payload) == ("k", b"hello")
    assert struct.unpack(">H", tail[:2])[0] == MAGIC_CRC32C
    assert struct.unpack(">I", tail[2:6])[0] == crc32c(tail[6:])


def test_bad_checksum_is_reported_not_raised() -> None:
    """A corrupted payload decodes with checksum_ok False so the sender can be told."""
    tail = bytearray(build_tail(metadata(), b"hello"))
    tail[-1] ^= 0xFF
    frame = decode_frame(send_frame(bytes(tail))[4:])
    assert frame.checksum_ok is False


def test_tail_without_checksum_is_given_one() -> None:
    """A pre-v6 tail (no magic) is stored with a checksum, like every other entry."""
    md = metadata().SerializeToString()
    raw = struct.pack(">I", len(md)) + md + b"body"
    stored, ok = normalize_tail(raw)
    assert ok
    assert split_tail(stored)[1] == b"body"


def test_broker_entry_metadata_block_is_skipped() -> None:
    """A leading 0x0e02 block is dropped and the rest kept as the stored entry."""
    tail = build_tail(metadata(), b"x")
    bem = pb.BrokerEntryMetadata(index=3).SerializeToString()
    raw = struct.pack(">HI", MAGIC_BROKER_ENTRY_METADATA, len(bem)) + bem + tail
    stored, ok = normalize_tail(raw)
    assert (stored, ok) == (tail, True)


def test_checksummed_tails_cut_or_corrupted_anywhere() -> None:
    """A checksummed tail (with or without a broker entry metadata block before it) is kept
    as it is with its checksum verdict, or refused with CodecError when cut short or when its
    metadata size runs past it; the block before it never changes the answer."""
    rng = random.Random(16)
    bem = pb.BrokerEntryMetadata(index=3).SerializeToString()
    prefix = struct.pack(">HI", MAGIC_BROKER_ENTRY_METADATA, len(bem)) + bem
    for i in range(2000):
        tail = bytearray(build_tail(metadata(), b"p" * rng.randrange(200)))
        kind = rng.randrange(4)
        if kind == 1:  # a flipped bit anywhere after the checksum field
            at = rng.randrange(6, len(tail))
            tail[at] ^= 1 << rng.randrange(8)
        elif kind == 2:  # cut short
            tail = tail[: rng.randrange(len(tail))]
        elif kind == 3:  # a metadata size past the end
            struct.pack_into(">I", tail, 6, len(tail) - 10 + rng.randrange(1, 2**20))
        data = bytes(tail)
        answers = []
        for raw in (data, prefix + data):
            try:
                answers.append(normalize_tail(raw))
            except CodecError:
                answers.append(None)
        assert answers[0] == answers[1], i
        result = answers[0]
        if len(data) >= 10 and struct.unpack_from(">I", data, 6)[0] <= len(data) - 10:
            if data[:2] == b"\x0e\x01":
                assert result == (data, crc32c(data[6:]) == struct.unpack_from(">I", data, 2)[0])
        elif data[:2] == b"\x0e\x01":
            assert result is None, i


def test_frames_split_anywhere_reassemble() -> None:
    """Frames fed one byte at a time come out whole and in order."""
    cmds = [command(T.FLOW, "flow", consumer_id=i, messagePermits=i + 1) for i in range(5)]
    data = b"".join(encode_command(c) for c in cmds)
    data += send_frame(build_tail(metadata(), b"p" * 100))
    decoder = FrameDecoder()
    out = []
    for i in range(len(data)):
        out.extend(decoder.feed(data[i : i + 1]))
    assert [f.command for f in out[:5]] == cmds
    assert split_tail(out[5].payload or b"")[1] == b"p" * 100
    assert decoder.buffered == 0


def test_oversize_frame_is_refused_before_reading_it() -> None:
    """A frame declaring more than the limit raises at once, from its header alone."""
    decoder = FrameDecoder(max_frame_size=1024)
    with pytest.raises(FrameTooLargeError):
        list(decoder.feed(struct.pack(">I", 1025)))


def test_truncated_frame_waits_for_more() -> None:
    """A partial frame yields nothing and is kept until the rest arrives."""
    raw = encode_command(command(T.PING, "ping"))
    decoder = FrameDecoder()
    assert list(decoder.feed(raw[:-1])) == []
    assert decoder.buffered == len(raw) - 1
    assert len(list(decoder.feed(raw[-1:]))) == 1


@pytest.mark.parametrize(
    "body",
    [
        struct.pack(">I", 100) + b"x",  # command size past the frame
        struct.pack(">I", 3) + b"\xff\xff\xff",  # not protobuf
        struct.pack(">I", 0),  # no type: a required field is missing
        struct.pack(">I", 4) + b"\x08\x0b\x5a\x00",  # FLOW with an empty body
    ],
)
def test_malformed_command_raises_codec_error(body: bytes) -> None:
    """A frame whose command cannot be read raises CodecError."""
    with pytest.raises(CodecError):
        decode_frame(body)


def test_frame_size_below_minimum_is_refused() -> None:
    """A frame too small to hold its command size raises CodecError."""
    with pytest.raises(CodecError):
        list(FrameDecoder().feed(struct.pack(">I", 2) + b"ab"))


def test_metadata_size_past_frame_is_refused() -> None:
    """A payload whose metadata size runs past the frame raises CodecError."""
    bad = struct.pack(">HII", MAGIC_CRC32C, 0, 1000) + b"short"
    with pytest.raises(CodecError):
        decode_frame(send_frame(bad)[4:])


def test_random_bytes_raise_only_codec_errors() -> None:
    """Random input either decodes or raises CodecError: nothing else escapes."""
    rng = random.Random(1234)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        if rng.random() < 0.5:  # a plausible header makes the decoder read further
            data = struct.pack(">I", len(data)) + data
        with contextlib.suppress(CodecError):
            list(FrameDecoder(max_frame_size=4096).feed(data))


def test_batch_round_trip() -> None:
    """A batch payload splits into its messages with their single-message metadata."""
    msgs = [
        (pb.SingleMessageMetadata(partition_key=f"k{i}", payload_size=0), b"v%d" % i)
        for i in range(3)
    ]
    payload = encode_batch(msgs)
    md = metadata(num_messages_in_batch=3)
    out = decode_batch(md, payload)
    assert [(s.partition_key, d) for s, d in out] == [("k0", b"v0"), ("k1", b"v1"), ("k2", b"v2")]


def test_truncated_batch_raises() -> None:
    """A batch shorter than its declared messages raises CodecError."""
    payload = encode_batch([(pb.SingleMessageMetadata(payload_size=0), b"abc")])
    with pytest.raises(CodecError):
        decode_batch(metadata(num_messages_in_batch=2), payload)
    with pytest.raises(CodecError):
        decode_batch(metadata(num_messages_in_batch=1), payload[:-1])


@pytest.mark.parametrize(
    ("kind", "pack"),
    [
        (pb.LZ4, lambda b: lz4.block.compress(b, store_size=False)),
        (pb.ZLIB, zlib.compress),
        (pb.ZSTD, lambda b: zstandard.ZstdCompressor().compress(b)),
        (pb.SNAPPY, snappy.compress),
    ],
)
def test_decompress_each_codec(kind: int, pack: object) -> None:
    """Each compression the client uses decompresses to the original payload."""
    raw = b"abc" * 1000
    md = metadata(compression=kind, uncompressed_size=len(raw))
    assert decompress(md, pack(raw), limit=1 << 20) == raw  # type: ignore[operator]


def test_decompress_refuses_declared_size_over_limit() -> None:
    """A declared uncompressed size above the limit is refused before decompressing."""
    md = metadata(compression=pb.LZ4, uncompressed_size=10_000)
    with pytest.raises(CodecError):
        decompress(md, b"\x00", limit=1000)


@pytest.mark.parametrize(
    ("kind", "pack"),
    [(pb.ZSTD, lambda b: zstandard.ZstdCompressor().compress(b)), (pb.SNAPPY, snappy.compress)],
)
def test_decompress_refuses_data_declaring_more_than_its_metadata(kind: int, pack: object) -> None:
    """zstd and snappy data declare their own size and the libraries set that much aside:
    more than the metadata's uncompressed size is refused before decompressing."""
    md = metadata(compression=kind, uncompressed_size=100)
    with pytest.raises(CodecError, match="declares"):
        decompress(md, pack(b"abc" * 1000), limit=1 << 20)  # type: ignore[operator]


def test_decompress_refuses_a_snappy_block_declaring_gigabytes() -> None:
    """A 9-byte snappy block declaring 4 GiB is refused without asking the library, whatever
    the metadata leaves out."""
    md = metadata(compression=pb.SNAPPY)
    with pytest.raises(CodecError, match="declares"):
        decompress(md, b"\xff\xff\xff\xff\x0f\x00abc", limit=1 << 20)


def test_decompress_garbage_raises_codec_error() -> None:
    """Corrupt compressed data raises CodecError, not the library's own error."""
    md = metadata(compression=pb.ZLIB, uncompressed_size=10)
    with pytest.raises(CodecError):
        decompress(md, b"not zlib", limit=1000)


def test_message_id_negative_values_and_ack_sets() -> None:
    """-1 ids survive the uint64 fields; ack sets pack into signed 64-bit words and back."""
    mid = message_id(-1, -1)
    assert (to_signed64(mid.ledgerId), to_signed64(mid.entryId)) == (-1, -1)
    bits = (1 << 63) | (1 << 70) | 1
    words = ack_set_words(bits, 100)
    assert words[0] < 0  # bit 63 set: a negative int64, as the client writes it
    assert ack_set_bits(words) == bits


_ID_VALUES = [0, 1, 127, 128, 300, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1]


def test_varint_lengths_match_protobuf() -> None:
    """Varints of every length (one to ten bytes) are protobuf's, e.g. as a uint64 field."""
    values = [*range(0, 70_000, 7), *_ID_VALUES, 2**21 - 1, 2**21, 2**28, 2**35, 2**56]
    for value in values:
        expected = pb.MessageIdData(ledgerId=value, entryId=0).SerializeToString()
        assert b"\x08" + _varint(value) + b"\x10\x00" == expected, value


def test_send_receipt_encoding_matches_protobuf() -> None:
    """The hand-built SEND_RECEIPT is byte for byte the protobuf encoding of the same fields."""
    rng = random.Random(3)
    for i in range(3000):
        ids = [*_ID_VALUES, rng.randrange(2**64), rng.randrange(1000)]
        ledger = rng.choice([-1, *ids])
        entry = rng.choice([-1, *ids])
        partition = rng.choice([-1, 0, 5, 2**31 - 1])
        pid, seq, highest = rng.choice(ids), rng.choice(ids), rng.choice(ids)
        expected = encode_command(
            command(
                T.SEND_RECEIPT,
                "send_receipt",
                producer_id=pid,
                sequence_id=seq,
                message_id=message_id(ledger, entry, partition),
                highest_sequence_id=highest,
            )
        )
        assert encode_send_receipt(pid, seq, ledger, entry, partition, highest) == expected, i


def test_message_encoding_matches_protobuf() -> None:
    """The hand-built MESSAGE (with and without an ack set) is byte for byte the protobuf
    encoding, followed by the stored entry unchanged."""
    rng = random.Random(4)
    for i in range(3000):
        ids = [*_ID_VALUES, rng.randrange(2**64), rng.randrange(1000)]
        ledger, entry = rng.choice([-1, *ids]), rng.choice(ids)
        partition = rng.choice([-1, 0, 7])
        cid = rng.choice(ids)
        redeliveries = rng.choice([0, 1, 200, 2**32 - 1])
        n = rng.randrange(1, 200)
        words = ack_set_words(rng.randrange(2**n), n) if rng.random() < 0.5 else []
        tail = build_tail(metadata(), b"m" * rng.randrange(50))
        cmd = command(
            T.MESSAGE,
            "message",
            consumer_id=cid,
            message_id=message_id(ledger, entry, partition),
            redelivery_count=redeliveries,
        )
        cmd.message.ack_set.extend(words)
        expected = encode_payload_command(cmd, tail)
        got = encode_message(cid, ledger, entry, partition, redeliveries, words, tail)
        assert got == expected, i
        frame = next(FrameDecoder().feed(got))
        assert frame.command == cmd
        assert frame.payload == tail


def test_bulk_message_encoding_matches_one_by_one() -> None:
    """``encode_messages`` gives the frames ``encode_message`` gives one by one, joined, over
    runs of entries in one ledger and across ledgers, redeliveries, ack sets and odd ids."""
    rng = random.Random(14)
    for i in range(300):
        ids = [*_ID_VALUES, rng.randrange(2**64), rng.randrange(1000)]
        cid = rng.choice(ids)
        partition = rng.choice([-1, 0, 7, 2**31 - 1])
        ledger = rng.choice([-1, *ids])
        rows = []
        for _ in range(rng.randrange(0, 20)):
            if rng.random() < 0.2:
                ledger = rng.choice([-1, *ids])
            entry = rng.choice([-1, *ids])
            redeliveries = rng.choice([0, 0, 1, 127, 128, 2**32 - 1])
            n = rng.randrange(1, 200)
            words = ack_set_words(rng.randrange(2**n), n) if rng.random() < 0.3 else []
            tail = build_tail(metadata(), b"m" * rng.randrange(300))
            rows.append((ledger, entry, redeliveries, words, tail))
        expected = b"".join(encode_message(cid, r[0], r[1], partition, *r[2:]) for r in rows)
        assert encode_messages(cid, partition, rows) == expected, i


def test_bulk_send_receipt_encoding_matches_one_by_one() -> None:
    """``encode_send_receipts`` gives the frames ``encode_send_receipt`` gives one by one,
    joined (and so the protobuf encoding of each), across ledgers and with odd ids."""
    rng = random.Random(15)
    for i in range(300):
        ids = [*_ID_VALUES, rng.randrange(2**64), rng.randrange(1000)]
        pid = rng.choice(ids)
        partition = rng.choice([-1, 0, 7, 2**31 - 1])
        ledger = rng.choice([-1, *ids])
        rows = []
        for _ in range(rng.randrange(0, 20)):
            if rng.random() < 0.2:
                ledger = rng.choice([-1, *ids])
            entry = rng.choice([-1, *ids])
            rows.append((rng.choice(ids), ledger, entry, rng.choice(ids)))
        expected = b"".join(
            encode_send_receipt(pid, seq, ledger_id, entry_id, partition, highest)
            for seq, ledger_id, entry_id, highest in rows
        )
        got = encode_send_receipts(pid, partition, rows)
        assert got == expected, i
        assert [f.command.send_receipt.sequence_id for f in FrameDecoder().feed(got)] == [
            r[0] for r in rows
        ]


def test_frames_split_at_random_points_reassemble() -> None:
    """Frames cut into random chunks (several frames per chunk, frames across chunks) decode
    to the same commands and payloads, and nothing stays buffered at the end."""
    rng = random.Random(5)
    frames = []
    for i in range(200):
        if i % 3:
            frames.append(encode_command(command(T.FLOW, "flow", consumer_id=i, messagePermits=i)))
        else:
            frames.append(send_frame(build_tail(metadata(), bytes([i % 256]) * i), seq=i))
    data = b"".join(frames)
    expected = [decode_frame(f[4:]) for f in frames]
    decoder = FrameDecoder()
    out = []
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 3, 7, 50, 400, 5000])
        out.extend(decoder.feed(data[pos : pos + step]))
        pos += step
    assert out == expected
    assert decoder.buffered == 0


def test_frames_left_unread_stay_buffered() -> None:
    """A consumer that stops taking frames midway leaves the rest for the next feed."""
    frames = [
        encode_command(command(T.FLOW, "flow", consumer_id=i, messagePermits=1)) for i in range(4)
    ]
    decoder = FrameDecoder()
    it = decoder.feed(b"".join(frames))
    first = next(it)
    it.close()
    assert first.command.flow.consumer_id == 0
    assert decoder.buffered == sum(len(f) for f in frames[1:])
    rest = list(decoder.feed(b""))
    assert [f.command.flow.consumer_id for f in rest] == [1, 2, 3]


def test_metadata_check_reuses_its_scratch_without_carrying_fields_over() -> None:
    """A complete metadata checks True; an incomplete one parsed into the same object next
    checks False (nothing of the first remains); bad layouts raise as split_tail does."""
    scratch = pb.MessageMetadata()
    assert metadata_is_complete(build_tail(metadata(), b"x"), scratch)
    partial = pb.MessageMetadata(producer_name="p").SerializePartialToString()
    rest = struct.pack(">I", len(partial)) + partial + b"x"
    tail = struct.pack(">HI", MAGIC_CRC32C, crc32c(rest)) + rest
    assert not metadata_is_complete(tail, scratch)
    assert not scratch.HasField("sequence_id")
    assert metadata_is_complete(build_tail(metadata(sequence_id=9), b""), scratch)
    assert scratch.sequence_id == 9
    for bad in (b"", b"\x0e\x01" + b"\x00" * 7, struct.pack(">HII", MAGIC_CRC32C, 0, 99)):
        with pytest.raises(CodecError):
            metadata_is_complete(bad, scratch)
    with pytest.raises(CodecError):
        metadata_is_complete(struct.pack(">HII", MAGIC_CRC32C, 0, 2) + b"\xff\xff", scratch)


# -- the SEND fast path ---------------------------------------------------------------------

_EDGES = [0, 1, 127, 128, 300, 16383, 16384, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def _protobuf_send(data: bytes) -> tuple[int, int, int, int] | None:
    """What protobuf makes of a command: a SEND's fields, or None if it is no valid SEND."""
    cmd = pb.BaseCommand()
    try:
        cmd.ParseFromString(data)
    except Exception:
        return None
    if not cmd.IsInitialized() or cmd.type != T.SEND or not cmd.HasField("send"):
        return None
    s = cmd.send
    return s.producer_id, s.sequence_id, s.num_messages, s.highest_sequence_id


def _random_send(rng: random.Random) -> tuple[bytes, bool]:
    """A serialized SEND of random shape, and whether it has the usual shape."""
    fields: dict[str, object] = {}
    usual = True
    for name in ("producer_id", "sequence_id", "highest_sequence_id"):
        if rng.random() < 0.85:
            fields[name] = rng.choice(_EDGES) if rng.random() < 0.5 else rng.randrange(2**64)
        elif name != "highest_sequence_id":
            usual = False  # a required field missing
    if rng.random() < 0.7:
        num = rng.choice([0, 1, 2, 1000, 2**31 - 1, -1, -(2**31)])
        fields["num_messages"] = num
        usual = usual and num >= 0
    if rng.random() < 0.15:
        fields["is_chunk"] = rng.random() < 0.5
        usual = False
    if rng.random() < 0.1:
        fields["txnid_least_bits"] = rng.randrange(2**20)
        usual = False
    if rng.random() < 0.1:
        fields["message_id"] = message_id(rng.randrange(100), rng.randrange(100))
        usual = False
    cmd = command(T.SEND, "send", **fields)
    return cmd.SerializePartialToString(), usual


def test_parse_send_agrees_with_protobuf_on_many_shapes() -> None:
    """On random SENDs (edge values, optional and unusual fields, missing required ones) the
    fast path answers exactly what protobuf decodes whenever it answers, and answers every
    SEND of the usual shape."""
    rng = random.Random(3)
    answered = 0
    for _ in range(5000):
        data, usual = _random_send(rng)
        fast = parse_send(data, 0, len(data))
        if usual:
            assert fast is not None, data.hex()
        if fast is not None:
            answered += 1
            assert fast == _protobuf_send(data), data.hex()
    assert answered > 2000


def test_parse_send_never_accepts_what_protobuf_refuses_or_reads_otherwise() -> None:
    """Mutated SENDs (flipped, cut, inserted and appended bytes): whatever the fast path
    accepts, protobuf decodes to the same fields."""
    rng = random.Random(4)
    accepted = 0
    for _ in range(20000):
        data, _ = _random_send(rng)
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(4)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1 and b:
                del b[rng.randrange(len(b)) :]
            elif op == 2:
                b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
            else:
                b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        mutated = bytes(b)
        fast = parse_send(mutated, 0, len(mutated))
        if fast is not None:
            accepted += 1
            assert fast == _protobuf_send(mutated), mutated.hex()
    assert accepted > 100


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # producer_id 1, sequence_id 2: the plainest SEND
        (bytes.fromhex("0806320408011002"), (1, 2, 1, 0)),
        # a repeated field: the last one wins, as in protobuf
        (bytes.fromhex("08063206080110020805"), (5, 2, 1, 0)),
        # a non-minimal varint (0x81 0x00 is 1)
        (bytes.fromhex("080632050881001002"), (1, 2, 1, 0)),
        # num_messages 0, highest_sequence_id 9
        (bytes.fromhex("0806320808011002180030 09".replace(" ", "")), (1, 2, 0, 9)),
        # a varint of eleven bytes: protobuf's to refuse
        (bytes.fromhex("08063210088180808080808080800110021802"), None),
        # sequence_id missing
        (bytes.fromhex("08063202 0801".replace(" ", "")), None),
        # another command type
        (bytes.fromhex("0807320408011002"), None),
        # a field after the send
        (bytes.fromhex("08063204080110021001"), None),
        # a length that runs past the command
        (bytes.fromhex("0806320508011002"), None),
        # a varint cut by the end of the command
        (bytes.fromhex("08063205080110 0281".replace(" ", "")), None),
    ],
)
def test_parse_send_cases(data: bytes, expected: tuple[int, int, int, int] | None) -> None:
    """Hand-made commands: the fast path's answer (None: left to protobuf)."""
    assert parse_send(data, 0, len(data)) == expected
    if expected is not None:
        assert _protobuf_send(data) == expected


def test_parse_send_reads_only_its_range() -> None:
    """The fast path decodes ``buf[start:end]`` alone: bytes around it change nothing."""
    rng = random.Random(5)
    for _ in range(2000):
        data, _ = _random_send(rng)
        cut = rng.randrange(len(data) + 1)
        inner = data[:cut]
        before = bytes(rng.randrange(256) for _ in range(rng.randrange(4)))
        after = data[cut:] + bytes(rng.randrange(256) for _ in range(rng.randrange(4)))
        buf = before + inner + after
        assert parse_send(buf, len(before), len(before) + cut) == parse_send(inner, 0, cut)


def test_fast_send_decoder_yields_what_protobuf_decodes() -> None:
    """``FrameDecoder(fast_send=True)`` gives a ``SendFrame`` for a usual SEND, with the fields
    and the normalized tail the protobuf path gives; other frames (another shape of SEND, a
    SEND without payload, other commands) come as ``Frame``; fed in pieces, the same."""
    tail = build_tail(metadata(), b"hello")
    bad = bytearray(tail)
    bad[-1] ^= 1
    frames = [
        encode_payload_command(
            command(T.SEND, "send", producer_id=3, sequence_id=9, num_messages=4), tail
        ),
        encode_payload_command(
            command(T.SEND, "send", producer_id=3, sequence_id=10, highest_sequence_id=12),
            bytes(bad),
        ),
        encode_payload_command(
            command(T.SEND, "send", producer_id=3, sequence_id=11, is_chunk=True), tail
        ),
        encode_command(command(T.SEND, "send", producer_id=3, sequence_id=12)),
        encode_command(command(T.PING, "ping")),
    ]
    data = b"".join(frames)
    for pieces in ([data], [data[i : i + 7] for i in range(0, len(data), 7)]):
        decoder = FrameDecoder(fast_send=True)
        out = [f for piece in pieces for f in decoder.feed(piece)]
        assert [type(f).__name__ for f in out] == [
            "SendFrame",
            "SendFrame",
            "Frame",
            "Frame",
            "Frame",
        ]
        assert out[0] == SendFrame(3, 9, 4, 0, tail, True)
        assert out[1] == SendFrame(3, 10, 1, 12, bytes(bad), False)
        for raw, got in zip(frames, out, strict=True):
            reference = decode_frame(raw[4:])
            if isinstance(got, SendFrame):
                s = reference.command.send
                fields = (s.producer_id, s.sequence_id, s.num_messages, s.highest_sequence_id)
                assert got[:4] == fields
                assert (got.payload, got.checksum_ok) == reference[1:]
            else:
                assert got == reference


def test_fast_send_decoder_keeps_the_bounds() -> None:
    """The fast path changes none of the decoder's refusals: an oversize frame, and a command
    size running past its frame, are still codec errors."""
    tail = build_tail(metadata(), b"x")
    frame = encode_payload_command(command(T.SEND, "send", producer_id=1, sequence_id=1), tail)
    with pytest.raises(FrameTooLargeError):
        list(FrameDecoder(len(frame) - 5, fast_send=True).feed(frame))
    broken = frame[:4] + struct.pack(">I", len(frame)) + frame[8:]
    with pytest.raises(CodecError):
        list(FrameDecoder(fast_send=True).feed(broken))
    bad_tail = frame[: -len(tail)] + b"\x0e\x01\x00\x00\x00\x00\x00\x00\xff\xff"
    bad_tail = struct.pack(">I", len(bad_tail) - 4) + bad_tail[4:]
    with pytest.raises(CodecError):
        list(FrameDecoder(fast_send=True).feed(bad_tail))


def test_fast_send_decoder_reassembles_sends_cut_anywhere() -> None:
    """Large and small SENDs between other frames, cut into random pieces (a SEND's tail then
    joined from the pieces held), decode as protobuf decodes the whole frames; a consumer
    that stops after any frame leaves the rest for the next feed, and nothing stays buffered
    at the end."""
    rng = random.Random(11)
    frames = []
    for i in range(120):
        if i % 4 == 0:
            frames.append(encode_command(command(T.FLOW, "flow", consumer_id=i, messagePermits=i)))
        else:
            size = rng.choice([1, 30, 700, 70_000, 150_000])
            tail = build_tail(metadata(), bytes([i % 256]) * size)
            if i % 7 == 0:  # a bad checksum: still a SendFrame, marked
                tail = tail[:-1] + bytes([tail[-1] ^ 1])
            frames.append(send_frame(tail, seq=i))
    data = b"".join(frames)
    expected = [decode_frame(f[4:]) for f in frames]
    decoder = FrameDecoder(fast_send=True)
    out: list[object] = []
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 5, 9, 600, 65_536, 200_000])
        it = decoder.feed(data[pos : pos + step])
        pos += step
        if rng.random() < 0.3:  # take one frame now, the rest on the next feed
            out.extend(itertools.islice(it, 1))
            it.close()
        else:
            out.extend(it)
    out.extend(decoder.feed(b""))
    out.extend(decoder.feed(b""))  # a frame completed by the previous one's leftovers
    assert len(out) == len(expected)
    for got, reference in zip(out, expected, strict=True):
        if isinstance(got, SendFrame):
            s = reference.command.send
            assert got[:4] == (s.producer_id, s.sequence_id, s.num_messages, 0)
            assert (got.payload, got.checksum_ok) == reference[1:]
        else:
            assert got == reference
    assert decoder.buffered == 0
