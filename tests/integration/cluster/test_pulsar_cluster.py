"""A real cluster (ZooKeeper, bookie and broker processes) driven by the official Pulsar client:
topics spread over brokers, lookups from any broker, bundle unload/transfer/split through the
admin API, and kill -9 of a broker while producers run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulsar
import pytest
from broker_harness import Broker, BrokerProcesses, initialize
from cluster_harness import BookieProcesses, port_of
from standalone_process import http_json as http
from zk_server import ZooKeeperServer

NS = "public/default"
REPLICATION = {
    "managedLedgerDefaultEnsembleSize": 2,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
}


@dataclass
class Cluster:
    zk_url: str
    bookies: BookieProcesses
    brokers: BrokerProcesses
    members: list[Broker]

    @property
    def service_url(self) -> str:
        """Every broker, as a multi-host service URL: any of them answers lookups."""
        hosts = ",".join(f"127.0.0.1:{b.ports['brokerServicePort']}" for b in self.members)
        return f"pulsar://{hosts}"


@pytest.fixture
def cluster(zk_url: str, bookies: BookieProcesses, tmp_path: Path) -> Iterator[Cluster]:
    """ZooKeeper + 3 bookies + 2 brokers (E=Qw=Qa=2), stopped by PID at teardown."""
    initialize(zk_url)
    for _ in range(3):
        bookies.start(zk_url)
    procs = BrokerProcesses(tmp_path)
    try:
        members = [procs.start(zk_url, REPLICATION) for _ in range(2)]
        yield Cluster(zk_url, bookies, procs, members)
    finally:
        procs.close()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def owners(broker: Broker) -> dict[str, str | None]:
    return http("GET", f"{broker.http_url}/admin/v2/namespaces/{NS}/owners")


def served_by(broker: Broker, topic: str) -> str:
    """The Pulsar URL of the broker a lookup through ``broker`` names for ``topic``."""
    path = topic.replace("://", "/")
    return str(http("GET", f"{broker.http_url}/lookup/v2/topic/{path}")["brokerUrl"])


def receive_all(consumer: pulsar.Consumer, expected: set[bytes], timeout: float = 60) -> set[bytes]:
    got: set[bytes] = set()
    deadline = time.monotonic() + timeout
    while not expected <= got:
        assert time.monotonic() < deadline, f"missing {len(expected - got)} messages"
        try:
            msg = consumer.receive(1000)
        except pulsar.Timeout:
            continue
        got.add(msg.data())
        consumer.acknowledge(msg)
    return got


def test_partitions_spread_over_brokers_and_any_broker_answers(cluster: Cluster) -> None:
    a, b = cluster.members
    topic = f"persistent://{NS}/spread"
    http("PUT", f"{a.http_url}/admin/v2/persistent/{NS}/spread/partitions", 8)
    client = pulsar.Client(a.pulsar_url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "s", consumer_type=pulsar.ConsumerType.Shared)
        producer = client.create_producer(topic, batching_enabled=False)
        sent = {f"m-{i}".encode() for i in range(200)}
        for i, m in enumerate(sorted(sent)):
            producer.send(m, partition_key=str(i))
        assert receive_all(consumer, sent) == sent
    finally:
        client.close()
    held = {o for o in owners(a).values() if o is not None}
    assert held == {a.broker_id, b.broker_id}
    assert owners(b) == owners(a)
    # Both name the same leader of the load manager, one of them.
    leader = http("GET", f"{a.http_url}/admin/v2/brokers/leaderBroker")
    assert http("GET", f"{b.http_url}/admin/v2/brokers/leaderBroker") == leader
    assert leader["brokerId"] in held
    # The HTTP lookup of any partition, asked of either broker, names its owner.
    bundle_owner = owners(a)
    for i in range(8):
        name = f"spread-partition-{i}"
        bundle = (
            urllib.request.urlopen(
                f"{b.http_url}/lookup/v2/topic/persistent/{NS}/{name}/bundle", timeout=30
            )
            .read()
            .decode()
        )
        for asked in (a, b):
            found = http("GET", f"{asked.http_url}/lookup/v2/topic/persistent/{NS}/{name}")
            owner = next(m for m in cluster.members if m.broker_id == bundle_owner[bundle])
            assert found["brokerUrl"] == owner.pulsar_url
        # Admin calls for a topic reach its owner, from either broker (307 to the owner).
        for asked in (a, b):
            stats = http("GET", f"{asked.http_url}/admin/v2/persistent/{NS}/{name}/stats")
            assert stats["msgInCounter"] > 0
    stats = http("GET", f"{b.http_url}/admin/v2/persistent/{NS}/spread/partitioned-stats")
    assert stats["msgInCounter"] == 200
    assert len(stats["partitions"]) == 8
    # Unloading the topic through one broker unloads the partitions the other serves too.
    http("PUT", f"{a.http_url}/admin/v2/persistent/{NS}/spread/unload")
    for i in range(8):
        stats = http("GET", f"{b.http_url}/admin/v2/persistent/{NS}/spread-partition-{i}/stats")
        assert stats["msgInCounter"] == 0  # counters start again in a freshly loaded topic
    # Deleting the partitioned topic from one broker deletes the partitions the other serves.
    http("DELETE", f"{a.http_url}/admin/v2/persistent/{NS}/spread/partitions?force=true")
    assert http("GET", f"{b.http_url}/admin/v2/persistent/{NS}/spread/partitions") == {
        "partitions": 0
    }
    assert not [t for t in http("GET", f"{b.http_url}/admin/v2/persistent/{NS}") if "spread" in t]


def test_subscription_admin_reaches_partitions_on_every_broker(cluster: Cluster) -> None:
    """Subscription calls on a partitioned topic whose partitions both brokers serve reach
    every partition, whichever broker is asked: create, list, skip, reset by time, expire
    (one subscription, and all), delete; and so do the namespace's clear-backlog and
    unsubscribe. Each broker does its own partitions and sends the same call to the other for
    the rest (a redirect of the whole call went back and forth)."""
    a, b = cluster.members
    path = f"/admin/v2/persistent/{NS}/fan"
    http("PUT", f"{a.http_url}{path}/partitions", 8)
    client = pulsar.Client(a.pulsar_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(f"persistent://{NS}/fan", batching_enabled=False)
        for i in range(80):
            producer.send(b"m", partition_key=str(i))
    finally:
        client.close()
    assert {o for o in owners(a).values() if o is not None} == {a.broker_id, b.broker_id}

    def backlog(asked: Broker) -> int:
        stats = http("GET", f"{asked.http_url}{path}/partitioned-stats?perPartition=true")
        return sum(p["subscriptions"]["audit"]["msgBacklog"] for p in stats["partitions"].values())

    http("PUT", f"{a.http_url}{path}/subscription/audit", {"ledgerId": -1, "entryId": -1})
    for asked in (a, b):
        assert http("GET", f"{asked.http_url}{path}/subscriptions") == ["audit"]
    assert backlog(b) == 80
    http("POST", f"{a.http_url}{path}/subscription/audit/skip_all")
    assert backlog(b) == 0
    http("POST", f"{b.http_url}{path}/subscription/audit/resetcursor/0")
    assert backlog(a) == 80
    http("POST", f"{a.http_url}{path}/subscription/audit/expireMessages/0")
    assert backlog(b) == 0
    http("POST", f"{a.http_url}{path}/subscription/audit/resetcursor/0")
    http("POST", f"{b.http_url}{path}/all_subscription/expireMessages/0")
    assert backlog(a) == 0
    # The CLI follows a broker's 307 to a partition's owner for a POST too.
    theirs = next(
        f"fan-partition-{i}"
        for i in range(8)
        if http("GET", f"{a.http_url}/lookup/v2/topic/persistent/{NS}/fan-partition-{i}")[
            "brokerUrl"
        ]
        == b.pulsar_url
    )
    cli = [sys.executable, "-m", "polybroker", "admin", "--admin-url", a.http_url]
    cli += ["topics", "reset-cursor", f"persistent://{NS}/{theirs}", "-s", "audit", "-t", "1h"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert backlog(a) > 0
    # Namespace-wide calls reach the topics every broker has loaded.
    http("POST", f"{a.http_url}/admin/v2/namespaces/{NS}/clearBacklog/audit")
    assert backlog(b) == 0
    http("POST", f"{a.http_url}{path}/subscription/audit/resetcursor/0")
    http("POST", f"{b.http_url}/admin/v2/namespaces/{NS}/clearBacklog")
    assert backlog(a) == 0
    http("POST", f"{b.http_url}/admin/v2/namespaces/{NS}/unsubscribe/audit")
    for asked in (a, b):
        assert http("GET", f"{asked.http_url}{path}/subscriptions") == []
    with pytest.raises(urllib.error.HTTPError) as gone:
        http("DELETE", f"{a.http_url}{path}/subscription/audit")
    assert gone.value.code == 404
    # A broker just killed is listed until its session expires: a namespace call skips it.
    cluster.brokers.kill(b)
    assert b.broker_id in http("GET", f"{a.http_url}/admin/v2/brokers/test-cluster")
    http("POST", f"{a.http_url}/admin/v2/namespaces/{NS}/clearBacklog")


def test_a_namespace_is_deleted_with_topics_every_broker_serves(cluster: Cluster) -> None:
    """Deleting a namespace (force) through one broker deletes the topics and partitions the
    other serves too (it went back and forth as 307s, and the namespace stayed); calls that
    name a partitioned topic where Pulsar wants a partition are refused (405)."""
    a, b = cluster.members
    http("PUT", f"{a.http_url}/admin/v2/namespaces/public/gone", {})
    http("PUT", f"{a.http_url}/admin/v2/persistent/public/gone/pt/partitions", 8)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer("persistent://public/gone/pt", batching_enabled=False)
        for i in range(40):
            producer.send(b"x", partition_key=str(i))
        for i in range(6):
            client.create_producer(f"persistent://public/gone/single-{i}").send(b"y")
    finally:
        client.close()
    served = http("GET", f"{a.http_url}/admin/v2/namespaces/public/gone/owners").values()
    assert {o for o in served if o is not None} == {a.broker_id, b.broker_id}
    for verb, suffix in (("POST", "terminate"), ("GET", "lastMessageId")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            http(verb, f"{a.http_url}/admin/v2/persistent/public/gone/pt/{suffix}")
        assert refused.value.code == 405
    http("DELETE", f"{a.http_url}/admin/v2/namespaces/public/gone?force=true")
    for asked in (a, b):
        assert "public/gone" not in http("GET", f"{asked.http_url}/admin/v2/namespaces/public")


def test_bundle_unload_transfer_and_split_through_admin(cluster: Cluster) -> None:
    a, b = cluster.members
    topic = f"persistent://{NS}/moving"
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        consumer = client.subscribe(topic, "s")
        producer.send(b"before")
        bundle = (
            urllib.request.urlopen(
                f"{a.http_url}/lookup/v2/topic/persistent/{NS}/moving/bundle", timeout=30
            )
            .read()
            .decode()
        )
        first = a if owners(a)[bundle] == a.broker_id else b
        other = b if first is a else a
        # Asked of the broker that does not own the bundle, the call goes to the owner and
        # returns once the owner has let the bundle go: it serves the topic no more.
        http(
            "PUT",
            f"{other.http_url}/admin/v2/namespaces/{NS}/{bundle}/unload"
            f"?destinationBroker={other.broker_id}",
        )
        assert owners(a)[bundle] != first.broker_id
        producer.send(b"after-transfer")  # the client follows the topic to its new owner
        assert owners(a)[bundle] == other.broker_id
        http("PUT", f"{first.http_url}/admin/v2/namespaces/{NS}/{bundle}/split")
        assert bundle not in owners(other)
        bundles = http("GET", f"{a.http_url}/admin/v2/namespaces/{NS}/bundles")
        assert bundles["numBundles"] == 5
        producer.send(b"after-split")
        assert receive_all(consumer, {b"before", b"after-transfer", b"after-split"}) == {
            b"before",
            b"after-transfer",
            b"after-split",
        }
    finally:
        client.close()


def test_unload_of_a_dead_owners_bundle_releases_its_claim(cluster: Cluster) -> None:
    """kill -9 the owner of a bundle, then unload the bundle through the other broker before
    the owner's session expires: the owner cannot answer, so the broker asked releases the claim
    itself and the bundle is served again without waiting for the session's expiry."""
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(f"persistent://{NS}/orphan", batching_enabled=False)
        producer.send(b"before")
        url = f"{cluster.members[0].http_url}/lookup/v2/topic/persistent/{NS}/orphan/bundle"
        bundle = urllib.request.urlopen(url, timeout=30).read().decode()
        owner = owners(cluster.members[0])[bundle]
        victim = next(m for m in cluster.members if m.broker_id == owner)
        survivor = next(m for m in cluster.members if m is not victim)
        cluster.brokers.kill(victim)
        http("PUT", f"{survivor.http_url}/admin/v2/namespaces/{NS}/{bundle}/unload")
        assert owners(survivor)[bundle] != victim.broker_id
        producer.send(b"after")  # the client finds the bundle's new owner
        assert owners(survivor)[bundle] == survivor.broker_id
    finally:
        client.close()


