"""Unit tests of the Kafka handler in cluster mode, over a fake ownership (who owns which topic
is set by the test), the in-memory metadata store, a Clock and the fake ledger: node ids,
leaders, coordinators, and the errors that send clients to the right broker."""

from __future__ import annotations

import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kafka.protocol.consumer import (
    FetchRequest,
    HeartbeatRequest,
    JoinGroupRequest,
    ListOffsetsRequest,
    OffsetCommitRequest,
    OffsetFetchRequest,
)
from kafka.protocol.metadata import FindCoordinatorRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.record.memory_records import MemoryRecordsBuilder
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of

from polybroker.broker_core import messages
from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.ownership import BrokerInfo, NotOwnerError, Ownership
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.metadata.memory import MemoryMetadataStore
from polybroker.protocols.kafka import codec as c
from polybroker.protocols.kafka.apis import SWEEP_INTERVAL_S, KafkaApis, Settings
from polybroker.protocols.kafka.cluster import (
    OWNERSHIP_TIMEOUT_S,
    SETTLED_S,
    KafkaCluster,
    coordinator_slot,
    lookup_url,
)
from polybroker.protocols.kafka.connection import KafkaConnection
from polybroker.protocols.kafka.groups import GroupCoordinator

HERE = "10.0.0.1:8080"
THERE = "10.0.0.2:8080"
ADMIN_ONLY = "10.0.0.3:8080"


def info(broker_id: str, kafka: str | None) -> BrokerInfo:
    return BrokerInfo(broker_id, f"http://{broker_id}", listeners={"kafka": kafka} if kafka else {})


class FakeOwnership(Ownership):
    """Ownership decided by the test: ``owners`` maps full topic names to broker ids; an
    unowned topic's lookup names ``candidate`` (claiming it when that is this broker)."""

    def __init__(self, local: BrokerInfo, live: Mapping[str, BrokerInfo]) -> None:
        self.local = local
        self.live = dict(live)
        self.owners: dict[str, str] = {}
        self.candidate = local.broker_id
        self.broken: set[str] = set()  # topics whose lookup fails
        self.lookups = 0

    @property
    def clustered(self) -> bool:
        return True

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        self.lookups += 1
        if topic in self.broken:
            return fail(ServiceNotReadyError("no broker"))
        owner = self.owners.get(topic)
        if owner is None:
            owner = self.candidate
            if owner == self.local.broker_id:
                self.owners[topic] = owner
        return succeed(self.live[owner])

    def acquire(self, topic: str) -> Deferred[None]:
        owner = self.owners.setdefault(topic, self.local.broker_id)
        if owner != self.local.broker_id:
            return fail(NotOwnerError(f"{topic} is served by {owner}", self.live.get(owner)))
        return succeed(None)

    def owns(self, topic: str) -> bool:
        return self.owners.get(topic) == self.local.broker_id

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([self.live[k] for k in sorted(self.live)])


class Node:
    """One broker's Kafka APIs (fake storage, shared metadata store) and a client connection."""

    def __init__(self, store: MemoryMetadataStore, clock: Clock, local: str = HERE) -> None:
        self.clock = clock
        live = {
            HERE: info(HERE, "10.0.0.1:9092"),
            THERE: info(THERE, "10.0.0.2:9093"),
            ADMIN_ONLY: info(ADMIN_ONLY, None),
        }
        self.ownership = FakeOwnership(live[local], live)
        self.service = BrokerService(
            FakeLedgerFactory(clock.seconds),
            clock,
            Config({"statsUpdateFrequencyInSecs": 0}),
            store,
        )
        self.service.ownership = self.ownership
        self.cluster = KafkaCluster(self.ownership, store, clock, coordinator_slots=4)
        self.apis = KafkaApis(
            self.service,
            clock,
            Settings(
                node_id=0,
                host=lambda: "unused",
                port=lambda: 1,
                cluster_id="test",
                max_message_size=1 << 20,
                default_partitions=4,
                auto_create=True,
                entry_format="kafka",
                api_versions=dict(c.API_VERSIONS_MODERN),
            ),
            self.cluster,
        )
        self.transport = StringTransport()
        self.conn = KafkaConnection(self.apis, max_frame=2 << 20)
        self.conn.makeConnection(self.transport)
        self.corr = 0

    def full(self, topic: str, partition: int) -> str:
        return f"persistent://public/default/{topic}-partition-{partition}"

    def send(self, request: Any) -> int:
        self.corr += 1
        request.with_header(correlation_id=self.corr, client_id="unit")
        self.conn.dataReceived(bytes(request.encode(header=True, framed=True)))
        return self.corr

    def answers(self, request: Any) -> list[Any]:
        """Decoded responses waiting on the wire (for requests of ``request``'s type)."""
        data = self.transport.value()
        self.transport.clear()
        out = []
        pos = 0
        cls = c.response_class(request.API_KEY)
        while pos < len(data):
            (size,) = struct.unpack_from(">i", data, pos)
            body = data[pos + 8 : pos + 4 + size]
            pos += 4 + size
            if cls.flexible_version_q(request.API_VERSION):
                body = body[1:]
            out.append(cls[request.API_VERSION].decode(body))
        return out

    def call(self, request: Any) -> Any:
        self.send(request)
        [answer] = self.answers(request)
        return answer


