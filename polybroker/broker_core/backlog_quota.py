"""Backlog quotas: how much a namespace's topics may keep unacknowledged, as Pulsar's.

A quota limits the slowest durable subscription of a topic by size (``destination_storage``:
bytes from its mark-delete position to the end of the log, estimated from the ledgers' sizes as
Pulsar does) and by age (``message_age``: the publish time of the first entry after its
mark-delete position). Each limit is the namespace's ``backlog_quota_map`` entry, else the
broker's ``backlogQuotaDefaultLimitBytes`` / ``backlogQuotaDefaultLimitSecond`` (-1: none) with
``backlogQuotaDefaultRetentionPolicy``. Its policy says what happens to a topic over it:

Rule 1: ``producer_request_hold`` and ``producer_exception``: a new producer is refused
        (``ProducerBlockedQuotaExceededError`` / ``...Exception``, Pulsar's errors: a Pulsar
        client holds its messages and retries for the first, fails them for the second), and
        every check disconnects the topic's producers, which then reconnect into that refusal.
        Size is judged when the producer comes, age by the last check.
Rule 2: ``consumer_backlog_eviction``: every check moves the mark-delete position of each
        subscription over the limit forward until it is within it (the oldest entries are
        acknowledged for it); consumers stay connected.
Rule 3: the checks run every ``interval_s`` on the injected clock, one at a time, over the
        loaded persistent topics. Producers that publish through other protocols (Kafka, MQTT,
        AMQP) are not Pulsar producers and are not held back; eviction applies to every
        subscription.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime

from polybroker.broker_core.errors import BrokerError
from polybroker.broker_core.periodic import PeriodicCheck
from polybroker.ledger.api import LedgerInfo, Position
from polybroker.logs import kv

log = logging.getLogger(__name__)

HOLD = "producer_request_hold"
EXCEPTION = "producer_exception"
EVICTION = "consumer_backlog_eviction"
POLICIES = (HOLD, EXCEPTION, EVICTION)
SIZE = "destination_storage"
AGE = "message_age"
QUOTA_TYPES = (SIZE, AGE)


class ProducerBlockedQuotaExceededError(BrokerError):
    """The topic is over its backlog quota and holds producers (``producer_request_hold``)."""

    pulsar_error = "ProducerBlockedQuotaExceededError"


class ProducerBlockedQuotaExceededException(BrokerError):
    """The topic is over its backlog quota and fails producers (``producer_exception``)."""

    pulsar_error = "ProducerBlockedQuotaExceededException"


@dataclass(frozen=True)
class Limit:
    """One limit of a quota: bytes (``destination_storage``) or seconds (``message_age``)."""

    value: int
    policy: str


def valid_quota(value: Any) -> bool:
    """Whether ``value`` is a BacklogQuota JSON Pulsar's admin API accepts."""
    if not isinstance(value, dict) or value.get("policy") not in POLICIES:
        return False
    return all(
        isinstance(value.get(k, -1), int) and not isinstance(value.get(k, -1), bool)
        for k in ("limitSize", "limitTime")
    )


def backlog_bytes(ledgers: Sequence[LedgerInfo], mark_delete: Position) -> int:
    """The bytes of the entries after ``mark_delete``: whole ledgers after its ledger, and the
    share of its ledger's size its remaining entries make (Pulsar's estimate)."""
    total = 0
    for info in ledgers:
        if info.ledger_id > mark_delete.ledger_id:
            total += info.size
        elif info.ledger_id == mark_delete.ledger_id and info.entries > 0:
            left = info.entries - (mark_delete.entry_id + 1)
            total += info.size * max(0, left) // info.entries
    return total