class Sender:
    """Sends numbered messages to a partitioned topic from a thread; records what was acked."""

    def __init__(self, client: pulsar.Client, topic: str) -> None:
        self.producer = client.create_producer(
            topic, batching_enabled=False, send_timeout_millis=60_000
        )
        self.acked: dict[bytes, float] = {}
        self.partition_acks: dict[int, list[float]] = {}
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        lock = threading.Semaphore(64)
        while not self._stop.is_set():
            data = f"m-{i:06d}".encode()
            lock.acquire()

            def done(res: Any, msg_id: Any, data: bytes = data) -> None:
                lock.release()
                if res == pulsar.Result.Ok:
                    now = time.monotonic()
                    self.acked[data] = now
                    self.partition_acks.setdefault(msg_id.partition(), []).append(now)
                else:
                    self.failed.append(str(res))

            self.producer.send_async(data, done, partition_key=str(i))
            i += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.producer.flush()


@contextlib.contextmanager
def producing(
    admin_url: str, service_url: str, name: str, *, sends_may_fail: bool = False
) -> Iterator[Sender]:
    """A topic of 8 partitions with a durable Shared subscription, and a ``Sender`` whose first
    messages are acknowledged; on leaving, the sender stops and every acknowledged message must
    be consumed (and, unless ``sends_may_fail``, no send may have failed)."""
    topic = f"persistent://{NS}/{name}"
    http("PUT", f"{admin_url}/admin/v2/persistent/{NS}/{name}/partitions", 8)
    client = pulsar.Client(service_url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "durable", consumer_type=pulsar.ConsumerType.Shared)
        sender = Sender(client, topic)
        wait_for(lambda: len(sender.acked) > 200, 60, "first messages acknowledged")
        yield sender
        sender.stop()
        if not sends_may_fail:
            assert not sender.failed
        acked = set(sender.acked)
        assert receive_all(consumer, acked, timeout=90) >= acked
    finally:
        client.close()


