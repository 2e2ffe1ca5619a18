"""Subscriptions: acks, redelivery, seek, unsubscribe, readers and durability."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import RecordingConsumer, failure_of, make_topic, payload_of, result_of

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.errors import (
    NotAllowedError,
    ServiceNotReadyError,
    SubscriptionBusyError,
)
from polybroker.ledger.api import InitialPosition, Position


def payloads(consumer: RecordingConsumer) -> list[str]:
    return [payload_of(d.entry) for d in consumer.deliveries]


# -- redelivery ---------------------------------------------------------------------------------


def test_pending_entries_of_a_closed_consumer_go_to_the_others() -> None:
    """Unacked entries of a departing Shared consumer are redelivered with count 1."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.SHARED)
    sb = bench.subscribe("s", b, SubType.SHARED)
    sa.flow(10)
    sb.flow(10)
    bench.publish("m0", "m1", "m2", "m3")
    assert payloads(a) == ["m0", "m2"]
    sa.ack([a.positions[0]])
    result_of(sa.close())
    assert payloads(b) == ["m1", "m3", "m2"]
    assert b.deliveries[-1].redelivery_count == 1
    assert sb.unacked_messages == 3


def test_negative_ack_redelivers_the_positions_and_counts_each_time() -> None:
    """Each nack of a Shared entry redelivers it with a count one higher."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish("m0", "m1")
    target = consumer.positions[1]
    for expected in (1, 2, 3):
        server.redeliver([target])
        last = consumer.deliveries[-1]
        assert last.entry.position == target
        assert last.redelivery_count == expected
    assert payloads(consumer) == ["m0", "m1", "m1", "m1", "m1"]
    stats = bench.topic.stats()["subscriptions"]["s"]
    assert stats["msgRedeliverCounter"] == 3


def test_redeliver_all_sends_every_pending_entry_again_in_order() -> None:
    """redeliver() with no positions redelivers all of the consumer's pending entries."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish("m0", "m1", "m2")
    server.ack([consumer.positions[1]])
    consumer.take()
    server.redeliver()
    assert payloads(consumer) == ["m0", "m2"]
    assert [d.redelivery_count for d in consumer.deliveries] == [1, 1]


def test_exclusive_redelivery_of_some_positions_redelivers_all_in_order() -> None:
    """Exclusive keeps order: a nack of one position redelivers every pending one."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    bench.publish("m0", "m1", "m2")
    consumer.take()
    server.redeliver([Position(1, 2)])
    assert payloads(consumer) == ["m0", "m1", "m2"]


def test_redelivered_entries_go_before_newer_ones() -> None:
    """A redelivered entry is delivered ahead of entries read after it."""
    bench = make_topic()
    bench.publish(*[f"m{i}" for i in range(4)])
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(2)
    server.redeliver([consumer.positions[0]])
    server.flow(2)
    assert payloads(consumer) == ["m0", "m1", "m0", "m2"]


# -- acknowledgements ------------------------------------------------------------------------------


def test_individual_acks_leave_holes_and_backlog_counts_the_rest() -> None:
    """Individual acks delete single entries; the mark-delete moves over contiguous runs."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish("m0", "m1", "m2", "m3")
    p = consumer.positions
    server.ack([p[1], p[2]])
    cursor = bench.ledger.cursors["s"]
    assert cursor.mark_delete_position == Position(1, -1)
    assert cursor.individually_deleted() == [(p[1], p[2])]
    server.ack([p[0]])
    assert cursor.mark_delete_position == p[2]
    assert bench.topic.stats()["subscriptions"]["s"]["msgBacklog"] == 1


def test_cumulative_ack_acknowledges_everything_up_to_the_position() -> None:
    """A cumulative ack on Exclusive moves the mark-delete and clears the pending entries."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    bench.publish("m0", "m1", "m2")
    result_of(server.ack_cumulative(consumer.positions[1]))
    assert bench.ledger.cursors["s"].mark_delete_position == consumer.positions[1]
    assert list(server.pending) == [consumer.positions[2]]
    consumer.take()
    server.redeliver()
    assert payloads(consumer) == ["m2"]


def test_cumulative_ack_across_ledgers_forgets_exactly_what_precedes_it() -> None:
    """With entry ids restarting in each ledger, a cumulative ack clears the pending entries
    of earlier ledgers and those up to the position in its own, and no later ones."""
    bench = make_topic(max_entries_per_ledger=3)
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    bench.publish(*[f"m{i}" for i in range(8)])
    positions = consumer.positions
    assert len({p.ledger_id for p in positions}) == 3
    result_of(server.ack_cumulative(positions[4]))
    assert list(server.pending) == positions[5:]
    assert server.unacked_messages == 3
    consumer.take()
    server.redeliver()
    assert payloads(consumer) == ["m5", "m6", "m7"]


def test_cumulative_ack_is_refused_on_shared_subscriptions() -> None:
    """Shared and Key_Shared take individual acks only."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(10)
    bench.publish("m0")
    assert isinstance(failure_of(server.ack_cumulative(consumer.positions[0])), NotAllowedError)