def cluster_pair() -> tuple[Node, Clock, MemoryMetadataStore]:
    clock = Clock()
    store = MemoryMetadataStore(clock)
    node = Node(store, clock)
    # Node ids in registration order: this broker first.
    result_of(node.cluster.node_id(HERE))
    result_of(node.cluster.node_id(THERE))
    return node, clock, store


def records(n: int = 2) -> bytes:
    b = MemoryRecordsBuilder(2, 0, 1 << 20)
    for i in range(n):
        b.append(1000 + i, None, b"v%d" % i, [])
    b.close()
    return bytes(b.buffer())


def produce(topic: str, partition: int) -> Any:
    return ProduceRequest[7](
        transactional_id=None,
        acks=-1,
        timeout_ms=1000,
        topic_data=[
            ProduceRequest.TopicProduceData(
                name=topic,
                partition_data=[
                    ProduceRequest.TopicProduceData.PartitionProduceData(
                        index=partition, records=records()
                    )
                ],
            )
        ],
    )


def fetch(topic: str, partition: int) -> Any:
    return FetchRequest[10](
        replica_id=-1,
        max_wait_ms=500,
        min_bytes=1,
        max_bytes=1 << 20,
        isolation_level=0,
        session_id=0,
        session_epoch=-1,
        topics=[
            FetchRequest.FetchTopic(
                topic=topic,
                partitions=[
                    FetchRequest.FetchTopic.FetchPartition(
                        partition=partition,
                        current_leader_epoch=-1,
                        fetch_offset=0,
                        log_start_offset=-1,
                        partition_max_bytes=1 << 20,
                    )
                ],
            )
        ],
        forgotten_topics_data=[],
        rack_id="",
    )


def metadata(*topics: str) -> Any:
    return MetadataRequest[7](
        topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
        allow_auto_topic_creation=True,
    )


def join(group: str, member: str = "") -> Any:
    return JoinGroupRequest[4](
        group_id=group,
        session_timeout_ms=10_000,
        rebalance_timeout_ms=10_000,
        member_id=member,
        protocol_type="consumer",
        protocols=[JoinGroupRequest.JoinGroupRequestProtocol(name="range", metadata=b"m")],
    )


def commit(
    group: str, offset: int, partition: int = 0, member: str = "", generation: int = -1
) -> Any:
    part = OffsetCommitRequest.OffsetCommitRequestTopic.OffsetCommitRequestPartition
    return OffsetCommitRequest[2](
        group_id=group,
        generation_id_or_member_epoch=generation,
        member_id=member,
        retention_time_ms=-1,
        topics=[
            OffsetCommitRequest.OffsetCommitRequestTopic(
                name="t",
                partitions=[
                    part(partition_index=partition, committed_offset=offset, committed_metadata="")
                ],
            )
        ],
    )


def offset_fetch(group: str) -> Any:
    return OffsetFetchRequest[3](
        group_id=group,
        topics=[OffsetFetchRequest.OffsetFetchRequestTopic(name="t", partition_indexes=[0, 1])],
    )


def group_in_slot_owned_by(node: Node, owner: str) -> str:
    """A group id and, as the test's setting, its coordinator slot owned by ``owner``."""
    group = "g-a"
    node.ownership.owners[node.cluster.coordinator_topic(group)] = owner
    return group


# -- node ids --------------------------------------------------------------------------------


