"""AMQP on a real cluster (ZooKeeper, bookie and broker processes, real pika): a client may
connect to any broker. One broker serves each vhost (the owner of its control topic); a
connection that reaches the other broker is relayed to it, so exchanges, queues and bindings
declared through one broker serve clients of both, a queue's messages are delivered once
across consumers on both brokers, exclusive queues are exclusive cluster-wide, and after
kill -9 of the vhost's broker the clients reconnect through the survivor and find every
confirmed message of their durable queue."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pulsar
import pytest
from broker_harness import Broker, BrokerProcesses, initialize
from cluster_harness import BookieProcesses
from zk_server import ZooKeeperServer

SETTINGS = {
    "managedLedgerDefaultEnsembleSize": 2,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
    "messagingProtocols": "pulsar,amqp",
}
WAIT_S = 30.0
CONTROL = "amqp.vhost"


@dataclass
class Cluster:
    zk_url: str
    brokers: BrokerProcesses
    a: Broker
    b: Broker

    def owner(self) -> Broker:
        """The broker that serves vhost ``/`` (once a connection made one claim it), as a
        live broker's lookup answers."""
        live = self.brokers.running[0]
        url = f"{live.http_url}/lookup/v2/topic/persistent/public/default/{CONTROL}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            http = json.loads(resp.read())["httpUrl"]
        return self.a if http.rstrip("/") == self.a.http_url else self.b

    def other(self, broker: Broker) -> Broker:
        return self.b if broker is self.a else self.a


def start_cluster(zk_url: str, bookies: BookieProcesses, root: Path, n_bookies: int = 2) -> Cluster:
    initialize(zk_url, bundles=4)
    for _ in range(n_bookies):
        bookies.start(zk_url)
    procs = BrokerProcesses(root)
    try:
        return Cluster(zk_url, procs, procs.start(zk_url, SETTINGS), procs.start(zk_url, SETTINGS))
    except BaseException:
        procs.close()
        raise


@pytest.fixture(scope="module")
def shared(
    zookeeper_server: ZooKeeperServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """ZooKeeper + 2 bookies + 2 brokers serving Pulsar and AMQP, shared by the tests that
    leave every process running (each uses names of its own)."""
    root = tmp_path_factory.mktemp("amqp-cluster")
    procs = BookieProcesses(root)
    try:
        cluster = start_cluster(zookeeper_server.url("/amqp-cluster"), procs, root)
        try:
            connect(cluster.a).close()  # the vhost is served from here on
            yield cluster
        finally:
            cluster.brokers.close()
    finally:
        procs.close()


def params(broker: Broker) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        "127.0.0.1",
        broker.port("amqpListenerPort"),
        heartbeat=30,
        blocked_connection_timeout=WAIT_S,
        socket_timeout=10,
        connection_attempts=1,
    )


def connect(broker: Broker, within: float = WAIT_S) -> pika.BlockingConnection:
    """A connection through ``broker``; refusals while the vhost moves are retried (bounded)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return pika.BlockingConnection(params(broker))
        except pika.exceptions.AMQPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)  # backoff between connection attempts


def drain(
    channels: list[Any], done: Callable[[], bool], timeout: float = WAIT_S, what: str = ""
) -> None:
    """Pump every channel's connection until ``done()`` (bounded)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        for ch in channels:
            ch.connection.process_data_events(time_limit=0.05)


