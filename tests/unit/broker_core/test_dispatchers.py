"""Dispatchers: delivery rules per subscription type, permits and read-ahead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import RecordingConsumer, make_topic, payload_of, result_of

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.dispatcher import DispatchSettings, pick_failover_active
from polybroker.broker_core.errors import ConsumerBusyError
from polybroker.broker_core.topic import TopicSettings
from polybroker.ledger.api import InitialPosition


def payloads(consumer: RecordingConsumer) -> list[str]:
    return [payload_of(d.entry) for d in consumer.deliveries]


# -- Exclusive ----------------------------------------------------------------------------------


def test_exclusive_admits_one_consumer() -> None:
    """A second consumer on an Exclusive subscription fails with ConsumerBusy."""
    bench = make_topic()
    bench.subscribe("s", RecordingConsumer())
    with pytest.raises(ConsumerBusyError):
        bench.subscribe("s", RecordingConsumer())


def test_exclusive_delivers_in_order_within_permits() -> None:
    """Entries arrive in order and never beyond the permits granted."""
    bench = make_topic()
    bench.publish(*[f"m{i}" for i in range(5)])
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    assert consumer.deliveries == []
    server.flow(3)
    assert payloads(consumer) == ["m0", "m1", "m2"]
    assert server.permits == 0
    server.flow(10)
    assert payloads(consumer) == ["m0", "m1", "m2", "m3", "m4"]
    assert server.permits == 8


def test_a_batch_uses_one_permit_per_message() -> None:
    """An entry of N messages takes N permits; it is sent whole to a consumer with any."""
    bench = make_topic()
    result_of(bench.topic.publish(b"batch of 4", 4))
    result_of(bench.topic.publish(b"single", 1))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(2)
    assert [d.entry.data for d in consumer.deliveries] == [b"batch of 4"]
    assert server.permits == -2
    server.flow(2)
    assert len(consumer.deliveries) == 1
    server.flow(1)
    assert [d.entry.data for d in consumer.deliveries] == [b"batch of 4", b"single"]


def test_latest_subscription_sees_only_new_messages() -> None:
    """A new subscription at Latest starts after what is already stored."""
    bench = make_topic()
    bench.publish("old")
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, initial_position=InitialPosition.LATEST)
    server.flow(10)
    bench.publish("new")
    assert payloads(consumer) == ["new"]


# -- read-ahead -----------------------------------------------------------------------------------


def test_no_read_without_permits_and_reads_are_batched() -> None:
    """The cursor is read only when a consumer has permits, at most max_read_batch a time."""
    settings = TopicSettings(dispatch=DispatchSettings(max_read_batch=4))
    bench = make_topic(settings=settings)
    bench.publish(*[f"m{i}" for i in range(10)])
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    cursor = bench.ledger.cursors["s"]
    assert cursor.reads == 0  # type: ignore[attr-defined]
    server.flow(100)
    assert len(consumer.deliveries) == 10
    assert cursor.reads == 4  # 4 + 4 + 2, then a waiting read  # type: ignore[attr-defined]
    assert cursor.waiting  # type: ignore[attr-defined]


def test_entries_are_read_once_even_when_consumers_run_out_of_permits() -> None:
    """Entries read beyond the permits wait in memory and are not read again."""
    bench = make_topic()
    for i in range(6):
        result_of(bench.topic.publish(f"b{i}".encode(), 3))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(4)  # reads 4 entries (12 messages) but permits cover 2 entries
    assert len(consumer.deliveries) == 2
    for _ in range(5):
        server.flow(3)
    assert len(consumer.deliveries) == 6
    cursor = bench.ledger.cursors["s"]
    read = cursor.entries_read  # type: ignore[attr-defined]
    assert len(read) == len(set(read)) == 6


def test_read_failure_is_retried_after_a_delay() -> None:
    """A failed cursor read is logged and retried on the clock, not lost."""
    bench = make_topic()
    bench.publish("a")
    bench.ledger.fail_reads = 1
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(5)
    assert consumer.deliveries == []
    bench.clock.advance(1.0)
    assert payloads(consumer) == ["a"]


# -- Shared --------------------------------------------------------------------------------------


def test_shared_round_robins_over_consumers_with_permits() -> None:
    """Shared alternates between consumers that have permits and skips those without."""
    bench = make_topic()
    a, b, c = RecordingConsumer("a"), RecordingConsumer("b"), RecordingConsumer("c")
    sa = bench.subscribe("s", a, SubType.SHARED)
    sb = bench.subscribe("s", b, SubType.SHARED)
    bench.subscribe("s", c, SubType.SHARED)  # no permits: gets nothing
    sa.flow(10)
    sb.flow(10)
    bench.publish(*[f"m{i}" for i in range(6)])
    assert payloads(a) == ["m0", "m2", "m4"]
    assert payloads(b) == ["m1", "m3", "m5"]
    assert c.deliveries == []


def test_shared_spreads_a_backlog_by_permits() -> None:
    """With a backlog, each consumer gets as many entries as its permits allow."""
    bench = make_topic()
    bench.publish(*[f"m{i}" for i in range(10)])
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.SHARED)
    sb = bench.subscribe("s", b, SubType.SHARED)
    sa.flow(2)
    sb.flow(5)
    assert len(a.deliveries) == 2
    assert len(b.deliveries) == 5
    delivered = payloads(a) + payloads(b)
    assert sorted(delivered, key=lambda p: int(p[1:])) == [f"m{i}" for i in range(7)]


def test_shared_fills_lower_priority_levels_first() -> None:
    """Consumers of priority level 0 take entries before level 1 ones while they have permits."""
    bench = make_topic()
    high, low = RecordingConsumer("high", 0), RecordingConsumer("low", 1)
    sh = bench.subscribe("s", high, SubType.SHARED)
    sl = bench.subscribe("s", low, SubType.SHARED)
    sh.flow(3)
    sl.flow(10)
    bench.publish(*[f"m{i}" for i in range(5)])
    assert payloads(high) == ["m0", "m1", "m2"]
    assert payloads(low) == ["m3", "m4"]


def test_shared_consumer_over_its_unacked_limit_is_skipped_until_it_acks() -> None:
    """A consumer at maxUnackedMessagesPerConsumer gets nothing more until it acknowledges."""
    settings = TopicSettings(dispatch=DispatchSettings(max_unacked_per_consumer=2))
    bench = make_topic(settings=settings)
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish(*[f"m{i}" for i in range(4)])
    assert payloads(consumer) == ["m0", "m1"]
    assert server.stats()["blockedConsumerOnUnackedMsgs"] is True
    server.ack(consumer.positions)
    assert payloads(consumer) == ["m0", "m1", "m2", "m3"]


# -- Failover ------------------------------------------------------------------------------------


def test_failover_active_is_lowest_priority_then_name() -> None:
    """The active consumer is the lowest priority level, ties broken by name."""
    bench = make_topic()
    b = RecordingConsumer("b", 0)
    a = RecordingConsumer("a", 0)
    z = RecordingConsumer("z", -1)
    sb = bench.subscribe("s", b, SubType.FAILOVER)
    assert b.active_changes == [True]
    sa = bench.subscribe("s", a, SubType.FAILOVER)
    assert b.active_changes == [True, False]
    assert a.active_changes == [True]
    sz = bench.subscribe("s", z, SubType.FAILOVER)
    assert z.active_changes == [True]
    assert a.active_changes == [True, False]
    for s in (sa, sb, sz):
        s.flow(10)
    bench.publish("m0", "m1")
    assert payloads(z) == ["m0", "m1"]
    assert a.deliveries == []
    assert b.deliveries == []
    assert bench.topic.stats()["subscriptions"]["s"]["activeConsumerName"] == "z"


def test_failover_switch_redelivers_unacked_to_the_new_active_consumer() -> None:
    """When the active consumer leaves, the standby becomes active and gets its unacked
    entries again, in order, with their redelivery count raised."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.FAILOVER)
    sb = bench.subscribe("s", b, SubType.FAILOVER)
    sa.flow(10)
    sb.flow(10)
    bench.publish("m0", "m1", "m2")
    sa.ack([a.positions[0]])
    result_of(sa.close())
    assert b.active_changes == [False, True]
    assert payloads(b) == ["m1", "m2"]
    assert [d.redelivery_count for d in b.deliveries] == [1, 1]
    bench.publish("m3")
    assert payloads(b)[-1] == "m3"