def test_node_ids_are_registered_once_unique_and_shared_by_every_broker() -> None:
    """The first broker to need an id registers it; another broker (and this one after a
    restart) reads the same id; distinct brokers get distinct ids."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    own = FakeOwnership(info(HERE, "h:1"), {HERE: info(HERE, "h:1")})
    first = KafkaCluster(own, store, clock)
    other = KafkaCluster(own, store.new_session(), clock)
    a = result_of(first.node_id(HERE))
    b = result_of(other.node_id(THERE))
    assert a != b
    assert result_of(other.node_id(HERE)) == a
    assert result_of(KafkaCluster(own, store, clock).node_id(THERE)) == b
    assert 0 <= a < 2**31
    assert 0 <= b < 2**31


def test_concurrent_registrations_of_one_broker_agree() -> None:
    """Two brokers registering the same broker id at once end with one id: the mapping is
    created by compare-and-set, the loser reads the winner's."""

    class SlowCreate(FakeMetadataStore):
        """Holds every put until the test releases it, so both registrations interleave."""

        def __init__(self) -> None:
            super().__init__()
            self.seq = 0
            self.held: list[tuple[Deferred[Any], str, bytes, int | None]] = []

        def create_sequential(self, prefix: str, value: bytes, *, ephemeral: bool = False) -> Any:
            self.seq += 1
            path = f"{prefix}{self.seq:010d}"
            self.nodes[path] = (value, 0)
            return succeed(path)

        def put(
            self, path: str, value: bytes, expected_version: int | None = None, **kw: Any
        ) -> Any:
            if not path.startswith("/kafka/node-ids/"):
                return super().put(path, value, expected_version, **kw)
            d: Deferred[Any] = Deferred()
            self.held.append((d, path, value, expected_version))
            return d

        def release(self) -> None:
            held, self.held = self.held, []
            for d, path, value, version in held:
                super().put(path, value, version).chainDeferred(d)

    store = SlowCreate()
    own = FakeOwnership(info(HERE, "h:1"), {HERE: info(HERE, "h:1")})
    x, y = KafkaCluster(own, store, Clock()), KafkaCluster(own, store, Clock())
    dx, dy = x.node_id(THERE), y.node_id(THERE)
    again = x.node_id(THERE)  # waits for the registration in flight
    store.release()
    assert result_of(dx) == result_of(dy) == result_of(again)
    assert not [p for p in store.nodes if p.startswith("/kafka/node-id-seq/")]


# -- metadata --------------------------------------------------------------------------------


def test_metadata_lists_kafka_brokers_and_each_partitions_owner_as_leader() -> None:
    """Brokers without a Kafka listener are not listed; the controller is the smallest node
    id; partitions owned elsewhere name that broker, unowned ones are claimed here."""
    node, _, _ = cluster_pair()
    here, there = result_of(node.cluster.node_id(HERE)), result_of(node.cluster.node_id(THERE))
    node.ownership.owners[node.full("t", 1)] = THERE
    node.ownership.owners[node.full("t", 3)] = THERE
    answer = node.call(metadata("t"))
    assert sorted((b.node_id, b.host, b.port) for b in answer.brokers) == sorted(
        [(here, "10.0.0.1", 9092), (there, "10.0.0.2", 9093)]
    )
    assert answer.controller_id == min(here, there)
    [topic] = answer.topics
    assert topic.error_code == c.NONE
    got = {p.partition_index: (p.leader_id, p.replica_nodes, p.isr_nodes) for p in topic.partitions}
    assert got == {
        0: (here, [here], [here]),
        1: (there, [there], [there]),
        2: (here, [here], [here]),
        3: (there, [there], [there]),
    }
    assert node.ownership.owns(node.full("t", 0))
    assert node.ownership.owns(node.full("t", 2))


def test_a_partition_without_a_leader_is_leader_not_available() -> None:
    """A failed lookup, or an owner that is not a live Kafka broker, gives error 5 and no
    leader for that partition only."""
    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 3))
    node.ownership.broken.add(node.full("t", 0))
    node.ownership.owners[node.full("t", 1)] = ADMIN_ONLY
    [topic] = node.call(metadata("t")).topics
    parts = {p.partition_index: p for p in topic.partitions}
    for i in (0, 1):
        assert (parts[i].error_code, parts[i].leader_id, parts[i].replica_nodes) == (
            c.LEADER_NOT_AVAILABLE,
            -1,
            [],
        )
    assert parts[2].error_code == c.NONE