def test_objects_declared_through_one_broker_serve_clients_of_both(shared: Cluster) -> None:
    """Declare on A, publish on B, consume on A and B: each message is delivered once, acks
    and requeue work across the two brokers."""
    on_a, on_b = connect(shared.a), connect(shared.b)
    try:
        ca, cb = on_a.channel(), on_b.channel()
        ca.exchange_declare("orders", "direct", durable=True)
        ca.queue_declare("work", durable=True)
        ca.queue_bind("work", "orders", "k")
        cb.confirm_delivery()
        bodies = [f"m{i}".encode() for i in range(40)]
        for body in bodies:
            cb.basic_publish("orders", "k", body, pika.BasicProperties(delivery_mode=2))
        got: dict[str, list[bytes]] = {"a": [], "b": []}
        for name, ch in (("a", ca), ("b", cb)):
            ch.basic_qos(prefetch_count=1)

            def on_message(c: Any, method: Any, _props: Any, body: bytes, name: str = name) -> None:
                got[name].append(body)
                c.basic_ack(method.delivery_tag)

            ch.basic_consume("work", on_message, consumer_tag=f"c-{name}")
        drain([ca, cb], lambda: len(got["a"]) + len(got["b"]) >= len(bodies), what="consume")
        assert sorted(got["a"] + got["b"]) == sorted(bodies)  # each message once
        assert got["a"]
        assert got["b"]
        ca.basic_cancel("c-a")
        cb.basic_cancel("c-b")
        # Requeue: rejected through B, redelivered through A.
        cb.basic_publish("orders", "k", b"again", pika.BasicProperties(delivery_mode=2))
        method, _, body = poll_get(cb, "work")
        assert (body, method.redelivered) == (b"again", False)
        cb.basic_nack(method.delivery_tag, requeue=True)
        method, _, body = poll_get(ca, "work")
        assert (body, method.redelivered) == (b"again", True)
        ca.basic_ack(method.delivery_tag)
        assert cb.queue_declare("work", passive=True).method.message_count == 0
        assert ca.basic_get("work")[0] is None
    finally:
        on_a.close()
        on_b.close()