def test_batch_index_acks_acknowledge_the_entry_once_all_messages_are() -> None:
    """Partial batch-index acks keep the entry; its redelivery carries the acked indexes."""
    bench = make_topic()
    result_of(bench.topic.publish(b"batch", 4))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(10)
    position = consumer.positions[0]
    server.ack_batch_index(position, 0b0011, 4)
    cursor = bench.ledger.cursors["s"]
    assert not cursor.is_deleted(position)
    server.redeliver([position])
    assert consumer.deliveries[-1].acked_indexes == 0b0011
    server.ack_batch_index(position, 0b1100, 4)
    assert cursor.is_deleted(position)
    assert server.pending == {}


def test_cumulative_ack_within_a_batch_keeps_the_rest_of_it() -> None:
    """A cumulative ack of part of a batch acknowledges what precedes it, not the batch."""
    bench = make_topic()
    bench.publish("m0")
    result_of(bench.topic.publish(b"batch", 3))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(10)
    batch = consumer.positions[1]
    result_of(server.ack_cumulative(batch, acked_indexes=0b001))
    cursor = bench.ledger.cursors["s"]
    assert cursor.mark_delete_position == consumer.positions[0]
    assert not cursor.is_deleted(batch)
    consumer.take()
    server.redeliver()
    assert consumer.deliveries[0].acked_indexes == 0b001


# -- seek ------------------------------------------------------------------------------------------


def test_seek_to_a_position_disconnects_consumers_and_restarts_there() -> None:
    """Seek resets the cursor (earlier acks forgotten after it), disconnects every consumer,
    and the next consumer reads from the position."""
    bench = make_topic()
    bench.publish(*[f"m{i}" for i in range(5)])
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    result_of(server.ack_cumulative(consumer.positions[4]))
    result_of(server.seek(consumer.positions[2]))
    assert consumer.disconnects == 1
    assert server.closed
    again = RecordingConsumer()
    bench.subscribe("s", again).flow(100)
    assert payloads(again) == ["m2", "m3", "m4"]


def test_seek_by_publish_time() -> None:
    """Seek by time restarts at the first entry published at or after it."""
    bench = make_topic()
    for i in range(4):
        result_of(bench.topic.publish(f"t{i}".encode(), publish_time_ms=1000 * i))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    result_of(server.seek_time(1500))
    again = RecordingConsumer()
    bench.subscribe("s", again).flow(100)
    assert [d.entry.data for d in again.deliveries] == [b"t2", b"t3"]


def test_seek_to_earliest_and_latest() -> None:
    """Seek to EARLIEST replays everything; to LATEST skips everything stored."""
    bench = make_topic()
    bench.publish("a", "b")
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    result_of(server.ack_cumulative(consumer.positions[1]))
    result_of(server.seek(InitialPosition.EARLIEST))
    replay = RecordingConsumer()
    s2 = bench.subscribe("s", replay)
    s2.flow(100)
    assert payloads(replay) == ["a", "b"]
    result_of(s2.seek(InitialPosition.LATEST))
    latest = RecordingConsumer()
    bench.subscribe("s", latest).flow(100)
    bench.publish("c")
    assert payloads(latest) == ["c"]


def test_read_in_flight_at_seek_time_is_discarded() -> None:
    """Entries arriving for a read issued before a seek do not leak into the new position."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)  # a waiting read is outstanding now
    result_of(server.seek(InitialPosition.EARLIEST))
    again = RecordingConsumer()
    s2 = bench.subscribe("s", again)
    s2.flow(100)
    bench.publish("x")
    assert payloads(again) == ["x"]
    assert consumer.deliveries == []


# -- unsubscribe and lifecycle --------------------------------------------------------------------


def test_unsubscribe_fails_while_other_consumers_are_connected() -> None:
    """Unsubscribe is refused with others connected and deletes the cursor when alone."""
    bench = make_topic()
    a, b = RecordingConsumer(), RecordingConsumer()
    sa = bench.subscribe("s", a, SubType.SHARED)
    sb = bench.subscribe("s", b, SubType.SHARED)
    assert isinstance(failure_of(sa.unsubscribe()), SubscriptionBusyError)
    result_of(sb.close())
    result_of(sa.unsubscribe())
    assert "s" not in bench.topic.subscriptions
    assert "s" not in bench.ledger.cursors
    assert "s" not in bench.ledger.data.cursors


def test_admin_delete_subscription_needs_force_with_consumers() -> None:
    """Deleting a subscription with consumers needs force, which disconnects them."""
    bench = make_topic()
    consumer = RecordingConsumer()
    bench.subscribe("s", consumer)
    assert isinstance(failure_of(bench.topic.delete_subscription("s")), SubscriptionBusyError)
    result_of(bench.topic.delete_subscription("s", force=True))
    assert consumer.disconnects == 1
    assert "s" not in bench.topic.subscriptions


def test_durable_subscription_keeps_its_position_across_a_reload() -> None:
    """After unloading, acked entries stay acked and unacked ones come again."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    bench.publish("m0", "m1", "m2")
    server.ack([consumer.positions[0]])
    bench.reload()
    assert "s" in bench.topic.subscriptions
    assert consumer.disconnects == 1
    again = RecordingConsumer()
    bench.subscribe("s", again).flow(100)
    assert payloads(again) == ["m1", "m2"]


