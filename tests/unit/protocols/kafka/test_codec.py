"""Unit tests of the Kafka codec: framing, request headers, versions and responses."""

from __future__ import annotations

import contextlib
import struct

import pytest
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest

from polybroker.protocols.kafka import codec as c


def _frame(request: object, correlation_id: int = 7, client_id: str = "t") -> bytes:
    request.with_header(correlation_id=correlation_id, client_id=client_id)  # type: ignore[attr-defined]
    return bytes(request.encode(header=True))  # type: ignore[attr-defined]


def test_frame_decoder_splits_a_stream_at_any_boundary() -> None:
    """Frames arrive whole however the stream is cut."""
    stream = b"".join(struct.pack(">i", len(p)) + p for p in (b"abc", b"", b"defgh"))
    for cut in range(len(stream) + 1):
        d = c.FrameDecoder(100)
        assert d.feed(stream[:cut]) + d.feed(stream[cut:]) == [b"abc", b"", b"defgh"]
        assert d.buffered == 0


@pytest.mark.parametrize("size", [101, -1, 1 << 30])
def test_frame_decoder_refuses_oversize_or_negative_frames_before_buffering(size: int) -> None:
    """A frame over the limit is refused from its size prefix alone."""
    with pytest.raises(c.FrameTooLargeError):
        c.FrameDecoder(100).feed(struct.pack(">i", size))


def test_parse_request_decodes_header_and_body() -> None:
    """A Metadata v7 request yields its header fields and typed body."""
    req = c.parse_request(
        _frame(
            MetadataRequest[7](
                topics=[MetadataRequest.MetadataRequestTopic(name="orders")],
                allow_auto_topic_creation=False,
            ),
            42,
            "me",
        )
    )
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (3, 7, 42, "me")
    assert [t.name for t in req.body.topics] == ["orders"]
    assert req.body.allow_auto_topic_creation is False


def test_flexible_request_header_tagged_fields_are_skipped() -> None:
    """DescribeCluster v0 is flexible: header v2's tagged fields are skipped before the body."""
    from kafka.protocol.admin import DescribeClusterRequest

    req = c.parse_request(
        _frame(DescribeClusterRequest[0](include_cluster_authorized_operations=True), 3)
    )
    assert (req.api_key, req.correlation_id) == (60, 3)
    assert req.body.include_cluster_authorized_operations is True


def test_too_new_api_versions_is_marked_unsupported_with_its_correlation_id() -> None:
    """An ApiVersions v3 request (above our v2) parses to an unsupported request."""
    req = c.parse_request(
        _frame(ApiVersionsRequest[3](client_software_name="x", client_software_version="1"), 9)
    )
    assert req.body is None
    assert req.correlation_id == 9
    assert not req.supported


def test_unsupported_api_versions_gets_error_35_and_a_v0_body() -> None:
    """The answer to a too-new ApiVersions decodes as a v0 response with error 35."""
    out = c.encode_unsupported_api_versions(11)
    size, corr = struct.unpack_from(">ii", out)
    assert size == len(out) - 4
    assert corr == 11
    body = ApiVersionsResponse[0].decode(out[8:])
    assert body.error_code == c.UNSUPPORTED_VERSION
    assert [(k.api_key, k.min_version, k.max_version) for k in body.api_keys] == [(18, 0, 2)]


def test_api_versions_response_lists_the_advertised_table() -> None:
    """ApiVersions v2 lists every implemented API with its range."""
    out = c.encode_response(18, 2, 5, c.api_versions_body(2))
    body = ApiVersionsResponse[2].decode(out[8:])
    assert {k.api_key: (k.min_version, k.max_version) for k in body.api_keys} == c.API_VERSIONS


@pytest.mark.parametrize(
    "frame",
    [
        b"\x00\x03",  # header cut short
        struct.pack(">hhih", 1000, 0, 1, -1),  # unknown API key
        struct.pack(">hhih", 3, 99, 1, -1),  # Metadata v99
        struct.pack(">hhih", 3, 7, 1, 50) + b"abc",  # client id runs past the frame
        struct.pack(">hhih", 3, 7, 1, -1) + b"\xff\xff",  # body cut short
        struct.pack(">hhih", 3, 7, 1, -7),  # negative client id length
    ],
)
def test_malformed_requests_raise_codec_errors(frame: bytes) -> None:
    """Malformed, unknown or unsupported requests raise KafkaCodecError, nothing else."""
    with pytest.raises(c.KafkaCodecError):
        c.parse_request(frame)


def test_random_frames_never_raise_anything_but_codec_errors() -> None:
    """Fuzz: garbage after a valid header prefix is refused cleanly."""
    import random

    rng = random.Random(4)
    keys = sorted(c.API_VERSIONS)
    for _ in range(2000):
        key = rng.choice(keys)
        lo, hi = c.API_VERSIONS[key]
        body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))
        frame = struct.pack(">hhih", key, rng.randint(lo, hi), 1, -1) + body
        with contextlib.suppress(c.KafkaCodecError):
            c.parse_request(frame)