def poll_get(ch: Any, queue: str) -> tuple[Any, Any, bytes]:
    """basic.get until a message comes (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        method, props, body = ch.basic_get(queue)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing in {queue}"


def test_an_exclusive_queue_is_exclusive_cluster_wide(shared: Cluster) -> None:
    """A queue exclusive to a connection through one broker is locked for connections through
    the other, and is gone once its connection closes."""
    first = connect(shared.a)
    second = connect(shared.b)
    try:
        first.channel().queue_declare("mine-only", exclusive=True)
        ch = second.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.queue_declare("mine-only", exclusive=True)
        assert refused.value.reply_code == 405
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            second.channel().basic_get("mine-only")
        assert refused.value.reply_code == 405
        first.close()
        wait_until(lambda: declares_exclusive(second, "mine-only"), "exclusive queue freed")
    finally:
        if first.is_open:
            first.close()
        second.close()


def declares_exclusive(conn: pika.BlockingConnection, queue: str) -> bool:
    """Whether ``conn`` may declare ``queue`` exclusive now (405: another one holds it)."""
    try:
        conn.channel().queue_declare(queue, exclusive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        if e.reply_code != 405:
            raise
        return False
    return True


def test_a_fanout_through_the_relay(shared: Cluster) -> None:
    """A client of the broker that does not serve the vhost fans out to three queues."""
    relayed = connect(shared.other(shared.owner()))
    try:
        ch = relayed.channel()
        ch.exchange_declare("news", "fanout")
        queues = [f"reader-{i}" for i in range(3)]
        for q in queues:
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, "news")
        ch.confirm_delivery()
        bodies = [f"n{i}".encode() for i in range(10)]
        for body in bodies:
            ch.basic_publish("news", "", body, pika.BasicProperties(delivery_mode=2))
        for q in queues:
            seen = []
            for _ in bodies:
                method, _, body = poll_get(ch, q)
                ch.basic_ack(method.delivery_tag)
                seen.append(body)
            assert seen == bodies, q
    finally:
        relayed.close()


def test_heartbeats_and_large_messages_pass_the_relay(shared: Cluster) -> None:
    """Through the relay, a client with 1 s heartbeats stays connected while idle (the two
    ends exchange heartbeats through it), and a 3 MB message goes and comes back whole."""
    owner = shared.owner()
    p = params(shared.other(owner))
    p.heartbeat = 1
    relayed = pika.BlockingConnection(p)
    try:
        deadline = time.monotonic() + 4  # four heartbeat intervals, idle
        while time.monotonic() < deadline:
            relayed.process_data_events(time_limit=0.2)
        assert relayed.is_open
        ch = relayed.channel()
        ch.queue_declare("big", durable=True)
        ch.confirm_delivery()
        body = bytes(range(256)) * (3 * 4096)
        ch.basic_publish("", "big", body, pika.BasicProperties(delivery_mode=2))
        method, _, got = poll_get(ch, "big")
        ch.basic_ack(method.delivery_tag)
        assert got == body
    finally:
        relayed.close()


def test_amq_topic_bridges_to_pulsar_clients_of_the_other_broker(shared: Cluster) -> None:
    """What a Pulsar producer connected to one broker writes to topic R reaches an AMQP queue
    bound to amq.topic with R through the other broker, and the other way round."""
    amqp_side = connect(shared.a)
    client = pulsar.Client(shared.b.pulsar_url, operation_timeout_seconds=30)
    try:
        ch = amqp_side.channel()
        ch.queue_declare("bridged", durable=True)
        ch.queue_bind("bridged", "amq.topic", "bridge-in")
        producer = client.create_producer("persistent://public/default/bridge-in")
        for i in range(5):
            producer.send(f"p{i}".encode())
        seen = [poll_get(ch, "bridged") for _ in range(5)]
        for method, _, _ in seen:
            ch.basic_ack(method.delivery_tag)
        assert [body for _, _, body in seen] == [f"p{i}".encode() for i in range(5)]
        assert all(m.routing_key == "bridge-in" for m, _, _ in seen)
        consumer = client.subscribe(
            "persistent://public/default/bridge-out",
            "readers",
            initial_position=pulsar.InitialPosition.Earliest,
        )
        ch.confirm_delivery()
        ch.basic_publish("amq.topic", "bridge-out", b"from-amqp")
        msg = consumer.receive(timeout_millis=int(WAIT_S * 1000))
        assert msg.data() == b"from-amqp"
        consumer.acknowledge(msg)
    finally:
        client.close()
        amqp_side.close()


def bundle_of(broker: Broker, local: str) -> str:
    url = f"{broker.http_url}/lookup/v2/topic/persistent/public/default/{local}/bundle"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def lookup_http(broker: Broker, local: str, authoritative: bool = False) -> str:
    """The admin URL of the broker that serves topic ``local`` (asked of ``broker``)."""
    url = f"{broker.http_url}/lookup/v2/topic/persistent/public/default/{local}"
    if authoritative:
        url += "?authoritative=true"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(json.loads(resp.read())["httpUrl"]).rstrip("/")


def test_a_queue_whose_topic_another_broker_owns_is_served_through_forwarding(
    shared: Cluster,
) -> None:
    """The vhost's broker serves a queue whose topic the other broker owns: publishes,
    deliveries, acks, purge (the log's end asked of the owner) and delete (the topic deleted
    at the owner) all work."""
    owner = shared.owner()
    other = shared.other(owner)
    # A queue whose topic is in another bundle than the vhost's control topic, and that
    # bundle moved to the other broker.
    control = bundle_of(other, CONTROL)
    names = (f"remote-{i}" for i in range(64))
    name = next(n for n in names if bundle_of(other, f"amqp.queue.{n}") != control)
    local = f"amqp.queue.{name}"
    move = urllib.request.Request(
        f"{other.http_url}/admin/v2/namespaces/public/default/{bundle_of(other, local)}"
        f"/unload?destinationBroker={other.broker_id}",
        method="PUT",
    )
    with urllib.request.urlopen(move, timeout=30) as resp:
        assert resp.status in (200, 204)
    assert lookup_http(other, local, authoritative=True) == other.http_url
    conn = connect(owner)
    try:
        ch = conn.channel()
        ch.queue_declare(name, durable=True)
        ch.confirm_delivery()
        for i in range(10):
            ch.basic_publish("", name, f"r{i}".encode(), pika.BasicProperties(delivery_mode=2))
        assert lookup_http(owner, local) == other.http_url
        got = []
        for _ in range(3):
            method, _, body = poll_get(ch, name)
            ch.basic_ack(method.delivery_tag)
            got.append(body)
        assert got == [b"r0", b"r1", b"r2"]
        assert ch.queue_purge(name).method.message_count == 7
        assert ch.basic_get(name)[0] is None
        ch.basic_publish("", name, b"after", pika.BasicProperties(delivery_mode=2))
        method, _, body = poll_get(ch, name)
        assert body == b"after"
        ch.basic_ack(method.delivery_tag)
        ch.queue_delete(name)
        stats = f"{other.http_url}/admin/v2/persistent/public/default/{local}/stats"
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(stats, timeout=30)
        assert gone.value.code == 404
    finally:
        conn.close()


def pump_until_closed(conn: pika.BlockingConnection) -> None:
    """Serve the connection's events until the broker closes it (which raises; bounded)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)


