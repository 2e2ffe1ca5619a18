"""Virtual hosts: exchanges, queues and bindings of one namespace, over the Broker API.

Design. A durable queue is a topic of its own, ``persistent://<ns>/amqp.queue.<name>``, read
through one durable subscription (``amqp``) by a feeder that keeps a bounded window of the
backlog in memory; AMQP consumers, ``basic.get``, prefetch, requeue and redelivered flags work on
that window, and an entry is acknowledged on the subscription once every message of it is settled
(acked, dropped or dead-lettered). Routing runs at publish time: the message is encoded once and
that one buffer is appended to each destination queue's topic, so every queue is an ordinary
topic that any broker can own (no one-bundle rule) and durability is the topics' durability.
A transient (non-durable) queue does not outlive this broker, so, as in RabbitMQ, it holds its
messages in memory only, against the handler's ``MemoryGauge`` (publishers are blocked above
its watermark).

``amq.topic`` bridges to the other protocols: a publish with routing key R is also written to
topic R; a queue bound to ``amq.topic`` with key P gets, through a forwarder (a durable
subscription ``amqp.fwd.<queue>`` on each topic matching P), what other protocols produce there.

Durable exchanges, queues and bindings are kept in the metadata store under
``/amqp/<tenant>/<ns>/``; transient messages in durable queues carry the incarnation that stored
them and are dropped when a later incarnation reads them.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall

from polybroker.broker_core.consumer import Delivery, ServerConsumer, SubType
from polybroker.broker_core.messages import (
    Message,
    MessageFormatError,
    decode_entry,
    encode_entry,
)
from polybroker.ledger.api import Entry, InitialPosition, Position
from polybroker.logs import kv
from polybroker.protocols.amqp import routing
from polybroker.protocols.amqp.codec import (
    NOT_FOUND,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    AmqpError,
    decode_table,
    encode_table,
)
from polybroker.protocols.amqp.convert import (
    P_EXCHANGE,
    P_ROUTING_KEY,
    AmqpMessage,
    from_stored,
    to_stored,
)

if TYPE_CHECKING:
    from polybroker.broker_core.service import BrokerService

log = logging.getLogger(__name__)

SUBSCRIPTION = "amqp"
#: Messages a queue keeps in memory (ready plus unacknowledged).
WINDOW = 2000
#: How long a basic.get waits for messages whose append is still under way.
CATCH_UP_S = 2.0
#: How often wildcard forwarders look for new topics.
RESCAN_S = 5.0
#: Publishes to one topic within one client input (or reactor turn) share a batch entry of at
#: most this many messages and bytes.
BATCH_MAX_MESSAGES = 500
BATCH_MAX_BYTES = 512 * 1024


def _now_ms(clock: IReactorTime) -> int:
    return int(clock.seconds() * 1000)


class QueueConsumer:
    """An AMQP consumer of a queue; the connection implements ``deliver`` and ``cancelled``."""

    def __init__(
        self,
        tag: str,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
        deliver: Callable[[QueueConsumer, QueuedMessage], None],
        has_room: Callable[[QueueConsumer], bool],
        cancelled: Callable[[QueueConsumer], None],
    ) -> None:
        self.tag = tag
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0
        self.deliver = deliver
        self.has_room = has_room
        self.cancelled = cancelled
        self.queue: Queue | None = None


@dataclass(slots=True)
class _EntryRef:
    position: Position | None  # None: a message held in memory only
    remaining: int


@dataclass(slots=True)
class QueuedMessage:
    """One message of a queue's window."""

    ref: _EntryRef
    message: AmqpMessage
    redelivered: bool = False
    expires_at_ms: int = 0
    settled: bool = False


class _Feeder:
    """The broker-side consumer that reads a queue's topic (see ``Consumer``)."""

    _ids = itertools.count(1)

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self._id = next(self._ids)

    @property
    def consumer_id(self) -> int:
        return self._id

    @property
    def consumer_name(self) -> str:
        return f"amqp-{self.queue.name}"

    @property
    def priority_level(self) -> int:
        return 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        self.queue.fed(deliveries)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        self.queue.feeder_lost()


