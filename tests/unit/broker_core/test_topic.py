"""PersistentTopic and NonPersistentTopic: publish, producers, dedup, termination, stats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import (
    RecordingConsumer,
    failure_of,
    make_topic,
    message,
    result_of,
)

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.errors import (
    PersistenceError,
    ProducerBusyError,
    ProducerClosedError,
    ProducerFencedError,
    TopicClosedError,
    TopicTerminatedError,
)
from polybroker.broker_core.topic import (
    NonPersistentTopic,
    ProducerAccessMode,
    PublishItem,
    TopicSettings,
)
from polybroker.ledger.api import Entry, Position

DEDUP = TopicSettings(dedup_enabled=True, dedup_snapshot_interval=3)


# -- publish -----------------------------------------------------------------------------------


def test_publish_fires_only_once_the_entry_is_durable() -> None:
    """The publish Deferred waits for the append and fires with the stored entry."""
    bench = make_topic()
    bench.ledger.hold_appends = True
    d = bench.topic.publish(b"hello", 3, publish_time_ms=1234)
    fired: list[object] = []
    d.addCallback(fired.append)
    assert fired == []
    bench.ledger.release_appends()
    entry = fired[0]
    assert isinstance(entry, Entry)
    assert (entry.data, entry.num_messages, entry.publish_time_ms) == (b"hello", 3, 1234)
    assert entry.position == Position(1, 0)


def test_publish_counts_messages_and_bytes_only_when_persisted() -> None:
    """msgInCounter and bytesInCounter count stored messages; storageSize is the log's."""
    bench = make_topic()
    result_of(bench.topic.publish(b"abcd", 4))
    result_of(bench.topic.publish(b"xy", 1))
    bench.ledger.hold_appends = True
    bench.topic.publish(b"pending", 1)
    stats = bench.topic.stats()
    assert stats["msgInCounter"] == 5
    assert stats["bytesInCounter"] == 6
    assert stats["storageSize"] == 6
    assert bench.topic.internal_stats()["pendingAddEntriesCount"] == 1


def test_publish_failure_is_typed() -> None:
    """A storage failure surfaces as PersistenceError, not a storage exception."""
    bench = make_topic()
    bench.ledger.hold_appends = True
    d = bench.topic.publish(b"x")
    bench.ledger.release_appends(error=RuntimeError("disk on fire"))
    assert isinstance(failure_of(d), PersistenceError)


def test_publish_on_closed_topic_fails_with_topic_closed() -> None:
    """After close, publishing fails with a retryable TopicClosedError."""
    bench = make_topic()
    result_of(bench.topic.close())
    assert isinstance(failure_of(bench.topic.publish(b"x")), TopicClosedError)


def test_publish_many_stores_in_order_with_one_completion() -> None:
    """A group is stored in order and fires once, with every entry, when all are durable."""
    bench = make_topic()
    producer = bench.topic.add_producer("p")
    bench.ledger.hold_appends = True
    d = producer.publish_many([PublishItem(b"a", 1), PublishItem(b"bcd", 3)])
    fired: list[object] = []
    d.addCallback(fired.append)
    bench.ledger.release_appends(1)
    assert fired == []  # one entry is not the group
    bench.ledger.release_appends()
    (entries,) = fired
    assert [(e.data, e.num_messages, e.index) for e in entries] == [(b"a", 1, 0), (b"bcd", 3, 1)]
    assert (producer.msg_in, bench.topic.stats()["msgInCounter"]) == (4, 4)
    assert (producer.bytes_in, bench.topic.stats()["bytesInCounter"]) == (4, 4)
    assert bench.topic.internal_stats()["pendingAddEntriesCount"] == 0


def test_publish_many_tells_append_listeners_of_each_entry() -> None:
    """An append listener hears of every entry of a group, in order, once it is durable."""
    bench = make_topic()
    heard: list[bytes] = []
    bench.topic.append_listeners.append(lambda entry: heard.append(entry.data))
    result_of(bench.topic.publish_many([PublishItem(b"a"), PublishItem(b"b"), PublishItem(b"c")]))
    assert heard == [b"a", b"b", b"c"]
    assert bench.topic.stats()["msgInCounter"] == 3


