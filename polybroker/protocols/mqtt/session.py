"""MQTT sessions over the Broker API: subscriptions, in-flight messages, retained messages.

Model: a session (one client id) holds its filters and, for each Pulsar topic a filter matches,
one Pulsar subscription, so a message matching overlapping filters of one client is delivered
once, at the highest granted QoS (delivered QoS = min(publish QoS, granted QoS)). The
subscription is named ``mqtt-<client id>`` (Exclusive; durable for a persistent session,
non-durable for a clean one); a shared filter ``$share/g/f`` uses the durable Shared
subscription ``mqtt-share-g`` of every matching topic. Wildcard filters cover topics created
later: the broker's topic listener reports each loaded topic, which is then subscribed from the
earliest entry, skipping entries published before the filter was subscribed.

A session outlives its connection while it has not expired. While its client is away, its
consumers are closed: what is published meanwhile waits in the log, kept by the durable
subscriptions (a topic that appears meanwhile gets its subscription too), not in memory; only
the in-flight messages stay, for their resend with DUP. When the client returns, every filter
is attached again and reads on from its subscription's cursor; an entry read again whose
messages were already handed over (in flight or done) sends only the others. An entry is
acknowledged on its subscription once all its messages are done (QoS 0 sent, QoS 1 PUBACKed,
QoS 2 PUBCOMPed).

Stored message properties (besides MQTT 5 user properties, stored as they are, but for a name
beginning with ``mqtt.``, stored under ``mqtt.user:<name>`` so no client can set the broker's
own): ``mqtt.qos``, ``mqtt.retain`` (``1`` when published retained), ``mqtt.expiry`` (message
expiry interval in seconds), ``mqtt.content-type``, ``mqtt.format``, ``mqtt.response-topic``,
``mqtt.correlation`` (hex), ``mqtt.pid`` (a QoS 2 publish's packet id). A message from
another protocol is delivered as QoS 1.

Durable state in the metadata store: ``/mqtt/sessions/<client id>`` (a persistent session's
filters), ``/mqtt/retained/<topic>`` (each retained message), ``/mqtt/qos2/<client id>``
(a persistent session's inbound QoS 2 packet ids awaiting PUBREL) and
``/mqtt/qos2-out/<client id>/<n>`` (its outbound QoS 2 messages the client has), names
percent-encoded.

Exactly-once inbound (persistent sessions), across a crash: before a QoS 2 message is stored,
its packet id is recorded with its topic and that topic's last position at the time; the
message is stored with ``mqtt.pid``; PUBREC follows; at PUBREL the record is dropped, then
PUBCOMP. Restoring the session reads each recorded topic after the recorded position: a packet
id found there (from this client) was stored, so a resent PUBLISH gets PUBREC and nothing is
stored again; one not found was never stored and is forgotten (the resend stores it).

Exactly-once outbound (persistent sessions, the client's own subscriptions), across a crash:
an entry is acknowledged only once all its messages are done, and durably at the cursor's
pace. So at PUBREC, before PUBREL, each message the client now has is recorded as (topic,
position, index in the entry, packet id): the PUBRECs of one read of the client's bytes make
one small node ``/mqtt/qos2-out/<client id>/<n>`` (n increasing), deleted once every entry it
names is durably acknowledged, so a write costs what its read brought, not what is in flight.
PUBCOMP is not written: a restored row whose packet id a later node reuses was completed (ids
are reused only after PUBCOMP); any other restored row counts as awaiting PUBCOMP. Restoring
the session puts each such message in flight as released (PUBREL is sent again for its packet
id on attach, never the message; a client answers PUBCOMP even for an id it completed) and,
when the cursor delivers its entry again, sends only the entry's other messages. A recorded
entry the cursor passes over without delivering it was acknowledged before the crash: its
record goes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import math
import secrets
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, unquote

from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import Delivery, SubType
from polybroker.broker_core.errors import (
    ConsumerBusyError,
    ConsumerClosedError,
    NotAllowedError,
    TopicNotFoundError,
)
from polybroker.broker_core.forwarding import ConsumerHandle
from polybroker.broker_core.messages import (
    Message,
    MessageFormatError,
    decode_entry,
    encode_entry,
    split_entry,
)
from polybroker.ledger.api import InitialPosition, Position
from polybroker.logs import Repeats, kv
from polybroker.protocols.mqtt import codec as c
from polybroker.protocols.mqtt import topics

log = logging.getLogger(__name__)

SESSIONS_ROOT = "/mqtt/sessions"
RETAINED_ROOT = "/mqtt/retained"
QOS2_ROOT = "/mqtt/qos2"
QOS2_OUT_ROOT = "/mqtt/qos2-out"
#: Messages a topic subscription may have outstanding in its session.
FLOW_WINDOW = 1000
#: A pump writes what it gathered every this many bytes, and stops once the buffer is full.
MAX_GATHERED = 64 * 1024
#: Entries (and their bytes) whose messages ``MqttBroker.written`` keeps at most.
WRITTEN_CACHE = 256
WRITTEN_CACHE_BYTES = 4 * 1024 * 1024
#: How long a listing of the namespace's topics serves wildcard SUBSCRIBEs.
LISTING_TTL_S = 5.0
#: Session expiry meaning "never".
NEVER = None
#: In a cluster, how long a SUBSCRIBE waits for another broker to let go of the session's
#: subscription (the device's previous connection there is being taken over).
BUSY_WAIT_S = 3.0

#: The stored name of a user property whose name begins with ``mqtt.`` is this and its name.
USER_ESCAPE = "mqtt.user:"

_PROP_MAP = {
    c.CONTENT_TYPE: "mqtt.content-type",
    c.RESPONSE_TOPIC: "mqtt.response-topic",
}


def stored_properties(pub: c.Publish) -> list[tuple[str, str]]:
    """The message properties that store ``pub`` (see the module docstring)."""
    props: list[tuple[str, str]] = [("mqtt.qos", str(pub.qos))]
    if pub.qos == 2:
        props.append(("mqtt.pid", str(pub.packet_id)))
    if pub.retain:
        props.append(("mqtt.retain", "1"))
    p = pub.properties
    if p:
        if c.MESSAGE_EXPIRY in p:
            props.append(("mqtt.expiry", str(p[c.MESSAGE_EXPIRY])))
        if c.PAYLOAD_FORMAT in p:
            props.append(("mqtt.format", str(p[c.PAYLOAD_FORMAT])))
        for pid, name in _PROP_MAP.items():
            if pid in p:
                props.append((name, p[pid]))
        if c.CORRELATION_DATA in p:
            props.append(("mqtt.correlation", p[c.CORRELATION_DATA].hex()))
        props.extend(
            (USER_ESCAPE + k if k.startswith("mqtt.") else k, v)
            for k, v in p.get(c.USER_PROPERTY, [])
        )
    return props


@dataclass(slots=True)
class Outgoing:
    """One message waiting for, or in, delivery to a client."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: dict[int, Any]
    expiry_at: float | None = None  # clock seconds
    track: EntryTrack | None = None
    packet_id: int = 0
    released: bool = False  # QoS 2: PUBREL sent
    index: int = 0  # within its entry
    via: str | None = None  # a retained copy: the filter of the SUBSCRIBE that queued it


@functools.lru_cache(maxsize=4096)
def topic_field(name: str) -> bytes:
    """The encoded topic name field of PUBLISHes to ``name``."""
    return c.string_field(name)


def outgoing_from(
    msg: Message, name: str, granted: int, sub_ids: list[int], retain: bool, publish_s: float
) -> Outgoing:
    """The PUBLISH of a stored message for one subscriber."""
    stored = msg.properties
    if not sub_ids and len(stored) == 1 and stored[0][0] == "mqtt.qos":
        # The common case: an MQTT publish with no properties.
        v = stored[0][1]
        q = int(v) if v in ("0", "1", "2") else 1
        return Outgoing(name, msg.payload, q if q < granted else granted, False, {})
    qos = 1
    props: dict[int, Any] = {}
    user: list[tuple[str, str]] = []
    expiry_at = None
    stored_retain = False
    for k, v in msg.properties:
        if not k.startswith("mqtt."):
            user.append((k, v))
        elif k.startswith(USER_ESCAPE):
            user.append((k[len(USER_ESCAPE) :], v))
        elif k == "mqtt.qos":
            qos = int(v) if v in ("0", "1", "2") else 1
        elif k == "mqtt.retain":
            stored_retain = v == "1"
        elif k == "mqtt.expiry" and v.isdigit():
            expiry_at = publish_s + int(v)
        elif k == "mqtt.format" and v in ("0", "1"):
            props[c.PAYLOAD_FORMAT] = int(v)
        elif k == "mqtt.content-type":
            props[c.CONTENT_TYPE] = v
        elif k == "mqtt.response-topic":
            props[c.RESPONSE_TOPIC] = v
        elif k == "mqtt.correlation":
            with contextlib.suppress(ValueError):
                props[c.CORRELATION_DATA] = bytes.fromhex(v)
    if user:
        props[c.USER_PROPERTY] = user
    if sub_ids:
        props[c.SUBSCRIPTION_ID] = list(sub_ids)
    return Outgoing(
        name, msg.payload, min(qos, granted), retain and stored_retain, props, expiry_at
    )


