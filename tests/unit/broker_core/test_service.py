"""BrokerService: the Broker API handlers use (topics, partitions, lifecycle, stats)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import (
    FakeLedgerFactory,
    FakeMetadataStore,
    JsonInspector,
    RecordingConsumer,
    failure_of,
    message,
    payload_of,
    result_of,
)

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.errors import (
    InvalidTopicNameError,
    NotAllowedError,
    ServiceNotReadyError,
    TopicAlreadyExistsError,
    TopicBusyError,
    TopicFencedError,
    TopicNotFoundError,
)
from polybroker.broker_core.service import BrokerService, TopicListMode, TopicRef
from polybroker.broker_core.topic import PersistentTopic, Topic
from polybroker.config import Config
from polybroker.ledger.api import Entry, InitialPosition, ManagedLedgerFencedError, Position


class Env:
    def __init__(self, **config: Any) -> None:
        self.clock = Clock()
        self.factory = FakeLedgerFactory(self.clock.seconds)
        self.store = FakeMetadataStore()
        self.service = BrokerService(
            self.factory, self.clock, Config(config), self.store, inspector=JsonInspector()
        )

    def topic(self, name: str, create: bool = True) -> Topic:
        return result_of(self.service.get_topic(name, create))

    def hold_opens(self) -> tuple[Deferred[None], list[str]]:
        """Make managed-ledger opens wait until the returned Deferred fires; the names opened
        are listed as they are asked for."""
        release: Deferred[None] = Deferred()
        real_open = self.factory.open
        names: list[str] = []

        def slow_open(name: str, config: object = None) -> Deferred[Any]:
            names.append(name)
            return release.addCallback(lambda _: result_of(real_open(name)))

        self.factory.open = slow_open  # type: ignore[method-assign]
        return release, names


# -- names and loading ------------------------------------------------------------------------


def test_topic_names_are_normalised_and_map_to_one_managed_ledger() -> None:
    """Short, namespace-relative and full names reach the same topic and log."""
    env = Env()
    full = env.topic("persistent://public/default/orders")
    assert env.topic("orders") is full
    assert env.topic("public/default/orders") is full
    assert full.name == "persistent://public/default/orders"
    assert list(env.factory.logs) == ["public/default/persistent/orders"]


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a/b",
        "bogus://t/ns/x",
        "persistent://t//x",
        "persistent://t/ns/x/y",
        ".",
        "..",
        "./ns/x",
    ],
)
def test_invalid_topic_names_are_refused(name: str) -> None:
    """Names that cannot be parsed fail with InvalidTopicNameError."""
    env = Env()
    assert isinstance(failure_of(env.service.get_topic(name)), InvalidTopicNameError)


def test_topic_ref_knows_partitions_and_encodes_the_ledger_name() -> None:
    """Partition indexes are parsed; odd characters are encoded in the log name."""
    ref = TopicRef.parse("persistent://t/ns/my topic-partition-7")
    assert ref.partition_index == 7
    assert ref.managed_ledger_name == "t/ns/persistent/my%20topic-partition-7"
    assert TopicRef.parse("t/ns/x").partition_index == -1


def test_get_topic_without_create_fails_for_unknown_topics() -> None:
    """create=False finds existing topics only, including ones not loaded."""
    env = Env()
    assert isinstance(failure_of(env.service.get_topic("nope", create=False)), TopicNotFoundError)
    env.topic("exists")
    result_of(env.service.unload_topic("exists"))
    assert env.topic("exists", create=False).name.endswith("/exists")


def test_auto_creation_can_be_disabled() -> None:
    """With allowAutoTopicCreation=false, producing to a new topic fails with TopicNotFound."""
    env = Env(allowAutoTopicCreation=False)
    assert isinstance(failure_of(env.service.get_topic("new")), TopicNotFoundError)
    assert isinstance(
        failure_of(env.service.get_topic("non-persistent://public/default/x")), TopicNotFoundError
    )
    assert isinstance(failure_of(env.service.publish("new", b"x")), TopicNotFoundError)


def test_topics_are_created_only_in_existing_namespaces() -> None:
    """With a namespace check installed, auto-creation in an unknown namespace is TopicNotFound."""
    env = Env()
    env.service.namespace_exists = lambda ns: ns == "public/default"
    assert env.topic("persistent://public/default/ok").name.endswith("/ok")
    assert isinstance(
        failure_of(env.service.get_topic("persistent://nobody/nothing/x")), TopicNotFoundError
    )
    assert "nobody/nothing/persistent/x" not in env.factory.logs


def test_concurrent_loads_share_one_topic() -> None:
    """Two get_topic calls during a slow open get the same topic; the log is opened once."""
    env = Env()
    pending, calls = env.hold_opens()
    first = env.service.get_topic("t")
    second = env.service.get_topic("t")
    pending.callback(None)
    assert result_of(first) is result_of(second)
    assert calls == ["public/default/persistent/t"]


def test_callers_of_one_load_resume_in_the_order_they_called() -> None:
    """Publishes sent one after another while their topic loads are stored in that order: the
    caller that started the load resumes first, not after those that came later."""
    env = Env()
    pending, _ = env.hold_opens()
    published = [env.service.publish("t", message(f"m{i}")) for i in range(3)]
    failing = [env.service.get_topic("absent", create=False) for _ in range(2)]
    pending.callback(None)
    entries = [result_of(d) for d in published]
    assert [e.position.entry_id for e in entries] == [0, 1, 2]
    consumer = RecordingConsumer()
    sub = result_of(
        env.service.subscribe("t", "s", consumer, SubType.EXCLUSIVE, InitialPosition.EARLIEST)
    )
    sub.flow(10)
    assert [payload_of(d.entry) for d in consumer.deliveries] == ["m0", "m1", "m2"]
    assert all(isinstance(failure_of(d), TopicNotFoundError) for d in failing)


def test_a_caller_that_stops_waiting_for_a_load_leaves_the_others_answered() -> None:
    """A caller cancels its wait while the topic loads: the callers after it still get the
    topic (its own wait ends cancelled)."""
    env = Env()
    pending, _ = env.hold_opens()
    waits = [env.service.get_topic("t") for _ in range(3)]
    waits[1].cancel()
    pending.callback(None)
    assert isinstance(failure_of(waits[1]), CancelledError)
    assert result_of(waits[0]) is result_of(waits[2])


def test_managed_ledger_config_comes_from_the_broker_config() -> None:
    """Ensemble and quorum settings reach the managed-ledger factory."""
    env = Env(
        managedLedgerDefaultEnsembleSize=3,
        managedLedgerDefaultWriteQuorum=2,
        managedLedgerDefaultAckQuorum=2,
    )
    env.topic("t")
    config = env.factory.configs["public/default/persistent/t"]
    assert config is not None
    assert (config.ensemble_size, config.write_quorum, config.ack_quorum) == (3, 2, 2)


# -- publish, subscribe, last message id ------------------------------------------------------


def test_publish_and_subscribe_by_name() -> None:
    """publish() and subscribe() work by topic name, creating the topic on first use."""
    env = Env()
    consumer = RecordingConsumer()
    server = result_of(
        env.service.subscribe("t", "sub", consumer, SubType.SHARED, InitialPosition.EARLIEST)
    )
    server.flow(10)
    entry = result_of(env.service.publish("t", message("hello")))
    assert isinstance(entry, Entry)
    assert [payload_of(d.entry) for d in consumer.deliveries] == ["hello"]
    last = result_of(env.service.last_message_id("t"))
    assert last.position == entry.position


def test_add_producer_by_name_returns_a_ready_producer() -> None:
    """add_producer loads the topic and registers the producer."""
    env = Env()
    producer = result_of(env.service.add_producer("t", "p"))
    assert producer.is_ready
    assert isinstance(result_of(producer.publish(b"x")), Entry)
    stats = result_of(env.service.stats("t"))
    assert stats["publishers"][0]["producerName"] == "p"


def test_deduplication_follows_config_or_policy() -> None:
    """brokerDeduplicationEnabled turns dedup on; a policy hook overrides it per topic."""
    env = Env(brokerDeduplicationEnabled=True)
    env.service.deduplication_policy = lambda name: False if name.endswith("/off") else None
    on = env.topic("on")
    off = env.topic("off")
    assert isinstance(on, PersistentTopic)
    assert isinstance(off, PersistentTopic)
    assert on.deduplication_enabled
    assert not off.deduplication_enabled


# -- partitioned topics ----------------------------------------------------------------------


def test_partitioned_topic_metadata_lives_in_the_metadata_store() -> None:
    """Creating a partitioned topic writes {"partitions": N} at Pulsar's admin path."""
    env = Env()
    result_of(env.service.create_partitioned_topic("persistent://public/default/p", 3))
    node = env.store.nodes["/admin/partitioned-topics/public/default/persistent/p"]
    assert json.loads(node[0]) == {"partitions": 3}
    assert result_of(env.service.partitioned_topic_metadata("p")) == 3
    assert result_of(env.service.partitioned_topic_metadata("plain")) == 0
    assert result_of(env.service.partitioned_topic_metadata("p-partition-1")) == 0


