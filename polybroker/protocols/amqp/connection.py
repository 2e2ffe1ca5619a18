"""One AMQP 0-9-1 client connection and its channels: thin Twisted glue over the codec and
the virtual hosts.

Ordering: the methods of one channel run in arrival order; a method that waits (a declare
persisted in the metadata store, a basic.get waiting for appends under way) holds back the
methods after it on that channel only. Publishes do not wait for their writes: confirms and
``tx.commit`` do. While a channel holds back ``MAX_BACKLOG`` methods, the socket is not read
(until half of them ran), so a client that pipelines methods faster than they complete is
slowed by TCP, as RabbitMQ's flow control slows its reader, rather than queued in memory.

Deliveries: while the socket's send buffer is full (the transport paused this connection, its
producer), no consumer of the connection takes more messages; they stay in their queues (a
durable queue's in its log), and the queues dispatch again once it drained. A dispatch writes
what it gathered every ``MAX_GATHERED`` bytes, so one dispatch to an auto-ack consumer (whose
messages are settled as they are written) cannot move a whole queue into the send buffer.
Should the buffer still pass ``MAX_UNREAD`` (answers to a client that sends methods, say
basic.get, and does not read), the socket is not read either until it drained, and the methods
already read wait too: those of the same read, and those held back on a channel.

Publishing: while more than ``MAX_PENDING_PUBLISHES`` publishes (or ``MAX_PENDING_PUBLISH_BYTES``
of them) are on their way to storage, the socket is not read, until half of them are stored: a
publisher faster than storage is slowed by TCP rather than queued in memory. Nor is it while
the broker-wide ``PublishBuffer`` is full ("buffer"). A transaction holds its publishes in
memory until tx.commit, as RabbitMQ does, up to ``MAX_TX_PUBLISHES`` or ``MAX_TX_BYTES``: one
that would hold more closes the connection with resource-error (the transaction is lost, as
on any close before tx.commit).

Errors: an ``AmqpError`` with a hard reply code closes the connection (connection.close, then
the socket once close-ok arrives or after a grace period); any other closes the channel.

Cluster: when the handler's ``route`` names another broker for the vhost of connection.open,
the connection becomes a relay to that broker (``proxy``: the handshake is replayed there, then
bytes go both ways unchanged).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from typing_extensions import override
from zope.interface import implementer

from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.broker_core.publish_buffer import PendingPublishes
from polybroker.logs import kv
from polybroker.netio import MAX_UNREAD, ReadHolds, write_now
from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.convert import AmqpMessage
from polybroker.protocols.amqp.proxy import (
    LINK_TIMEOUT_S,
    PROXIED,
    Connect,
    OwnerAddress,
    OwnerLink,
    tcp_connect,
)
from polybroker.protocols.amqp.vhost import (
    MemoryGauge,
    Queue,
    QueueConsumer,
    QueuedMessage,
    QueueFullError,
    VirtualHost,
)

log = logging.getLogger(__name__)

#: Methods one channel holds back (behind one that waits) before the socket stops being read.
MAX_BACKLOG = 1024
#: Bytes of deliveries one dispatch gathers before writing them and checking the buffer.
MAX_GATHERED = 64 * 1024
#: Publishes (and their body bytes) a connection may have under way to storage before its
#: socket stops being read, until half of them are stored.
MAX_PENDING_PUBLISHES = 1000
MAX_PENDING_PUBLISH_BYTES = 32 * 1024 * 1024
#: Publishes (and their body bytes) one transaction may hold until tx.commit: past them the
#: connection is closed with resource-error.
MAX_TX_PUBLISHES = 100_000
MAX_TX_BYTES = 64 * 1024 * 1024

CLOSE_GRACE_S = 5.0
PRODUCT = "polybroker"


@dataclass
class AmqpSettings:
    """What every connection of the handler shares."""

    service: Any
    clock: IReactorTime
    users: dict[str, str]
    vhost: Callable[[str], Deferred[VirtualHost]]
    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat_s: int = 60
    max_message_size: int = 5 * 1024 * 1024
    gauge: MemoryGauge = field(default_factory=lambda: MemoryGauge(0))
    #: Cluster only: the vhost here, or the broker to relay to; the flag says whether the
    #: connection is itself a relay (``proxy``, Rule P4). None: ``vhost`` (standalone).
    route: Callable[[str, bool], Deferred[VirtualHost | OwnerAddress]] | None = None
    #: How relays reach other brokers (default: TCP), and the bound on that (Rule P3).
    connect: Connect | None = None
    link_timeout_s: float = LINK_TIMEOUT_S
    #: How many connections are handling their input now: deliveries made meanwhile leave
    #: with the writes of that turn rather than one send each (``AmqpConnection._flush_out``).
    reading: int = 0


@dataclass
class _Content:
    method: c.BasicPublish
    properties: c.BasicProperties | None = None
    raw_properties: bytes = b""
    size: int = 0
    chunks: list[bytes] = field(default_factory=list)
    received: int = 0


class Channel:
    """The state of one open channel."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.closing = False
        self.confirm = False
        self.publish_seq = 0
        #: Publish outcomes not yet sent, and the highest seq every earlier one is sent for.
        self.outcomes: dict[int, bool] = {}
        self.confirmed = 0
        self.sent_ahead: set[int] = set()
        self.tx = False
        self.tx_work: list[Callable[[], Deferred[Any] | None]] = []
        #: Publishes of ``tx_work`` and their body bytes.
        self.tx_publishes = 0
        self.tx_bytes = 0
        self.prefetch = 0
        self.global_prefetch = 0
        self.consumers: dict[str, QueueConsumer] = {}
        self.unacked: OrderedDict[int, tuple[QueuedMessage, Queue, QueueConsumer | None]] = (
            OrderedDict()
        )
        self.next_tag = 1
        self.content: _Content | None = None
        self.busy = False
        self.backlog: deque[c.Method] = deque()
        self.flow_active = True


