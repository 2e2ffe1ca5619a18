"""Subscriptions: a named cursor plus the dispatcher of its type, and their lifecycle.

``Subscription`` (persistent topics) owns one ``Cursor`` (durable or not) and one ``Dispatcher``.
Its type is the type of its connected consumers: a consumer of another type is refused with
``ConsumerBusyError`` while any is connected; once all left, the next consumer may change it.

Acks go to the cursor first, then the dispatcher forgets the positions. Batch-index acks are
kept in memory until every message of the entry is acknowledged (the cursor stores whole
entries only), so after a broker restart a partly acknowledged batch comes again whole.

A seek resets the cursor and disconnects every consumer through ``Consumer.disconnect`` (the
client subscribes again), as Pulsar does. A non-durable subscription (a reader) goes away with its
last consumer, except across a seek, where its client is expected back.

``NonPersistentSubscription`` has no cursor: it hands each published entry to a connected consumer
with permits, or drops it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import (
    Consumer,
    DeliverAt,
    Delivery,
    KeyOf,
    KeySharedMeta,
    KeySharedMode,
    LastMessageId,
    ServerConsumer,
    SubscriptionAPI,
    SubType,
)
from polybroker.broker_core.dispatcher import (
    DISPATCHERS,
    AutoSplitSelector,
    Dispatcher,
    DispatchSettings,
    StickySelector,
    pick_failover_active,
    safe_key,
)
from polybroker.broker_core.errors import (
    ConsumerBusyError,
    NotAllowedError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
)
from polybroker.broker_core.murmur import key_hash
from polybroker.ledger.api import Cursor, Entry, InitialPosition, ManagedLedger, Position
from polybroker.logs import kv

log = logging.getLogger(__name__)


class SubscriptionOwner(Protocol):
    """What a subscription needs from its topic."""

    name: str
    partition_index: int
    clock: IReactorTime

    @property
    def terminated(self) -> bool: ...

    def subscription_gone(self, subscription: SubscriptionAPI) -> None: ...

    def last_message_id(self) -> Deferred[LastMessageId]: ...


class PersistentOwner(SubscriptionOwner, Protocol):
    ledger: ManagedLedger


def _now_ms(clock: IReactorTime) -> int:
    return int(clock.seconds() * 1000)


def _tell(consumer: ServerConsumer, what: str, call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:
        log.exception(f"consumer failed on {what}", extra=kv(consumer=consumer.consumer_name))


class _Rates:
    """Per-second rates of a pair of counters, refreshed by ``update``."""

    def __init__(self) -> None:
        self.base = (0, 0, 0)
        self.msg_rate = 0.0
        self.throughput = 0.0
        self.redeliver_rate = 0.0

    def update(self, period_s: float, msgs: int, size: int, redelivered: int) -> None:
        base_msgs, base_size, base_redelivered = self.base
        self.msg_rate = (msgs - base_msgs) / period_s
        self.throughput = (size - base_size) / period_s
        self.redeliver_rate = (redelivered - base_redelivered) / period_s
        self.base = (msgs, size, redelivered)


class Subscription(SubscriptionAPI):
    """A subscription of a persistent topic (see module docstring)."""

    def __init__(
        self,
        topic: PersistentOwner,
        name: str,
        cursor: Cursor,
        *,
        durable: bool,
        settings: DispatchSettings,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
    ) -> None:
        self.topic = topic
        self.name = name
        self.cursor = cursor
        self.durable = durable
        self.settings = settings
        self.key_of = key_of
        self.deliver_at = deliver_at
        self.dispatcher: Dispatcher | None = None
        self.last_type: SubType | None = None
        self.closed = False
        self._keep_after_seek = False
        self.last_ack_ms = 0
        self.expired = 0  # messages expired (TTL, expire-messages, age eviction)
        self._expired_base = 0
        self.expired_rate = 0.0
        self.last_consumed_flow_ms = 0
        self._rates = _Rates()

    # -- identity and state ---------------------------------------------------------------

    @property
    def topic_name(self) -> str:
        return self.topic.name

    @property
    def sub_type(self) -> SubType | None:
        return self.dispatcher.sub_type if self.dispatcher is not None else self.last_type

    @property
    def consumers(self) -> list[ServerConsumer]:
        return list(self.dispatcher.consumers) if self.dispatcher is not None else []

    def _at_end(self) -> bool:
        return (
            self.topic.terminated and self.cursor.read_position > self.topic.ledger.last_confirmed
        )

    # -- consumers ------------------------------------------------------------------------

    def add_consumer(
        self,
        consumer: Consumer,
        sub_type: SubType,
        *,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        metadata: dict[str, str] | None = None,
    ) -> ServerConsumer:
        """Attach a consumer; raises ``ConsumerBusyError`` / ``ConsumerAssignError``."""
        if self.closed:
            raise SubscriptionNotFoundError(f"subscription {self.name!r} was deleted")
        current = self.dispatcher
        if current is not None and current.consumers and current.sub_type is not sub_type:
            raise ConsumerBusyError(
                f"subscription {self.name!r} is {current.sub_type.value}, not {sub_type.value}"
            )
        if key_of is not None:
            self.key_of = key_of
        if deliver_at is not None:
            self.deliver_at = deliver_at
        if current is None or current.sub_type is not sub_type:
            fresh = DISPATCHERS[sub_type](
                self.cursor,
                self.topic.clock,
                self.settings,
                at_end=self._at_end,
                key_of=self.key_of,
                deliver_at=self.deliver_at if DISPATCHERS[sub_type].uses_delays else None,
                partition_index=self.topic.partition_index,
                name=f"{self.topic.name}/{self.name}",
            )
            if current is not None:
                fresh.take_over(current)
            self.dispatcher = fresh
        else:
            current.key_of = self.key_of
            if current.uses_delays and current.settings.delayed_delivery_enabled:
                current.deliver_at = self.deliver_at
        self.last_type = sub_type
        server = ServerConsumer(consumer, self, sub_type, _now_ms(self.topic.clock), metadata)
        assert self.dispatcher is not None
        self.dispatcher.add_consumer(server, key_shared)
        self._keep_after_seek = False
        return server

    def flow(self, consumer: ServerConsumer, permits: int) -> None:
        if self.dispatcher is not None and not consumer.closed:
            self.last_consumed_flow_ms = _now_ms(self.topic.clock)
            self.dispatcher.flow(consumer, permits)

    def remove_consumer(self, consumer: ServerConsumer) -> Deferred[None]:
        dispatcher = self.dispatcher
        if consumer.closed or dispatcher is None:
            consumer.closed = True
            return succeed(None)
        dispatcher.remove_consumer(consumer)
        if not self.durable and not dispatcher.consumers and not self._keep_after_seek:
            return self._delete()
        return succeed(None)

    # -- acknowledgements -----------------------------------------------------------------

    def ack(self, consumer: ServerConsumer, positions: Sequence[Position]) -> Deferred[None]:
        if not positions or self.closed:
            return succeed(None)
        positions = list(positions)
        self.last_ack_ms = _now_ms(self.topic.clock)
        d = self.cursor.delete(positions)
        if self.dispatcher is not None:
            self.dispatcher.acked(positions)
        return d

    def ack_batch_index(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]:
        if self.closed or batch_size <= 0:
            return succeed(None)
        full = (1 << batch_size) - 1
        dispatcher = self.dispatcher
        acks = dispatcher.batch_acks if dispatcher is not None else {}
        merged = acks.get(position, 0) | (acked_indexes & full)
        if merged == full:
            return self.ack(consumer, [position])
        if dispatcher is not None and not self.cursor.is_deleted(position):
            acks[position] = merged
        return succeed(None)

    def ack_cumulative(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]:
        if self.closed:
            return succeed(None)
        if self.sub_type not in (SubType.EXCLUSIVE, SubType.FAILOVER):
            return fail(NotAllowedError("cumulative ack is only allowed on Exclusive and Failover"))
        target: Position | None = position
        if acked_indexes is not None:
            entry = consumer.pending.get(position)
            size = entry.num_messages if entry is not None else 0
            if size and acked_indexes & ((1 << size) - 1) != (1 << size) - 1:
                # Part of this batch only: everything before it, and these indexes of it.
                target = self._previous_position(position)
                if self.dispatcher is not None:
                    acks = self.dispatcher.batch_acks
                    acks[position] = acks.get(position, 0) | acked_indexes
        self.last_ack_ms = _now_ms(self.topic.clock)
        if target is None:
            return succeed(None)
        d = self.cursor.mark_delete(target)
        if self.dispatcher is not None:
            self.dispatcher.acked_up_to(target)
        return d

    def skip(self, count: int) -> Deferred[int]:
        """Acknowledge the next ``count`` unacknowledged entries after the mark-delete position,
        as Pulsar's skip does (it counts entries); fire with how many were skipped."""
        if self.closed:
            return fail(SubscriptionNotFoundError(f"subscription {self.name!r} was deleted"))
        return Deferred.fromCoroutine(self._skip(count))

    async def _unacknowledged(self, count: int) -> AsyncIterator[Entry]:
        """The first ``count`` (or fewer) entries after the mark-delete position that are not
        acknowledged, read from the log in turn (the dispatcher's state is not consulted)."""
        found = 0
        md = self.cursor.mark_delete_position
        position = Position(md.ledger_id, md.entry_id + 1)
        last = self.topic.ledger.last_confirmed
        while found < count and not last < position:
            entries = await self.topic.ledger.read(position, min(count - found, 500) + 64)
            if not entries:
                break
            for entry in entries:
                if not self.cursor.is_deleted(entry.position):
                    yield entry
                    found += 1
                    if found == count:
                        break
            tail = entries[-1].position
            position = Position(tail.ledger_id, tail.entry_id + 1)

    async def _skip(self, count: int) -> int:
        skipped = [entry.position async for entry in self._unacknowledged(count)]
        if skipped:
            await self.cursor.delete(skipped)
            if self.dispatcher is not None:
                self.dispatcher.acked(skipped)
        return len(skipped)

    def peek(self, n: int) -> Deferred[Entry | None]:
        """The ``n``-th (from 1) unacknowledged entry after the mark-delete position, as
        Pulsar's peek-messages finds it; None past the backlog. Nothing is acknowledged or
        delivered, and only that entry is kept in memory."""
        if self.closed:
            return fail(SubscriptionNotFoundError(f"subscription {self.name!r} was deleted"))

        async def nth() -> Entry | None:
            seen, last = 0, None
            async for entry in self._unacknowledged(n):
                seen, last = seen + 1, entry
            return last if seen == n and n > 0 else None

        return Deferred.fromCoroutine(nth())

    def expire_before(self, timestamp_ms: int) -> Deferred[bool]:
        """Acknowledge every entry published before ``timestamp_ms``, as Pulsar's
        expire-messages does: the mark-delete position only moves forward. Fire with whether
        it moved."""
        if self.closed:
            return fail(SubscriptionNotFoundError(f"subscription {self.name!r} was deleted"))
        return Deferred.fromCoroutine(self._expire_before(timestamp_ms))

    async def _expire_before(self, timestamp_ms: int) -> bool:
        ledger = self.topic.ledger
        first_kept = await ledger.position_of_time(timestamp_ms)
        if first_kept is None:
            target: Position | None = ledger.last_confirmed
            if target is not None and target.entry_id < 0:
                target = self._previous_position(target)
        else:
            target = self._previous_position(first_kept)
        if target is None:
            return False
        before = self.cursor.backlog()
        moved = await self.acknowledge_up_to(target)
        self.expired += max(0, before - self.cursor.backlog())
        return moved

    async def acknowledge_up_to(self, target: Position) -> bool:
        """Move the mark-delete position forward to ``target`` (never back), telling the
        dispatcher as a cumulative ack does; return whether it moved."""
        if self.closed or not self.cursor.mark_delete_position < target:
            return False
        d = self.cursor.mark_delete(target)
        if self.dispatcher is not None:
            self.dispatcher.acked_up_to(target)
        await d
        return True

    def _previous_position(self, position: Position) -> Position | None:
        if position.entry_id > 0:
            return Position(position.ledger_id, position.entry_id - 1)
        previous: Position | None = None
        for info in self.topic.ledger.ledgers:
            if info.ledger_id >= position.ledger_id:
                break
            if info.entries > 0:
                previous = Position(info.ledger_id, info.entries - 1)
        return previous

    def redeliver(self, consumer: ServerConsumer, positions: Sequence[Position] | None) -> None:
        if self.dispatcher is not None:
            self.dispatcher.redeliver(consumer, positions)

    # -- seek -----------------------------------------------------------------------------

    def _after_last(self) -> Position:
        last = self.topic.ledger.last_confirmed
        return Position(last.ledger_id, last.entry_id + 1)

    def seek(self, target: Position | InitialPosition) -> Deferred[None]:
        if self.closed:
            return fail(SubscriptionNotFoundError(f"subscription {self.name!r} was deleted"))
        ledger = self.topic.ledger
        if target is InitialPosition.EARLIEST or (
            isinstance(target, Position) and target.ledger_id < 0
        ):
            position = ledger.first_position
        elif target is InitialPosition.LATEST or (
            isinstance(target, Position) and target > ledger.last_confirmed
        ):
            position = self._after_last()
        else:
            assert isinstance(target, Position)
            position = target
        return self.reset_cursor(position)

    def seek_time(self, timestamp_ms: int) -> Deferred[None]:
        if self.closed:
            return fail(SubscriptionNotFoundError(f"subscription {self.name!r} was deleted"))

        def found(position: Position | None) -> Deferred[None]:
            return self.reset_cursor(position if position is not None else self._after_last())

        return self.topic.ledger.position_of_time(timestamp_ms).addCallback(found)

    def reset_cursor(self, position: Position) -> Deferred[None]:
        """Make ``position`` the next entry read, dropping every consumer first."""
        dispatcher = self.dispatcher
        consumers: list[ServerConsumer] = []
        if dispatcher is not None:
            consumers = list(dispatcher.consumers)
            dispatcher.reset()
        # A reader's client comes back after the seek and must find its cursor here.
        self._keep_after_seek = not self.durable
        for consumer in consumers:
            _tell(consumer, "disconnect", consumer.consumer.disconnect)

        def resumed(result: object) -> object:
            if dispatcher is not None:
                dispatcher.resume()
            return result

        d = self.cursor.reset(position)
        d.addBoth(resumed)
        return d

    # -- lifecycle ------------------------------------------------------------------------

    def unsubscribe(self, consumer: ServerConsumer) -> Deferred[None]:
        others = [c for c in self.consumers if c is not consumer]
        if others:
            return fail(
                SubscriptionBusyError(
                    f"subscription {self.name!r} has {len(others)} other connected consumer(s)"
                )
            )
        if self.dispatcher is not None and not consumer.closed:
            self.dispatcher.remove_consumer(consumer, redeliver=False)
        return self._delete()

    def delete(self, force: bool = False) -> Deferred[None]:
        """Delete the subscription (admin); with consumers connected only when forced."""
        consumers = self.consumers
        if consumers and not force:
            return fail(
                SubscriptionBusyError(
                    f"subscription {self.name!r} has {len(consumers)} connected consumer(s)"
                )
            )
        self._disconnect_all()
        return self._delete()

    def _delete(self) -> Deferred[None]:
        if self.closed:
            return succeed(None)
        self.closed = True
        if self.dispatcher is not None:
            self.dispatcher.close()
        self.topic.subscription_gone(self)
        if self.durable:
            return self.topic.ledger.delete_cursor(self.name)
        return self.cursor.close()

    def _disconnect_all(self) -> None:
        dispatcher = self.dispatcher
        if dispatcher is None:
            return
        consumers = list(dispatcher.consumers)
        dispatcher.close()
        dispatcher.consumers = []
        for consumer in consumers:
            consumer.closed = True
            _tell(consumer, "disconnect", consumer.consumer.disconnect)

    def close(self) -> None:
        """Stop dispatching and disconnect every consumer (topic unload); the cursor is
        closed with its managed ledger."""
        self._disconnect_all()
        self.closed = True

    def on_terminated(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.wake()

    def last_message_id(self) -> Deferred[LastMessageId]:
        def with_mark_delete(last: LastMessageId) -> LastMessageId:
            return LastMessageId(last.position, last.num_messages, self.cursor.mark_delete_position)

        d = self.topic.last_message_id()
        d.addCallback(with_mark_delete)
        return d

    # -- stats ----------------------------------------------------------------------------

    def update_rates(self, period_s: float) -> None:
        self.expired_rate = (self.expired - self._expired_base) / period_s
        self._expired_base = self.expired
        d = self.dispatcher
        if d is not None:
            self._rates.update(period_s, d.msg_out, d.bytes_out, d.msg_redelivered)
            for consumer in d.consumers:
                consumer.update_rates(period_s)

    def stats(self) -> dict[str, object]:
        """This subscription's entry in Pulsar's topic stats ``subscriptions`` map."""
        d = self.dispatcher
        consumers = d.consumers if d is not None else []
        backlog = self.cursor.backlog_entries()
        delayed = d.delayed_count if d is not None else 0
        sub_type = self.sub_type
        out: dict[str, object] = {
            "msgRateOut": self._rates.msg_rate,
            "msgThroughputOut": self._rates.throughput,
            "bytesOutCounter": d.bytes_out if d is not None else 0,
            "msgOutCounter": d.msg_out if d is not None else 0,
            "msgRateRedeliver": self._rates.redeliver_rate,
            "msgRedeliverCounter": d.msg_redelivered if d is not None else 0,
            "msgBacklog": backlog,
            "msgBacklogNoDelayed": max(0, backlog - delayed),
            "backlogMessages": self.cursor.backlog(),
            "blockedSubscriptionOnUnackedMsgs": False,
            "msgDelayed": delayed,
            "unackedMessages": sum(c.pending_messages for c in consumers),
            "type": sub_type.value if sub_type is not None else SubType.EXCLUSIVE.value,
            "msgRateExpired": self.expired_rate,
            "totalMsgExpired": self.expired,
            "lastAckedTimestamp": self.last_ack_ms,
            "lastConsumedFlowTimestamp": self.last_consumed_flow_ms,
            "consumers": [c.stats() for c in consumers],
            "isDurable": self.durable,
            "isReplicated": False,
            "nonContiguousDeletedMessagesRanges": len(self.cursor.individually_deleted()),
        }
        if sub_type is SubType.FAILOVER and d is not None:
            active = getattr(d, "active", None)
            out["activeConsumerName"] = active.consumer_name if active is not None else None
        if sub_type is SubType.KEY_SHARED and d is not None:
            meta = getattr(d, "meta", None)
            if meta is not None:
                out["keySharedMode"] = meta.mode.value
                out["allowOutOfOrderDelivery"] = meta.allow_out_of_order
        return out


class NonPersistentSubscription(SubscriptionAPI):
    """A subscription of a non-persistent topic: delivery to connected consumers only."""

    def __init__(self, topic: SubscriptionOwner, name: str, key_of: KeyOf | None = None) -> None:
        self.topic = topic
        self.name = name
        self.key_of = key_of
        self.sub_type: SubType | None = None
        self.consumers: list[ServerConsumer] = []
        self.closed = False
        self.durable = False
        self.msg_out = 0
        self.bytes_out = 0
        self.msg_dropped = 0
        self._next = 0
        self._active: ServerConsumer | None = None
        self._auto: AutoSplitSelector | None = None
        self._sticky: StickySelector | None = None
        self._rates = _Rates()

    @property
    def topic_name(self) -> str:
        return self.topic.name

    def add_consumer(
        self,
        consumer: Consumer,
        sub_type: SubType,
        *,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        metadata: dict[str, str] | None = None,
    ) -> ServerConsumer:
        if self.closed:
            raise SubscriptionNotFoundError(f"subscription {self.name!r} was deleted")
        if self.consumers and self.sub_type is not sub_type:
            raise ConsumerBusyError(
                f"subscription {self.name!r} is {self.sub_type}, not {sub_type.value}"
            )
        if sub_type is SubType.EXCLUSIVE and self.consumers:
            raise ConsumerBusyError("Exclusive subscription already has a consumer")
        if key_of is not None:
            self.key_of = key_of
        server = ServerConsumer(consumer, self, sub_type, _now_ms(self.topic.clock), metadata)
        if sub_type is SubType.KEY_SHARED:
            meta = key_shared or KeySharedMeta()
            if not self.consumers:
                self._auto = AutoSplitSelector() if meta.mode is KeySharedMode.AUTO_SPLIT else None
                self._sticky = StickySelector() if meta.mode is KeySharedMode.STICKY else None
            if self._sticky is not None:
                self._sticky.add(server, meta.ranges)
            elif self._auto is not None:
                self._auto.add(server)
            else:
                raise ConsumerBusyError("Key_Shared subscription is in another mode")
        self.sub_type = sub_type
        self.consumers.append(server)
        if sub_type in (SubType.EXCLUSIVE, SubType.FAILOVER):
            self._elect(joined=server)
        return server

    def _elect(self, joined: ServerConsumer | None) -> None:
        chosen = pick_failover_active(self.consumers, self.topic.partition_index)
        self._active = chosen
        for consumer in self.consumers:
            is_active = consumer is chosen
            changed = consumer.active != is_active
            consumer.active = is_active
            if self.sub_type is SubType.FAILOVER and (changed or consumer is joined):
                try:
                    consumer.consumer.active_changed(is_active)
                except Exception:
                    log.exception("consumer failed on active change", extra=kv(sub=self.name))

    def deliver(self, entry: Entry) -> None:
        """Hand a just-published entry to one consumer with permits, or drop it."""
        consumer = self._choose(entry)
        n = entry.num_messages
        if consumer is None or consumer.permits <= 0 or consumer.paused:
            self.msg_dropped += n
            return
        consumer.permits -= n
        consumer.msg_out += n
        consumer.bytes_out += len(entry.data)
        self.msg_out += n
        self.bytes_out += len(entry.data)
        _tell(consumer, "delivery", lambda: consumer.consumer.send_entries([Delivery(entry, 0, 0)]))

    def _choose(self, entry: Entry) -> ServerConsumer | None:
        if not self.consumers:
            return None
        if self.sub_type is SubType.SHARED:
            size = len(self.consumers)
            for step in range(size):
                index = (self._next + step) % size
                consumer = self.consumers[index]
                if consumer.permits > 0 and not consumer.paused:
                    self._next = index + 1
                    return consumer
            return None
        if self.sub_type is SubType.KEY_SHARED:
            slot = key_hash(safe_key(self.key_of, entry, self.name))
            selector = self._auto or self._sticky
            return selector.select(slot) if selector is not None else None
        return self._active

    def flow(self, consumer: ServerConsumer, permits: int) -> None:
        consumer.permits += permits

    def ack(self, consumer: ServerConsumer, positions: Sequence[Position]) -> Deferred[None]:
        return succeed(None)

    def ack_batch_index(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]:
        return succeed(None)

    def ack_cumulative(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]:
        return succeed(None)

    def redeliver(self, consumer: ServerConsumer, positions: Sequence[Position] | None) -> None:
        """Nothing is kept, so nothing comes again."""

    def seek(self, target: Position | InitialPosition) -> Deferred[None]:
        return fail(NotAllowedError("seek is not supported on non-persistent topics"))

    def seek_time(self, timestamp_ms: int) -> Deferred[None]:
        return fail(NotAllowedError("seek is not supported on non-persistent topics"))

    def remove_consumer(self, consumer: ServerConsumer) -> Deferred[None]:
        if consumer.closed or consumer not in self.consumers:
            consumer.closed = True
            return succeed(None)
        self._detach(consumer)
        if not self.consumers:
            self._delete()
        return succeed(None)

    def _detach(self, consumer: ServerConsumer) -> None:
        consumer.closed = True
        self.consumers.remove(consumer)
        if self._auto is not None:
            self._auto.remove(consumer)
        if self._sticky is not None:
            self._sticky.remove(consumer)
        if self.sub_type in (SubType.EXCLUSIVE, SubType.FAILOVER):
            self._elect(joined=None)

    def unsubscribe(self, consumer: ServerConsumer) -> Deferred[None]:
        others = [c for c in self.consumers if c is not consumer]
        if others:
            return fail(
                SubscriptionBusyError(
                    f"subscription {self.name!r} has {len(others)} other connected consumer(s)"
                )
            )
        if consumer in self.consumers:
            self._detach(consumer)
        self._delete()
        return succeed(None)

    def delete(self, force: bool = False) -> Deferred[None]:
        if self.consumers and not force:
            return fail(SubscriptionBusyError(f"subscription {self.name!r} has consumers"))
        self.close()
        self._delete()
        return succeed(None)

    def _delete(self) -> None:
        if not self.closed:
            self.closed = True
            self.topic.subscription_gone(self)

    def close(self) -> None:
        consumers = list(self.consumers)
        self.consumers = []
        for consumer in consumers:
            consumer.closed = True
            _tell(consumer, "disconnect", consumer.consumer.disconnect)

    def last_message_id(self) -> Deferred[LastMessageId]:
        return self.topic.last_message_id()

    def update_rates(self, period_s: float) -> None:
        self._rates.update(period_s, self.msg_out, self.bytes_out, 0)
        for consumer in self.consumers:
            consumer.update_rates(period_s)

    def stats(self) -> dict[str, object]:
        return {
            "msgRateOut": self._rates.msg_rate,
            "msgThroughputOut": self._rates.throughput,
            "bytesOutCounter": self.bytes_out,
            "msgOutCounter": self.msg_out,
            "msgDropRate": 0.0,
            "msgDropCounter": self.msg_dropped,
            "msgBacklog": 0,
            "type": self.sub_type.value if self.sub_type is not None else "Exclusive",
            "consumers": [c.stats() for c in self.consumers],
            "isDurable": False,
            "isReplicated": False,
        }


def log_failure(what: str) -> Callable[[Failure], None]:
    """An errback that logs a background failure instead of leaving it unhandled."""

    def errback(failure: Failure) -> None:
        log.warning(f"{what} failed", extra=kv(error=str(failure.value)))

    return errback