def test_metadata_lookups_run_at_most_max_lookups_at_a_time() -> None:
    """Many partitions are looked up concurrently, bounded by the semaphore."""
    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("big", 40))
    pending: list[Deferred[BrokerInfo]] = []

    def slow(topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        d: Deferred[BrokerInfo] = Deferred()
        pending.append(d)
        return d

    node.ownership.lookup = slow  # type: ignore[method-assign]
    node.cluster = KafkaCluster(
        node.ownership, node.service.metadata_store, node.clock, max_lookups=8
    )
    node.apis.cluster = node.cluster
    node.send(metadata("big"))
    assert len(pending) == 8  # the rest wait for a slot
    here = node.ownership.live[HERE]
    while pending:
        d = pending.pop(0)
        d.callback(here)
    [answer] = node.answers(metadata("big"))
    assert len(answer.topics[0].partitions) == 40


# -- produce, fetch, list offsets ------------------------------------------------------------


def test_data_requests_for_partitions_owned_elsewhere_are_not_leader() -> None:
    """Produce, Fetch and ListOffsets on another broker's partition answer error 6 and store
    nothing; this broker's own partitions are served."""
    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))
    node.ownership.owners[node.full("t", 1)] = THERE
    assert node.call(produce("t", 1)).responses[0].partition_responses[0].error_code == (
        c.NOT_LEADER_OR_FOLLOWER
    )
    ok = node.call(produce("t", 0)).responses[0].partition_responses[0]
    assert (ok.error_code, ok.base_offset) == (c.NONE, 0)
    assert node.call(fetch("t", 1)).responses[0].partitions[0].error_code == (
        c.NOT_LEADER_OR_FOLLOWER
    )
    assert node.call(fetch("t", 0)).responses[0].partitions[0].high_watermark == 2
    part = ListOffsetsRequest.ListOffsetsTopic.ListOffsetsPartition
    listed = node.call(
        ListOffsetsRequest[4](
            replica_id=-1,
            isolation_level=0,
            topics=[
                ListOffsetsRequest.ListOffsetsTopic(
                    name="t",
                    partitions=[
                        part(partition_index=i, current_leader_epoch=-1, timestamp=-1)
                        for i in (0, 1)
                    ],
                )
            ],
        )
    )
    assert [(p.error_code, p.offset) for p in listed.topics[0].partitions] == [
        (c.NONE, 2),
        (c.NOT_LEADER_OR_FOLLOWER, -1),
    ]
    assert node.full("t", 1) not in node.service.topics


def test_producer_state_is_rebuilt_when_a_partition_comes_back() -> None:
    """An idempotent producer whose partition was served elsewhere meanwhile (the topic was
    unloaded, another broker appended its later batches, the topic came back) continues with
    its next sequence, and its retry of a batch the other broker stored is not stored again."""
    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 1))

    def records(seq: int) -> bytes:
        b = MemoryRecordsBuilder(2, 0, 1 << 20)
        b.set_producer_state(77, 0, seq, False)
        b.append(1000, None, b"x%d" % seq, [])
        b.close()
        return bytes(b.buffer())

    def batch(seq: int) -> Any:
        req = produce("t", 0)
        req.topic_data[0].partition_data[0].records = records(seq)
        return req

    assert node.call(batch(0)).responses[0].partition_responses[0].error_code == c.NONE
    result_of(node.service.unload_topic(node.full("t", 0)))  # served by another broker ...
    elsewhere = result_of(node.service.get_topic(node.full("t", 0)))
    for seq in range(1, 5):
        data = messages.encode_native_entry(
            "kafka",
            records(seq),
            num_messages=1,
            producer_name="kafka-77",
            sequence_id=seq,
            publish_time_ms=1,
        )
        result_of(elsewhere.publish(data, 1))
    result_of(node.service.unload_topic(node.full("t", 0)))
    retried = node.call(batch(4)).responses[0].partition_responses[0]  # ... then back here
    assert (retried.error_code, retried.base_offset) == (c.NONE, 4)
    answer = node.call(batch(5)).responses[0].partition_responses[0]
    assert (answer.error_code, answer.base_offset) == (c.NONE, 5)
    assert result_of(node.service.get_topic(node.full("t", 0))).next_index == 6


# -- coordinators ----------------------------------------------------------------------------


def test_find_coordinator_names_the_owner_of_the_groups_slot() -> None:
    """FindCoordinator (v2 and the v4 batch) answers each group's slot owner; an unowned slot
    is claimed by the broker the lookup names."""
    node, _, _ = cluster_pair()
    there = result_of(node.cluster.node_id(THERE))
    elsewhere = group_in_slot_owned_by(node, THERE)
    one = node.call(FindCoordinatorRequest[2](key=elsewhere, key_type=0))
    assert (one.error_code, one.node_id, one.host, one.port) == (c.NONE, there, "10.0.0.2", 9093)
    other = next(
        g
        for g in (f"x{i}" for i in range(100))
        if coordinator_slot(g, 4) != coordinator_slot(elsewhere, 4)
    )
    batch = node.call(FindCoordinatorRequest[4](key_type=0, coordinator_keys=[elsewhere, other]))
    here = result_of(node.cluster.node_id(HERE))
    assert [(x.key, x.node_id, x.port) for x in batch.coordinators] == [
        (elsewhere, there, 9093),
        (other, here, 9092),
    ]
    assert node.ownership.owns(node.cluster.coordinator_topic(other))


