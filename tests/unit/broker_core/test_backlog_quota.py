"""Unit tests of backlog quotas: the size estimate, the eviction target, which limit applies,
and what each policy does to fake topics on an injected clock."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from polybroker.broker_core.backlog_quota import (
    BacklogQuotas,
    Limit,
    ProducerBlockedQuotaExceededError,
    ProducerBlockedQuotaExceededException,
    backlog_bytes,
    eviction_target,
)
from polybroker.ledger.api import Entry, LedgerInfo, Position


def _ledger(ledger_id: int, entries: int, size: int, published_ms: int = 0) -> LedgerInfo:
    return LedgerInfo(ledger_id, entries, size, 0, entries, published_ms, published_ms)


# Three ledgers of 10 entries of 100 bytes each.
LEDGERS = [_ledger(1, 10, 1000), _ledger(2, 10, 1000), _ledger(3, 10, 1000)]


def test_backlog_bytes_count_what_follows_the_mark_delete_position() -> None:
    assert backlog_bytes(LEDGERS, Position(0, -1)) == 3000
    assert backlog_bytes(LEDGERS, Position(1, -1)) == 3000
    assert backlog_bytes(LEDGERS, Position(1, 4)) == 2500
    assert backlog_bytes(LEDGERS, Position(2, 9)) == 1000
    assert backlog_bytes(LEDGERS, Position(3, 9)) == 0


def test_eviction_keeps_at_most_the_limit_of_the_newest_entries() -> None:
    assert eviction_target(LEDGERS, Position(1, -1), 3000) is None
    assert eviction_target(LEDGERS, Position(1, -1), 1500) == Position(2, 4)
    assert eviction_target(LEDGERS, Position(1, -1), 1000) == Position(2, 9)
    assert eviction_target(LEDGERS, Position(1, -1), 950) == Position(3, 0)
    assert eviction_target(LEDGERS, Position(1, -1), 0) == Position(3, 9)
    target = eviction_target(LEDGERS, Position(2, 2), 1234)
    assert target is not None
    assert backlog_bytes(LEDGERS, target) <= 1234 < backlog_bytes(LEDGERS, Position(2, 2))


class FakeCursor:
    def __init__(self, mark_delete: Position) -> None:
        self.mark_delete_position = mark_delete


class FakeSub:
    durable = True
    closed = False

    def __init__(self, name: str, mark_delete: Position) -> None:
        self.name = name
        self.cursor = FakeCursor(mark_delete)
        self.expired: list[int] = []

    def acknowledge_up_to(self, target: Position) -> Deferred[bool]:
        self.cursor.mark_delete_position = max(self.cursor.mark_delete_position, target)
        return succeed(True)

    def expire_before(self, timestamp_ms: int) -> Deferred[bool]:
        self.expired.append(timestamp_ms)
        return succeed(True)


class FakeLedger:
    def __init__(self, ledgers: list[LedgerInfo], published_ms: int) -> None:
        self.ledgers = ledgers
        self.published_ms = published_ms

    def read(self, position: Position, count: int) -> Deferred[list[Entry]]:
        if position.ledger_id > 3 or position >= Position(3, 10):
            return succeed([])
        return succeed([Entry(position, 0, 1, self.published_ms, b"")])


class FakeTopic:
    persistent = True

    def __init__(self, name: str, published_ms: int = 0, **subs: FakeSub) -> None:
        self.name = name
        self.ledger = FakeLedger(LEDGERS, published_ms)
        self.subscriptions = subs
        self.disconnects = 0

    def disconnect_producers(self) -> None:
        self.disconnects += 1


def _quotas(
    topics: list[Any], quotas: dict[str, Any], defaults: tuple[int, int, str], clock: Clock
) -> BacklogQuotas:
    return BacklogQuotas(lambda: topics, lambda t: quotas.get(t), defaults, clock, 60.0)


def test_the_namespace_quota_wins_over_the_broker_default_type_by_type() -> None:
    size = {"limitSize": 100, "limitTime": -1, "policy": "producer_exception"}
    quotas = {"t": {"destination_storage": size}}
    q = _quotas([], quotas, (5000, 60, "producer_request_hold"), Clock())
    assert q.limits("t") == (Limit(100, "producer_exception"), Limit(60, "producer_request_hold"))
    assert q.limits("other") == (
        Limit(5000, "producer_request_hold"),
        Limit(60, "producer_request_hold"),
    )
    assert _quotas([], {}, (-1, -1, "producer_request_hold"), Clock()).limits("t") == (None, None)


def test_a_producer_is_refused_by_the_policy_of_the_limit_it_is_over() -> None:
    slow = FakeTopic("slow", s=FakeSub("s", Position(1, -1)))  # 3000 bytes behind
    fast = FakeTopic("fast", s=FakeSub("s", Position(3, 5)))  # 400 bytes behind
    q = _quotas([], {}, (1000, -1, "producer_request_hold"), Clock())
    assert isinstance(q.producer_refusal(slow), ProducerBlockedQuotaExceededError)
    assert q.producer_refusal(fast) is None
    q = _quotas([], {}, (1000, -1, "producer_exception"), Clock())
    assert isinstance(q.producer_refusal(slow), ProducerBlockedQuotaExceededException)
    assert (
        _quotas([], {}, (1000, -1, "consumer_backlog_eviction"), Clock()).producer_refusal(slow)
        is None
    )


def test_checks_evict_or_disconnect_by_policy_on_the_clock() -> None:
    clock = Clock()
    clock.advance(1000)
    evicted = FakeTopic("e", s=FakeSub("s", Position(1, -1)), t=FakeSub("t", Position(3, 8)))
    held = FakeTopic("h", published_ms=100_000, s=FakeSub("s", Position(3, 2)))
    quotas = {
        "e": {
            "destination_storage": {"limitSize": 1500, "policy": "consumer_backlog_eviction"},
            "message_age": {"limitTime": 30, "policy": "consumer_backlog_eviction"},
        },
        "h": {"message_age": {"limitTime": 60, "policy": "producer_request_hold"}},
    }
    q = _quotas([evicted, held], quotas, (-1, -1, "producer_request_hold"), clock)
    q.start()
    assert q.producer_refusal(held) is None  # age is judged by the checks
    clock.advance(60)
    assert q.checks == 1
    assert evicted.subscriptions["s"].cursor.mark_delete_position == Position(2, 4)
    assert evicted.subscriptions["t"].cursor.mark_delete_position == Position(3, 8)
    assert evicted.subscriptions["s"].expired == [(1060 - 30) * 1000]
    assert (evicted.disconnects, held.disconnects) == (0, 1)  # its oldest is 960 s old
    assert isinstance(q.producer_refusal(held), ProducerBlockedQuotaExceededError)
    held.subscriptions["s"].cursor.mark_delete_position = Position(3, 9)  # caught up
    clock.advance(60)
    assert q.producer_refusal(held) is None
    assert held.disconnects == 1
    q.stop()
