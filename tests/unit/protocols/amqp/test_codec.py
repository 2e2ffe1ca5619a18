"""Unit tests of the sans-IO AMQP 0-9-1 codec: round trips, pika interop, malformed input."""

from __future__ import annotations

import struct
from decimal import Decimal

import pika.spec
import pytest

from polybroker.protocols.amqp import codec as c


def _frames(data: bytes, frame_max: int = 131072) -> list[c.Frame]:
    reader = c.FrameReader(frame_max)
    reader.feed(c.PROTOCOL_HEADER + data)
    return reader.frames()[1:]


def test_method_round_trip_with_bits_and_tables() -> None:
    """A method with packed bits and a nested table decodes to what was encoded."""
    m = c.QueueDeclare(
        queue="q1",
        durable=True,
        auto_delete=True,
        arguments={"x-message-ttl": 1000, "list": [1, "a", {"b": True}], "none": None},
    )
    (frame,) = _frames(c.encode_method(5, m))
    assert frame == c.MethodFrame(5, m)


def test_decodes_what_pika_encodes() -> None:
    """Method frames and content headers written by pika decode field by field."""
    publish = pika.spec.Basic.Publish(exchange="ex", routing_key="rk", mandatory=True)
    props = pika.spec.BasicProperties(
        content_type="text/plain",
        headers={"h": "v", "n": 7, "big": 2**40, "d": Decimal("1.25")},
        delivery_mode=2,
        timestamp=1234,
        message_id="m1",
    )
    raw = b"".join(
        [
            pika.frame.Method(1, publish).marshal(),
            pika.frame.Header(1, 3, props).marshal(),
            pika.frame.Body(1, b"abc").marshal(),
        ]
    )
    (publish_frame,) = _frames(raw)
    assert isinstance(publish_frame, c.PublishFrame)
    method, header, body = publish_frame.parts()
    assert isinstance(method, c.MethodFrame)
    assert method.method == c.BasicPublish(exchange="ex", routing_key="rk", mandatory=True)
    assert isinstance(header, c.HeaderFrame)
    assert header.body_size == 3
    assert header.properties.content_type == "text/plain"
    assert header.properties.delivery_mode == 2
    assert header.properties.timestamp == 1234
    assert header.properties.headers == {
        "h": "v",
        "n": 7,
        "big": 2**40,
        "d": Decimal("1.25"),
    }
    assert body == c.BodyFrame(1, b"abc")


def test_pika_decodes_what_we_encode() -> None:
    """Our deliver + header + body frames decode with pika's own frame decoder."""
    props = c.BasicProperties(content_type="a/b", headers={"k": "v"}, delivery_mode=1)
    deliver = c.BasicDeliver(consumer_tag="ct", delivery_tag=9, exchange="e", routing_key="r")
    data = c.encode_content(1, deliver, props, b"x" * 10, frame_max=12)
    frames = []
    while data:
        used, frame = pika.frame.decode_frame(data)
        assert used > 0
        frames.append(frame)
        data = data[used:]
    assert frames[0].method.delivery_tag == 9
    assert frames[1].properties.headers == {"k": "v"}
    assert b"".join(f.fragment for f in frames[2:]) == b"x" * 10
    assert len(frames) == 2 + 3  # 10 body bytes in frames of at most 4


def test_partial_input_waits_for_the_rest() -> None:
    """A frame split across reads is yielded once it is complete."""
    raw = c.PROTOCOL_HEADER + c.encode_method(0, c.ConnectionTuneOk(10, 131072, 60))
    reader = c.FrameReader()
    got: list[c.Frame] = []
    for i in range(len(raw)):
        reader.feed(raw[i : i + 1])
        got.extend(reader.frames())
    assert got == [c.ProtocolHeaderFrame(), c.MethodFrame(0, c.ConnectionTuneOk(10, 131072, 60))]


def test_heartbeat_and_unknown_frame_type() -> None:
    """A heartbeat decodes; an unknown frame type is a frame error."""
    assert _frames(c.encode_heartbeat()) == [c.HeartbeatFrame(0)]
    with pytest.raises(c.AmqpError) as e:
        _frames(struct.pack(">BHI", 7, 0, 0) + b"\xce")
    assert e.value.code == c.FRAME_ERROR