def test_failover_spreads_partitions_over_consumers() -> None:
    """On partition i the active consumer is candidate i mod n, so partitions spread."""
    actives = []
    for partition in range(4):
        bench = make_topic(
            name=f"persistent://public/default/t-partition-{partition}", partition_index=partition
        )
        consumers = [RecordingConsumer(n) for n in ("c1", "c2")]
        for c in consumers:
            bench.subscribe("s", c, SubType.FAILOVER)
        actives.append(next(c.consumer_name for c in consumers if c.active_changes[-1]))
    assert actives == ["c1", "c2", "c1", "c2"]


def test_pick_failover_active_ignores_higher_priority_levels() -> None:
    """Only consumers of the lowest priority level are candidates."""

    class Fake:
        def __init__(self, name: str, level: int) -> None:
            self.consumer_name = name
            self.priority_level = level

    consumers = [Fake("a", 1), Fake("b", 0), Fake("c", 0)]
    assert pick_failover_active(consumers, -1).consumer_name == "b"  # type: ignore[arg-type,union-attr]
    assert pick_failover_active(consumers, 3).consumer_name == "c"  # type: ignore[arg-type,union-attr]
    assert pick_failover_active([], 0) is None


# -- type rules ------------------------------------------------------------------------------------


def test_subscription_type_conflict_is_refused_while_consumers_are_connected() -> None:
    """A consumer of another type is ConsumerBusy; after all left, the type may change."""
    bench = make_topic()
    first = bench.subscribe("s", RecordingConsumer(), SubType.SHARED)
    with pytest.raises(ConsumerBusyError):
        bench.subscribe("s", RecordingConsumer(), SubType.FAILOVER)
    result_of(first.close())
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.FAILOVER)
    assert bench.topic.subscriptions["s"].sub_type is SubType.FAILOVER
    server.flow(1)
    bench.publish("x")
    assert payloads(consumer) == ["x"]


