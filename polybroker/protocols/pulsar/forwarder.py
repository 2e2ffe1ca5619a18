"""``PulsarForwarder``: the ``broker_core.forwarding.Forwarder`` that reaches a topic's owner as a
client of its Pulsar port, with this package's own codec.

One connection per owner (its ``pulsar://host:port``), opened on first use, shared by every
forwarded producer and consumer, and dropped from the table when it closes (the next call
opens a new one). On the connection:

- CONNECT once; requests wait for CONNECTED (bounded like every request).
- One Shared producer per topic, created on first publish. A publish is one SEND whose payload
  is the stored entry as it is (metadata and payload: a stored entry is a Pulsar message or
  batch), so the owner stores the same bytes; it fires with the owner's position on
  SEND_RECEIPT (the owner answers only once the entry is durable).
- SUBSCRIBE per forwarded consumer, then FLOW / ACK / REDELIVER_UNACKNOWLEDGED_MESSAGES /
  CLOSE_CONSUMER / UNSUBSCRIBE as the handler drives it; each MESSAGE becomes a ``Delivery``
  whose entry has the owner's (ledger, entry) position and the MESSAGE's tail as data.
- CLOSE_PRODUCER from the owner (the topic moved): the producer is forgotten, its unanswered
  sends fail with ``ForwardingError`` and the next publish creates it again (wherever the new
  lookup says). CLOSE_CONSUMER from the owner, or the connection lost: the handler's consumer
  gets ``disconnect()`` and may subscribe again.
- PING is answered with PONG; every request times out after ``request_timeout_s``, which also
  bounds how long a dead owner can hold a caller. Every ``keep_alive_s`` the forwarder sends
  PING; an owner silent for a whole interval after one is dropped as dead (a host that vanished
  without closing its sockets), which fails and disconnects everything on it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from polybroker.broker_core import errors
from polybroker.broker_core.consumer import Consumer, Delivery, SubType
from polybroker.broker_core.forwarding import Forwarder, ForwardingError, RemoteConsumer
from polybroker.broker_core.ownership import BrokerInfo
from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.ledger.api import Entry, InitialPosition, Position
from polybroker.logs import kv
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    DEFAULT_MAX_MESSAGE_SIZE,
    FRAME_OVERHEAD,
    MAX_PROTOCOL_VERSION,
    CodecError,
    Frame,
    FrameDecoder,
    ack_set_bits,
    ack_set_words,
    command,
    encode_command,
    encode_payload_command,
    message_id,
    split_tail,
    to_signed64,
)

log = logging.getLogger(__name__)

T = pb.BaseCommand
CLIENT_VERSION = "polybroker-forwarder"
REQUEST_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 30.0

_SUB_TYPES = {
    SubType.EXCLUSIVE: pb.CommandSubscribe.Exclusive,
    SubType.SHARED: pb.CommandSubscribe.Shared,
    SubType.FAILOVER: pb.CommandSubscribe.Failover,
    SubType.KEY_SHARED: pb.CommandSubscribe.Key_Shared,
}


def _errors_by_code() -> dict[int, type[errors.BrokerError]]:
    """Pulsar ``ServerError`` -> the broker_core error that names it: the class named after
    the code (``TopicNotFound`` -> ``TopicNotFoundError``) when there is one, else the first."""
    out: dict[int, type[errors.BrokerError]] = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, errors.BrokerError):
            try:
                code = pb.ServerError.Value(value.pulsar_error)
            except ValueError:
                continue
            name = value.pulsar_error.removesuffix("Error") + "Error"
            if code not in out or value.__name__ == name:
                out[code] = value
    return out


_ERRORS = _errors_by_code()


def owner_error(code: int, message: str) -> Exception:
    """The exception for an owner's ERROR / SEND_ERROR: ``ForwardingError`` when a new lookup
    may cure it (ServiceNotReady: the owner no longer serves the topic), else the broker_core
    error of that code."""
    if code == pb.ServiceNotReady:
        return ForwardingError(f"owner: {message}")
    cls = _ERRORS.get(code, errors.BrokerError)
    return cls(message)


def parse_service_url(url: str) -> tuple[str, int]:
    """``pulsar://host:port`` -> (host, port); ``ValueError`` for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "pulsar" or not parts.hostname or parts.port is None:
        raise ValueError(f"not a pulsar:// service URL: {url!r}")
    return parts.hostname, parts.port


