"""A check a broker runs over its topics every so often (message TTL, backlog quotas).

Rule 1: ``start`` runs ``_check`` every ``interval_s`` on the injected clock (never when that is
        0 or less); one check runs at a time: a check still running when the next is due skips
        it. ``check`` runs one at once; ``checks`` counts those completed.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall


class PeriodicCheck:
    """Subclasses write ``_check`` (a coroutine); see the module docstring."""

    def __init__(self, clock: IReactorTime, interval_s: float) -> None:
        self._clock = clock
        self.interval_s = interval_s
        self._loop = LoopingCall(self._due)
        self._loop.clock = clock
        self._running = False
        self.checks = 0

    def start(self) -> None:
        if self.interval_s > 0 and not self._loop.running:
            self._loop.start(self.interval_s, now=False)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def _due(self) -> None:
        if not self._running:
            self.check()

    def check(self) -> Deferred[Any]:
        """Run one check now; fire with what it returns."""
        self._running = True

        def done(result: object) -> object:
            self._running = False
            self.checks += 1
            return result

        return Deferred.fromCoroutine(self._check()).addBoth(done)

    async def _check(self) -> Any:
        raise NotImplementedError
