"""Unit tests of the broker-wide publish buffer."""

from __future__ import annotations

from polybroker.broker_core.publish_buffer import PendingPublishes, PublishBuffer


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


def test_a_connections_bound_holds_past_count_or_bytes_and_lifts_at_half_of_both() -> None:
    """One connection's publishes: held past 4 publishes or 100 bytes, lifted once both fell to
    half; every byte also counted in the broker-wide buffer, and given back after close."""
    buf = PublishBuffer(0)
    conn = Watcher()
    holds: list[bool] = []
    pending = PendingPublishes(buf, conn, holds.append, 4, 100)
    for _ in range(4):
        pending.take(10)
    assert (holds, buf.used) == ([], 40)  # at the bound is not past it
    pending.take(10)
    assert (holds, pending.held) == ([True], True)
    pending.take(10)
    assert holds == [True]  # told once
    assert pending.give(30, 3) is False  # 3 left: more than half of 4
    assert pending.give(10) is True
    assert (holds, pending.count, pending.size, buf.used) == ([True, False], 2, 20, 20)
    pending.take(90)  # 3 publishes, but 110 bytes
    assert holds == [True, False, True]
    assert pending.give(90) is True  # 2 publishes, 20 bytes
    pending.close()
    pending.give(20, 2)
    assert (buf.used, conn.told) == (0, [])