def test_bad_protocol_header() -> None:
    """Anything but the 0-9-1 header is refused, as soon as a byte differs."""
    reader = c.FrameReader()
    reader.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(c.BadProtocolHeader):
        reader.frames()
    reader = c.FrameReader()
    reader.feed(b"AMQP\x00\x00\x08\x00")
    with pytest.raises(c.BadProtocolHeader):
        reader.frames()


def test_wrong_frame_end_is_a_frame_error() -> None:
    """A frame whose last octet is not 0xCE is a frame error."""
    raw = bytearray(c.encode_method(1, c.ChannelOpen()))
    raw[-1] = 0x00
    with pytest.raises(c.AmqpError) as e:
        _frames(bytes(raw))
    assert e.value.code == c.FRAME_ERROR
    assert e.value.hard


def test_oversize_frame_refused_before_its_body_arrives() -> None:
    """A frame announcing more than frame-max is refused from its 7-byte head alone."""
    with pytest.raises(c.AmqpError) as e:
        _frames(struct.pack(">BHI", 3, 1, 10_000_000), frame_max=4096)
    assert e.value.code == c.FRAME_ERROR


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\x0a",  # class id only
        struct.pack(">HH", 50, 10) + b"\x00",  # truncated queue.declare
        struct.pack(">HH", 50, 10) + b"\x00\x00\x05ab",  # short string overruns
        struct.pack(">HH", 40, 30) + b"\x00\x00" + b"\x00\x00\x00\x00" + b"\x00\xff\xff\xff\xff",
        struct.pack(">HH", 50, 20) + b"\x00\x00\x01q\x00\x00\x00" + b"\x00\x00\x00\x03\x01aZ",
        struct.pack(">HH", 60, 40) + b"\x00\x00\x02e",  # basic.publish cut in its exchange
        struct.pack(">HH", 60, 40) + b"\x00\x00\x00\x05k",  # ... in its routing key
        struct.pack(">HH", 60, 40) + b"\x00\x00\x01\xff\x00\x00",  # exchange not UTF-8
    ],
)
def test_truncated_or_malformed_arguments_are_syntax_errors(payload: bytes) -> None:
    """Arguments that overrun the frame or use unknown value types are syntax errors."""
    with pytest.raises(c.AmqpError) as e:
        _frames(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert e.value.code == c.SYNTAX_ERROR


def test_unknown_method_is_command_invalid() -> None:
    """A class/method pair the spec lacks is command-invalid."""
    payload = struct.pack(">HH", 60, 999)
    with pytest.raises(c.AmqpError) as e:
        _frames(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert e.value.code == c.COMMAND_INVALID


def test_deeply_nested_table_is_refused() -> None:
    """A table nested beyond the bound is a syntax error, not a recursion crash."""
    value = b"V"
    for _ in range(c.MAX_TABLE_DEPTH + 5):
        body = b"\x01k" + value
        value = b"F" + struct.pack(">I", len(body)) + body
    table = value[1:]
    payload = struct.pack(">HH", 10, 11) + table + b"\x05PLAIN" + b"\x00\x00\x00\x00" + b"\x00"
    with pytest.raises(c.AmqpError) as e:
        _frames(struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce")
    assert e.value.code == c.SYNTAX_ERROR


def test_content_properties_round_trip() -> None:
    """Every basic property survives an encode and decode."""
    props = c.BasicProperties(
        content_type="t",
        content_encoding="e",
        headers={"a": b"raw"},
        delivery_mode=2,
        priority=3,
        correlation_id="c",
        reply_to="r",
        expiration="100",
        message_id="m",
        timestamp=42,
        type="ty",
        user_id="u",
        app_id="ap",
        cluster_id="cl",
    )
    data = c.encode_content(2, c.BasicGetOk(delivery_tag=1), props, b"", frame_max=4096)
    frames = _frames(data)
    assert len(frames) == 2
    assert isinstance(frames[1], c.HeaderFrame)
    assert frames[1].properties == props


def test_basic_publish_and_deliver_fast_paths_match_the_generic_codec() -> None:
    """The hand-packed publish decoder and deliver encoder agree with the generic ones."""
    for m in (
        c.BasicPublish(7, "ex", "rk", True, False),
        c.BasicPublish(0, "", "", False, True),
        c.BasicPublish(0, "é" * 100, "ü" * 100, True, True),
        c.BasicAck(2**63 + 5, True),
        c.BasicAck(1, False),
    ):
        assert c.decode_method(m.encode()) == m
    d = c.BasicDeliver("ctag", 2**40, True, "ex", "q")
    data = c.encode_content(1, d, c.BasicProperties(), b"", 4096)
    assert data.startswith(c.encode_method(1, d))


def test_basic_ack_packed_directly_matches_the_generic_encoding() -> None:
    """The direct packing of basic.ack gives the bytes of the generic encoder, and reads back."""
    for method in (c.BasicAck(), c.BasicAck(7, True), c.BasicAck(2**64 - 1, False)):
        raw = c.encode_method(5, method)
        assert raw == c._frame(c.FRAME_METHOD, 5, method.encode())
        reader = c.FrameReader(4096, expect_header=False)
        reader.feed(raw)
        assert reader.frames() == [c.MethodFrame(5, method)]


def _publish_frames(channel: int, body: bytes, frame_max: int = 131072, **props: object) -> bytes:
    return c.encode_content(
        channel,
        c.BasicPublish(exchange="ex", routing_key="rk"),
        c.BasicProperties(**props),  # type: ignore[arg-type]
        body,
        frame_max,
    )


def test_a_whole_publish_reads_as_one_frame_equal_to_its_three() -> None:
    """A publish whose method, header and body frames are all buffered reads as one
    ``PublishFrame`` whose parts are what the frames read one by one give; the frames after
    it read as usual."""
    raw = _publish_frames(3, b"body", content_type="t/p", delivery_mode=2)
    after = c.encode_method(3, c.BasicAck(7, False))
    frames = _frames(raw + after)
    assert len(frames) == 2
    fused, ack = frames
    assert isinstance(fused, c.PublishFrame)
    assert (fused.channel, fused.body_size, fused.body) == (3, 4, b"body")
    one_by_one = c.FrameReader(131072, expect_header=False)
    one_by_one.feed(raw)
    assert fused.parts() == one_by_one.frames(limit=3)
    assert ack == c.MethodFrame(3, c.BasicAck(7, False))


def test_an_empty_body_publish_is_method_and_header_only() -> None:
    """A publish of an empty body (no body frame) reads as one frame with an empty body."""
    (fused,) = _frames(_publish_frames(1, b""))
    assert isinstance(fused, c.PublishFrame)
    assert fused.body == b""
    assert [type(f) for f in fused.parts()] == [c.MethodFrame, c.HeaderFrame]


def test_a_publish_not_all_buffered_or_in_several_body_frames_reads_frame_by_frame() -> None:
    """Only whole single-body publishes are read as one frame: a publish split across inputs
    or whose body spans several frames reads as its frames, in order."""
    raw = _publish_frames(1, b"abcdef")
    reader = c.FrameReader(131072, expect_header=False)
    reader.feed(raw[:-3])
    first = reader.frames()
    reader.feed(raw[-3:])
    rest = reader.frames()
    assert [type(f) for f in first + rest] == [c.MethodFrame, c.HeaderFrame, c.BodyFrame]
    big = _publish_frames(1, b"x" * 10000, frame_max=4096)
    assert [type(f) for f in _frames(big)] == [c.MethodFrame, c.HeaderFrame] + [c.BodyFrame] * 3


def test_a_malformed_header_after_a_publish_is_reported_as_before() -> None:
    """A publish followed by a bad content header (trailing bytes) is not read as one: the
    header frame raises the error it raises on its own."""
    method = c.encode_method(1, c.BasicPublish(exchange="", routing_key="q"))
    header = (60).to_bytes(2, "big") + b"\x00\x00" + (1).to_bytes(8, "big") + b"\x00\x00!"
    raw = method + c._frame(c.FRAME_HEADER, 1, header) + c._frame(c.FRAME_BODY, 1, b"z")
    with pytest.raises(c.AmqpError) as e:
        _frames(raw)
    assert e.value.code == c.FRAME_ERROR


def test_publishes_share_decoded_properties_only_without_headers() -> None:
    """Publishes whose properties are the same bytes share one decoded object, unless they
    carry headers (a mutable table)."""
    plain = _frames(_publish_frames(1, b"a", delivery_mode=2) * 2)
    assert plain[0].properties is plain[1].properties  # type: ignore[union-attr]
    headed = _frames(_publish_frames(1, b"a", headers={"h": 1}) * 2)
    assert headed[0].properties == headed[1].properties  # type: ignore[union-attr]
    assert headed[0].properties is not headed[1].properties  # type: ignore[union-attr]