def test_partitioned_topic_names_may_not_be_taken_twice() -> None:
    """A partitioned topic cannot be created over another one or over a plain topic."""
    env = Env()
    result_of(env.service.create_partitioned_topic("p", 2))
    assert isinstance(
        failure_of(env.service.create_partitioned_topic("p", 2)), TopicAlreadyExistsError
    )
    env.topic("plain")
    assert isinstance(
        failure_of(env.service.create_partitioned_topic("plain", 2)), TopicAlreadyExistsError
    )
    assert isinstance(failure_of(env.service.create_partitioned_topic("z", 0)), NotAllowedError)


def test_the_name_of_a_partitioned_topic_is_not_a_topic() -> None:
    """Publishing to a partitioned topic's own name is refused, not auto-created beside it."""
    env = Env()
    result_of(env.service.create_partitioned_topic("p", 2))
    assert isinstance(failure_of(env.service.publish("p", b"x")), NotAllowedError)
    assert isinstance(result_of(env.service.publish("p-partition-1", b"x")), Entry)
    assert list(env.factory.logs) == ["public/default/persistent/p-partition-1"]


def test_partitions_may_only_grow() -> None:
    """update_partitioned_topic raises the count and refuses to lower it."""
    env = Env()
    result_of(env.service.create_partitioned_topic("p", 2))
    result_of(env.service.update_partitioned_topic("p", 4))
    assert result_of(env.service.partitioned_topic_metadata("p")) == 4
    assert isinstance(failure_of(env.service.update_partitioned_topic("p", 3)), NotAllowedError)
    assert isinstance(
        failure_of(env.service.update_partitioned_topic("nope", 3)), TopicNotFoundError
    )


