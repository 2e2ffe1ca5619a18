"""MQTT on a real cluster (ZooKeeper, bookie and broker processes): a device may connect to any
broker. paho-mqtt clients on each broker publish to and subscribe to topics whose bundles the
other broker owns (served by forwarding to the owner), exact and wildcard filters see every
message byte for byte, topics first used on the other broker reach wildcard subscribers, the
official Pulsar client on the owner reads the same log, and after kill -9 of the owner the
clients of the survivor go on."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pulsar
import pytest
from broker_harness import Broker, BrokerProcesses, initialize
from cluster_harness import BookieProcesses
from paho.mqtt.enums import CallbackAPIVersion

NS = "public/default"
SETTINGS = {
    "managedLedgerDefaultEnsembleSize": 2,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
    "messagingProtocols": "pulsar,mqtt",
}
WAIT_S = 30.0


@dataclass
class Cluster:
    zk_url: str
    brokers: BrokerProcesses
    a: Broker
    b: Broker


@pytest.fixture
def cluster(zk_url: str, bookies: BookieProcesses, tmp_path: Path) -> Iterator[Cluster]:
    """ZooKeeper + 2 bookies + 2 brokers serving Pulsar and MQTT (E=Qw=Qa=2), 4 bundles."""
    initialize(zk_url, bundles=4)
    for _ in range(2):
        bookies.start(zk_url)
    procs = BrokerProcesses(tmp_path)
    try:
        a = procs.start(zk_url, SETTINGS)
        b = procs.start(zk_url, SETTINGS)
        yield Cluster(zk_url, procs, a, b)
    finally:
        procs.close()


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def bundle_of(broker: Broker, local: str) -> str:
    url = f"{broker.http_url}/lookup/v2/topic/persistent/{NS}/{local}/bundle"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def owners(broker: Broker) -> dict[str, str | None]:
    return http_json(f"{broker.http_url}/admin/v2/namespaces/{NS}/owners")


class Device:
    """A paho-mqtt 3.1.1 client connected to one broker; received messages are queued."""

    def __init__(self, broker: Broker, client_id: str, clean: bool = True) -> None:
        self.messages: queue.Queue[tuple[str, bytes, int]] = queue.Queue()
        self._connected = threading.Event()
        self._acks: dict[int, Any] = {}
        self._cv = threading.Condition()
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean)
        self.session_present = False
        self.dropped = threading.Event()
        # No automatic reconnect within a test: a taken-over client must stay away.
        self.c.reconnect_delay_set(min_delay=120, max_delay=120)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *_a: self.dropped.set()
        self.c.on_message = lambda _c, _u, m: self.messages.put((m.topic, m.payload, m.qos))
        self.c.on_subscribe = self._on_sub
        self.c.connect("127.0.0.1", broker.port("mqttListenerPort"), keepalive=60)
        self.c.loop_start()
        assert self._connected.wait(WAIT_S), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, flags: Any, _reason: Any, _p: Any) -> None:
        self.session_present = bool(flags.session_present)
        self._connected.set()

    def _on_sub(self, _c: Any, _u: Any, mid: int, reasons: Any, _p: Any) -> None:
        with self._cv:
            self._acks[mid] = reasons
            self._cv.notify_all()

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        result, mid = self.c.subscribe(topic_filter, qos)
        assert result == paho.MQTT_ERR_SUCCESS
        with self._cv:
            assert self._cv.wait_for(lambda: mid in self._acks, WAIT_S), "no SUBACK"
            codes = [int(getattr(r, "value", r)) for r in self._acks.pop(mid)]
        assert codes == [qos], codes

    def publish(self, topic: str, payload: bytes, qos: int = 1, timeout: float = WAIT_S) -> None:
        """Publish; for QoS 1 wait until the broker acknowledged it (its durable write)."""
        info = self.c.publish(topic, payload, qos)
        info.wait_for_publish(timeout)
        assert info.is_published(), f"publish to {topic} not acknowledged in {timeout}s"

    def collect(self, expected: set[tuple[str, bytes]], timeout: float) -> set[tuple[str, bytes]]:
        """Receive until every expected (topic, payload) arrived (bounded); return all seen."""
        seen: set[tuple[str, bytes]] = set()
        deadline = time.monotonic() + timeout
        while not expected <= seen:
            left = deadline - time.monotonic()
            assert left > 0, f"missing {sorted(expected - seen)[:5]} of {len(expected)}"
            try:
                topic, payload, _qos = self.messages.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            seen.add((topic, payload))
        return seen

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def payload(tag: str) -> bytes:
    """A payload that is not UTF-8 text: byte-identity is checked, not a decoding."""
    return tag.encode() + b"\x00\xff" + os.urandom(8)


def split_topics(c: Cluster, count: int) -> tuple[list[str], list[str]]:
    """Have A claim half the bundles and B the other half (each through its own MQTT client's
    first publish); return ``count`` topic names whose bundle A owns and ``count`` B owns."""
    by_bundle: dict[str, list[str]] = {}
    for i in range(200):
        name = f"dev-{i}"
        by_bundle.setdefault(bundle_of(c.a, name), []).append(name)
        if len(by_bundle) == 4 and all(len(v) >= count for v in by_bundle.values()):
            break
    bundles = sorted(by_bundle)
    assert len(bundles) == 4
    for i, bundle in enumerate(bundles):
        device = Device(c.a if i % 2 == 0 else c.b, f"warm-{i}")
        device.publish(by_bundle[bundle][0], b"warm-up", 1)
        device.close()
    held = owners(c.a)
    assert {held[b] for b in bundles[0::2]} == {c.a.broker_id}, held
    assert {held[b] for b in bundles[1::2]} == {c.b.broker_id}, held
    on_a = [t for b in bundles[0::2] for t in by_bundle[b][:count]]
    on_b = [t for b in bundles[1::2] for t in by_bundle[b][:count]]
    return on_a, on_b


def test_devices_on_either_broker_reach_topics_the_other_owns(cluster: Cluster) -> None:
    """Publishers on both brokers (QoS 1 and 0) reach exact subscribers on B and a wildcard
    subscriber on A whatever broker owns each topic; payloads are byte-identical; a topic first
    used on B reaches A's wildcard subscriber; a Pulsar consumer reads the same messages."""
    c = cluster
    on_a, on_b = split_topics(c, 2)
    topics = on_a + on_b
    wild = Device(c.a, "wild-on-a")
    wild.subscribe("#", 1)
    exact = Device(c.b, "exact-on-b")
    for t in topics:
        exact.subscribe(t, 1)
    pub_a = Device(c.a, "pub-on-a")
    pub_b = Device(c.b, "pub-on-b")
    sent: set[tuple[str, bytes]] = set()
    for t in topics:
        for device, qos in ((pub_a, 1), (pub_b, 0)):
            m = payload(f"{t}-q{qos}")
            device.publish(t, m, qos)
            sent.add((t, m))
    assert wild.collect(sent, WAIT_S) == sent
    assert exact.collect(sent, WAIT_S) == sent

    # A topic first used on B (in a bundle B owns) reaches the wildcard subscriber on A.
    late = next(
        f"late-{i}" for i in range(500) if owners(c.a)[bundle_of(c.a, f"late-{i}")] == c.b.broker_id
    )
    m = payload("late")
    pub_b.publish(late, m, 1)
    assert (late, m) in wild.collect({(late, m)}, WAIT_S)

    # The official Pulsar client, connected through either broker, reads the same log.
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{c.a.port('brokerServicePort')},"
        f"127.0.0.1:{c.b.port('brokerServicePort')}",
        operation_timeout_seconds=30,
    )
    try:
        for t in topics:
            consumer = client.subscribe(
                f"persistent://{NS}/{t}",
                "check",
                initial_position=pulsar.InitialPosition.Earliest,
            )
            want = {m for (topic, m) in sent if topic == t}
            got: set[bytes] = set()
            deadline = time.monotonic() + WAIT_S
            while not want <= got:
                assert time.monotonic() < deadline, f"pulsar consumer of {t} missed messages"
                try:
                    msg = consumer.receive(1000)
                except pulsar.Timeout:
                    continue
                got.add(msg.data())
                consumer.acknowledge(msg)
            consumer.close()
    finally:
        client.close()
    for d in (wild, exact, pub_a, pub_b):
        d.close()