def test_type_change_keeps_entries_already_read() -> None:
    """Entries read ahead under one type are delivered under the next, not lost."""
    bench = make_topic()
    bench.publish(*[f"m{i}" for i in range(4)])
    first = RecordingConsumer()
    s1 = bench.subscribe("s", first, SubType.SHARED)
    s1.flow(1)  # reads m0 only (one permit)
    s1.ack(first.positions)
    result_of(s1.close())
    second = RecordingConsumer()
    s2 = bench.subscribe("s", second, SubType.EXCLUSIVE)
    s2.flow(10)
    assert payloads(second) == ["m1", "m2", "m3"]


def test_failing_entry_hooks_do_not_stop_delivery() -> None:
    """A key or deliver-at hook that raises is treated as absent; entries still flow."""

    def broken(entry: object) -> None:
        raise ValueError("cannot parse")

    bench = make_topic()
    shared, keyed = RecordingConsumer(), RecordingConsumer()
    bench.subscribe("shared", shared, SubType.SHARED, deliver_at=broken).flow(10)
    bench.subscribe("keyed", keyed, SubType.KEY_SHARED, key_of=broken).flow(10)
    bench.publish("m0", "m1")
    assert payloads(shared) == ["m0", "m1"]
    assert payloads(keyed) == ["m0", "m1"]


