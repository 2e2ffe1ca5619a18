"""Virtual hosts: exchanges, queues and bindings of one namespace, over the Broker API.

Design. Routing happens at publish time and stores each message once for the queues it reaches,
whatever their number: in the exchange's log, ``persistent://<ns>/amqp.exchange.<name>``, with
the names of those queues (``P_TO``), when it reaches several durable queues or one that reads
that log already; else in the one durable queue's own topic, ``amqp.queue.<name>``. A queue
reads each log it gets messages from through a durable subscription of its own (``amqp`` on its
own topic, ``amqp.q.<name>.<unique>`` on a shared one), created and recorded in the metadata
store before the first append that needs it, so a confirmed message is in every queue it was
routed to and a restart reads the same logs from the same positions. A queue keeps its own
messages of a shared log and acknowledges the others at once, so the log is trimmed once every
queue has passed an entry; an unbind leaves what was routed before it, and a queue an exchange no
longer routes to leaves that exchange's log once it has read and settled what it had there; a
deleted queue drops its subscriptions (a restart drops those of exclusive queues that did not
come back). Every queue is read from ordinary topics that any broker can own (no one-bundle
rule), and durability is the topics' durability. In a cluster one broker holds a vhost
(``handler``), and every Broker API call here (publish, subscribe, stats, last message id,
topic and subscription deletion) is made with ``forward=True``: a topic another broker owns is
served by that owner on this broker's behalf. A queue's message count takes a shared log's
unread part at the share of the queue's messages in what it read there (exact for a fanout).

Order: what one exchange routes to one queue keeps its publish order. Once a queue reads an
exchange's log, everything that exchange routes to it goes there; when it starts to, the log's
entries wait until the queue's own topic is read up to the last append issued before (by this
broker: at the first such switch after a restart, an older backlog of the own topic may
interleave). Messages that reach a queue through different exchanges may interleave (as
RabbitMQ allows).

A queue keeps a bounded window of what it read in memory; AMQP consumers, ``basic.get``,
prefetch, requeue and redelivered flags work on that window, and an entry is acknowledged on its
subscription once every message of it for the queue is settled (acked, dropped or dead-lettered);
the settled messages of a partly settled entry are recorded in the metadata store (at the cursor's
pace, and before a ``tx.commit-ok``) so they are not handed out again. ``x-max-length`` counts
the backlog beyond the window too (drop-head frees the window's head, letting the backlog in).
A transient (non-durable) queue does not outlive this broker, so, as in RabbitMQ, it holds its
messages in memory only, against the handler's ``MemoryGauge`` (publishers are blocked above
its watermark).

``amq.topic`` bridges to the other protocols: a publish with routing key R is also written to
topic R (one more copy, whatever the number of queues); a queue bound to ``amq.topic`` with key
P reads each topic matching P (a ``Forwarder`` finds them), where messages other protocols
produce are routed on read by the queue's current ``amq.topic`` bindings (the AMQP copies are
skipped there: the queues have those from the exchange).

Durable exchanges, queues, bindings and the logs each queue reads are kept in the metadata store
under ``/amqp/<tenant>/<ns>/``; transient messages in durable queues carry the incarnation that
stored them and are dropped when a later incarnation reads them.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from twisted.internet.defer import Deferred, DeferredList, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import Delivery, LastMessageId, SubType
from polybroker.broker_core.errors import ConsumerBusyError
from polybroker.broker_core.forwarding import ConsumerHandle
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
    P_TO,
    AmqpMessage,
    decode_to,
    encode_to,
    from_stored,
    to_stored,
)

if TYPE_CHECKING:
    from polybroker.broker_core.service import BrokerService

log = logging.getLogger(__name__)

SUBSCRIPTION = "amqp"
#: Messages a queue keeps in memory (ready plus unacknowledged) from one log it reads...
WINDOW = 2000
#: ... and above which it reads from none.
QUEUE_WINDOW = 2 * WINDOW
#: How many of the latest entries it stored a vhost keeps the messages of (see ``messages_of``).
STORED_KEEP = 64
STORED_MAX_BYTES = 64 * 1024
#: What a message held by a memory-only queue costs beyond its body (its objects, properties
#: and queue slot; measured about 400 bytes), counted by the memory gauge with the body.
HELD_OVERHEAD = 400
#: How long a basic.get waits for messages whose append is still under way.
CATCH_UP_S = 2.0
#: How often wildcard forwarders look for new topics.
RESCAN_S = 5.0
#: How long a queue keeps subscribing again to a log whose subscription is still held by
#: another consumer (the previous owner of the vhost letting go), and how often it retries
#: a log it lost.
BUSY_RETRY_S = 30.0
REATTACH_S = 1.0
#: Publishes to one topic within one client input (or reactor turn) share a batch entry of at
#: most this many messages and bytes.
BATCH_MAX_MESSAGES = 500
BATCH_MAX_BYTES = 512 * 1024
#: How often a queue writes which messages of its partly settled entries are settled (the
#: cursor's own mark-delete rate: acknowledgements are durable at that pace, or at a tx.commit).
SETTLED_PERSIST_S = 1.0


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
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.tag = tag
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0
        self.deliver = deliver
        self.has_room = has_room
        self.cancelled = cancelled
        #: Called once a dispatch that delivered to this consumer ends (its deliveries may
        #: have been gathered for one write).
        self.flush = flush
        self.queue: Queue | None = None


#: What a queue reads: its own topic, the log of an exchange (messages stored once for several
#: queues) or a topic bridged through ``amq.topic``.
OWN = "own"
SHARED = "shared"
BRIDGE = "bridge"


@dataclass(slots=True)
class _EntryRef:
    position: Position | None  # None: a message held in memory only
    remaining: int
    source: _Source | None = None


@dataclass(slots=True)
class QueuedMessage:
    """One message of a queue's window (``index``: its place in the stored entry)."""

    ref: _EntryRef
    message: AmqpMessage
    redelivered: bool = False
    expires_at_ms: int = 0
    settled: bool = False
    index: int = 0