def test_publish_many_failure_fails_the_group_typed() -> None:
    """A storage failure fails the whole group as a PersistenceError, with nothing pending."""
    bench = make_topic()
    bench.ledger.hold_appends = True
    d = bench.topic.publish_many([PublishItem(b"x"), PublishItem(b"y")])
    bench.ledger.release_appends(error=RuntimeError("disk on fire"))
    assert isinstance(failure_of(d), PersistenceError)
    assert bench.topic.internal_stats()["pendingAddEntriesCount"] == 0


def test_publish_many_with_dedup_checks_every_sequence_id() -> None:
    """With dedup on, each entry of a group is checked as a single publish would be."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    result_of(producer.publish(b"m0", sequence_id=0))
    got = result_of(
        producer.publish_many([PublishItem(b"m0", 1, 0, 0), PublishItem(b"m1", 1, 1, 1)])
    )
    assert got[0] is None
    assert isinstance(got[1], Entry)
    assert bench.ledger.entries == 2


def test_publish_many_on_a_closed_topic_fails_with_topic_closed() -> None:
    bench = make_topic()
    result_of(bench.topic.close())
    failed = failure_of(bench.topic.publish_many([PublishItem(b"x"), PublishItem(b"y")]))
    assert isinstance(failed, TopicClosedError)


# -- producers and access modes -----------------------------------------------------------------


def test_shared_producers_coexist_and_names_must_be_unique() -> None:
    """Shared producers share a topic; a second producer with a taken name is busy."""
    topic = make_topic().topic
    a = topic.add_producer("a")
    b = topic.add_producer("b")
    assert a.is_ready
    assert b.is_ready
    with pytest.raises(ProducerBusyError):
        topic.add_producer("a")
    generated = topic.add_producer()
    assert generated.name not in ("a", "b")
    assert not generated.user_provided_name


def test_exclusive_producer_refused_when_others_exist_and_blocks_shared() -> None:
    """Exclusive fails with ProducerFenced when any producer is connected, and a Shared
    producer fails with ProducerBusy while an exclusive one holds the topic."""
    topic = make_topic().topic
    shared = topic.add_producer("s")
    with pytest.raises(ProducerFencedError):
        topic.add_producer("x", ProducerAccessMode.EXCLUSIVE)
    shared.close()
    exclusive = topic.add_producer("x", ProducerAccessMode.EXCLUSIVE)
    assert exclusive.topic_epoch == 1
    with pytest.raises(ProducerBusyError):
        topic.add_producer("s2")
    with pytest.raises(ProducerFencedError):
        topic.add_producer("x2", ProducerAccessMode.EXCLUSIVE)


def test_wait_for_exclusive_is_granted_when_the_topic_frees_up() -> None:
    """WaitForExclusive gets a pending producer whose ready fires when the holder leaves."""
    topic = make_topic().topic
    holder = topic.add_producer("holder", ProducerAccessMode.EXCLUSIVE)
    waiter = topic.add_producer("waiter", ProducerAccessMode.WAIT_FOR_EXCLUSIVE)
    granted: list[object] = []
    waiter.ready.addCallback(granted.append)
    assert not waiter.is_ready
    assert granted == []
    assert isinstance(failure_of(waiter.publish(b"too early")), ProducerClosedError)
    assert topic.stats()["waitingPublishers"] == 1
    holder.close()
    assert granted == [waiter]
    assert waiter.is_ready
    assert waiter.topic_epoch == 2
    assert isinstance(result_of(waiter.publish(b"now")), Entry)


def test_exclusive_with_fencing_closes_the_others_and_fences_their_return() -> None:
    """ExclusiveWithFencing disconnects every producer; one coming back with the old epoch
    is refused with ProducerFenced."""
    topic = make_topic().topic
    told: list[str] = []
    old = topic.add_producer(
        "old", ProducerAccessMode.EXCLUSIVE, on_disconnect=lambda: told.append("old")
    )
    assert old.topic_epoch == 1
    new = topic.add_producer("new", ProducerAccessMode.EXCLUSIVE_WITH_FENCING)
    assert told == ["old"]
    assert old.closed
    assert new.topic_epoch == 2
    assert isinstance(failure_of(old.publish(b"x")), ProducerClosedError)
    with pytest.raises(ProducerFencedError):
        topic.add_producer("old", ProducerAccessMode.EXCLUSIVE, topic_epoch=1)


def test_wait_for_exclusive_waiters_are_failed_by_fencing() -> None:
    """A queued WaitForExclusive producer fails with ProducerFenced when another fences."""
    topic = make_topic().topic
    topic.add_producer("a", ProducerAccessMode.EXCLUSIVE)
    waiter = topic.add_producer("w", ProducerAccessMode.WAIT_FOR_EXCLUSIVE)
    topic.add_producer("f", ProducerAccessMode.EXCLUSIVE_WITH_FENCING)
    assert isinstance(failure_of(waiter.ready), ProducerFencedError)


# -- deduplication ------------------------------------------------------------------------------


def test_dedup_answers_a_repeated_sequence_id_without_appending() -> None:
    """With dedup on, a sequence id at or below the last persisted one is not stored again."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    assert producer.last_sequence_id == -1
    first = result_of(producer.publish(b"m0", sequence_id=0))
    assert isinstance(first, Entry)
    assert result_of(producer.publish(b"m0 again", sequence_id=0)) is None
    assert isinstance(result_of(producer.publish(b"m1", sequence_id=1)), Entry)
    assert bench.ledger.entries == 2


