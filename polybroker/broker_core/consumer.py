"""What a protocol handler implements (``Consumer``, ``EntryInspector``) and what it gets back
(``ServerConsumer``) when it subscribes.

The broker never knows a wire format. It hands a handler's ``Consumer`` batches of ``Delivery``
(an entry plus its redelivery count and the batch indexes already acknowledged), asks it to close
(``disconnect``), and tells it about Failover activity and the end of a terminated topic. The
handler drives the broker through ``ServerConsumer``: flow permits, acks, negative acks, seeks.

Permits count messages, not entries: an entry holding N messages uses N permits. An entry is sent
to a consumer that has at least one permit, so permits may go below zero by less than one entry
(a batch is never split, and a batch larger than the receiver queue never stalls).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from twisted.internet.defer import Deferred

from polybroker.ledger.api import Entry, InitialPosition, Position


class SubType(enum.Enum):
    """Subscription types (Pulsar's names)."""

    EXCLUSIVE = "Exclusive"
    SHARED = "Shared"
    FAILOVER = "Failover"
    KEY_SHARED = "Key_Shared"


class KeySharedMode(enum.Enum):
    AUTO_SPLIT = "AUTO_SPLIT"
    STICKY = "STICKY"


@dataclass(frozen=True)
class KeySharedMeta:
    """How a Key_Shared consumer takes its hash ranges.

    ``ranges`` (STICKY only) are inclusive ``(start, end)`` slots in 0..65535.
    ``allow_out_of_order`` lifts the rule that holds back keys moved to a joining consumer.
    """

    mode: KeySharedMode = KeySharedMode.AUTO_SPLIT
    ranges: tuple[tuple[int, int], ...] = ()
    allow_out_of_order: bool = False


class Delivery(NamedTuple):
    """One entry as handed to a consumer.

    ``acked_indexes`` is a bitset of the batch indexes already acknowledged (bit i = message i);
    0 when none is. A handler that speaks batch-index acks tells its client to skip those.
    """

    entry: Entry
    redelivery_count: int
    acked_indexes: int


@dataclass(frozen=True)
class LastMessageId:
    """The last message of a topic: its entry, the messages in it, and (asked through a
    consumer) that subscription's mark-delete position. ``position.entry_id`` is -1 when the
    topic is empty."""

    position: Position
    num_messages: int
    mark_delete_position: Position | None = None

    @property
    def batch_index(self) -> int:
        """The index of the last message within its entry (-1 when empty)."""
        return self.num_messages - 1 if self.num_messages > 0 else -1


@runtime_checkable
class Consumer(Protocol):
    """The handler's side of a subscription: one client consumer.

    The broker calls these on the reactor thread; none may block, and none should raise (an
    exception is logged and the delivery counts as sent: its positions stay pending and are
    redelivered when the consumer goes away).
    """

    @property
    def consumer_id(self) -> int:
        """The handler's id of this consumer (unique per connection)."""
        ...

    @property
    def consumer_name(self) -> str:
        """The consumer's name; Failover picks the active consumer by it."""
        ...

    @property
    def priority_level(self) -> int:
        """Lower is preferred (Shared fills lower levels first; Failover picks the lowest)."""
        ...

    def send_entries(self, deliveries: list[Delivery]) -> None:
        """Send these entries, in order, to the client."""
        ...

    def active_changed(self, is_active: bool) -> None:
        """Failover only: this consumer became the active one, or a standby."""
        ...

    def reached_end_of_topic(self) -> None:
        """The topic is terminated and this subscription has acknowledged everything."""
        ...

    def disconnect(self) -> None:
        """The broker closed this consumer (seek, unload, delete, fencing): tell the client,
        which may subscribe again. The ``ServerConsumer`` is already closed when this runs."""
        ...


class EntryInspector(Protocol):
    """Reads what the broker needs from an entry whose format only a handler knows.

    Every method returns None when the entry does not say (or is in a format it does not know).
    """

    def key_of(self, entry: Entry) -> bytes | None:
        """The key Key_Shared orders and routes by (Pulsar: ordering key, else partition key)."""
        ...

    def deliver_at_ms(self, entry: Entry) -> int | None:
        """When (epoch ms) the entry may be delivered to Shared / Key_Shared subscriptions."""
        ...

    def producer_sequence(self, entry: Entry) -> tuple[str, int] | None:
        """The producer name and highest sequence id stored in the entry (dedup recovery)."""
        ...


class NullInspector:
    """An ``EntryInspector`` that knows nothing: no keys, no delays, no sequence ids."""

    def key_of(self, entry: Entry) -> bytes | None:
        return None

    def deliver_at_ms(self, entry: Entry) -> int | None:
        return None

    def producer_sequence(self, entry: Entry) -> tuple[str, int] | None:
        return None


KeyOf = Callable[[Entry], bytes | None]
DeliverAt = Callable[[Entry], int | None]


class SubscriptionAPI(abc.ABC):
    """What a ``ServerConsumer`` asks of its subscription (persistent or not)."""

    name: str

    @property
    @abc.abstractmethod
    def topic_name(self) -> str:
        """The topic's full name."""

    @abc.abstractmethod
    def flow(self, consumer: ServerConsumer, permits: int) -> None: ...

    @abc.abstractmethod
    def ack(self, consumer: ServerConsumer, positions: Sequence[Position]) -> Deferred[None]: ...

    @abc.abstractmethod
    def ack_batch_index(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]: ...

    @abc.abstractmethod
    def ack_cumulative(
        self, consumer: ServerConsumer, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]: ...

    @abc.abstractmethod
    def redeliver(self, consumer: ServerConsumer, positions: Sequence[Position] | None) -> None: ...

    @abc.abstractmethod
    def seek(self, target: Position | InitialPosition) -> Deferred[None]: ...

    @abc.abstractmethod
    def seek_time(self, timestamp_ms: int) -> Deferred[None]: ...

    @abc.abstractmethod
    def remove_consumer(self, consumer: ServerConsumer) -> Deferred[None]: ...

    @abc.abstractmethod
    def unsubscribe(self, consumer: ServerConsumer) -> Deferred[None]: ...

    @abc.abstractmethod
    def last_message_id(self) -> Deferred[LastMessageId]: ...


class ServerConsumer:
    """The broker's side of one connected consumer: what a handler calls.

    The dispatcher keeps the bookkeeping here: ``permits`` (messages the client can take),
    ``pending`` (delivered, unacknowledged entries by position, in delivery order) and
    ``pending_messages``. Handlers read these for stats and never change them.

    ``paused``: the handler's connection cannot take more now (its send buffer is full, as
    Pulsar's channel is not writable); dispatchers pass the consumer by, as if it had no
    permits, until the handler calls ``resume``.
    """

    __slots__ = (
        "_subscription",
        "active",
        "blocked",
        "bytes_out",
        "closed",
        "connected_since_ms",
        "consumer",
        "ended_notified",
        "hash_ranges",
        "join_marker",
        "metadata",
        "msg_out",
        "msg_rate_out",
        "msg_redelivered",
        "msg_throughput_out",
        "paused",
        "pending",
        "pending_messages",
        "permits",
        "rate_base",
        "sub_type",
    )

    def __init__(
        self,
        consumer: Consumer,
        subscription: SubscriptionAPI,
        sub_type: SubType,
        connected_since_ms: int,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.consumer = consumer
        self._subscription = subscription
        self.sub_type = sub_type
        self.connected_since_ms = connected_since_ms
        self.metadata = dict(metadata or {})
        self.permits = 0
        self.pending: dict[Position, Entry] = {}
        self.pending_messages = 0
        self.msg_out = 0
        self.bytes_out = 0
        self.msg_redelivered = 0
        self.closed = False
        self.blocked = False
        self.paused = False
        self.active = False
        self.msg_rate_out = 0.0
        self.msg_throughput_out = 0.0
        self.rate_base = (0, 0)
        self.ended_notified = False
        # Key_Shared: the slots this consumer owns, and (while it may only receive what was read
        # before it joined) the last position read at join time.
        self.hash_ranges: list[tuple[int, int]] = []
        self.join_marker: Position | None = None

    # -- identity ---------------------------------------------------------------------------

    @property
    def consumer_id(self) -> int:
        return self.consumer.consumer_id

    @property
    def consumer_name(self) -> str:
        return self.consumer.consumer_name

    @property
    def priority_level(self) -> int:
        return self.consumer.priority_level

    @property
    def subscription(self) -> SubscriptionAPI:
        return self._subscription

    @property
    def subscription_name(self) -> str:
        return self._subscription.name

    @property
    def topic_name(self) -> str:
        return self._subscription.topic_name

    # -- the handler's calls ----------------------------------------------------------------

    def flow(self, permits: int) -> None:
        """Grant ``permits`` more messages; the dispatcher sends as they allow."""
        if permits > 0 and not self.closed:
            self._subscription.flow(self, permits)

    def pause(self) -> None:
        """Take nothing more until ``resume`` (the connection's send buffer is full)."""
        self.paused = True

    def resume(self) -> None:
        """Take again what the permits allow."""
        if self.paused:
            self.paused = False
            if not self.closed:
                self._subscription.flow(self, 0)

    def ack(self, positions: Sequence[Position]) -> Deferred[None]:
        """Acknowledge whole entries individually."""
        return self._subscription.ack(self, positions)

    def ack_batch_index(
        self, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]:
        """Acknowledge some messages of an entry (bit i of ``acked_indexes`` = message i);
        the entry is acknowledged once all ``batch_size`` of its messages are."""
        return self._subscription.ack_batch_index(self, position, acked_indexes, batch_size)

    def ack_cumulative(
        self, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]:
        """Acknowledge everything up to ``position`` (Exclusive and Failover only; else the
        Deferred fails with ``NotAllowedError``). With ``acked_indexes`` only those messages
        of ``position`` itself are acknowledged, and everything before it."""
        return self._subscription.ack_cumulative(self, position, acked_indexes)

    def redeliver(self, positions: Sequence[Position] | None = None) -> None:
        """Negative ack: send these pending positions again (all of them when None; always all
        on Exclusive and Failover, where order forbids redelivering only some)."""
        if not self.closed:
            self._subscription.redeliver(self, positions)

    def seek(self, target: Position | InitialPosition) -> Deferred[None]:
        """Reset the subscription so ``target`` is read next; every consumer is disconnected."""
        return self._subscription.seek(target)

    def seek_time(self, timestamp_ms: int) -> Deferred[None]:
        """Reset the subscription to the first entry published at or after ``timestamp_ms``."""
        return self._subscription.seek_time(timestamp_ms)

    def close(self) -> Deferred[None]:
        """Detach this consumer; its pending entries go to the other consumers."""
        return self._subscription.remove_consumer(self)

    def unsubscribe(self) -> Deferred[None]:
        """Delete the subscription; fails with ``SubscriptionBusyError`` if other consumers
        are connected."""
        return self._subscription.unsubscribe(self)

    def last_message_id(self) -> Deferred[LastMessageId]:
        """The topic's last message and this subscription's mark-delete position."""
        return self._subscription.last_message_id()

    @property
    def unacked_messages(self) -> int:
        return self.pending_messages

    def update_rates(self, period_s: float) -> None:
        """Turn the counters since the last call into per-second rates."""
        base_msgs, base_bytes = self.rate_base
        self.msg_rate_out = (self.msg_out - base_msgs) / period_s
        self.msg_throughput_out = (self.bytes_out - base_bytes) / period_s
        self.rate_base = (self.msg_out, self.bytes_out)

    def stats(self) -> dict[str, object]:
        """This consumer's entry in Pulsar's subscription stats ``consumers`` list."""
        out: dict[str, object] = {
            "consumerName": self.consumer_name,
            "consumerId": self.consumer_id,
            "priorityLevel": self.priority_level,
            "msgRateOut": self.msg_rate_out,
            "msgThroughputOut": self.msg_throughput_out,
            "availablePermits": self.permits,
            "unackedMessages": self.pending_messages,
            "msgOutCounter": self.msg_out,
            "bytesOutCounter": self.bytes_out,
            "msgRedeliverCounter": self.msg_redelivered,
            "blockedConsumerOnUnackedMsgs": self.blocked,
            "connectedSince": self.connected_since_ms,
            "metadata": dict(self.metadata),
        }
        if self.sub_type is SubType.KEY_SHARED:
            out["keyHashRanges"] = [f"[{s}, {e}]" for s, e in self.hash_ranges]
            if self.join_marker is not None:
                out["readPositionWhenJoining"] = str(self.join_marker)
        if self.sub_type is SubType.FAILOVER:
            out["isActive"] = self.active
        return out