def test_non_durable_reader_starts_after_its_start_position_and_goes_away() -> None:
    """A reader starts after start_position (or at it when inclusive) and its subscription
    disappears with its consumer."""
    bench = make_topic()
    entries = bench.publish("m0", "m1", "m2")
    reader = RecordingConsumer()
    server = bench.subscribe("r", reader, durable=False, start_position=entries[0].position)
    server.flow(10)
    assert payloads(reader) == ["m1", "m2"]
    result_of(server.close())
    assert "r" not in bench.topic.subscriptions
    inclusive = RecordingConsumer()
    bench.subscribe(
        "r2", inclusive, durable=False, start_position=entries[1].position, start_inclusive=True
    ).flow(10)
    assert payloads(inclusive) == ["m1", "m2"]


def test_reader_subscription_survives_its_seek_for_the_reconnect() -> None:
    """A seek on a reader keeps its cursor so the client's re-subscribe continues there."""
    bench = make_topic()
    bench.publish("m0", "m1", "m2")
    reader = RecordingConsumer()
    server = bench.subscribe("r", reader, durable=False)
    server.flow(10)
    result_of(server.seek(Position(1, 1)))
    assert "r" in bench.topic.subscriptions
    again = RecordingConsumer()
    bench.subscribe("r", again, durable=False).flow(10)
    assert payloads(again) == ["m1", "m2"]


def test_last_message_id_through_a_consumer_carries_the_mark_delete() -> None:
    """GET_LAST_MESSAGE_ID needs the subscription's mark-delete position too."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(10)
    bench.publish("m0", "m1")
    server.ack([consumer.positions[0]])
    last = result_of(server.last_message_id())
    assert last.position == consumer.positions[1]
    assert last.mark_delete_position == consumer.positions[0]


@pytest.mark.parametrize("sub_type", [SubType.EXCLUSIVE, SubType.SHARED])
def test_closing_a_consumer_twice_is_harmless(sub_type: SubType) -> None:
    """close() is idempotent."""
    bench = make_topic()
    server = bench.subscribe("s", RecordingConsumer(), sub_type)
    result_of(server.close())
    result_of(server.close())
    assert bench.topic.subscriptions["s"].consumers == []


def test_entries_of_the_last_consumer_wait_for_the_next_one() -> None:
    """When the only consumer leaves, its unacked entries go to whoever subscribes next."""
    bench = make_topic()
    first = RecordingConsumer()
    s1 = bench.subscribe("s", first, SubType.SHARED)
    s1.flow(10)
    bench.publish("m0", "m1")
    s1.ack([first.positions[0]])
    result_of(s1.close())
    assert not bench.ledger.cursors["s"].waiting
    second = RecordingConsumer()
    bench.subscribe("s", second, SubType.SHARED).flow(10)
    assert payloads(second) == ["m1"]
    assert second.deliveries[0].redelivery_count == 1


@pytest.mark.parametrize(
    ("initial", "expected"),
    [(InitialPosition.EARLIEST, ["old", "new"]), (InitialPosition.LATEST, ["new"])],
)
def test_reader_without_start_position_uses_the_initial_position(
    initial: InitialPosition, expected: list[str]
) -> None:
    """A non-durable subscription without a start position starts at EARLIEST or LATEST."""
    bench = make_topic()
    bench.publish("old")
    reader = RecordingConsumer()
    bench.subscribe("r", reader, durable=False, initial_position=initial).flow(10)
    bench.publish("new")
    assert payloads(reader) == expected


def test_subscribing_to_a_closed_topic_fails_retryably() -> None:
    """A topic being unloaded refuses subscriptions with a ServiceNotReady-kind error."""
    bench = make_topic()
    result_of(bench.topic.close())
    error = failure_of(bench.topic.subscribe("s", RecordingConsumer()))
    assert isinstance(error, ServiceNotReadyError)
