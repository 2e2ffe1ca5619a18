"""The Kafka APIs over the Broker API: one method per request type.

Topics: Kafka topic ``t`` is ``persistent://public/default/t`` (full Pulsar names work too). A
partitioned topic's partition ``i`` is ``t-partition-i``; a non-partitioned Pulsar topic shows as
one partition. Topics that do not exist are created partitioned (``defaultNumPartitions``) when
auto-creation is on. This broker leads every partition.

Offsets are the managed ledger's message indexes, exactly: a produced record batch is stored as
one entry (verbatim, tagged ``kafka``: see ``records`` and ``broker_core.messages``) whose index
is the batch's base offset. Entries written by other protocols are converted to batches on fetch.

Idempotent producers: per (partition, producer id) the last few batches' sequence numbers and
offsets are remembered; a batch seen again is acknowledged with its first offset and not
appended twice, a gap is OUT_OF_ORDER_SEQUENCE_NUMBER. Produces to one partition are checked
and appended in the order they arrived (``_AppendOrder``), as a Kafka broker handles a
connection's requests one at a time. The state is rebuilt from the log when a
partition is loaded (here: before the first idempotent produce to it on this broker object is
answered), so a batch the previous owner stored but never acknowledged (a kill -9, a failover)
is acknowledged, not stored twice, when the producer retries it. Every stored Kafka batch says
who wrote it: a verbatim entry carries the batch header (producer id, epoch, base sequence,
count); a converted entry's producer name is ``kafka-<id>-<epoch>`` and its sequence id the
base sequence (the message count gives the last). Only the log's tail is read
(``_REBUILD_MAX_ENTRIES`` entries, ``_REBUILD_MAX_BYTES`` bytes, ``_REBUILD_MAX_SECONDS``,
newest first, with no hole): a producer whose last batch is older than that starts afresh, as
one the broker never saw.

Cluster mode (``cluster`` given: see ``cluster``): Metadata names each partition's owner as its
leader and lists the live brokers; Produce, Fetch and ListOffsets on a partition another broker
owns answer NOT_LEADER_OR_FOLLOWER, so the client refreshes its metadata; FindCoordinator names
the owner of the group's coordinator slot, and the group APIs on any other broker answer
NOT_COORDINATOR. Groups whose slot this broker lost are forgotten (checked every
``SWEEP_INTERVAL_S`` and on each request); producer states are kept per loaded topic, so a
partition that comes back after another broker served it is rebuilt from its log again.

Large requests: one request may name hundreds of thousands of topics or partitions, each a
store probe. Its work hands the reactor back every ``ELEMENTS_PER_TURN`` of them (``_Turns``),
so it delays other connections by one turn's work, not by its own. A topic named twice in one
Metadata request, or a partition twice in one OffsetFetch, is answered once, as Kafka does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import struct
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater
from twisted.python.failure import Failure

from polybroker.broker_core import messages
from polybroker.broker_core.errors import (
    InvalidTopicNameError,
    NotAllowedError,
    PersistenceError,
    ServiceNotReadyError,
    TopicAlreadyExistsError,
    TopicNotFoundError,
)
from polybroker.broker_core.messages import Message, MessageFormatError
from polybroker.broker_core.ownership import NotOwnerError
from polybroker.logs import kv
from polybroker.protocols.kafka import codec as c
from polybroker.protocols.kafka import records as rec
from polybroker.protocols.kafka.cluster import KafkaCluster, KafkaNode
from polybroker.protocols.kafka.groups import GroupCoordinator

log = logging.getLogger(__name__)

FORMAT_TAG = "kafka"
NO_RESPONSE = object()
_DEDUP_WINDOW = 5
_MAX_PRODUCER_STATES = 100_000
#: Bounds on the log tail read to rebuild a loaded partition's producer states.
_REBUILD_MAX_ENTRIES = 2048
_REBUILD_MAX_BYTES = 32 * 1024 * 1024
_REBUILD_MAX_SECONDS = 3.0
#: Messages in the first (newest) window of the tail; each older window is 4 times larger.
_REBUILD_FIRST_SPAN = 256
#: Topics or partitions one request works through before it hands the reactor back.
ELEMENTS_PER_TURN = 256
#: How often (seconds) a cluster broker drops the groups whose coordinator slot it lost.
SWEEP_INTERVAL_S = 1.0
#: How often (seconds) a cluster broker moves the groups' subscriptions on the partitions it
#: owns to their stored commits (``mirror_stored_commits``).
MIRROR_INTERVAL_S = 5.0
#: Topic ids are derived from the full topic name: stable across restarts with no stored state.
_TOPIC_ID_NAMESPACE = uuid.UUID("5c0f9d4e-6a55-4b8e-9a43-4b6b2f1d7a01")
_NO_TOPIC_ID = uuid.UUID(int=0)
_LATEST = -1
_EARLIEST = -2
_MAX_TIMESTAMP = -3
#: Entries asked of the log per read while filling a Fetch (each read is one Deferred).
_READ_ENTRIES = 64
_I64 = struct.Struct(">q")
#: Kafka batch codecs -> the stored message format's (gzip has no Pulsar twin: zlib is close).
_PULSAR_COMPRESSION = {
    rec.COMPRESSION_GZIP: "zlib",
    rec.COMPRESSION_SNAPPY: "snappy",
    rec.COMPRESSION_LZ4: "lz4",
    rec.COMPRESSION_ZSTD: "zstd",
}


def decode_native(native: bytes, template: Message) -> list[Message]:
    """The registered ``kafka`` entry format: a stored record batch as messages."""
    try:
        batches = rec.split_batches(native)
        out: list[Message] = []
        for batch in batches:
            for r in rec.decode_batch(batch, limit=messages.DEFAULT_MAX_SIZE):
                out.append(
                    Message(
                        r.value if r.value is not None else b"",
                        key=r.key,
                        properties=[
                            (k, (v or b"").decode("utf-8", "replace")) for k, v in r.headers
                        ],
                        event_time_ms=max(r.timestamp_ms, 0),
                        publish_time_ms=template.publish_time_ms,
                        null_value=r.value is None,
                        sequence_id=template.sequence_id + len(out),
                    )
                )
        return out
    except rec.RecordError as e:
        raise MessageFormatError(f"stored Kafka batch is malformed: {e}") from None


messages.register_format(FORMAT_TAG, decode_native)


def entry_as_batch(index: int, data: bytes) -> bytes:
    """A stored entry as one Kafka record batch whose base offset is ``index``."""
    md, payload = messages.split_entry(data)
    if messages.metadata_format(md) == FORMAT_TAG:
        return rec.with_base_offset(payload, index)
    records = []
    for i, m in enumerate(messages.decode_entry(data)):
        headers: list[tuple[str, bytes | None]] = [(k, v.encode()) for k, v in m.properties]
        ts = m.event_time_ms or m.publish_time_ms
        value = None if m.null_value else m.payload
        records.append(rec.Record(i, ts, m.key, value, headers))
    if not records:
        return b""
    return rec.build_batch(index, records)


def _produce_error(topic: str, error: BaseException) -> tuple[int, int, int]:
    """The answer to a partition's produce that raised ``error``: the storage refusing it
    (no writable bookie, say, their disks full) is Kafka's retriable storage error, so clients
    try again until their delivery timeout (the managed ledger logs why); anything else is
    unexpected, logged and answered as an unknown server error."""
    if isinstance(error, PersistenceError):
        log.debug("produce not stored", extra=kv(topic=topic, error=str(error)))
        return c.KAFKA_STORAGE_ERROR, -1, -1
    log.warning("produce failed", extra=kv(topic=topic, error=str(error)))
    return c.UNKNOWN_SERVER_ERROR, -1, -1


def producer_name(producer_id: int, epoch: int, base_sequence: int) -> str:
    """The producer name a stored Kafka batch carries: ``kafka-<id>-<epoch>`` for an idempotent
    batch (what ``stored_producer_batch`` reads back), ``kafka-<id>`` otherwise."""
    if producer_id >= 0 and base_sequence >= 0:
        return f"kafka-{producer_id}-{epoch}"
    return f"kafka-{producer_id}"


def stored_producer_batch(data: bytes) -> tuple[int, int, int, int] | None:
    """(producer id, epoch, base sequence, last sequence) of a stored entry an idempotent Kafka
    producer wrote, or None (another writer, a non-idempotent batch, or unreadable)."""
    try:
        md, payload = messages.split_entry(data)
    except MessageFormatError:
        return None
    if messages.metadata_format(md) == FORMAT_TAG:
        if len(payload) < rec.HEADER_SIZE:
            return None
        fields = rec.HEADER.unpack_from(payload, 0)
        pid, epoch, base, count = fields[9], fields[10], fields[11], fields[12]
    else:
        parts = md.producer_name.split("-")
        if len(parts) != 3 or parts[0] != "kafka":
            return None
        try:
            pid, epoch = int(parts[1]), int(parts[2])
        except ValueError:
            return None
        base, count = md.sequence_id, md.num_messages_in_batch
    if pid < 0 or epoch < 0 or base < 0 or count < 1:
        return None
    return pid, epoch, base, base + count - 1


@dataclass
class ProducerState:
    epoch: int
    last_sequence: int
    recent: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=_DEDUP_WINDOW))
    # (base sequence, last sequence, base offset) of the last batches
    topic: Any = None  # the loaded topic the state belongs to (cluster mode)


@dataclass
class Settings:
    node_id: int
    host: Callable[[], str]
    port: Callable[[], int]
    cluster_id: str
    max_message_size: int
    default_partitions: int
    auto_create: bool
    entry_format: str = "pulsar"  # or FORMAT_TAG: store batches verbatim
    api_versions: dict[int, tuple[int, int]] = field(default_factory=lambda: dict(c.API_VERSIONS))
    conversion_cache_bytes: int = 64 * 1024 * 1024


@dataclass(slots=True)
class _PartitionRead:
    topic: str
    topic_id: uuid.UUID
    out: c.FetchedPartition  # what the response carries: batches as wire pieces

    @property
    def error(self) -> int:
        return self.out.error

    @property
    def size(self) -> int:
        return self.out.size


class _AppendOrder:
    """Produces to one partition reach their sequence check and start their appends in the
    order they arrived, whatever each awaited before (the partition count, an ownership check,
    the topic's load, the producer-state rebuild). A Kafka broker handles a connection's
    requests one at a time, and an idempotent client with several requests in flight counts on
    that: a batch checked before the one sent ahead of it would be refused as a gap (which
    librdkafka makes fatal) or stored out of order. ``enter`` is called on arrival, before any
    await; the ticket fires once every earlier ticket of its key has left."""

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: dict[tuple[str, int], deque[Deferred[None]]] = {}

    def enter(self, key: tuple[str, int]) -> Deferred[None]:
        queue = self._queues.setdefault(key, deque())
        ticket: Deferred[None] = Deferred()
        queue.append(ticket)
        if len(queue) == 1:
            ticket.callback(None)
        return ticket

    def leave(self, key: tuple[str, int], ticket: Deferred[None]) -> None:
        """Let the next ticket of ``key`` go once ``ticket`` is done (or given up); a ticket
        that already left is ignored."""
        queue = self._queues.get(key)
        if queue is None or ticket not in queue:
            return
        head = queue[0] is ticket
        queue.remove(ticket)
        if not queue:
            del self._queues[key]
        elif head:
            queue[0].callback(None)


class _Turns:
    """One request's count of elements worked through; ``step`` hands the reactor back (a
    zero-delay call on the clock) every ``ELEMENTS_PER_TURN`` of them."""

    __slots__ = ("clock", "left")

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.left = ELEMENTS_PER_TURN

    async def step(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.left = ELEMENTS_PER_TURN
            await deferLater(self.clock, 0)


class KafkaApis:
    """Answers decoded Kafka requests; one instance serves every connection of a handler."""

    def __init__(
        self,
        service: Any,
        clock: IReactorTime,
        settings: Settings,
        cluster: KafkaCluster | None = None,
    ) -> None:
        self.service = service
        self.clock = clock
        self.settings = settings
        self.cluster = cluster
        self.groups = GroupCoordinator(
            clock,
            service.metadata_store,
            on_commit=self._committed,
            fresh_offsets=cluster is not None,
            is_coordinator=None if cluster is None else self._owns_slot,
        )
        self._sweep: LoopingCall | None = None
        self._mirror: LoopingCall | None = None
        # (group, full topic name) -> (id of the loaded topic, offset) last mirrored there.
        self._mirrored: dict[tuple[str, str], tuple[int, int]] = {}
        if cluster is not None:
            self._sweep = LoopingCall(self.sweep_groups)
            self._sweep.clock = clock
            self._sweep.start(SWEEP_INTERVAL_S, now=False)
            self._mirror = LoopingCall(self._mirror_tick)
            self._mirror.clock = clock
            self._mirror.start(MIRROR_INTERVAL_S, now=False)
        self.producers: dict[tuple[str, int], ProducerState] = {}
        # Loaded topic -> None once its producer states are rebuilt, or the rebuild under way.
        self._append_order = _AppendOrder()
        self._rebuilt: weakref.WeakKeyDictionary[Any, Deferred[None] | None] = (
            weakref.WeakKeyDictionary()
        )
        self._producer_ids = itertools.count(int(time.time() * 1000) << 8)
        self._partitions: dict[str, int] = {}  # Kafka name -> partition count (0: not partitioned)
        # Record batches converted from Pulsar-format entries, most recently used last: every
        # consumer group (and librdkafka's prefetch) reads the same entries again.
        self._converted: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()
        self._converted_bytes = 0
        self._topic_names: dict[uuid.UUID, str] = {}  # topic id -> Kafka name
        self._closed = False

    def close(self) -> None:
        self._closed = True
        for loop in (self._sweep, self._mirror):
            if loop is not None and loop.running:
                loop.stop()
        self.groups.close()

    # -- names ----------------------------------------------------------------------------

    def topic_id(self, name: str) -> uuid.UUID:
        """The stable id of a Kafka topic (remembered so requests may name it by id)."""
        found = uuid.uuid5(_TOPIC_ID_NAMESPACE, self._full(name))
        if len(self._topic_names) > 100_000:
            self._topic_names.clear()
        self._topic_names[found] = name
        return found

    def topic_name(self, topic_id: uuid.UUID | None, name: str | None) -> str | None:
        """The Kafka name a request means: its name, or the topic its id belongs to."""
        if topic_id is not None and topic_id != _NO_TOPIC_ID:
            return self._topic_names.get(topic_id)
        return name

    def _full(self, name: str) -> str:
        return self.service.topic_ref(name).full

    def _kafka_name(self, full: str, requested: str | None = None) -> str:
        if requested is not None:
            return requested
        prefix = "persistent://public/default/"
        return full[len(prefix) :] if full.startswith(prefix) else full

    async def partition_count(self, name: str, create: bool) -> int:
        """Partitions Kafka sees (0 when the topic does not exist); may create it."""
        if not name or len(name) > 249:
            raise InvalidTopicNameError(f"invalid topic name {name!r}")
        n = await self.service.partitioned_topic_metadata(name)
        if n > 0:
            self._partitions[name] = n
            return n
        if self.service.topic_ref(name).partition_index >= 0:
            raise InvalidTopicNameError(f"{name} names a partition")
        try:
            await self.service.get_topic(name, create=False)
            self._partitions[name] = 0
            return 1
        except TopicNotFoundError:
            pass
        except ServiceNotReadyError:
            if self.cluster is None:
                raise
            # Another broker serves it, if it exists: ask the store rather than load it here.
            ref = self.service.topic_ref(name)
            if ref.persistent and await self.service.ledger_factory.exists(ref.managed_ledger_name):
                self._partitions[name] = 0
                return 1
        if not create or not self.settings.auto_create:
            return 0
        with contextlib.suppress(TopicAlreadyExistsError):
            await self.service.create_partitioned_topic(name, self.settings.default_partitions)
        return await self.partition_count(name, False)

    async def _partition_topic(self, name: str, partition: int, create: bool) -> Any:
        """The Broker API topic behind a Kafka partition, or None if there is none."""
        n = self._partitions.get(name)
        if n is None:
            count = await self.partition_count(name, create)
            if count == 0:
                return None
            n = self._partitions[name]
        if n == 0:
            if partition != 0:
                return None
            full = self._full(name)
        else:
            if not 0 <= partition < n:
                # The count may have grown since it was cached.
                count = await self.partition_count(name, False)
                if not 0 <= partition < count:
                    return None
            full = f"{self._full(name)}-partition-{partition}"
        if self.cluster is not None and not await self.cluster.serves_here(full):
            raise NotOwnerError(f"{full} is served by another broker")
        try:
            topic = await self._load(full, create)
        except TopicNotFoundError:
            if n == 0 or partition >= await self.service.partitioned_topic_metadata(name):
                return None
            # A partition of a partitioned topic that nothing has written yet: Kafka shows it,
            # empty, from the topic's creation on, so a reader brings it up (otherwise its
            # client backs off on UNKNOWN_TOPIC_OR_PARTITION and misses the first messages).
            topic = await self._load(full, True)
        if not getattr(topic, "persistent", False):
            return None
        return topic

    def _load(self, full: str, create: bool) -> Deferred[Any]:
        loading = self.service.get_topic(full, create=create)
        return loading if self.cluster is None else self.cluster.bounded(loading)

    # -- dispatch -------------------------------------------------------------------------

    def handle(self, req: c.Request, client_host: str) -> Deferred[Any] | Any:
        """The response body for ``req`` (a Deferred, a body, or ``NO_RESPONSE``)."""
        method = _DISPATCH[req.api_key]
        if self.cluster is not None and req.api_key in _GROUP_APIS:
            return Deferred.fromCoroutine(self._as_coordinator(method, req, client_host))
        return method(self, req, client_host)

    def _api_versions(self, req: c.Request, host: str) -> Any:
        return c.api_versions_body(req.api_version, table=self.settings.api_versions)

    # -- coordination in a cluster ---------------------------------------------------------

    async def _coordinates(self, group_id: str) -> bool:
        """Whether this broker coordinates the group, claiming its slot when unowned."""
        assert self.cluster is not None
        slot = self.cluster.coordinator_topic(group_id)
        if self.cluster.owns(slot):
            return True
        # Coordination (re)starts here or is elsewhere: what this broker remembers of the
        # slot's groups is stale either way.
        for gid in list(self.groups.groups):
            if self.cluster.coordinator_topic(gid) == slot:
                self.groups.forget(gid)
        if not await self.cluster.serves_here(slot):
            return False
        return await self.cluster.claim(slot)

    def _owns_slot(self, group_id: str) -> bool:
        assert self.cluster is not None
        return self.cluster.owns(self.cluster.coordinator_topic(group_id))

    def sweep_groups(self) -> None:
        """Forget the groups whose coordinator slot this broker no longer owns."""
        if self.cluster is None:
            return
        for gid in list(self.groups.groups):
            if not self.cluster.owns(self.cluster.coordinator_topic(gid)):
                self.groups.forget(gid)

    def _mirror_tick(self) -> Deferred[None]:
        def failed(f: Failure) -> None:
            log.warning("mirroring stored commits failed", extra=kv(error=str(f.value)))

        return Deferred.fromCoroutine(self.mirror_stored_commits()).addErrback(failed)

    async def mirror_stored_commits(self) -> None:
        """Cluster mode: move the subscription named after each group, on every partition
        loaded and owned here, to the group's stored commit. The coordinator mirrors a commit
        at once only on the partitions it owns itself (``_committed``); on the others the group
        had no subscription, so their ledgers were trimmed as if nobody read them, whatever
        the group had not consumed yet."""
        if self.cluster is None or self._closed:
            return
        owned: dict[tuple[str, int], Any] = {}
        for name, count in list(self._partitions.items()):
            for i in range(max(count, 1)):
                full = self._partition_name(name, i)
                topic = self.service.loaded_topic(full)
                if topic is not None and self.cluster.owns(full):
                    owned[(name, i)] = topic
        if not owned:
            return
        if len(self._mirrored) > _MAX_PRODUCER_STATES:
            self._mirrored.clear()
        for group, offsets in await self.groups.stored_commits():
            for name, partition, offset in offsets:
                topic = owned.get((name, partition))
                if topic is None or offset < 0 or not getattr(topic, "persistent", False):
                    continue
                key, done = (group, topic.name), (id(topic), offset)
                if self._mirrored.get(key) == done:
                    continue
                try:
                    await topic.mark_subscription_at_index(group, offset)
                except Exception as e:
                    log.info(
                        "mirroring a stored commit failed",
                        extra=kv(group=group, topic=topic.name, error=str(e)),
                    )
                    continue
                self._mirrored[key] = done

    async def _as_coordinator(
        self, method: Callable[[KafkaApis, c.Request, str], Any], req: c.Request, host: str
    ) -> Any:
        """Serve a group request only for the groups this broker coordinates; the others
        get NOT_COORDINATOR."""
        b = req.body
        key = req.api_key
        if key == c.API_DESCRIBE_GROUPS:
            ids = list(b.groups)
        elif key == c.API_DELETE_GROUPS:
            ids = list(b.groups_names)
        elif key == c.API_OFFSET_FETCH and req.api_version >= 8:
            ids = [g.group_id for g in b.groups or []]
        else:
            if not await self._coordinates(b.group_id):
                log.info("not the group's coordinator", extra=kv(group=b.group_id, api=req.api_key))
                return _not_coordinator(req)
            return await _resolved(method(self, req, host))
        refused = []
        turns = _Turns(self.clock)
        for g in dict.fromkeys(ids):
            await turns.step()
            if not await self._coordinates(g):
                refused.append(g)
        if not refused:
            return await _resolved(method(self, req, host))
        cls = c.response_class(key)
        if key == c.API_DESCRIBE_GROUPS:
            b.groups = [g for g in b.groups if g not in refused]
            resp = await _resolved(method(self, req, host))
            resp.groups.extend(
                cls.DescribedGroup(
                    error_code=c.NOT_COORDINATOR,
                    group_id=g,
                    group_state="",
                    protocol_type="",
                    protocol_data="",
                    members=[],
                )
                for g in refused
            )
        elif key == c.API_DELETE_GROUPS:
            b.groups_names = [g for g in b.groups_names if g not in refused]
            resp = await _resolved(method(self, req, host))
            resp.results.extend(
                cls.DeletableGroupResult(group_id=g, error_code=c.NOT_COORDINATOR) for g in refused
            )
        else:
            b.groups = [g for g in b.groups if g.group_id not in refused]
            resp = await _resolved(method(self, req, host))
            resp.groups.extend(
                cls.OffsetFetchResponseGroup(group_id=g, topics=[], error_code=c.NOT_COORDINATOR)
                for g in refused
            )
        return resp

    # -- metadata and admin ---------------------------------------------------------------

    def _metadata(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._metadata_async(req))

    async def _metadata_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_METADATA)
        part_cls = cls.MetadataResponseTopic.MetadataResponsePartition
        body = req.body
        auto = bool(getattr(body, "allow_auto_topic_creation", True))
        if body.topics is None or (req.api_version == 0 and not body.topics):
            names = await self._all_topics()
            auto = False
        else:
            # Each name once (an unknown topic id, None, stays once per id).
            named = [self.topic_name(t.topic_id, t.name) for t in body.topics]
            names = [n for n in dict.fromkeys(named) if n is not None]
            names += [n for n in named if n is None]
        found: list[tuple[str | None, int, int]] = []  # (name, error, partitions)
        turns = _Turns(self.clock)
        for name in names:
            await turns.step()
            error = c.NONE
            n = 0
            if name is not None:
                try:
                    n = await self.partition_count(name, auto)
                    if n == 0:
                        error = c.UNKNOWN_TOPIC_OR_PARTITION
                except (InvalidTopicNameError, NotAllowedError):
                    error = c.INVALID_TOPIC_EXCEPTION
                except ServiceNotReadyError:
                    if self.cluster is None:
                        raise
                    error = c.LEADER_NOT_AVAILABLE
            found.append((name, error, n if error == c.NONE else 0))
        nodes, leaders = await self._placement(
            [self._partition_name(name, i) for name, _, n in found if name for i in range(n)]
        )
        topics = []
        for name, error, n in found:
            if name is None:
                topics.append(
                    cls.MetadataResponseTopic(
                        error_code=c.UNKNOWN_TOPIC_ID,
                        name=None,
                        topic_id=_NO_TOPIC_ID,
                        partitions=[],
                    )
                )
                continue
            partitions = []
            for i in range(n):
                leader = leaders.get(self._partition_name(name, i), -1)
                replicas = [leader] if leader >= 0 else []
                partitions.append(
                    part_cls(
                        error_code=c.NONE if leader >= 0 else c.LEADER_NOT_AVAILABLE,
                        partition_index=i,
                        leader_id=leader,
                        leader_epoch=0,
                        replica_nodes=replicas,
                        isr_nodes=replicas,
                        offline_replicas=[],
                    )
                )
            topics.append(
                cls.MetadataResponseTopic(
                    error_code=error,
                    name=name,
                    topic_id=self.topic_id(name) if error == c.NONE else _NO_TOPIC_ID,
                    is_internal=False,
                    partitions=partitions,
                )
            )
        return cls(
            throttle_time_ms=0,
            brokers=[
                cls.MetadataResponseBroker(node_id=n.node_id, host=n.host, port=n.port, rack=None)
                for n in nodes
            ],
            cluster_id=self.settings.cluster_id,
            controller_id=nodes[0].node_id if nodes else -1,
            topics=topics,
        )

    def _partition_name(self, name: str, partition: int) -> str:
        """The full topic name of a Kafka partition whose count is known."""
        if self._partitions.get(name, 1) == 0:
            return self._full(name)
        return f"{self._full(name)}-partition-{partition}"

    async def _placement(self, topics: list[str]) -> tuple[list[KafkaNode], dict[str, int]]:
        """The brokers to list (the controller first) and each full topic's leader node id
        (absent: no leader now)."""
        if self.cluster is None:
            node = KafkaNode(self.settings.node_id, self.settings.host(), self.settings.port(), "")
            return [node], dict.fromkeys(topics, node.node_id)
        try:
            nodes = await self.cluster.nodes()
        except ServiceNotReadyError:
            return [], {}
        found = await self.cluster.leaders(topics, nodes)
        return nodes, {t: n.node_id for t, n in found.items() if n is not None}

    async def _all_topics(self) -> list[str]:
        names: set[str] = set()
        for full in await self.service.topics_of_namespace("public/default"):
            ref = self.service.topic_ref(full)
            local = ref.local
            idx = ref.partition_index
            if idx >= 0:
                local = local[: local.rindex("-partition-")]
            names.add(local)
        return sorted(names)

    def _create_topics(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._create_topics_async(req))

    async def _create_topics_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_CREATE_TOPICS)
        results = []
        turns = _Turns(self.clock)
        for t in req.body.topics:
            await turns.step()
            error, message = c.NONE, None
            n = t.num_partitions if t.num_partitions > 0 else self.settings.default_partitions
            try:
                if t.num_partitions == 0 or t.num_partitions < -1:
                    error, message = c.INVALID_PARTITIONS, "partitions must be at least 1"
                elif await self.partition_count(t.name, False) > 0:
                    error, message = c.TOPIC_ALREADY_EXISTS, f"topic {t.name} already exists"
                elif not req.body.validate_only:
                    await self.service.create_partitioned_topic(t.name, n)
                    self._partitions[t.name] = n
            except TopicAlreadyExistsError as e:
                error, message = c.TOPIC_ALREADY_EXISTS, str(e)
            except (InvalidTopicNameError, NotAllowedError) as e:
                error, message = c.INVALID_TOPIC_EXCEPTION, str(e)
            results.append(
                cls.CreatableTopicResult(
                    name=t.name,
                    topic_id=self.topic_id(t.name) if error == c.NONE else _NO_TOPIC_ID,
                    error_code=error,
                    error_message=message,
                    num_partitions=n if error == c.NONE else -1,
                    replication_factor=1 if error == c.NONE else -1,
                    configs=[],
                )
            )
        return cls(throttle_time_ms=0, topics=results)

    def _delete_topics(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._delete_topics_async(req))

    async def _delete_topics_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_DELETE_TOPICS)
        results = []
        body = req.body
        requested = list(body.topic_names or [])
        if req.api_version >= 6:
            requested = [self.topic_name(t.topic_id, t.name) or "" for t in body.topics or []]
        turns = _Turns(self.clock)
        for name in requested:
            await turns.step()
            error, message = c.NONE, None
            self._partitions.pop(name, None)
            try:
                n = await self.service.partitioned_topic_metadata(name)
                elsewhere = await self._served_elsewhere(name, n)
                if elsewhere:
                    # Deleting needs every partition loaded here; none is deleted otherwise.
                    error = c.UNKNOWN_SERVER_ERROR
                    message = f"{elsewhere} is served by another broker: delete the topic there"
                elif n > 0:
                    await self.service.delete_partitioned_topic(name, force=True)
                else:
                    await self.service.get_topic(name, create=False)
                    await self.service.delete_topic(name, force=True)
                for key in [k for k in self.producers if k[0].startswith(self._full(name))]:
                    del self.producers[key]
                if not elsewhere:
                    await self.groups.forget_topic(name)
            except TopicNotFoundError:
                error = c.UNKNOWN_TOPIC_OR_PARTITION
            except InvalidTopicNameError:
                if name:
                    error = c.INVALID_TOPIC_EXCEPTION
            except ServiceNotReadyError as e:
                if self.cluster is None:
                    raise
                error, message = c.UNKNOWN_SERVER_ERROR, str(e)
            results.append(
                cls.DeletableTopicResult(
                    name=name or None,
                    topic_id=self.topic_id(name) if name else _NO_TOPIC_ID,
                    error_code=error if name else c.UNKNOWN_TOPIC_ID,
                    error_message=message,
                )
            )
        return cls(throttle_time_ms=0, responses=results)

    async def _served_elsewhere(self, name: str, partitions: int) -> str | None:
        """In a cluster, the first of the topic's partitions another broker owns (claiming
        the unowned ones here), or None."""
        if self.cluster is None:
            return None
        full = self._full(name)
        names = [f"{full}-partition-{i}" for i in range(partitions)] if partitions else [full]
        for topic in names:
            if not self.cluster.owns(topic) and not await self.cluster.claim(topic):
                return topic
        return None

    def _create_partitions(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._create_partitions_async(req))

    async def _create_partitions_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_CREATE_PARTITIONS)
        results = []
        turns = _Turns(self.clock)
        for t in req.body.topics:
            await turns.step()
            error, message = c.NONE, None
            try:
                n = await self.service.partitioned_topic_metadata(t.name)
                if n == 0:
                    error, message = c.UNKNOWN_TOPIC_OR_PARTITION, "not a partitioned topic"
                elif t.count <= n:
                    error, message = c.INVALID_PARTITIONS, f"topic has {n} partitions"
                elif not req.body.validate_only:
                    await self.service.update_partitioned_topic(t.name, t.count)
                    self._partitions[t.name] = t.count
            except (InvalidTopicNameError, NotAllowedError, TopicNotFoundError) as e:
                error, message = c.INVALID_PARTITIONS, str(e)
            results.append(
                cls.CreatePartitionsTopicResult(
                    name=t.name, error_code=error, error_message=message
                )
            )
        return cls(throttle_time_ms=0, results=results)

    def _retention(self, name: str) -> tuple[str, str]:
        """The topic's retention as Kafka's ``retention.ms`` and ``retention.bytes`` (-1: no
        limit). Pulsar's retention keeps what every subscription consumed that long: a topic
        no group or subscription reads keeps only that (its current ledger at least)."""
        config = self.service.ledger_config_of(self._full(name))
        seconds, size = config.retention_time_s, config.retention_size_bytes
        return ("-1" if seconds < 0 else str(int(seconds * 1000))), str(size if size >= 0 else -1)

    def _describe_configs(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._describe_configs_async(req))

    async def _describe_configs_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_DESCRIBE_CONFIGS)
        item = cls.DescribeConfigsResult.DescribeConfigsResourceResult
        results = []
        turns = _Turns(self.clock)
        for r in req.body.resources:
            await turns.step()
            error, message = c.NONE, None
            configs: dict[str, str] = {}
            if r.resource_type == 2:  # topic
                try:
                    if await self.partition_count(r.resource_name, False) == 0:
                        error = c.UNKNOWN_TOPIC_OR_PARTITION
                        message = f"topic {r.resource_name} does not exist"
                except InvalidTopicNameError as e:
                    error, message = c.INVALID_TOPIC_EXCEPTION, str(e)
                retention_ms, retention_bytes = (
                    ("-1", "-1") if error else self._retention(r.resource_name)
                )
                configs = {
                    "cleanup.policy": "delete",
                    "retention.ms": retention_ms,
                    "retention.bytes": retention_bytes,
                    "max.message.bytes": str(self.settings.max_message_size),
                    "message.timestamp.type": "CreateTime",
                    "min.insync.replicas": "1",
                    "compression.type": "producer",
                }
            elif r.resource_type == 4:  # broker
                configs = {
                    "message.max.bytes": str(self.settings.max_message_size),
                    "num.partitions": str(self.settings.default_partitions),
                    "auto.create.topics.enable": str(self.settings.auto_create).lower(),
                    "default.replication.factor": "1",
                }
            else:
                error, message = c.INVALID_REQUEST, f"resource type {r.resource_type}"
            wanted = r.configuration_keys
            entries = [
                item(
                    name=k,
                    value=v,
                    read_only=True,
                    config_source=5,
                    is_default=True,
                    is_sensitive=False,
                    synonyms=[],
                )
                for k, v in sorted(configs.items())
                if wanted is None or k in wanted
            ]
            results.append(
                cls.DescribeConfigsResult(
                    error_code=error,
                    error_message=message,
                    resource_type=r.resource_type,
                    resource_name=r.resource_name,
                    configs=[] if error else entries,
                )
            )
        return cls(throttle_time_ms=0, results=results)

    def _describe_cluster(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._describe_cluster_async())

    async def _describe_cluster_async(self) -> Any:
        cls = c.response_class(c.API_DESCRIBE_CLUSTER)
        nodes, _ = await self._placement([])
        return cls(
            throttle_time_ms=0,
            error_code=c.NONE,
            error_message=None,
            endpoint_type=1,  # brokers
            cluster_id=self.settings.cluster_id,
            controller_id=nodes[0].node_id if nodes else -1,
            brokers=[
                cls.DescribeClusterBroker(
                    broker_id=n.node_id, host=n.host, port=n.port, rack=None, is_fenced=False
                )
                for n in nodes
            ],
        )

    # -- produce --------------------------------------------------------------------------

    def _init_producer_id(self, req: c.Request, host: str) -> Any:
        cls = c.response_class(c.API_INIT_PRODUCER_ID)
        if req.body.transactional_id is not None:
            return cls(
                throttle_time_ms=0, error_code=c.INVALID_REQUEST, producer_id=-1, producer_epoch=-1
            )
        b = req.body
        if req.api_version >= 3 and b.producer_id >= 0:
            # A producer that knows its id asks for the next epoch (KIP-360).
            if b.producer_epoch >= 32766:
                return cls(
                    throttle_time_ms=0,
                    error_code=c.NONE,
                    producer_id=next(self._producer_ids),
                    producer_epoch=0,
                )
            return cls(
                throttle_time_ms=0,
                error_code=c.NONE,
                producer_id=b.producer_id,
                producer_epoch=b.producer_epoch + 1,
            )
        return cls(
            throttle_time_ms=0,
            error_code=c.NONE,
            producer_id=next(self._producer_ids),
            producer_epoch=0,
        )

    def _produce(self, req: c.Request, host: str) -> Deferred[Any] | Any:
        d = Deferred.fromCoroutine(self._produce_async(req))
        if req.body.acks == 0:
            # No response, but the request stays in flight until its write is done, so that
            # the connection's bound on requests in flight holds for these too.
            def done(result: Any) -> object:
                if isinstance(result, Failure):
                    log.warning("produce failed", extra=kv(error=str(result.value)))
                return NO_RESPONSE

            d.addBoth(done)
        return d

    async def _produce_async(self, req: c.Request) -> c.ProduceResponse:
        body = req.body
        wanted = [(t.name, p) for t in body.topic_data for p in t.partition_data]
        if len(wanted) == 1:  # the common case: no DeferredList
            name, p = wanted[0]
            try:
                results = [await self._produce_partition(req, name, p)]
            except Exception as e:
                results = [_produce_error(name, e)]
        else:
            answers = await DeferredList(
                [Deferred.fromCoroutine(self._produce_partition(req, n, p)) for n, p in wanted],
                consumeErrors=True,
            )
            results = []
            for (ok, value), (name, _) in zip(answers, wanted, strict=True):
                if not ok:
                    value = _produce_error(name, value.value)
                results.append(value)
        topics: list[tuple[str, list[c.ProducedPartition]]] = []
        answered = iter(results)
        for t in body.topic_data:
            rows = []
            for p in t.partition_data:
                error, base, start = next(answered)
                rows.append(c.ProducedPartition(p.index, error, base, start))
            topics.append((t.name, rows))
        return c.ProduceResponse(topics)

    async def _produce_partition(self, req: c.Request, name: str, p: Any) -> tuple[int, int, int]:
        key = (name, p.index)
        ticket = self._append_order.enter(key)
        try:
            return await self._produce_in_turn(req, name, p, key, ticket)
        finally:
            self._append_order.leave(key, ticket)

    async def _produce_in_turn(
        self, req: c.Request, name: str, p: Any, key: tuple[str, int], ticket: Deferred[None]
    ) -> tuple[int, int, int]:
        if req.api_version < 3:
            return c.UNSUPPORTED_FOR_MESSAGE_FORMAT, -1, -1
        if req.body.acks not in (-1, 0, 1):
            return c.INVALID_REQUIRED_ACKS, -1, -1
        data = p.records or b""
        try:
            batches = rec.split_batches(data)
        except rec.RecordError:
            return c.CORRUPT_MESSAGE, -1, -1
        if not batches:
            return c.INVALID_RECORD, -1, -1
        # Every batch is validated record by record as Kafka's broker does (CRC: CORRUPT_MESSAGE;
        # malformed records or offset deltas: INVALID_RECORD) without building records; only a
        # batch converted to the Pulsar format is then decoded.
        verbatim = self.settings.entry_format == FORMAT_TAG
        limit = max(self.settings.max_message_size, 1 << 20)
        decoded: list[list[rec.Record]] = []
        for batch in batches:
            if len(batch.raw) > self.settings.max_message_size:
                return c.MESSAGE_TOO_LARGE, -1, -1
            if not batch.crc_ok():
                return c.CORRUPT_MESSAGE, -1, -1
            if batch.transactional or batch.control:
                return c.INVALID_RECORD, -1, -1
            if batch.count < 1 or batch.last_offset_delta != batch.count - 1:
                return c.INVALID_RECORD, -1, -1
            try:
                body = rec.check_batch(batch, limit=limit)
                decoded.append([] if verbatim else rec.decode_batch(batch, limit=limit, body=body))
            except rec.InvalidRecordError:
                return c.INVALID_RECORD, -1, -1
            except rec.RecordError:  # a body that does not decompress
                return c.CORRUPT_MESSAGE, -1, -1
        try:
            topic = await self._partition_topic(name, p.index, True)
        except (InvalidTopicNameError, NotAllowedError):
            return c.INVALID_TOPIC_EXCEPTION, -1, -1
        except ServiceNotReadyError:
            if self.cluster is None:
                raise
            return c.NOT_LEADER_OR_FOLLOWER, -1, -1
        if topic is None:
            return c.UNKNOWN_TOPIC_OR_PARTITION, -1, -1
        if batches[0].producer_id >= 0:
            rebuilding = self._producers_ready(topic)
            if rebuilding is not None:
                await rebuilding
        await ticket
        first_base = -1
        last = len(batches) - 1
        for i, (batch, found) in enumerate(zip(batches, decoded, strict=True)):
            appending = Deferred.fromCoroutine(self._append(topic, batch, found))
            if i == last:  # checked and under way: the next produce may be checked
                self._append_order.leave(key, ticket)
            try:
                error, base = await appending
            except Exception:
                if self.cluster is None or self.cluster.owns(topic.name):
                    raise
                # The partition moved to another broker while this one wrote.
                return c.NOT_LEADER_OR_FOLLOWER, -1, -1
            if error != c.NONE:
                return error, -1, -1
            if first_base < 0:
                first_base = base
        return c.NONE, first_base, topic.first_index

    def _entry(self, batch: rec.Batch, records: list[rec.Record]) -> bytes:
        """The stored entry of a batch: verbatim (tagged) or converted to the Pulsar format."""
        now = int(self.clock.seconds() * 1000)
        name = producer_name(batch.producer_id, batch.producer_epoch, batch.base_sequence)
        sequence = max(batch.base_sequence, 0)
        if self.settings.entry_format == FORMAT_TAG:
            return messages.encode_native_entry(
                FORMAT_TAG,
                batch.raw,
                num_messages=batch.count,
                producer_name=name,
                sequence_id=sequence,
                publish_time_ms=now,
            )
        converted = [
            Message(
                r.value if r.value is not None else b"",
                key=r.key,
                properties=[(k, (v or b"").decode("utf-8", "replace")) for k, v in r.headers],
                event_time_ms=max(r.timestamp_ms, 0),
                null_value=r.value is None,
            )
            for r in records
        ]
        return messages.encode_entry(
            converted,
            producer_name=name,
            sequence_id=sequence,
            publish_time_ms=now,
            compression=_PULSAR_COMPRESSION.get(batch.compression, "none"),
        )

    def _producers_ready(self, topic: Any) -> Deferred[None] | None:
        """None when ``topic``'s producer states are rebuilt from its log; otherwise a Deferred
        that fires (never fails) once they are. Waiters resume in the order they asked."""
        try:
            pending = self._rebuilt[topic]
        except KeyError:
            pending = Deferred.fromCoroutine(self._rebuild_producers(topic))
            if pending.called:  # nothing to read (an empty log) answers at once
                self._rebuilt[topic] = None
                return None
            self._rebuilt[topic] = pending
        if pending is None:
            return None
        waiter: Deferred[None] = Deferred()

        def ready(result: Any) -> Any:
            waiter.callback(None)
            return result

        pending.addBoth(ready)
        return waiter

    async def _rebuild_producers(self, topic: Any) -> None:
        found: dict[int, tuple[int, int, int, int]] = {}
        try:
            found = await self._tail_producer_batches(topic)
        except Exception as e:
            log.warning(
                "could not rebuild Kafka producer states",
                extra=kv(topic=topic.name, error=str(e)),
            )
        built: dict[int, ProducerState] = {}
        for index, (pid, epoch, base, last) in sorted(found.items()):
            state = built.get(pid)
            if state is not None and epoch < state.epoch:
                continue  # a fenced producer's batch
            if state is None or epoch > state.epoch:
                state = built[pid] = ProducerState(epoch, last, topic=topic)
            state.last_sequence = last
            state.recent.append((base, last, index))
        for pid, state in built.items():
            key = (topic.name, pid)
            self.producers.pop(key, None)
            self.producers[key] = state
            if len(self.producers) > _MAX_PRODUCER_STATES:
                del self.producers[next(iter(self.producers))]
        if built:
            log.info(
                "rebuilt Kafka producer states from the log",
                extra=kv(topic=topic.name, producers=len(built), batches=len(found)),
            )
        self._rebuilt[topic] = None

    async def _tail_producer_batches(self, topic: Any) -> dict[int, tuple[int, int, int, int]]:
        """Entry index -> (producer id, epoch, base, last sequence) of the idempotent batches in
        the tail of ``topic``'s log. Windows are read newest first, each forward from its start;
        a window cut short (by a bound, or by the log's head trimmed or a read failing while it
        is read) is dropped whole with every older one, so what is returned has no hole: a
        hole could leave a producer's state behind what it was acknowledged, and its next batch
        refused as a gap."""
        found: dict[int, tuple[int, int, int, int]] = {}
        started = self.clock.seconds()
        upper = topic.next_index
        span = _REBUILD_FIRST_SPAN
        entries = size = 0
        while upper > topic.first_index and entries < _REBUILD_MAX_ENTRIES:
            # Each entry holds at least one message: the window cannot outgrow the entry budget.
            lower = max(topic.first_index, upper - min(span, _REBUILD_MAX_ENTRIES - entries))
            window: dict[int, tuple[int, int, int, int]] = {}
            index = lower
            while index < upper:
                if (
                    size >= _REBUILD_MAX_BYTES
                    or self.clock.seconds() - started > _REBUILD_MAX_SECONDS
                ):
                    break
                # Entries hold a message or more: never ask for more than the window can hold.
                try:
                    read = await topic.read_from_index(index, min(_READ_ENTRIES, upper - index))
                except Exception as e:
                    # The log's head trimmed meanwhile (a subscription moved on), say.
                    log.info(
                        "Kafka producer states: the log tail read stopped",
                        extra=kv(topic=topic.name, index=index, error=str(e)),
                    )
                    break
                if not read:  # the head trimmed past ``index`` meanwhile
                    break
                for entry in read:
                    if entry.index >= upper:
                        index = upper
                        break
                    entries += 1
                    size += len(entry.data)
                    index = entry.last_index + 1
                    summary = stored_producer_batch(entry.data)
                    if summary is not None:
                        window[entry.index] = summary
            if index < upper:  # cut short: its newest entries were not read
                break
            found.update(window)
            upper = lower
            span *= 4
        return found

    async def _append(
        self, topic: Any, batch: rec.Batch, records: list[rec.Record]
    ) -> tuple[int, int]:
        key = (topic.name, batch.producer_id)
        state: ProducerState | None = None
        if batch.producer_id >= 0 and batch.base_sequence >= 0:
            state = self.producers.get(key)
            if state is not None and self.cluster is not None and state.topic is not topic:
                state = None  # another broker served the partition meanwhile
            last_seq = batch.base_sequence + batch.count - 1
            if state is not None and batch.producer_epoch < state.epoch:
                return c.INVALID_PRODUCER_EPOCH, -1
            if state is not None and batch.producer_epoch == state.epoch:
                for base_seq, last, offset in state.recent:
                    if base_seq == batch.base_sequence and last == last_seq:
                        return c.NONE, offset  # a retried batch: stored once already
                if batch.base_sequence != (state.last_sequence + 1) & 0x7FFFFFFF:
                    if batch.base_sequence <= state.last_sequence:
                        return c.DUPLICATE_SEQUENCE_NUMBER, -1
                    return c.OUT_OF_ORDER_SEQUENCE_NUMBER, -1
            if state is None or batch.producer_epoch > state.epoch:
                state = ProducerState(batch.producer_epoch, last_seq, topic=topic)
                self.producers.pop(key, None)
                self.producers[key] = state
                if len(self.producers) > _MAX_PRODUCER_STATES:  # forget the oldest producer
                    del self.producers[next(iter(self.producers))]
            state.last_sequence = last_seq
        entry_data = self._entry(batch, records)
        try:
            entry = await topic.publish(entry_data, batch.count)
        except Exception:
            if state is not None:
                self.producers.pop(key, None)
            raise
        if state is not None:
            state.recent.append(
                (batch.base_sequence, batch.base_sequence + batch.count - 1, entry.index)
            )
        return c.NONE, entry.index

    # -- fetch ----------------------------------------------------------------------------

    def _fetch(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._fetch_async(req))

    async def _fetch_async(self, req: c.Request) -> Any:
        body = req.body
        deadline = self.clock.seconds() + max(body.max_wait_ms, 0) / 1000
        while True:
            reads, topics = await self._fetch_once(body)
            total = sum(r.size for r in reads)
            now = self.clock.seconds()
            if (
                total >= max(body.min_bytes, 1)
                or now >= deadline
                or self._closed
                or any(r.error != c.NONE for r in reads)
            ):
                break
            await self._wait_for_append(topics, deadline - now)
        return self._fetch_response(reads)

    def _wait_for_append(self, topics: list[Any], timeout_s: float) -> Deferred[None]:
        d: Deferred[None] = Deferred()

        def wake(_: Any = None) -> None:
            if not d.called:
                d.callback(None)

        timer = self.clock.callLater(timeout_s, wake)
        for t in topics:
            t.append_listeners.append(wake)

        def cleanup(result: Any) -> Any:
            if timer.active():
                timer.cancel()
            for t in topics:
                with contextlib.suppress(ValueError):
                    t.append_listeners.remove(wake)
            return result

        d.addBoth(cleanup)
        return d

    async def _fetch_once(self, body: Any) -> tuple[list[_PartitionRead], list[Any]]:
        budget = body.max_bytes if body.max_bytes and body.max_bytes > 0 else 50 * 1024 * 1024
        reads: list[_PartitionRead] = []
        topics: list[Any] = []
        turns = _Turns(self.clock)
        for t in body.topics:
            name = self.topic_name(t.topic_id, t.topic)
            for p in t.partitions:
                await turns.step()
                out = c.FetchedPartition(p.partition)
                r = _PartitionRead(name or "", t.topic_id or _NO_TOPIC_ID, out)
                reads.append(r)
                if name is None:
                    out.error = c.UNKNOWN_TOPIC_ID
                    continue
                try:
                    topic = await self._partition_topic(name, p.partition, False)
                except (InvalidTopicNameError, NotAllowedError):
                    topic = None
                except ServiceNotReadyError:
                    if self.cluster is None:
                        raise
                    out.error = c.NOT_LEADER_OR_FOLLOWER
                    continue
                if topic is None:
                    out.error = c.UNKNOWN_TOPIC_OR_PARTITION
                    continue
                topics.append(topic)
                out.high_watermark = topic.next_index
                out.log_start = topic.first_index
                offset = p.fetch_offset
                if offset < out.log_start or offset > out.high_watermark:
                    out.error = c.OFFSET_OUT_OF_RANGE
                    continue
                limit = (
                    min(p.partition_max_bytes, budget)
                    if reads[0] is not r
                    else (p.partition_max_bytes)
                )
                await self._read_partition(topic, offset, max(limit, 0), out)
                budget -= out.size
        return reads, topics

    async def _read_partition(
        self, topic: Any, offset: int, limit: int, r: c.FetchedPartition
    ) -> None:
        records = r.records
        while offset < topic.next_index and (r.size < limit or not records):
            entries = await topic.read_from_index(offset, _READ_ENTRIES)
            if not entries:
                return
            for entry in entries:
                if entry.last_index < offset:
                    continue
                try:
                    pieces, size = self._as_batch(topic.name, entry)
                except (MessageFormatError, rec.RecordError) as e:
                    log.warning(
                        "skipping an entry Kafka cannot read",
                        extra=kv(topic=topic.name, index=entry.index, error=str(e)),
                    )
                    size = 0
                offset = entry.last_index + 1
                if not size:
                    continue
                if records and r.size + size > limit:
                    return
                records.extend(pieces)
                r.size += size
                if r.size >= limit:
                    return

    def _as_batch(self, topic: str, entry: Any) -> tuple[tuple[bytes | memoryview, ...], int]:
        """An entry as one record batch at its index, in pieces for the response, and its size
        (0: nothing to send). A verbatim batch is its stored bytes with only the base offset
        written anew (no copy, no per-record work); other entries are converted once and
        cached."""
        md, payload = messages.split_entry(entry.data)
        if messages.metadata_format(md) == FORMAT_TAG:
            if len(payload) < rec.HEADER_SIZE:
                raise rec.RecordError("stored Kafka batch is truncated")
            return (_I64.pack(entry.index), memoryview(payload)[8:]), len(payload)
        key = (topic, entry.position, entry.index, len(entry.data))
        found = self._converted.get(key)
        if found is not None:
            self._converted.move_to_end(key)
            return (found,), len(found)
        batch = entry_as_batch(entry.index, entry.data)
        if not batch:
            return (), 0
        self._converted[key] = batch
        self._converted_bytes += len(batch)
        while self._converted_bytes > self.settings.conversion_cache_bytes and self._converted:
            _, dropped = self._converted.popitem(last=False)
            self._converted_bytes -= len(dropped)
        return (batch,), len(batch)

    def _fetch_response(self, reads: list[_PartitionRead]) -> c.FetchResponse:
        by_topic: dict[tuple[str, uuid.UUID], list[c.FetchedPartition]] = {}
        for r in reads:
            by_topic.setdefault((r.topic, r.topic_id), []).append(r.out)
        return c.FetchResponse(
            [(name, tid.bytes, parts) for (name, tid), parts in by_topic.items()]
        )

    def _list_offsets(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._list_offsets_async(req))

    async def _list_offsets_async(self, req: c.Request) -> Any:
        cls = c.response_class(c.API_LIST_OFFSETS)
        out = []
        turns = _Turns(self.clock)
        for t in req.body.topics:
            parts = []
            for p in t.partitions:
                await turns.step()
                error, offset, ts = c.NONE, -1, -1
                try:
                    topic = await self._partition_topic(t.name, p.partition_index, False)
                except (InvalidTopicNameError, NotAllowedError):
                    topic = None
                except ServiceNotReadyError:
                    if self.cluster is None:
                        raise
                    topic, error = None, c.NOT_LEADER_OR_FOLLOWER
                if topic is None:
                    error = error or c.UNKNOWN_TOPIC_OR_PARTITION
                elif p.timestamp == _EARLIEST:
                    offset = topic.first_index
                elif p.timestamp in (_LATEST, _MAX_TIMESTAMP):
                    offset = topic.next_index
                    if p.timestamp == _MAX_TIMESTAMP and offset > topic.first_index:
                        offset -= 1
                else:
                    found = await topic.index_of_time(p.timestamp)
                    if found is not None:
                        offset, ts = found, p.timestamp
                parts.append(
                    cls.ListOffsetsTopicResponse.ListOffsetsPartitionResponse(
                        partition_index=p.partition_index,
                        error_code=error,
                        timestamp=ts,
                        offset=offset,
                        leader_epoch=0,
                    )
                )
            out.append(cls.ListOffsetsTopicResponse(name=t.name, partitions=parts))
        return cls(throttle_time_ms=0, topics=out)

    # -- groups ---------------------------------------------------------------------------

    def _find_coordinator(self, req: c.Request, host: str) -> Any:
        if self.cluster is not None:
            return Deferred.fromCoroutine(self._find_coordinator_async(req))
        local = KafkaNode(self.settings.node_id, self.settings.host(), self.settings.port(), "")
        if req.api_version >= 4:  # a batch of keys
            return _coordinators(req, [(key, local) for key in req.body.coordinator_keys or []])
        return _coordinators(req, [("", local)])

    async def _find_coordinator_async(self, req: c.Request) -> Any:
        assert self.cluster is not None
        keys = list(req.body.coordinator_keys or []) if req.api_version >= 4 else [req.body.key]
        found = [(key, await self.cluster.coordinator(key)) for key in keys]
        return _coordinators(req, found)

    def _join_group(self, req: c.Request, host: str) -> Deferred[Any]:
        cls = c.response_class(c.API_JOIN_GROUP)
        b = req.body
        rebalance_timeout = b.rebalance_timeout_ms if req.api_version >= 1 else b.session_timeout_ms
        d = self.groups.join(
            b.group_id,
            b.member_id,
            client_id=req.client_id or "",
            client_host=host,
            session_timeout_ms=b.session_timeout_ms,
            rebalance_timeout_ms=rebalance_timeout,
            protocol_type=b.protocol_type,
            protocols=[(p.name, bytes(p.metadata)) for p in b.protocols],
            require_known_member_id=req.api_version >= 4,
        )

        def answer(j: Any) -> Any:
            return cls(
                throttle_time_ms=0,
                error_code=j.error,
                generation_id=j.generation,
                protocol_type=b.protocol_type if j.error == c.NONE else None,
                protocol_name=j.protocol or ("" if req.api_version < 7 else None),
                leader=j.leader,
                member_id=j.member_id,
                members=[
                    cls.JoinGroupResponseMember(member_id=mid, metadata=md) for mid, md in j.members
                ],
            )

        return d.addCallback(answer)

    def _sync_group(self, req: c.Request, host: str) -> Deferred[Any]:
        cls = c.response_class(c.API_SYNC_GROUP)
        b = req.body
        d = self.groups.sync(
            b.group_id,
            b.generation_id,
            b.member_id,
            {a.member_id: bytes(a.assignment) for a in b.assignments or []},
        )

        def answer(r: tuple[int, bytes]) -> Any:
            g = self.groups.describe(b.group_id)
            return cls(
                throttle_time_ms=0,
                error_code=r[0],
                protocol_type=g.protocol_type if g is not None else None,
                protocol_name=g.protocol if g is not None else None,
                assignment=r[1],
            )

        return d.addCallback(answer)

    def _heartbeat(self, req: c.Request, host: str) -> Any:
        cls = c.response_class(c.API_HEARTBEAT)
        b = req.body
        return cls(
            throttle_time_ms=0,
            error_code=self.groups.heartbeat(b.group_id, b.generation_id, b.member_id),
        )

    def _leave_group(self, req: c.Request, host: str) -> Any:
        cls = c.response_class(c.API_LEAVE_GROUP)
        b = req.body
        if req.api_version >= 3:  # a batch of members
            members = [
                cls.MemberResponse(
                    member_id=m.member_id,
                    group_instance_id=m.group_instance_id,
                    error_code=self.groups.leave(b.group_id, m.member_id),
                )
                for m in b.members or []
            ]
            return cls(throttle_time_ms=0, error_code=c.NONE, members=members)
        return cls(throttle_time_ms=0, error_code=self.groups.leave(b.group_id, b.member_id))

    def _offset_commit(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._offset_commit_async(req))

    async def _offset_commit_async(self, req: c.Request) -> Any:
        """Commit the offsets of partitions that exist; the others get
        UNKNOWN_TOPIC_OR_PARTITION, as on Kafka (nothing is stored for them)."""
        cls = c.response_class(c.API_OFFSET_COMMIT)
        b = req.body
        offsets, unknown = [], set()
        for t in b.topics:
            try:
                n = self._partitions.get(t.name)
                n = (n or 1) if n is not None else await self.partition_count(t.name, False)
            except InvalidTopicNameError:
                n = 0
            for p in t.partitions:
                if 0 <= p.partition_index < n:
                    offsets.append(
                        (t.name, p.partition_index, p.committed_offset, p.committed_metadata or "")
                    )
                else:
                    unknown.add((t.name, p.partition_index))
        error = c.NONE
        if offsets or not unknown:
            error = await self.groups.commit(
                b.group_id, b.generation_id_or_member_epoch, b.member_id, offsets
            )
        return _offset_commit_response(cls, b, error, unknown)

    def _offset_fetch(self, req: c.Request, host: str) -> Deferred[Any]:
        cls = c.response_class(c.API_OFFSET_FETCH)
        b = req.body
        if req.api_version >= 8:  # a batch of groups
            return Deferred.fromCoroutine(self._offset_fetch_groups(cls, b))
        part_cls = cls.OffsetFetchResponseTopic.OffsetFetchResponsePartition

        def answer(found: dict[tuple[str, int], tuple[int, str]]) -> Any:
            topics = [
                cls.OffsetFetchResponseTopic(
                    name=name,
                    partitions=[
                        part_cls(
                            partition_index=i,
                            committed_offset=offset,
                            committed_leader_epoch=-1,
                            metadata=md,
                            error_code=c.NONE,
                        )
                        for i, offset, md in parts
                    ],
                )
                for name, parts in _wanted_offsets(found, b.topics)
            ]
            return cls(throttle_time_ms=0, topics=topics, error_code=c.NONE)

        return self.groups.fetch_offsets(b.group_id).addCallback(answer)

    async def _offset_fetch_groups(self, cls: Any, b: Any) -> Any:
        group_cls = cls.OffsetFetchResponseGroup
        topic_cls = group_cls.OffsetFetchResponseTopics
        part_cls = topic_cls.OffsetFetchResponsePartitions
        groups = []
        turns = _Turns(self.clock)
        for g in b.groups or []:
            await turns.step()
            found = await self.groups.fetch_offsets(g.group_id)
            requested = None
            if g.topics is not None:
                requested = [
                    _Wanted(self.topic_name(t.topic_id, t.name) or "", t.partition_indexes)
                    for t in g.topics
                ]
            topics = [
                topic_cls(
                    name=name,
                    topic_id=self.topic_id(name) if name else _NO_TOPIC_ID,
                    partitions=[
                        part_cls(
                            partition_index=i,
                            committed_offset=offset,
                            committed_leader_epoch=-1,
                            metadata=md,
                            error_code=c.NONE,
                        )
                        for i, offset, md in parts
                    ],
                )
                for name, parts in _wanted_offsets(found, requested)
            ]
            groups.append(group_cls(group_id=g.group_id, topics=topics, error_code=c.NONE))
        return cls(throttle_time_ms=0, groups=groups)

    def _committed(self, group: str, offsets: list[tuple[str, int, int]]) -> None:
        """Mirror a durable commit of (topic, partition, offset) on Pulsar subscriptions named
        after the group, so the group's backlog shows in topic stats (best effort: a failure is
        only logged). The partitions are mirrored concurrently, started a turn at a time."""

        async def mirror(topic: str, partition: int, offset: int) -> None:
            # Only the partition's owner holds its subscriptions.
            if self.cluster is not None and (
                topic not in self._partitions
                or not self.cluster.owns(self._partition_name(topic, partition))
            ):
                return
            found = await self._partition_topic(topic, partition, False)
            if found is not None and offset >= 0:
                await found.mark_subscription_at_index(group, offset)

        def failed(f: Failure, topic: str) -> None:
            log.warning(
                "mirroring a commit on a subscription failed",
                extra=kv(group=group, topic=topic, error=str(f.value)),
            )

        async def start_all() -> None:
            turns = _Turns(self.clock)
            for topic, partition, offset in offsets:
                await turns.step()
                Deferred.fromCoroutine(mirror(topic, partition, offset)).addErrback(failed, topic)

        Deferred.fromCoroutine(start_all())

    def _list_groups(self, req: c.Request, host: str) -> Deferred[Any]:
        cls = c.response_class(c.API_LIST_GROUPS)
        states = {x.lower() for x in getattr(req.body, "states_filter", None) or []}
        return self.groups.list_all().addCallback(
            lambda groups: cls(
                throttle_time_ms=0,
                error_code=c.NONE,
                groups=[
                    cls.ListedGroup(
                        group_id=g.group_id,
                        protocol_type=g.protocol_type or "consumer",
                        group_state=g.state,
                        group_type="classic",
                    )
                    for g in groups
                    if (not states or g.state.lower() in states) and self._coordinated_here(g)
                ],
            )
        )

    def _coordinated_here(self, g: Any) -> bool:
        if self.cluster is None:
            return True
        return self.cluster.owns(self.cluster.coordinator_topic(g.group_id))

    def _describe_groups(self, req: c.Request, host: str) -> Any:
        cls = c.response_class(c.API_DESCRIBE_GROUPS)
        out = []
        for gid in req.body.groups:
            g = self.groups.describe(gid)
            if g is None:
                out.append(
                    cls.DescribedGroup(
                        error_code=c.NONE,
                        group_id=gid,
                        group_state="Dead",
                        protocol_type="",
                        protocol_data="",
                        members=[],
                    )
                )
                continue
            members = [
                cls.DescribedGroup.DescribedGroupMember(
                    member_id=m.member_id,
                    client_id=m.client_id,
                    client_host=m.client_host,
                    member_metadata=dict(m.protocols).get(g.protocol or "", b""),
                    member_assignment=m.assignment,
                )
                for m in g.members.values()
            ]
            out.append(
                cls.DescribedGroup(
                    error_code=c.NONE,
                    group_id=gid,
                    group_state=g.state,
                    protocol_type=g.protocol_type or "",
                    protocol_data=g.protocol or "",
                    members=members,
                )
            )
        return cls(throttle_time_ms=0, groups=out)

    def _delete_groups(self, req: c.Request, host: str) -> Deferred[Any]:
        return Deferred.fromCoroutine(self._delete_groups_async(req))

    async def _delete_groups_async(self, req: c.Request) -> Any:
        """The groups are deleted concurrently, started a turn at a time."""
        cls = c.response_class(c.API_DELETE_GROUPS)
        names = list(req.body.groups_names)
        ds = []
        turns = _Turns(self.clock)
        for g in names:
            await turns.step()
            ds.append(self.groups.delete(g))
        results = await DeferredList(ds, consumeErrors=True)
        return cls(
            throttle_time_ms=0,
            results=[
                cls.DeletableGroupResult(group_id=g, error_code=v if ok else c.UNKNOWN_SERVER_ERROR)
                for g, (ok, v) in zip(names, results, strict=True)
            ],
        )


@dataclass
class _Wanted:
    name: str
    partition_indexes: list[int]


def _wanted_offsets(
    found: dict[tuple[str, int], tuple[int, str]], requested: Any
) -> list[tuple[str, list[tuple[int, int, str]]]]:
    """(topic, [(partition, offset, metadata)]) for the requested topics, or every stored one;
    each partition once."""
    wanted: dict[str, list[int]] = {}
    if requested is None:
        for topic, partition in sorted(found):
            wanted.setdefault(topic, []).append(partition)
    else:
        for t in requested:
            wanted.setdefault(t.name, []).extend(t.partition_indexes)
    return [
        (name, [(i, *found.get((name, i), (-1, ""))) for i in dict.fromkeys(parts)])
        for name, parts in wanted.items()
    ]


async def _resolved(value: Any) -> Any:
    """A handler's answer, waited for when it is a Deferred."""
    if isinstance(value, Deferred):
        return await value
    return value