class ClientLink(Protocol):
    """What a session needs of the connection it is attached to."""

    level: int
    client_receive_max: int
    client_max_packet: int
    paused: bool
    #: Inside a read of the client's bytes: ``pump`` waits for its end (one write per read).
    reading: bool

    def write(self, data: bytes) -> None: ...

    def kick(self, reason_code: int) -> None: ...


@dataclass
class FilterSub:
    """One filter of a session with its SUBSCRIBE options."""

    topic_filter: str  # as the client sent it (``$share/...`` included)
    group: str | None
    pattern: str  # the filter without its ``$share/group/`` prefix
    qos: int
    sub_id: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscribed_ms: int = 0

    def as_json(self) -> list[Any]:
        return [
            self.topic_filter,
            self.qos,
            self.sub_id,
            self.no_local,
            self.retain_as_published,
            self.retain_handling,
            self.subscribed_ms,
        ]

    @classmethod
    def from_json(cls, raw: list[Any]) -> FilterSub:
        group, pattern = topics.split_shared(raw[0])
        return cls(raw[0], group, pattern, int(raw[1]), int(raw[2]), *raw[3:6], int(raw[6]))


class EntryTrack:
    """The messages of one delivered entry still to be completed, and which of them were
    handed to the client (``sent``, bit i = message i)."""

    __slots__ = ("position", "remaining", "sent", "size", "sub")

    def __init__(self, sub: TopicSub, position: Position, remaining: int, size: int) -> None:
        self.sub = sub
        self.position = position
        self.remaining = remaining
        self.size = size
        self.sent = 0


@dataclass
class Retained:
    """A retained message."""

    topic: str
    payload: bytes
    qos: int
    properties: list[tuple[str, str]] = field(default_factory=list)
    stored_s: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(
            {
                "payload": base64.b64encode(self.payload).decode(),
                "qos": self.qos,
                "properties": self.properties,
                "stored_s": self.stored_s,
            }
        ).encode()

    @classmethod
    def decode(cls, topic: str, raw: bytes) -> Retained:
        d = json.loads(raw)
        return cls(
            topic,
            base64.b64decode(d["payload"]),
            int(d["qos"]),
            [(str(k), str(v)) for k, v in d.get("properties", [])],
            float(d.get("stored_s", 0.0)),
        )


class TopicSub:
    """The ``Consumer`` of one session on one Pulsar subscription of one topic."""

    def __init__(
        self,
        session: Session,
        full: str,
        name: str,
        group: str | None,
        consumer_id: int,
        not_before_ms: int,
    ) -> None:
        self.session = session
        self.full = full
        self.name = name
        self.group = group
        self._consumer_id = consumer_id
        self.not_before_ms = not_before_ms
        self.server: ConsumerHandle | None = None
        self.closed = False
        self.durable = False
        self.delete = False  # closed for good: its durable subscription is deleted
        self.to_flow = 0
        # When it attached (epoch ms) and the last position it was handed: where a
        # non-durable subscription resumes after the broker closed it. Entries at or before
        # ``after`` are skipped.
        self.attached_ms = 0
        self.seen: Position | None = None
        self.after: Position | None = None

    @property
    def subscription(self) -> str:
        return subscription_name(self.session.client_id, self.group)

    @property
    def consumer_id(self) -> int:
        return self._consumer_id

    @property
    def consumer_name(self) -> str:
        return self.session.client_id

    @property
    def priority_level(self) -> int:
        return 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        if self.closed:
            return
        session = self.session
        for entry, _count, acked in deliveries:
            if self.after is not None and not self.after < entry.position:
                self._done(entry.position, entry.num_messages)
                continue
            self.seen = entry.position
            if session.restored_out and self.group is None:
                session.passed_restored(self.full, entry.position)
            filters = session.matching(self.name, self.group)
            if len(filters) == 1:
                # The common case, without the generators the general one runs per entry.
                f0 = filters[0]
                if f0.no_local and self._own(entry.data):
                    filters = []
            elif filters and any(f.no_local for f in filters) and self._own(entry.data):
                filters = [f for f in filters if not f.no_local]
            if not filters or entry.publish_time_ms < self.not_before_ms:
                self._done(entry.position, entry.num_messages)
                continue
            msgs = session.broker.written.get(entry.data)
            if msgs is None:
                try:
                    msgs = decode_entry(entry.data)
                except MessageFormatError:
                    log.warning("undecodable entry skipped", extra=kv(topic=self.full))
                    self._done(entry.position, entry.num_messages)
                    continue
            if len(filters) == 1:
                f0 = filters[0]
                granted = f0.qos
                sub_ids = [f0.sub_id] if f0.sub_id else []
                rap = f0.retain_as_published
            else:
                granted = max(f.qos for f in filters)
                sub_ids = sorted({f.sub_id for f in filters if f.sub_id})
                rap = any(f.retain_as_published for f in filters)
            held = (
                session.held.pop((self.full, self.group, entry.position), None)
                if session.held
                else None
            )
            skip = acked | held.sent if held is not None else acked
            todo = (
                list(enumerate(msgs))
                if not skip
                else [(i, m) for i, m in enumerate(msgs) if not (skip >> i) & 1]
            )
            if held is not None:
                # Read again after the client came back: only what it never got is sent.
                track = held
                track.sub = self
                track.size = entry.num_messages
                track.remaining += len(todo)
                if track.remaining <= 0:
                    self._done(entry.position, entry.num_messages)
                    continue
            elif not todo:
                self._done(entry.position, entry.num_messages)
                continue
            else:
                track = EntryTrack(self, entry.position, len(todo), entry.num_messages)
            publish_s = entry.publish_time_ms / 1000.0
            for i, m in todo:
                out = outgoing_from(m, self.name, granted, sub_ids, rap, publish_s)
                out.track = track
                out.index = i
                session.queue.append(out)
        session.pump()

    def _own(self, data: bytes) -> bool:
        """Whether this session's client published the entry (for MQTT 5 no-local)."""
        try:
            md, _ = split_entry(data)
        except MessageFormatError:
            return False
        return md.producer_name == "mqtt-" + self.session.client_id

    def complete(self, track: EntryTrack) -> None:
        """One message of ``track`` is done; acknowledge the entry after its last."""
        track.remaining -= 1
        if track.remaining <= 0:
            self._done(track.position, track.size)

    def _done(self, position: Position, size: int) -> None:
        server = self.server
        if server is None or self.closed:
            return
        d = server.ack([position])
        if self.group is None and self.session.qos2_out:
            key = (self.full, position)
            if key in self.session.qos2_out:
                d.addCallback(lambda _: self.session.qos2_acked(key))
        if not d.called or d.paused or isinstance(d.result, Failure):
            # Its failure is of no consequence (the entry is delivered again). An ack that
            # has already succeeded, the usual case, needs no errback: adding one would run
            # the Deferred's callback loop for nothing.
            d.addErrback(_ignore)
        self.to_flow += size
        if self.to_flow >= FLOW_WINDOW // 2:
            server.flow(self.to_flow)
            self.to_flow = 0

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        # The broker closed this consumer (unload, seek, delete): attach again shortly.
        self.server = None
        if self.closed:
            return
        self.closed = True
        self.session.consumer_lost(self)


def _ignore(_: object) -> None:
    return None


def subscription_name(client_id: str, group: str | None) -> str:
    """The Pulsar subscription of a client (or of a share group)."""
    if group is not None:
        return "mqtt-share-" + quote(group, safe="")
    return "mqtt-" + quote(client_id, safe="")


