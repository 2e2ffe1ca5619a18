"""Consumer groups over the Kafka handler: rebalances, commits and group admin."""

from __future__ import annotations

import threading
import time

import pytest
import pytest_twisted
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaConsumer
from kafka import TopicPartition as KTopicPartition
from kafka_harness import Broker


def _wait(cond: object, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("assignor", ["range", "roundrobin", "cooperative-sticky"])
@pytest_twisted.ensureDeferred
async def test_two_members_rebalance_and_share_partitions(broker: Broker, assignor: str) -> None:
    """Two librdkafka members of one group split 4 partitions, and one leaving hands its
    partitions to the other, with each client-side assignor; every record is consumed."""

    def scenario() -> dict[str, object]:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        topic = f"grp-{assignor}"
        created = admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
        created[topic].result(10)
        p = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(40):
            p.produce(topic, value=b"%d" % i, partition=i % 4)
        assert p.flush(20) == 0
        assignments: dict[str, set[int]] = {"a": set(), "b": set()}
        seen: dict[str, list[bytes]] = {"a": [], "b": []}
        stop = {"a": threading.Event(), "b": threading.Event()}

        def member(name: str) -> None:
            c = Consumer(
                {
                    "bootstrap.servers": broker.bootstrap,
                    "group.id": f"g2-{assignor}",
                    "auto.offset.reset": "earliest",
                    "session.timeout.ms": 6000,
                    "heartbeat.interval.ms": 200,
                    "partition.assignment.strategy": assignor,
                }
            )
            cooperative = assignor == "cooperative-sticky"

            def on_assign(consumer: Consumer, parts: list[TopicPartition]) -> None:
                # Cooperative rebalances hand out and revoke increments; eager ones replace.
                got = {tp.partition for tp in parts}
                assignments[name] = assignments[name] | got if cooperative else got

            def on_revoke(consumer: Consumer, parts: list[TopicPartition]) -> None:
                if cooperative:
                    assignments[name] = assignments[name] - {tp.partition for tp in parts}

            c.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
            while not stop[name].is_set():
                m = c.poll(0.1)
                if m is not None and not m.error():
                    seen[name].append(m.value())
            c.close()

        ta = threading.Thread(target=member, args=("a",))
        tb = threading.Thread(target=member, args=("b",))
        ta.start()
        try:
            first = _wait(lambda: len(assignments["a"]) == 4)
            tb.start()
            split = _wait(
                lambda: (
                    assignments["a"]
                    and assignments["b"]
                    and not (assignments["a"] & assignments["b"])
                    and len(assignments["a"] | assignments["b"]) == 4
                )
            )
            both = (sorted(assignments["a"]), sorted(assignments["b"]))
            stop["b"].set()
            if tb.is_alive():
                tb.join(30)
            regained = _wait(lambda: len(assignments["a"]) == 4)
            _wait(lambda: len(set(seen["a"]) | set(seen["b"])) == 40)
        finally:
            stop["a"].set()
            stop["b"].set()
            ta.join(30)
            if tb.ident is not None:
                tb.join(30)
        return {
            "first": first,
            "split": split,
            "both": both,
            "regained": regained,
            "values": sorted(int(v) for v in set(seen["a"]) | set(seen["b"])),
        }

    r = await broker.run(scenario)
    assert r["first"]
    assert r["split"], r["both"]
    assert r["regained"]
    assert r["values"] == list(range(40))


@pytest_twisted.ensureDeferred
async def test_commits_survive_consumer_restart(broker: Broker) -> None:
    """A kafka-python group consumer that committed resumes after its commit when restarted;
    the commit shows as a Pulsar subscription named after the group, with no backlog left."""

    def scenario() -> tuple[list[int], list[int], int | None]:
        p = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(10):
            p.produce("commits", value=b"%d" % i)
        assert p.flush(20) == 0

        def consume(n: int) -> list[int]:
            c = KafkaConsumer(
                "commits",
                bootstrap_servers=broker.bootstrap,
                group_id="cg",
                auto_offset_reset="earliest",
                enable_auto_commit=False,
                consumer_timeout_ms=10_000,
            )
            got = []
            for rec in c:
                got.append(rec.offset)
                if len(got) == n:
                    break
            c.commit()
            committed = c.committed(KTopicPartition("commits", 0))
            c.close()
            return [*got, committed]

        first = consume(6)
        second = consume(4)

        def backlog() -> object:
            stats = broker.call(broker.service.stats, "commits-partition-0")
            return stats["subscriptions"].get("cg", {}).get("msgBacklog")

        assert _wait(lambda: backlog() == 0, 10)
        return first[:-1], second[:-1], second[-1]

    first, second, committed = await broker.run(scenario)
    assert first == [0, 1, 2, 3, 4, 5]
    assert second == [6, 7, 8, 9]
    assert committed == 10


@pytest_twisted.ensureDeferred
async def test_a_deleted_topic_takes_its_committed_offsets_with_it(broker: Broker) -> None:
    """As on Kafka: a group that committed on a topic that is deleted and created again
    reads the new topic from its start (auto.offset.reset), skipping nothing."""

    def scenario() -> tuple[list[tuple[int, int]], list[bytes]]:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        conf = {"bootstrap.servers": broker.bootstrap, "group.id": "again"}
        admin.create_topics([NewTopic("gone", 1, 1)])["gone"].result(10)
        c = Consumer({**conf, "enable.auto.commit": False})
        c.commit(offsets=[TopicPartition("gone", 0, 5)], asynchronous=False)
        c.close()
        admin.delete_topics(["gone"])["gone"].result(10)
        admin.create_topics([NewTopic("gone", 1, 1)])["gone"].result(10)
        p = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(8):
            p.produce("gone", value=b"new-%d" % i)
        assert p.flush(20) == 0
        c = Consumer({**conf, "auto.offset.reset": "earliest"})
        committed = [
            (tp.partition, tp.offset) for tp in c.committed([TopicPartition("gone", 0)], timeout=10)
        ]
        c.subscribe(["gone"])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 8 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                got.append(m.value())
        c.close()
        return committed, got

    committed, got = await broker.run(scenario)
    assert committed == [(0, -1001)]  # none
    assert got == [b"new-%d" % i for i in range(8)]


@pytest_twisted.ensureDeferred
async def test_list_describe_delete_groups(broker: Broker) -> None:
    """The admin API lists and describes a live group and deletes it once it is empty."""

    def scenario() -> dict[str, object]:
        p = Producer({"bootstrap.servers": broker.bootstrap})
        p.produce("listed-topic", value=b"x")
        assert p.flush(20) == 0
        c = Consumer(
            {
                "bootstrap.servers": broker.bootstrap,
                "group.id": "listed",
                "auto.offset.reset": "earliest",
            }
        )
        assigned = threading.Event()
        c.subscribe(["listed-topic"], on_assign=lambda *_: assigned.set())
        deadline = time.monotonic() + 20
        while not assigned.is_set() and time.monotonic() < deadline:
            c.poll(0.1)
        c.commit(offsets=[TopicPartition("listed-topic", 0, 0)], asynchronous=False)
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        listed = [g.group_id for g in admin.list_consumer_groups().result(10).valid]
        described = admin.describe_consumer_groups(["listed"])["listed"].result(10)
        members = len(described.members)
        c.close()
        deleted = admin.delete_consumer_groups(["listed"])["listed"].result(10)
        return {"listed": listed, "members": members, "deleted": deleted}

    r = await broker.run(scenario)
    assert "listed" in r["listed"]
    assert r["members"] == 1
    assert r["deleted"] is None


@pytest_twisted.ensureDeferred
async def test_commits_for_partitions_that_do_not_exist_are_refused(broker: Broker) -> None:
    """As on Kafka: UNKNOWN_TOPIC_OR_PARTITION for a topic or partition that does not exist,
    and nothing is stored for it; the commit's other partitions are stored."""

    def scenario() -> tuple[list[object], list[int]]:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        admin.create_topics([NewTopic("one-part", 1, 1)])["one-part"].result(10)
        c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "strict"})
        asked = [
            TopicPartition("one-part", 0, 3),
            TopicPartition("one-part", 9, 3),
            TopicPartition("no-such-topic", 0, 3),
        ]
        try:
            c.commit(offsets=asked, asynchronous=False)
            errors: list[object] = [None]
        except Exception as e:
            errors = [e.args[0].code()]
        stored = [tp.offset for tp in c.committed(asked[:2], timeout=10)]
        c.close()
        return errors, stored

    errors, stored = await broker.run(scenario)
    assert errors == [KafkaError.UNKNOWN_TOPIC_OR_PART]
    assert stored == [3, -1001]  # partition 0 kept; none for partition 9