def test_unloading_the_vhost_bundle_moves_the_vhost(shared: Cluster) -> None:
    """An admin unload of the control topic's bundle closes the vhost's connections (direct
    and relayed) with 320; the clients reconnect and find the durable queue and its messages
    on the broker that serves the vhost next."""
    owner = shared.owner()
    direct, relayed = connect(owner), connect(shared.other(owner))
    try:
        ch = direct.channel()
        ch.queue_declare("moving", durable=True)
        ch.confirm_delivery()
        for i in range(5):
            ch.basic_publish("", "moving", f"v{i}".encode(), pika.BasicProperties(delivery_mode=2))
        relayed.channel().queue_declare("moving", passive=True)
        live = shared.a.http_url
        bundle = bundle_of(shared.a, CONTROL)
        unload = urllib.request.Request(
            f"{live}/admin/v2/namespaces/public/default/{bundle}/unload", method="PUT"
        )
        with urllib.request.urlopen(unload, timeout=30) as resp:
            assert resp.status in (200, 204)
        for conn in (direct, relayed):
            with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
                pump_until_closed(conn)
            assert closed.value.reply_code == 320
    finally:
        for conn in (direct, relayed):
            if conn.is_open:
                conn.close()
    again = connect(shared.b)
    try:
        ch = again.channel()
        bodies = []
        for _ in range(5):
            method, _, body = poll_get(ch, "moving")
            ch.basic_ack(method.delivery_tag)
            bodies.append(body)
        assert bodies == [f"v{i}".encode() for i in range(5)]
    finally:
        again.close()


class Client(threading.Thread):
    """A pika client in a thread of its own that goes on through failures: when its
    connection is lost it reconnects through the next broker of ``brokers`` (bounded)."""

    def __init__(self, brokers: list[Broker]) -> None:
        super().__init__(daemon=True)
        self.brokers = brokers
        self.reconnects = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        turn = 0
        conn: pika.BlockingConnection | None = None
        try:
            while not self.stop.is_set():
                try:
                    if conn is None or not conn.is_open:
                        conn = connect(self.brokers[turn % len(self.brokers)], within=60)
                        self.opened(conn.channel())
                    self.step()
                except (pika.exceptions.AMQPError, OSError):
                    self.reconnects += 1
                    turn += 1
                    conn = None
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            if conn is not None and conn.is_open:
                conn.close()

    def opened(self, ch: Any) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.stop.set()
        self.join(WAIT_S)
        assert not self.is_alive()
        assert self.error is None, self.error


class Publisher(Client):
    """Publishes persistent messages with confirms; keeps those confirmed."""

    def __init__(self, brokers: list[Broker], exchange: str, key: str) -> None:
        super().__init__(brokers)
        self.exchange, self.key = exchange, key
        self.confirmed: list[bytes] = []
        self._n = 0

    def opened(self, ch: Any) -> None:
        ch.confirm_delivery()
        self.ch = ch

    def step(self) -> None:
        body = f"d{self._n}".encode()
        self._n += 1
        self.ch.basic_publish(self.exchange, self.key, body, pika.BasicProperties(delivery_mode=2))
        self.confirmed.append(body)


class Consumer(Client):
    """Consumes a queue, acknowledging each message; keeps what it got."""

    def __init__(self, brokers: list[Broker], queue: str) -> None:
        super().__init__(brokers)
        self.queue = queue
        self.got: list[bytes] = []

    def opened(self, ch: Any) -> None:
        ch.basic_qos(prefetch_count=50)

        def on_message(c: Any, method: Any, _props: Any, body: bytes) -> None:
            self.got.append(body)
            c.basic_ack(method.delivery_tag)

        ch.basic_consume(self.queue, on_message)
        self.ch = ch

    def step(self) -> None:
        self.ch.connection.process_data_events(time_limit=0.1)