def test_kill_a_broker_while_producing_loses_nothing(cluster: Cluster) -> None:
    a, b = cluster.members
    # The service URL names the broker that stays, as a load balancer in front of the
    # cluster would; the other broker owns some of the partitions and is killed.
    with producing(a.http_url, a.pulsar_url, "failover") as sender:
        victim, survivor = b, a
        assert victim.broker_id in owners(a).values()
        killed_at = time.monotonic()
        cluster.brokers.kill(victim)
        # Every bundle comes back under the survivor, and producing goes on.
        wait_for(
            lambda: (
                all(o in (None, survivor.broker_id) for o in owners(survivor).values())
                and sum(1 for t in sender.acked.values() if t > killed_at) > 200
                and all(
                    any(t > killed_at for t in times) for times in sender.partition_acks.values()
                )
            ),
            60,
            "producing again after the kill",
        )
        assert sorted(sender.partition_acks) == list(range(8))
        # Every partition, those of the dead broker included, acknowledged sends again.
        resumed = max(
            min(t for t in times if t > killed_at) for times in sender.partition_acks.values()
        )
        print(f"every partition serving again {resumed - killed_at:.2f}s after kill -9")


def test_a_broker_restarted_after_kill_9_serves_its_bundles_at_once(
    zk_url: str, bookies: BookieProcesses, tmp_path: Path
) -> None:
    """kill -9 of a broker, then a restart on the same addresses: it takes its bundles back
    from its dead predecessor at once instead of waiting out that process's session (30 s
    here), and what was acknowledged before the kill is all there."""
    settings = {**REPLICATION, "metadataStoreSessionTimeoutMillis": 30_000}
    initialize(zk_url)
    for _ in range(2):
        bookies.start(zk_url)
    procs = BrokerProcesses(tmp_path)
    try:
        a, b = (procs.start(zk_url, settings) for _ in range(2))
        client = pulsar.Client(b.pulsar_url, operation_timeout_seconds=60)
        try:
            # Topics first used on B are served by B (a lookup's candidate claims on use).
            topics = [f"persistent://{NS}/restart-{i}" for i in range(8)]
            for t in topics:
                client.subscribe(t, "keep").close()  # holds what it has not read
                client.create_producer(t).send(b"before")
            ours = [t for t in topics if served_by(a, t) == b.pulsar_url]
            assert ours, "B serves none of the topics"
        finally:
            client.close()
        procs.kill(b)
        restarted_at = time.monotonic()
        procs.start(zk_url, settings, ports=b.ports)
        client = pulsar.Client(a.pulsar_url, operation_timeout_seconds=60)
        try:
            for t in ours:
                client.create_producer(t).send(b"after")
            served_in = time.monotonic() - restarted_at
            for t in ours:
                consumer = client.subscribe(t, "keep")
                got = [consumer.receive(30_000).data() for _ in range(2)]
                assert got == [b"before", b"after"], t
        finally:
            client.close()
        # Before the dead process's 30 s session could have expired (0.05 s here; 30.8 s
        # without the takeover): the claims were taken over, not waited for.
        assert served_in < 20, f"served again {served_in:.1f}s after the restart"
        assert {served_by(a, t) for t in ours} == {b.pulsar_url}, "B took its bundles back"
    finally:
        procs.close()