def eviction_target(
    ledgers: Sequence[LedgerInfo], mark_delete: Position, limit: int
) -> Position | None:
    """The position to mark-delete up to so that at most ``limit`` bytes stay after it (by the
    same estimate); None when they already do."""
    if backlog_bytes(ledgers, mark_delete) <= limit:
        return None
    kept = 0
    for info in reversed(ledgers):
        if info.entries <= 0 or info.ledger_id < mark_delete.ledger_id:
            continue
        if kept + info.size <= limit:
            kept += info.size
            continue
        per_entry = info.size / info.entries
        keep_entries = int((limit - kept) // per_entry) if per_entry else info.entries
        return Position(info.ledger_id, info.entries - keep_entries - 1)
    return None


class BacklogQuotas(PeriodicCheck):
    """Judges and enforces the backlog quotas of one broker's topics (module docstring)."""

    def __init__(
        self,
        topics: Callable[[], Iterable[Any]],
        quota_of: Callable[[str], dict[str, Any] | None],
        defaults: tuple[int, int, str],
        clock: IReactorTime,
        interval_s: float,
    ) -> None:
        super().__init__(clock, interval_s)
        self._topics = topics
        self._quota_of = quota_of
        self._default_bytes, self._default_s, self._default_policy = defaults
        self._too_old: set[str] = set()  # topics over their age limit at the last check

    def limits(self, topic: str) -> tuple[Limit | None, Limit | None]:
        """A topic's (size, age) limits; None where it has none."""
        chosen = self._quota_of(topic) or {}
        return (
            self._limit(chosen.get(SIZE), "limitSize", self._default_bytes),
            self._limit(chosen.get(AGE), "limitTime", self._default_s),
        )

    def _limit(self, quota: Any, key: str, default: int) -> Limit | None:
        if valid_quota(quota):
            value, policy = quota.get(key, -1), quota["policy"]
        else:
            value, policy = default, self._default_policy
        return Limit(value, policy) if value >= 0 else None

    def producer_refusal(self, topic: Any) -> BrokerError | None:
        """The error a new producer on ``topic`` gets now (Rule 1); None: it may come."""
        size, age = self.limits(topic.name)
        over = None
        if (
            size is not None
            and size.policy != EVICTION
            and self._largest_backlog(topic) > size.value
        ):
            over = size
        elif age is not None and age.policy != EVICTION and topic.name in self._too_old:
            over = age
        if over is None:
            return None
        kind = (
            ProducerBlockedQuotaExceededError
            if over.policy == HOLD
            else ProducerBlockedQuotaExceededException
        )
        return kind("Cannot create producer on topic with backlog quota exceeded")

    @staticmethod
    def _durable(topic: Any) -> list[Any]:
        return [
            s for s in topic.subscriptions.values() if getattr(s, "durable", False) and not s.closed
        ]

    def _largest_backlog(self, topic: Any) -> int:
        ledgers = topic.ledger.ledgers
        return max(
            (backlog_bytes(ledgers, s.cursor.mark_delete_position) for s in self._durable(topic)),
            default=0,
        )

    async def _check(self) -> None:
        now_ms = int(self._clock.seconds() * 1000)
        too_old: set[str] = set()
        for topic in list(self._topics()):
            if not getattr(topic, "persistent", False):
                continue
            try:
                if await self._check_topic(topic, now_ms):
                    too_old.add(topic.name)
            except Exception as e:
                log.warning("backlog quota check failed", extra=kv(topic=topic.name, error=str(e)))
        self._too_old = too_old

    async def _check_topic(self, topic: Any, now_ms: int) -> bool:
        """Enforce a topic's limits; return whether it is over its age limit (not evicting)."""
        size, age = self.limits(topic.name)
        over_size = size is not None and self._largest_backlog(topic) > size.value
        if over_size and size is not None and size.policy == EVICTION:
            for sub in self._durable(topic):
                target = eviction_target(
                    topic.ledger.ledgers, sub.cursor.mark_delete_position, size.value
                )
                if target is not None:
                    log.info(
                        "backlog evicted",
                        extra=kv(topic=topic.name, subscription=sub.name, to=str(target)),
                    )
                    await sub.acknowledge_up_to(target)
            over_size = False
        over_age = False
        if age is not None:
            cutoff = now_ms - age.value * 1000
            if age.policy == EVICTION:
                for sub in self._durable(topic):
                    await sub.expire_before(cutoff)
            else:
                over_age = await self._oldest_before(topic, cutoff)
        if over_size or over_age:
            topic.disconnect_producers()
        return over_age

    async def _oldest_before(self, topic: Any, cutoff_ms: int) -> bool:
        """Whether the first entry after some durable subscription's mark-delete position was
        published before ``cutoff_ms``."""
        for sub in self._durable(topic):
            md = sub.cursor.mark_delete_position
            entries = await topic.ledger.read(Position(md.ledger_id, md.entry_id + 1), 1)
            if entries and entries[0].publish_time_ms < cutoff_ms:
                return True
        return False