class Queue:
    """One AMQP queue (see the module docstring)."""

    def __init__(
        self,
        vhost: VirtualHost,
        name: str,
        *,
        durable: bool,
        exclusive_owner: object | None,
        auto_delete: bool,
        arguments: dict[str, Any],
    ) -> None:
        self.vhost = vhost
        self.name = name
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = arguments
        #: A transient queue lives and dies with this broker: it holds its messages in
        #: memory (as RabbitMQ does), bounded by the handler's memory gauge.
        self.memory_only = not durable
        local = f"amqp.queue.{quote(name, safe='')}"
        self.topic = f"persistent://{vhost.namespace}/{local}"
        self.ready: deque[QueuedMessage] = deque()
        self.consumers: list[QueueConsumer] = []
        self._rr = 0
        self.in_memory = 0
        self._granted = 0
        self._received = 0
        self.server_consumer: ServerConsumer | None = None
        self.deleted = False
        self.had_consumer = False
        self.appending = 0
        self.last_appended: Position | None = None
        self.last_fed: Position | None = None
        self._waiters: list[Deferred[None]] = []
        self.ttl_ms = _int_arg(arguments, "x-message-ttl")
        self.expires_ms = _int_arg(arguments, "x-expires")
        self.max_length = _int_arg(arguments, "x-max-length")
        self.dlx: str | None = arguments.get("x-dead-letter-exchange")
        self.dlx_key: str | None = arguments.get("x-dead-letter-routing-key")
        self._expiry: IDelayedCall | None = None
        self._ttl_timer: IDelayedCall | None = None
        self._acks: list[Position] = []
        #: Entries up to here were purged before the window read them.
        self.purged_to: Position | None = None
        self.forwarders: dict[str, Forwarder] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Subscribe the feeder to the queue's topic (a transient queue has none)."""
        self.touch()
        if self.memory_only:
            return succeed(None)
        d = self.vhost.service.subscribe(
            self.topic,
            SUBSCRIPTION,
            _Feeder(self),
            SubType.EXCLUSIVE,
            InitialPosition.EARLIEST,
        )

        def attached(sc: ServerConsumer) -> None:
            if self.deleted:
                sc.close()
                return
            self.server_consumer = sc
            self._flow()

        d.addCallback(attached)
        return d  # type: ignore[return-value]

    def feeder_lost(self) -> None:
        """The broker closed the feeder (topic unloaded): drop the window and subscribe again."""
        self.server_consumer = None
        if self.deleted:
            return
        self.ready.clear()
        self.in_memory = 0
        self._granted = self._received = 0
        self.start().addErrback(
            lambda f: log.warning("AMQP queue feeder lost", extra=kv(error=str(f.value)))
        )

    def close(self) -> None:
        """Stop reading (broker shutdown); the subscription keeps its position."""
        self.deleted = True
        if self.memory_only:
            while self.ready:
                self.settle(self.ready.popleft())
        for timer in (self._expiry, self._ttl_timer):
            if timer is not None and timer.active():
                timer.cancel()
        for fwd in self.forwarders.values():
            fwd.close()
        if self.server_consumer is not None:
            self.server_consumer.close()
            self.server_consumer = None

    # -- feeding -----------------------------------------------------------------------------

    def _flow(self) -> None:
        if self.server_consumer is None:
            return
        outstanding = self._granted - self._received
        want = WINDOW - self.in_memory - outstanding
        if want >= WINDOW // 4:
            self._granted += want
            self.server_consumer.flow(want)

    def fed(self, deliveries: list[Delivery]) -> None:
        """Entries from the topic: decode them into the window."""
        now = _now_ms(self.vhost.clock)
        for d in deliveries:
            entry = d.entry
            self._received += entry.num_messages
            if self.last_fed is None or self.last_fed < entry.position:
                self.last_fed = entry.position
            purged = self.purged_to
            if purged is not None and d.redelivery_count == 0 and not purged < entry.position:
                # Purged while still beyond the window: acknowledged unread.
                self._received_and_dropped(entry)
                continue
            try:
                messages = decode_entry(entry.data)
            except MessageFormatError:
                log.warning("AMQP queue skips a malformed entry", extra=kv(topic=self.topic))
                self._ack_entry(entry.position)
                continue
            ref = _EntryRef(entry.position, len(messages))
            if not messages:
                self._ack_entry(entry.position)
            for m in messages:
                am = from_stored(m)
                if not am.publish_time_ms:
                    am.publish_time_ms = entry.publish_time_ms
                qm = QueuedMessage(ref, am, redelivered=d.redelivery_count > 0)
                self.in_memory += 1
                if am.incarnation and am.incarnation != self.vhost.incarnation:
                    self.settle(qm)  # a transient message from before a restart
                    continue
                qm.expires_at_ms = self._expiry_of(am)
                self.ready.append(qm)
        self._enforce_max_length()
        self._wake_waiters()
        self.dispatch(now)
        self._schedule_expiry()
        self._flow()

    def _schedule_expiry(self) -> None:
        """Expire messages at the head when their time comes, not only when read."""
        if self._ttl_timer is not None and self._ttl_timer.active():
            return
        head = next((qm for qm in self.ready if not qm.settled), None)
        if head is None or not head.expires_at_ms or self.deleted:
            return
        delay = max(0.0, (head.expires_at_ms - _now_ms(self.vhost.clock)) / 1000.0)
        self._ttl_timer = self.vhost.clock.callLater(delay + 0.001, self._expire_head)

    def _expire_head(self) -> None:
        now = _now_ms(self.vhost.clock)
        while self.ready:
            qm = self.ready[0]
            if qm.settled:
                self.ready.popleft()
                continue
            if not qm.expires_at_ms or qm.expires_at_ms > now:
                break
            self.ready.popleft()
            self.dead_letter(qm, "expired")
        self._schedule_expiry()

    def accept(self, am: AmqpMessage) -> None:
        """Take a message into a memory-only queue."""
        if self.deleted:
            return
        if not am.publish_time_ms:
            am.publish_time_ms = _now_ms(self.vhost.clock)
        qm = QueuedMessage(_EntryRef(None, 1), am)
        qm.expires_at_ms = self._expiry_of(am)
        self.in_memory += 1
        self.vhost.gauge.add(len(am.body))
        self.ready.append(qm)
        self._enforce_max_length()
        self.dispatch()
        self._schedule_expiry()

    def _expiry_of(self, am: AmqpMessage) -> int:
        ttl = self.ttl_ms
        if am.properties.expiration:
            try:
                per = int(am.properties.expiration)
                ttl = per if ttl is None else min(ttl, per)
            except ValueError:
                pass
        if ttl is None:
            return 0
        return (am.publish_time_ms or _now_ms(self.vhost.clock)) + max(ttl, 0)

    def _enforce_max_length(self) -> None:
        if self.max_length is None:
            return
        while len(self.ready) > self.max_length:
            self.dead_letter(self.ready.popleft(), "maxlen")

    # -- settling ----------------------------------------------------------------------------

    def _ack_entry(self, position: Position) -> None:
        # Acks of one reactor turn go to the subscription together.
        self._acks.append(position)
        if len(self._acks) == 1:
            self.vhost.clock.callLater(0, self._flush_acks)

    def _flush_acks(self) -> None:
        acks, self._acks = self._acks, []
        if acks and self.server_consumer is not None:
            self.server_consumer.ack(acks).addErrback(lambda f: None)

    def settle(self, qm: QueuedMessage) -> None:
        """The message is done with (acked, dropped or dead-lettered)."""
        if qm.settled:
            return
        qm.settled = True
        self.in_memory -= 1
        qm.ref.remaining -= 1
        if qm.ref.position is None:
            self.vhost.gauge.add(-len(qm.message.body))
            return
        if qm.ref.remaining == 0:
            self._ack_entry(qm.ref.position)
        self._flow()

    def requeue(self, messages: list[QueuedMessage]) -> None:
        """Put unacknowledged messages back at the head, in their order, marked redelivered."""
        for qm in reversed(messages):
            if qm.settled:
                continue
            qm.redelivered = True
            self.ready.appendleft(qm)
        self.dispatch(_now_ms(self.vhost.clock))

    def dead_letter(self, qm: QueuedMessage, reason: str) -> None:
        """Drop a message, republishing it to the dead-letter exchange when there is one."""
        if self.dlx is not None and self.vhost.exchanges.get(self.dlx) is not None:
            am = qm.message
            headers = dict(am.properties.headers or {})
            # x-death keeps one entry per (queue, reason), most recent first, with a count.
            deaths = [d for d in headers.get("x-death") or [] if isinstance(d, dict)]
            count = 1
            for old in deaths:
                if old.get("queue") == self.name and old.get("reason") == reason:
                    count = int(old.get("count", 1)) + 1
                    deaths.remove(old)
                    break
            death = {
                "queue": self.name,
                "reason": reason,
                "exchange": am.exchange,
                "routing-keys": [am.routing_key],
                "count": count,
            }
            headers["x-death"] = [death, *deaths][:16]
            headers["x-first-death-queue"] = headers.get("x-first-death-queue", self.name)
            headers["x-first-death-reason"] = headers.get("x-first-death-reason", reason)
            props = type(am.properties)(**{**am.properties.__dict__})
            props.headers = headers
            if reason == "expired":
                props.expiration = None
            key = self.dlx_key if self.dlx_key is not None else am.routing_key
            dead = AmqpMessage(self.dlx, key, props, am.body, incarnation=am.incarnation)
            targets = self.vhost.destinations(dead)
            if reason != "rejected":
                # A message dead-lettered back into its own queue without a client's
                # rejection would cycle forever (RabbitMQ drops such cycles as well).
                targets = [q for q in targets if q is not self]
            d = self.vhost.publish(dead, targets)
            d.addCallback(lambda _: self.settle(qm))
            d.addErrback(lambda f: self.settle(qm))
            return
        self.settle(qm)

    # -- delivering --------------------------------------------------------------------------

    def _pop_live(self, now: int) -> QueuedMessage | None:
        while self.ready:
            qm = self.ready.popleft()
            if qm.settled:
                continue
            if qm.expires_at_ms and qm.expires_at_ms <= now:
                self.dead_letter(qm, "expired")
                continue
            return qm
        return None

    def dispatch(self, now: int | None = None) -> None:
        """Hand ready messages to consumers with room, round robin."""
        if not self.consumers or not self.ready:
            return
        if now is None:
            now = _now_ms(self.vhost.clock)
        idle = 0
        while self.ready and idle < len(self.consumers):
            self._rr %= len(self.consumers)
            c = self.consumers[self._rr]
            self._rr += 1
            if not c.has_room(c):
                idle += 1
                continue
            qm = self._pop_live(now)
            if qm is None:
                return
            idle = 0
            c.deliver(c, qm)

    def take(self) -> QueuedMessage | None:
        """The next live message, for basic.get."""
        self.touch()
        return self._pop_live(_now_ms(self.vhost.clock))

    def caught_up(self) -> Deferred[None]:
        """Fires once every append routed here has reached the window (bounded wait)."""
        if self._is_caught_up():
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiters.append(d)

        def give_up() -> None:
            if d in self._waiters:
                self._waiters.remove(d)
                d.callback(None)

        self.vhost.clock.callLater(CATCH_UP_S, give_up)
        return d

    def _is_caught_up(self) -> bool:
        if self.appending > 0:
            return False
        if self.last_appended is None or self.ready or self.in_memory >= WINDOW // 2:
            # Nothing routed here yet, or messages to serve (older than what is still
            # coming), or a full window that waits for acks rather than for appends.
            return True
        return self.last_fed is not None and not self.last_fed < self.last_appended

    def _wake_waiters(self) -> None:
        if self._waiters and self._is_caught_up():
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    def appended(self, entry: Entry | None) -> None:
        """An append routed here finished (``entry`` None when it failed)."""
        self.appending -= 1
        if entry is not None and (
            self.last_appended is None or self.last_appended < entry.position
        ):
            self.last_appended = entry.position
        self._wake_waiters()

    @property
    def message_count(self) -> int:
        """Ready messages in the window."""
        return sum(1 for qm in self.ready if not qm.settled)

    def count(self) -> Deferred[int]:
        """Ready messages, including a durable queue's backlog beyond the window."""
        ready = self.message_count
        if self.memory_only or self.in_memory < WINDOW // 2:
            return succeed(ready)
        d = self.vhost.service.stats(self.topic)

        def backlog(stats: dict[str, Any]) -> int:
            sub = stats.get("subscriptions", {}).get(SUBSCRIPTION, {})
            unacked = self.in_memory - ready  # delivered to clients, not yet acknowledged
            return max(ready, int(sub.get("backlogMessages", 0)) - unacked)

        d.addCallback(backlog)
        d.addErrback(lambda f: ready)
        return d

    def add_consumer(self, c: QueueConsumer) -> None:
        if c.exclusive and self.consumers:
            raise AmqpError(
                RESOURCE_LOCKED, f"queue '{self.name}' in use; cannot consume exclusively"
            )
        if any(x.exclusive for x in self.consumers):
            raise AmqpError(
                RESOURCE_LOCKED, f"queue '{self.name}' has an exclusive consumer; cannot consume"
            )
        c.queue = self
        self.consumers.append(c)
        self.had_consumer = True
        self.touch()
        self.dispatch()

    def remove_consumer(self, c: QueueConsumer) -> None:
        if c in self.consumers:
            self.consumers.remove(c)
        c.queue = None
        self.touch()
        if self.auto_delete and self.had_consumer and not self.consumers and not self.deleted:
            self.vhost.delete_queue(self.name).addErrback(lambda f: None)

    def purge(self) -> int:
        """Drop every ready message, also those of a durable queue's backlog not yet read
        into the window; return how many the window held."""
        count = 0
        while self.ready:
            qm = self.ready.popleft()
            if not qm.settled:
                count += 1
                self.settle(qm)
        if not self.memory_only and self.last_appended is not None:
            self.purged_to = self.last_appended
        return count

    def _received_and_dropped(self, entry: Entry) -> None:
        self._ack_entry(entry.position)
        self._flow()  # the entry never entered the window: its permits are free again

    def touch(self) -> None:
        """The queue was used: restart its x-expires timer."""
        if self.expires_ms is None or self.deleted:
            return
        if self._expiry is not None and self._expiry.active():
            self._expiry.cancel()
        self._expiry = self.vhost.clock.callLater(self.expires_ms / 1000.0, self._expire)

    def _expire(self) -> None:
        if self.consumers:
            self.touch()
            return
        self.vhost.delete_queue(self.name).addErrback(lambda f: None)


