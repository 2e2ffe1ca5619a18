"""Unit tests of a persistent topic's message-index reads and append listeners."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import make_topic, result_of

from polybroker.ledger.api import Position


def test_read_from_index_finds_the_entry_holding_a_message() -> None:
    """Reads start at the entry holding the index; out-of-range indexes read nothing."""
    bench = make_topic()
    for n in (3, 2, 4):
        result_of(bench.topic.publish(b"x" * n, n, publish_time_ms=1000 + n))
    topic = bench.topic
    assert (topic.first_index, topic.next_index) == (0, 9)
    entries = result_of(topic.read_from_index(4, 10))
    assert [(e.index, e.num_messages) for e in entries] == [(3, 2), (5, 4)]
    assert [e.index for e in result_of(topic.read_from_index(0, 1))] == [0]
    assert result_of(topic.read_from_index(9, 10)) == []
    assert result_of(topic.read_from_index(-1, 10)) == []


def test_index_of_time_is_the_first_entry_published_at_or_after() -> None:
    """A timestamp maps to the index of the first entry published at or after it."""
    bench = make_topic()
    result_of(bench.topic.publish(b"a", 2, publish_time_ms=1000))
    result_of(bench.topic.publish(b"b", 1, publish_time_ms=2000))
    assert result_of(bench.topic.index_of_time(1500)) == 2
    assert result_of(bench.topic.index_of_time(0)) == 0
    assert result_of(bench.topic.index_of_time(3000)) is None


def test_append_listeners_see_each_durable_entry_and_a_failing_one_is_contained() -> None:
    """Listeners run once the entry is durable; one that raises does not fail the publish."""
    bench = make_topic()
    seen: list[int] = []

    def broken(entry: object) -> None:
        raise RuntimeError("listener bug")

    bench.topic.append_listeners.extend([broken, lambda e: seen.append(e.index)])
    bench.ledger.hold_appends = True
    d = bench.topic.publish(b"x", 2)
    assert seen == []
    bench.ledger.release_appends()
    assert result_of(d).index == 0
    assert seen == [0]


def test_mark_subscription_at_index_acknowledges_whole_entries_before_the_index() -> None:
    """The named durable subscription is created and its mark-delete follows the index,
    stopping before an entry the index falls inside; it never moves back."""
    bench = make_topic()
    for n in (3, 2, 4):
        result_of(bench.topic.publish(b"x", n))
    topic = bench.topic
    result_of(topic.mark_subscription_at_index("grp", 4))  # inside the second entry
    sub = topic.subscriptions["grp"]
    assert sub.cursor.mark_delete_position == Position(1, 0)
    result_of(topic.mark_subscription_at_index("grp", 5))
    assert sub.cursor.mark_delete_position == Position(1, 1)
    result_of(topic.mark_subscription_at_index("grp", 1))
    assert sub.cursor.mark_delete_position == Position(1, 1)
    result_of(topic.mark_subscription_at_index("grp", 9))
    assert sub.cursor.mark_delete_position == Position(1, 2)
    assert sub.cursor.backlog_entries() == 0


def test_retention_defaults_reach_the_managed_ledger_config() -> None:
    """defaultRetentionTimeInMinutes / SizeInMB set the logs' retention; -1 is unlimited."""
    from fake_ledger import FakeLedgerFactory, FakeMetadataStore
    from twisted.internet.task import Clock

    from polybroker.broker_core.service import BrokerService
    from polybroker.config import Config

    clock = Clock()
    cfg = Config(
        {
            "defaultRetentionTimeInMinutes": -1,
            "defaultRetentionSizeInMB": 2,
            "statsUpdateFrequencyInSecs": 0,
        }
    )
    service = BrokerService(FakeLedgerFactory(clock.seconds), clock, cfg, FakeMetadataStore())
    assert service.ledger_config.retention_time_s == -1
    assert service.ledger_config.retention_size_bytes == 2 * 1024 * 1024