def test_group_apis_on_a_broker_that_is_not_the_coordinator_answer_not_coordinator() -> None:
    """Join, heartbeat, commit and offset fetch of a group whose slot another broker owns
    answer error 16 and change nothing here."""
    node, _, store = cluster_pair()
    group = group_in_slot_owned_by(node, THERE)
    assert node.call(join(group)).error_code == c.NOT_COORDINATOR
    heartbeat = HeartbeatRequest[1](group_id=group, generation_id=1, member_id="m")
    assert node.call(heartbeat).error_code == c.NOT_COORDINATOR
    committed = node.call(commit(group, 5))
    assert committed.topics[0].partitions[0].error_code == c.NOT_COORDINATOR
    fetched = node.call(offset_fetch(group))
    assert fetched.error_code == c.NOT_COORDINATOR
    assert [p.error_code for p in fetched.topics[0].partitions] == [c.NOT_COORDINATOR] * 2
    assert group not in node.apis.groups.groups
    assert result_of(store.children("/kafka/groups")) == []


def test_batched_group_requests_answer_per_group() -> None:
    """OffsetFetch v8 for two groups, one coordinated here: that one is answered, the other
    gets NOT_COORDINATOR."""
    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))  # commits name existing ones
    elsewhere = group_in_slot_owned_by(node, THERE)
    mine = next(
        g
        for g in (f"x{i}" for i in range(100))
        if coordinator_slot(g, 4) != coordinator_slot(elsewhere, 4)
    )
    assert node.call(commit(mine, 9)).topics[0].partitions[0].error_code == c.NONE
    request = OffsetFetchRequest[8](
        groups=[
            OffsetFetchRequest.OffsetFetchRequestGroup(group_id=g, topics=None)
            for g in (mine, elsewhere)
        ],
        require_stable=False,
    )
    groups = {g.group_id: g for g in node.call(request).groups}
    assert groups[elsewhere].error_code == c.NOT_COORDINATOR
    assert groups[mine].error_code == c.NONE
    assert groups[mine].topics[0].partitions[0].committed_offset == 9


def test_a_lost_slot_answers_waiting_joins_and_a_regained_one_reads_the_store() -> None:
    """When the slot moves away, a join waiting in a rebalance is answered NOT_COORDINATOR
    (the sweep); when it comes back, offsets another coordinator committed meanwhile are read
    from the store, and commits here apply on top of them."""
    node, clock, store = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))  # commits name existing ones
    group = group_in_slot_owned_by(node, HERE)
    slot = node.cluster.coordinator_topic(group)
    first = node.call(join(group))
    assert first.error_code == c.MEMBER_ID_REQUIRED
    joined = node.call(join(group, first.member_id))
    assert joined.error_code == c.NONE
    as_member = commit(group, 3, member=first.member_id, generation=joined.generation_id)
    assert node.call(as_member).topics[0].partitions[0].error_code == c.NONE
    second = node.call(join(group))
    node.send(join(group, second.member_id))  # a new member: waits for the first to rejoin
    assert node.answers(join(group)) == []
    node.ownership.owners[slot] = THERE  # the slot moved
    clock.advance(SWEEP_INTERVAL_S)
    [answer] = node.answers(join(group))
    assert answer.error_code == c.NOT_COORDINATOR
    assert group not in node.apis.groups.groups
    # The other coordinator commits partition 1 through the shared store.
    theirs = GroupCoordinator(clock, store.new_session(), fresh_offsets=True)
    assert result_of(theirs.commit(group, -1, "", [("t", 1, 40, "")])) == c.NONE
    del node.ownership.owners[slot]  # unowned again: this broker claims it on the next request
    fetched = node.call(offset_fetch(group))
    assert [(p.partition_index, p.committed_offset) for p in fetched.topics[0].partitions] == [
        (0, 3),
        (1, 40),
    ]
    assert node.call(commit(group, 4)).topics[0].partitions[0].error_code == c.NONE
    assert result_of(theirs.fetch_offsets(group)) == {("t", 0): (4, ""), ("t", 1): (40, "")}