def test_dedup_of_an_in_flight_message_answers_once_the_original_persists() -> None:
    """A duplicate of a message still being appended fires (with None) after it persists."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    bench.ledger.hold_appends = True
    original = producer.publish(b"m5", sequence_id=5)
    dup = producer.publish(b"m5", sequence_id=5)
    fired: list[object] = []
    dup.addCallback(fired.append)
    assert fired == []
    assert bench.ledger.held_appends == 1
    bench.ledger.release_appends()
    assert fired == [None]
    assert isinstance(result_of(original), Entry)


def test_dedup_uses_the_highest_sequence_id_of_a_batch() -> None:
    """A batch (sequence 10, highest 19) makes every id up to 19 a duplicate."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    producer.publish(b"batch", 10, sequence_id=10, highest_sequence_id=19)
    assert result_of(producer.publish(b"again", sequence_id=19)) is None
    assert isinstance(result_of(producer.publish(b"next", sequence_id=20)), Entry)


def test_dedup_failed_append_lets_the_producer_resend() -> None:
    """After a failed append the sequence id is not taken: the retry is stored."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    bench.ledger.hold_appends = True
    d = producer.publish(b"m0", sequence_id=0)
    bench.ledger.release_appends(error=RuntimeError("boom"))
    failure_of(d)
    bench.ledger.hold_appends = False
    assert isinstance(result_of(producer.publish(b"m0", sequence_id=0)), Entry)


def test_dedup_state_survives_a_clean_reload_through_the_snapshot() -> None:
    """Closing writes a snapshot; the reloaded topic remembers each producer's last id."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    for seq in range(5):
        result_of(producer.publish(message(f"m{seq}"), sequence_id=seq))
    bench.reload()
    doc = json.loads(bench.store.nodes["/dedup/public/default/persistent/t"][0])
    assert doc["producers"] == {"p": 4}
    again = bench.topic.add_producer("p")
    assert again.last_sequence_id == 4
    assert result_of(again.publish(message("m3"), sequence_id=3)) is None
    assert bench.ledger.entries == 5


def test_dedup_state_is_replayed_from_the_log_after_the_snapshot() -> None:
    """Entries stored after the last snapshot (no clean close) are replayed on load."""
    bench = make_topic(settings=DEDUP)
    producer = bench.topic.add_producer("p")
    for seq in range(4):  # the snapshot interval is 3: a snapshot covers m0..m2
        result_of(producer.publish(message(f"m{seq}", producer="p", seq=seq), sequence_id=seq))
    doc = json.loads(bench.store.nodes["/dedup/public/default/persistent/t"][0])
    assert doc["producers"] == {"p": 2}
    # Crash: drop the topic without closing it, then load the log afresh.
    bench.ledger.close()
    reloaded = make_topic(
        clock=bench.clock,
        factory=bench.factory,
        store=bench.store,
        settings=DEDUP,
    ).topic
    assert reloaded.add_producer("p").last_sequence_id == 3


