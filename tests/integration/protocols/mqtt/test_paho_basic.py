"""paho-mqtt (3.1.1 and 5) against the MQTT handler: connect, publish and subscribe at every
QoS, wildcards, overlapping filters."""

from __future__ import annotations

import pytest
import pytest_twisted
from mqtt_harness import Broker, recv_exactly


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
@pytest_twisted.ensureDeferred
async def test_publish_subscribe_every_qos(broker: Broker, v5: bool) -> None:
    """Messages at QoS 0, 1 and 2 reach a subscriber at min(publish, granted) QoS, in order."""

    def scenario() -> list[tuple[str, bytes, int]]:
        sub = broker.client("sub", v5=v5)
        assert sub.subscribe("a/b", 2) == [2]
        pub = broker.client("pub", v5=v5)
        for qos in (0, 1, 2):
            pub.publish("a/b", f"m{qos}".encode(), qos)
        got = [(m.topic, m.payload, m.qos) for m in sub.get_n(3)]
        sub1 = broker.client("sub1", v5=v5)
        assert sub1.subscribe("a/b", 1) == [1]
        pub.publish("a/b", b"q2", 2)
        low = sub1.get()
        got.append((low.topic, low.payload, low.qos))
        for c in (sub, sub1, pub):
            c.close()
        return got

    got = await broker.run(scenario)
    assert got == [
        ("a/b", b"m0", 0),
        ("a/b", b"m1", 1),
        ("a/b", b"m2", 2),
        ("a/b", b"q2", 1),
    ]


@pytest_twisted.ensureDeferred
async def test_wildcards_cover_existing_and_later_topics(broker: Broker) -> None:
    """+ and # filters match topics existing at SUBSCRIBE and topics created afterwards."""

    def scenario() -> list[str]:
        pub = broker.client("pub")
        pub.publish("home/kitchen/temp", b"before", 1)
        sub = broker.client("sub")
        assert sub.subscribe("home/+/temp", 1) == [1]
        assert sub.subscribe("office/#", 1) == [1]
        pub.publish("home/kitchen/temp", b"k", 1)
        pub.publish("home/garage/temp", b"g", 1)  # created after the SUBSCRIBE
        pub.publish("home/garage/humidity", b"no", 1)
        pub.publish("office", b"o", 1)  # '#' also matches the parent level
        pub.publish("office/a/b", b"ab", 1)
        got = sorted(f"{m.topic}={m.payload.decode()}" for m in sub.get_n(4))
        assert sub.nothing_more()
        sub.close()
        pub.close()
        return got

    got = await broker.run(scenario)
    assert got == ["home/garage/temp=g", "home/kitchen/temp=k", "office/a/b=ab", "office=o"]


@pytest_twisted.ensureDeferred
async def test_dollar_topics_not_matched_by_leading_wildcards(broker: Broker) -> None:
    """'#' and '+/...' skip $-topics; an explicit $SYS/# filter gets them."""

    def scenario() -> tuple[list[str], list[str]]:
        everything = broker.client("all")
        everything.subscribe("#", 0)
        everything.subscribe("+/info", 0)
        sys_sub = broker.client("sys")
        sys_sub.subscribe("$SYS/#", 0)
        pub = broker.client("pub")
        pub.publish("$SYS/info", b"s", 1)
        pub.publish("plain/info", b"p", 1)
        got_all = [m.topic for m in everything.get_n(1)]
        got_sys = [m.topic for m in sys_sub.get_n(1)]
        assert everything.nothing_more()
        for c in (everything, sys_sub, pub):
            c.close()
        return got_all, got_sys

    got_all, got_sys = await broker.run(scenario)
    assert got_all == ["plain/info"]
    assert got_sys == ["$SYS/info"]


@pytest_twisted.ensureDeferred
async def test_overlapping_filters_deliver_once_at_highest_qos(broker: Broker) -> None:
    """A message matching several filters of one client arrives once, at the highest QoS."""

    def scenario() -> list[tuple[bytes, int]]:
        sub = broker.client("sub")
        assert sub.subscribe("s/#", 0) == [0]
        assert sub.subscribe("s/+", 2) == [2]
        assert sub.subscribe("s/x", 1) == [1]
        pub = broker.client("pub")
        pub.publish("s/x", b"one", 2)
        pub.publish("s/y/z", b"two", 2)
        got = sorted((m.payload, m.qos) for m in sub.get_n(2))
        assert sub.nothing_more()
        sub.close()
        pub.close()
        return got

    assert await broker.run(scenario) == [(b"one", 2), (b"two", 0)]


@pytest_twisted.ensureDeferred
async def test_unsubscribe_stops_delivery(broker: Broker) -> None:
    """After UNSUBSCRIBE the client no longer receives the topic; other filters still work."""

    def scenario() -> list[bytes]:
        sub = broker.client("sub")
        sub.subscribe("u/1", 1)
        sub.subscribe("u/2", 1)
        sub.unsubscribe("u/1")
        pub = broker.client("pub")
        pub.publish("u/1", b"gone", 1)
        pub.publish("u/2", b"kept", 1)
        got = [m.payload for m in sub.get_n(1)]
        assert sub.nothing_more()
        sub.close()
        pub.close()
        return got

    assert await broker.run(scenario) == [b"kept"]


@pytest_twisted.ensureDeferred
async def test_empty_client_id(broker: Broker) -> None:
    """An empty client id is accepted with a clean session (3.1.1 and 5, which is told its
    assigned id) and refused without one."""

    def scenario() -> tuple[int, str, int]:
        ok = broker.client("", clean=True)
        ok_code = int(ok.connack[1].value)
        ok.close()
        v5 = broker.client("", v5=True, clean=True)
        assigned = v5.connack[2].AssignedClientIdentifier
        v5.close()
        # paho refuses this locally: a raw CONNECT (3.1.1, clean session 0, empty id).
        with broker.raw() as s:
            s.sendall(b"\x10\x0c\x00\x04MQTT\x04\x00\x00\x3c\x00\x00")
            answer = recv_exactly(s, 4)
            assert recv_exactly(s, 1) == b""  # then the broker closes the connection
        assert answer[:3] == b"\x20\x02\x00"
        return ok_code, assigned, answer[3]

    ok_code, assigned, refused = await broker.run(scenario)
    assert ok_code == 0
    assert assigned.startswith("auto-")
    assert refused == 2  # identifier rejected
