"""One Pulsar client connection: Twisted glue between the codec and the Broker API.

State machine: ``AWAIT_CONNECT`` -> (CONNECT) -> ``READY`` -> ``CLOSED``. Before CONNECT only
CONNECT is accepted; anything else gets an ERROR and the connection is closed. A framing error
(oversize, truncated, garbage) closes the connection. A bad payload checksum gets SEND_ERROR
ChecksumError and the connection stays up. No exception escapes ``dataReceived``: whatever goes
wrong is this connection's problem, never the broker's.

Ordering: SEND_RECEIPTs of one producer leave in the order of its SENDs (the client closes the
connection on an out-of-order receipt), whatever order storage completes them in.

Deliveries: the connection is its transport's producer. While the socket's send buffer is
full, its consumers take nothing more (``ServerConsumer.pause``; on a non-persistent topic what
they cannot take is dropped), as Pulsar skips a consumer whose channel is not writable: a client
that grants many permits and does not read holds its backlog in storage, not in the broker's
memory. They take again once the buffer drained. Should the buffer still pass ``MAX_UNREAD``
(answers to a client that sends requests and does not read), the socket is not read either
until it drained, and the frames of the same read wait unparsed.

Publishing: while more than ``max_pending_sends`` SENDs (Pulsar's
``maxPendingPublishRequestsPerConnection``) or ``MAX_PENDING_SEND_BYTES`` of them await their
receipts, the socket is not read and the frames of the same read wait unparsed, until half of
them were answered: a client sending faster than storage writes is slowed by TCP, as Pulsar
turns off auto-read, rather than queued in memory. The same holds while the broker-wide
``PublishBuffer`` is full.

Keep-alive: every keep-alive interval (30 s by default) the broker sends PING; if nothing at all
arrived from the client during a whole interval after a PING, the connection is closed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from zope.interface import implementer

from polybroker.broker_core import messages
from polybroker.broker_core.consumer import (
    Delivery,
    KeySharedMeta,
    KeySharedMode,
    ServerConsumer,
    SubType,
)
from polybroker.broker_core.errors import BrokerError, TopicNotFoundError
from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.broker_core.publish_buffer import PendingPublishes
from polybroker.broker_core.schemas import (
    IncompatibleSchemaError,
    SchemaNotFoundError,
    SchemaRegistry,
    StoredSchema,
    version_bytes,
    version_of,
)
from polybroker.broker_core.service import TopicListMode
from polybroker.broker_core.topic import Producer, ProducerAccessMode, PublishItem
from polybroker.ledger.api import Entry, InitialPosition, Position
from polybroker.logs import kv
from polybroker.netio import MAX_UNREAD, ReadHolds, peer_text, write_now
from polybroker.protocols.pulsar import PulsarApi_pb2 as pb
from polybroker.protocols.pulsar.codec import (
    FRAME_OVERHEAD,
    MAX_PROTOCOL_VERSION,
    CodecError,
    Frame,
    FrameDecoder,
    SendFrame,
    ack_set_bits,
    ack_set_words,
    command,
    encode_command,
    encode_messages,
    encode_send_receipts,
    message_id,
    metadata_is_complete,
    to_signed64,
)

log = logging.getLogger(__name__)

T = pb.BaseCommand
_SEND = T.SEND
_new_tuple = tuple.__new__
SERVER_VERSION = "polybroker-pulsar"
#: Bytes of SENDs awaiting receipts before the socket is not read (see the module docstring).
MAX_PENDING_SEND_BYTES = 32 * 1024 * 1024
_INT64_MAX = (1 << 63) - 1
#: The ack set of an entry delivered whole (shared, never changed).
_NO_WORDS: list[int] = []

_SUB_TYPES = {
    pb.CommandSubscribe.Exclusive: SubType.EXCLUSIVE,
    pb.CommandSubscribe.Shared: SubType.SHARED,
    pb.CommandSubscribe.Failover: SubType.FAILOVER,
    pb.CommandSubscribe.Key_Shared: SubType.KEY_SHARED,
}
_LIST_MODES = {
    pb.CommandGetTopicsOfNamespace.PERSISTENT: TopicListMode.PERSISTENT,
    pb.CommandGetTopicsOfNamespace.NON_PERSISTENT: TopicListMode.NON_PERSISTENT,
    pb.CommandGetTopicsOfNamespace.ALL: TopicListMode.ALL,
}


def _pulsar_format(entry: Entry) -> bytes:
    """The entry as Pulsar clients read it: stored entries of another protocol's native format
    (e.g. Kafka record batches kept verbatim) are converted here; Pulsar ones pass unchanged.
    An entry no decoder can convert goes out as stored, and is logged."""
    try:
        return messages.to_pulsar_entry(entry.data)
    except messages.MessageFormatError as e:
        log.warning(
            "cannot convert a stored entry", extra=kv(position=str(entry.position), error=str(e))
        )
        return entry.data


def server_error(exc: BaseException) -> tuple[int, str]:
    """The ``ServerError`` code and message for a Broker API failure."""
    name = getattr(exc, "pulsar_error", "UnknownError")
    try:
        code = pb.ServerError.Value(name)
    except ValueError:
        code = pb.UnknownError
    return code, str(exc) or type(exc).__name__


@dataclass
class PulsarSettings:
    """What every connection of one listener shares."""

    service: Any  # polybroker.broker_core.service.BrokerService
    clock: IReactorTime
    max_message_size: int = 5 * 1024 * 1024
    keep_alive_s: float = 30.0
    #: The URL lookups answer with (this broker's advertised Pulsar address).
    service_url: Callable[[], str] = field(default=lambda: "pulsar://127.0.0.1:6650")
    #: Where topics' schemas are kept (None: schemas are accepted and not checked).
    schemas: SchemaRegistry | None = None
    #: SENDs awaiting receipts before the socket is not read (see the module docstring).
    max_pending_sends: int = 1000


class _PendingSend:
    __slots__ = ("done", "entry_id", "error", "highest", "ledger_id", "sequence_id", "size")

    def __init__(self, sequence_id: int, highest: int, size: int) -> None:
        self.sequence_id = sequence_id
        self.highest = highest
        self.size = size
        self.done = False
        # The stored entry's position once done (-1, -1 for a duplicate).
        self.ledger_id = -1
        self.entry_id = -1
        self.error: tuple[int, str] | None = None


class _ProducerState:
    """A producer of this connection: the broker's ``Producer`` once registered."""

    def __init__(self, producer_id: int, topic: str, partition: int) -> None:
        self.producer_id = producer_id
        self.topic = topic
        self.partition = partition
        self.producer: Producer | None = None
        self.schema_version: int | None = None
        self.closed = False
        self.sends: deque[_PendingSend] = deque()