def test_a_stale_cached_copy_never_overwrites_newer_commits() -> None:
    """Two coordinators of one group over one store (a hand-over): the one with a cached copy
    commits by compare-and-set, finds the newer document, and keeps the other's commits."""
    clock = Clock()
    store = MemoryMetadataStore(clock)
    old = GroupCoordinator(clock, store)
    new = GroupCoordinator(clock, store.new_session())
    assert result_of(old.commit("g", -1, "", [("t", 0, 5, "")])) == c.NONE
    assert result_of(new.commit("g", -1, "", [("t", 1, 7, "")])) == c.NONE
    assert result_of(old.commit("g", -1, "", [("t", 0, 6, "")])) == c.NONE
    fresh = GroupCoordinator(clock, store, fresh_offsets=True)
    assert result_of(fresh.fetch_offsets("g")) == {("t", 0): (6, ""), ("t", 1): (7, "")}


def test_commits_of_one_group_are_written_in_arrival_order() -> None:
    """Two commits in flight at once: the later one is written last, whatever the store's
    timing, and both are acknowledged."""

    class Held(FakeMetadataStore):
        def __init__(self) -> None:
            super().__init__()
            self.held: list[tuple[Deferred[Any], str, bytes, int | None]] = []

        def put(
            self, path: str, value: bytes, expected_version: int | None = None, **kw: Any
        ) -> Any:
            d: Deferred[Any] = Deferred()
            self.held.append((d, path, value, expected_version))
            return d

        def release_one(self) -> None:
            d, path, value, version = self.held.pop(0)
            FakeMetadataStore.put(self, path, value, version).chainDeferred(d)

    store = Held()
    g = GroupCoordinator(Clock(), store)
    first = g.commit("g", -1, "", [("t", 0, 1, "")])
    second = g.commit("g", -1, "", [("t", 0, 2, "")])
    assert len(store.held) == 1  # the second waits for the first
    store.release_one()
    store.release_one()
    assert result_of(first) == result_of(second) == c.NONE
    fresh = GroupCoordinator(Clock(), store, fresh_offsets=True)
    assert result_of(fresh.fetch_offsets("g")) == {("t", 0): (2, "")}


def test_delete_topics_deletes_nothing_while_another_broker_serves_a_partition() -> None:
    """DeleteTopics refuses (with a message) a topic with a partition owned elsewhere and
    keeps every partition; once nothing is owned elsewhere the topic is deleted here."""
    from kafka.protocol.admin import DeleteTopicsRequest

    node, _, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))
    node.call(produce("t", 0))
    node.ownership.owners[node.full("t", 1)] = THERE
    request = DeleteTopicsRequest[3](topic_names=["t"], timeout_ms=1000)
    [refused] = node.call(request).responses
    assert refused.error_code == c.UNKNOWN_SERVER_ERROR
    assert result_of(node.service.partitioned_topic_metadata("t")) == 2
    assert node.full("t", 0) in node.service.topics
    del node.ownership.owners[node.full("t", 1)]
    [deleted] = node.call(DeleteTopicsRequest[3](topic_names=["t"], timeout_ms=1000)).responses
    assert deleted.error_code == c.NONE
    assert result_of(node.service.partitioned_topic_metadata("t")) == 0


# -- settling candidates ---------------------------------------------------------------------


class Asked:
    """A ``claim_at`` that records each request and, when ``answer``, makes the asked broker
    the owner (what an authoritative lookup there does)."""

    def __init__(self, node: Node, answer: bool = True) -> None:
        self.node = node
        self.answer = answer
        self.calls: list[tuple[str, str]] = []

    def __call__(self, broker: BrokerInfo, topic: str) -> Deferred[bool]:
        self.calls.append((broker.broker_id, topic))
        if self.answer:
            self.node.ownership.owners.setdefault(topic, broker.broker_id)
        return succeed(self.answer)


def settling(answer: bool = True) -> tuple[Node, Asked]:
    node, clock, store = cluster_pair()
    asked = Asked(node, answer)
    node.cluster = KafkaCluster(node.ownership, store, clock, claim_at=asked, coordinator_slots=4)
    node.apis.cluster = node.cluster
    node.ownership.candidate = THERE
    return node, asked


def test_metadata_has_the_candidate_claim_before_naming_it_and_asks_once() -> None:
    """An unowned partition whose candidate is another broker: that broker is asked to claim
    it, then named leader; a second Metadata within SETTLED_S asks nothing again."""
    node, asked = settling()
    there = result_of(node.cluster.node_id(THERE))
    result_of(node.service.create_partitioned_topic("t", 2))
    [topic] = node.call(metadata("t")).topics
    assert [p.leader_id for p in topic.partitions] == [there, there]
    assert sorted(asked.calls) == [(THERE, node.full("t", 0)), (THERE, node.full("t", 1))]
    assert node.ownership.owners[node.full("t", 0)] == THERE
    node.call(metadata("t"))
    assert len(asked.calls) == 2
    node.clock.advance(SETTLED_S + 1)
    node.call(metadata("t"))
    assert len(asked.calls) == 4