@implementer(IPushProducer)
class AmqpConnection(ReadHolds, Protocol):
    """The server side of one AMQP connection (the producer of its transport's writes)."""

    def __init__(self, settings: AmqpSettings) -> None:
        self.s = settings
        self.reader = c.FrameReader(c.FRAME_MIN_SIZE)
        self.state = "header"
        self.channels: dict[int, Channel] = {}
        self.frame_max = settings.frame_max
        self.channel_max = settings.channel_max
        self.vhost: VirtualHost | None = None
        self.closing = False
        self.closed = False
        self.cancel_notify = False
        self.user = ""
        self._heartbeat: LoopingCall | None = None
        self._last_rx = 0.0
        self._heartbeat_s = 0
        self._tags = itertools.count(1)
        self.factory: AmqpFactory | None = None
        self._released = False
        self.blocked_notify = False
        self.publisher = False
        self._in_data = False
        self._flush_scheduled = False
        self._flush_after = False
        self._confirming: list[Channel] = []
        #: The deliveries of the dispatch under way, written together when it ends.
        self._out: list[bytes] = []
        self._out_bytes = 0
        #: The socket's send buffer is full: no consumer takes more until it drained.
        self.write_full = False
        #: A lone delivery went to the kernel at once since the client last sent anything.
        self._sent_now = False
        self.blocked = False
        #: The handshake as the client made it, replayed to the vhost's broker by a relay.
        self._start_ok: c.ConnectionStartOk | None = None
        self._tune_ok: c.ConnectionTuneOk | None = None
        #: The connection is a relay from another broker (``proxy``, Rule P4).
        self.proxied = False
        self.link: OwnerLink | None = None
        #: Why the socket is not read (``ReadHolds``): "memory" (publishers blocked),
        #: "backlog", "unframed", "relay" (the link to the vhost's broker is being made),
        #: "unread" (answers wait), "publishing" (publishes under way past their bound),
        #: "buffer" (the broker's are).
        self.holds: set[str] = set()
        #: Frames read but not yet handled: reading stopped for "unread" before them.
        self._untaken: list[c.Frame] = []
        #: Publishes not yet stored (outside transactions).
        self._pending = PendingPublishes(
            settings.service.publish_buffer,
            self,
            lambda on: self.hold_reading("publishing", on),
            MAX_PENDING_PUBLISHES,
            MAX_PENDING_PUBLISH_BYTES,
        )
        #: Channels holding back MAX_BACKLOG methods or more (until half of them ran).
        self._backlogged: set[int] = set()

    # -- Twisted -----------------------------------------------------------------------------

    @override
    def connectionMade(self) -> None:
        set_no_delay(self.transport)
        # The transport pauses deliveries while its send buffer is full (``write_full``).
        self.transport.registerProducer(self, True)
        if self.factory is not None:
            self.factory.connections.add(self)
        self.s.gauge.listeners.append(self._memory)
        self._last_rx = self.s.clock.seconds()
        # A client that never finishes the handshake is dropped.
        self.s.clock.callLater(30.0, self._handshake_deadline)

    def _handshake_deadline(self) -> None:
        if self.state not in ("open", "relay") and not self.closed:
            self.transport.loseConnection()

    @override
    def dataReceived(self, data: bytes) -> None:
        if self.closed:
            return
        if self.state == "relay":
            if self.link is not None:
                self.link.transport.write(data)
            return
        self._last_rx = self.s.clock.seconds()
        self._sent_now = False
        if self.state == "proxying" and not self.closing:
            # For the vhost's broker, once it opened; the socket is not read meanwhile.
            self.reader.feed(data)
            return
        self.reader.feed(data)
        try:
            frames = self.reader.frames()
        except c.BadProtocolHeader:
            self.transport.write(c.PROTOCOL_HEADER)
            self.transport.loseConnection()
            self.closed = True
            return
        except c.AmqpError as e:
            # The stream cannot be framed past this point, so no close-ok can come: what
            # was buffered goes, and nothing more is read until the grace period ends.
            self.reader.take_rest()
            self.hold_reading("unframed", True)
            self.connection_error(e)
            return
        self._take(frames)

    def _take(self, frames: list[c.Frame]) -> None:
        """Handle ``frames`` in order, up to one whose answers pass ``MAX_UNREAD``: the rest
        wait in ``_untaken`` until the send buffer drained (``resumeProducing``)."""
        self._in_data = True
        self.s.reading += 1
        vh = self.vhost
        if vh is not None:
            vh.inputs += 1  # its publishes and acks wait for the flush below, not a timer
        try:
            for i, frame in enumerate(frames):
                if self.closed:
                    return
                try:
                    self.frame_received(frame)
                except c.AmqpError as e:
                    self.connection_error(e)
                    return
                except Exception as e:  # a bug must not take the broker down
                    log.exception("AMQP frame handling failed", extra=kv(error=str(e)))
                    self.connection_error(c.AmqpError(c.INTERNAL_ERROR, "internal error"))
                    return
                if "unread" in self.holds and i + 1 < len(frames):
                    self._untaken = frames[i + 1 :]
                    return
        finally:
            # This input's publishes go to storage as batch entries, its acks to the logs.
            if vh is not None:
                vh.inputs -= 1
                vh.flush()
            if self.vhost is not None and self.vhost is not vh:
                self.vhost.flush()
            self._in_data = False
            self.s.reading -= 1
            # Publishes this input completed at once (memory queues) are confirmed now.
            if self._confirming and not self._flush_scheduled:
                self._flush_all_confirms()

    @override
    def connectionLost(self, reason: Failure | None = None) -> None:
        self.closed = True
        if self._released:
            return
        self._released = True
        if self.factory is not None:
            self.factory.connections.discard(self)
        self._pending.close()
        if self._memory in self.s.gauge.listeners:
            self.s.gauge.listeners.remove(self._memory)
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()
        if self.link is not None:
            self.link.abandon()
        for ch in list(self.channels.values()):
            self._release_channel(ch)
        self.channels.clear()
        if self.vhost is not None:
            self.vhost.owner_gone(self)

    def publish_buffer_full(self, full: bool) -> None:
        """The broker-wide publish buffer filled (or drained): stop (or go on) reading."""
        self.hold_reading("buffer", full)

    def _memory(self, high: bool) -> None:
        """Memory crossed the watermark: stop (or resume) reading from publishers."""
        if self.closed or not self.publisher or high == self.blocked:
            return
        self.blocked = high
        if self.blocked_notify:
            method = c.ConnectionBlocked("low on memory") if high else c.ConnectionUnblocked()
            self.send(0, method)
        self.hold_reading("memory", high)

    # -- IPushProducer: the send buffer ------------------------------------------------------

    def pauseProducing(self) -> None:
        """The send buffer is full (called on every write while it is)."""
        self.write_full = True
        self.hold_if_unread(MAX_UNREAD)

    def resumeProducing(self) -> None:
        self.write_full = False
        self.hold_reading("unread", False)
        if not self.closed:
            # What waited behind answers the client had not read, before anything newer:
            # the channels' methods, then the frames of the read that stopped.
            for ch in list(self.channels.values()):
                if ch.backlog and not ch.busy:
                    self._resume(None, ch)
            if self._untaken and "unread" not in self.holds:
                frames, self._untaken = self._untaken, []
                self._take(frames)
        for ch in list(self.channels.values()):
            self._kick(ch)

    def stopProducing(self) -> None:
        self.write_full = True

    def send(self, channel: int, method: c.Method) -> None:
        if not self.closed:
            if self._out:
                self._flush_out()
            self.transport.write(c.encode_method(channel, method))

    def _flush_out(self) -> None:
        """Write the deliveries gathered in a dispatch (before any other write, so the order
        holds). A lone delivery made outside every connection's input (a storage read of one
        new message), the first since this client last sent anything, goes to the kernel at
        once: the consumer waits for it. Others (made while input is handled, a dispatch of
        several as a backlog drains, more lone ones before the client answers, as a fanout's
        queues each deliver one) leave with the turn's other writes, in as few sends as before.
        """
        out = self._out
        if not out:
            return
        lone = len(out) == 1
        data = out[0] if lone else b"".join(out)
        out.clear()
        self._out_bytes = 0
        if self.closed:
            return
        if lone and not self._sent_now and not self._in_data and not self.s.reading:
            self._sent_now = True
            write_now(self.transport, data)
        else:
            self.transport.write(data)

    # -- frames ------------------------------------------------------------------------------

    def frame_received(self, frame: c.Frame) -> None:
        if type(frame) is c.PublishFrame:
            ch = self.channels.get(frame.channel)
            if (
                ch is not None
                and self.state == "open"
                and self.publisher
                and not self.closing
                and not ch.closing
                and ch.content is None
                and frame.body_size <= self.s.max_message_size
            ):
                # A whole publish at once (the common case): what its three frames would do.
                size = frame.body_size
                content = _Content(
                    frame.method, frame.properties, frame.raw_properties, size, [frame.body], size
                )
                self._submit(ch, content)
                return
            # Anything else (a first publish, a channel closing or not open, an oversize
            # message): as the frames it stands for, one by one.
            for part in frame.parts():
                if self.closed:
                    return
                self.frame_received(part)
            return
        if isinstance(frame, c.HeartbeatFrame):
            return
        if self.state == "header":
            if isinstance(frame, c.ProtocolHeaderFrame):
                self.state = "start"
                caps = {
                    "publisher_confirms": True,
                    "exchange_exchange_bindings": True,
                    "basic.nack": True,
                    "consumer_cancel_notify": True,
                    "connection.blocked": True,
                    "authentication_failure_close": True,
                    "per_consumer_qos": True,
                }
                self.send(
                    0,
                    c.ConnectionStart(
                        0,
                        9,
                        {"product": PRODUCT, "version": "0.1", "capabilities": caps},
                        b"PLAIN AMQPLAIN",
                        b"en_US",
                    ),
                )
            return
        if self.closing:
            if isinstance(frame, c.MethodFrame) and isinstance(
                frame.method, c.ConnectionCloseOk | c.ConnectionClose
            ):
                if isinstance(frame.method, c.ConnectionClose):
                    self.send(0, c.ConnectionCloseOk())
                self.transport.loseConnection()
                self.closed = True
            return
        if self.state != "open":
            self._handshake(frame)
            return
        if frame.channel == 0:
            if not isinstance(frame, c.MethodFrame):
                raise c.AmqpError(c.UNEXPECTED_FRAME, "content frame on channel 0")
            self._connection_method(frame.method)
            return
        ch = self.channels.get(frame.channel)
        if isinstance(frame, c.MethodFrame):
            m = frame.method
            if ch is None:
                if isinstance(m, c.ChannelOpen):
                    if frame.channel > self.channel_max:
                        raise c.AmqpError(c.CHANNEL_ERROR, "channel number above channel-max")
                    self.channels[frame.channel] = Channel(frame.channel)
                    self.send(frame.channel, c.ChannelOpenOk())
                    return
                raise c.AmqpError(
                    c.CHANNEL_ERROR,
                    f"expected 'channel.open' on channel {frame.channel}",
                    m.CLASS_ID,
                    m.METHOD_ID,
                )
            if ch.closing:
                if isinstance(m, c.ChannelCloseOk):
                    del self.channels[ch.number]
                elif isinstance(m, c.ChannelClose):
                    self.send(ch.number, c.ChannelCloseOk())
                return
            if isinstance(m, c.ChannelOpen):
                raise c.AmqpError(c.CHANNEL_ERROR, "channel already open", 20, 10)
            if ch.content is not None:
                raise c.AmqpError(
                    c.UNEXPECTED_FRAME,
                    f"expected content header for class 60, got {m.NAME}",
                    m.CLASS_ID,
                    m.METHOD_ID,
                )
            if isinstance(m, c.BasicPublish):
                ch.content = _Content(m)
                if not self.publisher:
                    self.publisher = True
                    if self.s.gauge.high:
                        self._memory(True)
                return
            self._submit(ch, m)
            return
        if ch is None:
            raise c.AmqpError(c.CHANNEL_ERROR, f"content on unopened channel {frame.channel}")
        if ch.closing:
            return
        content = ch.content
        if content is None:
            raise c.AmqpError(c.UNEXPECTED_FRAME, "content frame without a content method")
        if isinstance(frame, c.HeaderFrame):
            if content.properties is not None or frame.class_id != 60:
                raise c.AmqpError(c.UNEXPECTED_FRAME, "unexpected content header")
            if frame.body_size > self.s.max_message_size:
                ch.content = None
                self.channel_error(
                    ch,
                    c.AmqpError(
                        c.PRECONDITION_FAILED,
                        f"message size {frame.body_size} is larger than configured max size "
                        f"{self.s.max_message_size}",
                        60,
                        40,
                    ),
                )
                return
            content.properties = frame.properties
            content.raw_properties = frame.raw_properties
            content.size = frame.body_size
        elif isinstance(frame, c.BodyFrame):
            if content.properties is None:
                raise c.AmqpError(c.UNEXPECTED_FRAME, "body frame before content header")
            content.chunks.append(frame.data)
            content.received += len(frame.data)
            if content.received > content.size:
                raise c.AmqpError(c.FRAME_ERROR, "content body longer than its header said")
        else:
            raise c.AmqpError(c.UNEXPECTED_FRAME, "unexpected frame")
        if content.properties is not None and content.received == content.size:
            ch.content = None
            self._submit(ch, content)  # type: ignore[arg-type]

    # -- handshake ---------------------------------------------------------------------------

    def _handshake(self, frame: c.Frame) -> None:
        if not isinstance(frame, c.MethodFrame) or frame.channel != 0:
            raise c.AmqpError(c.COMMAND_INVALID, "handshake expects methods on channel 0")
        m = frame.method
        if self.state == "start" and isinstance(m, c.ConnectionStartOk):
            caps = m.client_properties.get("capabilities")
            self.cancel_notify = isinstance(caps, dict) and bool(caps.get("consumer_cancel_notify"))
            props = m.client_properties
            self.proxied = isinstance(props, dict) and bool(props.get(PROXIED))
            self._start_ok = m
            user, password = self._credentials(m)
            if self.s.users.get(user) != password or user not in self.s.users:
                self.connection_error(
                    c.AmqpError(
                        c.ACCESS_REFUSED,
                        f"ACCESS_REFUSED - Login was refused using authentication mechanism "
                        f"{m.mechanism}",
                    )
                )
                return
            self.user = user
            self.state = "tune"
            self.send(0, c.ConnectionTune(self.channel_max, self.frame_max, self.s.heartbeat_s))
            return
        if self.state == "tune" and isinstance(m, c.ConnectionTuneOk):
            if m.frame_max and m.frame_max < c.FRAME_MIN_SIZE:
                raise c.AmqpError(c.NOT_ALLOWED, "frame-max below the 4096-octet minimum")
            if m.frame_max:
                self.frame_max = min(self.frame_max, m.frame_max)
            if m.channel_max:
                self.channel_max = min(self.channel_max, m.channel_max)
            self.reader.frame_max = self.frame_max
            self._tune_ok = c.ConnectionTuneOk(self.channel_max, self.frame_max, m.heartbeat)
            self._start_heartbeat(m.heartbeat)
            self.state = "tuned"
            return
        if self.state == "tuned" and isinstance(m, c.ConnectionOpen):
            self.state = "opening"
            route = self.s.route
            if route is not None:
                d: Deferred[Any] = route(m.virtual_host, self.proxied)
            else:
                d = self.s.vhost(m.virtual_host)

            def opened(vh: VirtualHost | OwnerAddress) -> None:
                if self.closed or self.closing:
                    return
                if isinstance(vh, OwnerAddress):
                    self._relay_to(vh, m)
                    return
                if vh.closed:
                    self.connection_error(
                        c.AmqpError(c.CONNECTION_FORCED, "vhost moved; reconnect", 10, 40)
                    )
                    return
                self.vhost = vh
                self.state = "open"
                self.send(0, c.ConnectionOpenOk())

            def refused(f: Failure) -> None:
                if route is not None and f.check(c.AmqpError):
                    e = f.value
                    self.connection_error(c.AmqpError(e.code, e.text, 10, 40))
                    return
                if route is not None and not f.check(LookupError):
                    self.connection_error(
                        c.AmqpError(
                            c.CONNECTION_FORCED,
                            f"vhost '{m.virtual_host}' is not available now: {f.getErrorMessage()}"[
                                :200
                            ],
                            10,
                            40,
                        )
                    )
                    return
                self.connection_error(
                    c.AmqpError(c.NOT_ALLOWED, f"vhost '{m.virtual_host}' not found", 10, 40)
                )

            d.addCallbacks(opened, refused)
            return
        if isinstance(m, c.ConnectionClose):
            self.send(0, c.ConnectionCloseOk())
            self.transport.loseConnection()
            self.closed = True
            return
        raise c.AmqpError(c.COMMAND_INVALID, f"unexpected {m.NAME} during handshake")

    # -- relay (``proxy``) -------------------------------------------------------------------

    def _relay_to(self, owner: OwnerAddress, m: c.ConnectionOpen) -> None:
        """Open the vhost's broker and replay the handshake there (Rule P1)."""
        assert self._start_ok is not None
        assert self._tune_ok is not None
        self.state = "proxying"
        self.hold_reading("relay", True)
        link = OwnerLink(
            self, self._start_ok, self._tune_ok, m, self.s.clock, self.s.link_timeout_s
        )
        self.link = link
        connect = self.s.connect or tcp_connect(self.s.clock, self.s.link_timeout_s)
        log.info("AMQP connection relayed", extra=kv(vhost=m.virtual_host, to=owner.broker_id))
        connect(owner.host, owner.port, link).addErrback(link.connect_failed)

    def relay_started(self, link: OwnerLink, rest: bytes) -> None:
        """The vhost's broker opened: answer open-ok, then relay both ways (Rule P2)."""
        if self.closed or self.closing or link is not self.link:
            link.abandon()
            self.hold_reading("relay", False)
            return
        self.state = "relay"
        if self._heartbeat is not None and self._heartbeat.running:
            self._heartbeat.stop()  # the two ends exchange their heartbeats through the relay
        self.transport.write(c.encode_method(0, c.ConnectionOpenOk()))
        if rest:
            self.transport.write(rest)
        pending = self.reader.take_rest()
        if pending:
            link.transport.write(pending)
        # Each side reads only as fast as the other side's socket takes it.
        self.transport.unregisterProducer()
        self.transport.registerProducer(link.transport, True)
        link.transport.registerProducer(self.transport, True)
        self.hold_reading("relay", False)

    def relay_failed(self, code: int, text: str) -> None:
        """The vhost's broker could not be reached or refused (Rule P3)."""
        self.link = None
        self.reader.take_rest()
        self.hold_reading("relay", False)  # the close-ok is read
        if not self.closed:
            self.connection_error(c.AmqpError(code, text, 10, 40))

    def relay_data(self, data: bytes) -> None:
        """Bytes from the vhost's broker."""
        if not self.closed:
            self.transport.write(data)

    def relay_closed(self) -> None:
        """The vhost's broker closed: so does the client's connection."""
        self.link = None
        if not self.closed:
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    @staticmethod
    def _credentials(m: c.ConnectionStartOk) -> tuple[str, str]:
        if m.mechanism == "PLAIN":
            parts = m.response.split(b"\x00")
            if len(parts) != 3:
                return "", ""
            return parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
        if m.mechanism == "AMQPLAIN":
            try:
                table = c.decode_table(len(m.response).to_bytes(4, "big") + m.response)
            except c.AmqpError:
                return "", ""
            return str(table.get("LOGIN", "")), str(table.get("PASSWORD", ""))
        return "", ""

    def _start_heartbeat(self, seconds: int) -> None:
        self._heartbeat_s = seconds
        if seconds <= 0:
            return
        self._heartbeat = LoopingCall(self._beat)
        self._heartbeat.clock = self.s.clock
        self._heartbeat.start(seconds / 2.0, now=False)

    def _beat(self) -> None:
        if self.closed:
            return
        if self.s.clock.seconds() - self._last_rx > 2 * self._heartbeat_s:
            log.info("AMQP client missed heartbeats; closing")
            self.transport.loseConnection()
            return
        if self._out:
            self._flush_out()
        self.transport.write(c.encode_heartbeat())

    # -- connection methods ------------------------------------------------------------------

    def _connection_method(self, m: c.Method) -> None:
        if isinstance(m, c.ConnectionClose):
            self.send(0, c.ConnectionCloseOk())
            self.transport.loseConnection()
            self.closed = True
            self.connectionLost()
            return
        if isinstance(m, c.ConnectionUpdateSecret):
            self.send(0, c.ConnectionUpdateSecretOk())
            return
        raise c.AmqpError(
            c.COMMAND_INVALID, f"{m.NAME} is not allowed on channel 0", m.CLASS_ID, m.METHOD_ID
        )

    def connection_error(self, e: c.AmqpError) -> None:
        """Close the connection with ``e``'s reply code."""
        if self.closed or self.closing:
            return
        log.info("AMQP connection error", extra=kv(code=e.code, text=e.text))
        self.send(0, c.ConnectionClose(e.code, e.text[:255], e.class_id, e.method_id))
        self.closing = True
        for ch in list(self.channels.values()):
            self._release_channel(ch)
        self.s.clock.callLater(CLOSE_GRACE_S, self._drop)

    def _drop(self) -> None:
        if not self.closed:
            self.transport.loseConnection()

    def channel_error(self, ch: Channel, e: c.AmqpError) -> None:
        """Close one channel with ``e``'s reply code (or the connection for a hard one)."""
        if e.hard:
            self.connection_error(e)
            return
        if ch.closing:
            return
        self.send(ch.number, c.ChannelClose(e.code, e.text[:255], e.class_id, e.method_id))
        ch.closing = True
        self._release_channel(ch)

    def _release_channel(self, ch: Channel) -> None:
        """Cancel the channel's consumers and requeue what it had not acknowledged."""
        for qc in list(ch.consumers.values()):
            if qc.queue is not None:
                qc.queue.remove_consumer(qc)
        ch.consumers.clear()
        ch.backlog.clear()
        self._backlog_ran(ch)
        ch.tx_work.clear()
        by_queue: dict[int, tuple[Queue, list[QueuedMessage]]] = {}
        for qm, q, _ in ch.unacked.values():
            by_queue.setdefault(id(q), (q, []))[1].append(qm)
        ch.unacked.clear()
        for q, msgs in by_queue.values():
            q.requeue(msgs)

    # -- channel method queue ----------------------------------------------------------------

    def _submit(self, ch: Channel, m: Any) -> None:
        if ch.busy or ch.backlog:  # behind what waits (a method under way, unread answers)
            ch.backlog.append(m)
            if len(ch.backlog) >= MAX_BACKLOG and ch.number not in self._backlogged:
                self._backlogged.add(ch.number)
                self.hold_reading("backlog", True)
            return
        self._run(ch, m)
        while ch.backlog and not ch.busy and not ch.closing and not self.closing:
            if "unread" in self.holds:
                return  # run by resumeProducing
            self._run(ch, ch.backlog.popleft())
        self._backlog_ran(ch)

    def _backlog_ran(self, ch: Channel) -> None:
        """Read again once no channel holds back more than half of MAX_BACKLOG."""
        if ch.number in self._backlogged and len(ch.backlog) < MAX_BACKLOG // 2:
            self._backlogged.discard(ch.number)
            if not self._backlogged:
                self.hold_reading("backlog", False)

    def _run(self, ch: Channel, m: Any) -> None:
        try:
            if isinstance(m, _Content):
                result = self.on_publish(ch, m)
            else:
                handler = getattr(self, f"on_{type(m).__name__}", None)
                if handler is None:
                    raise c.AmqpError(
                        c.NOT_IMPLEMENTED,
                        f"{m.NAME} is not implemented",
                        m.CLASS_ID,
                        m.METHOD_ID,
                    )
                result = handler(ch, m)
        except c.AmqpError as e:
            if not e.class_id and not isinstance(m, _Content):
                e.class_id, e.method_id = m.CLASS_ID, m.METHOD_ID
            self.channel_error(ch, e)
            return
        if isinstance(result, Deferred):
            ch.busy = True
            result.addCallbacks(self._resume, self._failed, (ch,), None, (ch, m))

    def _resume(self, _: object, ch: Channel) -> None:
        ch.busy = False
        while ch.backlog and not ch.busy and not ch.closing and not self.closed:
            if "unread" in self.holds:
                return  # run by resumeProducing
            self._run(ch, ch.backlog.popleft())
        self._backlog_ran(ch)

    def _failed(self, f: Failure, ch: Channel, m: Any) -> None:
        ch.busy = False
        e = f.value
        if not isinstance(e, c.AmqpError):
            log.warning("AMQP method failed", extra=kv(error=str(e)))
            e = c.AmqpError(c.INTERNAL_ERROR, f"internal error: {e}")
        if not e.class_id and not isinstance(m, _Content):
            e.class_id, e.method_id = m.CLASS_ID, m.METHOD_ID
        self.channel_error(ch, e)

    def _ok(self, ch: Channel, nowait: bool, reply: c.Method) -> Callable[[object], None]:
        def send(_: object) -> None:
            if not nowait and not ch.closing:
                self.send(ch.number, reply)

        return send

    @property
    def vh(self) -> VirtualHost:
        assert self.vhost is not None
        return self.vhost

    # -- channel class -----------------------------------------------------------------------

    def on_ChannelClose(self, ch: Channel, m: c.ChannelClose) -> None:
        self._release_channel(ch)
        self.channels.pop(ch.number, None)
        self.send(ch.number, c.ChannelCloseOk())

    def on_ChannelCloseOk(self, ch: Channel, m: c.ChannelCloseOk) -> None:
        self.channels.pop(ch.number, None)

    def on_ChannelFlow(self, ch: Channel, m: c.ChannelFlow) -> None:
        ch.flow_active = m.active
        self.send(ch.number, c.ChannelFlowOk(m.active))
        if m.active:
            self._kick(ch)

    def on_ChannelFlowOk(self, ch: Channel, m: c.ChannelFlowOk) -> None:
        pass

    # -- exchange class ----------------------------------------------------------------------

    def on_ExchangeDeclare(self, ch: Channel, m: c.ExchangeDeclare) -> Deferred[Any]:
        d = self.vh.declare_exchange(
            m.exchange,
            m.type,
            passive=m.passive,
            durable=m.durable,
            auto_delete=m.auto_delete,
            internal=m.internal,
            arguments=m.arguments,
        )
        d.addCallback(self._ok(ch, m.nowait, c.ExchangeDeclareOk()))
        return d

    def on_ExchangeDelete(self, ch: Channel, m: c.ExchangeDelete) -> Deferred[Any]:
        d = self.vh.delete_exchange(m.exchange, m.if_unused)
        d.addCallback(self._ok(ch, m.nowait, c.ExchangeDeleteOk()))
        return d

    def on_ExchangeBind(self, ch: Channel, m: c.ExchangeBind) -> Deferred[Any]:
        d = self.vh.bind(m.source, m.destination, "exchange", m.routing_key, m.arguments)
        d.addCallback(self._ok(ch, m.nowait, c.ExchangeBindOk()))
        return d

    def on_ExchangeUnbind(self, ch: Channel, m: c.ExchangeUnbind) -> Deferred[Any]:
        d = self.vh.unbind(m.source, m.destination, "exchange", m.routing_key, m.arguments)
        d.addCallback(self._ok(ch, m.nowait, c.ExchangeUnbindOk()))
        return d

    # -- queue class -------------------------------------------------------------------------

    def on_QueueDeclare(self, ch: Channel, m: c.QueueDeclare) -> Deferred[Any]:
        name = m.queue or self.vh.server_name()
        d = self.vh.declare_queue(
            name,
            owner=self,
            passive=m.passive,
            durable=m.durable,
            exclusive=m.exclusive,
            auto_delete=m.auto_delete,
            arguments=m.arguments,
        )

        def reply(q: Queue) -> Deferred[None]:
            d2 = q.caught_up()

            def send(count: int) -> None:
                if not m.nowait and not ch.closing:
                    self.send(ch.number, c.QueueDeclareOk(q.name, count, len(q.consumers)))

            d2.addCallback(lambda _: q.count())
            d2.addCallback(send)
            return d2

        d.addCallback(reply)
        return d

    def on_QueueBind(self, ch: Channel, m: c.QueueBind) -> Deferred[Any]:
        queue = m.queue or ""
        self.vh.get_queue(queue, self)
        d = self.vh.bind(m.exchange, queue, "queue", m.routing_key, m.arguments)
        d.addCallback(self._ok(ch, m.nowait, c.QueueBindOk()))
        return d

    def on_QueueUnbind(self, ch: Channel, m: c.QueueUnbind) -> Deferred[Any]:
        self.vh.get_queue(m.queue, self)
        d = self.vh.unbind(m.exchange, m.queue, "queue", m.routing_key, m.arguments)
        d.addCallback(self._ok(ch, False, c.QueueUnbindOk()))
        return d

    def on_QueuePurge(self, ch: Channel, m: c.QueuePurge) -> Deferred[Any]:
        q = self.vh.get_queue(m.queue, self)
        d = q.caught_up()
        d.addCallback(lambda _: q.count())

        def purge(count: int) -> Deferred[None]:
            done = q.purge()

            def reply(_: object) -> None:
                if not m.nowait and not ch.closing:
                    self.send(ch.number, c.QueuePurgeOk(count))

            done.addCallback(reply)
            return done  # type: ignore[return-value]

        d.addCallback(purge)
        return d

    def on_QueueDelete(self, ch: Channel, m: c.QueueDelete) -> Deferred[Any]:
        if m.queue in self.vh.queues:
            self.vh.get_queue(m.queue, self)
        d = self.vh.delete_queue(m.queue, if_unused=m.if_unused, if_empty=m.if_empty)

        def reply(count: int) -> None:
            if not m.nowait:
                self.send(ch.number, c.QueueDeleteOk(count))

        d.addCallback(reply)
        return d

    # -- basic class -------------------------------------------------------------------------

    def on_BasicQos(self, ch: Channel, m: c.BasicQos) -> None:
        if m.prefetch_size:
            raise c.AmqpError(c.NOT_IMPLEMENTED, "prefetch_size is not supported", 60, 10)
        if m.global_:
            ch.global_prefetch = m.prefetch_count
        else:
            ch.prefetch = m.prefetch_count
        self.send(ch.number, c.BasicQosOk())
        self._kick(ch)

    def on_BasicConsume(self, ch: Channel, m: c.BasicConsume) -> None:
        q = self.vh.get_queue(m.queue, self)
        tag = m.consumer_tag or f"amq.ctag-{next(self._tags)}"
        if tag in ch.consumers:
            raise c.AmqpError(c.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", 60, 20)
        qc = QueueConsumer(
            tag,
            m.no_ack,
            m.exclusive,
            ch.prefetch,
            lambda consumer, qm: self._deliver(ch, q, consumer, qm),
            lambda consumer: self._has_room(ch, consumer),
            lambda consumer: self._cancelled_by_broker(ch, consumer),
            flush=self._flush_out,
        )
        if (m.exclusive and q.consumers) or any(x.exclusive for x in q.consumers):
            # RabbitMQ's answer (405 is for a queue another connection declared exclusive).
            where = f"queue '{q.name}' in vhost '{q.vhost.namespace}'"
            raise c.AmqpError(c.ACCESS_REFUSED, f"{where} in exclusive use", 60, 20)
        ch.consumers[tag] = qc
        if not m.nowait:
            self.send(ch.number, c.BasicConsumeOk(tag))
        q.add_consumer(qc)

    def on_BasicCancel(self, ch: Channel, m: c.BasicCancel) -> None:
        qc = ch.consumers.pop(m.consumer_tag, None)
        if not m.nowait:
            self.send(ch.number, c.BasicCancelOk(m.consumer_tag))
        if qc is not None and qc.queue is not None:
            qc.queue.remove_consumer(qc)

    def _cancelled_by_broker(self, ch: Channel, qc: QueueConsumer) -> None:
        ch.consumers.pop(qc.tag, None)
        if self.cancel_notify and not ch.closing and not self.closed:
            self.send(ch.number, c.BasicCancel(qc.tag, True))

    def _has_room(self, ch: Channel, qc: QueueConsumer) -> bool:
        if self._out_bytes >= MAX_GATHERED:
            self._flush_out()  # the transport may pause this connection (``write_full``)
        if ch.closing or self.closed or self.closing or not ch.flow_active or self.write_full:
            return False
        if qc.no_ack:
            return True
        if qc.prefetch and qc.unacked >= qc.prefetch:
            return False
        return not (ch.global_prefetch and len(ch.unacked) >= ch.global_prefetch)

    def _deliver(self, ch: Channel, q: Queue, qc: QueueConsumer, qm: QueuedMessage) -> None:
        tag = ch.next_tag
        ch.next_tag += 1
        if not qc.no_ack:
            ch.unacked[tag] = (qm, q, qc)
            qc.unacked += 1
        am = qm.message
        # Written when the dispatch ends (``_flush_out``), with the rest of its deliveries.
        data = c.encode_content(
            ch.number,
            c.BasicDeliver(qc.tag, tag, qm.redelivered, am.exchange, am.routing_key),
            am.wire_properties(),
            am.body,
            self.frame_max,
        )
        self._out.append(data)
        self._out_bytes += len(data)
        if qc.no_ack:
            # After the write: settling lets more in, which may be delivered at once.
            q.settle(qm)

    def _kick(self, ch: Channel) -> None:
        """Room may have opened on this channel: let its queues dispatch."""
        seen: set[int] = set()
        for qc in list(ch.consumers.values()):
            if qc.queue is not None and id(qc.queue) not in seen:
                seen.add(id(qc.queue))
                qc.queue.dispatch()

    def on_BasicGet(self, ch: Channel, m: c.BasicGet) -> Deferred[Any]:
        q = self.vh.get_queue(m.queue, self)
        d = q.caught_up()

        def take(_: object) -> None:
            if ch.closing or self.closed:
                return
            qm = q.take()
            if qm is None:
                self.send(ch.number, c.BasicGetEmpty())
                return
            tag = ch.next_tag
            ch.next_tag += 1
            if not m.no_ack:
                ch.unacked[tag] = (qm, q, None)
            am = qm.message
            if self._out:
                self._flush_out()
            self.transport.write(
                c.encode_content(
                    ch.number,
                    c.BasicGetOk(tag, qm.redelivered, am.exchange, am.routing_key, q.message_count),
                    am.wire_properties(),
                    am.body,
                    self.frame_max,
                )
            )
            if m.no_ack:
                q.settle(qm)  # after the write (see _deliver)

        d.addCallback(take)
        return d

    def _take_tags(self, ch: Channel, tag: int, multiple: bool, m: c.Method) -> list[int]:
        if multiple:
            if tag == 0:
                return list(ch.unacked)
            # Tags are handed out increasing and kept in that order: stop at the first above.
            tags = []
            for t in ch.unacked:
                if t > tag:
                    break
                tags.append(t)
        else:
            if tag not in ch.unacked:
                raise c.AmqpError(
                    c.PRECONDITION_FAILED,
                    f"unknown delivery tag {tag}",
                    m.CLASS_ID,
                    m.METHOD_ID,
                )
            tags = [tag]
        return tags

    def _settle(self, ch: Channel, tags: list[int], how: str) -> list[Queue]:
        requeue: dict[int, tuple[Queue, list[QueuedMessage]]] = {}
        touched: dict[int, Queue] = {}
        for t in tags:
            item = ch.unacked.pop(t, None)
            if item is None:
                continue
            qm, q, qc = item
            if qc is not None:
                qc.unacked -= 1
            touched[id(q)] = q
            if how == "ack":
                q.settle(qm)
            elif how == "requeue":
                requeue.setdefault(id(q), (q, []))[1].append(qm)
            else:
                q.dead_letter(qm, "rejected")
        for q, msgs in requeue.values():
            q.requeue(msgs)
        for q in touched.values():
            q.dispatch()
        return list(touched.values())

    def _maybe_tx(self, ch: Channel, tags: list[int], how: str) -> None:
        """Settle now, or at ``tx.commit``, whose reply then waits until the settlements
        are durable (acknowledged messages do not come back after a crash)."""
        if not ch.tx:
            self._settle(ch, tags, how)
            return

        def commit() -> Deferred[Any]:
            ds = [q.sync() for q in self._settle(ch, tags, how)]
            return DeferredList(ds, consumeErrors=True)

        ch.tx_work.append(commit)

    def on_BasicAck(self, ch: Channel, m: c.BasicAck) -> None:
        tags = self._take_tags(ch, m.delivery_tag, m.multiple, m)
        self._maybe_tx(ch, tags, "ack")

    def on_BasicNack(self, ch: Channel, m: c.BasicNack) -> None:
        tags = self._take_tags(ch, m.delivery_tag, m.multiple, m)
        self._maybe_tx(ch, tags, "requeue" if m.requeue else "drop")

    def on_BasicReject(self, ch: Channel, m: c.BasicReject) -> None:
        tags = self._take_tags(ch, m.delivery_tag, False, m)
        self._maybe_tx(ch, tags, "requeue" if m.requeue else "drop")

    def on_BasicRecover(self, ch: Channel, m: c.BasicRecover) -> None:
        self._settle(ch, list(ch.unacked), "requeue")
        self.send(ch.number, c.BasicRecoverOk())

    def on_BasicRecoverAsync(self, ch: Channel, m: c.BasicRecoverAsync) -> None:
        self._settle(ch, list(ch.unacked), "requeue")

    def on_publish(self, ch: Channel, content: _Content) -> None:
        pm = content.method
        props = content.properties or c.BasicProperties()
        body = b"".join(content.chunks)
        msg = AmqpMessage(pm.exchange, pm.routing_key, props, body)
        msg.raw_properties = content.raw_properties
        # RabbitMQ's checks of what a publisher may say of itself and of expiry.
        if props.user_id is not None and props.user_id != self.user:
            raise c.AmqpError(
                c.PRECONDITION_FAILED,
                f"user_id property set to '{props.user_id}' but authenticated user was "
                f"'{self.user}'",
                60,
                40,
            )
        if props.expiration is not None and not (
            props.expiration.isascii() and props.expiration.isdigit()
        ):
            raise c.AmqpError(
                c.PRECONDITION_FAILED, f"invalid expiration '{props.expiration}'", 60, 40
            )
        if pm.immediate:
            raise c.AmqpError(c.NOT_IMPLEMENTED, "immediate=true", 60, 40)
        ex = self.vh.exchanges.get(pm.exchange)
        if ex is None:
            raise c.AmqpError(
                c.NOT_FOUND, f"no exchange '{pm.exchange}' in vhost '{self.vh.namespace}'", 60, 40
            )
        if ex.internal:
            raise c.AmqpError(
                c.ACCESS_REFUSED, f"cannot publish to internal exchange '{pm.exchange}'", 60, 40
            )
        if ch.tx:
            ch.tx_publishes += 1
            ch.tx_bytes += len(body)
            if ch.tx_publishes > MAX_TX_PUBLISHES or ch.tx_bytes > MAX_TX_BYTES:
                raise c.AmqpError(
                    c.RESOURCE_ERROR,
                    f"a transaction holds at most {MAX_TX_PUBLISHES} publishes or "
                    f"{MAX_TX_BYTES >> 20} MiB until tx.commit",
                    60,
                    40,
                )
            ch.tx_work.append(lambda: self._publish(ch, pm, msg, confirm=False))
            return
        self._publish(ch, pm, msg, confirm=ch.confirm)

    def _publish(
        self, ch: Channel, pm: c.BasicPublish, msg: AmqpMessage, *, confirm: bool
    ) -> Deferred[Any] | None:
        """Route and store ``msg``; in a transaction (at tx.commit) return a Deferred of the
        outcome, else the outcome is a confirm (or only logged when it failed)."""
        queues = self.vh.destinations(msg)
        bridged = msg.exchange == "amq.topic"
        if not queues and not bridged and pm.mandatory:
            if self._out:
                self._flush_out()
            self.transport.write(
                c.encode_content(
                    ch.number,
                    c.BasicReturn(c.NO_ROUTE, "NO_ROUTE", pm.exchange, pm.routing_key),
                    msg.properties,
                    msg.body,
                    self.frame_max,
                )
            )
        if ch.tx:
            d: Deferred[Any] = Deferred()

            def told(result: Any) -> None:
                if isinstance(result, Failure):
                    _log_failed(result)
                    d.errback(result)
                else:
                    d.callback(result)

            self.vh.publish_then(msg, queues, told)
            return d
        if not confirm:
            self.vh.publish_then(msg, queues, self._stored(len(msg.body), _log_if_failed))
            return None
        ch.publish_seq += 1
        told = _Confirm(self, ch, ch.publish_seq).told
        self.vh.publish_then(msg, queues, self._stored(len(msg.body), told))
        return None

    def _stored(self, size: int, tell: Callable[[Any], None]) -> Callable[[Any], None]:
        """Count a publish of ``size`` bytes as under way until ``tell`` is called: past
        ``MAX_PENDING_PUBLISHES`` or ``MAX_PENDING_PUBLISH_BYTES`` the socket is not read
        ("publishing"), until half of them are done."""
        pending = self._pending
        pending.take(size)

        def done(result: Any) -> None:
            pending.give(size)
            tell(result)

        return done

    # -- confirm and tx ----------------------------------------------------------------------

    def _confirmed(self, ch: Channel, seq: int, ok: bool) -> None:
        """Record a publish's outcome; outcomes of one reactor turn are sent together, a run
        of consecutive acks as one basic.ack with multiple set. Completed outside our own
        input (a storage reply), the newest publish of the channel is confirmed as soon as
        the completion under way has told every publish of it (before the queues read the
        entry: the publisher waits for it); others at the turn's end."""
        ch.outcomes[seq] = ok
        if len(ch.outcomes) == 1:
            self._confirming.append(ch)
        if self._in_data:
            return
        vh = self.vhost
        if vh is not None and vh.completing and seq == ch.publish_seq:
            if not self._flush_after:
                self._flush_after = True
                vh.after_completion(self._flush_completed)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self.s.clock.callLater(0, self._flush_all_confirms)

    def _flush_completed(self) -> None:
        self._flush_after = False
        channels, self._confirming = self._confirming, []
        for ch in channels:
            self._flush_confirms(ch)

    def _flush_all_confirms(self) -> None:
        self._flush_scheduled = False
        channels, self._confirming = self._confirming, []
        for ch in channels:
            self._flush_confirms(ch)

    def _flush_confirms(self, ch: Channel) -> None:
        outcomes, ch.outcomes = ch.outcomes, {}
        if ch.closing or self.closed or not outcomes:
            return
        out: list[bytes] = []
        run = 0  # the end of a run of acks that every earlier publish precedes
        for seq in sorted(outcomes):
            ok = outcomes[seq]
            if ok and seq == ch.confirmed + 1:
                self._advance(ch, seq)
                run = ch.confirmed
                continue
            if run:
                out.append(c.encode_method(ch.number, c.BasicAck(run, True)))
                run = 0
            method = c.BasicAck(seq, False) if ok else c.BasicNack(seq, False, False)
            out.append(c.encode_method(ch.number, method))
            if seq == ch.confirmed + 1:
                self._advance(ch, seq)
            else:
                ch.sent_ahead.add(seq)
        if run:
            out.append(c.encode_method(ch.number, c.BasicAck(run, True)))
        if self._out:
            self._flush_out()
        if self._in_data:
            self.transport.write(b"".join(out))
        else:
            # A confirm outside our own input: the publisher is waiting for it, so it goes to
            # the kernel now rather than when the reactor next polls.
            write_now(self.transport, b"".join(out))

    @staticmethod
    def _advance(ch: Channel, seq: int) -> None:
        """Every publish up to ``seq`` is confirmed; absorb those confirmed ahead of it."""
        ch.confirmed = seq
        while ch.confirmed + 1 in ch.sent_ahead:
            ch.sent_ahead.discard(ch.confirmed + 1)
            ch.confirmed += 1

    def on_ConfirmSelect(self, ch: Channel, m: c.ConfirmSelect) -> None:
        if ch.tx:
            raise c.AmqpError(
                c.PRECONDITION_FAILED, "cannot switch from tx to confirm mode", 85, 10
            )
        ch.confirm = True
        if not m.nowait:
            self.send(ch.number, c.ConfirmSelectOk())

    def on_TxSelect(self, ch: Channel, m: c.TxSelect) -> None:
        if ch.confirm:
            raise c.AmqpError(
                c.PRECONDITION_FAILED, "cannot switch from confirm to tx mode", 90, 10
            )
        ch.tx = True
        self.send(ch.number, c.TxSelectOk())

    def on_TxCommit(self, ch: Channel, m: c.TxCommit) -> Deferred[Any]:
        if not ch.tx:
            raise c.AmqpError(c.PRECONDITION_FAILED, "channel is not transactional", 90, 20)
        work, ch.tx_work = ch.tx_work, []
        ch.tx_publishes = ch.tx_bytes = 0
        ds: list[Deferred[Any]] = []
        for w in work:
            r = w()
            if isinstance(r, Deferred):
                ds.append(r)
        d = DeferredList(ds, fireOnOneErrback=True, consumeErrors=True)

        def unwrap(f: Failure) -> Failure:
            sub = getattr(f.value, "subFailure", None)
            return sub if sub is not None else f

        d.addErrback(unwrap)
        d.addCallback(self._ok(ch, False, c.TxCommitOk()))
        return d

    def on_TxRollback(self, ch: Channel, m: c.TxRollback) -> None:
        if not ch.tx:
            raise c.AmqpError(c.PRECONDITION_FAILED, "channel is not transactional", 90, 30)
        ch.tx_work.clear()
        ch.tx_publishes = ch.tx_bytes = 0
        self.send(ch.number, c.TxRollbackOk())


def _log_failed(f: Failure) -> None:
    if not f.check(QueueFullError):
        log.warning("AMQP publish failed", extra=kv(error=str(f.value)))


def _log_if_failed(result: Any) -> None:
    if isinstance(result, Failure):
        _log_failed(result)


class _Confirm:
    """Confirms publish ``seq`` of a channel once its outcome is known."""

    __slots__ = ("ch", "conn", "seq")

    def __init__(self, conn: AmqpConnection, ch: Channel, seq: int) -> None:
        self.conn = conn
        self.ch = ch
        self.seq = seq

    def told(self, result: Any) -> None:
        ok = not isinstance(result, Failure)
        if not ok:
            _log_failed(result)
        self.conn._confirmed(self.ch, self.seq, ok)


class AmqpFactory(Factory):
    """Builds connections and remembers them so the handler can close them all."""

    def __init__(self, settings: AmqpSettings) -> None:
        self.settings = settings
        self.connections: set[AmqpConnection] = set()

    @override
    def buildProtocol(self, addr: Any) -> AmqpConnection:
        conn = AmqpConnection(self.settings)
        conn.factory = self
        return conn

    def close_all(self) -> None:
        for conn in list(self.connections):
            if conn.state != "relay":  # a relay carries the vhost broker's frames only
                conn.connection_error(c.AmqpError(c.CONNECTION_FORCED, "broker shutdown"))
            conn.transport.loseConnection()