class PulsarConsumer:
    """The handler's ``Consumer``: turns deliveries into MESSAGE frames on its connection."""

    def __init__(
        self,
        conn: PulsarConnection,
        consumer_id: int,
        name: str,
        priority_level: int,
        partition: int,
    ) -> None:
        self.conn = conn
        self._consumer_id = consumer_id
        self._name = name
        self._priority = priority_level
        self.partition = partition
        self.server: ServerConsumer | None = None
        self.closed = False

    @property
    def consumer_id(self) -> int:
        return self._consumer_id

    @property
    def consumer_name(self) -> str:
        return self._name

    @property
    def priority_level(self) -> int:
        return self._priority

    def send_entries(self, deliveries: list[Delivery]) -> None:
        if self.closed:
            return
        rows = []
        for entry, redelivery_count, acked in deliveries:
            ledger_id, entry_id = entry.position
            words: list[int] = _NO_WORDS
            if acked:
                n = entry.num_messages
                words = ack_set_words(~acked & ((1 << n) - 1), n)
            rows.append((ledger_id, entry_id, redelivery_count, words, _pulsar_format(entry)))
        self.conn.write_raw(encode_messages(self._consumer_id, self.partition, rows))

    def active_changed(self, is_active: bool) -> None:
        if not self.closed:
            self.conn.send(
                command(
                    T.ACTIVE_CONSUMER_CHANGE,
                    "active_consumer_change",
                    consumer_id=self._consumer_id,
                    is_active=is_active,
                )
            )

    def reached_end_of_topic(self) -> None:
        if not self.closed:
            self.conn.send(
                command(T.REACHED_END_OF_TOPIC, "reachedEndOfTopic", consumer_id=self._consumer_id)
            )

    def disconnect(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.conn.consumer_gone(self)
        self.conn.send(
            command(T.CLOSE_CONSUMER, "close_consumer", consumer_id=self._consumer_id, request_id=0)
        )


@implementer(IPushProducer)
class PulsarConnection(ReadHolds, Protocol):
    """One client connection (see the module docstring for the state machine)."""

    AWAIT_CONNECT = "await-connect"
    READY = "ready"
    CLOSED = "closed"

    def __init__(self, settings: PulsarSettings) -> None:
        self.settings = settings
        self.service = settings.service
        self.state = self.AWAIT_CONNECT
        self.decoder = FrameDecoder(settings.max_message_size + FRAME_OVERHEAD, fast_send=True)
        # Where each SEND's metadata is parsed to be checked (one object, reused).
        self._metadata_scratch = pb.MessageMetadata()
        # SENDs of the read being handled, held per producer to be stored together (one
        # ``publish_many`` each) when the read ends or another command comes.
        # (producer, its PublishItems, their pending receipts), by producer id.
        self._held: dict[int, tuple[_ProducerState, list[PublishItem], list[_PendingSend]]] = {}
        self.protocol_version = 0
        self.client_version = ""
        self.producers: dict[int, _ProducerState] = {}
        self.consumers: dict[int, PulsarConsumer] = {}
        # Consumers whose SUBSCRIBE is under way, by consumer id.
        self._subscribing: dict[int, PulsarConsumer] = {}
        # Producers the broker closed: their in-flight SENDs are dropped, not refused, because
        # the client resends every unreceipted message once it has re-created the producer.
        self._dropped_producers: set[int] = set()
        self._keep_alive: LoopingCall | None = None
        self._heard_since_ping = True
        self._ping_outstanding = False
        #: The socket's send buffer is full: consumers are paused until it drained.
        self.write_full = False
        #: Why the socket is not read (``ReadHolds``): "unread" (past MAX_UNREAD until the
        #: buffer drained), "sends" (SENDs awaiting receipts past their bound), "buffer"
        #: (the broker-wide publish buffer is full).
        self.holds: set[str] = set()
        #: SENDs awaiting receipts.
        self._pending = PendingPublishes(
            settings.service.publish_buffer,
            self,
            lambda on: self.hold_reading("sends", on),
            settings.max_pending_sends,
            MAX_PENDING_SEND_BYTES,
        )

    # -- transport ------------------------------------------------------------------------

    def connectionMade(self) -> None:
        set_no_delay(self.transport)
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        if self.settings.keep_alive_s > 0:
            self._keep_alive = LoopingCall(self._keep_alive_tick)
            self._keep_alive.clock = self.settings.clock
            self._keep_alive.start(self.settings.keep_alive_s, now=False).addErrback(
                lambda f: log.warning("keep-alive stopped", extra=kv(error=str(f.value)))
            )

    def dataReceived(self, data: bytes) -> None:
        if self.state == self.CLOSED:
            return
        self._heard_since_ping = True
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Handle the frames ``data`` completes, in order, up to one after which reading
        must stop (``holds``): the rest stays in the decoder, unparsed, until it may go on."""
        frames = self.decoder.feed(data)
        try:
            for frame in frames:
                if self.state != self.READY:
                    if self.state == self.CLOSED:
                        return
                    if frame.__class__ is SendFrame:
                        self._protocol_error("expected CONNECT, got SEND")
                        return
                    self._dispatch(frame)  # type: ignore[arg-type]
                elif frame.__class__ is SendFrame:
                    # The one command per message, decoded without protobuf: straight there.
                    self._on_send(*frame)  # type: ignore[misc]
                else:
                    self._dispatch(frame)  # type: ignore[arg-type]
                if self.holds:
                    break
            if self._held:
                self._store_held()
        except CodecError as e:
            self._protocol_error(str(e))
        except Exception as e:
            log.exception("pulsar connection failed", extra=kv(peer=self._peer()))
            self._protocol_error(f"internal error: {e}")
        finally:
            frames.close()  # the decoder keeps what was not taken

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self.state = self.CLOSED
        self._pending.close()
        if self._keep_alive is not None and self._keep_alive.running:
            self._keep_alive.stop()
        for state in list(self.producers.values()):
            self._close_producer_state(state)
        self.producers.clear()
        for consumer in list(self.consumers.values()):
            consumer.closed = True
            if consumer.server is not None:
                consumer.server.close().addErrback(lambda f: None)
        self.consumers.clear()

    # -- IPushProducer: the send buffer ------------------------------------------------------

    def pauseProducing(self) -> None:
        """The send buffer is full (called on every write while it is)."""
        if not self.write_full:
            self.write_full = True
            for consumer in list(self.consumers.values()):
                if consumer.server is not None:
                    consumer.server.pause()
        self.hold_if_unread(MAX_UNREAD)

    def resumeProducing(self) -> None:
        self.write_full = False
        if "unread" in self.holds:
            self.hold_reading("unread", False)
            self._take_rest()
        for consumer in list(self.consumers.values()):
            if consumer.server is not None:
                consumer.server.resume()

    def stopProducing(self) -> None:
        self.write_full = True

    def publish_buffer_full(self, full: bool) -> None:
        """The broker-wide publish buffer filled (or drained): stop (or go on) reading."""
        self.hold_reading("buffer", full)
        if not full:
            self.settings.clock.callLater(0, self._take_rest)

    def _take_rest(self) -> None:
        """Take the frames left in the decoder when reading stopped, before any new one."""
        if not self.holds and self.state != self.CLOSED:
            self._take(b"")

    def _peer(self) -> str:
        return peer_text(self.transport)

    def write_raw(self, data: bytes) -> None:
        """Write framed bytes unless the connection is closed: to the socket at once when it
        takes them (``write_now``), so receipts and deliveries need no further reactor turn;
        callers write what one event produced in one call."""
        if self.state != self.CLOSED and self.transport is not None:
            write_now(self.transport, data)

    def send(self, cmd: pb.BaseCommand) -> None:
        """Frame and write a simple command."""
        self.write_raw(encode_command(cmd))

    def close(self) -> None:
        """Close the connection (what remains buffered is still sent)."""
        if self.state == self.CLOSED:
            return
        if self.transport is not None:
            self.transport.loseConnection()
        self.connectionLost(None)

    def _protocol_error(self, message: str) -> None:
        log.info("closing pulsar connection", extra=kv(peer=self._peer(), reason=message))
        if self.state != self.CLOSED:
            self.send(
                command(T.ERROR, "error", request_id=0, error=pb.UnknownError, message=message)
            )
        self.close()

    def _keep_alive_tick(self) -> None:
        if self._ping_outstanding and not self._heard_since_ping:
            log.info("closing pulsar connection: keep-alive timed out", extra=kv(peer=self._peer()))
            self.close()
            return
        self._heard_since_ping = False
        self._ping_outstanding = True
        if self.state == self.READY:
            self.send(command(T.PING, "ping"))

    # -- dispatch -------------------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        cmd = frame.command
        kind = cmd.type
        if kind == _SEND and self.state == self.READY and cmd.HasField("send"):
            self._on_send_command(cmd.send, frame)  # a SEND of another shape (chunk, txn...)
            return
        if self.state == self.AWAIT_CONNECT:
            if kind != T.CONNECT or not cmd.HasField("connect"):
                self._protocol_error(f"expected CONNECT, got {T.Type.Name(kind)}")
                return
            self._on_connect(cmd.connect)
            return
        handler = _HANDLERS.get(kind)
        if handler is None:
            name = T.Type.Name(kind) if kind in T.Type.values() else str(kind)
            self._protocol_error(f"unsupported command {name}")
            return
        attr, method = handler
        if attr is not None and not cmd.HasField(attr):
            self._protocol_error(f"{T.Type.Name(kind)} without its body")
            return
        if attr == "send":
            self._on_send_command(cmd.send, frame)
            return
        if self._held:
            self._store_held()  # what came before this command is handled before it
        if attr is None:
            method(self)
        else:
            method(self, getattr(cmd, attr))

    def _request_error(self, request_id: int, exc: BaseException) -> None:
        code, message = server_error(exc)
        self.send(command(T.ERROR, "error", request_id=request_id, error=code, message=message))

    def _success(self, request_id: int) -> None:
        self.send(command(T.SUCCESS, "success", request_id=request_id))

    # -- handshake and keep-alive -----------------------------------------------------------

    def _on_connect(self, c: pb.CommandConnect) -> None:
        self.client_version = c.client_version
        self.protocol_version = min(c.protocol_version, MAX_PROTOCOL_VERSION)
        self.state = self.READY
        self.send(
            command(
                T.CONNECTED,
                "connected",
                server_version=SERVER_VERSION,
                protocol_version=self.protocol_version,
                max_message_size=self.settings.max_message_size,
            )
        )

    def _on_ping(self) -> None:
        self.send(command(T.PONG, "pong"))

    def _on_pong(self) -> None:
        self._ping_outstanding = False

    def _on_ignored(self, _body: object = None) -> None:
        pass

    # -- lookup ---------------------------------------------------------------------------

    def _on_partitioned_metadata(self, c: pb.CommandPartitionedTopicMetadata) -> None:
        rid = c.request_id
        d = Deferred.fromCoroutine(self._partitions_of(c.topic))

        def ok(n: int) -> None:
            self.send(
                command(
                    T.PARTITIONED_METADATA_RESPONSE,
                    "partitionMetadataResponse",
                    request_id=rid,
                    partitions=n,
                    response=pb.CommandPartitionedTopicMetadataResponse.Success,
                )
            )

        def failed(f: Failure) -> None:
            code, message = server_error(f.value)
            self.send(
                command(
                    T.PARTITIONED_METADATA_RESPONSE,
                    "partitionMetadataResponse",
                    request_id=rid,
                    response=pb.CommandPartitionedTopicMetadataResponse.Failed,
                    error=code,
                    message=message,
                )
            )

        d.addCallbacks(ok, failed)

    async def _partitions_of(self, topic: str) -> int:
        # Clients ask this first for every producer and consumer: a topic in a namespace that
        # does not exist is reported here as TopicNotFound, as Pulsar does.
        exists = self.service.namespace_exists
        if exists is not None:
            known = exists(self.service.topic_ref(topic).namespace_name)
            if isinstance(known, Deferred):
                known = await known
            if not known:
                raise TopicNotFoundError(f"the namespace of {topic} does not exist")
        return await self.service.partitioned_topic_metadata(topic, create=True)

    def _on_lookup(self, c: pb.CommandLookupTopic) -> None:
        rid = c.request_id
        try:
            self.service.topic_ref(c.topic)
        except BrokerError as e:
            self._lookup_failed(rid, *server_error(e))
            return
        if c.advertised_listener_name:
            # This broker advertises no named listeners; the client reports this as a
            # connection error, as it does against Pulsar.
            message = f"the broker do not have {c.advertised_listener_name} listener"
            self._lookup_failed(rid, pb.ServiceNotReady, message)
            return
        ownership = getattr(self.service, "ownership", None)
        if ownership is None or not ownership.clustered:
            # One broker owns every topic: answer Connect to ourselves, authoritatively.
            self._lookup_answer(
                rid, self.settings.service_url(), pb.CommandLookupTopicResponse.Connect
            )
            return
        topic = self.service.topic_ref(c.topic).full
        d = ownership.lookup(topic, authoritative=c.authoritative)

        def found(owner: Any) -> None:
            if owner.broker_id == ownership.local.broker_id:
                url, kind = self.settings.service_url(), pb.CommandLookupTopicResponse.Connect
            else:
                # Another broker owns it, or will once the client asks it (authoritatively).
                url, kind = owner.pulsar_url, pb.CommandLookupTopicResponse.Redirect
            self._lookup_answer(rid, url, kind)

        def failed(f: Failure) -> None:
            self._lookup_failed(rid, *server_error(f.value))

        d.addCallbacks(found, failed)

    def _lookup_failed(self, rid: int, code: int, message: str) -> None:
        self.send(
            command(
                T.LOOKUP_RESPONSE,
                "lookupTopicResponse",
                request_id=rid,
                response=pb.CommandLookupTopicResponse.Failed,
                error=code,
                message=message,
            )
        )

    def _lookup_answer(self, rid: int, url: str, kind: int) -> None:
        self.send(
            command(
                T.LOOKUP_RESPONSE,
                "lookupTopicResponse",
                request_id=rid,
                brokerServiceUrl=url,
                response=kind,
                authoritative=True,
                proxy_through_service_url=False,
            )
        )

    def _on_topics_of_namespace(self, c: pb.CommandGetTopicsOfNamespace) -> None:
        rid = c.request_id
        d = self.service.topics_of_namespace(c.namespace, _LIST_MODES.get(c.mode))

        def ok(topics: list[str]) -> None:
            self.send(
                command(
                    T.GET_TOPICS_OF_NAMESPACE_RESPONSE,
                    "getTopicsOfNamespaceResponse",
                    request_id=rid,
                    topics=topics,
                    filtered=False,
                    changed=True,
                )
            )

        d.addCallbacks(ok, lambda f: self._request_error(rid, f.value))

    def _on_get_schema(self, c: pb.CommandGetSchema) -> None:
        rid = c.request_id
        registry = self.settings.schemas

        async def find() -> StoredSchema:
            if registry is None:
                raise SchemaNotFoundError("schemas are not kept by this broker")
            version = version_of(c.schema_version) if c.HasField("schema_version") else None
            return await registry.get(c.topic, version)

        def ok(found: StoredSchema) -> None:
            self.send(
                command(
                    T.GET_SCHEMA_RESPONSE,
                    "getSchemaResponse",
                    request_id=rid,
                    schema=_schema_proto(found),
                    schema_version=version_bytes(found.version),
                )
            )

        def failed(f: Failure) -> None:
            code, message = server_error(f.value)
            self.send(
                command(
                    T.GET_SCHEMA_RESPONSE,
                    "getSchemaResponse",
                    request_id=rid,
                    error_code=code,
                    error_message=message,
                )
            )

        Deferred.fromCoroutine(find()).addCallbacks(ok, failed)

    def _on_get_or_create_schema(self, c: pb.CommandGetOrCreateSchema) -> None:
        rid = c.request_id

        def ok(version: int | None) -> None:
            self.send(
                command(
                    T.GET_OR_CREATE_SCHEMA_RESPONSE,
                    "getOrCreateSchemaResponse",
                    request_id=rid,
                    schema_version=version_bytes(version or 0),
                )
            )

        def failed(f: Failure) -> None:
            code, message = server_error(f.value)
            self.send(
                command(
                    T.GET_OR_CREATE_SCHEMA_RESPONSE,
                    "getOrCreateSchemaResponse",
                    request_id=rid,
                    error_code=code,
                    error_message=message,
                )
            )

        self._register_schema(c.topic, c.schema, producer=True).addCallbacks(ok, failed)

    # -- producers ------------------------------------------------------------------------

    def _on_producer(self, c: pb.CommandProducer) -> None:
        rid = c.request_id
        self._dropped_producers.discard(c.producer_id)
        existing = self.producers.get(c.producer_id)
        if existing is not None:
            # The client retries a PRODUCER it timed out on: answer once it is registered.
            if existing.producer is not None and existing.producer.is_ready:
                self._producer_success(rid, existing, ready=True)
            else:
                self._request_error(
                    rid, BrokerError(f"producer {c.producer_id} is still being created")
                )
            return
        try:
            partition = self.service.topic_ref(c.topic).partition_index
        except BrokerError as e:
            self._request_error(rid, e)
            return
        state = _ProducerState(c.producer_id, c.topic, partition)
        self.producers[c.producer_id] = state
        try:
            mode = ProducerAccessMode(c.producer_access_mode)
        except ValueError:
            mode = ProducerAccessMode.SHARED
        name = c.producer_name if c.HasField("producer_name") and c.producer_name else None

        def add(_: object) -> Deferred[Producer]:
            return self.service.add_producer(  # type: ignore[no-any-return]
                c.topic,
                name,
                mode,
                producer_id=c.producer_id,
                topic_epoch=c.topic_epoch if c.HasField("topic_epoch") else None,
                on_disconnect=lambda: self._producer_fenced(state),
                metadata={kv_.key: kv_.value for kv_ in c.metadata},
            )

        schema = c.schema if c.HasField("schema") else None
        d = self._register_schema(c.topic, schema, producer=True)
        d.addCallback(lambda v: setattr(state, "schema_version", v))
        first = c.initial_subscription_name
        if first:
            # Pulsar's: created from the earliest message before the producer may write
            # (a dead letter topic's, so that its first message waits for a consumer).
            d.addCallback(lambda _: self._initial_subscription(c.topic, first))
        d.addCallback(add)

        def registered(producer: Producer) -> None:
            if state.closed or self.state == self.CLOSED:
                producer.close()
                return
            state.producer = producer
            if producer.is_ready:
                self._producer_success(rid, state, ready=True)
                return
            self._producer_success(rid, state, ready=False)

            def granted(_p: Producer) -> None:
                if not state.closed:
                    self._producer_success(rid, state, ready=True)

            def refused(f: Failure) -> None:
                if not state.closed:
                    self._forget_producer(state)
                    self._request_error(rid, f.value)

            producer.ready.addCallbacks(granted, refused)

        def failed(f: Failure) -> None:
            self._forget_producer(state)
            self._request_error(rid, f.value)

        d.addCallbacks(registered, failed)

    def _initial_subscription(self, topic: str, name: str) -> Deferred[Any]:
        def create(t: Any) -> Any:
            if not t.persistent:
                return None
            return t.create_subscription(name, InitialPosition.EARLIEST)

        return self.service.get_topic(topic, create=True).addCallback(create)

    def _producer_success(self, rid: int, state: _ProducerState, *, ready: bool) -> None:
        producer = state.producer
        assert producer is not None
        self.send(
            command(
                T.PRODUCER_SUCCESS,
                "producer_success",
                request_id=rid,
                producer_name=producer.name,
                last_sequence_id=producer.last_sequence_id,
                schema_version=(
                    None if state.schema_version is None else version_bytes(state.schema_version)
                ),
                topic_epoch=producer.topic_epoch,
                producer_ready=ready,
            )
        )

    def _register_schema(
        self, topic: str, schema: pb.Schema | None, *, producer: bool = False
    ) -> Deferred[int | None]:
        """The version of ``schema`` on ``topic`` (registered if new); None without one. For
        a producer, the namespace's schema flags apply: no new version unless auto update is
        allowed, no schema-less producer on a topic with a schema if validation is enforced."""
        registry = self.settings.schemas
        if registry is None:
            return succeed(None)
        service = self.settings.service
        auto, enforced = service.schema_flags(topic) if producer else (True, False)

        async def register() -> int | None:
            if schema is None:
                if enforced and await registry.versions(topic):
                    raise IncompatibleSchemaError(
                        "Producers cannot connect or send message without a schema to topics "
                        "with a schema if SchemaValidationEnforced is enabled"
                    )
                return None
            strategy = service.schema_compatibility(topic)
            given = StoredSchema(
                -1,
                int(schema.type),
                schema.name,
                schema.schema_data,
                {p.key: p.value for p in schema.properties},
            )
            return await registry.get_or_create(topic, given, strategy, add=auto)

        if schema is None and not enforced:
            return succeed(None)
        return Deferred.fromCoroutine(register())

    def _forget_producer(self, state: _ProducerState) -> None:
        state.closed = True
        if self.producers.get(state.producer_id) is state:
            del self.producers[state.producer_id]

    def _close_producer_state(self, state: _ProducerState) -> None:
        self._forget_producer(state)
        if state.producer is not None:
            state.producer.close()

    def _producer_fenced(self, state: _ProducerState) -> None:
        # The broker dropped the producer (fencing, unload): the client looks up and retries.
        if state.closed:
            return
        self._forget_producer(state)
        self._dropped_producers.add(state.producer_id)
        self.send(
            command(T.CLOSE_PRODUCER, "close_producer", producer_id=state.producer_id, request_id=0)
        )

    def _on_close_producer(self, c: pb.CommandCloseProducer) -> None:
        state = self.producers.get(c.producer_id)
        if state is not None:
            self._close_producer_state(state)
        self._success(c.request_id)

    def _on_send_command(self, c: pb.CommandSend, frame: Frame) -> None:
        self._on_send(
            c.producer_id,
            c.sequence_id,
            c.num_messages,
            c.highest_sequence_id,  # 0 when absent
            frame.payload,
            frame.checksum_ok,
        )

    def _on_send(
        self,
        pid: int,
        seq: int,
        num: int,
        highest: int,
        payload: bytes | None,
        checksum_ok: bool,
    ) -> None:
        """One SEND: its fields as ``CommandSend`` holds them (defaults when absent)."""
        state = self.producers.get(pid)
        if state is None and pid in self._dropped_producers:
            return
        if state is None or state.producer is None or not state.producer.is_ready:
            self._send_error(pid, seq, pb.NotAllowedError, "producer is not ready")
            return
        if payload is None:
            self._send_error(pid, seq, pb.UnknownError, "SEND without a payload")
            return
        if not checksum_ok:
            self._send_error(pid, seq, pb.ChecksumError, "payload checksum mismatch")
            return
        try:
            complete = metadata_is_complete(payload, self._metadata_scratch)
        except CodecError as e:
            self._protocol_error(f"SEND with a bad payload: {e}")
            return
        if not complete:
            self._protocol_error("SEND whose message metadata lacks required fields")
            return
        if self._metadata_scratch.HasField("marker_type"):
            # The broker's own mark (an entry stored in another protocol's format, read as
            # such by that protocol's consumers): never a client's to set.
            self._send_error(pid, seq, pb.NotAllowedError, "marker_type is set by the broker")
            return
        pending = _PendingSend(seq, highest, len(payload))
        state.sends.append(pending)
        self._pending.take(len(payload))
        if num > 1:
            last_seq = seq + num - 1
        else:
            num = 1
            last_seq = seq
        # ``tuple.__new__`` builds the named tuple without its Python-level ``__new__``.
        item = _new_tuple(
            PublishItem, (payload, num, seq, highest if highest > last_seq else last_seq)
        )
        held = self._held.get(pid)
        if held is None:
            self._held[pid] = (state, [item], [pending])
        else:
            held[1].append(item)
            held[2].append(pending)

    def _store_held(self) -> None:
        """Store the held SENDs: one ``publish_many`` per producer, in the order they came."""
        held, self._held = self._held, {}
        for state, items, pendings in held.values():
            producer = state.producer
            if producer is None:  # gone since (the connection closed): nothing to answer
                continue
            if len(items) == 1:
                item = items[0]
                pending = pendings[0]
                d = producer.publish(
                    item.data,
                    item.num_messages,
                    sequence_id=item.sequence_id,
                    highest_sequence_id=item.highest_sequence_id,
                )
                args = (state, pending)
                d.addCallbacks(
                    self._stored, self._store_failed, callbackArgs=args, errbackArgs=args
                )
                continue
            many = producer.publish_many(items)
            many.addCallbacks(
                self._stored_many,
                self._store_many_failed,
                callbackArgs=(state, pendings),
                errbackArgs=(state, pendings),
            )

    def _stored_many(
        self, entries: list[Entry | None], state: _ProducerState, pendings: list[_PendingSend]
    ) -> None:
        for entry, pending in zip(entries, pendings, strict=True):
            if entry is not None:  # None: a duplicate the broker already stored, id (-1, -1)
                pending.ledger_id, pending.entry_id = entry.position
            pending.done = True
        self._flush_receipts(state)

    def _store_many_failed(
        self, f: Failure, state: _ProducerState, pendings: list[_PendingSend]
    ) -> None:
        error = server_error(f.value)
        for pending in pendings:
            pending.error = error
            pending.done = True
        self._flush_receipts(state)

    def _stored(self, entry: Entry | None, state: _ProducerState, pending: _PendingSend) -> None:
        if entry is not None:  # None: a duplicate the broker already stored, id (-1, -1)
            pos = entry.position
            pending.ledger_id = pos.ledger_id
            pending.entry_id = pos.entry_id
        pending.done = True
        self._flush_receipts(state)

    def _store_failed(self, f: Failure, state: _ProducerState, pending: _PendingSend) -> None:
        pending.error = server_error(f.value)
        pending.done = True
        self._flush_receipts(state)

    def _flush_receipts(self, state: _ProducerState) -> None:
        # Receipts ready together leave in one write, in order.
        sends = state.sends
        rows: list[tuple[int, int, int, int]] = []
        answered = size = 0
        while sends and sends[0].done:
            p = sends.popleft()
            answered += 1
            size += p.size
            if p.error is not None:
                if rows:
                    self.write_raw(encode_send_receipts(state.producer_id, state.partition, rows))
                    rows = []
                self._send_error(state.producer_id, p.sequence_id, *p.error)
                continue
            rows.append((p.sequence_id, p.ledger_id, p.entry_id, p.highest))
        if rows:
            self.write_raw(encode_send_receipts(state.producer_id, state.partition, rows))
        if answered and self._pending.give(size, answered):
            # Not from here: storage may answer while the frames before are being taken.
            self.settings.clock.callLater(0, self._take_rest)

    def _send_error(self, producer_id: int, seq: int, code: int, message: str) -> None:
        self.send(
            command(
                T.SEND_ERROR,
                "send_error",
                producer_id=producer_id,
                sequence_id=seq,
                error=code,
                message=message,
            )
        )

    # -- consumers ------------------------------------------------------------------------

    def _on_subscribe(self, c: pb.CommandSubscribe) -> None:
        rid = c.request_id
        cid = c.consumer_id
        if cid in self.consumers:
            self._success(rid)  # a retried SUBSCRIBE of a consumer already attached
            return
        if cid in self._subscribing:
            self._request_error(rid, BrokerError(f"consumer {cid} is still subscribing"))
            return
        try:
            partition = self.service.topic_ref(c.topic).partition_index
        except BrokerError as e:
            self._request_error(rid, e)
            return
        consumer = PulsarConsumer(
            self,
            cid,
            c.consumer_name or f"consumer-{cid}",
            c.priority_level if c.HasField("priority_level") else 0,
            partition,
        )
        start: Position | None = None
        if c.HasField("start_message_id"):
            mid = c.start_message_id
            ledger, entry = to_signed64(mid.ledgerId), to_signed64(mid.entryId)
            start = Position(ledger, entry)
            if ledger == _INT64_MAX:
                start = Position(_INT64_MAX, _INT64_MAX)
        key_shared: KeySharedMeta | None = None
        if c.HasField("keySharedMeta"):
            meta = c.keySharedMeta
            key_shared = KeySharedMeta(
                mode=(
                    KeySharedMode.STICKY
                    if meta.keySharedMode == pb.KeySharedMeta.STICKY
                    else KeySharedMode.AUTO_SPLIT
                ),
                ranges=tuple((r.start, r.end) for r in meta.hashRanges),
                allow_out_of_order=meta.allowOutOfOrderDelivery,
            )
        initial = (
            InitialPosition.EARLIEST
            if c.initialPosition == pb.CommandSubscribe.Earliest
            else InitialPosition.LATEST
        )

        def attach(_: object) -> Deferred[ServerConsumer]:
            return self.service.subscribe(  # type: ignore[no-any-return]
                c.topic,
                c.subscription,
                consumer,
                _SUB_TYPES.get(c.subType, SubType.EXCLUSIVE),
                initial,
                durable=c.durable,
                # The client drops what precedes its start id itself, so resend the start
                # entry: a start inside a batch must still deliver that batch's later messages.
                start_position=start if not c.durable else None,
                start_inclusive=True,
                key_shared=key_shared,
                metadata={kv_.key: kv_.value for kv_ in c.metadata},
                create_topic=c.force_topic_creation,
            )

        d = self._register_schema(c.topic, c.schema if c.HasField("schema") else None)
        d.addCallback(attach)
        self._subscribing[cid] = consumer

        def attached(server: ServerConsumer) -> None:
            self._subscribing.pop(cid, None)
            if self.state == self.CLOSED or consumer.closed:  # closed while subscribing
                server.close().addErrback(lambda f: None)
                return
            consumer.server = server
            self.consumers[cid] = consumer
            if self.write_full:
                server.pause()
            self._success(rid)

        def failed(f: Failure) -> None:
            self._subscribing.pop(cid, None)
            self._request_error(rid, f.value)

        d.addCallbacks(attached, failed)

    def consumer_gone(self, consumer: PulsarConsumer) -> None:
        """Forget a consumer the broker closed."""
        if self.consumers.get(consumer.consumer_id) is consumer:
            del self.consumers[consumer.consumer_id]

    def _server(self, consumer_id: int) -> ServerConsumer | None:
        consumer = self.consumers.get(consumer_id)
        return None if consumer is None else consumer.server

    def _on_flow(self, c: pb.CommandFlow) -> None:
        server = self._server(c.consumer_id)
        if server is not None:
            server.flow(c.messagePermits)

    def _on_ack(self, c: pb.CommandAck) -> None:
        server = self._server(c.consumer_id)
        rid = c.request_id if c.HasField("request_id") else None
        if server is None:
            if rid is not None:
                self._ack_response(c.consumer_id, rid, pb.ConsumerNotFound, "unknown consumer")
            return
        done: list[Deferred[None]] = []
        if c.ack_type == pb.CommandAck.Cumulative:
            if c.message_id:
                mid = c.message_id[0]
                pos = Position(to_signed64(mid.ledgerId), to_signed64(mid.entryId))
                acked = None
                if mid.ack_set:
                    n = self._batch_size(server, pos, mid)
                    acked = ~ack_set_bits(list(mid.ack_set)) & ((1 << n) - 1)
                done.append(server.ack_cumulative(pos, acked))
        else:
            whole: list[Position] = []
            for mid in c.message_id:
                pos = Position(to_signed64(mid.ledgerId), to_signed64(mid.entryId))
                if mid.ack_set:
                    n = self._batch_size(server, pos, mid)
                    acked = ~ack_set_bits(list(mid.ack_set)) & ((1 << n) - 1)
                    done.append(server.ack_batch_index(pos, acked, n))
                else:
                    whole.append(pos)
            if whole:
                done.append(server.ack(whole))
        for d in done:
            if rid is None:
                d.addErrback(self._ack_failed)
        if rid is not None:
            from twisted.internet.defer import gatherResults

            def answered(_: object) -> None:
                self._ack_response(c.consumer_id, rid, None, None)

            def refused(f: Failure) -> None:
                err = f.value.subFailure.value if hasattr(f.value, "subFailure") else f.value
                code, message = server_error(err)
                self._ack_response(c.consumer_id, rid, code, message)

            gatherResults(done, consumeErrors=True).addCallbacks(answered, refused)

    @staticmethod
    def _batch_size(server: ServerConsumer, pos: Position, mid: pb.MessageIdData) -> int:
        if mid.HasField("batch_size") and mid.batch_size > 0:
            return mid.batch_size
        entry = server.pending.get(pos)
        if entry is not None:
            return entry.num_messages
        return 64 * len(mid.ack_set)

    def _ack_failed(self, f: Failure) -> None:
        log.info("ack refused", extra=kv(peer=self._peer(), error=str(f.value)))

    def _ack_response(
        self, consumer_id: int, rid: int, code: int | None, message: str | None
    ) -> None:
        self.send(
            command(
                T.ACK_RESPONSE,
                "ackResponse",
                consumer_id=consumer_id,
                request_id=rid,
                error=code,
                message=message,
            )
        )

    def _on_redeliver(self, c: pb.CommandRedeliverUnacknowledgedMessages) -> None:
        server = self._server(c.consumer_id)
        if server is None:
            return
        if c.message_ids:
            server.redeliver(
                [Position(to_signed64(m.ledgerId), to_signed64(m.entryId)) for m in c.message_ids]
            )
        else:
            server.redeliver(None)

    def _on_seek(self, c: pb.CommandSeek) -> None:
        rid = c.request_id
        server = self._server(c.consumer_id)
        if server is None:
            self._request_error(rid, _ConsumerNotFound(f"consumer {c.consumer_id} not found"))
            return
        if c.HasField("message_id"):
            ledger = to_signed64(c.message_id.ledgerId)
            entry = to_signed64(c.message_id.entryId)
            target: Position | InitialPosition
            if ledger < 0:
                target = InitialPosition.EARLIEST
            elif ledger == _INT64_MAX:
                target = InitialPosition.LATEST
            else:
                target = Position(ledger, entry)
            d = server.seek(target)
        elif c.HasField("message_publish_time"):
            d = server.seek_time(c.message_publish_time)
        else:
            self._request_error(rid, BrokerError("SEEK needs a message id or a publish time"))
            return
        d.addCallbacks(lambda _: self._success(rid), lambda f: self._request_error(rid, f.value))

    def _on_get_last_message_id(self, c: pb.CommandGetLastMessageId) -> None:
        rid = c.request_id
        consumer = self.consumers.get(c.consumer_id)
        if consumer is None or consumer.server is None:
            self._request_error(rid, _ConsumerNotFound(f"consumer {c.consumer_id} not found"))
            return
        partition = consumer.partition

        def ok(last: Any) -> None:
            pos = last.position
            cmd = command(
                T.GET_LAST_MESSAGE_ID_RESPONSE,
                "getLastMessageIdResponse",
                request_id=rid,
                # A lone message has no batch index; the client compares ids with it.
                last_message_id=message_id(
                    pos.ledger_id,
                    pos.entry_id,
                    partition,
                    last.batch_index if last.num_messages > 1 else -1,
                ),
            )
            md = last.mark_delete_position
            if md is not None:
                cmd.getLastMessageIdResponse.consumer_mark_delete_position.CopyFrom(
                    message_id(md.ledger_id, md.entry_id, partition)
                )
            self.send(cmd)

        consumer.server.last_message_id().addCallbacks(
            ok, lambda f: self._request_error(rid, f.value)
        )

    def _on_close_consumer(self, c: pb.CommandCloseConsumer) -> None:
        pending = self._subscribing.get(c.consumer_id)
        if pending is not None:
            pending.closed = True  # detached as soon as its subscription completes
        consumer = self.consumers.pop(c.consumer_id, None)
        if consumer is None or consumer.server is None:
            self._success(c.request_id)
            return
        consumer.closed = True
        consumer.server.close().addBoth(lambda _: self._success(c.request_id))

    def _on_unsubscribe(self, c: pb.CommandUnsubscribe) -> None:
        rid = c.request_id
        consumer = self.consumers.get(c.consumer_id)
        if consumer is None or consumer.server is None:
            self._request_error(rid, _ConsumerNotFound(f"consumer {c.consumer_id} not found"))
            return

        def done(_: object) -> None:
            consumer.closed = True
            self.consumer_gone(consumer)
            self._success(rid)

        consumer.server.unsubscribe().addCallbacks(
            done, lambda f: self._request_error(rid, f.value)
        )

    def _on_consumer_stats(self, c: pb.CommandConsumerStats) -> None:
        rid = c.request_id
        consumer = self.consumers.get(c.consumer_id)
        if consumer is None or consumer.server is None:
            self.send(
                command(
                    T.CONSUMER_STATS_RESPONSE,
                    "consumerStatsResponse",
                    request_id=rid,
                    error_code=pb.ConsumerNotFound,
                    error_message=f"consumer {c.consumer_id} not found",
                )
            )
            return
        s = consumer.server
        self.send(
            command(
                T.CONSUMER_STATS_RESPONSE,
                "consumerStatsResponse",
                request_id=rid,
                msgRateOut=s.msg_rate_out,
                msgThroughputOut=s.msg_throughput_out,
                msgRateRedeliver=0.0,
                consumerName=consumer.consumer_name,
                availablePermits=max(s.permits, 0),
                unackedMessages=max(s.unacked_messages, 0),
                blockedConsumerOnUnackedMsgs=s.blocked,
                address=self._peer(),
                connectedSince=str(s.connected_since_ms),
                type=s.sub_type.value,
                msgRateExpired=0.0,
                msgBacklog=0,
                messageAckRate=0.0,
            )
        )


class _ConsumerNotFound(BrokerError):
    pulsar_error = "ConsumerNotFound"


_Handler = tuple[str | None, Callable[..., None]]
_HANDLERS: dict[int, _Handler] = {
    T.PING: (None, PulsarConnection._on_ping),
    T.PONG: (None, PulsarConnection._on_pong),
    T.PARTITIONED_METADATA: ("partitionMetadata", PulsarConnection._on_partitioned_metadata),
    T.LOOKUP: ("lookupTopic", PulsarConnection._on_lookup),
    T.PRODUCER: ("producer", PulsarConnection._on_producer),
    T.SEND: ("send", PulsarConnection._on_ignored),
    T.CLOSE_PRODUCER: ("close_producer", PulsarConnection._on_close_producer),
    T.SUBSCRIBE: ("subscribe", PulsarConnection._on_subscribe),
    T.FLOW: ("flow", PulsarConnection._on_flow),
    T.ACK: ("ack", PulsarConnection._on_ack),
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: (
        "redeliverUnacknowledgedMessages",
        PulsarConnection._on_redeliver,
    ),
    T.SEEK: ("seek", PulsarConnection._on_seek),
    T.GET_LAST_MESSAGE_ID: ("getLastMessageId", PulsarConnection._on_get_last_message_id),
    T.CLOSE_CONSUMER: ("close_consumer", PulsarConnection._on_close_consumer),
    T.UNSUBSCRIBE: ("unsubscribe", PulsarConnection._on_unsubscribe),
    T.CONSUMER_STATS: ("consumerStats", PulsarConnection._on_consumer_stats),
    T.GET_TOPICS_OF_NAMESPACE: ("getTopicsOfNamespace", PulsarConnection._on_topics_of_namespace),
    T.GET_SCHEMA: ("getSchema", PulsarConnection._on_get_schema),
    T.GET_OR_CREATE_SCHEMA: ("getOrCreateSchema", PulsarConnection._on_get_or_create_schema),
    T.AUTH_RESPONSE: ("authResponse", PulsarConnection._on_ignored),
}


class PulsarFactory(ServerFactory):
    """Builds a ``PulsarConnection`` per accepted socket and tracks the open ones."""

    def __init__(self, settings: PulsarSettings) -> None:
        self.settings = settings
        self.connections: set[PulsarConnection] = set()

    def buildProtocol(self, addr: Any) -> PulsarConnection:
        conn = _TrackedConnection(self.settings, self)
        conn.factory = self
        return conn

    def close_all(self) -> None:
        """Close every open connection."""
        for conn in list(self.connections):
            conn.close()


class _TrackedConnection(PulsarConnection):
    def __init__(self, settings: PulsarSettings, owner: PulsarFactory) -> None:
        super().__init__(settings)
        self._owner = owner

    def connectionMade(self) -> None:
        self._owner.connections.add(self)
        super().connectionMade()

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self._owner.connections.discard(self)
        super().connectionLost(reason)


def _schema_proto(stored: StoredSchema) -> pb.Schema:
    """A registered schema version as the wire protocol carries it."""
    schema = pb.Schema(name=stored.name, schema_data=stored.data, type=stored.type)  # type: ignore[arg-type]
    for key, value in sorted(stored.properties.items()):
        schema.properties.add(key=key, value=value)
    return schema