class Session:
    """One client id's MQTT session (see the module docstring)."""

    def __init__(self, broker: MqttBroker, client_id: str, expiry_s: int | None) -> None:
        self.broker = broker
        self.client_id = client_id
        self.expiry_s = expiry_s  # None: never
        #: Its subscriptions are durable (it was persistent when made, even if resumed since
        #: with expiry 0: they are then still deleted at its end).
        self.durable_subs = self.persistent
        self.link: ClientLink | None = None
        self.filters: dict[str, FilterSub] = {}
        self.subs: dict[tuple[str, str | None], TopicSub] = {}
        self.inflight: dict[int, Outgoing] = {}
        self.queue: deque[Outgoing] = deque()
        #: Entries handed over before their consumer closed (client away, topic moved):
        #: (topic, group, position) -> their track, so that reading them again sends only
        #: what the client never got.
        self.held: dict[tuple[str, str | None, Position], EntryTrack] = {}
        #: The client is away and the consumers are closed (see the module docstring).
        self.parked = False
        #: A ``pump`` waits for the end of the connection's read.
        self.pump_due = False
        #: Inbound QoS 2 packet ids stored and awaiting PUBREL.
        self.inbound_qos2: set[int] = set()
        #: A persistent session's recorded QoS 2 packet ids: pid -> (topic, position before).
        self.qos2_record: dict[int, tuple[str, Position | None]] = {}
        #: Outbound QoS 2 messages the client has (PUBRECed), by (topic, entry position):
        #: index in the entry -> packet id (0: PUBCOMPed, the entry's ack not yet durable).
        self.qos2_out: dict[tuple[str, Position], dict[int, int]] = {}
        #: Restored entries of ``qos2_out`` not delivered again yet: topic -> positions.
        self.restored_out: dict[str, set[Position]] = {}
        #: Restored entries the cursor passed over whose messages are still in flight.
        self._stale_out: set[tuple[str, Position]] = set()
        #: Rows recorded since the last write: (topic, position), index, packet id.
        self.out_new: list[tuple[tuple[str, Position], int, int]] = []
        #: The stored nodes of the record: number -> the entries it names still recorded,
        #: and the other way round; the nodes being written; the next node's number.
        self.out_nodes: dict[int, set[tuple[str, Position]]] = {}
        self.out_key_nodes: dict[tuple[str, Position], set[int]] = {}
        self.out_writing: set[int] = set()
        self.out_seq = 0
        #: Waiting for the next node, written once the one being written is stored (so a
        #: busy client's PUBRECs are grouped as the store's writes allow).
        self.out_waiters: list[Deferred[None]] = []
        self.ended = False
        #: When an absent session expires (epoch ms; None while connected or never).
        self.expires_at_ms: int | None = None
        self._next_pid = 0
        self._match_cache: dict[tuple[str, str | None], list[FilterSub]] = {}
        # Topics whose consumer the broker closed (unload): attached again from where they were.
        # Each lost one's resume point: (not_before_ms, after) as ``ensure_sub`` takes them.
        self._lost: dict[tuple[str, str | None], tuple[int | None, Position | None]] = {}
        self._expiry_call: IDelayedCall | None = None
        # A delayed will: its timer and what publishes it (at the delay or the session's end).
        self.will_call: IDelayedCall | None = None
        self.will_fire: Callable[[], None] | None = None
        #: Another broker took the session over: this copy is inert (never saved or ended).
        self.released = False

    @property
    def persistent(self) -> bool:
        return self.expiry_s is None or self.expiry_s > 0

    # -- filters -------------------------------------------------------------------------

    def matching(self, name: str, group: str | None) -> list[FilterSub]:
        """The filters of ``group`` (None: the client's own) that match topic ``name``."""
        key = (name, group)
        got = self._match_cache.get(key)
        if got is None:
            got = [
                f
                for f in self.filters.values()
                if f.group == group and topics.matches(f.pattern, name)
            ]
            if len(self._match_cache) > 10_000:
                self._match_cache.clear()
            self._match_cache[key] = got
        return got

    def add_filter(self, f: FilterSub) -> Deferred[bool]:
        """Subscribe ``f`` (replacing the same filter); fire with whether it existed."""
        existed = f.topic_filter in self.filters
        if existed:
            f.subscribed_ms = self.filters[f.topic_filter].subscribed_ms
        self.filters[f.topic_filter] = f
        self._match_cache.clear()
        busy_wait = BUSY_WAIT_S if self.broker.clustered else 0.0
        d = self._cover(f, initial=not existed, busy_wait_s=busy_wait)
        if self.broker.clustered and f.group is None:
            # Other brokers store retained messages too: read the ones this filter matches.
            d.addCallback(lambda _: self.broker.refresh_retained(f.pattern))
        d.addCallback(lambda _: existed)
        return d

    def _cover(
        self,
        f: FilterSub,
        initial: bool,
        busy_wait_s: float | None = None,
        then: str | None = None,
    ) -> Deferred[None]:
        """Attach subscriptions on every topic ``f`` matches now (``busy_wait_s``, ``then``:
        see ``ensure_sub``)."""
        if not topics.has_wildcard(f.pattern):
            full = topics.to_pulsar(f.pattern)
            create = then != "delete"

            def attach(name: str, handled: tuple[type[Exception], ...] = ()) -> Deferred[None]:
                return self.ensure_sub(
                    name,
                    f.pattern,
                    f.group,
                    None,
                    create,
                    busy_wait_s=busy_wait_s,
                    then=then,
                    handled=handled,
                )

            def exact(n: int) -> Deferred[Any]:
                if n <= 0:
                    return attach(full, (NotAllowedError,)).addErrback(partitioned_meanwhile)
                ds = [attach(topics.partition_name(full, i)) for i in range(n)]
                return gatherResults(ds, consumeErrors=True)

            def partitioned_meanwhile(failure: Failure) -> Deferred[Any]:
                # A Kafka client made the topic partitioned since the count was read: its
                # name is no topic any more, its partitions are.
                failure.trap(NotAllowedError)

                def again(n: int) -> Deferred[Any]:
                    if n > 0:
                        return exact(n)
                    log.warning(
                        "mqtt subscription failed",
                        extra=kv(client=self.client_id, topic=full, error=str(failure.value)),
                    )
                    return fail(failure)

                return self.broker.partitions(full).addCallback(again)

            d = self.broker.partitions(full)
            d.addCallback(exact)
            d.addCallback(lambda _: None)
            return d
        not_before = None if initial else f.subscribed_ms

        def attach_all(names: list[str]) -> Deferred[Any]:
            ds = []
            for full in names:
                name = topics.from_pulsar(topics.split_partition(full)[0])
                if name is not None and topics.matches(f.pattern, name):
                    # A topic deleted since the listing is skipped, not a failed SUBSCRIBE.
                    d = self.ensure_sub(
                        full,
                        name,
                        f.group,
                        not_before,
                        create=False,
                        busy_wait_s=busy_wait_s,
                        then=then,
                    )
                    ds.append(d.addErrback(lambda _: None))
            return gatherResults(ds, consumeErrors=True) if ds else succeed(None)

        d = self.broker.topic_names()
        d.addCallback(attach_all)
        d.addCallback(lambda _: None)
        return d

    def remove_filter(self, topic_filter: str) -> bool:
        """Unsubscribe a filter; return whether it existed."""
        f = self.filters.pop(topic_filter, None)
        if f is None:
            return False
        self._match_cache.clear()
        for key, sub in list(self.subs.items()):
            if sub.group == f.group and not self.matching(sub.name, sub.group):
                del self.subs[key]
                self._close_sub(sub, delete=True)
        for held in [k for k, t in self.held.items() if not self.matching(t.sub.name, k[1])]:
            del self.held[held]  # its subscription is gone: never read again
        if self.qos2_out:
            gone = [k for k in self.qos2_out if k not in self.held and not self._subscribed(k[0])]
            for k in gone:
                self.drop_out(k)
                self.restored_out.pop(k[0], None)
        return True

    def drop_out(self, key: tuple[str, Position]) -> None:
        """Forget the recorded messages of entry ``key``; delete nodes left naming nothing."""
        self.qos2_out.pop(key, None)
        for seq in self.out_key_nodes.pop(key, ()):
            keys = self.out_nodes.get(seq)
            if keys is None:
                continue
            keys.discard(key)
            if not keys:
                del self.out_nodes[seq]
                self.broker.delete_qos2_out_node(self, seq)

    def _subscribed(self, full: str) -> bool:
        """Whether one of the client's own filters matches topic (or partition) ``full``."""
        name = topics.from_pulsar(topics.split_partition(full)[0])
        return name is not None and bool(self.matching(name, None))

    def topic_appeared(self, full: str, name: str) -> None:
        """A topic (or partition) was loaded: cover it if a filter matches it.

        A topic this session read before (unloaded and loaded again) is read on from where
        its subscription is (durable) or from now (non-durable), never again from the start."""
        groups = {f.group: f for f in self.filters.values() if topics.matches(f.pattern, name)}
        for group, f in groups.items():
            key = (full, group)
            if key not in self.subs:
                if self.parked and group is not None:
                    continue  # the share group's members read it
                not_before, after = self._lost.get(key, (f.subscribed_ms, None))
                # While the client is away only the durable subscription is made.
                then = "close" if self.parked else None
                d = self.ensure_sub(
                    full, name, group, not_before, create=False, after=after, then=then
                )
                d.addErrback(lambda _: None)

    def ensure_sub(
        self,
        full: str,
        name: str,
        group: str | None,
        not_before_ms: int | None,
        create: bool = True,
        after: Position | None = None,
        busy_wait_s: float | None = None,
        then: str | None = None,
        handled: tuple[type[Exception], ...] = (),
    ) -> Deferred[None]:
        """Attach the session's subscription on ``full`` unless attached; ``not_before_ms``
        reads from the earliest entry, skipping older ones (a topic found later), and so does
        ``after``, skipping entries up to that position (a non-durable subscription resumed).
        Only an exact filter ``create``s its topic: a wildcard never brings a deleted topic
        back. A subscription another broker still holds for this session (it is letting the
        session go) is retried: for up to ``busy_wait_s`` before failing, or (None) in the
        background. ``then="close"`` only makes the subscription (the consumer is closed once
        attached), ``then="delete"`` deletes it (a session ending while its client is away).
        A failure of a ``handled`` type is the caller's to recover from, or to report."""
        key = (full, group)
        if then is not None:
            return self._touch_sub(full, name, group, not_before_ms, create, then)
        if key in self.subs or self.ended:
            return succeed(None)
        asked_not_before = not_before_ms
        sub = TopicSub(self, full, name, group, self.broker.next_consumer_id(), not_before_ms or 0)
        sub.after = after
        if after is not None and not_before_ms is None:
            not_before_ms = 0  # read from the earliest entry, skipping up to ``after``
        self.subs[key] = sub
        durable = group is not None or self.persistent or self.durable_subs
        sub.durable = durable
        d = self._subscribe(sub, group, not_before_ms, durable, create)

        def attached(server: ConsumerHandle) -> None:
            sub.server = server
            sub.attached_ms = int(self.broker.clock.seconds() * 1000)
            if sub.closed or self.subs.get(key) is not sub:
                done = server.unsubscribe() if sub.delete else server.close()
                done.addErrback(lambda _: None)
                return
            server.flow(FLOW_WINDOW)

        def failed(f: Failure) -> Failure:
            if self.subs.get(key) is sub:
                del self.subs[key]
            (log.info if f.check(*handled) else log.warning)(
                "mqtt subscription failed",
                extra=kv(client=self.client_id, topic=full, error=str(f.value)),
            )
            if f.check(ConsumerBusyError) and not self.ended:
                # The broker this session just left still holds the subscription: it lets go
                # once it sees the session taken over (``MqttBroker``), then this attaches.
                if busy_wait_s is None:
                    self._attach_again(sub, not_before_ms, after, 0.2)
                elif busy_wait_s > 0:
                    return deferLater(
                        self.broker.clock,
                        0.1,
                        self.ensure_sub,
                        full,
                        name,
                        group,
                        asked_not_before,
                        create,
                        after,
                        busy_wait_s - 0.1,
                    )
            return f

        d.addCallbacks(attached, failed)
        return d

    def _subscribe(
        self,
        sub: TopicSub,
        group: str | None,
        not_before_ms: int | None,
        durable: bool,
        create: bool,
    ) -> Deferred[ConsumerHandle]:
        """Attach ``sub`` to its topic (forwarded to the owner in a cluster): a shared
        subscription for a ``$share`` group, from the earliest entry when a start time is set."""
        return self.broker.service.subscribe(
            sub.full,
            sub.subscription,
            sub,
            SubType.SHARED if group is not None else SubType.EXCLUSIVE,
            InitialPosition.EARLIEST if not_before_ms is not None else InitialPosition.LATEST,
            durable=durable,
            create_topic=create,
            forward=True,
        )

    def _touch_sub(
        self,
        full: str,
        name: str,
        group: str | None,
        not_before_ms: int | None,
        create: bool,
        then: str,
    ) -> Deferred[None]:
        """Make (``then="close"``) or delete (``"delete"``) a durable subscription with a
        consumer that never reads."""
        sub = TopicSub(self, full, name, group, self.broker.next_consumer_id(), 0)
        sub.closed = True
        d = self._subscribe(sub, group, not_before_ms, True, create)

        def attached(server: ConsumerHandle) -> None:
            done = server.unsubscribe() if then == "delete" else server.close()
            done.addErrback(lambda _: None)

        d.addCallback(attached)
        return d

    def consumer_lost(self, sub: TopicSub) -> None:
        key = (sub.full, sub.group)
        if self.subs.get(key) is sub:
            del self.subs[key]
        if sub.durable and sub.group is None:
            self._hold({sub})
        else:
            self.queue = deque(o for o in self.queue if o.track is None or o.track.sub is not sub)
        if self.ended or self.parked or not self.matching(sub.name, sub.group):
            return
        # A durable subscription resumes from its cursor; a non-durable one right after what
        # it was last handed (or from when it attached), e.g. when its topic moved to another
        # broker or a forwarded link to the owner went down.
        resume: tuple[int | None, Position | None] = (None, None)
        if not sub.durable and sub.seen is not None:
            resume = (sub.not_before_ms, sub.seen)
        elif not sub.durable:
            resume = (sub.attached_ms or None, sub.after)
        self._lost[key] = resume
        self._attach_again(sub, *resume, 0.2)

    def _attach_again(
        self, sub: TopicSub, not_before_ms: int | None, after: Position | None, delay: float
    ) -> None:
        """Attach ``sub``'s topic again after ``delay``, retrying (backoff up to 5 s) while a
        filter still wants it."""
        key = (sub.full, sub.group)

        def again() -> None:
            if (
                self.ended
                or self.parked
                or key in self.subs
                or not self.matching(sub.name, sub.group)
            ):
                return
            d = self.ensure_sub(
                sub.full, sub.name, sub.group, not_before_ms, create=False, after=after
            )
            d.addErrback(
                lambda _: self._attach_again(sub, not_before_ms, after, min(delay * 2, 5.0))
            )

        self.broker.clock.callLater(delay, again)

    def _close_sub(self, sub: TopicSub, delete: bool) -> None:
        """Detach ``sub``; with ``delete`` its durable subscription goes too (never a share
        group's, which other members use). One still attaching is handled when it attaches."""
        sub.closed = True
        sub.delete = delete and sub.durable and sub.group is None
        server = sub.server
        if server is None:
            return
        if sub.delete:
            server.unsubscribe().addErrback(lambda _: None)
        else:
            server.close().addErrback(lambda _: None)

    # -- delivery ------------------------------------------------------------------------

    def _packet_id(self) -> int:
        for _ in range(65535):
            self._next_pid = self._next_pid % 65535 + 1
            if self._next_pid not in self.inflight:
                return self._next_pid
        raise RuntimeError("no free packet identifier")

    def enqueue(self, out: Outgoing) -> None:
        self.queue.append(out)
        self.pump()

    def queue_retained(self, topic_filter: str, outs: list[Outgoing]) -> None:
        """Queue the retained copies a SUBSCRIBE of ``topic_filter`` receives, in place of
        those an earlier SUBSCRIBE of the same filter queued that have not left yet: a client
        subscribing again and again while it does not read, or does not acknowledge what it
        has, holds one copy of each, not one per SUBSCRIBE."""
        if any(o.via == topic_filter for o in self.queue):
            self.queue = deque(o for o in self.queue if o.via != topic_filter)
        for o in outs:
            o.via = topic_filter
        self.queue.extend(outs)

    def pump(self, at_read_end: bool = False) -> None:
        """Send what the connection and the client's receive maximum allow (during the
        connection's read: at its end, ``at_read_end``)."""
        queue = self.queue
        if not queue:
            # Nothing to send (a PUBACK's pump, mostly): nothing waits for the read's end.
            self.pump_due = False
            return
        link = self.link
        if link is None or link.paused:
            return
        if link.reading and not at_read_end:
            self.pump_due = True
            return
        self.pump_due = False
        chunks: list[bytes] = []
        gathered = 0
        now: float | None = None
        level = link.level
        inflight = self.inflight
        while queue:
            out = queue[0]
            if out.qos and len(inflight) >= link.client_receive_max:
                break
            queue.popleft()
            if out.expiry_at is not None:
                if now is None:
                    now = self.broker.clock.seconds()
                left = out.expiry_at - now
                if left <= 0:
                    self._complete(out)
                    continue
                # What is left, in whole seconds up: 0.4 s left is 1, never 0 (no expiry).
                out.properties[c.MESSAGE_EXPIRY] = math.ceil(left)
            pid: int | None = None
            if out.qos:
                # ``_packet_id``'s first try, without its call: the next id is mostly free.
                pid = self._next_pid = self._next_pid % 65535 + 1
                if pid in inflight:
                    pid = self._packet_id()
            try:
                data = c.encode_publish(
                    topic_field(out.topic),
                    out.payload,
                    out.qos,
                    out.retain,
                    False,
                    pid,
                    c.encode_properties(out.properties) if level == c.LEVEL_5 else b"",
                )
            except (ValueError, TypeError, KeyError) as e:
                # A message MQTT cannot carry (a property longer than 65535 bytes): skipped.
                log.warning("undeliverable message skipped", extra=kv(topic=out.topic, error=e))
                self._complete(out)
                continue
            if len(data) > link.client_max_packet:
                self._complete(out)
                continue
            chunks.append(data)
            if out.track is not None:
                out.track.sent |= 1 << out.index
            if pid is None:
                self._complete(out)
            else:
                out.packet_id = pid
                inflight[pid] = out
            gathered += len(data)
            if gathered >= MAX_GATHERED:
                link.write(b"".join(chunks))
                chunks = []
                gathered = 0
                if link.paused:
                    break
        if chunks:
            link.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _complete(self, out: Outgoing) -> None:
        track = out.track
        if track is not None:
            track.sub.complete(track)

    def on_puback(self, pid: int) -> None:
        out = self.inflight.get(pid)
        if out is not None and out.qos == 1:
            del self.inflight[pid]
            track = out.track
            if track is not None:
                track.sub.complete(track)
            if self.queue:
                self.pump()

    def on_pubrec(self, pid: int, reason_code: int) -> bool:
        """PUBREC of a QoS 2 delivery; return whether to answer PUBREL (else not found)."""
        out = self.inflight.get(pid)
        if out is None or out.qos != 2:
            return False
        if reason_code >= 0x80:
            del self.inflight[pid]
            self._complete(out)
            self.pump()
            return False
        out.released = True
        return True

    def record_pubrec(self, pid: int) -> bool:
        """The client has in-flight message ``pid`` (its PUBREC was accepted): note it in
        ``qos2_out``; return whether it was (the record is then written before PUBREL)."""
        out = self.inflight.get(pid)
        track = out.track if out is not None else None
        if (
            out is None
            or track is None
            or not self.persistent
            or track.sub.group is not None
            or not track.sub.durable
        ):
            return False
        key = (track.sub.full, track.position)
        self.qos2_out.setdefault(key, {})[out.index] = pid
        self.out_new.append((key, out.index, pid))
        return True

    def on_pubcomp(self, pid: int) -> None:
        out = self.inflight.get(pid)
        if out is not None and out.qos == 2:
            del self.inflight[pid]
            if self.qos2_out and out.track is not None:
                self._out_completed(out, out.track)
            self._complete(out)
            self.pump()

    def _out_completed(self, out: Outgoing, track: EntryTrack) -> None:
        """A recorded message is PUBCOMPed: done (0) until its entry's ack is durable."""
        key = (track.sub.full, track.position)
        got = self.qos2_out.get(key)
        if got is None or got.get(out.index) != out.packet_id:
            return
        got[out.index] = 0
        if key in self._stale_out and not any(got.values()):
            self._stale_out.discard(key)
            self.drop_out(key)

    def qos2_acked(self, key: tuple[str, Position]) -> None:
        """The entry ``key`` is durably acknowledged: its record goes."""
        self.drop_out(key)

    def passed_restored(self, full: str, position: Position) -> None:
        """The cursor of ``full`` delivers ``position``: restored entries before it that it did
        not deliver again were acknowledged before the crash (Exclusive: in order)."""
        waiting = self.restored_out.get(full)
        if not waiting:
            return
        waiting.discard(position)
        for p in [p for p in waiting if p < position]:
            waiting.discard(p)
            self.held.pop((full, None, p), None)
            key = (full, p)
            got = self.qos2_out.get(key)
            if got is not None and any(got.values()):
                self._stale_out.add(key)  # dropped at the last PUBCOMP
            elif got is not None:
                self.drop_out(key)
        if not waiting:
            del self.restored_out[full]

    def restore_out(self, nodes: list[tuple[int, list[tuple[str, Position, int, int]]]]) -> None:
        """Rebuild the outbound QoS 2 state from its record's nodes (ascending): every
        recorded message counts as handed over (``held``), and those awaiting PUBCOMP are in
        flight as released."""
        owner: dict[int, tuple[tuple[str, Position], int]] = {}
        for seq, rows in nodes:
            self.out_seq = max(self.out_seq, seq + 1)
            for full, pos, index, pid in rows:
                if not (0 <= index < 65536 and 0 <= pid <= 65535):
                    continue
                key = (full, pos)
                if pid:
                    earlier = owner.get(pid)
                    if earlier is not None and earlier != (key, index):
                        self.qos2_out[earlier[0]][earlier[1]] = 0  # completed, id reused
                    owner[pid] = (key, index)
                self.qos2_out.setdefault(key, {})[index] = pid
                self.out_nodes.setdefault(seq, set()).add(key)
                self.out_key_nodes.setdefault(key, set()).add(seq)
        subs: dict[str, TopicSub] = {}
        for (full, pos), got in self.qos2_out.items():
            sub = subs.get(full)
            if sub is None:
                name = topics.from_pulsar(topics.split_partition(full)[0]) or full
                # Stands in until the topic's subscription is attached and reads the entry.
                sub = TopicSub(self, full, name, None, self.broker.next_consumer_id(), 0)
                sub.closed = True
                sub.durable = True
                subs[full] = sub
            track = EntryTrack(sub, pos, 0, 0)
            for index, pid in got.items():
                track.sent |= 1 << index
                if pid:
                    track.remaining += 1
                    self.inflight[pid] = Outgoing(
                        sub.name,
                        b"",
                        2,
                        False,
                        {},
                        track=track,
                        packet_id=pid,
                        released=True,
                        index=index,
                    )
            self.held[(full, None, pos)] = track
            self.restored_out.setdefault(full, set()).add(pos)

    def unrelease(self, pids: Iterable[int]) -> None:
        """The record of these PUBRECs could not be written: they are not released (a return
        resends the PUBLISH with DUP, whose PUBREC records them again)."""
        for pid in pids:
            out = self.inflight.get(pid)
            if out is not None and out.qos == 2:
                out.released = False

    # -- lifecycle -----------------------------------------------------------------------

    def attach(self, link: ClientLink) -> None:
        """The client (re)connected: resend in-flight messages, then continue delivering."""
        if self._expiry_call is not None and self._expiry_call.active():
            self._expiry_call.cancel()
        self._expiry_call = None
        if self.will_call is not None and self.will_call.active():
            self.will_call.cancel()
        self.will_call = None
        self.will_fire = None
        self.link = link
        self.parked = False
        chunks = []
        for pid, out in self.inflight.items():
            if out.released:
                chunks.append(c.encode(c.PubRel(pid), link.level))
            else:
                chunks.append(
                    c.encode(
                        c.Publish(
                            out.topic, out.payload, out.qos, out.retain, True, pid, out.properties
                        ),
                        link.level,
                    )
                )
        if chunks:
            link.write(b"".join(chunks))
        # Then every filter reads on from its subscription (after the resends above).
        for f in self.filters.values():
            self._cover(f, initial=False).addErrback(lambda _: None)
        self.pump()

    def detach(self, link: ClientLink) -> None:
        """The connection went away: end the session or keep it until it expires."""
        if self.link is not link:
            return
        self.link = None
        if self.released:
            return
        if not self.persistent:
            self.broker.end_session(self)
            return
        self._leave_groups()
        self._park()
        if self.expiry_s is not None:
            self._expiry_call = self.broker.clock.callLater(
                self.expiry_s, self.broker.end_session, self
            )
            # Stored too, so a restarted broker still ends the session in time.
            now_ms = int(self.broker.clock.seconds() * 1000)
            self.expires_at_ms = now_ms + self.expiry_s * 1000
            self.broker.save(self).addErrback(lambda _: None)

    def _leave_groups(self) -> None:
        # An absent member must not hold a share group's messages: its shared consumers go
        # (their unacknowledged messages go to the other members) until the client returns.
        gone = {key: sub for key, sub in self.subs.items() if sub.group is not None}
        if not gone:
            return
        for key, sub in gone.items():
            del self.subs[key]
            self._close_sub(sub, delete=False)
        subs = set(gone.values())
        self.queue = deque(o for o in self.queue if o.track is None or o.track.sub not in subs)
        for pid, out in list(self.inflight.items()):
            if out.track is not None and out.track.sub in subs:
                del self.inflight[pid]

    def _park(self) -> None:
        """The client left: close the consumers (the backlog stays in the log, kept by the
        durable subscriptions) and drop what waited to be sent; in-flight messages stay."""
        self.parked = True
        subs = set(self.subs.values())
        self.subs.clear()
        for sub in subs:
            self._close_sub(sub, delete=False)
        self._hold(subs)

    def _hold(self, subs: set[TopicSub]) -> None:
        """Forget the queued messages of closed durable ``subs``; their entries, read again,
        send only what was not handed over (``held``)."""
        if not subs:
            return
        tracks: dict[int, EntryTrack] = {}
        keep: deque[Outgoing] = deque()
        for out in self.queue:
            t = out.track
            if t is not None and t.sub in subs:
                tracks[id(t)] = t
            else:
                keep.append(out)
        self.queue = keep
        in_flight = [o.track for o in self.inflight.values() if o.track and o.track.sub in subs]
        for t in in_flight:
            tracks[id(t)] = t
        for t in tracks.values():
            t.remaining = 0
        for t in in_flight:
            t.remaining += 1
        for t in tracks.values():
            self.held[(t.sub.full, t.sub.group, t.position)] = t

    def end(self) -> None:
        """Drop every subscription (durable ones are deleted) and all state; a will still
        waiting for its delay is published now."""
        self.ended = True
        if self.will_call is not None and self.will_call.active():
            self.will_call.cancel()
            if self.will_fire is not None:
                self.will_fire()
        self.will_call = None
        self.will_fire = None
        if self._expiry_call is not None and self._expiry_call.active():
            self._expiry_call.cancel()
        for sub in self.subs.values():
            self._close_sub(sub, delete=True)
        self.subs.clear()
        if self.parked:
            # The client is away and nothing is attached: delete its subscriptions.
            for f in self.filters.values():
                if f.group is None:
                    self._cover(f, initial=False, then="delete").addErrback(lambda _: None)
        self.queue.clear()
        self.inflight.clear()
        self.held.clear()
        self._drop_out_state()

    def _drop_out_state(self) -> None:
        self.qos2_out.clear()
        self.restored_out.clear()
        self._stale_out.clear()
        self.out_new.clear()
        self.out_nodes.clear()
        self.out_key_nodes.clear()
        waiters, self.out_waiters = self.out_waiters, []
        for w in waiters:
            w.callback(None)

    def snapshot(self) -> bytes:
        return json.dumps(
            {
                "expiry": self.expiry_s,
                "holder": self.broker.instance,
                "expires_at_ms": self.expires_at_ms,
                "filters": [f.as_json() for f in self.filters.values()],
            }
        ).encode()