def test_a_broker_whose_session_expires_gives_its_bundles_up(cluster: Cluster) -> None:
    """SIGSTOP a broker past its ZooKeeper session: the other takes its bundles; once resumed it
    serves none of them silently (it unloads them), registers again, and nothing acked is lost."""
    a, b = cluster.members
    with producing(a.http_url, a.pulsar_url, "paused", sends_may_fail=True) as sender:
        held = {k for k, v in owners(a).items() if v == b.broker_id}
        assert held
        os.kill(b.pid, signal.SIGSTOP)
        try:
            # Its session expires: its bundles and its registration go.
            wait_for(
                lambda: not held & {k for k, v in owners(a).items() if v == b.broker_id},
                30,
                "the paused broker's bundles freed",
            )

            def taken_over() -> bool:
                # A new client's lookups, through the broker that is up.
                for i in range(8):
                    http(
                        "GET", f"{a.http_url}/lookup/v2/topic/persistent/{NS}/paused-partition-{i}"
                    )
                return any(v == a.broker_id for k, v in owners(a).items() if k in held)

            wait_for(taken_over, 30, "the other broker serving the paused broker's bundles")
        finally:
            os.kill(b.pid, signal.SIGCONT)
        wait_for(lambda: "bundle lost" in b.log.read_text(), 30, "the resumed broker unloading")
        wait_for(
            lambda: b.broker_id in http("GET", f"{a.http_url}/admin/v2/brokers/test-cluster"),
            30,
            "the resumed broker registered again",
        )
        count = len(sender.acked)
        wait_for(lambda: len(sender.acked) > count + 200, 60, "producing after the resume")