class _Source:
    """One log a queue reads through a subscription of its own (the broker-side ``Consumer``).

    The queue's own topic (subscription ``amqp``) holds what was routed to it alone. A log that
    several queues read (an exchange's log, or a topic bridged through ``amq.topic``; the
    subscription is ``amqp.q.<queue>.<unique>``) holds each message once, with the queues it was
    routed to in ``P_TO``; the queue keeps its own messages and acknowledges the others unread by
    any client. A bridged topic's messages from other protocols (no ``P_TO``) are routed on read.
    """

    _ids = itertools.count(1)

    def __init__(self, queue: Queue, topic: str, kind: str, subscription: str) -> None:
        self.queue = queue
        self.topic = topic
        self.kind = kind
        self.local = topic.rsplit("/", 1)[-1]
        self.subscription = subscription
        self.server_consumer: ConsumerHandle | None = None
        #: The subscription exists (the cursor is durable unless the queue is transient).
        self.created = False
        self.closed = False
        self.dropped = False
        self.waiters: list[Deferred[None]] = []
        self.failure: Any = None
        self.granted = 0
        self.received = 0
        #: Messages of this source in the queue's window.
        self.in_memory = 0
        self.last_appended: Position | None = None
        self.last_fed: Position | None = None
        #: Entries up to here were purged before the window read them.
        self.purged_to: Position | None = None
        self.acks: list[Position] = []
        #: Appends routed here through this log: issued, and finished (in that order).
        self.issued = 0
        self.done = 0
        #: A shared log a queue starts reading while its own topic still has messages to
        #: feed holds its entries back until the own topic is read up to the append that
        #: was issued last before (ticket), at ``barrier_pos``, keeping one exchange's order.
        self.barrier_ticket: int | None = None
        self.barrier_pos: Position | None = None
        self.held: list[Delivery] = []
        #: Messages read from this log, and those of them that were the queue's.
        self.read = 0
        self.accepted = 0
        #: A shared log's exchange; once that no longer routes to the queue, the source is
        #: retired when the queue has read (``retire_at``: the log's end then, None if empty)
        #: and settled all of it.
        self.exchange: str | None = None
        self.retiring = False
        self.retire_known = False
        self.retire_at: Position | None = None
        #: The settled messages of entries partly settled (bit i = message i of the entry),
        #: kept in the metadata store (``SETTLED_PERSIST_S``) so that neither a restart nor
        #: a new subscription hands them out again; an entry leaves once its ack is durable.
        self.partial: dict[Position, int] = {}
        self.partial_loaded = False
        #: For x-max-length: the messages of each entry read and not yet acknowledged on
        #: the subscription (what of its backlog the window has seen).
        self.seen: dict[Position, int] | None = {} if queue.max_length is not None else None
        #: A new subscription reads from the start, skipping entries published before this
        #: (a bridged topic found after its binding started); None: it starts at the end.
        self.not_before_ms: int | None = None
        self._partial_dirty = False
        self._partial_writing = False
        self._partial_timer: IDelayedCall | None = None
        self._partial_last = 0.0
        self._partial_next: list[Deferred[None]] = []
        self._partial_inflight: list[Deferred[None]] = []
        self._discarded = False
        self._id = next(self._ids)

    # -- Consumer ----------------------------------------------------------------------------

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
        self.queue.fed(self, deliveries)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        self.server_consumer = None
        self.queue.source_lost(self)

    # -- subscription ------------------------------------------------------------------------

    def attach(self) -> Deferred[None]:
        """Subscribe (creating the subscription if it is new); fires once subscribed.

        The log may live on another broker of a cluster (the subscription is forwarded to
        its owner). In a cluster, while the subscription is still held by another consumer
        (a previous owner of the vhost letting go) it is tried again for ``BUSY_RETRY_S``."""
        vh = self.queue.vhost
        return Deferred.fromCoroutine(self._attach(vh.clock.seconds() + BUSY_RETRY_S))

    async def _attach(self, deadline: float) -> None:
        vh = self.queue.vhost
        if not self.partial_loaded and self.queue.recorded:
            self.partial_loaded = True
            for position, bits in (await vh.load_settled(self)).items():
                self.partial[position] = self.partial.get(position, 0) | bits
        delay = 0.1
        while True:
            try:
                sc = await vh.service.subscribe(
                    self.topic,
                    self.subscription,
                    self,
                    SubType.EXCLUSIVE,
                    InitialPosition.EARLIEST
                    if self.kind == OWN or self.not_before_ms is not None
                    else InitialPosition.LATEST,
                    durable=not self.queue.memory_only,
                    forward=True,
                )
                break
            except ConsumerBusyError:
                if not vh.clustered or self.closed or vh.clock.seconds() + delay > deadline:
                    raise
            await _sleep(vh.clock, delay)
            delay = min(delay * 2, 1.0)
        self._attached(sc)

    def _attached(self, sc: ConsumerHandle) -> None:
        self.created = True
        if self.closed:
            (sc.unsubscribe() if self.dropped else sc.close()).addErrback(lambda f: None)
            return
        self.server_consumer = sc
        self.granted = self.received = 0
        self.queue._flow()

    def ready(self) -> Deferred[None]:
        """Fires once the subscription exists (at once if it does)."""
        if self.created:
            return succeed(None)
        if self.failure is not None:
            return fail(self.failure)
        d: Deferred[None] = Deferred()
        self.waiters.append(d)
        return d

    def settled_attach(self, failure: Any = None) -> None:
        """The subscription exists, or could not be made (``failure``): tell the waiters."""
        self.failure = failure
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            if failure is None:
                w.callback(None)
            else:
                w.errback(failure)

    def ack(self, position: Position) -> None:
        # Acks of one reactor turn go to the subscription together.
        self.acks.append(position)
        if len(self.acks) == 1:
            self.queue.vhost.soon(self._flush_acks)

    def _flush_acks(self) -> Deferred[None] | None:
        acks, self.acks = self.acks, []
        if not acks or self.server_consumer is None:
            return None
        d = self.server_consumer.ack(acks)
        seen = self.seen
        if seen:
            for p in acks:
                seen.pop(p, None)
        if self.partial:
            d.addCallback(lambda _: self._forget_partial(acks))
        d.addErrback(lambda f: None)
        return d

    # -- settled messages of partly settled entries ----------------------------------------

    def settle_part(self, position: Position, index: int) -> None:
        """Message ``index`` of the entry at ``position`` is settled, others of it are not."""
        self.partial[position] = self.partial.get(position, 0) | (1 << index)
        if self.queue.recorded:
            self._partial_changed()

    def _forget_partial(self, acks: list[Position]) -> None:
        """These entries are acknowledged durably: their settled messages need no record."""
        changed = False
        for p in acks:
            if self.partial.pop(p, None) is not None:
                changed = True
        if changed and self.queue.recorded:
            self._partial_changed()

    def _partial_changed(self) -> None:
        if self._discarded:
            return
        self._partial_dirty = True
        if self._partial_writing or self._partial_timer is not None:
            return
        clock = self.queue.vhost.clock
        delay = self._partial_last + SETTLED_PERSIST_S - clock.seconds()
        if delay <= 0:
            self._write_partial()
        else:
            self._partial_timer = clock.callLater(delay, self._write_partial)

    def _write_partial(self) -> None:
        if self._partial_timer is not None and self._partial_timer.active():
            self._partial_timer.cancel()
        self._partial_timer = None
        self._partial_dirty = False
        self._partial_writing = True
        self._partial_inflight.extend(self._partial_next)
        self._partial_next = []
        vh = self.queue.vhost
        self._partial_last = vh.clock.seconds()
        d = vh.save_settled(self)

        def written(result: Any) -> None:
            if isinstance(result, Failure):
                log.warning("AMQP settled messages not recorded", extra=kv(error=str(result.value)))
                self._partial_dirty = True
            self._partial_writing = False
            waiters, self._partial_inflight = self._partial_inflight, []
            for w in waiters:
                w.callback(None)
            if self._discarded:
                vh.forget_settled(self)  # the subscription went while this was written
            elif self._partial_dirty and self._partial_next:
                self._write_partial()  # a tx.commit waits for it
            elif self._partial_dirty:
                self._partial_changed()

        d.addBoth(written)

    def discard_settled(self) -> None:
        """The subscription is gone: drop the record of partly settled entries."""
        self._discarded = True
        self.partial.clear()
        self._partial_dirty = False
        if self._partial_timer is not None and self._partial_timer.active():
            self._partial_timer.cancel()
        self._partial_timer = None
        if self.queue.recorded:
            self.queue.vhost.forget_settled(self)

    def sync(self) -> Deferred[None]:
        """Fires once what the queue settled so far is durable: written now to the record
        (entries settled whole since the last ack flush as well, marked -1, until their
        acks on the subscription are durable), without waiting for the cursor's pace."""
        if self.queue.recorded and not self._discarded:
            for p in self.acks:
                self.partial[p] = -1
                self._partial_dirty = True
        d: Deferred[None] = succeed(None)
        if self._partial_dirty or self._partial_writing:
            d = Deferred()
            if self._partial_dirty:
                self._partial_next.append(d)
                if not self._partial_writing:
                    self._write_partial()
            else:
                self._partial_inflight.append(d)
        self._flush_acks()  # after the record holds them: it forgets them once durable
        return d

    def close(self, unsubscribe: bool = False) -> None:
        """Stop reading; ``unsubscribe`` also deletes the subscription (the queue is gone)."""
        self.closed = True
        self.dropped = unsubscribe
        if self._partial_timer is not None and self._partial_timer.active():
            self._partial_timer.cancel()
        self._partial_timer = None
        if unsubscribe:
            self.discard_settled()
        elif self._partial_dirty and not self._partial_writing:
            self._write_partial()  # the next owner reads on from here
        sc, self.server_consumer = self.server_consumer, None
        if sc is not None:
            (sc.unsubscribe() if unsubscribe else sc.close()).addErrback(lambda f: None)

    # -- routing on read ---------------------------------------------------------------------

    def accepts(self, m: Message) -> bool:
        """Whether a message of this log belongs to the queue (see the class docstring)."""
        if self.kind == OWN:
            return True
        to: str | None = None
        exchange: str | None = None
        for k, v in m.properties:
            if k == P_TO:
                to = v
            elif k == P_EXCHANGE:
                exchange = v
        if to is not None:
            return self.queue.name in decode_to(to)
        if self.kind != BRIDGE or exchange == "amq.topic":
            # Not routed here, or an AMQP publish stored before P_TO existed (those were
            # routed to the queue's own topic directly).
            return False
        if not self.queue.vhost.bridge_bound(self.queue.name, self.local):
            return False
        m.properties = [
            *(p for p in m.properties if not p[0].startswith("amqp.")),
            (P_EXCHANGE, "amq.topic"),
            (P_ROUTING_KEY, self.local),
        ]
        return True


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
        #: The logs this queue reads, by topic.
        self.sources: dict[str, _Source] = {}
        self.deleted = False
        self.had_consumer = False
        #: Appends routed here that have not finished.
        self.in_flight = 0
        self._waiters: list[Deferred[None]] = []
        self.ttl_ms = _int_arg(arguments, "x-message-ttl")
        self.expires_ms = _int_arg(arguments, "x-expires")
        self.max_length = _int_arg(arguments, "x-max-length")
        overflow = arguments.get("x-overflow", "drop-head")
        if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
            raise AmqpError(
                PRECONDITION_FAILED, f"invalid arg 'x-overflow' for queue: {overflow!r}"
            )
        #: reject-publish: a full queue refuses new messages (nacked) instead of dropping
        #: its oldest ones.
        self.reject_publish = overflow != "drop-head"
        #: Messages routed here and stored that the window has not read yet (the backlog
        #: in the logs, counted for ``x-max-length``; after a restart, taken from the own
        #: topic's backlog).
        self.unread = 0
        self.dlx: str | None = arguments.get("x-dead-letter-exchange")
        self.dlx_key: str | None = arguments.get("x-dead-letter-routing-key")
        self._expiry: IDelayedCall | None = None
        self._ttl_timer: IDelayedCall | None = None
        self.forwarders: dict[str, Forwarder] = {}

    @property
    def recorded(self) -> bool:
        """Whether the queue is kept in the metadata store (and so are the logs it reads:
        those of an exclusive one too, so that a restart removes its subscriptions)."""
        return not self.memory_only

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Subscribe to the queue's own topic (a transient queue has none)."""
        self.touch()
        if self.memory_only:
            return succeed(None)
        own = _Source(self, self.topic, OWN, SUBSCRIPTION)
        self.sources[self.topic] = own
        d = own.attach()
        if self.max_length is not None:
            d.addCallback(lambda _: self._count_backlog(own))
        return d

    def _count_backlog(self, own: _Source) -> None:
        """Count the own topic's backlog beyond the window (a restart), for x-max-length."""

        def got(stats: dict[str, Any]) -> None:
            sub = stats.get("subscriptions", {}).get(own.subscription, {})
            backlog = int(sub.get("backlogMessages", 0))
            seen = sum(own.seen.values()) if own.seen else 0
            self.unread = max(self.unread, backlog - seen)
            self._enforce_max_length()

        d = self.vhost.service.stats(own.topic, forward=True)
        d.addCallbacks(got, lambda f: None)

    def ensure_source(
        self,
        topic: str,
        kind: str,
        subscription: str | None = None,
        exchange: str | None = None,
        not_before_ms: int | None = None,
    ) -> Deferred[None] | None:
        """Make sure the queue reads ``topic``: None when it does already, else a Deferred
        that fires once its subscription exists (recorded first, so a restart finds it).
        With ``not_before_ms`` a new subscription starts at the topic's start and skips
        what was published before then.

        A new subscription gets a name of its own (``amqp.q.<queue>.<unique>``), so a queue
        declared again under an old name never inherits what the old one left."""
        s = self.sources.get(topic)
        if s is not None:
            return None if s.created else s.ready()
        if self.deleted:
            return None
        restored = subscription is not None
        if subscription is None:
            subscription = f"amqp.q.{quote(self.name, safe='')}.{self.vhost.unique()}"
        s = _Source(self, topic, kind, subscription)
        s.exchange = exchange
        s.not_before_ms = not_before_ms
        own = self.sources.get(self.topic)
        if kind == SHARED and own is not None and own.issued:
            s.barrier_ticket = own.issued
            if own.done >= own.issued:
                s.barrier_pos = own.last_appended
        self.sources[topic] = s
        record = self.recorded and not restored
        d = self.vhost.record_source(self, s) if record else succeed(None)
        d.addCallback(lambda _: s.attach())

        def failed(f: Any) -> None:
            log.warning("AMQP queue cannot read a log", extra=kv(topic=topic, error=str(f.value)))
            if self.sources.get(topic) is s:
                del self.sources[topic]
            s.settled_attach(f)

        d.addCallbacks(lambda _: s.settled_attach(), failed)
        return s.ready()

    def retire_from(self, last: LastMessageId | None, s: _Source) -> None:
        """The end of a log being retired is known (None: it could not be asked)."""
        if not s.retiring:
            return
        if last is None:
            s.retiring = False  # try again at the next binding change
            return
        s.retire_known = True
        s.retire_at = last.position if last.position.entry_id >= 0 else None
        self.maybe_retire(s)

    def maybe_retire(self, s: _Source) -> None:
        """Drop a retiring source once everything it held for the queue is read and settled."""
        if not s.retire_known or not s.retiring or s.closed or self.deleted:
            return
        if s.in_memory or s.held or s.issued != s.done:
            return
        # Read up to the log's end when the exchange stopped routing here, and up to the
        # last append routed here (one still in flight then ends after that end).
        for end in (s.retire_at, s.last_appended):
            if end is not None and (s.last_fed is None or s.last_fed < end):
                return
        if self.sources.get(s.topic) is not s:
            return
        del self.sources[s.topic]
        s.close(unsubscribe=True)
        if self.recorded:
            self.vhost._forget_source(self, s.topic)
        self._flow()

    def source_lost(self, s: _Source) -> None:
        """The broker closed a source's subscription (topic unloaded): drop what the window
        holds of it and subscribe again."""
        if self.deleted or s.closed or self.sources.get(s.topic) is not s:
            return
        kept: deque[QueuedMessage] = deque()
        for qm in self.ready:
            if qm.ref.source is s and not qm.settled:
                qm.settled = True
                self.in_memory -= 1
                s.in_memory -= 1
            elif not qm.settled:
                kept.append(qm)
        self.ready = kept
        s.held.clear()
        s.granted = s.received = 0
        self._reattach(s)

    def _reattach(self, s: _Source) -> None:
        """Subscribe to a lost log again, every ``REATTACH_S`` until it works (its owner may
        be moving to another broker) or the queue stops reading it."""
        if self.deleted or s.closed or self.sources.get(s.topic) is not s:
            return

        def failed(f: Any) -> None:
            log.warning("AMQP queue feeder lost", extra=kv(topic=s.topic, error=str(f.value)))
            self.vhost.clock.callLater(REATTACH_S, self._reattach, s)

        s.attach().addErrback(failed)

    def close(self) -> None:
        """Stop reading (broker shutdown); the subscriptions keep their positions."""
        self.deleted = True
        if self.memory_only:
            while self.ready:
                self.settle(self.ready.popleft())
        for timer in (self._expiry, self._ttl_timer):
            if timer is not None and timer.active():
                timer.cancel()
        for fwd in self.forwarders.values():
            fwd.close()
        for s in self.sources.values():
            s.close()

    # -- feeding -----------------------------------------------------------------------------

    def _flow(self) -> None:
        """Let each log feed up to ``WINDOW`` messages in memory or on their way, while the
        queue holds fewer than ``QUEUE_WINDOW`` from all of them."""
        if self.in_memory >= QUEUE_WINDOW:
            return
        for s in self.sources.values():
            want = WINDOW - s.in_memory - (s.granted - s.received)
            if want >= WINDOW // 4 and s.server_consumer is not None:
                s.granted += want
                s.server_consumer.flow(want)

    def fed(self, source: _Source, deliveries: list[Delivery]) -> None:
        """Entries from one of the queue's logs: decode this queue's messages into the
        window, acknowledge the rest."""
        if self.sources.get(source.topic) is not source or source.closed:
            return
        if source.held or not self._barrier_passed(source):
            source.held.extend(deliveries)
            return
        now = _now_ms(self.vhost.clock)
        seen = source.seen
        incarnation = self.vhost.incarnation
        ttl = self.ttl_ms is not None
        append = self.ready.append
        for d in deliveries:
            entry = d.entry
            source.received += entry.num_messages
            if seen is not None:
                seen[entry.position] = entry.num_messages
            if source.last_fed is None or source.last_fed < entry.position:
                source.last_fed = entry.position
            early = source.not_before_ms
            if early is not None and entry.publish_time_ms < early:
                source.ack(entry.position)  # published before the binding covered the topic
                continue
            purged = source.purged_to
            if purged is not None and d.redelivery_count == 0 and not purged < entry.position:
                # Purged while still beyond the window: acknowledged unread.
                source.ack(entry.position)
                continue
            try:
                # A bridge's routing may rewrite a message's properties (``accepts``): it
                # decodes its own copy rather than share the vhost's kept messages.
                messages = (
                    decode_entry(entry.data)
                    if source.kind == BRIDGE
                    else self.vhost.messages_of(entry.data)
                )
            except MessageFormatError:
                log.warning("AMQP queue skips a malformed entry", extra=kv(topic=source.topic))
                source.ack(entry.position)
                continue
            indexed = list(enumerate(messages))
            if source.kind != OWN:
                source.read += len(messages)
                indexed = [(i, m) for i, m in indexed if source.accepts(m)]
                source.accepted += len(indexed)
            done = source.partial.get(entry.position, 0) | d.acked_indexes
            if done:
                # Settled before (a restart, or the subscription read again): not again.
                indexed = [(i, m) for i, m in indexed if not done >> i & 1]
            if not indexed:
                source.ack(entry.position)
                continue
            count = len(indexed)
            ref = _EntryRef(entry.position, count, source)
            redelivered = d.redelivery_count > 0
            if self.unread:
                self.unread = max(0, self.unread - count)
            self.in_memory += count
            source.in_memory += count
            for i, m in indexed:
                am = from_stored(m)
                if not am.publish_time_ms:
                    am.publish_time_ms = entry.publish_time_ms
                qm = QueuedMessage(ref, am, redelivered, 0, False, i)
                if am.incarnation and am.incarnation != incarnation:
                    self.settle(qm)  # a transient message from before a restart
                    append = self.ready.append  # (settling may have let more in)
                    continue
                if ttl or am.properties.expiration:
                    qm.expires_at_ms = self._expiry_of(am)
                append(qm)
        self._enforce_max_length()
        self._wake_waiters()
        self.dispatch(now)
        self._schedule_expiry()
        self._flow()
        if source.kind == OWN:
            if len(self.sources) > 1:
                self._release_held()
        elif source.retiring:
            self.maybe_retire(source)

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
        self.vhost.gauge.add(len(am.body) + HELD_OVERHEAD)
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
        """Drop (or dead-letter) from the head while the ready messages, in the window and
        in the backlog the window has not read, exceed x-max-length (drop-head); the head
        is in the window, and the room that frees lets the backlog in behind it."""
        if self.max_length is None or self.reject_publish:
            return
        while self.ready and len(self.ready) + self.unread > self.max_length:
            qm = self.ready.popleft()
            if not qm.settled:
                self.dead_letter(qm, "maxlen")

    def full(self) -> bool:
        """A reject-publish queue at its x-max-length refuses new messages."""
        return (
            self.reject_publish
            and self.max_length is not None
            and len(self.ready) + self.unread >= self.max_length
        )

    # -- settling ----------------------------------------------------------------------------

    def settle(self, qm: QueuedMessage) -> None:
        """The message is done with (acked, dropped or dead-lettered)."""
        if qm.settled:
            return
        qm.settled = True
        self.in_memory -= 1
        ref = qm.ref
        ref.remaining -= 1
        source = ref.source
        if source is None or ref.position is None:
            self.vhost.gauge.add(-len(qm.message.body) - HELD_OVERHEAD)
            return
        source.in_memory -= 1
        if ref.remaining == 0:
            source.ack(ref.position)
        else:
            source.settle_part(ref.position, qm.index)
        self._flow()
        if source.retiring:
            self.maybe_retire(source)

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
        delivered: list[QueueConsumer] = []
        try:
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
                if c.flush is not None and not any(c is x for x in delivered):
                    delivered.append(c)
        finally:
            for c in delivered:
                assert c.flush is not None
                c.flush()

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
        if self.in_flight > 0:
            return False
        if self.ready or self.in_memory >= WINDOW // 2:
            # Messages to serve (older than what is still coming), or a full window that
            # waits for acks rather than for appends.
            return True
        for s in self.sources.values():
            # Something routed here that the window has not read yet.
            if s.last_appended is not None and (s.last_fed is None or s.last_fed < s.last_appended):
                return False
        return True

    def _wake_waiters(self) -> None:
        if self._waiters and self._is_caught_up():
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                d.callback(None)

    def appending(self, topic: str) -> None:
        """An append routed here (to ``topic``) is issued."""
        self.in_flight += 1
        s = self.sources.get(topic)
        if s is not None:
            s.issued += 1

    def appended(self, topic: str, entry: Entry | None) -> None:
        """An append routed here (to ``topic``) finished (``entry`` None when it failed)."""
        self.in_flight -= 1
        s = self.sources.get(topic)
        if s is not None:
            s.done += 1
            if entry is not None and (s.last_appended is None or s.last_appended < entry.position):
                s.last_appended = entry.position
            if s.kind == OWN and len(self.sources) > 1:
                for other in self.sources.values():
                    if other.barrier_ticket is not None and other.barrier_ticket == s.done:
                        other.barrier_pos = s.last_appended
                self._release_held()
        self._wake_waiters()

    def _barrier_passed(self, s: _Source) -> bool:
        if s.barrier_ticket is None:
            return True
        own = self.sources.get(self.topic)
        if own is not None and own.done < s.barrier_ticket:
            return False
        pos = s.barrier_pos
        if own is None or pos is None or (own.last_fed is not None and not own.last_fed < pos):
            s.barrier_ticket = s.barrier_pos = None
            return True
        return False

    def _release_held(self) -> None:
        for s in list(self.sources.values()):
            if s.held and self._barrier_passed(s):
                held, s.held = s.held, []
                self.fed(s, held)

    def sync(self) -> Deferred[Any]:
        """Fires once what this queue settled so far is durable (``tx.commit``)."""
        ds = [s.sync() for s in self.sources.values()]
        return DeferredList(ds, consumeErrors=True) if ds else succeed(None)

    @property
    def message_count(self) -> int:
        """Ready messages in the window."""
        return sum(1 for qm in self.ready if not qm.settled)

    def count(self) -> Deferred[int]:
        """Ready messages, with the backlog beyond the window: exact for the queue's own
        topic; for a shared log, its unread part times the share of the queue's messages in
        what it read there (exact for a fanout's log)."""
        ready = self.message_count
        full = [s for s in self.sources.values() if s.in_memory >= WINDOW // 2]
        if not full:
            return succeed(ready)
        ds = [self.vhost.service.stats(s.topic, forward=True) for s in full]
        dl = DeferredList(ds, consumeErrors=True)

        def total(results: list[tuple[bool, Any]]) -> int:
            n = ready
            for s, (ok, stats) in zip(full, results, strict=True):
                if not ok:
                    continue
                sub = stats.get("subscriptions", {}).get(s.subscription, {})
                backlog = int(sub.get("backlogMessages", 0))
                in_window = sum(1 for qm in self.ready if qm.ref.source is s and not qm.settled)
                unacked = s.in_memory - in_window  # delivered to clients, not yet acknowledged
                # Settled messages of partly settled entries still count in the backlog.
                backlog -= sum(bits.bit_count() for bits in s.partial.values() if bits > 0)
                if s.kind == OWN:
                    n += max(in_window, backlog - unacked) - in_window
                else:
                    share = s.accepted / s.read if s.read else 1.0
                    n += round(max(0, backlog - s.in_memory) * share)
            return n

        dl.addCallback(total)
        return dl  # type: ignore[return-value]

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

    def purge(self) -> Deferred[int]:
        """Drop every ready message, and the backlog not yet read into the window up to the
        last entry each log holds; fire with how many the window held once those ends are
        known (messages delivered and not yet acknowledged stay)."""
        for s in self.sources.values():
            if s.last_appended is not None:
                s.purged_to = s.last_appended
        count = self._drop_ready(None)
        ds: list[Deferred[Any]] = []
        for s in list(self.sources.values()):
            d = self.vhost.service.last_message_id(s.topic, forward=True)
            d.addCallback(self._purge_to, s)
            ds.append(d)
        dl = DeferredList(ds, consumeErrors=True)
        dl.addCallback(lambda _: count)
        return dl  # type: ignore[return-value]

    def _purge_to(self, last: LastMessageId, s: _Source) -> None:
        position = last.position
        if position.entry_id < 0 or (s.purged_to is not None and not s.purged_to < position):
            return
        s.purged_to = position
        self._drop_ready(s)  # what the window read while the end was asked

    def _drop_ready(self, source: _Source | None) -> int:
        """Settle the ready messages (of ``source`` only, up to its purge point, if given)."""
        count = 0
        kept: deque[QueuedMessage] = deque()
        # Settling frees window room, and the feed it lets in may append to ``ready``.
        items, self.ready = self.ready, deque()
        for qm in items:
            if qm.settled:
                continue
            ref = qm.ref
            if source is not None and (
                ref.source is not source
                or qm.redelivered
                or ref.position is None
                or source.purged_to is None
                or source.purged_to < ref.position
            ):
                kept.append(qm)
                continue
            count += 1
            self.settle(qm)
        kept.extend(self.ready)
        self.ready = kept
        return count

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


# The arguments a redeclaration must repeat, as RabbitMQ checks them (others may differ), and
# the value of each that giving none means.
_QUEUE_ARGS: dict[str, Any] = {
    "x-expires": None,
    "x-message-ttl": None,
    "x-dead-letter-exchange": None,
    "x-dead-letter-routing-key": None,
    "x-max-length": None,
    "x-max-length-bytes": None,
    "x-max-priority": None,
    "x-overflow": "drop-head",
    "x-queue-mode": None,
    "x-queue-type": "classic",
    "x-single-active-consumer": False,
}
_EXCHANGE_ARGS: dict[str, Any] = {"alternate-exchange": None}


def _equivalence_args(arguments: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
    return {k: arguments.get(k, default) for k, default in checked.items()}


def _assert_equivalent(where: str, received: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise RabbitMQ's 406 "inequivalent arg" for the first field a redeclaration of an
    existing queue or exchange gives another value (a bool is not a number here)."""
    for key, value in received.items():
        now = current[key]
        if value != now or isinstance(value, bool) != isinstance(now, bool):
            said = "none" if value is None else f"the value '{_shown(value)}'"
            was = "none" if now is None else f"the value '{_shown(now)}'"
            raise AmqpError(
                PRECONDITION_FAILED,
                f"inequivalent arg '{key}' for {where}: received {said} but current is {was}",
            )


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value).lower() if isinstance(value, bool) else str(value)


class MemoryGauge:
    """Bytes held by memory-only queues (bodies, and ``HELD_OVERHEAD`` each) against a high
    watermark (0: no limit); listeners hear when it is crossed upwards (True) and when usage
    falls back below it (False)."""

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
    """Finds the topics a queue's ``amq.topic`` binding with ``pattern`` covers and makes the
    queue read each of them (a ``BRIDGE`` source; see the module docstring).

    A topic there is when the binding starts is read from then on (its subscription starts
    at the end). A topic that appears later is read from its start, skipping what was
    published before the binding started, so its first messages are not lost to the time
    it took to find it: the forwarder hears of it as it is loaded here or recorded on any
    broker, and rescans the namespace every ``RESCAN_S`` besides."""

    def __init__(self, queue: Queue, pattern: str) -> None:
        self.queue = queue
        self.pattern = pattern
        self.topics: set[str] = set()
        self._scan: LoopingCall | None = None
        self._stops: list[Callable[[], None]] = []
        self.closed = False
        self.since_ms: int | None = None  # set once the first scan listed what there was

    def start(self) -> Deferred[Any]:
        """Read the matching topics there are; fires once subscribed."""
        if not routing.is_pattern(self.pattern):
            return self._attach(self.pattern)
        vh = self.queue.vhost
        since_ms = _now_ms(vh.clock)
        prefix = f"persistent://{vh.namespace}/"

        def appeared(full: str) -> None:
            if self.since_ms is not None and full.startswith(prefix):
                self._attach_if_matching(full.removeprefix(prefix))

        self._stops = [
            vh.service.add_topic_listener(appeared),
            vh.service.watch_namespace_topics(vh.namespace, appeared),
        ]
        d = self.rescan()

        def listed(result: Any) -> Any:
            self.since_ms = since_ms
            return result

        d.addBoth(listed)
        self._scan = LoopingCall(self.rescan)
        self._scan.clock = vh.clock
        self._scan.start(RESCAN_S, now=False).addErrback(lambda f: None)
        return d

    def rescan(self) -> Deferred[Any]:
        """Read matching topics created since the last scan."""
        vh = self.queue.vhost
        d = vh.service.topics_of_namespace(vh.namespace)

        def got(names: list[str]) -> Deferred[Any]:
            ds = [self._attach_if_matching(full.rsplit("/", 1)[-1]) for full in names]
            return DeferredList(ds, consumeErrors=True)

        d.addCallback(got)
        d.addErrback(lambda f: None)
        return d

    def _attach_if_matching(self, local: str) -> Deferred[Any]:
        if _valid_local(local) and routing.topic_matches(self.pattern, local):
            return self._attach(local)
        return succeed(None)

    def _attach(self, local: str) -> Deferred[Any]:
        if self.closed or local in self.topics or not _valid_local(local):
            return succeed(None)
        self.topics.add(local)
        topic = f"persistent://{self.queue.vhost.namespace}/{local}"
        d = self.queue.ensure_source(topic, BRIDGE, not_before_ms=self.since_ms)
        if d is None:
            return succeed(None)

        def failed(f: Any) -> None:
            self.topics.discard(local)

        d.addErrback(failed)
        return d

    def close(self) -> None:
        """Stop looking for topics; the queue keeps reading those it reads (what was
        routed to it before an unbind stays in it)."""
        self.closed = True
        if self._scan is not None and self._scan.running:
            self._scan.stop()
        for stop in self._stops:
            stop()
        self._stops = []
        self.topics.clear()


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
        #: The messages of the latest entries this vhost stored, by the identity of their
        #: bytes (kept alive here, so an id is not reused while present): a queue reading an
        #: entry the broker just stored takes them rather than decoding it again.
        self._stored: dict[int, tuple[bytes, list[Message]]] = {}
        self._flush_scheduled = False
        #: Client inputs of this vhost's connections under way: each ends with ``flush``.
        self.inputs = 0
        self._at_flush: list[Callable[[], object]] = []
        self._exchange_logs: dict[str, str] = {}
        #: Per log, the publish that waits to be stored there (later ones queue behind it).
        self._gates: dict[str, Deferred[None]] = {}
        #: Inside the completion of stored batches: what waits for the end of it.
        self.completing = 0
        self._after: list[Callable[[], None]] = []
        #: Closed (broker stopping, or the vhost moved to another broker of the cluster): its
        #: state is dropped, and nothing it held is deleted any more.
        self.closed = False
        ownership = getattr(service, "ownership", None)
        #: Other brokers of a cluster may hold this vhost's subscriptions while it moves here.
        self.clustered = bool(ownership is not None and ownership.clustered)

    # -- persistence -------------------------------------------------------------------------

    def _path(self, kind: str, name: str) -> str:
        return f"{self._root}/{kind}/{quote(name, safe='') or '%'}"

    def _save(self, kind: str, name: str, body: dict[str, Any]) -> Deferred[Any]:
        return self.service.metadata_store.put(self._path(kind, name), json.dumps(body).encode())

    def _forget(self, kind: str, name: str) -> Deferred[Any]:
        d = self.service.metadata_store.delete(self._path(kind, name))
        d.addErrback(lambda f: None)
        return d

    def _source_path(self, q: Queue, topic: str) -> str:
        return f"{self._root}/sources/{quote(q.name, safe='')}/{quote(topic, safe='')}"

    def unique(self) -> str:
        """A name part no other object of this vhost has, across restarts."""
        return f"{self.incarnation}{next(self._names)}"

    def record_source(self, q: Queue, s: _Source) -> Deferred[Any]:
        """Remember that queue ``q`` reads ``s`` (so a restart reads it again)."""
        body = json.dumps(
            {"kind": s.kind, "subscription": s.subscription, "exchange": s.exchange}
        ).encode()
        return self.service.metadata_store.put(self._source_path(q, s.topic), body)

    def _settled_path(self, s: _Source) -> str:
        q = quote(s.queue.name, safe="")
        return f"{self._root}/settled/{q}/{quote(s.topic, safe='')}"

    def save_settled(self, s: _Source) -> Deferred[Any]:
        """Record the settled messages of the partly settled entries ``s`` holds."""
        if not s.partial:
            return self.service.metadata_store.delete_recursive(self._settled_path(s))
        body = {
            "subscription": s.subscription,
            "entries": [[p.ledger_id, p.entry_id, bits] for p, bits in s.partial.items()],
        }
        return self.service.metadata_store.put(self._settled_path(s), json.dumps(body).encode())

    def forget_settled(self, s: _Source) -> None:
        d = self.service.metadata_store.delete_recursive(self._settled_path(s))
        d.addErrback(lambda f: None)

    async def load_settled(self, s: _Source) -> dict[Position, int]:
        """The settled messages of partly settled entries of ``s`` as last recorded."""
        try:
            got = await self.service.metadata_store.get(self._settled_path(s))
        except Exception as e:
            log.warning("AMQP settled messages not read", extra=kv(error=str(e)))
            return {}
        if got is None:
            return {}
        body = json.loads(got.value)
        if body.get("subscription") != s.subscription:
            return {}  # left by an older queue of the same name
        return {Position(int(lid), int(eid)): int(bits) for lid, eid, bits in body["entries"]}

    def _forget_source(self, q: Queue, topic: str) -> Deferred[Any]:
        d = self.service.metadata_store.delete(self._source_path(q, topic))
        d.addErrback(lambda f: None)
        return d

    async def _restore_sources(self, q: Queue) -> None:
        store = self.service.metadata_store
        root = f"{self._root}/sources/{quote(q.name, safe='')}"
        for child in await store.children(root):
            got = await store.get(f"{root}/{child}")
            if got is None:
                continue
            body = json.loads(got.value)
            kind, subscription = body.get("kind"), body.get("subscription")
            exchange = body.get("exchange")
            if kind in (SHARED, BRIDGE) and isinstance(subscription, str):
                d = q.ensure_source(
                    unquote(child),
                    kind,
                    subscription,
                    exchange if isinstance(exchange, str) else None,
                )
                if d is not None:
                    await d

    async def _drop_orphan_sources(self) -> None:
        """Remove the subscriptions of queues that did not come back (exclusive queues of
        a broker that stopped without deleting them)."""
        store = self.service.metadata_store
        for qchild in await store.children(f"{self._root}/sources"):
            if unquote(qchild) in self.queues:
                continue
            root = f"{self._root}/sources/{qchild}"
            for child in await store.children(root):
                got = await store.get(f"{root}/{child}")
                subscription = json.loads(got.value).get("subscription") if got else None
                if isinstance(subscription, str):
                    try:
                        await self.service.delete_subscription(
                            unquote(child), subscription, force=True, forward=True
                        )
                    except Exception as e:
                        log.info(
                            "AMQP orphan subscription not removed",
                            extra=kv(topic=unquote(child), error=str(e)),
                        )
                with contextlib.suppress(Exception):
                    await store.delete(f"{root}/{child}")

    def bridge_bound(self, queue: str, local: str) -> bool:
        """Whether ``queue`` is bound to ``amq.topic`` with a key that topic ``local`` matches."""
        ex = self.exchanges.get("amq.topic")
        if ex is None:
            return False
        return any(
            b.kind == routing.QUEUE
            and b.destination == queue
            and routing.topic_matches(b.routing_key, local)
            for b in ex.bindings
        )

    def reaches(self, exchange: str, queue: str) -> bool:
        """Whether any binding path leads from ``exchange`` to ``queue``."""
        seen: set[str] = set()
        todo = [exchange]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            ex = self.exchanges.get(name)
            if ex is None:
                continue
            for b in ex.bindings:
                if b.kind != routing.QUEUE:
                    todo.append(b.destination)
                elif b.destination == queue:
                    return True
        return False

    def bindings_changed(self, removed: routing.Binding | None = None) -> None:
        """Retire the shared logs whose exchange no longer routes to their queue (once read),
        and keep those it routes to again.

        A new binding can only bring back a log being retired; a removed queue binding can
        only change what reaches that queue; other removals (and a load) look at every queue."""
        if removed is None:
            queues = [
                q for q in self.queues.values() if any(s.retiring for s in q.sources.values())
            ]
        elif removed.kind == routing.QUEUE:
            q = self.queues.get(removed.destination)
            queues = [q] if q is not None else []
        else:
            queues = list(self.queues.values())
        for q in queues:
            for s in list(q.sources.values()):
                if s.kind != SHARED or s.exchange is None:
                    continue
                if self.reaches(s.exchange, q.name):
                    s.retiring = s.retire_known = False
                elif not s.retiring and removed is not None:
                    s.retiring = True
                    d = self.service.last_message_id(s.topic, forward=True)
                    d.addCallback(q.retire_from, s)
                    d.addErrback(lambda f, q=q, s=s: q.retire_from(None, s))

    def exchange_log(self, exchange: str) -> str:
        """The topic that holds what is published to ``exchange`` for several queues."""
        topic = self._exchange_logs.get(exchange)
        if topic is None:
            local = f"amqp.exchange.{quote(exchange, safe='') or '%'}"
            topic = f"persistent://{self.namespace}/{local}"
            if len(self._exchange_logs) > 10_000:
                self._exchange_logs.clear()
            self._exchange_logs[exchange] = topic
        return topic

    @staticmethod
    def _binding_id(b: routing.Binding) -> str:
        raw = json.dumps([b.source, b.destination, b.kind, b.routing_key, repr(b.arguments)])
        return hashlib.sha1(raw.encode()).hexdigest()

    async def load(self) -> None:
        """Restore durable exchanges, queues and bindings.

        Every binding is in place before any queue reads: a queue's ``amq.topic`` source routes
        what it reads by the bindings (``accepts``) and acknowledges at once what they do not
        route to it, so a source read before its binding was back lost its backlog."""
        store = self.service.metadata_store
        queues: list[Queue] = []
        bindings: list[routing.Binding] = []
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
                    queues.append(q)
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
                        bindings.append(b)
        for q in queues:
            await q.start()
            await self._restore_sources(q)
        # After the sources they record: a forwarder then finds its queue reading already.
        for b in bindings:
            await self._bound(b)
        self.bindings_changed(_ANY_REMOVAL)
        Deferred.fromCoroutine(self._drop_orphan_sources()).addErrback(
            lambda f: log.warning("AMQP orphan sweep failed", extra=kv(error=str(f.value)))
        )

    def close(self) -> None:
        """Stop every queue reading; what is durable stays for the next owner."""
        self.closed = True
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
            where = f"exchange '{name}' in vhost '{self.namespace}'"
            fields = ("type", "durable", "auto_delete", "internal")
            _assert_equivalent(
                where,
                dict(zip(fields, (kind, durable, auto_delete, internal), strict=True)),
                {f: getattr(ex, f) for f in fields},
            )
            _assert_equivalent(
                where,
                _equivalence_args(arguments, _EXCHANGE_ARGS),
                _equivalence_args(ex.arguments, _EXCHANGE_ARGS),
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
        self.bindings_changed()
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
                    fwd.close()
        self.bindings_changed(b)
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
            where = f"queue '{name}' in vhost '{self.namespace}'"
            _assert_equivalent(
                where,
                {"durable": durable, "auto_delete": auto_delete},
                {"durable": existing.durable, "auto_delete": existing.auto_delete},
            )
            _assert_equivalent(
                where,
                _equivalence_args(arguments, _QUEUE_ARGS),
                _equivalence_args(existing.arguments, _QUEUE_ARGS),
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
            fwd.close()
        q.forwarders.clear()
        for topic, s in q.sources.items():
            if s.kind != OWN:
                s.close(unsubscribe=True)
                if q.recorded:
                    ds.append(self._forget_source(q, topic))
            else:
                s.discard_settled()
        q.close()
        if q.durable:
            ds.append(self._forget("queues", name))
        if not q.memory_only:
            ds.append(self.service.delete_topic(q.topic, force=True, forward=True))
        dl = DeferredList(ds, consumeErrors=True)
        dl.addCallback(lambda _: count)
        return dl  # type: ignore[return-value]

    def owner_gone(self, owner: object) -> None:
        """A connection closed: delete the exclusive queues it owned."""
        if self.closed:
            return
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
        seen = {msg.exchange}
        while not names:
            # RabbitMQ's alternate exchange: what an exchange routes nowhere goes there.
            alternate = ex.arguments.get("alternate-exchange")
            if isinstance(alternate, bytes):
                alternate = alternate.decode("utf-8", "replace")
            if not isinstance(alternate, str) or alternate in seen:
                break
            ex = self.exchanges.get(alternate)
            if ex is None:
                break
            seen.add(alternate)
            msg.via = alternate
            names = routing.route(self.exchanges, alternate, msg.routing_key, headers, extra)
        return [self.queues[n] for n in names if n in self.queues]

    def publish(self, msg: AmqpMessage, queues: list[Queue] | None = None) -> Deferred[int]:
        """``publish_then`` as a Deferred: fires with the number of queues reached once every
        write is durable (raises ``AmqpError`` for a missing exchange)."""
        d: Deferred[int] = Deferred()

        def told(result: Any) -> None:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)

        self.publish_then(msg, queues, told)
        return d

    def publish_then(
        self, msg: AmqpMessage, queues: list[Queue] | None, tell: Callable[[Any], None]
    ) -> None:
        """Store ``msg`` once for the queues it reaches, whatever their number; call ``tell``
        once, with that number once every write is durable (then it is in each of them), or
        with the first write's ``Failure`` (``QueueFullError`` when a reject-publish queue
        refused it). ``tell`` may be called before this returns (memory queues only).

        Where: in the exchange's log, naming the queues in ``P_TO``, when it reaches several
        durable queues or one that reads that log already (so the order of what one exchange
        routes to one queue is the log's order); else in the one durable queue's own topic.
        Each queue reads a shared log through a subscription of its own, created (and
        recorded) before the first append it needs. Transient queues take the message in
        memory. ``amq.topic`` with routing key R also writes it on topic R, for the other
        protocols (queues skip those copies: they have it from the exchange already).

        No Deferred per message: a publish is one entry in its batch's list of whom to tell
        (``_Batch.waiters``)."""
        if queues is None:
            queues = self.destinations(msg)
        if not msg.persistent and not msg.incarnation:
            msg.incarnation = self.incarnation
        reached = len(queues)
        refused = False
        if any(q.reject_publish for q in queues):
            kept = [q for q in queues if not q.full()]
            refused = len(kept) != len(queues)
            queues = kept
        stored = [q for q in queues if not q.memory_only and not q.deleted]
        if len(stored) != len(queues):
            msg.publish_time_ms = _now_ms(self.clock)
            for q in queues:
                if q.memory_only:
                    q.accept(msg)
        size = len(msg.body) + 256
        bridged = (
            f"persistent://{self.namespace}/{msg.routing_key}"
            if msg.exchange == "amq.topic" and _valid_local(msg.routing_key)
            else None
        )
        writes = (1 if stored else 0) + (1 if bridged is not None else 0)
        if not writes:
            tell(Failure(QueueFullError()) if refused else reached)
            return
        outcome = _Outcome(tell, writes, Failure(QueueFullError()) if refused else reached)
        if stored:
            self._route(msg, stored, size, outcome.one)
        if bridged is not None:
            self._store(bridged, to_stored(msg), size, outcome.one)

    def _route(
        self, msg: AmqpMessage, stored: list[Queue], size: int, tell: Callable[[Any], None]
    ) -> None:
        """Append ``msg`` for durable queues ``stored`` (see ``publish_then``); ``tell`` the
        stored entry or the failure."""
        routed_by = msg.via or msg.exchange
        log_topic = self.exchange_log(routed_by)
        stored_message = to_stored(msg)
        waits: list[Deferred[None]] = []
        if len(stored) > 1 or log_topic in stored[0].sources:
            target = log_topic
            stored_message.properties.append((P_TO, encode_to([q.name for q in stored])))
            for q in stored:
                w = q.ensure_source(target, SHARED, exchange=routed_by)
                if w is not None:
                    waits.append(w)
        else:
            target = stored[0].topic
        for q in stored:
            q.appending(target)
            q.unread += 1
            if q.max_length is not None:
                q._enforce_max_length()

        def appended(result: Any) -> None:
            entry = result if isinstance(result, Entry) else None
            for q in stored:
                if entry is None and q.unread:
                    q.unread -= 1
                q.appended(target, entry)
            tell(result)

        previous = self._gates.get(target)
        if not waits and previous is None:
            self._store(target, stored_message, size, appended)
        else:
            self._gated(target, stored_message, size, waits, previous, appended)

    def _gated(
        self,
        target: str,
        message: Message,
        size: int,
        waits: list[Deferred[None]],
        previous: Deferred[None] | None,
        tell: Callable[[Any], None],
    ) -> None:
        """Store ``message`` once the queues' subscriptions exist (the first message a queue
        gets through a log waits for its subscription) and after the publish to ``target``
        that waited before it, so a log keeps the publish order."""
        mine: Deferred[None] = Deferred()
        self._gates[target] = mine

        def opened() -> None:
            if self._gates.get(target) is mine:
                del self._gates[target]
            mine.callback(None)

        def go(_: object) -> None:
            self._store(target, message, size, tell)
            opened()

        def failed(f: Any) -> None:
            opened()
            tell(_first_failure(f))

        gate = DeferredList(
            [*waits, *([previous] if previous is not None else [])],
            fireOnOneErrback=True,
            consumeErrors=True,
        )
        gate.addCallbacks(go, failed)

    # -- batching ----------------------------------------------------------------------------

    def _store(self, topic: str, message: Message, size: int, tell: Callable[[Any], None]) -> None:
        """Append ``message`` to ``topic`` in the batch entry of this turn; ``tell`` the stored
        entry once it is durable, or the failure."""
        pending = self._pending.get(topic)
        if pending is not None and pending.size + size > BATCH_MAX_BYTES:
            self._flush_topic(topic)
            pending = None
        if pending is None:
            pending = self._pending[topic] = _Batch()
        pending.messages.append(message)
        pending.waiters.append(tell)
        pending.size += size
        if len(pending.messages) >= BATCH_MAX_MESSAGES:
            self._flush_topic(topic)
        elif not self._flush_scheduled and not self.inputs:
            self._flush_scheduled = True
            self.clock.callLater(0, self.flush)

    def soon(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` at the end of the client input under way (its ``flush``), else at the
        reactor's next turn: work of one input or turn is gathered either way."""
        if self.inputs:
            self._at_flush.append(fn)
        else:
            self.clock.callLater(0, fn)

    def flush(self) -> None:
        """Send every batch being gathered, then what waits for the end of the client's
        input (the end of a client's input, or of the turn)."""
        self._flush_scheduled = False
        for topic in list(self._pending):
            self._flush_topic(topic)
        while self._at_flush:
            at_flush, self._at_flush = self._at_flush, []
            for fn in at_flush:
                try:
                    fn()
                except Exception:  # as the reactor would for a timer: logged, not raised
                    log.exception("AMQP deferred work failed")

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
        if len(data) <= STORED_MAX_BYTES:
            stored = self._stored
            if len(stored) >= STORED_KEEP:
                del stored[next(iter(stored))]
            stored[id(data)] = (data, batch.messages)
        d = self.service.publish(topic, data, count, publish_time_ms=now, forward=True)

        def done(result: Any) -> None:
            # ``result``: the stored entry, or the failure; every publish of the batch hears.
            self.completing += 1
            try:
                for tell in batch.waiters:
                    try:
                        tell(result)
                    except Exception:  # one publish's bug must not keep the others waiting
                        log.exception("AMQP publish completion failed")
            finally:
                self.completing -= 1
            if self._after and not self.completing:
                self._completed()

        d.addBoth(done)

    def messages_of(self, data: bytes) -> list[Message]:
        """The messages of a stored entry: those this vhost encoded into these very bytes
        (as ``decode_entry`` would return them, bar the publish time and sequence ids, which
        a queue takes from the entry), else decoded."""
        kept = self._stored.get(id(data))
        if kept is not None and kept[0] is data:
            return kept[1]
        return decode_entry(data)

    def after_completion(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the batch completion under way has told every publish (the
        confirms of all of them go out together, before the queues read the new entry)."""
        self._after.append(fn)

    def _completed(self) -> None:
        after, self._after = self._after, []
        for fn in after:
            fn()


@dataclass
class _Batch:
    """Messages gathered for one topic in one turn, stored as one batch entry, and whom to
    tell the outcome (the stored entry, or the failure)."""

    messages: list[Message] = field(default_factory=list)
    waiters: list[Callable[[Any], None]] = field(default_factory=list)
    size: int = 0


class _Outcome:
    """Joins the writes of one publish (its queues' log, and the ``amq.topic`` bridge): tells
    ``result`` once all succeeded, or the first failure at once (later ones are dropped)."""

    __slots__ = ("left", "result", "tell")

    def __init__(self, tell: Callable[[Any], None], writes: int, result: Any) -> None:
        self.tell: Callable[[Any], None] | None = tell
        self.left = writes
        self.result = result

    def one(self, result: Any) -> None:
        tell = self.tell
        if tell is None:
            return
        if isinstance(result, Failure):
            self.tell = None
            tell(result)
            return
        self.left -= 1
        if not self.left:
            self.tell = None
            tell(self.result)


#: Stands for "some binding may be gone" (every queue is looked at).
_ANY_REMOVAL = routing.Binding("", "", routing.EXCHANGE, "")


class QueueFullError(Exception):
    """A reject-publish queue at its x-max-length refused the message (the publish is nacked)."""


def _first_failure(f: Any) -> Any:
    """The failure inside a DeferredList's FirstError."""
    return f.value.subFailure if hasattr(f.value, "subFailure") else f


def _valid_local(name: str) -> bool:
    """Whether ``amq.topic`` bridges routing key ``name`` to a topic (the ``amqp.`` topics
    are this handler's own)."""
    return bool(name) and "/" not in name and ":" not in name and not name.startswith("amqp.")


def _sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    d: Deferred[None] = Deferred()
    clock.callLater(seconds, d.callback, None)
    return d
