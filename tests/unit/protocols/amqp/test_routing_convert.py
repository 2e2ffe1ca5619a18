"""Unit tests of exchange routing and of the AMQP <-> stored message conversion."""

from __future__ import annotations

import pytest

from polybroker.broker_core.messages import Message, decode_entry, encode_entry
from polybroker.protocols.amqp import routing as r
from polybroker.protocols.amqp.codec import BasicProperties
from polybroker.protocols.amqp.convert import (
    AmqpMessage,
    decode_to,
    encode_to,
    from_stored,
    to_stored,
)


@pytest.mark.parametrize(
    ("pattern", "key", "hit"),
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("#.c", "a.b.c", True),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.x.y.c", True),
        ("a.#.c", "a.x.y.d", False),
        ("*", "", False),
        ("#", "", True),
        ("*.*", "a", False),
    ],
)
def test_topic_patterns(pattern: str, key: str, hit: bool) -> None:
    """``*`` is one word, ``#`` zero or more."""
    assert r.topic_matches(pattern, key) is hit


def test_headers_all_and_any() -> None:
    """x-match all needs every pair, any one of them; x- keys are not compared."""
    args = {"x-match": "all", "a": 1, "b": "2", "x-note": "skip"}
    assert r.headers_match(args, {"a": 1, "b": "2"})
    assert not r.headers_match(args, {"a": 1})
    assert r.headers_match({**args, "x-match": "any"}, {"a": 1})
    assert not r.headers_match({**args, "x-match": "any"}, {"c": 1})


def test_route_follows_exchange_bindings_once_and_ends_cycles() -> None:
    """Exchange-to-exchange bindings are followed; a cycle ends; a queue is reached once."""
    ex = {
        "a": r.Exchange("a", r.FANOUT),
        "b": r.Exchange("b", r.DIRECT),
    }
    ex["a"].bindings += [
        r.Binding("a", "b", r.EXCHANGE, ""),
        r.Binding("a", "q1", r.QUEUE, ""),
    ]
    ex["b"].bindings += [
        r.Binding("b", "a", r.EXCHANGE, "k"),
        r.Binding("b", "q1", r.QUEUE, "k"),
        r.Binding("b", "q2", r.QUEUE, "k"),
    ]
    assert r.route(ex, "a", "k", None) == ["q1", "q2"]
    assert r.route(ex, "b", "other", None) == []


def test_amqp_message_survives_the_store() -> None:
    """Properties, typed headers, routing key and timestamp come back from an entry."""
    props = BasicProperties(
        content_type="application/json",
        headers={"n": 5, "s": "text", "nested": {"x": [1, 2]}},
        delivery_mode=2,
        priority=4,
        message_id="id-1",
        timestamp=1_700_000_000,
    )
    msg = AmqpMessage("ex", "rk", props, b"body")
    stored = to_stored(msg)
    assert ("s", "text") in stored.properties  # visible to other protocols as a property
    data = encode_entry([stored], producer_name="p", sequence_id=0, publish_time_ms=5)
    back = from_stored(decode_entry(data)[0])
    assert back.properties == props
    assert (back.exchange, back.routing_key, back.body) == ("ex", "rk", b"body")


def test_foreign_message_reads_as_amqp() -> None:
    """A message another protocol stored reads with its properties as headers."""
    m = Message(payload=b"p", key=b"k", properties=[("a", "1")], event_time_ms=3_000)
    back = from_stored(m, default_exchange="amq.topic")
    assert back.properties.headers == {"a": "1"}
    assert back.properties.timestamp == 3
    assert back.routing_key == "k"


def test_long_foreign_key_fits_a_short_string() -> None:
    """A key longer than 255 bytes is cut to fit the routing-key short string."""
    back = from_stored(Message(payload=b"", key=b"k" * 300))
    assert back.routing_key == "k" * 255


def test_destination_lists_round_trip_and_bad_ones_name_no_queue() -> None:
    """The queues a shared message names come back as written (any characters); a value that
    is not a JSON list of strings names none."""
    names = ["a", "b.c", 'q "x"', "ünï", ","]
    assert decode_to(encode_to(names)) == frozenset(names)
    assert decode_to("not json") == frozenset()
    assert decode_to('{"a": 1}') == frozenset()
    assert decode_to('["a", 1]') == frozenset({"a"})


def _entry(messages: list[Message]) -> bytes:
    return encode_entry(messages, producer_name="t", sequence_id=0, publish_time_ms=1)


def test_alike_publishes_read_back_with_shared_properties_and_their_own_keys() -> None:
    """Stored publishes with the same basic properties read back through one properties
    object and its wire form, each with its own exchange, routing key, body and incarnation;
    one with headers or another timestamp gets its own."""
    props = BasicProperties(delivery_mode=2, content_type="text/plain")
    a = AmqpMessage("ex", "k1", props, b"one")
    b = AmqpMessage("ex", "k2", BasicProperties(delivery_mode=2, content_type="text/plain"), b"two")
    b.incarnation = "inc"
    stored = decode_entry(_entry([to_stored(a), to_stored(b)]))
    ra, rb = (from_stored(m) for m in stored)
    assert (ra.exchange, ra.routing_key, ra.body, ra.incarnation) == ("ex", "k1", b"one", "")
    assert (rb.exchange, rb.routing_key, rb.body, rb.incarnation) == ("ex", "k2", b"two", "inc")
    assert rb.properties is ra.properties
    assert ra.wire_properties() == props.encode()
    h = AmqpMessage("ex", "k", BasicProperties(delivery_mode=2, headers={"n": 1}), b"h")
    t = AmqpMessage("ex", "k", BasicProperties(delivery_mode=2, timestamp=7), b"t")
    rh, rt = (from_stored(m) for m in decode_entry(_entry([to_stored(h), to_stored(t)])))
    assert rh.properties.headers == {"n": 1}
    assert rt.properties.timestamp == 7
    assert rt.wire_properties() == BasicProperties(delivery_mode=2, timestamp=7).encode()