class Stream:
    """Numbered QoS 1 publishes to one topic, up to 20 unacknowledged (paho's window), from a
    thread until stopped; ``acked`` are the numbers the broker acknowledged."""

    def __init__(self, device: Device, topic: str) -> None:
        self.device, self.topic = device, topic
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            window: list[tuple[int, Any]] = []
            i = 0
            while not self.stop.is_set() or window:
                if not self.stop.is_set() and len(window) < 20:
                    window.append((i, self.device.c.publish(self.topic, b"seq-%06d" % i, 1)))
                    i += 1
                    continue
                n, info = window.pop(0)
                info.wait_for_publish(45)
                assert info.is_published(), f"publish {n} not acknowledged in 45 s"
                self.acked.append(n)
        except BaseException as e:
            self.error = e

    def finish(self) -> list[int]:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.acked


def audit(broker: Broker, topic: str, want: set[int] | None = None) -> list[int]:
    """Through the Pulsar subscription "audit" of ``topic`` (created at the first call, so
    that the messages after it are kept): the numbers of its ``Stream`` messages in log
    order, read until every number in ``want`` arrived (bounded)."""
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{broker.port('brokerServicePort')}", operation_timeout_seconds=30
    )
    try:
        consumer = client.subscribe(f"persistent://{NS}/{topic}", "audit")
        found: list[int] = []
        deadline = time.monotonic() + WAIT_S
        while want is not None and not want <= set(found):
            assert time.monotonic() < deadline, f"missing {sorted(want - set(found))[:5]}"
            try:
                data = consumer.receive(1000).data()
            except pulsar.Timeout:
                continue
            if data.startswith(b"seq-"):
                found.append(int(data[4:]))
        consumer.close()
        return found
    finally:
        client.close()