def test_partitioned_auto_creation() -> None:
    """With allowAutoTopicCreationType=partitioned, asking for metadata creates the topic."""
    env = Env(allowAutoTopicCreationType="partitioned", defaultNumPartitions=4)
    assert result_of(env.service.partitioned_topic_metadata("auto", create=True)) == 4
    assert result_of(env.service.partitioned_topic_metadata("other")) == 0


def test_deleting_a_partitioned_topic_deletes_its_partitions() -> None:
    """Every partition's log and the metadata go."""
    env = Env()
    result_of(env.service.create_partitioned_topic("p", 2))
    result_of(env.service.publish("p-partition-0", b"x"))
    result_of(env.service.delete_partitioned_topic("p"))
    assert env.factory.logs == {}
    assert env.store.nodes == {}


def test_topics_of_namespace_lists_topics_and_partitions() -> None:
    """Persistent topics and every partition of partitioned topics, sorted; other namespaces
    and domains are left out unless asked for."""
    env = Env()
    env.topic("b")
    env.topic("a")
    env.topic("persistent://public/other/c")
    env.topic("non-persistent://public/default/np")
    result_of(env.service.create_partitioned_topic("p", 2))
    listed = result_of(env.service.topics_of_namespace("public/default"))
    assert listed == [
        "persistent://public/default/a",
        "persistent://public/default/b",
        "persistent://public/default/p-partition-0",
        "persistent://public/default/p-partition-1",
    ]
    everything = result_of(env.service.topics_of_namespace("public/default", TopicListMode.ALL))
    assert "non-persistent://public/default/np" in everything
    assert len(everything) == 5


# -- lifecycle ---------------------------------------------------------------------------------


def test_delete_topic_refuses_while_in_use_unless_forced() -> None:
    """Deleting a topic with a producer needs force; afterwards the topic is gone."""
    env = Env()
    told: list[str] = []
    result_of(env.service.add_producer("t", "p", on_disconnect=lambda: told.append("p")))
    assert isinstance(failure_of(env.service.delete_topic("t")), TopicBusyError)
    result_of(env.service.delete_topic("t", force=True))
    assert told == ["p"]
    assert env.factory.logs == {}
    assert isinstance(failure_of(env.service.get_topic("t", False)), TopicNotFoundError)
    assert isinstance(failure_of(env.service.delete_topic("t")), TopicNotFoundError)


