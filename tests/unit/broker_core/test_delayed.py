"""Delayed delivery: entries with a future deliver-at time wait on the clock."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import RecordingConsumer, make_topic, payload_of, result_of

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.dispatcher import DispatchSettings
from polybroker.broker_core.topic import TopicSettings


def delivered(consumer: RecordingConsumer) -> list[str]:
    return [payload_of(d.entry) for d in consumer.deliveries]


def test_shared_holds_a_delayed_entry_until_its_time() -> None:
    """A delayed entry waits while later ones go ahead; it arrives when the clock gets there."""
    bench = make_topic()
    bench.clock.advance(100)  # now = 100 000 ms
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish("later", deliver_at=105_000)
    bench.publish("now")
    assert delivered(consumer) == ["now"]
    stats = bench.topic.stats()["subscriptions"]["s"]
    assert stats["msgDelayed"] == 1
    assert stats["msgBacklogNoDelayed"] == 1
    bench.clock.advance(4.9)
    assert delivered(consumer) == ["now"]
    bench.clock.advance(0.1)
    assert delivered(consumer) == ["now", "later"]
    assert bench.topic.stats()["subscriptions"]["s"]["msgDelayed"] == 0


def test_delayed_entries_come_in_deliver_at_order() -> None:
    """Several delayed entries are released in order of their times, each at its time."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(100)
    bench.publish("third", deliver_at=3000)
    bench.publish("first", deliver_at=1000)
    bench.publish("second", deliver_at=2000)
    bench.clock.advance(1)
    assert delivered(consumer) == ["first"]
    bench.clock.advance(1)
    assert delivered(consumer) == ["first", "second"]
    bench.clock.advance(1)
    assert delivered(consumer) == ["first", "second", "third"]


def test_delayed_entry_waits_for_permits_when_due() -> None:
    """A due entry still needs a permit; it is delivered when the consumer has one."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(1)
    bench.publish("delayed", deliver_at=1000)
    bench.publish("now")
    assert delivered(consumer) == ["now"]
    bench.clock.advance(2)
    assert delivered(consumer) == ["now"]
    server.flow(1)
    assert delivered(consumer) == ["now", "delayed"]


def test_key_shared_delays_too() -> None:
    """Key_Shared subscriptions honour deliver-at times."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.KEY_SHARED)
    server.flow(100)
    bench.publish("later", deliver_at=2000, key="k")
    assert consumer.deliveries == []
    bench.clock.advance(2)
    assert delivered(consumer) == ["later"]


def test_exclusive_and_failover_ignore_delays() -> None:
    """Delays apply to Shared and Key_Shared only, as in Pulsar."""
    bench = make_topic()
    ex, fo = RecordingConsumer(), RecordingConsumer()
    bench.subscribe("ex", ex, SubType.EXCLUSIVE).flow(10)
    bench.subscribe("fo", fo, SubType.FAILOVER).flow(10)
    bench.publish("later", deliver_at=60_000)
    assert delivered(ex) == ["later"]
    assert delivered(fo) == ["later"]


def test_delayed_delivery_can_be_disabled() -> None:
    """With delayedDeliveryEnabled off, deliver-at times are ignored."""
    settings = TopicSettings(dispatch=DispatchSettings(delayed_delivery_enabled=False))
    bench = make_topic(settings=settings)
    consumer = RecordingConsumer()
    bench.subscribe("s", consumer, SubType.SHARED).flow(10)
    bench.publish("later", deliver_at=60_000)
    assert delivered(consumer) == ["later"]


def test_delayed_entries_are_dropped_by_a_seek() -> None:
    """A seek forgets parked entries: the timer delivers nothing to the old consumers."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(10)
    bench.publish("later", deliver_at=5000)
    result_of(server.seek(bench.ledger.last_confirmed))
    bench.clock.advance(10)
    assert consumer.deliveries == []
    assert bench.clock.getDelayedCalls() == []


def test_redelivered_delayed_entry_is_not_delayed_again() -> None:
    """Once due and delivered, a nacked delayed entry comes back at once."""
    bench = make_topic()
    consumer = RecordingConsumer()
    server = bench.subscribe("s", consumer, SubType.SHARED)
    server.flow(10)
    bench.publish("later", deliver_at=1000)
    bench.clock.advance(1)
    server.redeliver(consumer.positions)
    assert delivered(consumer) == ["later", "later"]
    assert consumer.deliveries[-1].redelivery_count == 1