@pytest.mark.parametrize("version", range(12))
def test_produce_responses_encode_byte_for_byte_as_the_schema(version: int) -> None:
    """The directly encoded Produce response equals the schema class's bytes at every version."""
    cls = c.response_class(c.API_PRODUCE)
    part = cls.TopicProduceResponse.PartitionProduceResponse
    reference = cls(
        responses=[
            cls.TopicProduceResponse(
                name="topic",
                partition_responses=[
                    part(index=0, error_code=0, base_offset=5, log_start_offset=0),
                    part(index=3, error_code=10, base_offset=-1, log_start_offset=-1),
                ],
            ),
            cls.TopicProduceResponse(name="émpty", partition_responses=[]),
        ],
        throttle_time_ms=0,
    )
    direct = c.ProduceResponse(
        [
            ("topic", [c.ProducedPartition(0, 0, 5, 0), c.ProducedPartition(3, 10, -1, -1)]),
            ("émpty", []),
        ]
    )
    assert direct.encode(version) == bytes(reference.encode(version=version))
    framed = c.encode_response(c.API_PRODUCE, version, 9, direct)
    assert framed == c.encode_response(c.API_PRODUCE, version, 9, reference)


@pytest.mark.parametrize("version", range(4, 18))
def test_fetch_responses_encode_byte_for_byte_as_the_schema(version: int) -> None:
    """The directly encoded Fetch response, its records given in pieces, equals the schema
    class's bytes at every served version (names up to v12, topic ids from v13)."""
    import uuid

    topic_id = uuid.UUID("0b5c6a7e-1f2d-4c3b-9a8e-7d6c5b4a3f21")
    cls = c.response_class(c.API_FETCH)
    data = cls.FetchableTopicResponse.PartitionData
    reference = cls(
        throttle_time_ms=0,
        error_code=0,
        session_id=0,
        responses=[
            cls.FetchableTopicResponse(
                topic="t",
                topic_id=topic_id,
                partitions=[
                    data(
                        partition_index=0,
                        error_code=0,
                        high_watermark=10,
                        last_stable_offset=10,
                        log_start_offset=2,
                        aborted_transactions=[],
                        preferred_read_replica=-1,
                        records=b"abc" + b"x" * 300,
                    ),
                    data(
                        partition_index=1,
                        error_code=1,
                        high_watermark=-1,
                        last_stable_offset=-1,
                        log_start_offset=-1,
                        aborted_transactions=[],
                        preferred_read_replica=-1,
                        records=b"",
                    ),
                ],
            )
        ],
    )
    pieces: list[bytes | memoryview] = [b"abc", memoryview(b"-" + b"x" * 300)[1:]]
    direct = c.FetchResponse(
        [
            (
                "t",
                topic_id.bytes,
                [
                    c.FetchedPartition(0, 0, 10, 2, pieces, 303),
                    c.FetchedPartition(1, 1, -1, -1, [], 0),
                ],
            )
        ]
    )
    assert direct.encode(version) == bytes(reference.encode(version=version))
    framed = c.encode_response(c.API_FETCH, version, 9, direct)
    assert framed == c.encode_response(c.API_FETCH, version, 9, reference)


def _produce_request(version: int) -> bytes:
    from kafka.protocol.producer import ProduceRequest

    data = ProduceRequest.TopicProduceData
    req = ProduceRequest[version](
        transactional_id="tx" if version % 2 else None,
        acks=-1,
        timeout_ms=30_000,
        topic_data=[
            data(
                name="tópic",
                partition_data=[
                    data.PartitionProduceData(index=0, records=b"batch-0" * 40),
                    data.PartitionProduceData(index=7, records=None),
                ],
            ),
            data(name="u", partition_data=[]),
        ],
    )
    return _frame(req, correlation_id=11)


@pytest.mark.parametrize("version", range(3, 12))
def test_produce_requests_decode_directly_as_the_schema_does(version: int) -> None:
    """The direct Produce decoder reads what the schema class writes, at every served version,
    leaving the records as views into the frame."""
    req = c.parse_request(_produce_request(version), c.API_VERSIONS_MODERN)
    b = req.body
    assert isinstance(b, c.ProduceRequestBody)
    assert (req.correlation_id, b.transactional_id, b.acks, b.timeout_ms) == (
        11,
        "tx" if version % 2 else None,
        -1,
        30_000,
    )
    assert [(t.name, [(p.index, p.records) for p in t.partition_data]) for t in b.topic_data] == [
        ("tópic", [(0, b"batch-0" * 40), (7, None)]),
        ("u", []),
    ]