def test_unload_closes_the_topic_and_the_next_use_reopens_it() -> None:
    """Unload disconnects consumers and releases the log; data and cursors remain."""
    env = Env()
    consumer = RecordingConsumer()
    server = result_of(
        env.service.subscribe("t", "s", consumer, initial_position=InitialPosition.EARLIEST)
    )
    server.flow(10)
    result_of(env.service.publish("t", message("kept")))
    result_of(env.service.unload_topic("t"))
    assert consumer.disconnects == 1
    assert "persistent://public/default/t" not in env.service.topics
    again = RecordingConsumer()
    result_of(env.service.subscribe("t", "s", again)).flow(10)
    assert [payload_of(d.entry) for d in again.deliveries] == ["kept"]
    assert env.factory.opens == 2


def test_close_closes_topics_and_the_factory_and_refuses_new_work() -> None:
    """After close, loads fail with ServiceNotReady and the factory is closed."""
    env = Env()
    consumer = RecordingConsumer()
    result_of(env.service.subscribe("t", "s", consumer))
    result_of(env.service.close())
    assert env.factory.closed
    assert consumer.disconnects == 1
    assert isinstance(failure_of(env.service.get_topic("t")), ServiceNotReadyError)


def test_a_fenced_topic_drops_itself_from_the_broker() -> None:
    """When another owner fences the log, publishes fail with TopicFenced and the topic is
    forgotten so the next use reopens (and recovers) it."""
    env = Env()
    told: list[str] = []
    producer = result_of(env.service.add_producer("t", "p", on_disconnect=lambda: told.append("p")))
    ledger = env.factory.ledger("public/default/persistent/t")
    ledger.hold_appends = True
    d = producer.publish(b"x")
    ledger.release_appends(error=ManagedLedgerFencedError("taken over"))
    assert isinstance(failure_of(d), TopicFencedError)
    assert told == ["p"]
    assert "persistent://public/default/t" not in env.service.topics
    assert ledger.closed


def test_stats_rates_are_refreshed_on_the_configured_period() -> None:
    """The service recomputes rates every statsUpdateFrequencyInSecs on its clock."""
    env = Env(statsUpdateFrequencyInSecs=10)
    for _ in range(5):
        result_of(env.service.publish("t", b"12345"))
    env.clock.advance(10)
    stats = result_of(env.service.stats("t"))
    assert stats["msgRateIn"] == pytest.approx(0.5)
    assert stats["msgThroughputIn"] == pytest.approx(2.5)
    internal = result_of(env.service.internal_stats("t"))
    assert internal["lastConfirmedEntry"] == str(Position(1, 4))


def test_terminate_by_name() -> None:
    """terminate_topic fires with the last position and the topic refuses more."""
    env = Env()
    entry = result_of(env.service.publish("t", b"x"))
    assert result_of(env.service.terminate_topic("t")) == entry.position
    assert failure_of(env.service.publish("t", b"y")) is not None


def test_failover_on_partitions_spreads_through_the_service() -> None:
    """Consumers of a Failover subscription on a partitioned topic split the partitions."""
    env = Env()
    result_of(env.service.create_partitioned_topic("p", 4))
    c1, c2 = RecordingConsumer("c1"), RecordingConsumer("c2")
    owners: dict[int, str] = {}
    for i in range(4):
        servers = [
            result_of(env.service.subscribe(f"p-partition-{i}", "s", c, SubType.FAILOVER))
            for c in (c1, c2)
        ]
        owners[i] = next(s.consumer_name for s in servers if s.active)
    assert owners == {0: "c1", 1: "c2", 2: "c1", 3: "c2"}


def test_topic_listeners_hear_every_load_until_removed() -> None:
    """A topic listener is told each loaded topic (created or reopened) until it is removed."""
    env = Env()
    heard: list[str] = []
    remove = env.service.add_topic_listener(heard.append)
    env.topic("t")
    env.topic("t")
    result_of(env.service.unload_topic("t"))
    env.topic("t")
    remove()
    env.topic("u")
    assert heard == ["persistent://public/default/t", "persistent://public/default/t"]
