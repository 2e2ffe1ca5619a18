"""One MQTT client connection: Twisted glue between the codec and the MQTT sessions.

State machine: ``AWAIT_CONNECT`` -> (CONNECT) -> ``CONNECTING`` (the session is opened or
restored; packets that arrive meanwhile wait) -> ``READY`` -> ``CLOSED``. Anything but CONNECT
first, a malformed or oversize packet, or a protocol violation closes the connection (MQTT 5
clients get DISCONNECT with the reason code first); an unknown protocol level gets CONNACK
0x01 (3.1.1's "unacceptable protocol version") and a closed connection. No exception escapes
``dataReceived``: whatever goes wrong is this connection's problem, never the broker's.

Acknowledgements: PUBACK (QoS 1) and PUBREC (QoS 2) are sent only once the message (and, when
retained, the retained copy) is durable, in the order of the PUBLISHes. A persistent session's
PUBRELs (answering its client's PUBRECs) leave once the PUBRECs of the read are recorded
(one write; see ``session``), in order with those acknowledgements.

Grouping: the PUBLISHes of one read make one entry per topic; those a client keeping at least
``publish_group_min_window`` in flight sends in answer to a round of PUBACKs (or PUBCOMPs) may
wait ``publish_group_wait_s`` for the rest of the round to make one entry too, and those it
sends while one of its stores is under way wait for that store, so such a client has one store
under way at a time (``_hold_publishes``); the acknowledgements of stores under way together
leave together (``_store_done``); reads bringing QoS 1/2 PUBLISHes are TCP-ACKed at once
(``_ack_at_once``). Writes go to the kernel at once (``write_now``), those of a read at its
end, or every ``MAX_GATHERED`` bytes when a read produces more. While the socket's send buffer
is full the session holds deliveries (``paused``); should it still pass ``MAX_UNREAD`` (answers
to a client that does not read), or the session hold more than ``MAX_QUEUED`` messages for it
(the retained copies of SUBSCRIBEs of many filters; those of a filter subscribed again
replace the copies its last SUBSCRIBE queued, ``Session.queue_retained``), the socket is not
read either until it drained, nor the packets already read taken. Nor is it while the client's
stores under way pass ``MAX_PENDING_STORES`` or ``MAX_PENDING_STORE_BYTES`` (PUBLISHes, QoS 0
ones above all, sent faster than storage writes), until half of them completed, nor while the
broker-wide ``PublishBuffer`` is full.

Keep-alive: a client silent for 1.5 times its keep-alive is disconnected, which publishes its
will; a connection that sends no CONNECT within ``connect_timeout_s`` is closed.
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.broker_core.publish_buffer import PendingPublishes
from polybroker.logs import kv
from polybroker.netio import MAX_UNREAD, ReadHolds, peer_text, write_now
from polybroker.protocols.mqtt import codec as c
from polybroker.protocols.mqtt import topics
from polybroker.protocols.mqtt.session import MAX_GATHERED, FilterSub, MqttBroker, Session

log = logging.getLogger(__name__)

#: Bytes an MQTT packet may add around its largest payload.
PACKET_OVERHEAD = 64 * 1024
#: Topic aliases a client may use towards the broker.
TOPIC_ALIAS_MAX = 100
_FOREVER = 0xFFFFFFFF
#: Messages a session may queue for a client whose send buffer is full before the client's
#: socket stops being read.
MAX_QUEUED = 10_000
#: Stores (entries) and their payload bytes a connection may have under way before its
#: socket stops being read, until half of them completed.
MAX_PENDING_STORES = 1000
MAX_PENDING_STORE_BYTES = 32 * 1024 * 1024
#: Payload bytes (each message counted with ``_MESSAGE_OVERHEAD`` more) of one entry made of
#: PUBLISHes: those of a read, or held behind a store, make several entries past it. A bookie
#: takes frames of maxMessageSize (5 MB) and a little more; a bigger entry would fail.
MAX_ENTRY_BYTES = 1024 * 1024
_MESSAGE_OVERHEAD = 64
#: Acknowledgements older than this many group waits are no longer answered by what arrives.
OWED_HORIZON = 20

# Connection states (see the module docstring), as module constants: the read path tests
# them several times per packet, and a class attribute read through ``self`` is not cached.
_AWAIT_CONNECT = "await-connect"
_CONNECTING = "connecting"
_READY = "ready"
_CLOSED = "closed"


@dataclass
class MqttSettings:
    """What every connection of one listener shares."""

    broker: MqttBroker
    clock: IReactorTime
    max_packet_size: int = 5 * 1024 * 1024 + PACKET_OVERHEAD
    receive_maximum: int = 1024
    max_keep_alive_s: int = 0
    connect_timeout_s: float = 10.0
    #: How long a read's PUBLISHes may wait for the ones their client is about to send
    #: (see ``MqttConnection._hold_publishes``); 0: never.
    publish_group_wait_s: float = 0.0005
    #: The fewest QoS 1/2 publishes a client must keep in flight for the ones answering
    #: acknowledgements to wait for each other (a client pacing its publishes keeps fewer).
    publish_group_min_window: int = 6


def quick_ack_socket(transport: Any) -> Any:
    """The transport's TCP socket if it takes ``TCP_QUICKACK`` (Linux), else None."""
    get_handle = getattr(transport, "getHandle", None)
    if not hasattr(socket, "TCP_QUICKACK") or get_handle is None:
        return None
    sock = get_handle()
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


