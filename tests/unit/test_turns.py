"""End-of-turn calls: one pass per turn over every part on a clock, in order, bounded."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from twisted.internet.task import Clock

from polybroker import turns
from polybroker.turns import at_turn_end


def test_the_calls_of_one_turn_run_in_one_pass_in_order() -> None:
    """Calls asked for in one turn share one delayed call and run in the order asked."""
    clock = Clock()
    ran: list[int] = []
    at_turn_end(clock, ran.append, 1)
    at_turn_end(clock, ran.append, 2)
    assert (ran, len(clock.getDelayedCalls())) == ([], 1)
    clock.advance(0)
    assert (ran, clock.getDelayedCalls()) == ([1, 2], [])


def test_a_call_asked_for_during_the_pass_runs_in_it_without_another_turn() -> None:
    """A flush that makes a bookie ask for its own end-of-turn hand-off: both run in one pass,
    with no delayed call left for a later turn in between."""
    clock = Clock()
    ran: list[str] = []
    pending_then: list[int] = []

    def submit() -> None:
        ran.append("submit")

    def flush() -> None:
        ran.append("flush")
        at_turn_end(clock, submit)
        pending_then.append(len(clock.getDelayedCalls()))

    at_turn_end(clock, flush)
    clock.advance(0)
    assert (ran, pending_then, clock.getDelayedCalls()) == (["flush", "submit"], [0], [])


def test_a_cancelled_call_does_not_run() -> None:
    """``cancel`` keeps a queued call from running; ``active`` says so."""
    clock = Clock()
    ran: list[int] = []
    call = at_turn_end(clock, ran.append, 1)
    at_turn_end(clock, ran.append, 2)
    assert call.active()
    call.cancel()
    assert not call.active()
    clock.advance(0)
    assert ran == [2]


def test_a_failing_call_is_logged_and_the_rest_run(caplog: pytest.LogCaptureFixture) -> None:
    """One call's exception does not keep the others of its pass from running."""
    clock = Clock()
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("boom")

    at_turn_end(clock, boom)
    at_turn_end(clock, ran.append, 1)
    with caplog.at_level(logging.ERROR, logger="polybroker.turns"):
        clock.advance(0)
    assert ran == [1]
    assert "end-of-turn call failed" in caplog.text
    assert at_turn_end(clock, ran.append, 2).active()
    clock.advance(0)
    assert ran == [1, 2]


def test_calls_that_keep_asking_for_more_yield_to_the_reactor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass runs what was queued at its start and at most PASS_EXTRA more; the rest go to
    passes of later turns."""
    monkeypatch.setattr(turns, "PASS_EXTRA", 3)
    clock = Clock()
    passes: list[float] = []
    call_later = clock.callLater

    def counted(delay: float, f: Any, *args: Any) -> Any:
        passes.append(delay)
        return call_later(delay, f, *args)

    monkeypatch.setattr(clock, "callLater", counted)
    ran: list[int] = []

    def again() -> None:
        ran.append(len(ran))
        if len(ran) < 10:
            at_turn_end(clock, again)

    at_turn_end(clock, again)
    clock.advance(0)
    assert ran == list(range(10))
    assert passes == [0, 0, 0]  # 4 calls, 4 calls, then the last 2


def test_each_clock_has_its_own_passes() -> None:
    """Calls on one clock never run on another's turn."""
    a, b = Clock(), Clock()
    ran: list[str] = []
    at_turn_end(a, ran.append, "a")
    at_turn_end(b, ran.append, "b")
    b.advance(0)
    assert ran == ["b"]
    a.advance(0)
    assert ran == ["b", "a"]


def test_a_queue_does_not_keep_its_clock_alive() -> None:
    """The per-clock queue holds its clock weakly, so a clock that is dropped is collected."""
    import gc
    import weakref

    clock = Clock()
    at_turn_end(clock, lambda: None)
    clock.advance(0)
    gone = weakref.ref(clock)
    del clock
    gc.collect()
    assert gone() is None


def test_an_exception_no_call_catches_leaves_the_rest_for_the_next_pass() -> None:
    """A BaseException out of one call ends its pass, and what is still queued runs on the next
    one rather than never."""
    clock = Clock()
    ran: list[int] = []

    def stop() -> None:
        raise KeyboardInterrupt

    at_turn_end(clock, stop)
    at_turn_end(clock, ran.append, 1)
    with pytest.raises(KeyboardInterrupt):
        clock.advance(0)
    assert ran == []
    clock.advance(0)
    assert ran == [1]
