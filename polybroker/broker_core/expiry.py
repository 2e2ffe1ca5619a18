"""Message TTL: messages older than their namespace's TTL are acknowledged on every
subscription, as Pulsar's expiry monitor does.

Every ``interval_s`` (on the injected clock) each loaded persistent topic whose TTL is set (the
namespace's ``message_ttl_in_seconds``, else the broker's ``ttlDurationDefaultInSeconds``; 0 or
less: none) has each of its subscriptions moved past the entries published more than the TTL
ago (``Subscription.expire_before``): a mark-delete only moves forward, consumers stay
connected. One check runs at a time; a check still running when the next is due skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from twisted.internet.interfaces import IReactorTime

from polybroker.broker_core.periodic import PeriodicCheck
from polybroker.logs import kv

log = logging.getLogger(__name__)


class MessageExpiry(PeriodicCheck):
    """Runs the TTL checks of one broker (see the module docstring); ``check`` fires with how
    many subscriptions moved."""

    def __init__(
        self,
        topics: Callable[[], Iterable[Any]],
        ttl_of: Callable[[str], int | None],
        default_ttl_s: int,
        clock: IReactorTime,
        interval_s: float,
    ) -> None:
        super().__init__(clock, interval_s)
        self._topics = topics
        self._ttl_of = ttl_of
        self._default_ttl_s = default_ttl_s

    def ttl_s(self, topic: str) -> int:
        """The TTL of a topic in seconds (0: none)."""
        chosen = self._ttl_of(topic)
        return self._default_ttl_s if chosen is None else chosen

    async def _check(self) -> int:
        moved = 0
        now_ms = int(self._clock.seconds() * 1000)
        for topic in list(self._topics()):
            ttl = self.ttl_s(topic.name)
            if ttl <= 0:
                continue
            for name, sub in list(topic.subscriptions.items()):
                if not hasattr(sub, "expire_before") or sub.closed:
                    continue  # a non-persistent topic keeps nothing to expire
                try:
                    moved += bool(await sub.expire_before(now_ms - ttl * 1000))
                except Exception as e:
                    log.warning(
                        "message expiry failed",
                        extra=kv(topic=topic.name, subscription=name, error=str(e)),
                    )
        return moved
