"""Topics: producers, publishing, deduplication, subscriptions and stats.

``PersistentTopic`` is one managed ledger. ``publish`` appends one entry (a message or a batch of
``num_messages``) and fires with the stored ``Entry`` once it is durable. Subscriptions are the
ledger's cursors; durable ones found in the ledger are loaded with the topic.

Producers register with an access mode (Pulsar's):

* Shared: any number, unless an exclusive producer holds the topic (``ProducerBusyError``).
* Exclusive: only if no other producer is connected (else ``ProducerFencedError``).
* WaitForExclusive: queued until the topic is free; ``Producer.ready`` fires then.
* ExclusiveWithFencing: closes every other producer (their ``on_disconnect`` runs) and takes
  the topic.

Each exclusive grant increments the topic epoch; a producer that comes back with an older
``topic_epoch`` was fenced and is refused with ``ProducerFencedError``.

Deduplication (Pulsar's model): per producer name the topic tracks the highest sequence id pushed
(appending) and persisted. A publish whose ``sequence_id`` is at or below the pushed one is a
duplicate: it is not appended, and its Deferred fires with None (once the earlier copy is
persisted, if that is still in flight). Recovery: every ``dedup_snapshot_interval`` entries (and
on a clean close) the persisted map and the position it covers are written to the metadata store
at ``/dedup/<managed ledger name>``, and the ``pulsar.dedup`` cursor is moved there so the entries
after it are kept; on load the topic reads the snapshot and replays the entries after it through
``EntryInspector.producer_sequence``.

``NonPersistentTopic`` keeps nothing: each message goes to the consumers connected right now.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import (
    Consumer,
    DeliverAt,
    EntryInspector,
    KeyOf,
    KeySharedMeta,
    LastMessageId,
    NullInspector,
    ServerConsumer,
    SubscriptionAPI,
    SubType,
)
from polybroker.broker_core.dispatcher import DispatchSettings
from polybroker.broker_core.errors import (
    ConsumerBusyError,
    NotAllowedError,
    PersistenceError,
    ProducerBusyError,
    ProducerClosedError,
    ProducerFencedError,
    SubscriptionNotFoundError,
    TopicBusyError,
    TopicClosedError,
    TopicFencedError,
    TopicTerminatedError,
)
from polybroker.broker_core.subscription import (
    NonPersistentSubscription,
    Subscription,
    log_failure,
)
from polybroker.ledger.api import (
    EARLIEST,
    Cursor,
    Entry,
    InitialPosition,
    ManagedLedger,
    ManagedLedgerClosedError,
    ManagedLedgerFencedError,
    ManagedLedgerTerminatedError,
    Position,
)
from polybroker.logs import kv
from polybroker.metadata.api import MetadataStore, NotFoundError

log = logging.getLogger(__name__)

DEDUP_CURSOR = "pulsar.dedup"
DEDUP_ROOT = "/dedup"
_REPLAY_BATCH = 100


class ProducerAccessMode(enum.Enum):
    """Producer access modes; values are Pulsar's wire numbers."""

    SHARED = 0
    EXCLUSIVE = 1
    WAIT_FOR_EXCLUSIVE = 2
    EXCLUSIVE_WITH_FENCING = 3


_ACCESS_MODE_NAMES = {
    ProducerAccessMode.SHARED: "Shared",
    ProducerAccessMode.EXCLUSIVE: "Exclusive",
    ProducerAccessMode.WAIT_FOR_EXCLUSIVE: "WaitForExclusive",
    ProducerAccessMode.EXCLUSIVE_WITH_FENCING: "ExclusiveWithFencing",
}


class TopicState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FENCED = "fenced"
    DELETED = "deleted"


class PublishItem(NamedTuple):
    """One entry of ``publish_many``: what ``publish`` takes for it."""

    data: bytes
    num_messages: int = 1
    sequence_id: int = -1
    highest_sequence_id: int = -1


@dataclass(frozen=True)
class TopicSettings:
    """Broker settings a topic uses (built from the broker config)."""

    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    dedup_enabled: bool = False  # brokerDeduplicationEnabled
    dedup_snapshot_interval: int = 1000  # brokerDeduplicationEntriesInterval


@dataclass(frozen=True)
class TopicLimits:
    """How many producers and consumers a topic takes (Pulsar's ``maxProducersPerTopic``,
    ``maxConsumersPerTopic`` and ``maxConsumersPerSubscription``; 0: no limit)."""

    max_producers: int = 0
    max_consumers: int = 0
    max_consumers_per_subscription: int = 0


NO_LIMITS = TopicLimits()


class Producer:
    """A registered producer. ``ready`` fires (with the producer) once it may publish: at once,
    or for WaitForExclusive when the topic becomes free; it fails if it is fenced or the topic
    closes first."""

    def __init__(
        self,
        topic: Topic,
        name: str,
        access_mode: ProducerAccessMode,
        *,
        producer_id: int,
        user_provided_name: bool,
        on_disconnect: Callable[[], None] | None,
        metadata: dict[str, str] | None,
        connected_since_ms: int,
    ) -> None:
        self.topic = topic
        self.name = name
        self.access_mode = access_mode
        self.producer_id = producer_id
        self.user_provided_name = user_provided_name
        self.on_disconnect = on_disconnect
        self.metadata = dict(metadata or {})
        self.connected_since_ms = connected_since_ms
        self.topic_epoch: int | None = None
        self.last_sequence_id = -1
        self.ready: Deferred[Producer] = Deferred()
        self.is_ready = False
        self.closed = False
        self.msg_in = 0
        self.bytes_in = 0
        self.msg_rate_in = 0.0
        self.msg_throughput_in = 0.0
        self._rate_base = (0, 0)

    def publish(
        self,
        data: bytes,
        num_messages: int = 1,
        *,
        sequence_id: int = -1,
        highest_sequence_id: int = -1,
        publish_time_ms: int | None = None,
    ) -> Deferred[Entry | None]:
        """``Topic.publish`` as this producer."""
        return self.topic.publish(
            data,
            num_messages,
            producer=self,
            sequence_id=sequence_id,
            highest_sequence_id=highest_sequence_id,
            publish_time_ms=publish_time_ms,
        )

    def publish_many(
        self, items: Sequence[PublishItem], *, publish_time_ms: int | None = None
    ) -> Deferred[list[Entry | None]]:
        """``Topic.publish_many`` as this producer."""
        return self.topic.publish_many(items, producer=self, publish_time_ms=publish_time_ms)

    def close(self) -> None:
        """Unregister (idempotent); a waiting exclusive producer may take the topic."""
        self.topic.remove_producer(self)

    def _grant(self) -> None:
        self.is_ready = True
        self.ready.callback(self)

    def update_rates(self, period_s: float) -> None:
        base_msgs, base_bytes = self._rate_base
        self.msg_rate_in = (self.msg_in - base_msgs) / period_s
        self.msg_throughput_in = (self.bytes_in - base_bytes) / period_s
        self._rate_base = (self.msg_in, self.bytes_in)

    def stats(self) -> dict[str, object]:
        """This producer's entry in Pulsar's topic stats ``publishers`` list."""
        return {
            "producerId": self.producer_id,
            "producerName": self.name,
            "accessMode": _ACCESS_MODE_NAMES[self.access_mode],
            "msgRateIn": self.msg_rate_in,
            "msgThroughputIn": self.msg_throughput_in,
            "averageMsgSize": self.bytes_in / self.msg_in if self.msg_in else 0.0,
            "msgInCounter": self.msg_in,
            "bytesInCounter": self.bytes_in,
            "connectedSince": self.connected_since_ms,
            "metadata": dict(self.metadata),
        }


