"""paho-mqtt (3.1.1 and 5) against the MQTT handler: connect, publish and subscribe at every
QoS, wildcards, overlapping filters."""

from __future__ import annotations

import pytest
import pytest_twisted
from mqtt_harness import Broker


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