def test_truncated_or_padded_produce_requests_are_codec_errors() -> None:
    """Every truncation of a Produce request, and trailing bytes, raise KafkaCodecError."""
    frame = _produce_request(9)
    for cut in range(10, len(frame)):
        with pytest.raises(c.KafkaCodecError):
            c.parse_request(frame[:cut], c.API_VERSIONS_MODERN)
    with pytest.raises(c.KafkaCodecError):
        c.parse_request(frame + b"\x00", c.API_VERSIONS_MODERN)
    # An array count larger than the frame is refused before any allocation.
    huge = bytearray(_produce_request(3))
    head = 8 + 2 + 1  # api key, version, correlation id; client id "t"
    at = head + 2 + 2 + 2 + 4  # transactional id "tx", acks, timeout
    assert huge[at : at + 4] == (2).to_bytes(4, "big")  # the topic count
    huge[at : at + 4] = (1 << 30).to_bytes(4, "big")
    with pytest.raises(c.KafkaCodecError, match="cannot fit"):
        c.parse_request(bytes(huge), c.API_VERSIONS_MODERN)


def _null_fields(api_key: int, version: int) -> list[str]:
    """The top-level fields of a request that may decode as None but that the schema does not
    let be null at ``version`` (arrays, strings, bytes, structs)."""
    names = []
    for f in c.request_class(api_key)._struct._fields:
        if not f.for_version_q(version) or f.tagged_field_q(version):
            continue
        may_be_null = f.is_array() or f.is_struct() or f.type_str in ("string", "bytes")
        if may_be_null and not f.nullable_for_version_q(version):
            names.append(f.name)
    return names


@pytest.mark.parametrize(
    ("api_key", "version"),
    [
        (k, v)
        for k, (lo, hi) in c.API_VERSIONS_MODERN.items()
        if k != c.API_PRODUCE
        for v in range(lo, hi + 1)
    ],
)
def test_a_null_the_schema_forbids_is_a_codec_error(api_key: int, version: int) -> None:
    """Each non-nullable field of every served request, sent as null, is refused as malformed
    rather than handed to the handler as None (a fuzzed Fetch v12 with null topics once
    reached it and failed there). Where the schema class writes no null (an empty v0 array),
    the handler gets what was written, never None."""
    cls = c.request_class(api_key)
    for name in _null_fields(api_key, version):
        frame = _frame(cls[version](**{name: None}))
        try:
            body = c.parse_request(frame, c.API_VERSIONS_MODERN).body
        except c.KafkaCodecError as e:
            refusal = str(e)
        else:
            refusal = ""
            assert getattr(body, name) is not None, name
        assert not refusal or refusal.endswith("is null"), refusal


def test_a_null_inside_an_array_is_refused_and_allowed_nulls_pass() -> None:
    """A null partitions array inside a Fetch topic is refused with its path; nulls the schema
    allows (Metadata's topics for all topics, a commit's metadata) still parse."""
    from kafka.protocol.consumer import FetchRequest, OffsetCommitRequest

    fetch = FetchRequest[12](
        max_wait_ms=1,
        min_bytes=1,
        topics=[FetchRequest.FetchTopic(topic="t", partitions=None)],
        forgotten_topics_data=[],
    )
    with pytest.raises(c.KafkaCodecError, match=r"Topics\.Partitions is null"):
        c.parse_request(_frame(fetch), c.API_VERSIONS_MODERN)
    everything = c.parse_request(_frame(MetadataRequest[7](topics=None)), c.API_VERSIONS_MODERN)
    assert everything.body.topics is None
    commit = OffsetCommitRequest[8](
        group_id="g",
        generation_id_or_member_epoch=1,
        member_id="m",
        topics=[
            OffsetCommitRequest.OffsetCommitRequestTopic(
                name="t",
                partitions=[
                    OffsetCommitRequest.OffsetCommitRequestTopic.OffsetCommitRequestPartition(
                        partition_index=0, committed_offset=5, committed_metadata=None
                    )
                ],
            )
        ],
    )
    req = c.parse_request(_frame(commit), c.API_VERSIONS_MODERN)
    assert req.body.topics[0].partitions[0].committed_metadata is None


@pytest.mark.parametrize("version", [3, 9])
def test_a_produce_request_with_null_arrays_is_a_codec_error(version: int) -> None:
    """The direct Produce decoder refuses a null topic or partition array, as the schema does."""
    from kafka.protocol.producer import ProduceRequest

    data = ProduceRequest.TopicProduceData
    for topics in (None, [data(name="t", partition_data=None)]):
        req = ProduceRequest[version](acks=1, timeout_ms=1, topic_data=topics)
        with pytest.raises(c.KafkaCodecError, match="null array"):
            c.parse_request(_frame(req), c.API_VERSIONS_MODERN)
