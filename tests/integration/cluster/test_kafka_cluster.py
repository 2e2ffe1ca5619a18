"""Kafka clients against a real cluster (ZooKeeper, two bookie processes with E=Qw=Qa=2, two
``polybroker broker`` processes): metadata names each partition's owner as its leader and the
owner of the group's slot as coordinator; kill -9 of the coordinator (which also leads some
partitions) under kafka-python and confluent-kafka clients loses no acknowledged message, the
clients serve again through metadata refresh, and the group resumes from its committed offsets;
an idempotent producer's records are stored exactly once across kill -9 of a partition leader.

The clients block, so they run on the test's own thread against the broker processes."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from broker_harness import Broker, BrokerProcesses, initialize
from cluster_harness import BookieProcesses
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import Producer as ConfluentProducer
from confluent_kafka import TopicPartition as ConfluentTopicPartition
from confluent_kafka.admin import AdminClient
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from standalone_process import http_json as http

TOPIC = "orders"
PARTITIONS = 8
GROUP = "billing"
#: The bound on every wait for the cluster to serve again after a kill.
RECOVERY_S = 30.0
BROKER_CONFIG: dict[str, object] = {
    "managedLedgerDefaultEnsembleSize": 2,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
    "defaultNumPartitions": PARTITIONS,
    # Kafka consumers read by offset: keep what nobody subscribes to.
    "defaultRetentionTimeInMinutes": -1,
    "logLevel": "info",
}

log = logging.getLogger(__name__)


@dataclass
class KafkaCluster:
    """The running brokers, by Kafka port."""

    zk_url: str
    procs: BrokerProcesses
    brokers: list[Broker]

    def bootstrap(self, broker: Broker) -> str:
        return f"127.0.0.1:{broker.port('kafkaListenerPort')}"

    def by_kafka_port(self, port: int) -> Broker:
        [found] = [b for b in self.brokers if b.port("kafkaListenerPort") == port]
        return found


@pytest.fixture
def kafka_cluster(zk_url: str, bookies: BookieProcesses, tmp_path: Path) -> Iterator[KafkaCluster]:
    """Two bookies and two brokers over one ZooKeeper chroot; every process is stopped (by
    PID) at teardown."""
    for _ in range(2):
        bookies.start(zk_url, {"metadataStoreSessionTimeoutMillis": 2000})
    initialize(zk_url, bundles=8)
    procs = BrokerProcesses(tmp_path)
    try:
        brokers = [procs.start(zk_url, BROKER_CONFIG) for _ in range(2)]
        yield KafkaCluster(zk_url, procs, brokers)
    finally:
        procs.close()


def wait_for(check: Any, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll ``check()`` until it is truthy; return the seconds it took, or fail naming
    ``what``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        time.sleep(interval)
    return time.monotonic() - start


def create_topic(cluster: KafkaCluster, via: Broker) -> None:
    admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap(via), request_timeout_ms=15000)
    try:
        admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
    finally:
        admin.close()


def leaders(cluster: KafkaCluster, via: Broker) -> tuple[dict[int, str], dict[int, int]]:
    """({node id: host:port}, {partition: leader node id}) as ``via`` describes them."""
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap(via)})
    md = admin.list_topics(TOPIC, timeout=15)
    nodes = {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()}
    parts = {p.id: p.leader for p in md.topics[TOPIC].partitions.values()}
    return nodes, parts


def coordinator_port(cluster: KafkaCluster, via: Broker) -> int:
    """The Kafka port of the group's coordinator as ``via`` names it."""
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap(via)})
    found = admin.describe_consumer_groups([GROUP], request_timeout=15)[GROUP].result(timeout=20)
    return int(found.coordinator.port)


def produce(producer: KafkaProducer, values: list[bytes], timeout: float) -> list[bytes]:
    """Send each value (spread over the partitions by key); return those acknowledged."""
    futures = [(v, producer.send(TOPIC, key=v[-2:], value=v)) for v in values]
    producer.flush(timeout=timeout)
    acked = []
    for v, f in futures:
        try:
            f.get(timeout=max(0.1, timeout))
            acked.append(v)
        except Exception as e:
            log.warning("send failed: %r", e)
    return acked


