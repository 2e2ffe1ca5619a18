"""Unit tests of the broker-wide publish buffer."""

from __future__ import annotations

from polybroker.broker_core.publish_buffer import PublishBuffer


class Watcher:
    def __init__(self) -> None:
        self.told: list[bool] = []

    def publish_buffer_full(self, full: bool) -> None:
        self.told.append(full)


def test_full_past_the_limit_and_free_again_at_half() -> None:
    """Watchers are told once when the bytes pass the limit, and once when they fell to half."""
    buf = PublishBuffer(1000)
    a, b = Watcher(), Watcher()
    buf.watch(a)
    buf.watch(b)
    buf.watch(a)  # once however often
    buf.take(600, a)
    buf.take(400, b)
    assert (buf.full, a.told) == (False, [])  # at the limit is not past it
    buf.take(1, a)
    assert (buf.full, a.told, b.told) == (True, [True], [True])
    buf.take(500, b)
    buf.give(1000)
    assert a.told == [True]  # 501 left: more than half
    buf.give(1)
    assert (buf.full, buf.used, a.told, b.told) == (False, 500, [True, False], [True, False])


def test_a_watcher_added_while_full_is_told_at_once_and_unwatch_stops_telling() -> None:
    buf = PublishBuffer(10)
    buf.take(11, Watcher())
    late = Watcher()
    buf.watch(late)
    assert late.told == [True]
    buf.unwatch(late)
    buf.give(11)
    assert late.told == [True]
    assert not buf.full


def test_no_limit_is_never_full() -> None:
    buf = PublishBuffer(0)
    w = Watcher()
    buf.watch(w)
    buf.take(1 << 40, w)
    assert (buf.full, w.told) == (False, [])


def test_a_publisher_watches_from_its_first_take() -> None:
    buf = PublishBuffer(10)
    publisher = Watcher()
    buf.take(5, publisher)
    buf.take(6, publisher)
    assert publisher.told == [True]
    buf.give(11)
    assert publisher.told == [True, False]