def test_dedup_cursor_is_not_a_subscription() -> None:
    """The cursor that pins dedup replay is hidden from subscriptions and stats."""
    bench = make_topic(settings=DEDUP)
    assert "pulsar.dedup" in bench.ledger.cursors
    assert bench.topic.subscriptions == {}
    assert bench.topic.stats()["deduplicationStatus"] == "Enabled"


def test_dedup_can_be_turned_off_and_on() -> None:
    """Turning dedup off drops its state; turning it on recovers from the log."""
    bench = make_topic()
    producer = bench.topic.add_producer("p")
    result_of(bench.topic.set_deduplication(True))
    result_of(producer.publish(message("a", producer="p", seq=0), sequence_id=0))
    assert result_of(producer.publish(b"dup", sequence_id=0)) is None
    result_of(bench.topic.set_deduplication(False))
    assert "pulsar.dedup" not in bench.ledger.cursors
    assert isinstance(result_of(producer.publish(b"dup", sequence_id=0)), Entry)


# -- termination and end of topic ---------------------------------------------------------------


def test_terminated_topic_refuses_publish_and_new_producers() -> None:
    """After terminate, publishing and registering producers fail with TopicTerminated."""
    bench = make_topic()
    bench.publish("a", "b")
    assert result_of(bench.topic.terminate()) == Position(1, 1)
    assert isinstance(failure_of(bench.topic.publish(b"x")), TopicTerminatedError)
    with pytest.raises(TopicTerminatedError):
        bench.topic.add_producer("late")
    assert bench.topic.stats()["isTerminated"] is True


def test_end_of_topic_is_told_once_everything_is_acknowledged() -> None:
    """Consumers learn of the end only when the subscription consumed and acked it all."""
    bench = make_topic()
    bench.publish("a", "b")
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(10)
    result_of(bench.topic.terminate())
    assert consumer.ended == 0
    server.ack([consumer.positions[0]])
    assert consumer.ended == 0
    server.ack([consumer.positions[1]])
    assert consumer.ended == 1
    assert not bench.ledger.cursors["s"].waiting


def test_consumer_joining_a_finished_terminated_topic_is_told_at_once() -> None:
    """A consumer subscribing after everything was consumed hears of the end right away."""
    bench = make_topic()
    result_of(bench.topic.terminate())
    consumer = RecordingConsumer()
    bench.subscribe("s", consumer)
    assert consumer.ended == 1


# -- queries and stats --------------------------------------------------------------------------


def test_last_message_id_reports_the_last_entry_and_its_batch_size() -> None:
    """An empty topic reports entry -1; afterwards the last entry and its message count."""
    bench = make_topic()
    empty = result_of(bench.topic.last_message_id())
    assert empty.position.entry_id == -1
    assert empty.batch_index == -1
    result_of(bench.topic.publish(b"batch", 5))
    last = result_of(bench.topic.last_message_id())
    assert last.position == Position(1, 0)
    assert last.batch_index == 4
    bench.reload()
    reloaded = result_of(bench.topic.last_message_id())
    assert reloaded.num_messages == 5


def test_stats_are_shaped_like_pulsar_topic_stats() -> None:
    """Stats carry publishers, per-subscription backlog, consumers and type, and rates."""
    bench = make_topic()
    producer = bench.topic.add_producer("p1")
    consumer = RecordingConsumer("reader")
    server = bench.subscribe("sub", consumer, SubType.SHARED)
    for i in range(4):
        result_of(producer.publish(message(f"m{i}")))
    server.flow(2)
    bench.clock.advance(10)
    bench.topic.update_rates()
    stats = bench.topic.stats()
    assert stats["msgInCounter"] == 4
    assert stats["msgRateIn"] == pytest.approx(0.4)
    assert stats["publishers"][0]["producerName"] == "p1"
    assert stats["publishers"][0]["msgInCounter"] == 4
    sub = stats["subscriptions"]["sub"]
    assert sub["type"] == "Shared"
    assert sub["msgBacklog"] == 4
    assert sub["unackedMessages"] == 2
    assert sub["msgOutCounter"] == 2
    assert sub["msgRateOut"] == pytest.approx(0.2)
    assert sub["consumers"][0]["consumerName"] == "reader"
    assert sub["consumers"][0]["availablePermits"] == 0
    assert stats["msgOutCounter"] == 2