def consume_until(consumer: KafkaConsumer, wanted: set[bytes], timeout: float) -> list[bytes]:
    """Poll (committing what was read) until every wanted value was seen; return every value
    read, repeats included."""
    seen: list[bytes] = []
    deadline = time.monotonic() + timeout
    while not wanted <= set(seen) and time.monotonic() < deadline:
        batch = consumer.poll(timeout_ms=500)
        for records in batch.values():
            seen.extend(r.value for r in records)
        if batch:
            try:
                consumer.commit()
            except Exception as e:  # a rebalance or a moving coordinator: commit again later
                log.warning("commit failed: %r", e)
    return seen


def commit_all(consumer: KafkaConsumer, timeout: float) -> dict[int, int]:
    """Poll until the member holds every partition at its end with nothing left to read, then
    commit (a rebalance may rewind positions to the last commit: those records are read
    again first); return the committed offsets."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"the group did not settle within {timeout}s"
        if consumer.poll(timeout_ms=300):
            continue
        assignment = consumer.assignment()
        if len(assignment) != PARTITIONS:
            continue
        ends = consumer.end_offsets(list(assignment))
        if any(consumer.position(tp) != ends[tp] for tp in assignment):
            continue
        try:
            consumer.commit()
        except Exception as e:
            log.warning("commit failed: %r", e)
            continue
        return {tp.partition: ends[tp] for tp in assignment}


def test_metadata_names_each_partitions_owner_from_every_broker(
    kafka_cluster: KafkaCluster,
) -> None:
    """Once written, the 8 partitions are led by both brokers; both brokers list both with the
    same node ids, name the same leaders and the same group coordinator."""
    a, b = kafka_cluster.brokers
    create_topic(kafka_cluster, a)
    producer = KafkaProducer(bootstrap_servers=kafka_cluster.bootstrap(a), acks="all")
    try:
        for i in range(PARTITIONS):
            producer.send(TOPIC, value=b"v%d" % i, partition=i).get(timeout=30)
    finally:
        producer.close(timeout=10)
    nodes_a, leaders_a = leaders(kafka_cluster, a)
    nodes_b, leaders_b = leaders(kafka_cluster, b)
    ports = {b.port("kafkaListenerPort") for b in kafka_cluster.brokers}
    assert nodes_a == nodes_b
    assert {int(addr.rpartition(":")[2]) for addr in nodes_a.values()} == ports
    assert leaders_a == leaders_b
    assert set(leaders_a) == set(range(PARTITIONS))
    assert set(leaders_a.values()) == set(nodes_a), "both brokers lead some partitions"
    assert coordinator_port(kafka_cluster, a) == coordinator_port(kafka_cluster, b)


def test_kill_9_of_the_coordinator_loses_no_acknowledged_message(
    kafka_cluster: KafkaCluster,
) -> None:
    """kafka-python producer and consumer group through one broker's bootstrap; kill -9 the
    group's coordinator: sends and the group serve again within the bound, every acknowledged
    message is consumed, and a confluent-kafka consumer of the group then starts exactly at
    the committed offsets."""
    a, b = kafka_cluster.brokers
    create_topic(kafka_cluster, a)
    producer = KafkaProducer(
        bootstrap_servers=kafka_cluster.bootstrap(a),
        acks="all",
        retries=1_000_000,
        retry_backoff_ms=100,
        reconnect_backoff_ms=100,
        reconnect_backoff_max_ms=1000,
        request_timeout_ms=5000,
        delivery_timeout_ms=int(RECOVERY_S * 1000),
        metadata_max_age_ms=5000,
    )
    consumer = KafkaConsumer(
        TOPIC,
        bootstrap_servers=kafka_cluster.bootstrap(a),
        group_id=GROUP,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        request_timeout_ms=7000,
        retry_backoff_ms=100,
        reconnect_backoff_ms=100,
        reconnect_backoff_max_ms=1000,
        metadata_max_age_ms=5000,
    )
    try:
        before = [b"before-%04d" % i for i in range(200)]
        assert produce(producer, before, timeout=30) == before
        seen = consume_until(consumer, set(before), timeout=30)
        assert set(seen) == set(before)
        consumer.commit()

        # Every partition was written, so both brokers own some; the coordinator dies.
        victim = kafka_cluster.by_kafka_port(coordinator_port(kafka_cluster, a))
        _, leaders_now = leaders(kafka_cluster, a)
        assert len(set(leaders_now.values())) == 2
        survivor = b if victim is a else a
        killed_at = time.monotonic()
        kafka_cluster.procs.kill(victim)

        after = [b"after-%04d" % i for i in range(200)]
        acked = produce(producer, after, timeout=RECOVERY_S)
        produce_s = time.monotonic() - killed_at
        assert acked == after, f"only {len(acked)} of {len(after)} sends acknowledged"
        seen_after = consume_until(consumer, set(after), timeout=RECOVERY_S)
        consume_s = time.monotonic() - killed_at
        assert set(after) <= set(seen_after), "an acknowledged message was not consumed"
        commit_all(consumer, RECOVERY_S)
        print(f"\nkill -9 -> every send acknowledged {produce_s:.1f}s, consumed {consume_s:.1f}s")
        # The survivor leads everything now and coordinates the group.
        nodes, leaders_after = leaders(kafka_cluster, survivor)
        assert len(nodes) == 1
        assert set(leaders_after.values()) == set(nodes)
        assert coordinator_port(kafka_cluster, survivor) == survivor.port("kafkaListenerPort")
    finally:
        consumer.close()
        producer.close(timeout=10)

    # The group resumes from its committed offsets on a new member, through the survivor.
    last = [b"last-%04d" % i for i in range(50)]
    confluent = ConfluentProducer(
        {"bootstrap.servers": kafka_cluster.bootstrap(survivor), "acks": "all"}
    )
    for v in last:
        confluent.produce(TOPIC, key=v[-2:], value=v)
    assert confluent.flush(30) == 0
    member = ConfluentConsumer(
        {
            "bootstrap.servers": kafka_cluster.bootstrap(survivor),
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        member.subscribe([TOPIC])
        got: list[bytes] = []
        deadline = time.monotonic() + RECOVERY_S
        while len(got) < len(last) and time.monotonic() < deadline:
            msg = member.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
        assert sorted(got) == sorted(last), "the group did not resume at its committed offsets"
        committed = member.committed(
            [ConfluentTopicPartition(TOPIC, i) for i in range(PARTITIONS)], timeout=15
        )
        assert sum(max(tp.offset, 0) for tp in committed) >= len(before) + len(after)
    finally:
        member.close()


def test_kill_9_of_a_partition_leader_under_confluent_kafka_clients(
    kafka_cluster: KafkaCluster,
) -> None:
    """confluent-kafka producer and consumer group bootstrapped through the broker that is
    then killed (it leads some partitions, the other coordinates the group): both recover
    through the survivor within the bound, and every acknowledged message is consumed."""
    a, b = kafka_cluster.brokers
    create_topic(kafka_cluster, a)
    warm = ConfluentProducer({"bootstrap.servers": kafka_cluster.bootstrap(a), "acks": "all"})
    for i in range(PARTITIONS):
        warm.produce(TOPIC, value=b"warm-%d" % i, partition=i)
    assert warm.flush(30) == 0
    del warm
    coordinator = kafka_cluster.by_kafka_port(coordinator_port(kafka_cluster, a))
    victim = b if coordinator is a else a
    survivor = coordinator
    nodes, leaders_now = leaders(kafka_cluster, survivor)
    victim_node = next(
        n for n, addr in nodes.items() if addr.endswith(f":{victim.port('kafkaListenerPort')}")
    )
    assert victim_node in leaders_now.values(), "the victim leads some partitions"

    acked: list[bytes] = []
    failed: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            acked.append(msg.value())
        else:
            failed.append(str(err))

    producer = ConfluentProducer(
        {
            "bootstrap.servers": kafka_cluster.bootstrap(victim),
            "acks": "all",
            "enable.idempotence": True,
            "message.timeout.ms": int(RECOVERY_S * 1000),
            "retry.backoff.ms": 100,
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 1000,
            "topic.metadata.refresh.interval.ms": 2000,
        }
    )
    consumer = ConfluentConsumer(
        {
            "bootstrap.servers": kafka_cluster.bootstrap(victim),
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 1000,
            "topic.metadata.refresh.interval.ms": 2000,
        }
    )
    seen: list[bytes] = []

    def consume(wanted: set[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not wanted <= set(seen) and time.monotonic() < deadline:
            msgs = consumer.consume(num_messages=500, timeout=0.5)
            good = [m for m in msgs if m.error() is None]
            seen.extend(m.value() for m in good)
            if good:
                try:
                    consumer.commit(asynchronous=False)
                except Exception as e:  # the coordinator may be moving: commit again later
                    log.warning("commit failed: %r", e)

    try:
        consumer.subscribe([TOPIC])
        before = [b"before-%04d" % i for i in range(200)]
        for v in before:
            producer.produce(TOPIC, key=v[-2:], value=v, on_delivery=delivered)
        assert producer.flush(30) == 0
        assert sorted(acked) == sorted(before)
        consume(set(before), 30)
        assert set(before) <= set(seen)

        killed_at = time.monotonic()
        kafka_cluster.procs.kill(victim)
        after = [b"after-%04d" % i for i in range(200)]
        for v in after:
            producer.produce(TOPIC, key=v[-2:], value=v, on_delivery=delivered)
        assert producer.flush(RECOVERY_S + 5) == 0
        produce_s = time.monotonic() - killed_at
        assert failed == []
        assert set(after) <= set(acked)
        consume(set(after), RECOVERY_S)
        consume_s = time.monotonic() - killed_at
        assert set(acked) <= set(seen), "an acknowledged message was not consumed"
        print(f"\nkill -9 -> every send acknowledged {produce_s:.1f}s, consumed {consume_s:.1f}s")
        _, leaders_after = leaders(kafka_cluster, survivor)
        assert victim_node not in leaders_after.values()
    finally:
        consumer.close()
        producer.flush(5)


def read_partitions(cluster: KafkaCluster, via: Broker, timeout: float) -> list[bytes]:
    """Every record value of every partition, from the beginning to its end offset."""
    consumer = ConfluentConsumer(
        {
            "bootstrap.servers": cluster.bootstrap(via),
            "group.id": "exactly-once-check",
            "enable.auto.commit": False,
        }
    )
    try:
        ends = {
            i: consumer.get_watermark_offsets(ConfluentTopicPartition(TOPIC, i), timeout=15)[1]
            for i in range(PARTITIONS)
        }
        consumer.assign([ConfluentTopicPartition(TOPIC, i, 0) for i in range(PARTITIONS)])
        read = dict.fromkeys(range(PARTITIONS), 0)
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while any(read[i] < ends[i] for i in read) and time.monotonic() < deadline:
            for m in consumer.consume(num_messages=1000, timeout=0.5):
                if m.error() is None and m.offset() < ends[m.partition()]:
                    read[m.partition()] += 1
                    values.append(m.value())
        assert read == ends, f"read {read} of {ends} records"
        return values
    finally:
        consumer.close()


def test_kill_9_of_a_partition_leader_under_an_idempotent_producer_stores_each_once(
    kafka_cluster: KafkaCluster, bookies: BookieProcesses
) -> None:
    """An idempotent confluent-kafka producer keeps sending to both brokers; one bookie is
    paused (SIGSTOP), so the partition leader's appends reach the other bookie but are never
    answered, and the leader is killed -9 then (the bookie resumes). The new owner recovers
    those entries and rebuilds the producer's state from the partition's log, so the
    producer's retries of them are acknowledged, not stored again: afterwards every sent
    record is in the log exactly once."""
    a, b = kafka_cluster.brokers
    create_topic(kafka_cluster, a)
    warm = ConfluentProducer({"bootstrap.servers": kafka_cluster.bootstrap(a), "acks": "all"})
    for i in range(PARTITIONS):
        warm.produce(TOPIC, value=b"warm-%d" % i, partition=i)
    assert warm.flush(30) == 0
    del warm
    _, leaders_now = leaders(kafka_cluster, a)
    assert len(set(leaders_now.values())) == 2, "both brokers lead some partitions"
    victim, survivor = a, b
    paused = bookies.running[-1]

    acked: list[bytes] = []
    failed: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            acked.append(msg.value())
        else:
            failed.append(str(err))

    producer = ConfluentProducer(
        {
            "bootstrap.servers": f"{kafka_cluster.bootstrap(a)},{kafka_cluster.bootstrap(b)}",
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 2,
            "batch.num.messages": 20,
            "message.timeout.ms": int(RECOVERY_S * 1000),
            "retry.backoff.ms": 100,
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 1000,
            "topic.metadata.refresh.interval.ms": 2000,
        }
    )

    def send(values: list[bytes]) -> None:
        for i, v in enumerate(values):
            producer.produce(TOPIC, key=v[-2:], value=v, on_delivery=delivered)
            producer.poll(0)
            if i % 50 == 49:
                time.sleep(0.01)  # paced: batches keep flowing to both brokers

    sent = [b"idem-%05d" % i for i in range(3000)]
    send(sent[:1000])
    bookies.send(paused, signal.SIGSTOP)
    try:
        send(sent[1000:1500])  # appended on one bookie only: unanswered
        producer.poll(0.3)
        killed_at = time.monotonic()
        kafka_cluster.procs.kill(victim)
    finally:
        bookies.send(paused, signal.SIGCONT)
    send(sent[1500:])
    assert producer.flush(RECOVERY_S + 5) == 0
    produce_s = time.monotonic() - killed_at
    assert failed == []
    assert sorted(acked) == sorted(sent)

    stored = Counter(read_partitions(kafka_cluster, survivor, RECOVERY_S))
    repeated = {v: n for v, n in stored.items() if n > 1}
    assert repeated == {}, f"{len(repeated)} records stored more than once"
    assert set(stored) == set(sent) | {b"warm-%d" % i for i in range(PARTITIONS)}
    rebuilt = survivor.log.read_text(errors="replace").count("rebuilt Kafka producer states")
    print(f"\nkill -9 -> every send acknowledged {produce_s:.1f}s; {rebuilt} partitions rebuilt")


def test_a_group_keeps_what_it_has_not_read_on_a_partition_its_coordinator_does_not_own(
    zk_url: str, bookies: BookieProcesses, tmp_path: Path
) -> None:
    """With Pulsar's retention default (a ledger every subscription has passed is deleted), a
    group's commit on a partition another broker owns moves the group's subscription there
    too: the ledgers it has not consumed stay, and the group reads on from its commit after
    the partition's ledger is sealed and trimming runs."""
    for _ in range(2):
        bookies.start(zk_url, {"metadataStoreSessionTimeoutMillis": 2000})
    initialize(zk_url, bundles=8)
    procs = BrokerProcesses(tmp_path)
    try:
        config = {**BROKER_CONFIG, "defaultRetentionTimeInMinutes": 0}
        brokers = [procs.start(zk_url, config) for _ in range(2)]
        cluster = KafkaCluster(zk_url, procs, brokers)
        a = brokers[0]
        create_topic(cluster, a)
        boot = cluster.bootstrap(a)
        producer = KafkaProducer(bootstrap_servers=boot, acks="all")
        setup = KafkaConsumer(bootstrap_servers=boot, group_id=GROUP, enable_auto_commit=False)
        setup.assign([TopicPartition(TOPIC, 0)])
        setup.commit({TopicPartition(TOPIC, 0): OffsetAndMetadata(0, "", -1)})
        coordinator = coordinator_port(cluster, a)
        nodes, parts = leaders(cluster, a)
        partition = next(
            p for p, n in sorted(parts.items()) if not nodes[n].endswith(f":{coordinator}")
        )
        owner = cluster.by_kafka_port(int(nodes[parts[partition]].rsplit(":", 1)[1]))
        tp = TopicPartition(TOPIC, partition)
        values = [b"v-%03d" % i for i in range(100)]
        for v in values:  # an entry each, so that the commit at 50 falls between entries
            producer.send(TOPIC, value=v, partition=partition)
            producer.flush(timeout=30)
        setup.commit({tp: OffsetAndMetadata(50, "", -1)})
        setup.close()
        topic_path = f"persistent/public/default/{TOPIC}-partition-{partition}"
        stats_url = f"{owner.http_url}/admin/v2/{topic_path}/stats"

        def mirrored() -> bool:
            subs = http("GET", stats_url).get("subscriptions", {})
            return GROUP in subs and subs[GROUP].get("msgBacklog") == 50

        wait_for(mirrored, 30, "the group's subscription on the partition's owner")
        # Seal the partition's ledger (an unload; the next write opens a new one), then write:
        # the sealed ledger goes unless a subscription still needs it.
        http("PUT", f"{owner.http_url}/admin/v2/{topic_path}/unload")
        producer.send(TOPIC, value=b"v-100", partition=partition)
        producer.flush(timeout=30)
        producer.close()
        reader = KafkaConsumer(
            bootstrap_servers=boot,
            group_id=GROUP,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        reader.assign([tp])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 51 and time.monotonic() < deadline:
            for records in reader.poll(timeout_ms=500).values():
                got.extend(r.value for r in records)
        reader.close()
        assert got == [*values[50:], b"v-100"]
    finally:
        procs.close()


def test_bundles_swapping_brokers_under_kafka_python_clients(kafka_cluster: KafkaCluster) -> None:
    """Every bundle of public/default is transferred to the other broker while sends are in
    flight and the group is stable: partitions and the coordinator move, every acknowledged
    message is consumed, and the group's commits survive the move."""
    a, b = kafka_cluster.brokers
    create_topic(kafka_cluster, a)
    producer = KafkaProducer(
        bootstrap_servers=kafka_cluster.bootstrap(a),
        acks="all",
        retries=1_000_000,
        retry_backoff_ms=100,
        request_timeout_ms=5000,
        delivery_timeout_ms=int(RECOVERY_S * 1000),
    )
    consumer = KafkaConsumer(
        TOPIC,
        bootstrap_servers=kafka_cluster.bootstrap(a),
        group_id=GROUP,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        retry_backoff_ms=100,
    )
    try:
        before = [b"before-%04d" % i for i in range(100)]
        assert produce(producer, before, timeout=30) == before
        assert set(before) <= set(consume_until(consumer, set(before), timeout=30))
        consumer.commit()
        coordinator_before = coordinator_port(kafka_cluster, a)
        owners = http("GET", f"{a.http_url}/admin/v2/namespaces/public/default/owners")
        other = {a.broker_id: b.broker_id, b.broker_id: a.broker_id}
        moving = [(bundle, owner) for bundle, owner in owners.items() if owner is not None]
        assert {owner for _, owner in moving} == {a.broker_id, b.broker_id}

        after = [b"after-%04d" % i for i in range(200)]
        futures = [producer.send(TOPIC, key=v[-2:], value=v) for v in after[:100]]
        for bundle, owner in moving:
            http(
                "PUT",
                f"{a.http_url}/admin/v2/namespaces/public/default/{bundle}/unload"
                f"?destinationBroker={other[owner]}",
            )
        futures += [producer.send(TOPIC, key=v[-2:], value=v) for v in after[100:]]
        producer.flush(timeout=RECOVERY_S)
        assert all(f.succeeded() for f in futures), "a send was not acknowledged"
        seen = consume_until(consumer, set(after), timeout=RECOVERY_S)
        assert set(after) <= set(seen), "an acknowledged message was not consumed"
        committed = commit_all(consumer, RECOVERY_S)
        assert sum(committed.values()) >= len(before) + len(after)
        moved = http("GET", f"{a.http_url}/admin/v2/namespaces/public/default/owners")
        for bundle, owner in moving:
            assert moved[bundle] in (None, other[owner]), f"{bundle} did not move"
        assert coordinator_port(kafka_cluster, b) != coordinator_before
    finally:
        consumer.close()
        producer.close(timeout=10)
    # A new member of the group starts where the commits left it: nothing is read again, and
    # a marker produced once it holds its partitions is the one message it gets.
    member = ConfluentConsumer(
        {
            "bootstrap.servers": kafka_cluster.bootstrap(b),
            "group.id": GROUP,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    assigned: list[Any] = []
    marker = b"marker"
    got: list[bytes] = []
    try:
        member.subscribe([TOPIC], on_assign=lambda _, parts: assigned.extend(parts))
        sent = False
        deadline = time.monotonic() + RECOVERY_S
        while marker not in got:
            assert time.monotonic() < deadline, "the new member did not get the marker"
            msg = member.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
            if len(assigned) == PARTITIONS and not sent:
                marking = ConfluentProducer(
                    {"bootstrap.servers": kafka_cluster.bootstrap(b), "acks": "all"}
                )
                marking.produce(TOPIC, value=marker, partition=0)
                assert marking.flush(30) == 0
                sent = True
        assert got == [marker], "the group did not resume at its committed offsets"
        resumed = member.committed(
            [ConfluentTopicPartition(TOPIC, i) for i in range(PARTITIONS)], timeout=15
        )
        assert {tp.partition: tp.offset for tp in resumed} == committed
    finally:
        member.close()


SPARK_CALLS = Path(__file__).parents[1] / "protocols" / "kafka" / "java" / "SparkKafkaCalls.java"


def java_classpath() -> str | None:
    """kafka-clients 3.9 (inside the pyflink wheel) and slf4j, or None when missing."""
    try:
        import pyflink
    except ImportError:
        return None
    jar = Path(next(iter(pyflink.__path__))) / "lib" / "kafka-clients.jar"
    if not jar.exists():
        return None
    extra = [Path("/usr/share/java/slf4j-api.jar"), Path("/usr/share/java/slf4j-nop.jar")]
    try:  # lz4-java, as Spark ships it beside the connector
        import pyspark

        extra += sorted((Path(pyspark.__file__).parent / "jars").glob("lz4-java-*.jar"))
    except ImportError:
        pass
    return ":".join(str(p) for p in [jar, *extra] if p.exists())


@pytest.mark.skipif(shutil.which("java") is None, reason="Java is not installed")
def test_spark_kafka_calls_of_the_java_client_on_a_cluster(kafka_cluster: KafkaCluster) -> None:
    """The Java kafka-clients calls Spark's Kafka source and sink make (admin describeTopics
    and listOffsets, the idempotent acks=all producer, assign/seek/poll) give the results they
    give on one broker, bootstrapped through one broker of the cluster."""
    cp = java_classpath()
    if cp is None:
        pytest.skip("kafka-clients.jar (shigawire-apache-flink-libraries) is not installed")
    a, _ = kafka_cluster.brokers
    done = subprocess.run(
        ["java", "-cp", cp, str(SPARK_CALLS), kafka_cluster.bootstrap(a), "spark-topic"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={done.returncode} {done.stdout[-2000:]} {done.stderr[-4000:]}"
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["partitions"] == 2
    assert (r["earliest"], r["latest"]) == ([0, 0], [10, 10])
    assert (r["consumed"], r["position"], r["beginning"], r["end"]) == (17, 10, 0, 10)
