"""Calls for the end of the reactor turn, run together in one pass.

Rule 1: ``at_turn_end(clock, fn)`` runs ``fn()`` once the work under way is done: at the
        clock's next zero-delay call, with every other call asked for meanwhile on that clock,
        in the order asked, in one pass. A call asked for during the pass runs in that pass
        too, after those queued before it. Two zero-delay calls of their own would take two
        reactor turns (each an epoll call and the timer heap's work): a ledger client's
        batched flush hands its frames to a bookie in the same process, whose hand-off to the
        journal waits for the end of the turn; in one pass, a lone add takes one turn, not two.
Rule 2: a pass runs the calls queued when it began and at most ``PASS_EXTRA`` asked for during
        it; the rest wait for the next turn, so calls that keep asking for more cannot hold the
        reactor.
Rule 3: an exception raised by one call is logged; the others still run.
Rule 4: one queue per clock (a weak map: a clock that is gone takes its queue with it), so
        every part that runs on one reactor shares its passes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary, ref

from polybroker.logs import kv

log = logging.getLogger(__name__)

#: Calls asked for during a pass that still run in it (Rule 2).
PASS_EXTRA = 1024


class TurnEndCall:
    """A call queued for the end of the turn; ``cancel`` keeps it from running."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args

    def active(self) -> bool:
        """Whether it has yet to run and was not cancelled."""
        return self.fn is not None

    def cancel(self) -> None:
        self.fn = None
        self.args = ()


class _TurnEnd:
    """The queue of one clock (Rule 4). It holds its clock weakly: the map's value must not
    keep the map's key alive."""

    __slots__ = ("__weakref__", "calls", "clock", "scheduled")

    def __init__(self, clock: Any) -> None:
        self.clock = ref(clock)
        self.calls: deque[TurnEndCall] = deque()
        self.scheduled = False

    def add(self, call: TurnEndCall) -> None:
        self.calls.append(call)
        if not self.scheduled:
            self._schedule()

    def _schedule(self) -> None:
        clock = self.clock()
        self.scheduled = clock is not None
        if clock is not None:
            clock.callLater(0, self.run)

    def run(self) -> None:
        calls = self.calls
        budget = len(calls) + PASS_EXTRA
        try:
            while calls and budget > 0:
                budget -= 1
                call = calls.popleft()
                fn, args = call.fn, call.args
                if fn is None:
                    continue
                call.fn = None
                call.args = ()
                try:
                    fn(*args)
                except Exception:
                    log.exception("end-of-turn call failed", extra=kv(call=repr(fn)))
        finally:
            # Even past an exception no call catches, what is queued still gets a pass.
            if calls:
                self._schedule()
            else:
                self.scheduled = False


_queues: WeakKeyDictionary[Any, _TurnEnd] = WeakKeyDictionary()


def at_turn_end(clock: Any, fn: Callable[..., Any], *args: Any) -> TurnEndCall:
    """Run ``fn(*args)`` at the end of the current turn of ``clock`` (Rules 1-3)."""
    queue = _queues.get(clock)
    if queue is None:
        queue = _queues[clock] = _TurnEnd(clock)
    call = TurnEndCall(fn, args)
    queue.add(call)
    return call