def test_kill_zookeeper_while_producing_loses_nothing(tmp_path: Path) -> None:
    """kill -9 of ZooKeeper (its own server here) while a producer runs: brokers keep serving
    the topics they own through the outage, and once it is back nothing acked is lost."""
    zk = ZooKeeperServer.start(tmp_path / "zk")
    bookies = BookieProcesses(tmp_path)
    procs = BrokerProcesses(tmp_path)
    try:
        url = zk.url("/c")
        initialize(url)
        for _ in range(3):
            bookies.start(url)
        # Sessions outlive the restart, so ownership is kept across it.
        a, _b = (
            procs.start(url, {**REPLICATION, "metadataStoreSessionTimeoutMillis": 15000})
            for _ in range(2)
        )
        with producing(a.http_url, a.pulsar_url, "zk-outage") as sender:
            os.kill(zk.process.pid, signal.SIGKILL)
            zk.process.wait(30)
            down = time.monotonic()
            wait_for(
                lambda: sum(1 for t in sender.acked.values() if t > down) > 200,
                30,
                "acknowledgements while ZooKeeper is down",
            )
            zk.restart()
            count = len(sender.acked)
            wait_for(lambda: len(sender.acked) > count + 200, 60, "producing after the restart")
    finally:
        procs.close()
        bookies.close()
        zk.stop()