def test_a_request_for_another_brokers_candidate_topic_is_refused_not_claimed() -> None:
    """Produce for an unowned partition whose candidate is another broker: that broker claims
    it and this one answers NOT_LEADER_OR_FOLLOWER, keeping the load manager's choice."""
    node, asked = settling()
    result_of(node.service.create_partitioned_topic("t", 1))
    answer = node.call(produce("t", 0)).responses[0].partition_responses[0]
    assert answer.error_code == c.NOT_LEADER_OR_FOLLOWER
    assert asked.calls == [(THERE, node.full("t", 0))]
    assert not node.ownership.owns(node.full("t", 0))


def test_a_candidate_that_cannot_be_asked_leaves_the_topic_to_this_broker() -> None:
    """When the named broker does not answer, this broker claims the free bundle and serves
    the request."""
    node, asked = settling(answer=False)
    result_of(node.service.create_partitioned_topic("t", 1))
    answer = node.call(produce("t", 0)).responses[0].partition_responses[0]
    assert (answer.error_code, answer.base_offset) == (c.NONE, 0)
    assert asked.calls == [(THERE, node.full("t", 0))]
    assert node.ownership.owns(node.full("t", 0))


def test_find_coordinator_has_the_candidate_claim_the_slot() -> None:
    """FindCoordinator for a group whose slot is unowned asks the candidate to claim it, and
    the group APIs here then answer NOT_COORDINATOR."""
    node, asked = settling()
    there = result_of(node.cluster.node_id(THERE))
    found = node.call(FindCoordinatorRequest[2](key="g", key_type=0))
    assert (found.error_code, found.node_id) == (c.NONE, there)
    slot = node.cluster.coordinator_topic("g")
    assert asked.calls == [(THERE, slot)]
    assert node.call(join("g")).error_code == c.NOT_COORDINATOR


def test_lookup_urls_are_authoritative_http_lookups() -> None:
    """The claim request is the broker's HTTP lookup of the topic, authoritative."""
    assert lookup_url("http://h:8080", "persistent://public/default/t-partition-3") == (
        "http://h:8080/lookup/v2/topic/persistent/public/default/t-partition-3?authoritative=true"
    )
    assert lookup_url("", "persistent://public/default/t") is None
    assert lookup_url("http://h:8080", "t") is None


def test_describe_cluster_lists_the_kafka_brokers_and_the_controller() -> None:
    """DescribeCluster answers the same brokers as Metadata, the smallest node id controls."""
    from kafka.protocol.admin import DescribeClusterRequest

    node, _, _ = cluster_pair()
    here, there = result_of(node.cluster.node_id(HERE)), result_of(node.cluster.node_id(THERE))
    answer = node.call(DescribeClusterRequest[0](include_cluster_authorized_operations=False))
    assert answer.error_code == c.NONE
    assert sorted((b.broker_id, b.host, b.port) for b in answer.brokers) == sorted(
        [(here, "10.0.0.1", 9092), (there, "10.0.0.2", 9093)]
    )
    assert answer.controller_id == min(here, there)


def test_requests_waiting_on_an_ownership_that_does_not_answer_are_refused_in_time() -> None:
    """Lookups and claims that never answer: after OWNERSHIP_TIMEOUT_S, Metadata names no
    leader, Produce is NOT_LEADER_OR_FOLLOWER and JoinGroup NOT_COORDINATOR (all retriable)."""
    node, clock, _ = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 1))
    node.ownership.lookup = lambda topic, authoritative=False: Deferred()  # type: ignore[method-assign]
    node.ownership.acquire = lambda topic: Deferred()  # type: ignore[method-assign]
    node.send(metadata("t"))
    node.send(produce("t", 0))
    node.send(join("g"))
    assert node.transport.value() == b""
    clock.advance(OWNERSHIP_TIMEOUT_S)
    data = node.transport.value()
    node.transport.clear()
    bodies = []
    pos = 0
    for request in (metadata("t"), produce("t", 0), join("g")):
        (size,) = struct.unpack_from(">i", data, pos)
        cls = c.response_class(request.API_KEY)
        bodies.append(cls[request.API_VERSION].decode(data[pos + 8 : pos + 4 + size]))
        pos += 4 + size
    [topic] = bodies[0].topics
    assert [(p.error_code, p.leader_id) for p in topic.partitions] == [(c.LEADER_NOT_AVAILABLE, -1)]
    assert bodies[1].responses[0].partition_responses[0].error_code == c.NOT_LEADER_OR_FOLLOWER
    assert bodies[2].error_code == c.NOT_COORDINATOR