def _coordinators(req: c.Request, found: list[tuple[str, KafkaNode | None]]) -> Any:
    """A FindCoordinator response naming each key's coordinator (None: none now)."""
    cls = c.response_class(c.API_FIND_COORDINATOR)

    def fields(node: KafkaNode | None) -> dict[str, Any]:
        if node is None:
            return {
                "error_code": c.COORDINATOR_NOT_AVAILABLE,
                "error_message": "no coordinator is available now",
                "node_id": -1,
                "host": "",
                "port": -1,
            }
        return {
            "error_code": c.NONE,
            "error_message": None,
            "node_id": node.node_id,
            "host": node.host,
            "port": node.port,
        }

    if req.api_version >= 4:  # a batch of keys
        return cls(
            throttle_time_ms=0,
            coordinators=[cls.Coordinator(key=key, **fields(node)) for key, node in found],
        )
    return cls(throttle_time_ms=0, **fields(found[0][1]))


def _not_coordinator(req: c.Request) -> Any:
    """The NOT_COORDINATOR answer to a request about one group."""
    cls = c.response_class(req.api_key)
    b = req.body
    e = c.NOT_COORDINATOR
    if req.api_key == c.API_JOIN_GROUP:
        return cls(
            throttle_time_ms=0,
            error_code=e,
            generation_id=-1,
            protocol_type=None,
            protocol_name="" if req.api_version < 7 else None,
            leader="",
            member_id=b.member_id,
            members=[],
        )
    if req.api_key == c.API_SYNC_GROUP:
        return cls(
            throttle_time_ms=0, error_code=e, protocol_type=None, protocol_name=None, assignment=b""
        )
    if req.api_key == c.API_HEARTBEAT:
        return cls(throttle_time_ms=0, error_code=e)
    if req.api_key == c.API_LEAVE_GROUP:
        return cls(throttle_time_ms=0, error_code=e, members=[])
    if req.api_key == c.API_OFFSET_COMMIT:
        return _offset_commit_response(cls, b, e)
    if req.api_key == c.API_OFFSET_FETCH:
        part_cls = cls.OffsetFetchResponseTopic.OffsetFetchResponsePartition
        topics = [
            cls.OffsetFetchResponseTopic(
                name=t.name,
                partitions=[
                    part_cls(
                        partition_index=i,
                        committed_offset=-1,
                        committed_leader_epoch=-1,
                        metadata="",
                        error_code=e,
                    )
                    for i in t.partition_indexes
                ],
            )
            for t in b.topics or []
        ]
        return cls(throttle_time_ms=0, topics=topics, error_code=e)
    raise ValueError(f"API {req.api_key} is not about one group")


