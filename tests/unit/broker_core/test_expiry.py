"""Unit tests of ``MessageExpiry`` with fake topics and an injected clock."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from polybroker.broker_core.expiry import MessageExpiry


class FakeSub:
    def __init__(self, result: Any = None) -> None:
        self.calls: list[int] = []
        self.closed = False
        self.result = result

    def expire_before(self, timestamp_ms: int) -> Deferred[bool]:
        self.calls.append(timestamp_ms)
        if isinstance(self.result, Deferred):
            return self.result
        if isinstance(self.result, Exception):
            return fail(self.result)
        return succeed(True)


class FakeTopic:
    def __init__(self, name: str, **subs: FakeSub) -> None:
        self.name = name
        self.subscriptions = subs


def _expiry(
    topics: list[FakeTopic], ttls: dict[str, int | None], default: int, clock: Clock
) -> MessageExpiry:
    return MessageExpiry(lambda: topics, lambda t: ttls.get(t), default, clock, 60.0)


def test_each_check_expires_what_is_older_than_the_topics_ttl() -> None:
    """Every interval: each subscription of a topic with a TTL is expired up to now - TTL;
    a namespace's TTL wins over the broker's default, and 0 means none."""
    clock = Clock()
    clock.advance(1000)
    own, default, off = FakeSub(), FakeSub(), FakeSub()
    topics = [FakeTopic("a", s=own), FakeTopic("b", s=default), FakeTopic("c", s=off)]
    expiry = _expiry(topics, {"a": 30, "c": 0}, 100, clock)
    expiry.start()
    clock.advance(59)
    assert own.calls == []
    clock.advance(1)
    assert own.calls == [(1060 - 30) * 1000]
    assert default.calls == [(1060 - 100) * 1000]
    assert off.calls == []
    clock.advance(60)
    assert len(own.calls) == 2
    expiry.stop()
    clock.advance(600)
    assert len(own.calls) == 2


def test_a_check_still_running_makes_the_next_one_skip() -> None:
    """While a subscription's expiry has not finished, a check that falls due is skipped."""
    clock = Clock()
    pending: Deferred[bool] = Deferred()
    slow = FakeSub(pending)
    expiry = _expiry([FakeTopic("a", s=slow)], {}, 10, clock)
    expiry.start()
    clock.advance(60)
    clock.advance(60)
    assert len(slow.calls) == 1
    pending.callback(True)
    assert expiry.checks == 1
    slow.result = None
    clock.advance(60)
    assert len(slow.calls) == 2


def test_a_failing_subscription_does_not_stop_the_others() -> None:
    """An expiry that fails is logged; the other subscriptions are still expired."""
    clock = Clock()
    broken, fine = FakeSub(RuntimeError("closed")), FakeSub()
    expiry = _expiry([FakeTopic("a", x=broken, y=fine)], {}, 10, clock)
    moved: list[int] = []
    expiry.check().addCallback(moved.append)
    assert moved == [1]
    assert len(fine.calls) == 1