def test_internal_stats_show_ledgers_and_cursor_positions() -> None:
    """internalStats lists ledgers and each cursor's mark-delete, read position and holes."""
    bench = make_topic(max_entries_per_ledger=3)
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish(*[f"m{i}" for i in range(5)])
    positions = consumer.positions
    server.ack([positions[0], positions[2], positions[3]])
    stats = bench.topic.internal_stats()
    assert [ledger["ledgerId"] for ledger in stats["ledgers"]] == [1, 2]
    cursor = stats["cursors"]["s"]
    assert cursor["markDeletePosition"] == "1:0"
    assert cursor["readPosition"] == "2:2"
    assert cursor["individuallyDeletedMessages"] == "[(1:1..2:0]]"
    assert stats["lastConfirmedEntry"] == "2:1"


# -- non-persistent ------------------------------------------------------------------------------


def test_non_persistent_delivers_only_to_connected_consumers_with_permits() -> None:
    """A non-persistent topic stores nothing: late subscribers and consumers without
    permits miss messages."""
    topic = NonPersistentTopic("non-persistent://public/default/np", Clock())
    early = RecordingConsumer()
    server = result_of(topic.subscribe("s", early, SubType.EXCLUSIVE))
    result_of(topic.publish(b"dropped: no permits"))
    server.flow(5)
    result_of(topic.publish(b"one"))
    late = RecordingConsumer()
    late_server = result_of(topic.subscribe("other", late, SubType.SHARED))
    late_server.flow(5)
    result_of(topic.publish(b"two"))
    assert early.payloads == [b"one", b"two"]
    assert late.payloads == [b"two"]
    stats = topic.stats()
    assert stats["storageSize"] == 0
    assert stats["msgInCounter"] == 3
    assert stats["subscriptions"]["s"]["msgDropCounter"] == 1


def test_non_persistent_shared_round_robins_and_subscription_goes_with_last_consumer() -> None:
    """Shared non-persistent consumers alternate; the subscription ends with its consumers."""
    topic = NonPersistentTopic("non-persistent://public/default/np", Clock())
    a, b = RecordingConsumer(), RecordingConsumer()
    sa = result_of(topic.subscribe("s", a, SubType.SHARED))
    sb = result_of(topic.subscribe("s", b, SubType.SHARED))
    sa.flow(10)
    sb.flow(10)
    for i in range(4):
        result_of(topic.publish(f"m{i}".encode()))
    assert a.payloads == [b"m0", b"m2"]
    assert b.payloads == [b"m1", b"m3"]
    result_of(sa.close())
    result_of(sb.close())
    assert topic.subscriptions == {}


def test_a_waiting_producer_that_closes_is_failed_and_leaves_the_queue() -> None:
    """Closing a WaitForExclusive producer before it is granted fails its ready Deferred."""
    topic = make_topic().topic
    holder = topic.add_producer("h", ProducerAccessMode.EXCLUSIVE)
    waiter = topic.add_producer("w", ProducerAccessMode.WAIT_FOR_EXCLUSIVE)
    waiter.close()
    assert isinstance(failure_of(waiter.ready), ProducerClosedError)
    holder.close()
    assert topic.producers == {}
    assert topic.stats()["waitingPublishers"] == 0


def test_non_persistent_drops_what_a_paused_consumer_cannot_take() -> None:
    """A paused consumer of a non-persistent topic misses what comes while it is paused, as a
    consumer without permits does."""
    topic = NonPersistentTopic("non-persistent://public/default/np", Clock())
    consumer = RecordingConsumer()
    server = result_of(topic.subscribe("s", consumer, SubType.SHARED))
    server.flow(5)
    server.pause()
    result_of(topic.publish(b"dropped: paused"))
    server.resume()
    result_of(topic.publish(b"kept"))
    assert consumer.payloads == [b"kept"]
    assert topic.stats()["subscriptions"]["s"]["msgDropCounter"] == 1
