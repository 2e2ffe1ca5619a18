"""A line of forwarded publishes to one topic, kept in call order across failovers.

A handler that forwards (``BrokerService.publish(..., forward=True)``) sends each message on
as it comes, without waiting for the one before; where the topic is served (here or at its
owner) may change between two messages, and a call refused on the way must be sent again.

Rule 1: publishes are dispatched (handed to their target: the topic loaded here or its owner) in
        call order, each after the one before it; their completions run concurrently.
Rule 2: a publish refused with an error a new lookup may cure (``ServiceNotReadyError``) stalls
        the line: nothing more is dispatched until every dispatched publish has settled; then,
        after a backoff, the target is looked up again and the refused publishes are dispatched
        again, in call order, ahead of those that waited. What was stored stays stored: an owner
        refuses what follows a publish it refused (its topic closed or moved), so the order
        holds.
Rule 3: a publish is retried until its deadline; one that would be retried past it fails with
        the error it met. Other errors fail only the publish that met them, lookup errors too.
Rule 4: the backoff starts at ``FIRST_BACKOFF_S``, doubles with each stall up to
        ``MAX_BACKOFF_S``, and starts again once a publish was stored.
Rule 5: ``on_idle`` is called when nothing waits, is dispatched or is to be retried: the
        line holds nothing then and may be dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.logs import kv

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0

#: Sends one publish to a target; fires with what the caller gets.
Send = Callable[[Any], Deferred[Any]]


class _Publish:
    __slots__ = ("deadline", "result", "send", "seq")

    def __init__(self, seq: int, send: Send, deadline: float) -> None:
        self.seq = seq
        self.send = send
        self.deadline = deadline
        self.result: Deferred[Any] = Deferred()


class PublishLine:
    """The forwarded publishes of one topic not settled yet (module docstring).

    ``known`` answers the target without a round trip, or None; ``look_up`` finds it (and may
    fail); ``forget`` drops what ``known`` remembers, after a refusal."""

    def __init__(
        self,
        clock: IReactorTime,
        name: str,
        known: Callable[[], Any],
        look_up: Callable[[], Deferred[Any]],
        forget: Callable[[], None],
        on_idle: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._name = name
        self._known = known
        self._look_up = look_up
        self._forget = forget
        self._on_idle = on_idle
        self._seq = 0
        self._waiting: list[_Publish] = []  # to dispatch, in call order
        self._refused: list[_Publish] = []  # to dispatch again after the backoff (Rule 2)
        self._in_flight = 0
        self._looking = False
        self._stalled = False
        self._resume_call: Any = None
        self._backoff = FIRST_BACKOFF_S
        self._closed = False

    def publish(self, send: Send, retry_s: float) -> Deferred[Any]:
        """Queue one publish; ``send(target)`` dispatches it. Fires with what ``send`` fired,
        or the error that ended it (Rule 3)."""
        self._seq += 1
        p = _Publish(self._seq, send, self._clock.seconds() + retry_s)
        self._waiting.append(p)
        self._pump()
        return p.result

    def close(self, error: Exception) -> None:
        """Fail what waits or is to be retried with ``error``; what was dispatched settles."""
        self._closed = True
        if self._resume_call is not None and self._resume_call.active():
            self._resume_call.cancel()
        self._resume_call = None
        left, self._waiting, self._refused = self._waiting + self._refused, [], []
        for p in sorted(left, key=lambda p: p.seq):
            p.result.errback(error)
        self._check_idle()

    def _pump(self) -> None:
        while self._waiting and not (self._looking or self._stalled or self._closed):
            target = self._known()
            if target is None:
                self._looking = True
                maybeDeferred(self._look_up).addBoth(self._looked_up)
                return
            p = self._waiting.pop(0)
            self._in_flight += 1
            maybeDeferred(p.send, target).addBoth(self._settled, p)
        self._check_idle()

    def _looked_up(self, result: Any) -> None:
        self._looking = False
        if isinstance(result, Failure) and self._waiting:
            p = self._waiting.pop(0)
            if not self._retry(p, result):
                p.result.errback(result)
        self._pump()

    def _settled(self, result: Any, p: _Publish) -> None:
        self._in_flight -= 1
        if isinstance(result, Failure):
            if not self._retry(p, result):
                p.result.errback(result)
        else:
            self._backoff = FIRST_BACKOFF_S
            p.result.callback(result)
        if self._stalled and self._in_flight == 0 and self._resume_call is None:
            self._resume_call = self._clock.callLater(self._backoff, self._resume)
        self._check_idle()

    def _retry(self, p: _Publish, failure: Failure) -> bool:
        """Keep ``p`` to be dispatched again if its error may be cured in time (Rules 2, 3)."""
        if not failure.check(ServiceNotReadyError) or self._closed:
            return False
        if self._clock.seconds() + self._backoff > p.deadline:
            return False
        self._forget()
        if not self._stalled:
            self._stalled = True
            if self._backoff == FIRST_BACKOFF_S:  # once per failover, not once per retry
                log.info(
                    "forwarded publishes retried",
                    extra=kv(topic=self._name, error=failure.getErrorMessage()),
                )
        self._refused.append(p)
        if self._in_flight == 0 and self._resume_call is None:
            self._resume_call = self._clock.callLater(self._backoff, self._resume)
        return True

    def _resume(self) -> None:
        self._resume_call = None
        self._stalled = False
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
        self._waiting = sorted(self._refused, key=lambda p: p.seq) + self._waiting
        self._refused = []
        self._pump()

    def _check_idle(self) -> None:
        busy = self._waiting or self._refused or self._in_flight or self._looking
        if not busy and self._resume_call is None:
            self._on_idle()
