"""paho-mqtt against the MQTT handler: retained messages, wills, persistent sessions,
session takeover, and state that survives a broker restart."""

from __future__ import annotations

import pytest
import pytest_twisted
from mqtt_harness import Broker, restart_broker, stop_broker


@pytest_twisted.ensureDeferred
async def test_retained_messages(broker: Broker) -> None:
    """Every retained match is delivered on subscribe with the retain flag; live deliveries
    carry none; an empty retained publish clears the topic's retained message."""

    def scenario() -> tuple[list[tuple[str, bytes, bool]], tuple[bytes, bool], list[str]]:
        pub = broker.client("pub")
        pub.publish("r/1", b"one", 1, retain=True)
        pub.publish("r/2", b"two", 1, retain=True)
        pub.publish("r/2", b"two-b", 1, retain=True)
        sub = broker.client("sub")
        sub.subscribe("r/+", 1)
        first = sorted((m.topic, m.payload, m.retain) for m in sub.get_n(2))
        pub.publish("r/1", b"live", 1, retain=True)
        live = sub.get()
        pub.publish("r/1", b"", 1, retain=True)  # clears r/1
        assert sub.get().payload == b""
        late = broker.client("late")
        late.subscribe("r/#", 1)
        after_clear = [m.topic for m in late.get_n(1)]
        assert late.nothing_more()
        for c in (pub, sub, late):
            c.close()
        return first, (live.payload, live.retain), after_clear

    first, live, after_clear = await broker.run(scenario)
    assert first == [("r/1", b"one", True), ("r/2", b"two-b", True)]
    assert live == (b"live", False)
    assert after_clear == ["r/2"]


@pytest_twisted.ensureDeferred
async def test_retained_messages_survive_a_restart(broker: Broker) -> None:
    """Retained messages are durable: a restarted broker still delivers them."""
    await broker.run(lambda: broker.client("p").publish("keep/me", b"v", 1, retain=True))
    restarted = await restart_broker(broker)
    try:

        def scenario() -> tuple[bytes, bool]:
            sub = restarted.client("s")
            sub.subscribe("keep/#", 0)
            m = sub.get()
            sub.close()
            return m.payload, m.retain

        assert await restarted.run(scenario) == (b"v", True)
    finally:
        await stop_broker(restarted)


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
@pytest_twisted.ensureDeferred
async def test_will_on_abnormal_loss_never_on_disconnect(broker: Broker, v5: bool) -> None:
    """The will is published when the connection is lost, not after DISCONNECT."""

    def scenario() -> list[tuple[str, bytes]]:
        watcher = broker.client("watch", v5=v5)
        watcher.subscribe("will/#", 1)
        polite = broker.client("polite", v5=v5, will=("will/polite", b"bye", 1, False))
        polite.close()
        rude = broker.client("rude", v5=v5, will=("will/rude", b"gone", 1, False))
        rude.drop()
        got = [(m.topic, m.payload) for m in watcher.get_n(1)]
        assert watcher.nothing_more()
        watcher.close()
        return got

    assert await broker.run(scenario) == [("will/rude", b"gone")]


@pytest_twisted.ensureDeferred
async def test_will_on_keep_alive_timeout(broker: Broker) -> None:
    """A client silent for 1.5x its keep-alive is dropped and its will published."""

    def scenario() -> tuple[str, bytes]:
        watcher = broker.client("watch")
        watcher.subscribe("ka/#", 1)
        silent = broker.client("silent", keepalive=1, will=("ka/silent", b"timeout", 1, False))
        silent.c.loop_stop()  # no more PINGREQs
        m = watcher.get(timeout=10)
        watcher.close()
        return m.topic, m.payload

    assert await broker.run(scenario) == ("ka/silent", b"timeout")