def declare_work(broker: Broker, exchange: str, queue: str) -> None:
    setup = connect(broker)
    ch = setup.channel()
    ch.exchange_declare(exchange, "direct", durable=True)
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, "j")
    setup.close()


def drain_all(broker: Broker, queue: str, expected: set[bytes], got: set[bytes]) -> None:
    """Consume through ``broker`` until ``got`` holds every ``expected`` message (bounded)."""
    conn = connect(broker)
    try:
        ch = conn.channel()
        while not expected <= got:
            method, _, body = poll_get(ch, queue)
            ch.basic_ack(method.delivery_tag)
            got.add(body)
    finally:
        conn.close()


def test_a_durable_queue_survives_kill_9_of_the_vhost_broker(
    zk_url: str, bookies: BookieProcesses, tmp_path: Path
) -> None:
    """While a publisher with confirms and a consumer run through the other broker, kill -9
    the vhost's broker: the relayed clients are closed, reconnect through the survivor (now
    serving the vhost), and every confirmed message is consumed (at-least-once)."""
    cluster = start_cluster(zk_url, bookies, tmp_path)
    try:
        declare_work(cluster.a, "jobs", "durable-work")
        owner = cluster.owner()
        survivor = cluster.other(owner)
        relayed = connect(survivor)
        relayed.channel().queue_declare("durable-work", passive=True)
        publisher = Publisher([survivor], "jobs", "j")
        consumer = Consumer([survivor], "durable-work")
        publisher.start()
        consumer.start()
        wait_until(lambda: len(publisher.confirmed) >= 50 and consumer.got, "before the kill")
        cluster.brokers.kill(owner)
        # The survivor closes the connection it relayed to the dead broker.
        wait_until(lambda: not poke(relayed), "relayed connection closed")
        wait_until(
            lambda: publisher.reconnects > 0 and len(publisher.confirmed) >= 150,
            "publishes after the failover",
            60,
        )
        wait_until(
            lambda: consumer.reconnects > 0 and set(publisher.confirmed[:150]) <= set(consumer.got),
            "consumed after the failover",
            60,
        )
        publisher.finish()
        consumer.finish()
        assert cluster.owner() is survivor
        drain_all(survivor, "durable-work", set(publisher.confirmed), set(consumer.got))
    finally:
        cluster.brokers.close()


def test_kill_9_of_a_bookie_then_of_the_relaying_broker_loses_nothing(
    zk_url: str, bookies: BookieProcesses, tmp_path: Path
) -> None:
    """With 3 bookies (E=Qw=Qa=2), kill -9 a bookie while a publisher runs through the relaying
    broker (its writes go on), then kill -9 that broker: the publisher reconnects through the
    vhost's broker and every confirmed message is in the queue."""
    cluster = start_cluster(zk_url, bookies, tmp_path, n_bookies=3)
    try:
        declare_work(cluster.a, "jobs", "work-2")
        owner = cluster.owner()
        relay = cluster.other(owner)
        publisher = Publisher([relay, owner], "jobs", "j")
        publisher.start()
        wait_until(lambda: len(publisher.confirmed) >= 50, "publishes before the bookie kill")
        bookies.kill(bookies.running[0])
        wait_until(lambda: len(publisher.confirmed) >= 120, "publishes after the bookie kill")
        assert publisher.reconnects == 0
        cluster.brokers.kill(relay)
        wait_until(
            lambda: publisher.reconnects > 0 and len(publisher.confirmed) >= 200,
            "publishes through the vhost's broker",
            60,
        )
        publisher.finish()
        drain_all(owner, "work-2", set(publisher.confirmed), set())
    finally:
        cluster.brokers.close()


def poke(conn: pika.BlockingConnection) -> bool:
    """Whether the connection still works."""
    try:
        conn.process_data_events(time_limit=0.05)
        return conn.is_open
    except (pika.exceptions.AMQPError, OSError):
        return False


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)  # polling a condition of another thread, bounded