Connect = Callable[[str, int, Factory], Deferred[Protocol]]


class _Request:
    __slots__ = ("deferred", "timer")

    def __init__(self, deferred: Deferred[Any], timer: IDelayedCall) -> None:
        self.deferred = deferred
        self.timer = timer


class _Producer:
    """A forwarded producer: its id, its creation, and its unanswered sends by sequence id."""

    def __init__(self, producer_id: int, topic: str) -> None:
        self.producer_id = producer_id
        self.topic = topic
        self.waiting: list[Deferred[None]] = []  # publishes waiting for the creation
        self.created = False
        self.sequence = itertools.count()
        self.sends: dict[int, _Request] = {}


class ForwardedConsumer(RemoteConsumer):
    """A consumer attached on the owner through one ``OwnerConnection``."""

    def __init__(self, conn: OwnerConnection, consumer_id: int, consumer: Consumer) -> None:
        self.conn = conn
        self.consumer_id = consumer_id
        self.consumer = consumer
        self.attached = False
        self._closed = False
        #: Messages in each delivered entry, for batch-index acks.
        self.sizes: dict[Position, int] = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def flow(self, permits: int) -> None:
        if permits > 0 and not self._closed:
            self.conn.send(
                command(T.FLOW, "flow", consumer_id=self.consumer_id, messagePermits=permits)
            )

    def _ack(self, ack_type: int, ids: list[pb.MessageIdData]) -> Deferred[None]:
        if not self._closed and ids:
            self.conn.send(
                command(
                    T.ACK, "ack", consumer_id=self.consumer_id, ack_type=ack_type, message_id=ids
                )
            )
        return succeed(None)

    def ack(self, positions: Sequence[Position]) -> Deferred[None]:
        for p in positions:
            self.sizes.pop(p, None)
        ids = [message_id(p.ledger_id, p.entry_id) for p in positions]
        return self._ack(pb.CommandAck.Individual, ids)

    def ack_batch_index(
        self, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]:
        mid = message_id(position.ledger_id, position.entry_id)
        unacked = ~acked_indexes & ((1 << batch_size) - 1)
        if not unacked:
            return self.ack([position])
        mid.ack_set.extend(ack_set_words(unacked, batch_size))
        mid.batch_size = batch_size
        return self._ack(pb.CommandAck.Individual, [mid])

    def ack_cumulative(
        self, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]:
        for p in [p for p in self.sizes if not position < p]:
            del self.sizes[p]
        mid = message_id(position.ledger_id, position.entry_id)
        if acked_indexes is not None:
            size = self.sizes.get(position, acked_indexes.bit_length())
            unacked = ~acked_indexes & ((1 << size) - 1)
            if unacked:
                mid.ack_set.extend(ack_set_words(unacked, size))
        return self._ack(pb.CommandAck.Cumulative, [mid])

    def redeliver(self, positions: Sequence[Position] | None = None) -> None:
        if self._closed:
            return
        ids = [message_id(p.ledger_id, p.entry_id) for p in positions or ()]
        self.conn.send(
            command(
                T.REDELIVER_UNACKNOWLEDGED_MESSAGES,
                "redeliverUnacknowledgedMessages",
                consumer_id=self.consumer_id,
                message_ids=ids or None,
            )
        )

    def close(self) -> Deferred[None]:
        if self._closed:
            return succeed(None)
        self._closed = True
        d = self.conn.request(T.CLOSE_CONSUMER, "close_consumer", consumer_id=self.consumer_id)
        d.addBoth(lambda _: self.conn.forget_consumer(self))
        return d

    def unsubscribe(self) -> Deferred[None]:
        if self._closed:
            return fail(errors.ConsumerClosedError("the forwarded consumer is closed"))
        d = self.conn.request(T.UNSUBSCRIBE, "unsubscribe", consumer_id=self.consumer_id)

        def done(_: object) -> None:
            self._closed = True
            self.conn.forget_consumer(self)

        return d.addCallback(done)

    def deliver(self, cmd: pb.CommandMessage, data: bytes) -> None:
        """One MESSAGE from the owner, handed to the handler's consumer."""
        if self._closed:
            return
        try:
            md, _ = split_tail(data)
        except CodecError as e:
            log.warning("forwarded message skipped", extra=kv(error=str(e)))
            return
        n = md.num_messages_in_batch if md.HasField("num_messages_in_batch") else 1
        mid = cmd.message_id
        pos = Position(to_signed64(mid.ledgerId), to_signed64(mid.entryId))
        acked = 0
        if cmd.ack_set:
            acked = ~ack_set_bits(list(cmd.ack_set)) & ((1 << n) - 1)
        self.sizes[pos] = n
        entry = Entry(pos, -1, n, md.publish_time, data)
        try:
            self.consumer.send_entries([Delivery(entry, cmd.redelivery_count, acked)])
        except Exception:
            log.exception("forwarded delivery failed", extra=kv(position=str(pos)))

    def gone(self) -> None:
        """The owner closed this consumer, or the connection went: tell the handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self.consumer.disconnect()
        except Exception:
            log.exception("forwarded consumer disconnect failed")


class OwnerConnection(Protocol):
    """The client side of one connection to an owner broker (module docstring)."""

    def __init__(
        self,
        clock: IReactorTime,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_frame_size: int = DEFAULT_MAX_MESSAGE_SIZE + FRAME_OVERHEAD,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.keep_alive_s = keep_alive_s
        self._keep_alive: LoopingCall | None = None
        self._heard = True
        self.decoder = FrameDecoder(max_frame_size)
        self.handshaken = False
        self.lost = False
        self._waiting_connected: list[Deferred[None]] = []
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self.producers: dict[str, _Producer] = {}
        self._producers_by_id: dict[int, _Producer] = {}
        self.consumers: dict[int, ForwardedConsumer] = {}
        self.on_lost: Callable[[OwnerConnection], None] | None = None
        self.max_message_size = DEFAULT_MAX_MESSAGE_SIZE

    # -- transport ----------------------------------------------------------------------------

    def connectionMade(self) -> None:
        set_no_delay(self.transport)
        if self.keep_alive_s > 0:
            self._keep_alive = LoopingCall(self._keep_alive_tick)
            self._keep_alive.clock = self.clock
            self._keep_alive.start(self.keep_alive_s, now=False)
        self.send(
            command(
                T.CONNECT,
                "connect",
                client_version=CLIENT_VERSION,
                protocol_version=MAX_PROTOCOL_VERSION,
            )
        )

    def dataReceived(self, data: bytes) -> None:
        if self.lost:
            return
        self._heard = True
        try:
            for frame in self.decoder.feed(data):
                self._dispatch(frame)
                if self.lost:
                    return
        except CodecError as e:
            log.warning("owner connection: bad frame", extra=kv(error=str(e)))
            self.abort()
        except Exception:
            log.exception("owner connection failed")
            self.abort()

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        if self.lost:
            return
        self.lost = True
        self.handshaken = False
        if self._keep_alive is not None and self._keep_alive.running:
            self._keep_alive.stop()
        why = ForwardingError("connection to the owner lost")
        for d in self._waiting_connected:
            d.errback(why)
        self._waiting_connected.clear()
        requests = list(self._requests.values())
        self._requests.clear()
        for producer in self.producers.values():
            requests += producer.sends.values()
            producer.sends.clear()
        self.producers.clear()
        self._producers_by_id.clear()
        for r in requests:
            if r.timer.active():
                r.timer.cancel()
            if not r.deferred.called:
                r.deferred.errback(ForwardingError("connection to the owner lost"))
        consumers = list(self.consumers.values())
        self.consumers.clear()
        for consumer in consumers:
            consumer.gone()
        if self.on_lost is not None:
            self.on_lost(self)

    def _keep_alive_tick(self) -> None:
        if not self._heard:
            log.warning("owner connection: keep-alive timed out")
            self.abort()
            return
        self._heard = False
        self.send(command(T.PING, "ping"))

    def abort(self) -> None:
        """Drop the connection now (everything pending fails with ``ForwardingError``)."""
        if self.transport is not None:
            self.transport.loseConnection()
        self.connectionLost(None)

    def send(self, cmd: pb.BaseCommand) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(encode_command(cmd))

    # -- requests -----------------------------------------------------------------------------

    def ready(self) -> Deferred[None]:
        """Fire once CONNECTED arrived (bounded by the request timeout)."""
        if self.handshaken:
            return succeed(None)
        if self.lost:
            return fail(ForwardingError("connection to the owner lost"))
        d: Deferred[None] = Deferred()
        self._waiting_connected.append(d)

        def expire() -> None:
            if d in self._waiting_connected:
                self._waiting_connected.remove(d)
                d.errback(ForwardingError("the owner did not answer CONNECT in time"))
                self.abort()

        timer = self.clock.callLater(self.request_timeout_s, expire)
        d.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return d

    def _track(self, d: Deferred[Any], what: str, on_expire: Callable[[], None]) -> _Request:
        def expire() -> None:
            on_expire()
            if not d.called:
                d.errback(ForwardingError(f"the owner did not answer {what} in time"))

        return _Request(d, self.clock.callLater(self.request_timeout_s, expire))

    def request(self, type_: int, field: str, **fields: object) -> Deferred[Any]:
        """Send a command with a fresh ``request_id``; fire with the answer's sub-command."""
        if self.lost:
            return fail(ForwardingError("connection to the owner lost"))
        rid = next(self._ids)
        d: Deferred[Any] = Deferred()
        self._requests[rid] = self._track(d, T.Type.Name(type_), lambda: self._requests.pop(rid))
        self.send(command(type_, field, request_id=rid, **fields))
        return d

    def _answer(self, rid: int, result: Any = None, error: Exception | None = None) -> None:
        r = self._requests.pop(rid, None)
        if r is None:
            return
        if r.timer.active():
            r.timer.cancel()
        if error is not None:
            r.deferred.errback(error)
        else:
            r.deferred.callback(result)

    # -- producers ----------------------------------------------------------------------------

    def publish(self, topic: str, data: bytes, num_messages: int) -> Deferred[Position]:
        """Send one stored entry to ``topic`` (module docstring); fire with its position."""
        producer = self.producers.get(topic)
        if producer is None:
            producer = _Producer(next(self._ids), topic)
            self.producers[topic] = producer
            self._producers_by_id[producer.producer_id] = producer
            self._create_producer(producer)
        if producer.created:
            return self._send(producer, data, num_messages)
        waiter: Deferred[None] = Deferred()
        producer.waiting.append(waiter)
        return waiter.addCallback(  # type: ignore[no-any-return]
            lambda _: self._send(producer, data, num_messages)
        )

    def _create_producer(self, producer: _Producer) -> None:
        d = self.request(
            T.PRODUCER, "producer", topic=producer.topic, producer_id=producer.producer_id
        )

        def created(_: object) -> None:
            waiting, producer.waiting = producer.waiting, []
            if self._producers_by_id.get(producer.producer_id) is not producer:
                why = ForwardingError("the forwarded producer was closed")
                for w in waiting:
                    w.errback(why)
                return
            producer.created = True
            for w in waiting:
                w.callback(None)

        def failed(f: Failure) -> None:
            waiting, producer.waiting = producer.waiting, []
            self._forget_producer(producer)
            for w in waiting:
                w.errback(f.value)

        d.addCallbacks(created, failed)

    def _send(self, producer: _Producer, data: bytes, num_messages: int) -> Deferred[Position]:
        if self._producers_by_id.get(producer.producer_id) is not producer:
            return fail(ForwardingError("the forwarded producer was closed"))
        seq = next(producer.sequence)
        d: Deferred[Position] = Deferred()
        producer.sends[seq] = self._track(d, "SEND", lambda: producer.sends.pop(seq, None))
        cmd = command(
            T.SEND,
            "send",
            producer_id=producer.producer_id,
            sequence_id=seq,
            num_messages=num_messages,
            highest_sequence_id=seq,
        )
        if not self.lost and self.transport is not None:
            self.transport.write(encode_payload_command(cmd, data))
        return d

    def _forget_producer(self, producer: _Producer, why: str | None = None) -> None:
        if self._producers_by_id.get(producer.producer_id) is producer:
            del self._producers_by_id[producer.producer_id]
        if self.producers.get(producer.topic) is producer:
            del self.producers[producer.topic]
        sends = list(producer.sends.values())
        producer.sends.clear()
        for r in sends:
            if r.timer.active():
                r.timer.cancel()
            if not r.deferred.called:
                r.deferred.errback(ForwardingError(why or "the forwarded producer was closed"))

    def _on_send_answer(
        self, producer_id: int, seq: int, position: Position | None, error: Exception | None
    ) -> None:
        producer = self._producers_by_id.get(producer_id)
        if producer is None:
            return
        r = producer.sends.pop(seq, None)
        if r is None:
            return
        if r.timer.active():
            r.timer.cancel()
        if error is not None:
            r.deferred.errback(error)
        else:
            r.deferred.callback(position)

    # -- consumers ----------------------------------------------------------------------------

    def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType,
        initial_position: InitialPosition,
        durable: bool,
        create_topic: bool,
    ) -> Deferred[ForwardedConsumer]:
        """Attach ``consumer`` on the owner; fire with its ``ForwardedConsumer``."""
        cid = next(self._ids)
        remote = ForwardedConsumer(self, cid, consumer)
        self.consumers[cid] = remote
        d = self.request(
            T.SUBSCRIBE,
            "subscribe",
            topic=topic,
            subscription=subscription,
            subType=_SUB_TYPES[sub_type],
            consumer_id=cid,
            consumer_name=consumer.consumer_name,
            priority_level=consumer.priority_level,
            durable=durable,
            initialPosition=(
                pb.CommandSubscribe.Earliest
                if initial_position is InitialPosition.EARLIEST
                else pb.CommandSubscribe.Latest
            ),
            force_topic_creation=create_topic,
        )

        def attached(_: object) -> ForwardedConsumer:
            remote.attached = True
            return remote

        def failed(f: Failure) -> Failure:
            remote._closed = True
            self.forget_consumer(remote)
            if not self.lost:
                # A SUBSCRIBE that timed out may still attach later: have it closed.
                self.send(
                    command(T.CLOSE_CONSUMER, "close_consumer", consumer_id=cid, request_id=0)
                )
            return f

        return d.addCallbacks(attached, failed)

    def forget_consumer(self, remote: ForwardedConsumer) -> None:
        if self.consumers.get(remote.consumer_id) is remote:
            del self.consumers[remote.consumer_id]

    # -- dispatch -----------------------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        cmd = frame.command
        kind = cmd.type
        if kind == T.CONNECTED:
            self.handshaken = True
            if cmd.connected.HasField("max_message_size"):
                self.max_message_size = cmd.connected.max_message_size
            waiting, self._waiting_connected = self._waiting_connected, []
            for d in waiting:
                d.callback(None)
        elif kind == T.MESSAGE:
            consumer = self.consumers.get(cmd.message.consumer_id)
            if consumer is not None and frame.payload is not None:
                consumer.deliver(cmd.message, frame.payload)
        elif kind == T.SEND_RECEIPT:
            r = cmd.send_receipt
            mid = r.message_id
            pos = Position(to_signed64(mid.ledgerId), to_signed64(mid.entryId))
            self._on_send_answer(r.producer_id, r.sequence_id, pos, None)
        elif kind == T.SEND_ERROR:
            e = cmd.send_error
            self._on_send_answer(
                e.producer_id, e.sequence_id, None, owner_error(e.error, e.message)
            )
        elif kind == T.SUCCESS:
            self._answer(cmd.success.request_id, cmd.success)
        elif kind == T.PRODUCER_SUCCESS:
            self._on_producer_success(cmd.producer_success)
        elif kind == T.ERROR:
            err = cmd.error
            if err.request_id == 0 and err.request_id not in self._requests:
                log.info("owner closing the connection", extra=kv(error=err.message))
                return
            self._answer(err.request_id, error=owner_error(err.error, err.message))
        elif kind == T.CLOSE_PRODUCER:
            producer = self._producers_by_id.get(cmd.close_producer.producer_id)
            if producer is not None:
                self._forget_producer(producer, "the owner closed the producer: topic moved")
        elif kind == T.CLOSE_CONSUMER:
            consumer = self.consumers.pop(cmd.close_consumer.consumer_id, None)
            if consumer is not None:
                consumer.gone()
        elif kind == T.PING:
            self.send(command(T.PONG, "pong"))
        # PONG, ACTIVE_CONSUMER_CHANGE, REACHED_END_OF_TOPIC, ACK_RESPONSE: nothing to do.

    def _on_producer_success(self, answer: pb.CommandProducerSuccess) -> None:
        if answer.HasField("producer_ready") and not answer.producer_ready:
            return  # waiting for exclusive access: the final answer follows
        self._answer(answer.request_id, answer)