class PidScan:
    """A reader from a position to ``end`` collecting where one producer's messages carry
    ``mqtt.pid``: ``done`` fires with pid -> positions (or fails when the broker closes it)."""

    PERMITS = 1000

    def __init__(
        self, producer: str, after: Position | None, end: Position, consumer_id: int
    ) -> None:
        self.consumer_id = consumer_id
        self.producer = producer
        self.after = after
        self.end = end
        self.server: ConsumerHandle | None = None
        self.found: dict[int, list[Position]] = {}
        self.done: Deferred[dict[int, list[Position]]] = Deferred()

    consumer_name = "mqtt-qos2-check"
    priority_level = 0

    def send_entries(self, deliveries: list[Delivery]) -> None:
        if self.done.called:
            return
        permits = 0
        for entry, _count, _acked in deliveries:
            permits += entry.num_messages
            pos = entry.position
            if self.after is not None and not self.after < pos:
                continue
            if not self.end < pos:
                self._inspect(pos, entry.data)
            if not pos < self.end:
                self.done.callback(self.found)
                return
        if self.server is not None and permits:
            self.server.flow(permits)

    def _inspect(self, pos: Position, data: bytes) -> None:
        try:
            md, _ = split_entry(data)
            if md.producer_name != self.producer:
                return
            msgs = decode_entry(data)
        except MessageFormatError:
            return
        for m in msgs:
            for k, v in m.properties:
                if k == "mqtt.pid" and v.isdigit():
                    self.found.setdefault(int(v), []).append(pos)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        if not self.done.called:
            self.done.errback(ConsumerClosedError("the broker closed the qos2 check"))