def _now_ms(clock: IReactorTime) -> int:
    return int(clock.seconds() * 1000)


class Topic(abc.ABC):
    """What every topic offers handlers and the service."""

    persistent: ClassVar[bool]

    def __init__(
        self,
        name: str,
        clock: IReactorTime,
        *,
        partition_index: int = -1,
        producer_names: Callable[[], str] | None = None,
    ) -> None:
        self.name = name
        self.clock = clock
        self.partition_index = partition_index
        counter = itertools.count()
        self._producer_names = producer_names or (lambda: f"producer-{next(counter)}")
        self.producers: dict[str, Producer] = {}
        self._waiting: deque[Producer] = deque()
        self._exclusive: Producer | None = None
        self.topic_epoch = 0
        self.state = TopicState.OPEN
        self.msg_in = 0
        self.bytes_in = 0
        self.msg_rate_in = 0.0
        self.msg_throughput_in = 0.0
        self._rate_base = (0, 0)
        self._rates_at = clock.seconds()
        self.on_closed: Callable[[Topic], None] | None = None
        # Read at each new producer and consumer, so that a changed policy applies to the
        # next one (those already attached stay, as on Pulsar).
        self.limits: Callable[[], TopicLimits] = lambda: NO_LIMITS

    # -- producers ------------------------------------------------------------------------

    @property
    def terminated(self) -> bool:
        return False

    def _check_open(self) -> None:
        if self.state is TopicState.FENCED:
            raise TopicFencedError(f"topic {self.name} was fenced by another owner")
        if self.state is not TopicState.OPEN:
            raise TopicClosedError(f"topic {self.name} is {self.state.value}")

    def add_producer(
        self,
        name: str | None = None,
        access_mode: ProducerAccessMode = ProducerAccessMode.SHARED,
        *,
        producer_id: int = 0,
        topic_epoch: int | None = None,
        on_disconnect: Callable[[], None] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Producer:
        """Register a producer (see module docstring for access modes).

        Raises ``ProducerBusyError`` (name taken, exclusive holder), ``ProducerFencedError``,
        ``TopicTerminatedError`` or ``TopicClosedError``. The producer's ``last_sequence_id`` is
        the last persisted sequence id of that name when deduplication is on, else -1."""
        self._check_open()
        if self.terminated:
            raise TopicTerminatedError(f"topic {self.name} is terminated")
        user_provided = name is not None
        if name is None:
            name = self._producer_names()
        if name in self.producers or any(p.name == name for p in self._waiting):
            raise ProducerBusyError(f"producer {name!r} is already connected to {self.name}")
        limit = self.limits().max_producers
        if limit and len(self.producers) >= limit:
            raise ProducerBusyError("Topic reached max producers limit")
        exclusive_mode = access_mode is not ProducerAccessMode.SHARED
        if exclusive_mode and topic_epoch is not None and topic_epoch < self.topic_epoch:
            raise ProducerFencedError(
                f"topic epoch moved to {self.topic_epoch}; producer {name!r} is at {topic_epoch}"
            )
        producer = Producer(
            self,
            name,
            access_mode,
            producer_id=producer_id,
            user_provided_name=user_provided,
            on_disconnect=on_disconnect,
            metadata=metadata,
            connected_since_ms=_now_ms(self.clock),
        )
        producer.last_sequence_id = self._last_sequence_id(name)
        if access_mode is ProducerAccessMode.SHARED:
            if self._exclusive is not None or self._waiting:
                holder = self._exclusive.name if self._exclusive else self._waiting[0].name
                raise ProducerBusyError(f"topic {self.name} has an exclusive producer {holder!r}")
        elif access_mode is ProducerAccessMode.EXCLUSIVE:
            if self.producers:
                raise ProducerFencedError(f"topic {self.name} has other producers")
        elif access_mode is ProducerAccessMode.EXCLUSIVE_WITH_FENCING:
            self._fence_producers()
        elif self.producers:  # WAIT_FOR_EXCLUSIVE
            self._waiting.append(producer)
            return producer
        if exclusive_mode:
            self._make_exclusive(producer, topic_epoch)
        self.producers[name] = producer
        producer._grant()
        return producer

    def _make_exclusive(self, producer: Producer, topic_epoch: int | None) -> None:
        if topic_epoch is not None and topic_epoch >= self.topic_epoch and topic_epoch > 0:
            self.topic_epoch = topic_epoch
        else:
            self.topic_epoch += 1
        producer.topic_epoch = self.topic_epoch
        self._exclusive = producer

    def disconnect_producers(self) -> None:
        """Close every producer, telling its client (which may reconnect)."""
        for producer in list(self.producers.values()):
            self._drop_producer(producer, notify=True)

    def _fence_producers(self) -> None:
        self.disconnect_producers()
        while self._waiting:
            waiter = self._waiting.popleft()
            waiter.closed = True
            waiter.ready.errback(ProducerFencedError(f"fenced by a producer on {self.name}"))

    def _drop_producer(self, producer: Producer, *, notify: bool) -> None:
        producer.closed = True
        self.producers.pop(producer.name, None)
        if self._exclusive is producer:
            self._exclusive = None
        if notify and producer.on_disconnect is not None:
            try:
                producer.on_disconnect()
            except Exception:
                log.exception("producer failed on disconnect", extra=kv(producer=producer.name))

    def remove_producer(self, producer: Producer) -> None:
        """Unregister a producer; the first waiting exclusive producer may take the topic."""
        if producer.closed:
            return
        if producer in self._waiting:
            self._waiting.remove(producer)
            producer.closed = True
            producer.ready.errback(ProducerClosedError(f"producer {producer.name!r} closed"))
            return
        if self.producers.get(producer.name) is producer:
            self._drop_producer(producer, notify=False)
        self._promote_waiting()

    def _promote_waiting(self) -> None:
        if self.producers or not self._waiting or self.state is not TopicState.OPEN:
            return
        producer = self._waiting.popleft()
        self._make_exclusive(producer, None)
        self.producers[producer.name] = producer
        producer._grant()

    def _disconnect_producers(self, error: Exception) -> None:
        for producer in list(self.producers.values()):
            self._drop_producer(producer, notify=True)
        while self._waiting:
            waiter = self._waiting.popleft()
            waiter.closed = True
            waiter.ready.errback(error)

    def _last_sequence_id(self, producer_name: str) -> int:
        return -1

    # -- the rest of the API --------------------------------------------------------------

    @property
    @abc.abstractmethod
    def subscriptions(self) -> dict[str, Any]:
        """Subscriptions by name."""

    def _check_consumer_limits(self, subscription: str) -> None:
        """Raise ``ConsumerBusyError`` when the topic, or ``subscription``, already has as
        many consumers as its limits allow."""
        limits = self.limits()
        subs = self.subscriptions
        if limits.max_consumers and limits.max_consumers <= sum(
            len(s.consumers) for s in subs.values()
        ):
            raise ConsumerBusyError("Topic reached max consumers limit")
        sub = subs.get(subscription)
        cap = limits.max_consumers_per_subscription
        if cap and sub is not None and cap <= len(sub.consumers):
            raise ConsumerBusyError("Subscription reached max consumers limit")

    @abc.abstractmethod
    def publish(
        self,
        data: bytes,
        num_messages: int = 1,
        *,
        producer: Producer | None = None,
        sequence_id: int = -1,
        highest_sequence_id: int = -1,
        publish_time_ms: int | None = None,
    ) -> Deferred[Entry | None]:
        """Store one entry; fire with it once durable, or with None for a duplicate."""

    def publish_many(
        self,
        items: Sequence[PublishItem],
        *,
        producer: Producer | None = None,
        publish_time_ms: int | None = None,
    ) -> Deferred[list[Entry | None]]:
        """Store the entries in order, as ``publish`` calls would, with one completion: fire
        with their results (None for a duplicate) once all are durable, or fail with the first
        failure (entries before it may then be stored, as with separate publishes)."""
        ds = [
            self.publish(
                item.data,
                item.num_messages,
                producer=producer,
                sequence_id=item.sequence_id,
                highest_sequence_id=item.highest_sequence_id,
                publish_time_ms=publish_time_ms,
            )
            for item in items
        ]
        out: Deferred[list[Entry | None]] = gatherResults(ds, consumeErrors=True)
        return out.addErrback(lambda f: f.value.subFailure)

    @abc.abstractmethod
    def subscribe(
        self,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        *,
        initial_position: InitialPosition = InitialPosition.LATEST,
        durable: bool = True,
        start_position: Position | None = None,
        start_inclusive: bool = False,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Deferred[ServerConsumer]:
        """Attach a consumer to a subscription, creating it if needed."""

    @abc.abstractmethod
    def delete_subscription(self, name: str, force: bool = False) -> Deferred[None]:
        """Delete a subscription (``SubscriptionBusyError`` with consumers, unless forced)."""

    @abc.abstractmethod
    def last_message_id(self) -> Deferred[LastMessageId]:
        """The last message stored (entry id -1 when none)."""

    @abc.abstractmethod
    def terminate(self) -> Deferred[Position]:
        """Refuse further messages; fire with the last position."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Disconnect producers and consumers and release the topic (unload)."""

    @abc.abstractmethod
    def delete(self, force: bool = False) -> Deferred[None]:
        """Delete the topic and its data (``TopicBusyError`` if in use, unless forced)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, object]:
        """Pulsar-shaped topic stats."""

    @abc.abstractmethod
    def internal_stats(self) -> dict[str, object]:
        """Pulsar-shaped internal stats."""

    def subscription_gone(self, subscription: SubscriptionAPI) -> None:
        """A subscription deleted itself."""
        subs = self.subscriptions
        if subs.get(subscription.name) is subscription:
            del subs[subscription.name]

    def has_connections(self) -> bool:
        """Whether producers or consumers are connected."""
        if self.producers or self._waiting:
            return True
        return any(sub.consumers for sub in self.subscriptions.values())

    def update_rates(self) -> None:
        """Turn counters since the last call into the per-second rates stats report."""
        now = self.clock.seconds()
        period = now - self._rates_at
        if period <= 0:
            return
        self._rates_at = now
        base_msgs, base_bytes = self._rate_base
        self.msg_rate_in = (self.msg_in - base_msgs) / period
        self.msg_throughput_in = (self.bytes_in - base_bytes) / period
        self._rate_base = (self.msg_in, self.bytes_in)
        for producer in self.producers.values():
            producer.update_rates(period)
        for sub in self.subscriptions.values():
            sub.update_rates(period)

    def _base_stats(self) -> dict[str, object]:
        subs = {name: sub.stats() for name, sub in self.subscriptions.items()}

        def total(key: str) -> float:
            return sum(float(s[key]) for s in subs.values())  # type: ignore[arg-type]

        return {
            "msgRateIn": self.msg_rate_in,
            "msgThroughputIn": self.msg_throughput_in,
            "msgRateOut": total("msgRateOut"),
            "msgThroughputOut": total("msgThroughputOut"),
            "msgInCounter": self.msg_in,
            "bytesInCounter": self.bytes_in,
            "msgOutCounter": int(total("msgOutCounter")),
            "bytesOutCounter": int(total("bytesOutCounter")),
            "averageMsgSize": self.bytes_in / self.msg_in if self.msg_in else 0.0,
            "publishers": [p.stats() for p in self.producers.values()],
            "waitingPublishers": len(self._waiting),
            "subscriptions": subs,
            "replication": {},
            "topicEpoch": self.topic_epoch if self._exclusive is not None else None,
        }

    def _notify_closed(self) -> None:
        if self.on_closed is not None:
            self.on_closed(self)


class _Dedup:
    """Sequence ids per producer name; see the module docstring."""

    def __init__(self, cursor: Cursor | None) -> None:
        self.cursor = cursor
        self.pushed: dict[str, int] = {}
        self.persisted: dict[str, int] = {}
        self.waiters: dict[str, list[tuple[int, Deferred[Entry | None]]]] = {}
        self.since_snapshot = 0
        self.snapshotting = False

    def wait_for(self, name: str, sequence_id: int) -> Deferred[Entry | None]:
        d: Deferred[Entry | None] = Deferred()
        self.waiters.setdefault(name, []).append((sequence_id, d))
        return d

    def persisted_up_to(self, name: str, highest: int) -> None:
        if highest > self.persisted.get(name, -1):
            self.persisted[name] = highest
        waiters = self.waiters.get(name)
        if waiters:
            done = [w for w in waiters if w[0] <= self.persisted[name]]
            if done:
                self.waiters[name] = [w for w in waiters if w[0] > self.persisted[name]]
                for _, d in done:
                    d.callback(None)

    def failed(self, name: str, error: Exception) -> None:
        self.pushed[name] = self.persisted.get(name, -1)
        for _, d in self.waiters.pop(name, []):
            d.errback(error)


def _convert_storage_failure(failure: Failure, topic: str) -> Failure:
    if failure.check(ManagedLedgerTerminatedError):
        return Failure(TopicTerminatedError(f"topic {topic} is terminated"))
    if failure.check(ManagedLedgerFencedError):
        return Failure(TopicFencedError(f"topic {topic} was fenced by another owner"))
    if failure.check(ManagedLedgerClosedError):
        return Failure(TopicClosedError(f"topic {topic} is closed"))
    return Failure(PersistenceError(f"could not persist to {topic}: {failure.value}"))


class PersistentTopic(Topic):
    """A topic stored in one managed ledger (see module docstring)."""

    persistent = True

    def __init__(
        self,
        name: str,
        ledger: ManagedLedger,
        clock: IReactorTime,
        *,
        settings: TopicSettings | None = None,
        inspector: EntryInspector | None = None,
        metadata_store: MetadataStore | None = None,
        partition_index: int = -1,
        producer_names: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(
            name, clock, partition_index=partition_index, producer_names=producer_names
        )
        self.ledger = ledger
        self.settings = settings or TopicSettings()
        self.inspector: EntryInspector = inspector or NullInspector()
        self.metadata_store = metadata_store
        self._subscriptions: dict[str, Subscription] = {}
        self._opening: dict[str, list[Deferred[Subscription]]] = {}
        self._dedup: _Dedup | None = None
        self._last_entry: Entry | None = None
        self.pending_publishes = 0
        # Called with each entry once durable (e.g. to wake long-polling readers).
        self.append_listeners: list[Callable[[Entry], None]] = []

    @property
    def subscriptions(self) -> dict[str, Subscription]:  # type: ignore[override]
        return self._subscriptions

    @property
    def terminated(self) -> bool:
        return self.ledger.terminated

    @property
    def deduplication_enabled(self) -> bool:
        return self._dedup is not None

    def _default_key_of(self) -> KeyOf | None:
        return None if isinstance(self.inspector, NullInspector) else self.inspector.key_of

    def _default_deliver_at(self) -> DeliverAt | None:
        if isinstance(self.inspector, NullInspector):
            return None
        return self.inspector.deliver_at_ms

    # -- load -----------------------------------------------------------------------------

    def load(self) -> Deferred[PersistentTopic]:
        """Recover deduplication state and the durable subscriptions; fire with the topic."""
        return Deferred.fromCoroutine(self._load())

    async def _load(self) -> PersistentTopic:
        if self.settings.dedup_enabled:
            await self._enable_dedup()
        for name, cursor in list(self.ledger.cursors.items()):
            if name == DEDUP_CURSOR or not cursor.durable or name in self._subscriptions:
                continue
            self._subscriptions[name] = self._make_subscription(name, cursor, durable=True)
        return self

    def _make_subscription(self, name: str, cursor: Cursor, *, durable: bool) -> Subscription:
        return Subscription(
            self,
            name,
            cursor,
            durable=durable,
            settings=self.settings.dispatch,
            key_of=self._default_key_of(),
            deliver_at=self._default_deliver_at(),
        )

    # -- deduplication --------------------------------------------------------------------

    def _dedup_path(self) -> str:
        return f"{DEDUP_ROOT}/{self.ledger.name}"

    def set_deduplication(self, enabled: bool) -> Deferred[None]:
        """Turn deduplication on (recovering its state) or off (dropping it)."""
        if enabled:
            if self._dedup is not None:
                return succeed(None)
            return Deferred.fromCoroutine(self._enable_dedup())
        return Deferred.fromCoroutine(self._disable_dedup())

    async def _enable_dedup(self) -> None:
        cursor = await self.ledger.open_cursor(DEDUP_CURSOR, InitialPosition.LATEST)
        dedup = _Dedup(cursor)
        start = cursor.mark_delete_position
        if self.metadata_store is not None:
            found = await self.metadata_store.get(self._dedup_path())
            if found is not None:
                doc = json.loads(found.value)
                dedup.persisted = {str(k): int(v) for k, v in doc["producers"].items()}
                start = Position(int(doc["position"][0]), int(doc["position"][1]))
        if not isinstance(self.inspector, NullInspector):
            await self._replay_dedup(dedup, start)
        dedup.pushed = dict(dedup.persisted)
        self._dedup = dedup

    async def _replay_dedup(self, dedup: _Dedup, start: Position) -> None:
        reader = self.ledger.new_non_durable_cursor(start)
        try:
            while True:
                entries = await reader.read(_REPLAY_BATCH)
                if not entries:
                    break
                for entry in entries:
                    try:
                        found = self.inspector.producer_sequence(entry)
                    except Exception:
                        log.exception("sequence hook failed", extra=kv(topic=self.name))
                        found = None
                    if found is not None and found[1] > dedup.persisted.get(found[0], -1):
                        dedup.persisted[found[0]] = found[1]
                    dedup.since_snapshot += 1
        finally:
            await reader.close()

    async def _disable_dedup(self) -> None:
        self._dedup = None
        if DEDUP_CURSOR in self.ledger.cursors:
            await self.ledger.delete_cursor(DEDUP_CURSOR)
        await self._delete_dedup_snapshot()

    async def _delete_dedup_snapshot(self) -> None:
        if self.metadata_store is None:
            return
        with contextlib.suppress(NotFoundError):
            await self.metadata_store.delete(self._dedup_path())

    def _snapshot_dedup(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._write_dedup_snapshot())

    async def _write_dedup_snapshot(self) -> None:
        dedup = self._dedup
        last = self._last_entry
        if dedup is None or last is None or dedup.snapshotting:
            return
        dedup.snapshotting = True
        dedup.since_snapshot = 0
        position = last.position
        doc = {"position": [position.ledger_id, position.entry_id], "producers": dedup.persisted}
        try:
            if self.metadata_store is not None:
                await self.metadata_store.put(self._dedup_path(), json.dumps(doc).encode())
            # Only now may replay start here: entries before it are covered by the snapshot.
            if dedup.cursor is not None and self._dedup is dedup:
                await dedup.cursor.mark_delete(position)
        finally:
            dedup.snapshotting = False

    def _last_sequence_id(self, producer_name: str) -> int:
        if self._dedup is None:
            return -1
        return self._dedup.persisted.get(producer_name, -1)

    # -- publish --------------------------------------------------------------------------

    def publish(
        self,
        data: bytes,
        num_messages: int = 1,
        *,
        producer: Producer | None = None,
        sequence_id: int = -1,
        highest_sequence_id: int = -1,
        publish_time_ms: int | None = None,
    ) -> Deferred[Entry | None]:
        if self.state is not TopicState.OPEN:
            try:
                self._check_open()
            except Exception as e:
                return fail(e)
        if self.ledger.terminated:
            return fail(TopicTerminatedError(f"topic {self.name} is terminated"))
        if producer is not None and (producer.closed or not producer.is_ready):
            return fail(ProducerClosedError(f"producer {producer.name!r} may not publish"))
        dedup = self._dedup
        dedup_name: str | None = None
        highest = sequence_id
        if dedup is not None and producer is not None and sequence_id >= 0:
            dedup_name = producer.name
            if highest_sequence_id > highest:
                highest = highest_sequence_id
            if sequence_id <= dedup.pushed.get(dedup_name, -1):
                if sequence_id <= dedup.persisted.get(dedup_name, -1):
                    return succeed(None)
                return dedup.wait_for(dedup_name, sequence_id)
            dedup.pushed[dedup_name] = highest
        if publish_time_ms is None:
            publish_time_ms = int(self.clock.seconds() * 1000)
        self.pending_publishes += 1
        d: Deferred[Entry | None] = Deferred()
        # Callbacks, not the log's own Deferred: one Deferred per publish instead of two.
        self.ledger.append_then(
            data,
            self._appended,
            self._append_failed,
            (d, producer, dedup_name, highest),
            num_messages,
            publish_time_ms,
        )
        return d

    def _appended(self, entry: Entry, token: tuple[Any, ...]) -> None:
        d, producer, dedup_name, highest = token
        try:
            published = self._published(entry, producer, dedup_name, highest)
        except Exception:
            d.errback(Failure())
            return
        d.callback(published)

    def _append_failed(self, error: Exception, token: tuple[Any, ...]) -> None:
        d, _, dedup_name, _ = token
        d.errback(self._publish_failed(Failure(error), dedup_name))

    def publish_many(
        self,
        items: Sequence[PublishItem],
        *,
        producer: Producer | None = None,
        publish_time_ms: int | None = None,
    ) -> Deferred[list[Entry | None]]:
        if self._dedup is not None or self.state is not TopicState.OPEN or not items:
            # Sequence checks per entry (and the refusals) as single publishes make them.
            return super().publish_many(items, producer=producer, publish_time_ms=publish_time_ms)
        if self.ledger.terminated:
            return fail(TopicTerminatedError(f"topic {self.name} is terminated"))
        if producer is not None and (producer.closed or not producer.is_ready):
            return fail(ProducerClosedError(f"producer {producer.name!r} may not publish"))
        if publish_time_ms is None:
            publish_time_ms = int(self.clock.seconds() * 1000)
        count = len(items)
        self.pending_publishes += count
        d = self.ledger.append_many(
            [item.data for item in items], [item.num_messages for item in items], publish_time_ms
        )
        d.addCallbacks(
            self._published_many,
            self._publish_many_failed,
            callbackArgs=(producer,),
            errbackArgs=(count,),
        )
        return d  # type: ignore[return-value]

    def _published_many(
        self, entries: list[Entry], producer: Producer | None
    ) -> list[Entry | None]:
        if self.append_listeners or self._dedup is not None:
            published = self._published
            for entry in entries:
                published(entry, producer, None, -1)
            return entries  # type: ignore[return-value]
        # What ``_published`` does for each entry, with the counters updated once.
        messages = 0
        size = 0
        for entry in entries:
            messages += entry.num_messages
            size += len(entry.data)
        self.pending_publishes -= len(entries)
        self.msg_in += messages
        self.bytes_in += size
        if entries:
            self._last_entry = entries[-1]
        if producer is not None:
            producer.msg_in += messages
            producer.bytes_in += size
        return entries  # type: ignore[return-value]

    def _publish_many_failed(self, failure: Failure, count: int) -> Failure:
        self.pending_publishes -= count - 1  # ``_publish_failed`` takes the last one
        return self._publish_failed(failure, None)

    def _published(
        self, entry: Entry, producer: Producer | None, dedup_name: str | None, highest: int
    ) -> Entry:
        self.pending_publishes -= 1
        n = entry.num_messages
        size = len(entry.data)
        self.msg_in += n
        self.bytes_in += size
        self._last_entry = entry
        for listener in list(self.append_listeners):
            try:
                listener(entry)
            except Exception:
                log.exception("append listener failed", extra=kv(topic=self.name))
        if producer is not None:
            producer.msg_in += n
            producer.bytes_in += size
        dedup = self._dedup
        if dedup is not None:
            if dedup_name is not None:
                dedup.persisted_up_to(dedup_name, highest)
            dedup.since_snapshot += 1
            if dedup.since_snapshot >= self.settings.dedup_snapshot_interval:
                self._snapshot_dedup().addErrback(log_failure("deduplication snapshot"))
        return entry

    def _publish_failed(self, failure: Failure, dedup_name: str | None) -> Failure:
        self.pending_publishes -= 1
        converted = _convert_storage_failure(failure, self.name)
        if self._dedup is not None and dedup_name is not None:
            self._dedup.failed(dedup_name, converted.value)  # type: ignore[arg-type]
        if failure.check(ManagedLedgerFencedError) and self.state is TopicState.OPEN:
            log.warning("topic fenced by another owner; closing it", extra=kv(topic=self.name))
            self._shut(TopicState.FENCED)
            self._notify_closed()
        return converted

    # -- subscriptions --------------------------------------------------------------------

    def subscribe(
        self,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        *,
        initial_position: InitialPosition = InitialPosition.LATEST,
        durable: bool = True,
        start_position: Position | None = None,
        start_inclusive: bool = False,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Deferred[ServerConsumer]:
        """Attach ``consumer`` to ``subscription``, creating it if needed.

        A new durable subscription starts at ``initial_position``; an existing one where it
        is. A non-durable one (a reader) starts after ``start_position`` (or at it with
        ``start_inclusive``; a handler whose client filters, e.g. for a batch index, asks for
        inclusive), else at ``initial_position``. Fails with ``ConsumerBusyError``,
        ``ConsumerAssignError``, ``TopicClosedError``."""
        return Deferred.fromCoroutine(
            self._subscribe(
                subscription,
                consumer,
                sub_type,
                initial_position,
                durable,
                start_position,
                start_inclusive,
                key_shared,
                key_of,
                deliver_at,
                metadata,
            )
        )

    async def _subscribe(
        self,
        name: str,
        consumer: Consumer,
        sub_type: SubType,
        initial_position: InitialPosition,
        durable: bool,
        start_position: Position | None,
        start_inclusive: bool,
        key_shared: KeySharedMeta | None,
        key_of: KeyOf | None,
        deliver_at: DeliverAt | None,
        metadata: dict[str, str] | None,
    ) -> ServerConsumer:
        self._check_open()
        if not name or name == DEDUP_CURSOR:
            raise NotAllowedError(f"invalid subscription name {name!r}")
        self._check_consumer_limits(name)  # before a refused consumer creates a subscription
        sub = self._subscriptions.get(name)
        fresh = False
        if sub is None:
            if durable:
                sub = await self._open_durable(name, initial_position)
            else:
                start = self._reader_start(initial_position, start_position, start_inclusive)
                cursor = self.ledger.new_non_durable_cursor(start, name)
                sub = self._make_subscription(name, cursor, durable=False)
                self._subscriptions[name] = sub
                fresh = True
        self._check_open()
        try:
            self._check_consumer_limits(name)  # again: others may have attached meanwhile
            return sub.add_consumer(
                consumer,
                sub_type,
                key_shared=key_shared,
                key_of=key_of,
                deliver_at=deliver_at,
                metadata=metadata,
            )
        except Exception:
            if fresh and not sub.consumers:
                await sub.delete()
            raise

    def create_subscription(self, name: str, initial: InitialPosition) -> Deferred[Subscription]:
        """The durable subscription ``name``, created at ``initial`` if it does not exist yet
        (with no consumer: as a producer's initial subscription)."""

        async def create() -> Subscription:
            self._check_open()
            if not name or name == DEDUP_CURSOR:
                raise NotAllowedError(f"invalid subscription name {name!r}")
            sub = self._subscriptions.get(name)
            return sub if sub is not None else await self._open_durable(name, initial)

        return Deferred.fromCoroutine(create())

    def _reader_start(
        self, initial: InitialPosition, start: Position | None, inclusive: bool
    ) -> Position:
        last = self.ledger.last_confirmed
        if start is None:
            return EARLIEST if initial is InitialPosition.EARLIEST else last
        if start.ledger_id < 0:
            return EARLIEST
        if start > last:
            return last
        if inclusive:
            return Position(start.ledger_id, start.entry_id - 1)
        return start

    async def _open_durable(self, name: str, initial: InitialPosition) -> Subscription:
        waiters = self._opening.get(name)
        if waiters is not None:
            waiter: Deferred[Subscription] = Deferred()
            waiters.append(waiter)
            return await waiter
        waiters = self._opening[name] = []
        try:
            cursor = await self.ledger.open_cursor(name, initial)
        except Exception as e:
            for w in self._opening.pop(name):
                w.errback(e)
            raise
        sub = self._subscriptions.get(name)
        if sub is None:
            sub = self._make_subscription(name, cursor, durable=True)
            self._subscriptions[name] = sub
        for w in self._opening.pop(name):
            w.callback(sub)
        return sub

    def delete_subscription(self, name: str, force: bool = False) -> Deferred[None]:
        sub = self._subscriptions.get(name)
        if sub is None:
            return fail(SubscriptionNotFoundError(f"no subscription {name!r} on {self.name}"))
        return sub.delete(force)

    # -- queries --------------------------------------------------------------------------

    def last_message_id(self) -> Deferred[LastMessageId]:
        last = self.ledger.last_confirmed
        if last.entry_id < 0:
            return succeed(LastMessageId(last, 0))
        cached = self._last_entry
        if cached is not None and cached.position == last:
            return succeed(LastMessageId(last, cached.num_messages))

        def found(entries: list[Entry]) -> LastMessageId:
            return LastMessageId(last, entries[0].num_messages if entries else 1)

        return self.ledger.read(last, 1).addCallback(found)

    # -- message indexes (Kafka offsets) ---------------------------------------------------

    @property
    def next_index(self) -> int:
        """The index the next published message gets (the log end offset)."""
        return self.ledger.next_index

    @property
    def first_index(self) -> int:
        """The index of the first message still stored (the log start offset)."""
        return self.ledger.first_index

    def read_from_index(self, index: int, max_entries: int) -> Deferred[list[Entry]]:
        """Read up to ``max_entries`` entries from the one holding message ``index``; [] when
        ``index`` is at or past the end or before the first stored message."""
        if index < self.ledger.first_index or index >= self.ledger.next_index:
            return succeed([])

        def read(position: Position | None) -> Deferred[list[Entry]] | list[Entry]:
            if position is None:
                return []
            return self.ledger.read(position, max_entries)

        d = self.ledger.position_of_index(index)
        d.addCallback(read)
        return d  # type: ignore[return-value]

    def mark_subscription_at_index(self, name: str, index: int) -> Deferred[None]:
        """Open (creating it at the earliest message) the durable subscription ``name`` and move
        its mark-delete up to the last whole entry before message ``index`` (a committed Kafka
        offset shown as a Pulsar subscription, so its backlog appears in the stats). Never moves
        the mark-delete backwards."""
        return Deferred.fromCoroutine(self._mark_at_index(name, index))

    async def _mark_at_index(self, name: str, index: int) -> None:
        sub = await self._open_durable(name, InitialPosition.EARLIEST)
        last = min(index, self.ledger.next_index) - 1
        if last < self.ledger.first_index:
            return
        position = await self.ledger.position_of_index(last)
        if position is None:
            return
        entries = await self.ledger.read(position, 1)
        if entries and entries[0].last_index > last:  # ``index`` is inside this entry
            if entries[0].index - 1 < self.ledger.first_index:
                return
            position = await self.ledger.position_of_index(entries[0].index - 1)
            if position is None:
                return
        if sub.cursor.mark_delete_position < position:
            await sub.cursor.mark_delete(position)

    def entry_at(self, position: Position) -> Deferred[Entry | None]:
        """The stored entry at ``position``; None if the log holds none there (any more)."""

        def exact(entries: list[Entry]) -> Entry | None:
            return entries[0] if entries and entries[0].position == position else None

        if position.entry_id < 0:
            return succeed(None)
        return self.ledger.read(position, 1).addCallback(exact)

    def position_of_time(self, timestamp_ms: int) -> Deferred[Position | None]:
        """The first entry published at or after ``timestamp_ms``; None if there is none."""
        return self.ledger.position_of_time(timestamp_ms)

    def index_of_time(self, timestamp_ms: int) -> Deferred[int | None]:
        """The index of the first message of the first entry published at or after
        ``timestamp_ms``; None if there is none."""

        def index(position: Position | None) -> Deferred[int] | None:
            return None if position is None else self.ledger.index_of_position(position)

        d = self.ledger.position_of_time(timestamp_ms)
        d.addCallback(index)
        return d  # type: ignore[return-value]

    # -- lifecycle ------------------------------------------------------------------------

    def terminate(self) -> Deferred[Position]:
        try:
            self._check_open()
        except Exception as e:
            return fail(e)

        def terminated(position: Position) -> Position:
            for sub in list(self._subscriptions.values()):
                sub.on_terminated()
            return position

        d = self.ledger.terminate()
        d.addCallback(terminated)
        return d

    def _shut(self, state: TopicState) -> None:
        self.state = state
        self._disconnect_producers(TopicClosedError(f"topic {self.name} closed"))
        for sub in list(self._subscriptions.values()):
            sub.close()

    def close(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._close())

    async def _close(self) -> None:
        if self.state is TopicState.CLOSED or self.state is TopicState.DELETED:
            return
        fenced = self.state is TopicState.FENCED
        self._shut(TopicState.CLOSING)
        if self._dedup is not None and self._dedup.since_snapshot and not fenced:
            try:
                await self._snapshot_dedup()
            except Exception as e:
                log.warning("final deduplication snapshot failed", extra=kv(error=str(e)))
        try:
            await self.ledger.close()
        finally:
            self.state = TopicState.CLOSED

    def delete(self, force: bool = False) -> Deferred[None]:
        return Deferred.fromCoroutine(self._delete(force))

    async def _delete(self, force: bool) -> None:
        if self.state is TopicState.DELETED:
            return
        if self.has_connections() and not force:
            raise TopicBusyError(f"topic {self.name} has connected producers or consumers")
        self._shut(TopicState.CLOSING)
        self._dedup = None
        await self._delete_dedup_snapshot()
        await self.ledger.delete()
        self.state = TopicState.DELETED

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Pulsar's topic stats (``msgBacklog`` counts entries, as Pulsar's does)."""
        out = self._base_stats()
        size = self.ledger.size
        entries = self.ledger.entries
        backlog_entries = max(
            (s.cursor.backlog_entries() for s in self._subscriptions.values()), default=0
        )
        out["storageSize"] = size
        out["backlogSize"] = (size * backlog_entries // entries) if entries else 0
        out["offloadedStorageSize"] = 0
        out["deduplicationStatus"] = "Enabled" if self._dedup is not None else "Disabled"
        out["nonContiguousDeletedMessagesRanges"] = sum(
            len(s.cursor.individually_deleted()) for s in self._subscriptions.values()
        )
        out["isTerminated"] = self.terminated
        return out

    def internal_stats(self) -> dict[str, object]:
        """Pulsar's ``internalStats``: the ledgers and every cursor's positions."""
        ledger = self.ledger
        infos = list(ledger.ledgers)
        current = infos[-1] if infos else None
        cursors: dict[str, object] = {}
        for name, cursor in ledger.cursors.items():
            ranges = cursor.individually_deleted()
            sub = self._subscriptions.get(name)
            d = sub.dispatcher if sub is not None else None
            cursors[name] = {
                "markDeletePosition": str(cursor.mark_delete_position),
                "readPosition": str(cursor.read_position),
                "waitingReadOp": bool(d is not None and d.has_pending_read),
                "pendingReadOps": 1 if d is not None and d.has_pending_read else 0,
                "messagesConsumedCounter": d.msg_out if d is not None else 0,
                "individuallyDeletedMessages": "["
                + ", ".join(f"({Position(a.ledger_id, a.entry_id - 1)}..{b}]" for a, b in ranges)
                + "]",
                "totalNonContiguousDeletedMessagesRange": len(ranges),
                "state": "Open",
                "active": bool(sub is not None and sub.consumers),
                "numberOfEntriesSinceFirstNotAckedMessage": cursor.backlog_entries(),
                "subscriptionHavePendingRead": bool(d is not None and d.has_pending_read),
                "properties": {},
            }
        return {
            "entriesAddedCounter": ledger.entries,
            "numberOfEntries": ledger.entries,
            "totalSize": ledger.size,
            "currentLedgerEntries": current.entries if current else 0,
            "currentLedgerSize": current.size if current else 0,
            "pendingAddEntriesCount": self.pending_publishes,
            "lastConfirmedEntry": str(ledger.last_confirmed),
            "state": "Terminated" if ledger.terminated else "LedgerOpened",
            "ledgers": [
                {
                    "ledgerId": info.ledger_id,
                    "entries": info.entries,
                    "size": info.size,
                    "offloaded": False,
                    "underReplicated": False,
                }
                for info in infos
            ],
            "cursors": cursors,
        }


class NonPersistentTopic(Topic):
    """A topic kept nowhere: a message goes to the consumers connected when it is published."""

    persistent = False

    def __init__(
        self,
        name: str,
        clock: IReactorTime,
        *,
        inspector: EntryInspector | None = None,
        partition_index: int = -1,
        producer_names: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(
            name, clock, partition_index=partition_index, producer_names=producer_names
        )
        self.inspector: EntryInspector = inspector or NullInspector()
        self._subscriptions: dict[str, NonPersistentSubscription] = {}
        self._next_entry = 0
        self._next_index = 0
        self._terminated = False
        self._last: Entry | None = None

    @property
    def subscriptions(self) -> dict[str, NonPersistentSubscription]:  # type: ignore[override]
        return self._subscriptions

    @property
    def terminated(self) -> bool:
        return self._terminated

    def publish(
        self,
        data: bytes,
        num_messages: int = 1,
        *,
        producer: Producer | None = None,
        sequence_id: int = -1,
        highest_sequence_id: int = -1,
        publish_time_ms: int | None = None,
    ) -> Deferred[Entry | None]:
        try:
            self._check_open()
        except Exception as e:
            return fail(e)
        if self._terminated:
            return fail(TopicTerminatedError(f"topic {self.name} is terminated"))
        if producer is not None and (producer.closed or not producer.is_ready):
            return fail(ProducerClosedError(f"producer {producer.name!r} may not publish"))
        if publish_time_ms is None:
            publish_time_ms = int(self.clock.seconds() * 1000)
        entry = Entry(
            Position(0, self._next_entry), self._next_index, num_messages, publish_time_ms, data
        )
        self._next_entry += 1
        self._next_index += num_messages
        self._last = entry
        self.msg_in += num_messages
        self.bytes_in += len(data)
        if producer is not None:
            producer.msg_in += num_messages
            producer.bytes_in += len(data)
        for sub in list(self._subscriptions.values()):
            sub.deliver(entry)
        return succeed(entry)

    def subscribe(
        self,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        *,
        initial_position: InitialPosition = InitialPosition.LATEST,
        durable: bool = True,
        start_position: Position | None = None,
        start_inclusive: bool = False,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Deferred[ServerConsumer]:
        try:
            self._check_open()
            if not subscription:
                raise NotAllowedError("empty subscription name")
            self._check_consumer_limits(subscription)
            sub = self._subscriptions.get(subscription)
            if sub is None:
                default_key_of = (
                    None if isinstance(self.inspector, NullInspector) else self.inspector.key_of
                )
                sub = NonPersistentSubscription(self, subscription, default_key_of)
                self._subscriptions[subscription] = sub
            server = sub.add_consumer(
                consumer, sub_type, key_shared=key_shared, key_of=key_of, metadata=metadata
            )
        except Exception as e:
            sub = self._subscriptions.get(subscription)
            if sub is not None and not sub.consumers:
                sub._delete()
            return fail(e)
        return succeed(server)

    def delete_subscription(self, name: str, force: bool = False) -> Deferred[None]:
        sub = self._subscriptions.get(name)
        if sub is None:
            return fail(SubscriptionNotFoundError(f"no subscription {name!r} on {self.name}"))
        return sub.delete(force)

    def last_message_id(self) -> Deferred[LastMessageId]:
        last = self._last
        if last is None:
            return succeed(LastMessageId(Position(0, -1), 0))
        return succeed(LastMessageId(last.position, last.num_messages))

    def terminate(self) -> Deferred[Position]:
        self._terminated = True
        last = self._last
        return succeed(last.position if last is not None else Position(0, -1))

    def close(self) -> Deferred[None]:
        if self.state is TopicState.OPEN:
            self.state = TopicState.CLOSING
            self._disconnect_producers(TopicClosedError(f"topic {self.name} closed"))
            for sub in list(self._subscriptions.values()):
                sub.close()
            self.state = TopicState.CLOSED
        return succeed(None)

    def delete(self, force: bool = False) -> Deferred[None]:
        if self.has_connections() and not force:
            return fail(TopicBusyError(f"topic {self.name} has connected producers or consumers"))
        self.close()
        self._subscriptions.clear()
        self.state = TopicState.DELETED
        return succeed(None)

    def stats(self) -> dict[str, object]:
        out = self._base_stats()
        out["storageSize"] = 0
        out["backlogSize"] = 0
        out["msgDropRate"] = 0.0
        out["msgDropCounter"] = sum(s.msg_dropped for s in self._subscriptions.values())
        out["deduplicationStatus"] = "Disabled"
        return out

    def internal_stats(self) -> dict[str, object]:
        return {"entriesAddedCounter": self._next_entry, "ledgers": [], "cursors": {}}