def _offset_commit_response(
    cls: Any, b: Any, error: int, unknown: Container[tuple[str, int]] = ()
) -> Any:
    return cls(
        throttle_time_ms=0,
        topics=[
            cls.OffsetCommitResponseTopic(
                name=t.name,
                partitions=[
                    cls.OffsetCommitResponseTopic.OffsetCommitResponsePartition(
                        partition_index=p.partition_index,
                        error_code=c.UNKNOWN_TOPIC_OR_PARTITION
                        if (t.name, p.partition_index) in unknown
                        else error,
                    )
                    for p in t.partitions
                ],
            )
            for t in b.topics
        ],
    )


_DISPATCH: dict[int, Callable[[KafkaApis, c.Request, str], Any]] = {
    c.API_PRODUCE: KafkaApis._produce,
    c.API_FETCH: KafkaApis._fetch,
    c.API_LIST_OFFSETS: KafkaApis._list_offsets,
    c.API_METADATA: KafkaApis._metadata,
    c.API_OFFSET_COMMIT: KafkaApis._offset_commit,
    c.API_OFFSET_FETCH: KafkaApis._offset_fetch,
    c.API_FIND_COORDINATOR: KafkaApis._find_coordinator,
    c.API_JOIN_GROUP: KafkaApis._join_group,
    c.API_HEARTBEAT: KafkaApis._heartbeat,
    c.API_LEAVE_GROUP: KafkaApis._leave_group,
    c.API_SYNC_GROUP: KafkaApis._sync_group,
    c.API_DESCRIBE_GROUPS: KafkaApis._describe_groups,
    c.API_LIST_GROUPS: KafkaApis._list_groups,
    c.API_API_VERSIONS: KafkaApis._api_versions,
    c.API_CREATE_TOPICS: KafkaApis._create_topics,
    c.API_DELETE_TOPICS: KafkaApis._delete_topics,
    c.API_INIT_PRODUCER_ID: KafkaApis._init_producer_id,
    c.API_DESCRIBE_CONFIGS: KafkaApis._describe_configs,
    c.API_CREATE_PARTITIONS: KafkaApis._create_partitions,
    c.API_DELETE_GROUPS: KafkaApis._delete_groups,
    c.API_DESCRIBE_CLUSTER: KafkaApis._describe_cluster,
}

#: The group APIs: served only by the group's coordinator in a cluster.
_GROUP_APIS = frozenset(
    {
        c.API_OFFSET_COMMIT,
        c.API_OFFSET_FETCH,
        c.API_JOIN_GROUP,
        c.API_HEARTBEAT,
        c.API_LEAVE_GROUP,
        c.API_SYNC_GROUP,
        c.API_DESCRIBE_GROUPS,
        c.API_DELETE_GROUPS,
    }
)