class MqttBroker:
    """The MQTT state shared by every connection of one handler: sessions and retained
    messages, over the Broker API and the metadata store."""

    def __init__(
        self,
        service: Any,
        clock: IReactorTime,
        deny_list: Iterable[str] = (),
    ) -> None:
        self.service = service
        self.clock = clock
        self.store = service.metadata_store
        self.deny_list = [d for d in deny_list if d]
        self.sessions: dict[str, Session] = {}
        #: Client ids with a stored (persistent) session: only those are looked up at CONNECT.
        self.stored_ids: set[str] = set()
        self.retained: dict[str, Retained] = {}
        #: Publishes failing (storage refusing writes) are warned of at most every 30 s each.
        self.publish_failures = Repeats(clock.seconds)
        #: The messages of the entries written here lately, by entry bytes: a subscriber
        #: reading an entry this broker just wrote skips decoding it.
        self.written: dict[bytes, list[Message]] = {}
        self._written_bytes = 0
        self._consumer_ids = 0
        self._partitions: dict[str, int] = {}
        # The namespace's topics, listed at most every LISTING_TTL_S (wildcard SUBSCRIBEs of a
        # reconnecting fleet share one listing); topics loaded meanwhile are added.
        self._names: dict[str, float] = {}  # full name -> when listed or loaded
        self._names_at = -LISTING_TTL_S
        self._listing: list[Deferred[list[str]]] | None = None
        # Timers ending stored sessions of absent clients (found at start).
        self._stored_expiry: dict[str, IDelayedCall] = {}
        self._remove_listener: Callable[[], None] | None = None
        #: Whether other brokers serve MQTT clients too (sessions and retained messages are
        #: then read from the metadata store, not only from what this broker remembers).
        ownership = getattr(service, "ownership", None)
        self.clustered = bool(ownership is not None and ownership.clustered)
        #: Names this broker in the sessions it stores (``holder``).
        self.instance = secrets.token_hex(8)
        # Sessions held here whose stored record is watched (client id -> unwatch).
        self._held: dict[str, Callable[[], None]] = {}

    def start(self) -> Deferred[None]:
        """Load retained messages and the stored sessions' ids; follow topic creation."""
        remove_listener = self.service.add_topic_listener(self._topic_loaded)
        # In a cluster, topics first used on another broker are reported from metadata.
        unwatch = self.service.watch_namespace_topics(topics.NAMESPACE, self._topic_loaded)

        def remove() -> None:
            remove_listener()
            unwatch()

        self._remove_listener = remove
        return Deferred.fromCoroutine(self._load())

    async def _load(self) -> None:
        self.stored_ids = {unquote(c) for c in await self.store.children(SESSIONS_ROOT)}
        now_ms = int(self.clock.seconds() * 1000)
        ids = sorted(self.stored_ids)
        # Read together (a cluster records every connected session: there may be many).
        found = await gatherResults(
            [self.store.get(f"{SESSIONS_ROOT}/{quote(i, safe='')}") for i in ids],
            consumeErrors=True,
        )
        for client_id, got in zip(ids, found, strict=True):
            try:
                expires = json.loads(got.value).get("expires_at_ms") if got else None
            except ValueError:
                expires = None
            if expires is not None:
                delay = max(0.0, (int(expires) - now_ms) / 1000.0)
                self._stored_expiry[client_id] = self.clock.callLater(
                    delay, self._expire_stored, client_id
                )
        for child in await self.store.children(RETAINED_ROOT):
            got = await self.store.get(f"{RETAINED_ROOT}/{child}")
            if got is not None:
                try:
                    self.retained[unquote(child)] = Retained.decode(unquote(child), got.value)
                except (ValueError, KeyError, TypeError):
                    log.warning("bad retained message skipped", extra=kv(topic=unquote(child)))

    def _expire_stored(self, client_id: str) -> None:
        self._stored_expiry.pop(client_id, None)
        if client_id in self.sessions:
            return  # back (or restored): its own timer decides
        d = Deferred.fromCoroutine(self._expire_if_due(client_id))
        d.addErrback(
            lambda f: log.warning(
                "expiring a stored mqtt session failed",
                extra=kv(client=client_id, error=str(f.value)),
            )
        )

    async def _expire_if_due(self, client_id: str) -> None:
        # The device may have come back since (here or, in a cluster, to another broker): only
        # a record still absent and past its expiry ends the session.
        got = await self.store.get(f"{SESSIONS_ROOT}/{quote(client_id, safe='')}")
        try:
            expires = json.loads(got.value).get("expires_at_ms") if got else None
        except (ValueError, AttributeError):
            expires = None
        if expires is None or client_id in self.sessions:
            return
        left = (int(expires) - int(self.clock.seconds() * 1000)) / 1000.0
        if left > 0:
            self._stored_expiry[client_id] = self.clock.callLater(
                left, self._expire_stored, client_id
            )
            return
        session = await self._restore(client_id)
        if session is not None and session.link is None:
            self.end_session(session)

    def stop(self) -> None:
        if self._remove_listener is not None:
            self._remove_listener()
        for unwatch in self._held.values():
            unwatch()
        self._held.clear()
        for call in self._stored_expiry.values():
            if call.active():
                call.cancel()
        self._stored_expiry.clear()
        for session in list(self.sessions.values()):
            for call in (session._expiry_call, session.will_call):
                if call is not None and call.active():
                    call.cancel()

    def next_consumer_id(self) -> int:
        self._consumer_ids += 1
        return self._consumer_ids

    def denied(self, topic_filter: str) -> bool:
        """Whether the deny list refuses a SUBSCRIBE of ``topic_filter``."""
        return any(d == topic_filter or topics.matches(d, topic_filter) for d in self.deny_list)

    def topic_names(self) -> Deferred[list[str]]:
        """Full names of the namespace's topics (a listing at most ``LISTING_TTL_S`` old,
        plus every topic loaded since)."""
        if self.clock.seconds() - self._names_at < LISTING_TTL_S:
            return succeed(sorted(self._names))
        d: Deferred[list[str]] = Deferred()
        if self._listing is not None:
            self._listing.append(d)
            return d
        self._listing = [d]
        started = self.clock.seconds()

        def listed(names: list[str]) -> None:
            # Deleted topics drop out; topics loaded while listing stay.
            fresh = {n: t for n, t in self._names.items() if t >= started}
            fresh.update(dict.fromkeys(names, started))
            self._names = fresh
            self._names_at = started
            waiting, self._listing = self._listing or [], None
            for w in waiting:
                w.callback(sorted(self._names))

        def failed(f: Failure) -> None:
            waiting, self._listing = self._listing or [], None
            for w in waiting:
                w.errback(f)

        self.service.topics_of_namespace(topics.NAMESPACE).addCallbacks(listed, failed)
        return d

    def _topic_loaded(self, full: str) -> None:
        name = topics.from_pulsar(topics.split_partition(full)[0])
        if name is None:
            return
        self._names[full] = self.clock.seconds()
        for session in list(self.sessions.values()):
            if session.filters:
                session.topic_appeared(full, name)

    # -- sessions ------------------------------------------------------------------------

    def open_session(
        self, client_id: str, clean_start: bool, expiry_s: int | None
    ) -> Deferred[tuple[Session, bool]]:
        """The session for a CONNECT: ``(session, session_present)``. An attached session is
        taken over (its connection kicked) by the caller before attaching."""
        return Deferred.fromCoroutine(self._open(client_id, clean_start, expiry_s))

    async def _open(
        self, client_id: str, clean_start: bool, expiry_s: int | None
    ) -> tuple[Session, bool]:
        existing = self.sessions.get(client_id)
        if existing is not None and existing.link is not None:
            existing.link.kick(c.SESSION_TAKEN_OVER)
        if existing is None:
            existing = await self._restore(client_id)
        now_ms = int(self.clock.seconds() * 1000)
        if existing is not None and existing.link is None:
            expires = existing.expires_at_ms
            if expires is not None and expires <= now_ms:
                self.end_session(existing)  # expired while the broker was down
                existing = None
        if existing is not None and (clean_start or existing.ended):
            self.end_session(existing)
            existing = None
        if existing is not None:
            existing.expiry_s = expiry_s
            existing.expires_at_ms = None
            # In a cluster every connected session is recorded, so that a broker the device
            # connects to next can take it over (``release``).
            if existing.persistent or self.clustered:
                await self.save(existing)
            else:
                await self._forget(client_id)
            return existing, True
        session = Session(self, client_id, expiry_s)
        self.sessions[client_id] = session
        if session.persistent or self.clustered:
            await self.save(session)
        return session, False

    async def _restore(self, client_id: str) -> Session | None:
        # In a cluster a session may have been stored by another broker since this one started.
        if client_id not in self.stored_ids and not self.clustered:
            return None
        got = await self.store.get(f"{SESSIONS_ROOT}/{quote(client_id, safe='')}")
        if got is None:
            return None
        try:
            raw = json.loads(got.value)
            session = Session(self, client_id, raw.get("expiry"))
            expires = raw.get("expires_at_ms")
            session.expires_at_ms = None if expires is None else int(expires)
            filters = [FilterSub.from_json(f) for f in raw["filters"]]
        except (ValueError, KeyError, TypeError, IndexError):
            log.warning("bad stored mqtt session dropped", extra=kv(client=client_id))
            await self._forget(client_id)
            return None
        if session.expiry_s == 0:
            # A clean session connected to another broker (or left by a dead one): it is not
            # resumed; deleting its record makes its holder let the device's connection go.
            await self._forget(client_id)
            return None
        await self._restore_qos2(session)
        out_nodes = await self._stored_qos2_out(client_id)
        if client_id in self.sessions:  # restored concurrently
            return self.sessions[client_id]
        self.sessions[client_id] = session
        for f in filters:
            session.filters[f.topic_filter] = f
        session.restore_out(out_nodes)
        # Nothing is attached until the client is (``attach``): the backlog stays in the log.
        session.parked = True
        return session

    def end_session(self, session: Session) -> None:
        """End a session: its subscriptions go, its durable record too."""
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        if session.link is not None:
            return
        session.end()
        if session.client_id in self.stored_ids:
            self._forget(session.client_id)

    def save(self, session: Session) -> Deferred[Any]:
        """Store a persistent session's filters (naming this broker as its holder)."""
        if session.released:
            return succeed(None)
        self.stored_ids.add(session.client_id)
        path = f"{SESSIONS_ROOT}/{quote(session.client_id, safe='')}"
        self._hold(session.client_id, path)
        return self.store.put(path, session.snapshot())

    def _hold(self, client_id: str, path: str) -> None:
        """In a cluster, watch a session this broker holds: when another broker stores it as
        its own (the device connected there) or it is ended there, let it go here."""
        if not self.clustered or client_id in self._held:
            return

        def changed(_: object) -> None:
            d = Deferred.fromCoroutine(self._check_holder(client_id, path))
            d.addErrback(
                lambda f: log.warning(
                    "checking an mqtt session's holder failed",
                    extra=kv(client=client_id, error=str(f.value)),
                )
            )

        self._held[client_id] = self.store.watch(path, changed)

    async def _check_holder(self, client_id: str, path: str) -> None:
        if client_id not in self._held:
            return
        got = await self.store.get(path)
        holder = None
        if got is not None:
            with contextlib.suppress(ValueError, AttributeError):
                holder = json.loads(got.value).get("holder")
        if got is None or (holder is not None and holder != self.instance):
            self.release(client_id, ended=got is None)

    def release(self, client_id: str, ended: bool = False) -> None:
        """Another broker holds the session now: kick its connection here and let its
        subscriptions go (not deleted: the new holder reads them on). ``ended``: the session
        was ended there (its record deleted), so its durable subscriptions are deleted too."""
        unwatch = self._held.pop(client_id, None)
        if unwatch is not None:
            unwatch()
        session = self.sessions.get(client_id)
        if session is None:
            return
        log.info("mqtt session taken over by another broker", extra=kv(client=client_id))
        del self.sessions[client_id]
        session.released = True
        session.ended = True
        for call in (session._expiry_call, session.will_call):
            if call is not None and call.active():
                call.cancel()
        if session.link is not None:
            session.link.kick(c.SESSION_TAKEN_OVER)
        for sub in session.subs.values():
            session._close_sub(sub, delete=ended)
        session.subs.clear()
        session.queue.clear()
        session.inflight.clear()
        session._drop_out_state()

    def _forget(self, client_id: str) -> Deferred[None]:
        self.stored_ids.discard(client_id)
        unwatch = self._held.pop(client_id, None)
        if unwatch is not None:
            unwatch()
        path = f"{SESSIONS_ROOT}/{quote(client_id, safe='')}"
        self.store.delete(f"{QOS2_ROOT}/{quote(client_id, safe='')}").addErrback(lambda _: None)
        Deferred.fromCoroutine(self._delete_qos2_out(client_id)).addErrback(lambda _: None)
        d = self.store.delete(path)
        d.addErrback(lambda _: None)
        return d

    # -- publishing ----------------------------------------------------------------------

    def publish(self, pub: c.Publish, client_id: str) -> Deferred[Any]:
        """Store ``pub`` on its topic (and as the retained message when flagged); fire (with
        no meaningful result) once both are durable."""
        return self.publish_batch([pub], client_id)

    def publish_batch(
        self, pubs: list[c.Publish], client_id: str, session: Session | None = None
    ) -> Deferred[Any]:
        """Store PUBLISHes of one topic as one entry (a batch when several), and the last
        retained one as the topic's retained message; fire (with no meaningful result) once
        durable. The QoS 2 packet ids of a persistent ``session`` are recorded first (see the
        module docstring)."""
        now_ms = int(self.clock.seconds() * 1000)
        props = [stored_properties(p) for p in pubs]
        msgs = [Message(p.payload, properties=pr) for p, pr in zip(pubs, props, strict=True)]
        any_qos2 = any(p.qos == 2 for p in pubs)
        data = encode_entry(
            msgs, producer_name="mqtt-" + client_id, sequence_id=0, publish_time_ms=now_ms
        )
        written = self.written
        if len(data) <= WRITTEN_CACHE_BYTES // 4 and data not in written:
            while written and (
                len(written) >= WRITTEN_CACHE
                or self._written_bytes + len(data) > WRITTEN_CACHE_BYTES
            ):
                oldest = next(iter(written))
                del written[oldest]
                self._written_bytes -= len(oldest)
            written[data] = msgs
            self._written_bytes += len(data)
        full = topics.to_pulsar(pubs[0].topic)
        n = len(pubs)
        known = self._partitions.get(full)
        exactly_once = (
            [p.packet_id for p in pubs if p.qos == 2 and p.packet_id is not None]
            if any_qos2 and session is not None and session.persistent and not session.released
            else []
        )
        if exactly_once:
            assert session is not None
            d = Deferred.fromCoroutine(
                self._publish_recorded(session, full, data, n, client_id, exactly_once)
            )
        elif known:
            d = self.service.publish(
                self._partition_of(full, known, client_id), data, n, forward=True
            )
        else:
            d = self.service.publish(full, data, n, forward=True)
            d.addErrback(self._publish_partitioned, full, data, n, client_id)
        for i in range(n - 1, -1, -1):
            if pubs[i].retain:
                d.addCallback(lambda _, last=pubs[i], pr=props[i]: self.set_retained(last, pr))
                break
        return d

    async def _publish_recorded(
        self, session: Session, full: str, data: bytes, n: int, client_id: str, pids: list[int]
    ) -> None:
        count = await self.partitions(full)
        target = self._partition_of(full, count, client_id) if count > 0 else full
        after: Position | None = None
        try:
            last = await self.service.last_message_id(target)
            if last.position.entry_id >= 0:
                after = last.position
        except Exception:
            after = None  # not created yet, or served elsewhere: read from the earliest
        for pid in pids:
            session.qos2_record[pid] = (target, after)
        await self.save_qos2(session)
        try:
            await self.service.publish(target, data, n, forward=True)
        except Exception:
            for pid in pids:
                session.qos2_record.pop(pid, None)
            self.save_qos2(session).addErrback(lambda _: None)
            raise

    def save_qos2(self, session: Session) -> Deferred[Any]:
        """Store (or, when empty, delete) a session's QoS 2 record."""
        path = f"{QOS2_ROOT}/{quote(session.client_id, safe='')}"
        if session.released:
            return succeed(None)
        if not session.qos2_record:
            d = self.store.delete(path)
            d.addErrback(lambda _: None)
            return d
        doc = {
            str(pid): [t, None if a is None else [a.ledger_id, a.entry_id]]
            for pid, (t, a) in session.qos2_record.items()
        }
        return self.store.put(path, json.dumps(doc).encode())

    def release_qos2(self, session: Session, pids: Iterable[int]) -> Deferred[Any]:
        """PUBRELs of ``pids``: forget them (durably first, in one write, for a persistent
        session)."""
        changed = False
        for pid in pids:
            session.inbound_qos2.discard(pid)
            changed = session.qos2_record.pop(pid, None) is not None or changed
        return self.save_qos2(session) if changed else succeed(None)

    def _qos2_out_path(self, client_id: str, seq: int | None = None) -> str:
        path = f"{QOS2_OUT_ROOT}/{quote(client_id, safe='')}"
        return path if seq is None else f"{path}/{seq:010d}"

    def save_qos2_out(self, session: Session) -> Deferred[None]:
        """Store the rows recorded so far as the record's next node; fire once stored (at
        once when there are none). While a node is being written the next one waits for it,
        taking every row recorded meanwhile."""
        if not session.out_new or session.released or session.ended:
            return succeed(None)
        d: Deferred[None] = Deferred()
        session.out_waiters.append(d)
        if not session.out_writing:
            self._write_qos2_out_node(session)
        return d

    def _write_qos2_out_node(self, session: Session) -> None:
        waiters, session.out_waiters = session.out_waiters, []
        rows = [r for r in session.out_new if r[0] in session.qos2_out]
        session.out_new = []
        if not rows or session.released or session.ended:
            for w in waiters:
                w.callback(None)
            return
        seq = session.out_seq
        session.out_seq += 1
        keys = {key for key, _, _ in rows}
        session.out_nodes[seq] = keys
        for key in keys:
            session.out_key_nodes.setdefault(key, set()).add(seq)
        session.out_writing.add(seq)
        path = self._qos2_out_path(session.client_id, seq)
        doc = [[full, p.ledger_id, p.entry_id, i, pid] for (full, p), i, pid in rows]
        d: Deferred[Any] = self.store.put(path, json.dumps(doc).encode())

        def written(result: object) -> None:
            session.out_writing.discard(seq)
            if not session.released and (session.ended or seq not in session.out_nodes):
                # Dropped (or the session ended) while being written: it must not stay.
                self.store.delete(path).addErrback(lambda _: None)
            for w in waiters:
                if isinstance(result, Failure):
                    w.errback(result)
                else:
                    w.callback(None)
            if session.out_waiters:
                self._write_qos2_out_node(session)

        d.addBoth(written)

    def delete_qos2_out_node(self, session: Session, seq: int) -> None:
        """Delete a node of the record that names nothing any more (one being written is
        deleted when its write completes)."""
        if seq in session.out_writing or session.released:
            return
        self.store.delete(self._qos2_out_path(session.client_id, seq)).addErrback(lambda _: None)

    async def _delete_qos2_out(self, client_id: str) -> None:
        path = self._qos2_out_path(client_id)
        for child in await self.store.children(path):
            with contextlib.suppress(Exception):
                await self.store.delete(f"{path}/{child}")
        with contextlib.suppress(Exception):
            await self.store.delete(path)

    async def _stored_qos2_out(
        self, client_id: str
    ) -> list[tuple[int, list[tuple[str, Position, int, int]]]]:
        """The nodes of a stored session's outbound QoS 2 record, ascending (see
        ``restore_out``); a node that does not decode is skipped."""
        path = self._qos2_out_path(client_id)
        out = []
        for child in await self.store.children(path):
            got = await self.store.get(f"{path}/{child}")
            if got is None:
                continue
            try:
                rows = [
                    (str(t), Position(int(ledger), int(entry)), int(i), int(pid))
                    for t, ledger, entry, i, pid in json.loads(got.value)
                ]
                out.append((int(child), rows))
            except (ValueError, TypeError):
                log.warning("bad stored mqtt qos2 record skipped", extra=kv(client=client_id))
        out.sort(key=lambda n: n[0])
        return out

    async def _restore_qos2(self, session: Session) -> None:
        """Rebuild a restored session's stored QoS 2 packet ids from its record and the log
        (see the module docstring); raise when the log cannot be read."""
        got = await self.store.get(f"{QOS2_ROOT}/{quote(session.client_id, safe='')}")
        if got is None:
            return
        try:
            raw = json.loads(got.value)
            record = {
                int(pid): (str(t), None if a is None else Position(int(a[0]), int(a[1])))
                for pid, (t, a) in raw.items()
            }
        except (ValueError, TypeError, IndexError, AttributeError):
            log.warning("bad stored mqtt qos2 record dropped", extra=kv(client=session.client_id))
            record = {}
        by_topic: dict[str, dict[int, Position | None]] = {}
        for pid, (t, a) in record.items():
            by_topic.setdefault(t, {})[pid] = a
        kept: dict[int, tuple[str, Position | None]] = {}
        for t, wanted in by_topic.items():
            found = await self._stored_pids(t, "mqtt-" + session.client_id, wanted)
            for pid in found:
                kept[pid] = (t, wanted[pid])
        session.qos2_record = kept
        session.inbound_qos2 = set(kept)
        if kept != record:
            await self.save_qos2(session)

    async def _stored_pids(
        self, full: str, producer: str, wanted: dict[int, Position | None]
    ) -> set[int]:
        """Which of ``wanted`` (pid -> position before it) ``producer`` stored on ``full``."""
        try:
            last = await self.service.last_message_id(full)
        except TopicNotFoundError:
            return set()
        except Exception:
            # Served by another broker (cluster): its end cannot be asked here, so the ids
            # are forgotten and a resend is stored again (a duplicate rather than a loss).
            log.warning("mqtt qos2 ids not checked", extra=kv(topic=full, producer=producer))
            return set()
        if last.position.entry_id < 0:
            return set()
        starts = list(wanted.values())
        start = None if None in starts else min(a for a in starts if a is not None)
        if start is not None and not start < last.position:
            return set()
        scan = PidScan(producer, start, last.position, self.next_consumer_id())
        server = await self.service.subscribe(
            full,
            "mqtt-qos2-check-" + secrets.token_hex(4),
            scan,
            SubType.EXCLUSIVE,
            InitialPosition.EARLIEST,
            durable=False,
            start_position=start,
            create_topic=False,
        )
        scan.server = server
        server.flow(PidScan.PERMITS)
        try:
            seen = await scan.done
        finally:
            server.close().addErrback(lambda _: None)
        return {
            pid
            for pid, a in wanted.items()
            if any(a is None or a < pos for pos in seen.get(pid, []))
        }

    def _publish_partitioned(
        self, f: Failure, full: str, data: bytes, n: int, client_id: str
    ) -> Deferred[Any]:
        # The topic is partitioned (a Kafka client made it): publish to one of its partitions.
        f.trap(NotAllowedError)

        def to_partition(count: int) -> Deferred[Any]:
            if count <= 0:
                return fail(f)
            return self.service.publish(
                self._partition_of(full, count, client_id), data, n, forward=True
            )

        d = self.partitions(full)
        d.addCallback(to_partition)
        return d

    @staticmethod
    def _partition_of(full: str, count: int, client_id: str) -> str:
        return topics.partition_name(full, zlib.crc32(client_id.encode()) % count)

    def partitions(self, full: str) -> Deferred[int]:
        """The partition count of a topic (0: not partitioned); positive counts are cached."""
        known = self._partitions.get(full)
        if known:
            return succeed(known)
        d: Deferred[int] = self.service.partitioned_topic_metadata(full)

        def remember(count: int) -> int:
            if count > 0:
                self._partitions[full] = count
            return count

        d.addCallback(remember)
        return d

    # -- retained ------------------------------------------------------------------------

    def set_retained(self, pub: c.Publish, properties: list[tuple[str, str]]) -> Deferred[Any]:
        """Store (or, with an empty payload, clear) the retained message of ``pub.topic``."""
        path = f"{RETAINED_ROOT}/{quote(pub.topic, safe='')}"
        if not pub.payload:
            self.retained.pop(pub.topic, None)
            d = self.store.delete(path)
            d.addErrback(lambda _: None)
            return d
        r = Retained(pub.topic, pub.payload, pub.qos, properties, self.clock.seconds())
        self.retained[pub.topic] = r
        return self.store.put(path, r.encode())

    def refresh_retained(self, pattern: str) -> Deferred[None]:
        """Read the stored retained messages whose topic ``pattern`` matches into the cache
        (a cluster's other brokers store them too); a failure is logged, not raised."""
        d = Deferred.fromCoroutine(self._refresh_retained(pattern))
        d.addErrback(
            lambda f: log.warning(
                "reading retained messages failed", extra=kv(filter=pattern, error=str(f.value))
            )
        )
        return d

    async def _refresh_retained(self, pattern: str) -> None:
        names = {unquote(n) for n in await self.store.children(RETAINED_ROOT)}
        wanted = sorted(n for n in names if topics.matches(pattern, n))
        for name in [n for n in self.retained if n not in names and topics.matches(pattern, n)]:
            del self.retained[name]
        got = await gatherResults(
            [self.store.get(f"{RETAINED_ROOT}/{quote(n, safe='')}") for n in wanted],
            consumeErrors=True,
        )
        for name, found in zip(wanted, got, strict=True):
            if found is None:
                self.retained.pop(name, None)
                continue
            try:
                self.retained[name] = Retained.decode(name, found.value)
            except (ValueError, KeyError, TypeError):
                log.warning("bad retained message skipped", extra=kv(topic=name))

    def retained_for(self, f: FilterSub) -> list[Outgoing]:
        """The retained messages a new subscription of ``f`` receives."""
        out = []
        sub_ids = [f.sub_id] if f.sub_id else []
        for name, r in sorted(self.retained.items()):
            if topics.matches(f.pattern, name):
                msg = Message(r.payload, properties=r.properties)
                o = outgoing_from(msg, name, f.qos, sub_ids, True, r.stored_s)
                o.retain = True
                out.append(o)
        return out
