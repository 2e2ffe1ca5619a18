"""The one-log message format: every protocol's messages survive the stored entry."""

from __future__ import annotations

import struct

import pytest

from polybroker.broker_core import messages as fmt
from polybroker.broker_core.messages import Message, MessageFormatError
from polybroker.protocols.pulsar import codec as pulsar_codec


def _entry(msgs: list[Message], compression: str = "none") -> bytes:
    return fmt.encode_entry(
        msgs,
        producer_name="p",
        sequence_id=7,
        publish_time_ms=1_700_000_000_000,
        compression=compression,
    )


def test_lone_message_round_trips_every_field() -> None:
    """Key, payload, properties, event time and publish time survive a lone message."""
    m = Message(b"\x00payload", key=b"k1", properties=[("a", "1"), ("b", "2")], event_time_ms=42)
    [out] = fmt.decode_entry(_entry([m]))
    assert (out.payload, out.key, out.properties, out.event_time_ms) == (
        b"\x00payload",
        b"k1",
        [("a", "1"), ("b", "2")],
        42,
    )
    assert out.publish_time_ms == 1_700_000_000_000
    assert out.sequence_id == 7


@pytest.mark.parametrize("compression", ["none", "lz4", "zlib", "zstd", "snappy"])
def test_batch_round_trips_with_every_compression(compression: str) -> None:
    """A batch of several messages decodes to the same messages, in order, compressed or not."""
    msgs = [
        Message(
            b"v%d" % i * 20, key=None if i % 2 else b"\xff\xfe%d" % i, properties=[("i", str(i))]
        )
        for i in range(5)
    ]
    out = fmt.decode_entry(_entry(msgs, compression))
    assert [(m.payload, m.key, m.properties) for m in out] == [
        (m.payload, m.key, m.properties) for m in msgs
    ]
    assert [m.sequence_id for m in out] == [7, 8, 9, 10, 11]


def test_stored_entry_is_what_the_pulsar_codec_reads() -> None:
    """The Pulsar handler's codec parses our entries: same magic, checksum and field numbers."""
    data = _entry([Message(b"a", key=b"k"), Message(b"bb", key=b"k2")], "lz4")
    assert fmt.verify_checksum(data)
    md, payload = pulsar_codec.split_tail(data)
    assert md.num_messages_in_batch == 2
    assert md.producer_name == "p"
    body = pulsar_codec.decompress(md, payload, 1 << 20)
    parts = pulsar_codec.decode_batch(md, body)
    assert [(s.partition_key, p) for s, p in parts] == [("k", b"a"), ("k2", b"bb")]


def test_pulsar_built_entry_decodes() -> None:
    """An entry as the Pulsar client builds it (batch, ordering key) decodes here."""
    pb = pulsar_codec.pb
    smm = pb.SingleMessageMetadata(partition_key="pk", ordering_key=b"ok", event_time=5)
    smm.properties.add(key="x", value="y")
    md = pb.MessageMetadata(
        producer_name="c", sequence_id=3, publish_time=9, num_messages_in_batch=1
    )
    tail = pulsar_codec.build_tail(md, pulsar_codec.encode_batch([(smm, b"hello")]))
    [m] = fmt.decode_entry(tail)
    assert (m.payload, m.key, m.properties, m.event_time_ms, m.publish_time_ms) == (
        b"hello",
        b"ok",
        [("x", "y")],
        5,
        9,
    )


def test_foreign_format_converts_lazily() -> None:
    """A registered foreign format is decoded by its decoder and converted for Pulsar readers."""

    def decode(native: bytes, template: Message) -> list[Message]:
        return [
            Message(part, publish_time_ms=template.publish_time_ms) for part in native.split(b",")
        ]

    fmt.register_format("test-csv", decode)
    data = fmt.encode_native_entry(
        "test-csv", b"a,b,c", num_messages=3, producer_name="k", sequence_id=0, publish_time_ms=5
    )
    assert fmt.entry_format(data) == "test-csv"
    assert [m.payload for m in fmt.decode_entry(data)] == [b"a", b"b", b"c"]
    pulsar_entry = fmt.to_pulsar_entry(data)
    assert fmt.entry_format(pulsar_entry) == "pulsar"
    assert [m.payload for m in fmt.decode_entry(pulsar_entry)] == [b"a", b"b", b"c"]
    plain = _entry([Message(b"z")])
    assert fmt.to_pulsar_entry(plain) is plain


def test_a_pulsar_property_naming_the_format_does_not_make_an_entry_foreign() -> None:
    """Only the writer of a foreign entry marks it; a producer's property is just a property."""
    fmt.register_format("test-csv", lambda native, template: [Message(b"never")])
    data = _entry([Message(b"hello", properties=[(fmt.FORMAT_PROPERTY, "test-csv")])])
    assert fmt.entry_format(data) == "pulsar"
    assert fmt.to_pulsar_entry(data) is data
    (got,) = fmt.decode_entry(data)
    assert got.payload == b"hello"
    assert got.properties == [(fmt.FORMAT_PROPERTY, "test-csv")]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x0e\x01\x00\x00",
        b"\x0e\x02" + b"\x00" * 20,
        b"\x0e\x01\x00\x00\x00\x00" + struct.pack(">I", 1000) + b"\x01",
        b"\x0e\x01\x00\x00\x00\x00" + struct.pack(">I", 3) + b"\xff\xff\xff",
    ],
)
def test_garbage_is_a_clear_error(data: bytes) -> None:
    """Malformed entries raise MessageFormatError, never anything else."""
    with pytest.raises(MessageFormatError):
        fmt.decode_entry(data)


def test_batch_claims_are_bounded() -> None:
    """A batch whose sizes run past its body, or whose compressed size lies, is refused."""
    good = _entry([Message(b"a" * 10), Message(b"b" * 10)])
    md, payload = fmt.split_entry(good)
    md.num_messages_in_batch = 3
    with pytest.raises(MessageFormatError):
        fmt.decode_entry(fmt._frame(md, payload))
    big = _entry([Message(b"x" * 5000), Message(b"y")], "zstd")
    with pytest.raises(MessageFormatError):
        fmt.decode_entry(big, max_size=1000)


def test_unknown_format_without_decoder_is_an_error() -> None:
    """An entry tagged with a format nobody registered is refused, not misread as Pulsar."""
    data = fmt.encode_native_entry(
        "nobody", b"x", num_messages=1, producer_name="k", sequence_id=0, publish_time_ms=0
    )
    with pytest.raises(MessageFormatError, match="nobody"):
        fmt.decode_entry(data)