def _int_arg(arguments: dict[str, Any], name: str) -> int | None:
    value = arguments.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AmqpError(PRECONDITION_FAILED, f"invalid arg '{name}' for queue: {value!r}")
    return value


class MemoryGauge:
    """Bytes held by memory-only queues against a high watermark (0: no limit); listeners
    hear when it is crossed upwards (True) and when usage falls back below it (False)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.high = False
        self.listeners: list[Callable[[bool], None]] = []

    def add(self, delta: int) -> None:
        self.used += delta
        if not self.limit:
            return
        high = self.used > self.limit
        if high != self.high and (high or self.used < self.limit * 0.9):
            self.high = high
            for listener in list(self.listeners):
                listener(high)


class Forwarder:
    """Feeds a queue bound to ``amq.topic`` from topics other protocols write (see module)."""

    def __init__(self, queue: Queue, pattern: str) -> None:
        self.queue = queue
        self.pattern = pattern
        self.topics: dict[str, ServerConsumer | None] = {}
        self._scan: LoopingCall | None = None
        self.closed = False

    def start(self) -> Deferred[Any]:
        """Subscribe to the matching topics there are; fires once subscribed."""
        if not routing.is_pattern(self.pattern):
            return self._attach(self.pattern)
        d = self.rescan()
        self._scan = LoopingCall(self.rescan)
        self._scan.clock = self.queue.vhost.clock
        self._scan.start(RESCAN_S, now=False).addErrback(lambda f: None)
        return d

    def rescan(self) -> Deferred[Any]:
        """Subscribe to matching topics created since the last scan."""
        vh = self.queue.vhost
        d = vh.service.topics_of_namespace(vh.namespace)

        def got(names: list[str]) -> Deferred[Any]:
            ds = []
            for full in names:
                local = full.rsplit("/", 1)[-1]
                if local.startswith("amqp."):
                    continue
                if routing.topic_matches(self.pattern, local):
                    ds.append(self._attach(local))
            return DeferredList(ds, consumeErrors=True)

        d.addCallback(got)
        d.addErrback(lambda f: None)
        return d

    def _attach(self, local: str) -> Deferred[Any]:
        if self.closed or local in self.topics or not _valid_local(local):
            return succeed(None)
        self.topics[local] = None
        vh = self.queue.vhost
        topic = f"persistent://{vh.namespace}/{local}"
        sink = _ForwardSink(self, topic)
        d = vh.service.subscribe(
            topic,
            f"amqp.fwd.{quote(self.queue.name, safe='')}",
            sink,
            SubType.EXCLUSIVE,
            InitialPosition.LATEST,
        )

        def attached(sc: ServerConsumer) -> None:
            if self.closed:
                sc.close()
                return
            self.topics[local] = sc
            sink.server_consumer = sc
            sc.flow(1000)

        def failed(f: Any) -> None:
            log.warning(
                "AMQP forwarder cannot subscribe", extra=kv(topic=topic, error=str(f.value))
            )
            self.topics.pop(local, None)

        d.addCallbacks(attached, failed)
        return d

    def close(self, unsubscribe: bool = False) -> None:
        self.closed = True
        if self._scan is not None and self._scan.running:
            self._scan.stop()
        for sc in self.topics.values():
            if sc is not None:
                (sc.unsubscribe() if unsubscribe else sc.close()).addErrback(lambda f: None)
        self.topics.clear()


class _ForwardSink:
    """Copies entries another protocol stored into the queue's topic, then acknowledges them."""

    _ids = itertools.count(1)

    def __init__(self, forwarder: Forwarder, topic: str) -> None:
        self.forwarder = forwarder
        self.topic = topic
        self.server_consumer: ServerConsumer | None = None
        self._id = next(self._ids)

    consumer_id = property(lambda self: self._id)
    consumer_name = property(lambda self: "amqp-forwarder")
    priority_level = property(lambda self: 0)

    def send_entries(self, deliveries: list[Delivery]) -> None:
        queue = self.forwarder.queue
        for d in deliveries:
            entry = d.entry
            data = entry.data
            try:
                messages = decode_entry(data)
            except MessageFormatError:
                messages = []
            # What AMQP published to amq.topic was routed to the queue directly already.
            keep = [m for m in messages if (P_EXCHANGE, "amq.topic") not in m.properties]
            sc = self.server_consumer
            if not keep or queue.deleted:
                if sc is not None:
                    sc.ack([entry.position]).addErrback(lambda f: None)
                    sc.flow(entry.num_messages)
                continue
            local = self.topic.rsplit("/", 1)[-1]
            for m in keep:
                m.properties = [
                    *(p for p in m.properties if not p[0].startswith("amqp.")),
                    (P_EXCHANGE, "amq.topic"),
                    (P_ROUTING_KEY, local),
                ]
            data = encode_entry(
                keep,
                producer_name="amqp-forwarder",
                sequence_id=-1,
                publish_time_ms=entry.publish_time_ms,
            )
            if queue.memory_only:
                for m in keep:
                    am = from_stored(m)
                    am.publish_time_ms = am.publish_time_ms or entry.publish_time_ms
                    queue.accept(am)
                if sc is not None:
                    sc.ack([entry.position]).addErrback(lambda f: None)
                    sc.flow(entry.num_messages)
                continue
            queue.appending += 1
            pd = queue.vhost.service.publish(queue.topic, data, num_messages=len(keep))

            def done(
                e: Entry | None, pos: Position = entry.position, n: int = entry.num_messages
            ) -> None:
                queue.appended(e)
                if self.server_consumer is not None:
                    self.server_consumer.ack([pos]).addErrback(lambda f: None)
                    self.server_consumer.flow(n)

            def failed(f: Any) -> None:
                queue.appended(None)

            pd.addCallbacks(done, failed)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        self.server_consumer = None