def test_clients_of_the_survivor_go_on_after_kill_9_of_the_owner(cluster: Cluster) -> None:
    """Devices on A using topics B owns (forwarded) keep working after kill -9 of B: QoS 1
    publishes are acknowledged again once A serves the topics, and A's exact, wildcard and
    persistent-session subscribers receive everything published after the crash. A stream of
    QoS 1 publishes running through the crash is stored whole and in order (a message sent
    again after the crash may follow a copy stored before it)."""
    c = cluster
    _on_a, on_b = split_topics(c, 2)
    exact = Device(c.a, "exact-on-a")
    for t in on_b:
        exact.subscribe(t, 1)
    durable = Device(c.a, "durable-on-a", clean=False)
    for t in on_b:
        durable.subscribe(t, 1)
    wild = Device(c.a, "wild-on-a")
    wild.subscribe("#", 1)
    pub = Device(c.a, "pub-on-a")
    before = set()
    for t in on_b:
        m = payload(f"{t}-before")
        pub.publish(t, m, 1)
        before.add((t, m))
    for d in (exact, durable, wild):
        d.collect(before, WAIT_S)
    audit(c.a, on_b[0])
    streamer = Device(c.a, "stream-on-a")
    stream = Stream(streamer, on_b[0])
    deadline = time.monotonic() + WAIT_S
    while len(stream.acked) < 200:
        assert stream.error is None
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)

    c.brokers.kill(c.b)
    started = time.monotonic()
    after = set()
    for t in on_b:
        m = payload(f"{t}-after")
        pub.publish(t, m, 1, timeout=45)  # acknowledged once durable on the new owner
        after.add((t, m))
    for d in (exact, durable, wild):
        d.collect(after, 45)
    assert time.monotonic() - started < 50
    acked = stream.finish()
    stored = audit(c.a, on_b[0], set(acked))
    first_seen = list(dict.fromkeys(stored))
    assert first_seen == sorted(first_seen), "the stream was stored out of order"
    streamer.close()
    held = owners(c.a)
    assert {held[bundle_of(c.a, t)] for t in on_b} == {c.a.broker_id}
    for d in (exact, durable, wild, pub):
        d.close()


def test_a_persistent_session_moves_with_its_device_to_the_other_broker(cluster: Cluster) -> None:
    """A device with a persistent session leaves broker A and connects to broker B: its session
    is present there, what was published while it was away is delivered, and so is what comes
    next (A let the session's subscriptions go)."""
    c = cluster
    dev = Device(c.a, "roaming", clean=False)
    dev.subscribe("move-0", 1)
    dev.subscribe("move-1", 1)
    dev.close()
    pub = Device(c.b, "pub-on-b")
    away = {("move-0", payload("away-0")), ("move-1", payload("away-1"))}
    for topic, m in sorted(away):
        pub.publish(topic, m, 1)
    dev = Device(c.b, "roaming", clean=False)
    assert dev.session_present
    dev.collect(away, WAIT_S)
    later = {("move-0", payload("later-0")), ("move-1", payload("later-1"))}
    for topic, m in sorted(later):
        pub.publish(topic, m, 1)
    dev.collect(later, WAIT_S)
    dev.close()
    pub.close()


def test_a_device_still_connected_to_a_is_taken_over_by_its_connection_to_b(
    cluster: Cluster,
) -> None:
    """The same client id connects to B while its connection to A is still open (a device that
    moved on, leaving a half-open connection): A closes the old connection, the new one
    subscribes at once, and messages go to the new connection only."""
    c = cluster
    old = Device(c.a, "twin")
    old.subscribe("twin-topic", 1)
    new = Device(c.b, "twin")
    assert old.dropped.wait(WAIT_S), "the old connection was not closed"
    new.subscribe("twin-topic", 1)
    pub = Device(c.a, "pub-on-a")
    m = payload("twin")
    pub.publish("twin-topic", m, 1)
    assert new.collect({("twin-topic", m)}, WAIT_S) == {("twin-topic", m)}
    assert old.messages.empty()
    for d in (new, pub):
        d.close()
    old.c.loop_stop()
