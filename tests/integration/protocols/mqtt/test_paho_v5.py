"""paho-mqtt 5 against the MQTT handler: user properties, topic aliases, message expiry,
subscription identifiers, shared subscriptions, server keep-alive, the deny list."""

from __future__ import annotations

import contextlib
import queue
import time
from typing import Any

import paho.mqtt.client as paho
import pytest
import pytest_twisted
from mqtt_harness import Broker, start_broker, stop_broker, user_props
from paho.mqtt.properties import Properties


@pytest_twisted.ensureDeferred
async def test_user_properties_and_content_fields_round_trip(broker: Broker) -> None:
    """User properties, content type, response topic and correlation data reach subscribers."""

    def scenario() -> tuple[Any, ...]:
        sub = broker.client("sub", v5=True)
        sub.subscribe("props/t", 1)
        pub = broker.client("pub", v5=True)
        props = user_props(a="1", b="two")
        props.ContentType = "text/plain"
        props.ResponseTopic = "reply/here"
        props.CorrelationData = b"\x01\x02"
        props.PayloadFormatIndicator = 1
        pub.publish("props/t", b"hello", 1, properties=props)
        m = sub.get()
        sub.close()
        pub.close()
        p = m.properties
        return (
            m.payload,
            sorted(p.UserProperty),
            p.ContentType,
            p.ResponseTopic,
            p.CorrelationData,
            p.PayloadFormatIndicator,
        )

    assert await broker.run(scenario) == (
        b"hello",
        [("a", "1"), ("b", "two")],
        "text/plain",
        "reply/here",
        b"\x01\x02",
        1,
    )


@pytest_twisted.ensureDeferred
async def test_user_properties_named_like_the_brokers_own_pass_through(broker: Broker) -> None:
    """A user property named ``mqtt.qos`` or ``mqtt.expiry`` is the client's: forwarded
    unchanged, it sets neither the QoS, the retain flag nor an expiry."""

    def scenario() -> tuple[Any, ...]:
        sub = broker.client("sub", v5=True)
        sub.subscribe("clash/t", 2)
        pub = broker.client("pub", v5=True)
        pairs = [("app", "1"), ("mqtt.qos", "2"), ("mqtt.retain", "1"), ("mqtt.expiry", "1")]
        props = Properties(paho.PacketTypes.PUBLISH)
        props.UserProperty = pairs
        pub.publish("clash/t", b"mine", 0, properties=props)
        m = sub.get()
        sub.close()
        pub.close()
        return (
            m.qos,
            m.retain,
            m.properties.UserProperty,
            hasattr(m.properties, "MessageExpiryInterval"),
        )

    assert await broker.run(scenario) == (
        0,
        False,
        [("app", "1"), ("mqtt.qos", "2"), ("mqtt.retain", "1"), ("mqtt.expiry", "1")],
        False,
    )


@pytest_twisted.ensureDeferred
async def test_a_one_second_expiry_still_reaches_a_connected_subscriber(broker: Broker) -> None:
    """Messages with a 1 s expiry interval are delivered at once to a subscriber that is
    there, with 1 s left: what is left is rounded up, never to 0."""

    def scenario() -> list[tuple[bytes, int]]:
        sub = broker.client("sub", v5=True)
        sub.subscribe("exp1/t", 1)
        pub = broker.client("pub", v5=True)
        props = Properties(paho.PacketTypes.PUBLISH)
        props.MessageExpiryInterval = 1
        for i in range(5):
            pub.publish("exp1/t", bytes([i]), 1, properties=props)
        got = [(m.payload, m.properties.MessageExpiryInterval) for m in sub.get_n(5)]
        sub.close()
        pub.close()
        return got

    assert await broker.run(scenario) == [(bytes([i]), 1) for i in range(5)]


@pytest_twisted.ensureDeferred
async def test_topic_alias_from_the_client(broker: Broker) -> None:
    """A PUBLISH naming only a topic alias the client set earlier goes to that topic."""

    def scenario() -> list[tuple[str, bytes]]:
        sub = broker.client("sub", v5=True)
        sub.subscribe("alias/t", 1)
        pub = broker.client("pub", v5=True)
        p1 = Properties(paho.PacketTypes.PUBLISH)
        p1.TopicAlias = 3
        pub.publish("alias/t", b"first", 1, properties=p1)
        p2 = Properties(paho.PacketTypes.PUBLISH)
        p2.TopicAlias = 3
        pub.publish("", b"second", 1, properties=p2)
        got = [(m.topic, m.payload) for m in sub.get_n(2)]
        sub.close()
        pub.close()
        return got

    assert await broker.run(scenario) == [("alias/t", b"first"), ("alias/t", b"second")]