class PulsarForwarder(Forwarder):
    """Forwards to owners over their Pulsar port (module docstring)."""

    def __init__(
        self,
        clock: IReactorTime,
        *,
        connect: Connect | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.keep_alive_s = keep_alive_s
        self.max_frame_size = max_message_size + FRAME_OVERHEAD
        self._connect = connect or self._tcp_connect
        self.connections: dict[str, OwnerConnection] = {}
        self._opening: dict[str, list[Deferred[OwnerConnection]]] = {}
        self._closed = False

    def _tcp_connect(self, host: str, port: int, factory: Factory) -> Deferred[Protocol]:
        endpoint = TCP4ClientEndpoint(self.clock, host, port, timeout=int(self.request_timeout_s))
        return endpoint.connect(factory)  # type: ignore[no-any-return]

    def _build(self) -> OwnerConnection:
        return OwnerConnection(
            self.clock, self.request_timeout_s, self.max_frame_size, self.keep_alive_s
        )

    def connection(self, owner: BrokerInfo) -> Deferred[OwnerConnection]:
        """The ready connection to ``owner`` (opened, and CONNECT answered, when needed)."""
        if self._closed:
            return fail(ForwardingError("forwarding is closed"))
        url = owner.pulsar_url
        conn = self.connections.get(url)
        if conn is not None and not conn.lost:
            return conn.ready().addCallback(lambda _: conn)
        waiters = self._opening.get(url)
        d: Deferred[OwnerConnection] = Deferred()
        if waiters is not None:
            waiters.append(d)
            return d
        try:
            host, port = parse_service_url(url)
        except ValueError as e:
            return fail(ForwardingError(str(e)))
        self._opening[url] = [d]
        factory = Factory.forProtocol(self._build)

        def opened(proto: Protocol) -> Deferred[None]:
            assert isinstance(proto, OwnerConnection)
            self.connections[url] = proto

            def lost(c: OwnerConnection) -> None:
                if self.connections.get(url) is c:
                    del self.connections[url]

            proto.on_lost = lost
            return proto.ready().addCallback(lambda _: proto)  # type: ignore[return-value]

        def done(result: Any) -> None:
            waiting = self._opening.pop(url, [])
            for w in waiting:
                if isinstance(result, Failure):
                    w.errback(ForwardingError(f"cannot reach {url}: {result.getErrorMessage()}"))
                else:
                    w.callback(result)

        opening = self._connect(host, port, factory)
        opening.addCallback(opened)
        opening.addBoth(done)
        return d

    def publish(
        self, owner: BrokerInfo, topic: str, data: bytes, num_messages: int = 1
    ) -> Deferred[Position]:
        d = self.connection(owner)
        return d.addCallback(  # type: ignore[no-any-return]
            lambda conn: conn.publish(topic, data, num_messages)
        )

    def subscribe(
        self,
        owner: BrokerInfo,
        topic: str,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        initial_position: InitialPosition = InitialPosition.LATEST,
        *,
        durable: bool = True,
        create_topic: bool = True,
    ) -> Deferred[RemoteConsumer]:
        d = self.connection(owner)
        return d.addCallback(  # type: ignore[no-any-return]
            lambda conn: conn.subscribe(
                topic, subscription, consumer, sub_type, initial_position, durable, create_topic
            )
        )

    def close(self) -> Deferred[None]:
        self._closed = True
        for conn in list(self.connections.values()):
            conn.abort()
        self.connections.clear()
        return succeed(None)