@pytest_twisted.ensureDeferred
async def test_offsets_of_a_group_with_members_change_only_by_its_members(
    broker: Broker,
) -> None:
    """As on Kafka: altering a group's offsets from outside (an admin tool) is refused while
    the group has members, and done once it is empty."""

    def scenario() -> tuple[object, list[int]]:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        admin.create_topics([NewTopic("busy", 1, 1)])["busy"].result(10)
        member = Consumer(
            {
                "bootstrap.servers": broker.bootstrap,
                "group.id": "busy-g",
                "session.timeout.ms": 6000,
            }
        )
        member.subscribe(["busy"])
        assert _wait(lambda: bool(member.poll(0.2) is None and member.assignment()), 30)
        request = ConsumerGroupTopicPartitions("busy-g", [TopicPartition("busy", 0, 7)])
        answer = admin.alter_consumer_group_offsets([request])["busy-g"].result(10)
        error = answer.topic_partitions[0].error  # per partition, not raised
        refused = None if error is None else error.code()
        member.close()
        admin.alter_consumer_group_offsets([request])["busy-g"].result(10)
        check = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "busy-g"})
        stored = [tp.offset for tp in check.committed([TopicPartition("busy", 0)], timeout=10)]
        check.close()
        return refused, stored

    refused, stored = await broker.run(scenario)
    assert refused == KafkaError.UNKNOWN_MEMBER_ID
    assert stored == [7]