class _AckSlot:
    __slots__ = ("data", "done")

    def __init__(self) -> None:
        self.data = b""
        self.done = False


@implementer(IPushProducer)
class MqttConnection(ReadHolds, Protocol):
    """One client connection (see the module docstring)."""

    AWAIT_CONNECT = _AWAIT_CONNECT
    CONNECTING = _CONNECTING
    READY = _READY
    CLOSED = _CLOSED

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = settings
        self.broker = settings.broker
        self.clock = settings.clock
        self.state = _AWAIT_CONNECT
        self.reader = c.PacketReader(settings.max_packet_size)
        self.level = c.LEVEL_311
        self.client_receive_max = 65535
        self.client_max_packet = c.MAX_REMAINING_LENGTH + 5
        self.client_id = ""
        self.session: Session | None = None
        self.will: c.Will | None = None
        self.keep_alive_s = 0
        self._last_heard = 0.0
        self._timer: IDelayedCall | None = None
        self._waiting: list[c.Packet] = []
        self._acks: deque[_AckSlot] = deque()
        self._aliases: dict[int, str] = {}
        self._inbound_pending = 0
        #: The transport's buffer is full: the session holds deliveries until it drains.
        self.paused = False
        #: Why the socket is not read (``ReadHolds``): "unread" (past MAX_UNREAD or
        #: MAX_QUEUED, until the buffer drained), "stores" (stores under way past their
        #: bounds), "buffer" (the broker-wide publish buffer is full).
        self.holds: set[str] = set()
        #: The stores under way and their payload bytes.
        self._pending = PendingPublishes(
            settings.broker.service.publish_buffer,
            self,
            lambda on: self.hold_reading("stores", on),
            MAX_PENDING_STORES,
            MAX_PENDING_STORE_BYTES,
        )
        #: Inside ``dataReceived``: writes are gathered (``_out``) and the session's pump
        #: waits for the read's end.
        self.reading = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        # PUBRELs of the read under way: (ack slot, packet id, PUBCOMP reason code).
        self._releases: list[tuple[_AckSlot, int, int]] = []
        # PUBRELs of the read under way (persistent session): (ack slot, packet id), and
        # whether a PUBREC was recorded (the record is written before they leave).
        self._pubrels: list[tuple[_AckSlot, int]] = []
        self._pubrel_write = False
        # PUBLISHes of the read under way, by topic, with their ack slots (None for QoS 0).
        self._batches: dict[str, list[tuple[c.Publish, _AckSlot | None]]] = {}
        # QoS 2 packet ids being stored, with the slots waiting for their PUBREC.
        self._qos2_unstored: dict[int, list[_AckSlot]] = {}
        # QoS 1/2 exchanges completed towards the client (PUBACK, PUBCOMP) whose replacement
        # PUBLISHes have not arrived yet, and the timer bounding how long held ones wait.
        self._owed = 0
        self._owed_at = 0.0
        self._group_timer: IDelayedCall | None = None
        # The most QoS 1/2 publishes the client had in flight during the last round of
        # acknowledgements (``_window``) and since (``_peak``).
        self._window = 0
        self._peak = 0
        # The TCP socket, and whether the read under way brought a QoS 1/2 PUBLISH: its TCP
        # ACK is then sent at once (``_ack_at_once``).
        self._quick_ack: Any = None
        self._awaits_ack = False
        # Stores (``_store``) by number, those under way, and the last of those under way
        # when an earlier one completed: acknowledgements wait for it (``_store_done``).
        self._store_seq = 0
        self._storing: set[int] = set()
        self._ack_barrier = 0

    # -- transport ------------------------------------------------------------------------

    def connectionMade(self) -> None:
        self._last_heard = self.clock.seconds()
        # Deliveries stop while the socket's send buffer is full (see ``paused``).
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        set_no_delay(self.transport)
        self._quick_ack = quick_ack_socket(self.transport)
        self._timer = self.clock.callLater(self.settings.connect_timeout_s, self._connect_timeout)

    def dataReceived(self, data: bytes) -> None:
        if self.state == _CLOSED:
            return
        self._last_heard = self.clock.seconds()
        self.reader.feed(data)
        self._take()

    def _take(self) -> None:
        """Handle the packets read, in order, until reading must stop (``holds``): the rest
        stay in the reader until it may go on."""
        reader = self.reader
        # What this read makes the connection write goes out as one write at its end.
        self.reading = True
        try:
            while self.state != _CLOSED:
                packet = reader.next_packet()
                if packet is None:
                    break
                if self.state == _CONNECTING:
                    self._waiting.append(packet)
                else:
                    self._dispatch(packet)
                if self.holds:
                    break
                session = self.session
                if session is not None and len(session.queue) > MAX_QUEUED and self._overqueued():
                    break
            if self._awaits_ack:
                self._awaits_ack = False
                if self._quick_ack is not None:
                    self._ack_at_once()
            if self._batches and not self._hold_publishes():
                self._flush_publishes()
        except c.UnsupportedProtocolError as e:
            self._log_close(str(e))
            self.write(c.encode(c.ConnAck(False, c.V3_UNACCEPTABLE_PROTOCOL), c.LEVEL_311))
            self.close()
        except c.MqttError as e:
            self._fail(e.reason_code, str(e))
        except Exception as e:
            log.exception("mqtt connection failed", extra=kv(peer=self._peer()))
            self._fail(c.UNSPECIFIED_ERROR, f"internal error: {e}")
        finally:
            self._end_read()

    def _ack_at_once(self) -> None:
        """Have the kernel send the TCP ACK of what was read now, and ACK what arrives next
        at once (Linux resets the choice as it goes, so it is made again on such reads).

        Clients such as paho write their PUBLISHes one by one without TCP_NODELAY: after the
        first, Nagle's algorithm holds the rest until it is ACKed. A delayed ACK would wait
        for the first one's PUBACK, which waits for the durable write; the rest would then
        make a second entry and a second durable write. Only reads that bring QoS 1/2
        PUBLISHes do it: a subscriber's PUBACKs, held by Nagle, arrive fewer reads apart."""
        assert self._quick_ack is not None
        try:
            self._quick_ack.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            self._quick_ack = None

    def _end_read(self) -> None:
        """Deliver what the read's acknowledgements allow, then write everything at once."""
        session = self.session
        try:
            if self._releases:
                self._flush_releases()
            if self._pubrels:
                self._flush_pubrels()
            if session is not None and session.pump_due and session.link is self:
                session.pump(at_read_end=True)
        finally:
            self.reading = False
            self._flush_out()
        if self.paused and self._queued() > MAX_QUEUED:
            self.hold_reading("unread")

    def _flush_out(self) -> None:
        if self._out:
            data = b"".join(self._out)
            self._out = []
            self._out_bytes = 0
            if self.state != _CLOSED and self.transport is not None:
                write_now(self.transport, data)

    def _queued(self) -> int:
        """Messages the session holds for this connection."""
        session = self.session
        return len(session.queue) if session is not None and session.link is self else 0

    def _overqueued(self) -> bool:
        """Past MAX_QUEUED (mid-read): send what the buffer takes now; whether the client is
        not reading, so that the socket stops being read."""
        if self._queued() <= MAX_QUEUED:
            return False
        assert self.session is not None
        self.session.pump(at_read_end=True)
        self._flush_out()
        if self.paused and self._queued() > MAX_QUEUED:
            self.hold_reading("unread")
        return bool(self.holds)

    def publish_buffer_full(self, full: bool) -> None:
        """The broker-wide publish buffer filled (or drained): stop (or go on) reading."""
        self.hold_reading("buffer", full)
        if not full:
            self.clock.callLater(0, self._take_rest)

    def _take_rest(self) -> None:
        """Take the packets left in the reader when reading stopped, before any new one."""
        if not self.holds and self.state != _CLOSED:
            self._take()

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        if self.state == _CLOSED:
            return
        if self._batches:
            # What arrived before the end is stored (its acks can no longer be sent).
            self._flush_publishes()
        self._stop_group_timer()
        self.state = _CLOSED
        self._pending.close()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        session = self.session
        will = self.will
        self.will = None
        if session is not None:
            session.detach(self)
        if will is not None:
            self._send_will(will, session)

    # -- IPushProducer: backpressure from the socket -------------------------------------

    def pauseProducing(self) -> None:
        """The send buffer is full (called on every write while it is)."""
        self.paused = True
        self.hold_if_unread(MAX_UNREAD)

    def resumeProducing(self) -> None:
        self.paused = False
        unread = "unread" in self.holds
        if unread:
            self.hold_reading("unread", False)
        if self.session is not None and self.session.link is self:
            self.session.pump()
        if unread:
            self._take_rest()

    def stopProducing(self) -> None:
        self.paused = True

    def _peer(self) -> str:
        return peer_text(self.transport)

    def write(self, data: bytes) -> None:
        """Write wire bytes unless the connection is closed (during a read: at its end).

        The bytes go to the kernel at once (``write_now``), not when the reactor next
        polls: a delivery completes a durable write that a subscriber waits for, and what a
        read produced is all there is to write for it."""
        if self.reading:
            self._out.append(data)
            self._out_bytes += len(data)
            if self._out_bytes >= MAX_GATHERED:
                self._flush_out()  # a read that makes much to send: the buffer may fill
        elif self.state != _CLOSED and self.transport is not None:
            write_now(self.transport, data)

    def send(self, packet: c.Packet) -> None:
        self.write(c.encode(packet, self.level))

    def close(self) -> None:
        """Close the connection (what is buffered is still sent); an unsent will fires."""
        if self.state == _CLOSED:
            return
        self._flush_out()
        if self.transport is not None:
            self.transport.loseConnection()
        self.connectionLost(None)

    def kick(self, reason_code: int) -> None:
        """The broker ends this connection (session taken over, shutdown)."""
        if self.level == c.LEVEL_5 and self.state == _READY:
            self.send(c.Disconnect(reason_code))
        self._log_close(f"kicked 0x{reason_code:02x}")
        self.close()

    def _fail(self, reason_code: int, message: str) -> None:
        self._log_close(message)
        if self.level == c.LEVEL_5 and self.state in (_READY, _CONNECTING):
            self.send(c.Disconnect(reason_code, {c.REASON_STRING: message[:200]}))
        self.close()

    def _log_close(self, message: str) -> None:
        log.info("closing mqtt connection", extra=kv(peer=self._peer(), reason=message))

    # -- timers ---------------------------------------------------------------------------

    def _connect_timeout(self) -> None:
        self._timer = None
        if self.state == _AWAIT_CONNECT:
            self._log_close("no CONNECT in time")
            self.close()

    def _keep_alive_check(self) -> None:
        self._timer = None
        if self.state == _CLOSED:
            return
        limit = 1.5 * self.keep_alive_s
        idle = self.clock.seconds() - self._last_heard
        if idle >= limit:
            self._fail(c.KEEP_ALIVE_TIMEOUT, "keep-alive timeout")
            return
        self._timer = self.clock.callLater(limit - idle, self._keep_alive_check)

    # -- dispatch -------------------------------------------------------------------------

    def _dispatch(self, packet: c.Packet) -> None:
        if isinstance(packet, c.Publish):
            self._on_publish(packet)
        elif isinstance(packet, c.PubAck):
            self._on_ack(packet)
        elif isinstance(packet, c.Connect):
            self._on_connect(packet)
        elif isinstance(packet, c.PingReq):
            self.send(c.PingResp())
        elif isinstance(packet, c.Subscribe):
            self._on_subscribe(packet)
        elif isinstance(packet, c.Unsubscribe):
            self._on_unsubscribe(packet)
        elif isinstance(packet, c.Disconnect):
            self._on_disconnect(packet)
        else:
            raise c.MqttError(c.PROTOCOL_ERROR, f"unexpected {type(packet).__name__}")

    def _on_connect(self, p: c.Connect) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.level = c.LEVEL_5 if p.level == c.LEVEL_5 else c.LEVEL_311
        v5 = self.level == c.LEVEL_5
        if p.will is not None and not topics.valid_name(p.will.topic):
            # A will is published to its topic: bounded and checked as a PUBLISH's is. MQTT
            # 3.1.1 has no CONNACK code for it, so that connection just closes.
            if v5:
                self.send(c.ConnAck(False, c.TOPIC_NAME_INVALID, {c.REASON_STRING: "will topic"}))
            self._log_close("invalid will topic")
            self.close()
            return
        props = p.properties
        client_id = p.client_id
        assigned = False
        if not client_id:
            if not p.clean_start:
                code = c.CLIENT_ID_NOT_VALID if v5 else c.V3_IDENTIFIER_REJECTED
                self.send(c.ConnAck(False, code))
                self._log_close("empty client id without a clean session")
                self.close()
                return
            client_id = "auto-" + secrets.token_hex(8)
            assigned = True
        if v5:
            expiry = int(props.get(c.SESSION_EXPIRY, 0))
            expiry_s: int | None = None if expiry == _FOREVER else expiry
            self.client_receive_max = int(props.get(c.RECEIVE_MAXIMUM, 65535))
            self.client_max_packet = int(props.get(c.MAXIMUM_PACKET_SIZE, self.client_max_packet))
            refusal = None
            if self.client_receive_max == 0 or self.client_max_packet == 0:
                refusal = (c.PROTOCOL_ERROR, "receive maximum or packet size 0")
            elif c.AUTH_METHOD in props:
                refusal = (c.BAD_AUTH_METHOD, "enhanced authentication is not offered")
            if refusal is not None:
                self.send(c.ConnAck(False, refusal[0], {c.REASON_STRING: refusal[1]}))
                self._log_close(refusal[1])
                self.close()
                return
        else:
            expiry_s = 0 if p.clean_start else None
        self.client_id = client_id
        self.will = p.will
        keep_alive = p.keep_alive
        server_keep_alive = None
        cap = self.settings.max_keep_alive_s
        if cap and (keep_alive == 0 or keep_alive > cap) and v5:
            keep_alive = server_keep_alive = cap
        self.keep_alive_s = keep_alive
        self.state = _CONNECTING
        d = self.broker.open_session(client_id, p.clean_start, expiry_s)

        def opened(got: tuple[Session, bool]) -> None:
            session, present = got
            if self.state == _CLOSED:
                session.detach(self)
                if session.link is None and not session.persistent:
                    self.broker.end_session(session)
                return
            self.session = session
            ack_props: dict[int, Any] = {}
            if v5:
                ack_props = {
                    c.RECEIVE_MAXIMUM: self.settings.receive_maximum,
                    c.MAXIMUM_PACKET_SIZE: self.settings.max_packet_size,
                    c.TOPIC_ALIAS_MAXIMUM: TOPIC_ALIAS_MAX,
                    c.SHARED_SUB_AVAILABLE: 1,
                    c.SUB_ID_AVAILABLE: 1,
                    c.WILDCARD_SUB_AVAILABLE: 1,
                    c.RETAIN_AVAILABLE: 1,
                }
                if assigned:
                    ack_props[c.ASSIGNED_CLIENT_ID] = client_id
                if server_keep_alive is not None:
                    ack_props[c.SERVER_KEEP_ALIVE] = server_keep_alive
            self.send(c.ConnAck(present, c.SUCCESS, ack_props))
            self.state = _READY
            if self.keep_alive_s > 0:
                self._timer = self.clock.callLater(1.5 * self.keep_alive_s, self._keep_alive_check)
            session.attach(self)
            waiting, self._waiting = self._waiting, []
            for packet in waiting:
                if self.state != _READY:
                    break
                self._dispatch_safely(packet)
            if self._batches and self.state == _READY:
                self._flush_publishes()

        def failed(f: Failure) -> None:
            log.warning("mqtt session open failed", extra=kv(client=client_id, error=str(f.value)))
            if self.state != _CLOSED:
                self.send(c.ConnAck(False, c.SERVER_UNAVAILABLE if v5 else c.V3_SERVER_UNAVAILABLE))
                self.close()

        d.addCallbacks(opened, failed)

    def _dispatch_safely(self, packet: c.Packet) -> None:
        try:
            self._dispatch(packet)
        except c.MqttError as e:
            self._fail(e.reason_code, str(e))
        except Exception as e:
            log.exception("mqtt connection failed", extra=kv(peer=self._peer()))
            self._fail(c.UNSPECIFIED_ERROR, f"internal error: {e}")

    def _on_disconnect(self, p: c.Disconnect) -> None:
        # The will is discarded on DISCONNECT, except MQTT 5's "disconnect with will message".
        if self.level != c.LEVEL_5 or p.reason_code != c.DISCONNECT_WITH_WILL:
            self.will = None
        session = self.session
        if session is not None and c.SESSION_EXPIRY in p.properties:
            expiry = int(p.properties[c.SESSION_EXPIRY])
            if session.expiry_s == 0 and expiry != 0:
                self._fail(c.PROTOCOL_ERROR, "session expiry set after a zero one")
                return
            session.expiry_s = None if expiry == _FOREVER else expiry
        self.close()

    # -- publishing -----------------------------------------------------------------------

    def _ack_slot(self) -> _AckSlot:
        slot = _AckSlot()
        self._acks.append(slot)
        return slot

    def _ack_ready(
        self, slot: _AckSlot, packet: c.Packet | bytes | None, flush: bool = True
    ) -> None:
        """``slot``'s answer (a packet, its bytes, or None for none) is ready: write it and
        the ready ones behind it, in order (``flush=False``: the caller calls
        ``_flush_acks``)."""
        if packet is None:
            slot.data = b""
        elif isinstance(packet, bytes):
            slot.data = packet
        else:
            slot.data = c.encode(packet, self.level)
        slot.done = True
        if flush:
            self._flush_acks()

    def _flush_acks(self) -> None:
        acks = self._acks
        if not acks or not acks[0].done:
            return
        out = []
        while acks and acks[0].done:
            out.append(acks.popleft().data)
        data = out[0] if len(out) == 1 else b"".join(out)
        if self.reading or self.state == _CLOSED or self.transport is None:
            self.write(data)
        else:
            # A durable write completed: its publisher waits for these acks, so they go to the
            # kernel now rather than when the reactor next polls.
            write_now(self.transport, data)

    def _on_publish(self, p: c.Publish) -> None:
        session = self.session
        assert session is not None
        if c.SUBSCRIPTION_ID in p.properties:
            # The server's to set on what it delivers [MQTT-3.3.4-6].
            raise c.MqttError(c.PROTOCOL_ERROR, "PUBLISH from a client with a subscription id")
        if self.level == c.LEVEL_5 and c.TOPIC_ALIAS in p.properties:
            alias = int(p.properties.pop(c.TOPIC_ALIAS))
            if not 0 < alias <= TOPIC_ALIAS_MAX:
                raise c.MqttError(c.TOPIC_ALIAS_INVALID, f"topic alias {alias}")
            if p.topic:
                self._aliases[alias] = p.topic
            else:
                known = self._aliases.get(alias)
                if known is None:
                    raise c.MqttError(c.PROTOCOL_ERROR, f"unknown topic alias {alias}")
                p.topic = known
        if not topics.valid_name(p.topic):
            raise c.MqttError(c.TOPIC_NAME_INVALID, f"invalid topic name {p.topic!r}")
        pid = p.packet_id
        slot: _AckSlot | None = None
        if p.qos:
            assert pid is not None
            if p.qos == 2 and pid in session.inbound_qos2:
                # A resent PUBLISH whose message is stored: acknowledge again, store nothing.
                self._ack_ready(self._ack_slot(), c.PubRec(pid))
                return
            if p.qos == 2 and pid in self._qos2_unstored:
                # Resent while its first copy is still being stored: answer with that one.
                self._qos2_unstored[pid].append(self._ack_slot())
                return
            self._awaits_ack = True
            if self._owed > 0:
                self._owed -= 1
            self._inbound_pending += 1
            if self._inbound_pending > self._peak:
                self._peak = self._inbound_pending
            if self.level == c.LEVEL_5 and self._inbound_pending > self.settings.receive_maximum:
                raise c.MqttError(c.RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")
            slot = _AckSlot()
            self._acks.append(slot)
            if p.qos == 2:
                self._qos2_unstored[pid] = [slot]
        if p.retain:
            # Retained messages update the retained store too: stored one by one, after
            # what was read before them.
            if self._batches:
                self._flush_publishes()
            self._store([(p, slot)])
            return
        batch = self._batches.get(p.topic)
        if batch is None:
            self._batches[p.topic] = [(p, slot)]
        else:
            batch.append((p, slot))

    def _hold_publishes(self) -> bool:
        """Whether the PUBLISHes read so far wait for more rather than being stored now.

        A client with several QoS 1/2 messages in flight sends a new one per PUBACK (or
        PUBCOMP) and writes them one by one: stored as they arrive, the first would make an
        entry (and a durable write) of its own and the rest another. So while fewer new
        QoS 1/2 PUBLISHes have arrived than exchanges were completed towards the client
        (``_owed``), what was read waits for the rest, at most ``publish_group_wait_s`` from
        the first read held; then everything held is stored, in arrival order, and nothing
        more is expected until the next acknowledgements (nor once the acknowledgements are
        ``OWED_HORIZON`` waits old: the client sent no more).

        A wait begins only for a client that kept at least ``publish_group_min_window``
        publishes in flight during the last round (``_window``). A client that paces its
        publishes keeps a few in flight and sends them one at a time whatever it was
        answered: the acknowledgements of two of them, written together, would make the next
        one wait for the one after it, the two would be stored together and acknowledged
        together, and so on: every other message would wait a whole interval, to save one
        small entry.

        A client keeping at least ``publish_group_min_window`` in flight also has one store
        under way at a time: what it sends meanwhile waits for that store's completion
        (``_store_next``), then for the answers to its acknowledgements as above. The cost of
        an entry (its write through the ledger, the bookie's journal group and sync, its
        delivery and acknowledgement) dwarfs that of a message in it, and such a client's
        next PUBLISHes come mostly as answers to those acknowledgements: stored apart, the
        window splits into two entries per round for good."""
        wait = self.settings.publish_group_wait_s
        if (
            self._storing
            and wait > 0
            and self.state == _READY
            and self._window >= self.settings.publish_group_min_window
        ):
            return True
        if (
            self._owed <= 0
            or wait <= 0
            or self.state != _READY
            or self.clock.seconds() - self._owed_at > OWED_HORIZON * wait
            or (self._group_timer is None and self._window < self.settings.publish_group_min_window)
        ):
            self._owed = 0
            if self._group_timer is not None:
                self._stop_group_timer()
            return False
        if self._group_timer is None:
            self._group_timer = self.clock.callLater(wait, self._group_wait_over)
        return True

    def _group_wait_over(self) -> None:
        self._group_timer = None
        self._owed = 0
        if self._batches and self.state == _READY:
            self.reading = True
            try:
                self._flush_publishes()
            finally:
                self._end_read()

    def _stop_group_timer(self) -> None:
        timer, self._group_timer = self._group_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _flush_publishes(self) -> None:
        """Store the PUBLISHes read and held: one entry per topic, each a batch (several
        when it passes ``MAX_ENTRY_BYTES``)."""
        if self._group_timer is not None:
            self._stop_group_timer()
        batches, self._batches = self._batches, {}
        for batch in batches.values():
            size = sum(len(p.payload) for p, _ in batch) + _MESSAGE_OVERHEAD * len(batch)
            if size <= MAX_ENTRY_BYTES:
                self._store(batch)
                continue
            part: list[tuple[c.Publish, _AckSlot | None]] = []
            size = 0
            for item in batch:
                n = len(item[0].payload) + _MESSAGE_OVERHEAD
                if part and size + n > MAX_ENTRY_BYTES:
                    self._store(part)
                    part, size = [], 0
                part.append(item)
                size += n
            self._store(part)

    def _store(self, batch: list[tuple[c.Publish, _AckSlot | None]]) -> None:
        session = self.session
        assert session is not None
        topic = batch[0][0].topic
        self._store_seq += 1
        seq = self._store_seq
        self._storing.add(seq)
        size = sum(len(p.payload) for p, _ in batch)
        self._pending.take(size)

        def stored(_: object) -> None:
            self._storing.discard(seq)
            self._stored_bytes(size)
            owed = self._owed
            for p, slot in batch:
                if slot is None:
                    continue
                pid = p.packet_id
                assert pid is not None
                if p.qos == 1:
                    self._inbound_pending -= 1
                    self._owed += 1
                    self._ack_ready(slot, c.encode_ack(c.PUBACK, pid), flush=False)
                else:
                    session.inbound_qos2.add(pid)
                    for waiting in self._qos2_unstored.pop(pid, [slot]):
                        self._ack_ready(waiting, c.encode_ack(c.PUBREC, pid), flush=False)
            if self._owed != owed:
                self._owed_at = self.clock.seconds()
                self._window, self._peak = self._peak, self._inbound_pending
            self._store_done()
            self._store_next()

        def failed(f: Failure) -> None:
            self._storing.discard(seq)
            self._stored_bytes(size)
            self._store_done()
            self._publish_failed(f, topic)
            for p, slot in batch:
                if slot is None:
                    continue
                pid = p.packet_id
                assert pid is not None
                self._inbound_pending -= 1
                slots = self._qos2_unstored.pop(pid, [slot]) if p.qos == 2 else [slot]
                for waiting in slots:
                    if self.level == c.LEVEL_5:
                        cls = c.PubAck if p.qos == 1 else c.PubRec
                        self._ack_ready(waiting, cls(pid, c.UNSPECIFIED_ERROR))
                    else:
                        self._ack_ready(waiting, None)
            if self.level != c.LEVEL_5 and any(slot is not None for _, slot in batch):
                self.close()
            else:
                self._store_next()

        pubs = [batch[0][0]] if len(batch) == 1 else [p for p, _ in batch]
        d = self.broker.publish_batch(pubs, self.client_id, session)
        d.addCallbacks(stored, failed)

    def _stored_bytes(self, size: int) -> None:
        """A store of ``size`` payload bytes completed: read again once half are done."""
        if self._pending.give(size):
            # Not from here: storage may answer while the packets before are being taken.
            self.clock.callLater(0, self._take_rest)

    def _store_next(self) -> None:
        """A store completed: store what waited for it, unless that still waits for more
        (``_hold_publishes``)."""
        if not self._batches or self._storing or self.state != _READY:
            return
        if self._hold_publishes():
            return
        if self.reading:
            self._flush_publishes()
            return
        self.reading = True
        try:
            self._flush_publishes()
        finally:
            self._end_read()

    def _store_done(self) -> None:
        """A store completed: write the acknowledgements now ready, unless stores begun
        before this completion are still under way; then wait for them (not for later ones)
        and write all of theirs at once. A client answers acknowledgements with new
        PUBLISHes: answered in one go, those make one entry rather than one per store."""
        storing = self._storing
        barrier = self._ack_barrier
        if barrier:
            if storing and min(storing) <= barrier:
                return
            self._ack_barrier = 0
        elif storing:
            self._ack_barrier = max(storing)
            return
        self._flush_acks()

    def _publish_failed(self, f: Failure, topic: str) -> None:
        error = str(f.value)
        more = self.broker.publish_failures.news(error)
        if more is not None:
            log.warning(
                f"mqtt publish failed{more}",
                extra=kv(client=self.client_id, topic=topic, error=error),
            )

    def _flush_releases(self) -> None:
        """Forget the PUBRELed ids of the read (one durable write), then send their PUBCOMPs.
        The ids are forgotten before PUBCOMP lets the client use them again; if that fails
        the connection closes unanswered and the client sends PUBREL again."""
        releases, self._releases = self._releases, []
        session = self.session
        if not releases or session is None:
            return

        def released(_: object) -> None:
            self._owed += len(releases)
            self._owed_at = self.clock.seconds()
            self._window, self._peak = self._peak, self._inbound_pending
            for slot, pid, code in releases:
                packet = c.PubComp(pid, code) if code else c.encode_ack(c.PUBCOMP, pid)
                self._ack_ready(slot, packet, flush=False)
            self._flush_acks()

        def failed(f: Failure) -> None:
            self._publish_failed(f, "PUBREL")
            self.close()

        d = self.broker.release_qos2(session, [pid for _, pid, _ in releases])
        d.addCallbacks(released, failed)

    def _flush_pubrels(self) -> None:
        """Write the record of the read's PUBRECs (one write), then send their PUBRELs. If
        that fails the connection closes and they are resent as PUBLISHes with DUP."""
        pubrels, self._pubrels = self._pubrels, []
        write, self._pubrel_write = self._pubrel_write, False
        session = self.session
        if not pubrels or session is None:
            return

        def recorded(_: object) -> None:
            for slot, pid in pubrels:
                self._ack_ready(slot, c.encode_ack(c.PUBREL, pid), flush=False)
            self._flush_acks()

        def failed(f: Failure) -> None:
            self._publish_failed(f, "PUBREC")
            session.unrelease(pid for _, pid in pubrels)
            self.close()

        if not write:
            recorded(None)
            return
        self.broker.save_qos2_out(session).addCallbacks(recorded, failed)

    def _on_ack(self, p: c.PubAck) -> None:
        session = self.session
        assert session is not None
        if isinstance(p, c.PubRel):
            pid = p.packet_id
            found = pid in session.inbound_qos2
            if found:
                self._inbound_pending = max(0, self._inbound_pending - 1)
            code = c.SUCCESS if found or self.level != c.LEVEL_5 else c.PACKET_ID_NOT_FOUND
            self._releases.append((self._ack_slot(), pid, code))
            if not self.reading:
                self._flush_releases()
        elif isinstance(p, c.PubRec):
            if session.on_pubrec(p.packet_id, p.reason_code):
                if not session.persistent:
                    self.send(c.PubRel(p.packet_id))
                    return
                if session.record_pubrec(p.packet_id):
                    self._pubrel_write = True
                self._pubrels.append((self._ack_slot(), p.packet_id))
                if not self.reading:
                    self._flush_pubrels()
            elif p.reason_code < 0x80:
                code = c.PACKET_ID_NOT_FOUND if self.level == c.LEVEL_5 else c.SUCCESS
                self.send(c.PubRel(p.packet_id, code))
        elif isinstance(p, c.PubComp):
            session.on_pubcomp(p.packet_id)
        else:
            session.on_puback(p.packet_id)

    # -- subscriptions --------------------------------------------------------------------

    def _on_subscribe(self, p: c.Subscribe) -> None:
        session = self.session
        assert session is not None
        v5 = self.level == c.LEVEL_5
        sub_ids = p.properties.get(c.SUBSCRIPTION_ID, [])
        sub_id = int(sub_ids[0]) if sub_ids else 0
        if sub_ids and sub_id == 0:
            raise c.MqttError(c.PROTOCOL_ERROR, "subscription identifier 0")
        if len(sub_ids) > 1:
            raise c.MqttError(c.PROTOCOL_ERROR, "more than one subscription identifier")
        codes: list[int] = [0] * len(p.subscriptions)
        pending: list[tuple[int, FilterSub, Deferred[bool]]] = []
        now_ms = int(self.clock.seconds() * 1000)
        for i, s in enumerate(p.subscriptions):
            try:
                group, pattern = topics.split_shared(s.topic_filter)
            except ValueError:
                codes[i] = c.TOPIC_FILTER_INVALID if v5 else c.UNSPECIFIED_ERROR
                continue
            if not topics.valid_filter(pattern):
                codes[i] = c.TOPIC_FILTER_INVALID if v5 else c.UNSPECIFIED_ERROR
                continue
            if self.broker.denied(s.topic_filter) or self.broker.denied(pattern):
                codes[i] = c.NOT_AUTHORIZED if v5 else c.UNSPECIFIED_ERROR
                continue
            if group is not None and s.no_local:
                raise c.MqttError(c.PROTOCOL_ERROR, "no-local on a shared subscription")
            f = FilterSub(
                s.topic_filter,
                group,
                pattern,
                s.qos,
                sub_id,
                s.no_local,
                s.retain_as_published,
                s.retain_handling,
                now_ms,
            )
            codes[i] = s.qos
            pending.append((i, f, session.add_filter(f)))
        self._finish_subscribe(p.packet_id, codes, pending)

    def _finish_subscribe(
        self,
        packet_id: int,
        codes: list[int],
        pending: list[tuple[int, FilterSub, Deferred[bool]]],
    ) -> None:
        session = self.session
        assert session is not None
        slot = self._ack_slot()
        results: dict[int, bool] = {}
        left = [len(pending)]

        def one_done(existed: object, i: int, f: FilterSub) -> None:
            if isinstance(existed, Failure):
                codes[i] = c.UNSPECIFIED_ERROR
                session.remove_filter(f.topic_filter)
            else:
                results[i] = bool(existed)
            left[0] -= 1
            if left[0] == 0:
                all_done()

        def all_done() -> None:
            if self.state == _CLOSED:
                return
            if session.persistent:
                self.broker.save(session).addErrback(lambda _: None)
            self._ack_ready(slot, c.SubAck(packet_id, codes))
            for i, f, _d in pending:
                if codes[i] >= 0x80 or f.group is not None:
                    continue
                if f.retain_handling == 0 or (f.retain_handling == 1 and not results.get(i)):
                    session.queue_retained(f.topic_filter, self.broker.retained_for(f))
            session.pump()

        if not pending:
            all_done()
            return
        for i, f, d in pending:
            d.addBoth(one_done, i, f)

    def _on_unsubscribe(self, p: c.Unsubscribe) -> None:
        session = self.session
        assert session is not None
        codes = [
            c.SUCCESS if session.remove_filter(f) else c.NO_SUBSCRIPTION_EXISTED
            for f in p.topic_filters
        ]
        if session.persistent:
            self.broker.save(session).addErrback(lambda _: None)
        self._ack_ready(self._ack_slot(), c.UnsubAck(p.packet_id, codes))

    # -- will -----------------------------------------------------------------------------

    def _send_will(self, will: c.Will, session: Session | None) -> None:
        props = dict(will.properties)
        delay = int(props.pop(c.WILL_DELAY, 0))
        pub = c.Publish(will.topic, will.payload, will.qos, will.retain, False, None, props)
        client_id = self.client_id

        def fire() -> None:
            if session is not None:
                session.will_call = None
                session.will_fire = None
            self.broker.publish(pub, client_id).addErrback(self._publish_failed, will.topic)

        if delay > 0 and session is not None and session.persistent and not session.ended:
            session.will_call = self.clock.callLater(delay, fire)
            session.will_fire = fire
        else:
            fire()


class MqttFactory(ServerFactory):
    """Builds an ``MqttConnection`` per accepted socket and tracks the open ones."""

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = settings
        self.connections: set[MqttConnection] = set()

    def buildProtocol(self, addr: Any) -> MqttConnection:
        conn = _TrackedConnection(self.settings, self.connections.discard)
        conn.factory = self
        self.connections.add(conn)
        return conn

    def close_all(self) -> None:
        """Close every open connection (MQTT 5 clients hear "server shutting down")."""
        for conn in list(self.connections):
            conn.will = None
            conn.kick(c.SERVER_SHUTTING_DOWN)


class _TrackedConnection(MqttConnection):
    def __init__(self, settings: MqttSettings, forget: Callable[[MqttConnection], None]) -> None:
        super().__init__(settings)
        self._forget = forget

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self._forget(self)
        super().connectionLost(reason)