@pytest_twisted.ensureDeferred
async def test_message_expiry(broker: Broker) -> None:
    """An expired message is not delivered; a live one arrives with the remaining interval."""

    def scenario() -> tuple[list[bytes], int]:
        away = broker.client("away", v5=True, clean=False, session_expiry=60)
        away.subscribe("exp/#", 1)
        away.close()
        pub = broker.client("pub", v5=True)
        short = Properties(paho.PacketTypes.PUBLISH)
        short.MessageExpiryInterval = 1
        pub.publish("exp/short", b"short", 1, properties=short)
        long = Properties(paho.PacketTypes.PUBLISH)
        long.MessageExpiryInterval = 100
        pub.publish("exp/long", b"long", 1, properties=long)
        # Outlive the short one's expiry before returning (a wait on time itself).
        time.sleep(1.5)
        back = broker.client("away", v5=True, clean=False, session_expiry=60)
        got = [m for m in back.get_n(1)]
        assert back.nothing_more()
        back.close()
        pub.close()
        return [m.payload for m in got], got[0].properties.MessageExpiryInterval

    payloads, left = await broker.run(scenario)
    assert payloads == [b"long"]
    assert 90 <= left <= 100


@pytest_twisted.ensureDeferred
async def test_subscription_identifiers(broker: Broker) -> None:
    """A delivery carries the identifiers of every matching subscription."""

    def scenario() -> list[int]:
        sub = broker.client("sub", v5=True)
        p1 = Properties(paho.PacketTypes.SUBSCRIBE)
        p1.SubscriptionIdentifier = 7
        sub.subscribe("ids/#", 1, properties=p1)
        p2 = Properties(paho.PacketTypes.SUBSCRIBE)
        p2.SubscriptionIdentifier = 300
        sub.subscribe("ids/+", 1, properties=p2)
        broker.client("pub", v5=True).publish("ids/x", b"x", 1)
        m = sub.get()
        sub.close()
        return sorted(m.properties.SubscriptionIdentifier)

    assert await broker.run(scenario) == [7, 300]


@pytest_twisted.ensureDeferred
async def test_shared_subscription_splits_messages(broker: Broker) -> None:
    """Members of $share/g/filter share the messages: each arrives at exactly one member;
    a plain subscriber beside them gets all."""

    def scenario() -> tuple[int, int, list[bytes], int]:
        a = broker.client("a", v5=True)
        b = broker.client("b", v5=True)
        plain = broker.client("plain", v5=True)
        assert a.subscribe("$share/g/jobs/+", 1) == [1]
        assert b.subscribe("$share/g/jobs/+", 1) == [1]
        plain.subscribe("jobs/+", 1)
        pub = broker.client("pub", v5=True)
        n = 40
        for i in range(n):
            pub.publish("jobs/q", str(i).encode(), 1)
        plain_got = len(plain.get_n(n))
        got_a: list[bytes] = []
        got_b: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got_a) + len(got_b) < n and time.monotonic() < deadline:
            for client, into in ((a, got_a), (b, got_b)):
                with contextlib.suppress(queue.Empty):
                    into.append(client.get(timeout=0.05).payload)
        for c in (a, b, plain, pub):
            c.close()
        both = sorted(got_a + got_b, key=int)
        return len(got_a), len(got_b), both, plain_got

    n_a, n_b, both, plain_got = await broker.run(scenario)
    assert both == [str(i).encode() for i in range(40)]
    assert n_a > 0
    assert n_b > 0
    assert plain_got == 40


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
@pytest_twisted.ensureDeferred
async def test_deny_list_refuses_subscriptions(v5: bool) -> None:
    """A filter on the deny list gets 0x80 (3.1.1) or 0x87 (5); other filters are granted."""
    broker = await start_broker({"mqttSubscriptionDenyList": "secret/#, admin"})
    try:

        def scenario() -> list[int]:
            c = broker.client("c", v5=v5)
            codes = c.subscribe("secret/x", 1) + c.subscribe("admin", 1) + c.subscribe("ok", 1)
            c.close()
            return codes

        expected = [0x87, 0x87, 1] if v5 else [0x80, 0x80, 1]
        assert await broker.run(scenario) == expected
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_server_keep_alive_and_connack_properties() -> None:
    """With mqttMaxKeepAliveSeconds an MQTT 5 client asking for more is told the server's;
    CONNACK announces receive maximum, packet size and shared subscriptions."""
    broker = await start_broker({"mqttMaxKeepAliveSeconds": 20, "mqttReceiveMaximum": 50})
    try:

        def scenario() -> tuple[int, int, int, int]:
            c = broker.client("c", v5=True, keepalive=120)
            p = c.connack[2]
            c.close()
            return (
                p.ServerKeepAlive,
                p.ReceiveMaximum,
                p.SharedSubscriptionAvailable,
                int(p.MaximumPacketSize > 5 * 1024 * 1024),
            )

        assert await broker.run(scenario) == (20, 50, 1, 1)
    finally:
        await stop_broker(broker)