@pytest_twisted.ensureDeferred
async def test_will_delay_cancelled_by_reconnect(broker: Broker) -> None:
    """An MQTT 5 will with a delay is not published when the client returns in time."""

    def scenario() -> list[bytes]:
        watcher = broker.client("watch")
        watcher.subscribe("wd/#", 1)
        a = broker.client(
            "delayed",
            v5=True,
            clean=False,
            session_expiry=60,
            will=("wd/a", b"late", 1, False),
            will_delay=2,
        )
        a.drop()
        back = broker.client("delayed", v5=True, clean=False, session_expiry=60)
        b = broker.client("prompt", v5=True, will=("wd/b", b"now", 1, False), will_delay=0)
        b.drop()
        got = [m.payload for m in watcher.get_n(1)]
        assert watcher.nothing_more(within=3.0)
        back.close()
        watcher.close()
        return got

    assert await broker.run(scenario) == [b"now"]


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
@pytest_twisted.ensureDeferred
async def test_persistent_session_gets_what_was_published_while_away(
    broker: Broker, v5: bool
) -> None:
    """A persistent session keeps its subscriptions; QoS 1/2 messages published while the client
    was away arrive when it returns, with session-present set; a clean session starts empty."""
    expiry = 300 if v5 else None

    def scenario() -> tuple[bool, bool, list[bytes], bool]:
        first = broker.client("dev", v5=v5, clean=False, session_expiry=expiry)
        present_first = first.session_present
        first.subscribe("away/+", 1)
        first.close()
        pub = broker.client("pub")
        for i in range(3):
            pub.publish(f"away/{i}", f"m{i}".encode(), 1)
        back = broker.client("dev", v5=v5, clean=False, session_expiry=expiry)
        present_back = back.session_present
        got = sorted(m.payload for m in back.get_n(3))
        back.close()
        clean = broker.client("dev", v5=v5, clean=True)
        present_clean = clean.session_present
        clean.close()
        pub.close()
        return present_first, present_back, got, present_clean

    assert await broker.run(scenario) == (False, True, [b"m0", b"m1", b"m2"], False)


@pytest_twisted.ensureDeferred
async def test_persistent_session_survives_a_restart(broker: Broker) -> None:
    """A persistent session's subscriptions are durable: after a broker restart the client
    returns without subscribing again and gets what was published meanwhile."""

    def before() -> None:
        c = broker.client("durable", clean=False)
        c.subscribe("dur/#", 1)
        c.close()
        broker.client("p").publish("dur/x", b"while-away", 1)

    await broker.run(before)
    restarted = await restart_broker(broker)
    try:

        def after() -> tuple[bool, list[bytes]]:
            c = restarted.client("durable", clean=False)
            present = c.session_present
            got = [m.payload for m in c.get_n(1)]
            restarted.client("p").publish("dur/y", b"after", 1)
            got += [m.payload for m in c.get_n(1)]
            c.close()
            return present, got

        assert await restarted.run(after) == (True, [b"while-away", b"after"])
    finally:
        await stop_broker(restarted)


@pytest.mark.parametrize("v5", [False, True], ids=["v311", "v5"])
@pytest_twisted.ensureDeferred
async def test_session_takeover(broker: Broker, v5: bool) -> None:
    """A second connection with the same client id takes over: the first is closed."""

    def scenario() -> tuple[bool, bytes]:
        first = broker.client("same", v5=v5)
        second = broker.client("same", v5=v5)
        assert first.disconnected.wait(10)
        second.subscribe("take/over", 1)
        broker.client("p").publish("take/over", b"x", 1)
        m = second.get()
        second.close()
        first.c.loop_stop()
        return first.disconnected.is_set(), m.payload

    assert await broker.run(scenario) == (True, b"x")


@pytest_twisted.ensureDeferred
async def test_messages_published_while_a_persistent_session_is_away_wait_in_the_log(
    broker: Broker,
) -> None:
    """1,500 QoS 1 messages published while a persistent session's client is away are not
    held by the session (its consumers are closed; the durable subscription keeps them) and
    all reach the client when it returns, in order, once each."""
    n = 1500

    def away() -> None:
        sub = broker.client("away", clean=False)
        assert sub.subscribe("away/t", 1) == [1]
        sub.close()
        pub = broker.client("pub")
        infos = [pub.c.publish("away/t", str(i).encode(), 1) for i in range(n)]
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published()
        pub.close()

    await broker.run(away)
    session = broker.handler.broker.sessions["away"] if broker.handler.broker else None
    assert session is not None
    assert (len(session.queue), session.subs, session.inflight) == (0, {}, {})

    def back() -> list[bytes]:
        sub = broker.client("away", clean=False)
        assert sub.session_present
        got = [m.payload for m in sub.get_n(n, timeout=30)]
        assert sub.nothing_more()
        sub.close()
        return got

    assert await broker.run(back) == [str(i).encode() for i in range(n)]