def test_exclusive_run_keeps_counters_and_redelivery_counts() -> None:
    """Entries handed to the active consumer as one run are counted as one by one would be:
    permits and pending messages per message, bytes and messages out on the consumer and the
    dispatcher, each entry pending once, and a redelivered entry with its redelivery count."""
    bench = make_topic()
    entries = bench.publish(*[f"m{i}" for i in range(6)])
    result_of(bench.topic.publish(b"batch of 3", 3))
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(100)
    size = sum(len(e.data) for e in entries) + len(b"batch of 3")
    datas = [e.data for e in entries] + [b"batch of 3"]
    assert [d.entry.data for d in consumer.deliveries] == datas
    assert server.permits == 100 - 9
    assert server.pending_messages == 9
    assert len(server.pending) == 7
    assert (server.msg_out, server.bytes_out) == (9, size)
    dispatcher = bench.topic.subscriptions["s"].dispatcher
    assert dispatcher is not None
    assert (dispatcher.msg_out, dispatcher.bytes_out) == (9, size)
    assert [d.redelivery_count for d in consumer.deliveries] == [0] * 7

    result_of(server.ack([entries[0].position, entries[1].position]))
    server.redeliver()
    again = consumer.deliveries[7:]
    assert [d.entry.data for d in again] == datas[2:]
    assert [d.redelivery_count for d in again] == [1] * 5
    assert server.pending_messages == 7
    assert (dispatcher.msg_out, dispatcher.bytes_out) == (
        16,
        2 * size - len(entries[0].data) - len(entries[1].data),
    )


def test_cumulative_ack_releases_exactly_what_precedes_it_also_after_redelivery() -> None:
    """A cumulative ack frees the pending entries at or before it and no others: when the
    entries went out in order, and when a redelivery sent older ones out again."""
    bench = make_topic()
    entries = bench.publish(*[f"m{i}" for i in range(8)])
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer)
    server.flow(5)
    result_of(server.ack_cumulative(entries[1].position))
    assert sorted(server.pending) == [e.position for e in entries[2:5]]
    server.redeliver()  # m2..m4 go out again (with new permits), then m5, m6
    server.flow(5)
    result_of(server.ack_cumulative(entries[3].position))
    assert sorted(server.pending) == [e.position for e in entries[4:7]]
    assert server.pending_messages == 3

    server.redeliver()  # m4..m6 again, then m7
    server.flow(10)
    assert [payload_of(d.entry) for d in consumer.deliveries[-4:]] == ["m4", "m5", "m6", "m7"]
    result_of(server.ack_cumulative(entries[5].position))
    assert sorted(server.pending) == [entries[6].position, entries[7].position]
    later = bench.publish("m8", "m9")
    result_of(server.ack_cumulative(entries[7].position))
    assert sorted(server.pending) == [e.position for e in later]
    result_of(server.ack_cumulative(later[0].position))
    assert sorted(server.pending) == [later[1].position]
    assert server.pending_messages == 1
    result_of(server.ack_cumulative(later[1].position))
    assert server.pending == {}
    newest = bench.publish("m10", "m11", "m12")
    result_of(server.ack_cumulative(newest[1].position))
    assert sorted(server.pending) == [newest[2].position]
    assert server.pending_messages == 1


# -- A paused consumer (its connection's send buffer is full) ------------------------------------


@pytest.mark.parametrize(
    "sub_type", [SubType.EXCLUSIVE, SubType.FAILOVER, SubType.SHARED, SubType.KEY_SHARED]
)
def test_a_paused_consumer_takes_nothing_until_resumed(sub_type: SubType) -> None:
    """Permits granted while paused are kept; nothing is delivered or read ahead for the
    consumer until it resumes, then everything comes in order."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, sub_type)
    server.pause()
    server.flow(100)
    bench.publish(*[f"m{i}" for i in range(5)])
    assert consumer.deliveries == []
    assert server.permits == 100
    server.resume()
    assert payloads(consumer) == [f"m{i}" for i in range(5)]
    bench.publish("m5")
    assert payloads(consumer)[-1] == "m5"


def test_shared_passes_a_paused_consumer_by() -> None:
    """On Shared, the others take what a paused consumer would have had."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.SHARED)
    sb = bench.subscribe("s", b, SubType.SHARED)
    sa.flow(10)
    sb.flow(10)
    sa.pause()
    bench.publish(*[f"m{i}" for i in range(4)])
    assert a.deliveries == []
    assert payloads(b) == ["m0", "m1", "m2", "m3"]
    sa.resume()
    bench.publish("m4", "m5")
    assert payloads(a) == ["m4"]
    assert payloads(b)[-1] == "m5"