@dataclass
class _Stored:
    """How durable objects are written to the metadata store."""

    kind: str
    name: str
    body: dict[str, Any] = field(default_factory=dict)


def _args_out(arguments: dict[str, Any]) -> str:
    return base64.b64encode(encode_table(arguments)).decode("ascii")


def _args_in(text: str) -> dict[str, Any]:
    return decode_table(base64.b64decode(text)) if text else {}


class VirtualHost:
    """The exchanges and queues of one vhost (see the module docstring)."""

    def __init__(
        self,
        service: BrokerService,
        clock: IReactorTime,
        namespace: str,
        incarnation: str,
        gauge: MemoryGauge | None = None,
    ) -> None:
        self.gauge = gauge or MemoryGauge(0)
        self.service = service
        self.clock = clock
        self.namespace = namespace
        self.incarnation = incarnation
        self.exchanges: dict[str, routing.Exchange] = {
            name: routing.Exchange(name, kind) for name, kind in routing.PREDECLARED.items()
        }
        self.queues: dict[str, Queue] = {}
        self._root = f"/amqp/{namespace}"
        self._names = itertools.count(1)
        self._seq = 0
        self._pending: dict[str, _Batch] = {}
        self._flush_scheduled = False

    # -- persistence -------------------------------------------------------------------------

    def _path(self, kind: str, name: str) -> str:
        return f"{self._root}/{kind}/{quote(name, safe='') or '%'}"

    def _save(self, kind: str, name: str, body: dict[str, Any]) -> Deferred[Any]:
        return self.service.metadata_store.put(self._path(kind, name), json.dumps(body).encode())

    def _forget(self, kind: str, name: str) -> Deferred[Any]:
        d = self.service.metadata_store.delete(self._path(kind, name))
        d.addErrback(lambda f: None)
        return d

    @staticmethod
    def _binding_id(b: routing.Binding) -> str:
        raw = json.dumps([b.source, b.destination, b.kind, b.routing_key, repr(b.arguments)])
        return hashlib.sha1(raw.encode()).hexdigest()

    async def load(self) -> None:
        """Restore durable exchanges, queues and bindings."""
        store = self.service.metadata_store
        for kind in ("exchanges", "queues", "bindings"):
            for child in await store.children(f"{self._root}/{kind}"):
                got = await store.get(f"{self._root}/{kind}/{child}")
                if got is None:
                    continue
                body = json.loads(got.value)
                if kind == "exchanges":
                    name = unquote(child) if child != "%" else ""
                    self.exchanges[name] = routing.Exchange(
                        name,
                        body["type"],
                        durable=True,
                        auto_delete=body.get("auto_delete", False),
                        internal=body.get("internal", False),
                        arguments=_args_in(body.get("arguments", "")),
                    )
                elif kind == "queues":
                    name = unquote(child)
                    q = Queue(
                        self,
                        name,
                        durable=True,
                        exclusive_owner=None,
                        auto_delete=body.get("auto_delete", False),
                        arguments=_args_in(body.get("arguments", "")),
                    )
                    self.queues[name] = q
                    await q.start()
                else:
                    b = routing.Binding(
                        body["source"],
                        body["destination"],
                        body["kind"],
                        body["routing_key"],
                        routing.freeze_args(_args_in(body.get("arguments", ""))),
                    )
                    ex = self.exchanges.get(b.source)
                    if ex is not None and b not in ex.bindings:
                        ex.bindings.append(b)
                        await self._bound(b)

    def close(self) -> None:
        for q in self.queues.values():
            q.close()

    # -- exchanges ---------------------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        kind: str,
        *,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: dict[str, Any],
    ) -> Deferred[Any]:
        """exchange.declare (raises ``AmqpError``)."""
        ex = self.exchanges.get(name)
        if passive:
            if ex is None:
                raise AmqpError(NOT_FOUND, f"no exchange '{name}' in vhost '{self.namespace}'")
            return succeed(None)
        if ex is not None:
            if ex.type != kind or ex.durable != durable:
                raise AmqpError(
                    PRECONDITION_FAILED,
                    f"inequivalent arg for exchange '{name}': type {ex.type}, durable {ex.durable}",
                )
            return succeed(None)
        if name.startswith("amq."):
            raise AmqpError(403, f"exchange name '{name}' contains reserved prefix 'amq.*'")
        if kind not in routing.EXCHANGE_TYPES:
            raise AmqpError(503, f"invalid exchange type '{kind}'")
        self.exchanges[name] = routing.Exchange(
            name,
            kind,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        if durable:
            return self._save(
                "exchanges",
                name,
                {
                    "type": kind,
                    "auto_delete": auto_delete,
                    "internal": internal,
                    "arguments": _args_out(arguments),
                },
            )
        return succeed(None)

    def delete_exchange(self, name: str, if_unused: bool) -> Deferred[Any]:
        ex = self.exchanges.get(name)
        if ex is None:
            return succeed(None)  # RabbitMQ: deleting a missing exchange is fine
        if name == "" or name.startswith("amq."):
            raise AmqpError(403, f"cannot delete predeclared exchange '{name}'")
        if if_unused and ex.bindings:
            raise AmqpError(PRECONDITION_FAILED, f"exchange '{name}' in use")
        del self.exchanges[name]
        ds: list[Deferred[Any]] = []
        for b in list(ex.bindings):
            ds.append(self._unbind(ex, b))
        for other in self.exchanges.values():
            for b in list(other.bindings):
                if b.kind == routing.EXCHANGE and b.destination == name:
                    ds.append(self._unbind(other, b))
        if ex.durable:
            ds.append(self._forget("exchanges", name))
        return DeferredList(ds)

    def bind(
        self, source: str, destination: str, kind: str, key: str, arguments: dict[str, Any]
    ) -> Deferred[Any]:
        """queue.bind / exchange.bind."""
        ex = self.exchanges.get(source)
        if ex is None or source == "":
            if source == "":
                raise AmqpError(403, "operation not permitted on the default exchange")
            raise AmqpError(NOT_FOUND, f"no exchange '{source}' in vhost '{self.namespace}'")
        dest_durable = True
        if kind == routing.QUEUE:
            q = self.queues.get(destination)
            if q is None:
                raise AmqpError(NOT_FOUND, f"no queue '{destination}' in vhost '{self.namespace}'")
            dest_durable = q.durable
        else:
            dx = self.exchanges.get(destination)
            if dx is None:
                raise AmqpError(NOT_FOUND, f"no exchange '{destination}'")
            dest_durable = dx.durable
        b = routing.Binding(source, destination, kind, key, routing.freeze_args(arguments))
        if b in ex.bindings:
            return succeed(None)
        ex.bindings.append(b)
        forwarding = self._bound(b)
        if ex.durable and dest_durable:
            forwarding.addCallback(
                lambda _: self._save(
                    "bindings",
                    self._binding_id(b),
                    {
                        "source": source,
                        "destination": destination,
                        "kind": kind,
                        "routing_key": key,
                        "arguments": _args_out(arguments),
                    },
                )
            )
        return forwarding

    def _bound(self, b: routing.Binding) -> Deferred[Any]:
        """Start the forwarder a new ``amq.topic`` binding needs; fires once it reads."""
        if b.source == "amq.topic" and b.kind == routing.QUEUE:
            q = self.queues.get(b.destination)
            if q is not None and b.routing_key not in q.forwarders:
                fwd = Forwarder(q, b.routing_key)
                q.forwarders[b.routing_key] = fwd
                return fwd.start()
        return succeed(None)

    def unbind(
        self, source: str, destination: str, kind: str, key: str, arguments: dict[str, Any]
    ) -> Deferred[Any]:
        ex = self.exchanges.get(source)
        if ex is None:
            raise AmqpError(NOT_FOUND, f"no exchange '{source}' in vhost '{self.namespace}'")
        b = routing.Binding(source, destination, kind, key, routing.freeze_args(arguments))
        if b not in ex.bindings:
            return succeed(None)
        d = self._unbind(ex, b)
        if ex.auto_delete and not ex.bindings:
            self.delete_exchange(ex.name, False)
        return d

    def _unbind(self, ex: routing.Exchange, b: routing.Binding) -> Deferred[Any]:
        if b in ex.bindings:
            ex.bindings.remove(b)
        if b.source == "amq.topic" and b.kind == routing.QUEUE:
            q = self.queues.get(b.destination)
            if q is not None and not any(
                x.kind == routing.QUEUE
                and x.destination == q.name
                and x.routing_key == b.routing_key
                for x in ex.bindings
            ):
                fwd = q.forwarders.pop(b.routing_key, None)
                if fwd is not None:
                    fwd.close(unsubscribe=True)
        return self._forget("bindings", self._binding_id(b))

    # -- queues ------------------------------------------------------------------------------

    def server_name(self) -> str:
        return f"amq.gen-{self.incarnation}-{next(self._names)}"

    def get_queue(self, name: str, owner: object | None = None) -> Queue:
        """The queue, checking exclusive ownership (raises ``AmqpError``)."""
        q = self.queues.get(name)
        if q is None:
            raise AmqpError(NOT_FOUND, f"no queue '{name}' in vhost '{self.namespace}'")
        if q.exclusive_owner is not None and owner is not None and q.exclusive_owner is not owner:
            raise AmqpError(
                RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{name}' in vhost "
                f"'{self.namespace}'",
            )
        return q

    def declare_queue(
        self,
        name: str,
        *,
        owner: object,
        passive: bool,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: dict[str, Any],
    ) -> Deferred[Queue]:
        """queue.declare; fires with the queue once it reads its topic."""
        if passive:
            return succeed(self.get_queue(name, owner))
        existing = self.queues.get(name)
        if existing is not None:
            self.get_queue(name, owner)
            if existing.durable != durable:
                raise AmqpError(
                    PRECONDITION_FAILED,
                    f"inequivalent arg 'durable' for queue '{name}' in vhost '{self.namespace}'",
                )
            return succeed(existing)
        if name.startswith("amq.") and not name.startswith("amq.gen-"):
            raise AmqpError(403, f"queue name '{name}' contains reserved prefix 'amq.*'")
        q = Queue(
            self,
            name,
            durable=durable,
            exclusive_owner=owner if exclusive else None,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        self.queues[name] = q
        # Every queue is bound to the default exchange by its name (implicitly).
        d = q.start()
        if durable and not exclusive:
            d.addCallback(
                lambda _: self._save(
                    "queues",
                    name,
                    {"auto_delete": auto_delete, "arguments": _args_out(arguments)},
                )
            )

        def failed(f: Any) -> Any:
            self.queues.pop(name, None)
            return f

        d.addCallbacks(lambda _: q, failed)
        return d

    def delete_queue(
        self, name: str, *, if_unused: bool = False, if_empty: bool = False
    ) -> Deferred[int]:
        """queue.delete: cancel its consumers, drop its bindings and topic; fire with the
        number of ready messages it held."""
        q = self.queues.get(name)
        if q is None:
            return succeed(0)
        if if_unused and q.consumers:
            raise AmqpError(PRECONDITION_FAILED, f"queue '{name}' in use")
        if if_empty and q.message_count:
            raise AmqpError(PRECONDITION_FAILED, f"queue '{name}' not empty")
        count = q.message_count
        del self.queues[name]
        for c in list(q.consumers):
            q.consumers.remove(c)
            c.queue = None
            c.cancelled(c)
        ds: list[Deferred[Any]] = []
        for ex in self.exchanges.values():
            for b in list(ex.bindings):
                if b.kind == routing.QUEUE and b.destination == name:
                    ds.append(self._unbind(ex, b))
        for fwd in q.forwarders.values():
            fwd.close(unsubscribe=True)
        q.forwarders.clear()
        q.close()
        if q.durable:
            ds.append(self._forget("queues", name))
        if not q.memory_only:
            ds.append(self.service.delete_topic(q.topic, force=True))
        dl = DeferredList(ds, consumeErrors=True)
        dl.addCallback(lambda _: count)
        return dl  # type: ignore[return-value]

    def owner_gone(self, owner: object) -> None:
        """A connection closed: delete the exclusive queues it owned."""
        for name, q in list(self.queues.items()):
            if q.exclusive_owner is owner:
                self.delete_queue(name).addErrback(lambda f: None)

    # -- publishing --------------------------------------------------------------------------

    def destinations(self, msg: AmqpMessage) -> list[Queue]:
        """The queues a message reaches (raises ``AmqpError`` for a missing exchange)."""
        ex = self.exchanges.get(msg.exchange)
        if ex is None:
            raise AmqpError(NOT_FOUND, f"no exchange '{msg.exchange}' in vhost '{self.namespace}'")
        headers = msg.properties.headers
        if msg.exchange == "":
            q = self.queues.get(msg.routing_key)
            return [q] if q is not None else []
        extra: tuple[str, ...] = ()
        if headers:
            for h in ("CC", "BCC"):
                v = headers.get(h)
                if isinstance(v, list):
                    extra += tuple(str(x) for x in v)
        names = routing.route(self.exchanges, msg.exchange, msg.routing_key, headers, extra)
        return [self.queues[n] for n in names if n in self.queues]

    def publish(self, msg: AmqpMessage, queues: list[Queue] | None = None) -> Deferred[int]:
        """Store ``msg`` once per destination (and on topic R via ``amq.topic``); fire with the
        number of queues reached once every write is durable."""
        if queues is None:
            queues = self.destinations(msg)
        if not msg.persistent and not msg.incarnation:
            msg.incarnation = self.incarnation
        now = _now_ms(self.clock)
        stored = [q for q in queues if not q.memory_only]
        if len(stored) != len(queues):
            msg.publish_time_ms = now
            for q in queues:
                if q.memory_only:
                    q.accept(msg)
            reached = len(queues)
            queues = stored
        else:
            reached = len(queues)
        targets = [q.topic for q in queues]
        bridge = msg.exchange == "amq.topic" and _valid_local(msg.routing_key)
        if bridge:
            targets.append(f"persistent://{self.namespace}/{msg.routing_key}")
        if not targets:
            return succeed(reached)
        stored_message = to_stored(msg)
        size = len(msg.body) + 256
        ds: list[Deferred[Any]] = []
        for q in queues:
            q.appending += 1
            d = self._store(q.topic, stored_message, size)
            d.addBoth(_appended, q)
            ds.append(d)
        if bridge:
            ds.append(self._store(targets[-1], stored_message, size))
        if len(ds) == 1:
            # The common case: one destination, no list of Deferreds to wait on.
            one = ds[0]
            one.addCallback(lambda _: reached)
            return one
        dl = DeferredList(ds, fireOnOneErrback=True, consumeErrors=True)

        def unwrap(f: Any) -> Any:
            return f.value.subFailure if hasattr(f.value, "subFailure") else f

        dl.addCallbacks(lambda _: reached, unwrap)
        return dl  # type: ignore[return-value]

    # -- batching ----------------------------------------------------------------------------

    def _store(self, topic: str, message: Message, size: int) -> Deferred[Any]:
        """Append ``message`` to ``topic`` in the batch entry of this turn; fires with the
        stored entry once it is durable."""
        pending = self._pending.get(topic)
        if pending is not None and pending.size + size > BATCH_MAX_BYTES:
            self._flush_topic(topic)
            pending = None
        if pending is None:
            pending = self._pending[topic] = _Batch()
        d: Deferred[Any] = Deferred()
        pending.messages.append(message)
        pending.waiters.append(d)
        pending.size += size
        if len(pending.messages) >= BATCH_MAX_MESSAGES:
            self._flush_topic(topic)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self.clock.callLater(0, self.flush)
        return d

    def flush(self) -> None:
        """Send every batch being gathered (the end of a client's input, or of the turn)."""
        self._flush_scheduled = False
        for topic in list(self._pending):
            self._flush_topic(topic)

    def _flush_topic(self, topic: str) -> None:
        batch = self._pending.pop(topic, None)
        if batch is None:
            return
        now = _now_ms(self.clock)
        count = len(batch.messages)
        data = encode_entry(
            batch.messages, producer_name="amqp", sequence_id=self._seq, publish_time_ms=now
        )
        self._seq += count
        d = self.service.publish(topic, data, count, publish_time_ms=now)

        def done(entry: Any) -> None:
            for w in batch.waiters:
                w.callback(entry)

        def failed(f: Any) -> None:
            for w in batch.waiters:
                w.errback(f)

        d.addCallbacks(done, failed)


@dataclass
class _Batch:
    """Messages gathered for one topic in one turn, stored as one batch entry."""

    messages: list[Message] = field(default_factory=list)
    waiters: list[Deferred[Any]] = field(default_factory=list)
    size: int = 0


def _appended(result: Any, q: Queue) -> Any:
    q.appended(result if isinstance(result, Entry) else None)
    return result


def _valid_local(name: str) -> bool:
    return bool(name) and "/" not in name and ":" not in name