def test_list_groups_names_only_the_groups_this_broker_coordinates() -> None:
    """ListGroups (sent to every broker by admin clients) lists the groups of the slots this
    broker owns, not every group with stored offsets."""
    from kafka.protocol.admin import ListGroupsRequest

    node, clock, store = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))  # commits name existing ones
    elsewhere = group_in_slot_owned_by(node, THERE)
    mine = next(
        g
        for g in (f"x{i}" for i in range(100))
        if coordinator_slot(g, 4) != coordinator_slot(elsewhere, 4)
    )
    assert node.call(commit(mine, 1)).topics[0].partitions[0].error_code == c.NONE
    theirs = GroupCoordinator(clock, store.new_session(), fresh_offsets=True)
    assert result_of(theirs.commit(elsewhere, -1, "", [("t", 0, 2, "")])) == c.NONE
    listed = node.call(ListGroupsRequest[2]())
    assert [g.group_id for g in listed.groups] == [mine]
    clock.advance(SWEEP_INTERVAL_S)
    assert elsewhere not in node.apis.groups.groups


def test_a_coordinator_that_lost_the_group_never_writes_its_offsets_again() -> None:
    """The old coordinator's commit, overtaken by the new coordinator's write, finds it no
    longer coordinates the group and answers NOT_COORDINATOR without writing."""

    class Held(MemoryMetadataStore):
        """Holds this session's puts until the test lets them through."""

        def __init__(self, clock: Clock, tree: Any) -> None:
            super().__init__(clock, tree=tree)
            self.held: list[tuple[Deferred[Any], str, bytes, int | None]] = []

        def put(
            self, path: str, value: bytes, expected_version: int | None = None, **kw: Any
        ) -> Any:
            d: Deferred[Any] = Deferred()
            self.held.append((d, path, value, expected_version))
            return d

        def release(self) -> None:
            d, path, value, version = self.held.pop(0)
            MemoryMetadataStore.put(self, path, value, version).chainDeferred(d)

    clock = Clock()
    shared = MemoryMetadataStore(clock)
    owned = {"g": True}
    slow = Held(clock, shared.tree)
    old = GroupCoordinator(clock, slow, fresh_offsets=True, is_coordinator=lambda gid: owned[gid])
    new = GroupCoordinator(clock, shared.new_session(), fresh_offsets=True)
    late = old.commit("g", -1, "", [("t", 0, 10, "")])
    owned["g"] = False  # the slot moved while the write was in flight ...
    assert result_of(new.commit("g", -1, "", [("t", 0, 15, "")])) == c.NONE
    slow.release()  # ... and the new coordinator wrote first: the CAS fails
    assert result_of(late) == c.NOT_COORDINATOR
    assert slow.held == []
    assert result_of(new.fetch_offsets("g")) == {("t", 0): (15, "")}


def test_describe_and_delete_groups_answer_not_coordinator_per_group() -> None:
    """DescribeGroups and DeleteGroups for a group here and one elsewhere: the one here is
    described and deleted, the other gets NOT_COORDINATOR and its offsets stay."""
    from kafka.protocol.admin import DeleteGroupsRequest, DescribeGroupsRequest

    node, clock, store = cluster_pair()
    result_of(node.service.create_partitioned_topic("t", 2))  # commits name existing ones
    elsewhere = group_in_slot_owned_by(node, THERE)
    mine = next(
        g
        for g in (f"x{i}" for i in range(100))
        if coordinator_slot(g, 4) != coordinator_slot(elsewhere, 4)
    )
    assert node.call(commit(mine, 1)).topics[0].partitions[0].error_code == c.NONE
    theirs = GroupCoordinator(clock, store.new_session(), fresh_offsets=True)
    assert result_of(theirs.commit(elsewhere, -1, "", [("t", 0, 2, "")])) == c.NONE
    described = node.call(
        DescribeGroupsRequest[2](groups=[mine, elsewhere], include_authorized_operations=False)
    )
    assert {g.group_id: g.error_code for g in described.groups} == {
        mine: c.NONE,
        elsewhere: c.NOT_COORDINATOR,
    }
    deleted = node.call(DeleteGroupsRequest[1](groups_names=[mine, elsewhere]))
    assert {r.group_id: r.error_code for r in deleted.results} == {
        mine: c.NONE,
        elsewhere: c.NOT_COORDINATOR,
    }
    assert result_of(theirs.fetch_offsets(elsewhere)) == {("t", 0): (2, "")}
    assert result_of(theirs.fetch_offsets(mine)) == {}