def test_kill_a_bookie_while_producing_loses_nothing(cluster: Cluster) -> None:
    """E=Qw=Qa=2 over 3 bookies plus a spare: kill -9 one bookie while a producer runs; writes
    go on (ensemble change) and every acknowledged message is consumed."""
    a = cluster.members[0]
    cluster.bookies.start(cluster.zk_url)  # the spare an ensemble change can take
    with producing(a.http_url, cluster.service_url, "bookie-loss") as sender:
        killed_at = time.monotonic()
        cluster.bookies.kill(cluster.bookies.running[0])
        wait_for(
            lambda: (
                all(any(t > killed_at for t in times) for times in sender.partition_acks.values())
                and sum(1 for t in sender.acked.values() if t > killed_at) > 200
            ),
            60,
            "every partition writing after the bookie kill",
        )


def test_the_whole_cluster_restarts_with_its_data(cluster: Cluster) -> None:
    """Every broker and bookie goes down (brokers stopped, bookies killed -9) and comes back on
    the same data dirs and ports: every acknowledged message is there, a durable subscription
    resumes after what it acknowledged, and the topic takes writes again."""
    name = "restart-all"
    topic = f"persistent://{NS}/{name}"
    a = cluster.members[0]
    http("PUT", f"{a.http_url}/admin/v2/persistent/{NS}/{name}/partitions", 8)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "durable", consumer_type=pulsar.ConsumerType.Shared)
        producer = client.create_producer(topic, batching_enabled=False)
        sent = {f"m-{i}".encode() for i in range(400)}
        for data in sorted(sent):
            producer.send(data, partition_key=data.decode())
        acked: set[bytes] = set()
        while len(acked) < 150:
            msg = consumer.receive(10_000)
            consumer.acknowledge(msg)
            acked.add(msg.data())
        consumer.close()  # its acknowledgements reach the brokers before they stop
    finally:
        client.close()

    old_bookies = list(cluster.bookies.running)
    for broker in list(cluster.members):
        assert cluster.brokers.stop(broker) == 0
    for bookie in old_bookies:
        cluster.bookies.kill(bookie)
    for bookie in old_bookies:
        cluster.bookies.start(cluster.zk_url, data_dir=bookie.data_dir, port=port_of(bookie))
    cluster.members[:] = [cluster.brokers.start(cluster.zk_url, REPLICATION) for _ in range(2)]

    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=30)
    try:
        # Before anything is consumed (consumed ledgers may be trimmed): the data written
        # before the restart is read back from the restarted bookies.
        reader = client.create_reader(f"{topic}-partition-0", pulsar.MessageId.earliest)
        assert reader.read_next(30_000).data() in sent
        consumer = client.subscribe(topic, "durable", consumer_type=pulsar.ConsumerType.Shared)
        got = receive_all(consumer, sent - acked, timeout=90)
        assert not got & acked  # acknowledged before the restart: never delivered again
        producer = client.create_producer(topic, batching_enabled=False)
        producer.send(b"after", partition_key="after")
        assert b"after" in receive_all(consumer, {b"after"}, timeout=60)
    finally:
        client.close()
