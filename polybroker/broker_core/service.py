"""The Broker API: what protocol handlers call. One API, every protocol.

``BrokerService`` owns the loaded topics of this broker. Topics are loaded on first use (and
created when allowed: ``allowAutoTopicCreation``), unloaded on request (the next use opens them
again), and closed with the service.

Names: ``persistent://tenant/ns/topic``, ``non-persistent://...``, ``tenant/ns/topic`` or just
``topic`` (in ``public/default``). A persistent topic's managed ledger is named
``tenant/ns/persistent/<url-encoded topic>``, as Pulsar names it.

Partitioned topics are metadata: ``{"partitions": N}`` at
``/admin/partitioned-topics/<tenant>/<ns>/<domain>/<encoded topic>``; the partitions
``<topic>-partition-<i>`` are ordinary topics.

Hot path: handlers that publish a lot hold the ``Topic`` (or a ``Producer``) and call it; the
name-based ``publish`` here is one dictionary lookup more when the topic is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater

from polybroker.broker_core.consumer import (
    Consumer,
    DeliverAt,
    EntryInspector,
    KeyOf,
    KeySharedMeta,
    LastMessageId,
    NullInspector,
    ServerConsumer,
    SubType,
)
from polybroker.broker_core.dispatcher import DispatchSettings
from polybroker.broker_core.errors import (
    BrokerError,
    InvalidTopicNameError,
    NotAllowedError,
    ServiceNotReadyError,
    TopicAlreadyExistsError,
    TopicNotFoundError,
)
from polybroker.broker_core.forwarding import (
    FORWARD_RETRY_S,
    Forwarder,
    RemoteConsumer,
)
from polybroker.broker_core.ownership import NotOwnerError, Ownership
from polybroker.broker_core.publish_buffer import PublishBuffer
from polybroker.broker_core.publish_line import FIRST_BACKOFF_S, MAX_BACKOFF_S, PublishLine
from polybroker.broker_core.topic import (
    NonPersistentTopic,
    PersistentTopic,
    Producer,
    ProducerAccessMode,
    Topic,
    TopicLimits,
    TopicSettings,
)
from polybroker.config import Config
from polybroker.ledger.api import (
    Entry,
    InitialPosition,
    ManagedLedgerConfig,
    ManagedLedgerFactory,
    Position,
)
from polybroker.logs import kv
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError

log = logging.getLogger(__name__)

PARTITIONED_ROOT = "/admin/partitioned-topics"
PARTITION_SUFFIX = "-partition-"
_PARTITION_RE = re.compile(r"^(.+)-partition-(\d+)$")
_DOMAINS = ("persistent", "non-persistent")
HEALTH_TIMEOUT_S = 10.0  # each check of ``storage_problem``
# The broker settings of ``TopicLimits``' fields, in order.
LIMIT_KEYS = ("maxProducersPerTopic", "maxConsumersPerTopic", "maxConsumersPerSubscription")


@dataclass(frozen=True)
class TopicRef:
    """A parsed topic name (until a shared ``TopicName`` replaces it)."""

    domain: str
    tenant: str
    namespace: str
    local: str

    @classmethod
    def parse(cls, name: str) -> TopicRef:
        """Parse any accepted spelling; raise ``InvalidTopicNameError``."""
        if not isinstance(name, str) or not name:
            raise InvalidTopicNameError(f"invalid topic name {name!r}")
        domain = "persistent"
        rest = name
        if "://" in name:
            domain, _, rest = name.partition("://")
            if domain not in _DOMAINS:
                raise InvalidTopicNameError(f"invalid topic domain in {name!r}")
        elif "/" not in name:
            rest = f"public/default/{name}"
        parts = rest.split("/")
        if len(parts) != 3 or not all(parts):
            raise InvalidTopicNameError(
                f"invalid topic name {name!r}: expected <domain>://<tenant>/<namespace>/<topic>"
            )
        if any(p in (".", "..") for p in parts):
            raise InvalidTopicNameError(f"invalid topic name {name!r}: '.' and '..' are reserved")
        return cls(domain, parts[0], parts[1], parts[2])

    @property
    def full(self) -> str:
        return f"{self.domain}://{self.tenant}/{self.namespace}/{self.local}"

    @property
    def persistent(self) -> bool:
        return self.domain == "persistent"

    @property
    def partition_index(self) -> int:
        m = _PARTITION_RE.match(self.local)
        return int(m.group(2)) if m else -1

    @property
    def namespace_name(self) -> str:
        return f"{self.tenant}/{self.namespace}"

    @property
    def partitioned_parent(self) -> TopicRef | None:
        """The partitioned topic this partition belongs to (None: not a partition name)."""
        m = _PARTITION_RE.match(self.local)
        return TopicRef(self.domain, self.tenant, self.namespace, m.group(1)) if m else None

    def partition(self, index: int) -> TopicRef:
        return TopicRef(self.domain, self.tenant, self.namespace, f"{self.local}-partition-{index}")

    @property
    def managed_ledger_name(self) -> str:
        return f"{self.tenant}/{self.namespace}/{self.domain}/{quote(self.local, safe='')}"

    @property
    def partitioned_path(self) -> str:
        return (
            f"{PARTITIONED_ROOT}/{self.tenant}/{self.namespace}/{self.domain}/"
            f"{quote(self.local, safe='')}"
        )


class TopicListMode(enum.Enum):
    """Which topics ``topics_of_namespace`` lists (Pulsar's GET_TOPICS_OF_NAMESPACE modes)."""

    PERSISTENT = "PERSISTENT"
    NON_PERSISTENT = "NON_PERSISTENT"
    ALL = "ALL"


def _cfg(config: Config | None, key: str, default: Any) -> Any:
    if config is None:
        return default
    try:
        return config.get(key)
    except KeyError:
        return default


def _retention(value: Any, unit: float) -> float:
    """A retention setting in seconds or bytes; -1 (or any negative) stays -1: unlimited."""
    v = float(value)
    return -1.0 if v < 0 else v * unit


class BrokerService:
    """Topics of this broker and the operations handlers use on them."""

    def __init__(
        self,
        ledger_factory: ManagedLedgerFactory,
        reactor: IReactorTime,
        config: Config | None,
        metadata_store: MetadataStore,
        *,
        inspector: EntryInspector | None = None,
    ) -> None:
        self.ledger_factory = ledger_factory
        self.reactor = reactor
        self.config = config
        self.metadata_store = metadata_store
        self.inspector: EntryInspector = inspector or NullInspector()
        self.topics: dict[str, Topic] = {}
        self._loading: dict[str, list[Deferred[Topic]]] = {}
        self._refs: dict[str, TopicRef] = {}
        self._closed = False
        # Decides deduplication per topic (namespace policy); None falls back to the config.
        self.deduplication_policy: Callable[[str], bool | None] | None = None
        # The namespace's retention (seconds, bytes) of a topic; None (or None answered): the
        # broker-wide defaults.
        self.retention_policy: Callable[[str], tuple[float, int] | None] | None = None
        # The namespace's schema compatibility strategy of a topic; None (or None answered):
        # the broker's ``schemaCompatibilityStrategy``.
        self.schema_compatibility_policy: Callable[[str], str | None] | None = None
        # The namespace's (auto update allowed, validation enforced) schema flags of a topic,
        # each None when not set: the broker's ``isAllowAutoUpdateSchemaEnabled`` and
        # ``isSchemaValidationEnforced`` then.
        self.schema_flags_policy: Callable[[str], tuple[bool | None, bool | None]] | None = None
        # The namespace's auto-creation override of a topic (allowed, "partitioned" or
        # "non-partitioned", partitions); None (or None answered): the broker's settings.
        self.auto_create_policy: Callable[[str], tuple[bool, str, int] | None] | None = None
        # A topic's own or its namespace's (max producers, max consumers per topic, max
        # consumers per subscription), each None when not set: the broker's
        # ``maxProducersPerTopic``, ``maxConsumersPerTopic``, ``maxConsumersPerSubscription``.
        self.limits_policy: Callable[[str], tuple[int | None, int | None, int | None]] | None = None
        # Reads a topic's own policies (and follows them) before it opens; None: topics
        # have only their namespace's.
        self.follow_topic_policies: Callable[[str], Deferred[None]] | None = None
        self.unfollow_topic_policies: Callable[[str], None] | None = None
        # Asked before a producer is added to a topic: the error that refuses it (backlog
        # quotas), or None.
        self.producer_gate: Callable[[Topic], BrokerError | None] | None = None
        # Whether a namespace ("tenant/ns") exists; topics are created only in one that does.
        # None: every namespace exists.
        self.namespace_exists: Callable[[str], Deferred[bool] | bool] | None = None
        # Who serves which topic; None: this broker serves every topic (standalone).
        self.ownership: Ownership | None = None
        # Reaches a topic's owner for callers that opt in (``forward=True``); None: no
        # forwarding, a topic another broker owns fails with ``NotOwnerError``.
        self.forwarder: Forwarder | None = None
        self.forward_retry_s = FORWARD_RETRY_S
        # The owner each forwarded topic was last sent to, so the next call goes straight
        # there (no ownership round trip per message); dropped when a call there fails.
        self._forward_owners: dict[str, Any] = {}
        # Forwarded publishes not settled yet, by topic: kept in call order.
        self._lines: dict[str, PublishLine] = {}
        # Where the ledger factory names managed ledgers in the metadata store
        # (``<root>/<managed ledger name>``), for ``watch_namespace_topics``; None: not watched.
        self.ledger_names_root: str | None = None
        cluster = _cfg(config, "clusterName", "standalone")
        counter = itertools.count()
        instance = secrets.token_hex(3)
        self._producer_names = lambda: f"{cluster}-{instance}-{next(counter)}"
        self._auto_create = bool(_cfg(config, "allowAutoTopicCreation", True))
        self._auto_create_type = str(_cfg(config, "allowAutoTopicCreationType", "non-partitioned"))
        self._default_partitions = int(_cfg(config, "defaultNumPartitions", 1))
        self._dedup_default = bool(_cfg(config, "brokerDeduplicationEnabled", False))
        self._default_limits = tuple(int(_cfg(config, key, 0)) for key in LIMIT_KEYS)
        #: Publishes on their way to storage, every protocol's (``publish_buffer``).
        self.publish_buffer = PublishBuffer(
            max(0, int(_cfg(config, "maxMessagePublishBufferSizeInMB", 512))) * 1024 * 1024
        )
        self.dispatch_settings = DispatchSettings(
            max_read_batch=int(_cfg(config, "dispatcherMaxReadBatchSize", 100)),
            max_unacked_per_consumer=int(_cfg(config, "maxUnackedMessagesPerConsumer", 50_000)),
            delayed_delivery_enabled=bool(_cfg(config, "delayedDeliveryEnabled", True)),
        )
        self._dedup_interval = int(_cfg(config, "brokerDeduplicationEntriesInterval", 1000))
        mb = 1024 * 1024
        self.ledger_config = ManagedLedgerConfig(
            ensemble_size=int(_cfg(config, "managedLedgerDefaultEnsembleSize", 1)),
            write_quorum=int(_cfg(config, "managedLedgerDefaultWriteQuorum", 1)),
            ack_quorum=int(_cfg(config, "managedLedgerDefaultAckQuorum", 1)),
            max_entries_per_ledger=int(_cfg(config, "managedLedgerMaxEntriesPerLedger", 50_000)),
            max_size_per_ledger_bytes=int(_cfg(config, "managedLedgerMaxSizePerLedgerMbytes", 2048))
            * mb,
            max_ledger_rollover_time_s=60.0
            * float(_cfg(config, "managedLedgerMaxLedgerRolloverTimeMinutes", 240)),
            min_ledger_rollover_time_s=60.0
            * float(_cfg(config, "managedLedgerMinLedgerRolloverTimeMinutes", 10)),
            cursor_mark_delete_rate_per_s=float(
                _cfg(config, "managedLedgerDefaultMarkDeleteRateLimit", 1.0)
            ),
            # Pulsar's broker-wide retention defaults (-1: unlimited).
            retention_time_s=_retention(_cfg(config, "defaultRetentionTimeInMinutes", 0), 60.0),
            retention_size_bytes=int(
                _retention(_cfg(config, "defaultRetentionSizeInMB", 0), float(mb))
            ),
        )
        # Told the full name of every topic this broker loads (created or reopened).
        self._topic_listeners: list[Callable[[str], None]] = []
        self._rates: LoopingCall | None = None
        interval = float(_cfg(config, "statsUpdateFrequencyInSecs", 60))
        if interval > 0:
            self._rates = LoopingCall(self.update_rates)
            self._rates.clock = reactor
            self._rates.start(interval, now=False).addErrback(
                lambda f: log.error("stats updater stopped", extra=kv(error=str(f.value)))
            )

    # -- health ---------------------------------------------------------------------------

    async def storage_problem(self) -> str | None:
        """Why this broker could not store a message now, or None (``/brokers/health``): its
        metadata store must answer, and enough bookies take writes for a new ledger, each
        within ``HEALTH_TIMEOUT_S``."""
        checks: list[tuple[str, Callable[[], Deferred[Any]]]] = [
            ("metadata store", lambda: self.metadata_store.exists("/")),
            (
                "bookies",
                lambda: self.ledger_factory.storage_problem(self.ledger_config.ensemble_size),
            ),
        ]
        for what, check in checks:
            try:
                problem = await check().addTimeout(HEALTH_TIMEOUT_S, self.reactor)
            except defer.TimeoutError:
                return f"{what}: no answer within {HEALTH_TIMEOUT_S:g} s"
            except Exception as e:
                return f"{what}: {e or type(e).__name__}"
            if isinstance(problem, str):
                return problem
        return None

    # -- names ----------------------------------------------------------------------------

    def topic_ref(self, name: str) -> TopicRef:
        """Parse (and cache) a topic name; raise ``InvalidTopicNameError``."""
        ref = self._refs.get(name)
        if ref is None:
            ref = TopicRef.parse(name)
            if len(self._refs) > 100_000:
                self._refs.clear()
            self._refs[name] = ref
        return ref

    def set_entry_inspector(self, inspector: EntryInspector) -> None:
        """Use ``inspector`` for topics loaded from now on."""
        self.inspector = inspector

    def add_topic_listener(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(full_name)`` whenever a topic is loaded here (created or reopened),
        before anyone waiting for it gets it; return a function that removes the listener.

        A handler with wildcard subscriptions uses it to follow topics created later."""
        self._topic_listeners.append(listener)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._topic_listeners.remove(listener)

        return remove

    # -- topics ---------------------------------------------------------------------------

    def loaded_topic(self, full: str) -> Topic | None:
        """The topic of full name ``full`` if it is loaded here now (never loads it)."""
        return self.topics.get(full)

    def get_topic(self, name: str, create: bool = True) -> Deferred[Topic]:
        """The loaded topic, loading it (and creating it if ``create`` and auto-creation allow).
        Callers waiting for one load resume in the order they called, the one that started it
        first: a connection's publishes, sent one after another, are then stored in order.

        Fails with ``TopicNotFoundError``, ``InvalidTopicNameError``, ``ServiceNotReadyError``."""
        try:
            ref = self.topic_ref(name)
        except InvalidTopicNameError as e:
            return fail(e)
        topic = self.topics.get(ref.full)
        if topic is not None:
            return succeed(topic)
        if self._closed:
            return fail(ServiceNotReadyError("broker is shutting down"))
        d: Deferred[Topic] = Deferred()
        waiters = self._loading.get(ref.full)
        if waiters is not None:
            waiters.append(d)
            return d
        self._loading[ref.full] = [d]
        # The outcome reaches every caller through its waiter, this one's too.
        Deferred.fromCoroutine(self._load(ref, create)).addErrback(lambda _: None)
        return d

    async def _load(self, ref: TopicRef, create: bool) -> Topic:
        try:
            topic = await self._open(ref, create)
        except Exception as e:
            for waiter in self._loading.pop(ref.full, []):
                waiter.errback(e)  # a cancelled wait ignores it (Twisted's rule)
            raise
        topic.on_closed = self._topic_closed
        topic.limits = functools.partial(self.limits_of, ref.full)
        self.topics[ref.full] = topic
        for listener in list(self._topic_listeners):
            try:
                listener(ref.full)
            except Exception:
                log.exception("topic listener failed", extra=kv(topic=ref.full))
        for waiter in self._loading.pop(ref.full, []):
            waiter.callback(topic)
        return topic

    async def _open(self, ref: TopicRef, create: bool) -> Topic:
        if self.ownership is not None and self.ownership.clustered:
            # In a cluster a topic is served only by the owner of its bundle.
            await self.ownership.acquire(ref.full)
        # A partition of a partitioned topic exists by declaration, whatever auto-creation says;
        # one past its partition count does not exist (as on Pulsar).
        allowed = self._auto_creation(ref.full)[0]
        parent = ref.partitioned_parent
        partitions = None if parent is None else await self._partition_count(parent)
        if parent is not None and partitions is not None and ref.partition_index >= partitions:
            raise TopicNotFoundError(
                f"topic {ref.full} does not exist: {parent.full} has {partitions} partitions"
            )
        may_create = create and (allowed or partitions is not None)
        if may_create and self.namespace_exists is not None:
            known = self.namespace_exists(ref.namespace_name)
            if isinstance(known, Deferred):
                known = await known
            if not known:
                raise TopicNotFoundError(f"namespace {ref.namespace_name} does not exist")
        # A partitioned topic's name is not a topic itself: its partitions are.
        if (
            may_create
            and ref.partition_index < 0
            and await self.metadata_store.get(ref.partitioned_path) is not None
        ):
            raise NotAllowedError(
                f"{ref.full} is a partitioned topic; use its partitions "
                f"{ref.full}{PARTITION_SUFFIX}<n>"
            )
        if not ref.persistent:
            if not may_create:
                raise TopicNotFoundError(f"topic {ref.full} does not exist")
            return NonPersistentTopic(
                ref.full,
                self.reactor,
                inspector=self.inspector,
                partition_index=ref.partition_index,
                producer_names=self._producer_names,
            )
        ml_name = ref.managed_ledger_name
        if not may_create and not await self.ledger_factory.exists(ml_name):
            raise TopicNotFoundError(f"topic {ref.full} does not exist")
        if self.follow_topic_policies is not None:
            await self.follow_topic_policies(ref.full)  # its own retention, dedup, limits...
        try:
            return await self._open_persistent(ref, ml_name)
        except BaseException:
            self._unfollow(ref.full)
            raise

    def _unfollow(self, full: str) -> None:
        if self.unfollow_topic_policies is not None and TopicRef.parse(full).persistent:
            self.unfollow_topic_policies(full)

    def _drop(self, full: str) -> Topic | None:
        """Forget a loaded topic (its own policies stop being followed)."""
        topic = self.topics.pop(full, None)
        if topic is not None:
            self._unfollow(full)
        return topic

    async def _open_persistent(self, ref: TopicRef, ml_name: str) -> Topic:
        ledger = await self.ledger_factory.open(ml_name, self.ledger_config_of(ref.full))
        dedup = self._dedup_default
        if self.deduplication_policy is not None:
            chosen = self.deduplication_policy(ref.full)
            if chosen is not None:
                dedup = chosen
        topic = PersistentTopic(
            ref.full,
            ledger,
            self.reactor,
            settings=TopicSettings(
                dispatch=self.dispatch_settings,
                dedup_enabled=dedup,
                dedup_snapshot_interval=self._dedup_interval,
            ),
            inspector=self.inspector,
            metadata_store=self.metadata_store,
            partition_index=ref.partition_index,
            producer_names=self._producer_names,
        )
        try:
            await topic.load()
        except Exception:
            await ledger.close()
            raise
        return topic

    async def _partition_count(self, parent: TopicRef) -> int | None:
        """The partition count of partitioned topic ``parent``; None when it is not one."""
        found = await self.metadata_store.get(parent.partitioned_path)
        return None if found is None else int(json.loads(found.value)["partitions"])

    def limits_of(self, topic: str) -> TopicLimits:
        """A topic's producer and consumer limits: its own or its namespace's where set, else
        the broker's."""
        chosen = self.limits_policy(topic) if self.limits_policy is not None else (None,) * 3
        values = zip(chosen, self._default_limits, strict=True)
        return TopicLimits(*(default if value is None else value for value, default in values))

    def ledger_config_of(self, topic: str) -> ManagedLedgerConfig:
        """The managed-ledger config of a topic: the broker's, with its namespace's retention."""
        retention = None if self.retention_policy is None else self.retention_policy(topic)
        if retention is None:
            return self.ledger_config
        seconds, size = retention
        return dataclasses.replace(
            self.ledger_config, retention_time_s=seconds, retention_size_bytes=size
        )

    def apply_retention(self, namespace: str) -> None:
        """Give the loaded topics of ``namespace`` (``tenant/ns``, or a topic's full name for
        that topic and its partitions) their (new) retention; it applies from their next trim
        on."""
        for name, topic in list(self.topics.items()):
            ledger = getattr(topic, "ledger", None)
            if ledger is not None and namespace in (
                self.topic_ref(name).namespace_name,
                name,
                _PARTITION_RE.sub(r"\1", name),
            ):
                ledger.config = self.ledger_config_of(name)

    def _topic_closed(self, topic: Topic) -> None:
        # The topic shut itself (fenced by another owner): forget it and release its log.
        if self.topics.get(topic.name) is topic:
            self._drop(topic.name)
        topic.close().addErrback(
            lambda f: log.warning("closing a fenced topic failed", extra=kv(error=str(f.value)))
        )

    def publish(
        self,
        topic: str,
        data: bytes,
        num_messages: int = 1,
        *,
        producer: Producer | None = None,
        sequence_id: int = -1,
        highest_sequence_id: int = -1,
        publish_time_ms: int | None = None,
        forward: bool = False,
    ) -> Deferred[Entry | None]:
        """Publish to a topic by name (auto-created); fires with the stored entry once
        durable, or None for a deduplicated message.

        With ``forward`` (and a ``forwarder``), a topic another broker owns is published there
        (``broker_core.forwarding``): the entry fired has the owner's position, ``index`` -1
        and this call's ``publish_time_ms`` (0 when None); failures a new lookup may cure are
        retried for ``forward_retry_s``, and forwarded publishes to one topic are stored in the
        order of the calls, retries included (``broker_core.publish_line``)."""
        try:
            full = self.topic_ref(topic).full
        except InvalidTopicNameError as e:
            return fail(e)
        loaded = self.topics.get(full)
        if loaded is not None and not (forward and full in self._lines):
            return loaded.publish(
                data,
                num_messages,
                producer=producer,
                sequence_id=sequence_id,
                highest_sequence_id=highest_sequence_id,
                publish_time_ms=publish_time_ms,
            )

        def loaded_then(t: Topic) -> Deferred[Entry | None]:
            return t.publish(
                data,
                num_messages,
                producer=producer,
                sequence_id=sequence_id,
                highest_sequence_id=highest_sequence_id,
                publish_time_ms=publish_time_ms,
            )

        forwarder = self.forwarder
        if forward and forwarder is not None:

            def remote(owner: Any) -> Deferred[Entry | None]:
                d = forwarder.publish(owner, full, data, num_messages)
                return d.addCallback(  # type: ignore[no-any-return]
                    lambda pos: Entry(pos, -1, num_messages, publish_time_ms or 0, data)
                )

            def send(target: Any) -> Deferred[Entry | None]:
                return loaded_then(target) if isinstance(target, Topic) else remote(target)

            return self._publish_line(full).publish(send, self.forward_retry_s)

        d = self.get_topic(full, create=True)
        d.addCallback(loaded_then)
        return d  # type: ignore[return-value]

    def _publish_line(self, full: str) -> PublishLine:
        """The line of forwarded publishes to ``full`` (``broker_core.publish_line``): its
        target is the topic when loaded here, else its owner as last found."""
        line = self._lines.get(full)
        if line is not None:
            return line
        owners = self._forward_owners

        def known() -> Any:
            topic = self.topics.get(full)
            return topic if topic is not None else owners.get(full)

        def idle() -> None:
            if self._lines.get(full) is line:
                del self._lines[full]

        line = PublishLine(
            self.reactor,
            full,
            known,
            lambda: Deferred.fromCoroutine(self._route(full, True)),
            lambda: owners.pop(full, None),
            idle,
        )
        self._lines[full] = line
        return line

    def add_producer(
        self,
        topic: str,
        name: str | None = None,
        access_mode: ProducerAccessMode = ProducerAccessMode.SHARED,
        *,
        producer_id: int = 0,
        topic_epoch: int | None = None,
        on_disconnect: Callable[[], None] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Deferred[Producer]:
        """Load (or create) the topic and register a producer (see ``Topic.add_producer``).

        The Deferred fires at registration; for WaitForExclusive, wait on ``Producer.ready``."""

        def register(t: Topic) -> Producer:
            refusal = self.producer_gate(t) if self.producer_gate is not None else None
            if refusal is not None:
                raise refusal
            return t.add_producer(
                name,
                access_mode,
                producer_id=producer_id,
                topic_epoch=topic_epoch,
                on_disconnect=on_disconnect,
                metadata=metadata,
            )

        d = self.get_topic(topic, create=True)
        d.addCallback(register)
        return d  # type: ignore[return-value]

    def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        initial_position: InitialPosition = InitialPosition.LATEST,
        *,
        durable: bool = True,
        start_position: Position | None = None,
        start_inclusive: bool = False,
        key_shared: KeySharedMeta | None = None,
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        metadata: dict[str, str] | None = None,
        create_topic: bool = True,
        forward: bool = False,
    ) -> Deferred[ServerConsumer | RemoteConsumer]:
        """Load (or create) the topic and attach ``consumer`` (see ``Topic.subscribe``);
        fire with its ``ServerConsumer``.

        With ``forward`` (and a ``forwarder``), a topic another broker owns is subscribed there
        and the Deferred fires with a ``RemoteConsumer`` instead (both are ``ConsumerHandle``s;
        ``broker_core.forwarding``); only the arguments up to ``durable`` and ``create_topic``
        are forwarded. Failures a new lookup may cure are retried for ``forward_retry_s``."""

        def attach(t: Topic) -> Deferred[ServerConsumer]:
            return t.subscribe(
                subscription,
                consumer,
                sub_type,
                initial_position=initial_position,
                durable=durable,
                start_position=start_position,
                start_inclusive=start_inclusive,
                key_shared=key_shared,
                key_of=key_of,
                deliver_at=deliver_at,
                metadata=metadata,
            )

        forwarder = self.forwarder
        if forward and forwarder is not None:
            try:
                full = self.topic_ref(topic).full
            except InvalidTopicNameError as e:
                return fail(e)

            def remote(owner: Any) -> Deferred[RemoteConsumer]:
                return forwarder.subscribe(
                    owner,
                    full,
                    subscription,
                    consumer,
                    sub_type,
                    initial_position,
                    durable=durable,
                    create_topic=create_topic,
                )

            return Deferred.fromCoroutine(self._routed(full, create_topic, attach, remote))

        d = self.get_topic(topic, create=create_topic)
        d.addCallback(attach)
        return d  # type: ignore[return-value]

    async def _routed(
        self,
        full: str,
        create: bool,
        local: Callable[[Topic], Deferred[Any]],
        remote: Callable[[Any], Deferred[Any]],
    ) -> Any:
        """Run ``local`` on the topic when this broker serves it, else ``remote`` with its
        owner; retry what a new lookup may cure (``ServiceNotReadyError``: not owned yet, the
        owner gone or moving) with backoff, for ``forward_retry_s``."""
        deadline = self.reactor.seconds() + self.forward_retry_s
        delay = FIRST_BACKOFF_S
        owners = self._forward_owners
        while True:
            try:
                target = owners.get(full)
                if target is None:
                    target = await self._route(full, create)
                if isinstance(target, Topic):
                    return await local(target)
                return await remote(target)
            except ServiceNotReadyError as e:
                owners.pop(full, None)  # look the topic up again
                if self._closed or self.reactor.seconds() + delay > deadline:
                    raise
                if delay == FIRST_BACKOFF_S:  # once per call: a failover retries many times
                    log.info("forwarded call retried", extra=kv(topic=full, error=str(e)))
            await deferLater(self.reactor, delay, lambda: None)
            delay = min(delay * 2, MAX_BACKOFF_S)

    async def _route(self, full: str, create: bool) -> Any:
        """Where a forwarded call on ``full`` goes: the topic, loaded here when this broker
        serves it, else its owner's ``BrokerInfo``, remembered in ``_forward_owners`` so the
        next call goes straight there."""
        try:
            return await self.get_topic(full, create=create)
        except NotOwnerError as e:
            if e.owner is None or not e.owner.pulsar_url:
                raise
            owners = self._forward_owners
            if len(owners) >= 100_000:
                owners.clear()
            owners[full] = e.owner
            return e.owner

    def watch_namespace_topics(
        self, namespace: str, listener: Callable[[str], None]
    ) -> Callable[[], None]:
        """Call ``listener(full_name)`` for each persistent topic that appears in
        ``namespace`` (``tenant/ns``) on any broker of the cluster, as the metadata store
        records its managed ledger; return a function that stops watching.

        Topics that exist when the watch starts are not reported (list them with
        ``topics_of_namespace``); without ``ledger_names_root`` nothing is watched."""
        root = self.ledger_names_root
        if root is None:
            return lambda: None
        tenant, _, ns = namespace.partition("/")
        path = f"{root.rstrip('/')}/{tenant}/{ns}/persistent"
        known: set[str] | None = None
        stopped = False
        # One listing at a time; changes seen meanwhile make it list once more.
        scanning = False
        again = False

        async def scan() -> None:
            nonlocal known, scanning, again
            scanning = True
            try:
                while True:
                    again = False
                    names = set(await self.metadata_store.children(path))
                    first = known is None
                    new = names - (known or set())
                    known = names
                    if not first and not stopped:
                        for child in sorted(new):
                            full = f"persistent://{tenant}/{ns}/{unquote(child)}"
                            try:
                                listener(full)
                            except Exception:
                                log.exception("topic listener failed", extra=kv(topic=full))
                    if not again or stopped:
                        return
            finally:
                scanning = False

        def changed(_: object) -> None:
            nonlocal again
            if stopped:
                return
            if scanning:
                again = True
                return
            Deferred.fromCoroutine(scan()).addErrback(
                lambda f: log.warning(
                    "listing new topics failed", extra=kv(path=path, error=str(f.value))
                )
            )

        unwatch = self.metadata_store.watch(path, changed)
        changed(None)

        def stop() -> None:
            nonlocal stopped
            stopped = True
            unwatch()

        return stop

    def last_message_id(self, topic: str, *, forward: bool = False) -> Deferred[LastMessageId]:
        """The topic's last message (entry id -1 when empty); ``forward``: asked of the owner
        when another broker serves the topic (``broker_core.forwarding``, Rule F4)."""
        if forward:
            return self._forwarded(
                topic,
                lambda t: t.last_message_id(),
                lambda f, owner, full: f.last_message_id(owner, full),
            )
        d = self.get_topic(topic, create=False)
        d.addCallback(lambda t: t.last_message_id())
        return d  # type: ignore[return-value]

    def _forwarded(
        self,
        topic: str,
        local: Callable[[Topic], Deferred[Any]],
        remote: Callable[[Forwarder, Any, str], Deferred[Any]],
    ) -> Deferred[Any]:
        """``local`` on an existing topic this broker serves, else ``remote`` with the
        forwarder, the owner and the full name (retried as ``publish`` is)."""
        try:
            full = self.topic_ref(topic).full
        except InvalidTopicNameError as e:
            return fail(e)
        forwarder = self.forwarder
        if forwarder is None:
            d = self.get_topic(full, create=False)
            d.addCallback(local)
            return d
        return Deferred.fromCoroutine(
            self._routed(full, False, local, lambda owner: remote(forwarder, owner, full))
        )

    def terminate_topic(self, topic: str) -> Deferred[Position]:
        """Terminate a topic; fire with its last position."""
        d = self.get_topic(topic, create=False)
        d.addCallback(lambda t: t.terminate())
        return d  # type: ignore[return-value]

    def stats(self, topic: str, *, forward: bool = False) -> Deferred[dict[str, object]]:
        """Pulsar-shaped stats of an existing topic (``forward``: as ``last_message_id``)."""
        if forward:
            return self._forwarded(
                topic, lambda t: succeed(t.stats()), lambda f, owner, full: f.stats(owner, full)
            )
        d = self.get_topic(topic, create=False)
        d.addCallback(lambda t: t.stats())
        return d  # type: ignore[return-value]

    def internal_stats(self, topic: str) -> Deferred[dict[str, object]]:
        """Pulsar-shaped internal stats of an existing topic."""
        d = self.get_topic(topic, create=False)
        d.addCallback(lambda t: t.internal_stats())
        return d  # type: ignore[return-value]

    def unload_topic(self, topic: str) -> Deferred[None]:
        """Close a loaded topic and forget it; its next use loads it again."""
        return Deferred.fromCoroutine(self._unload(topic))

    async def _unload(self, name: str) -> None:
        ref = self.topic_ref(name)
        topic = self._drop(ref.full)
        if topic is not None:
            await topic.close()

    def delete_topic(
        self, topic: str, force: bool = False, *, forward: bool = False
    ) -> Deferred[None]:
        """Delete a topic and its data (``TopicBusyError`` if in use unless ``force``;
        ``TopicNotFoundError`` if it does not exist); ``forward``: as ``last_message_id``."""
        if forward:
            return self._forwarded(
                topic,
                lambda t: Deferred.fromCoroutine(self._delete_topic(t.name, force)),
                lambda f, owner, full: f.delete_topic(owner, full, force),
            )
        return Deferred.fromCoroutine(self._delete_topic(topic, force))

    def delete_subscription(
        self, topic: str, subscription: str, force: bool = False, *, forward: bool = False
    ) -> Deferred[None]:
        """Delete one subscription of an existing topic (``SubscriptionNotFoundError``,
        ``SubscriptionBusyError`` with consumers unless ``force``); ``forward``: as
        ``last_message_id``."""
        if forward:
            return self._forwarded(
                topic,
                lambda t: t.delete_subscription(subscription, force),
                lambda f, owner, full: f.delete_subscription(owner, full, subscription, force),
            )
        d = self.get_topic(topic, create=False)
        d.addCallback(lambda t: t.delete_subscription(subscription, force))
        return d  # type: ignore[return-value]

    async def _delete_topic(self, name: str, force: bool) -> None:
        ref = self.topic_ref(name)
        topic = await self.get_topic(ref.full, create=False)
        await topic.delete(force)
        if self.topics.get(ref.full) is topic:
            self._drop(ref.full)

    def topic_loads(self) -> dict[str, tuple[float, float]]:
        """Each loaded topic's last measured (msgs/s in, msgs/s out), for load reports."""
        loads = {}
        for name, topic in self.topics.items():
            rate_out = sum(
                getattr(c, "msg_rate_out", 0.0)
                for sub in topic.subscriptions.values()
                for c in sub.consumers
            )
            loads[name] = (topic.msg_rate_in, rate_out)
        return loads

    def update_rates(self) -> None:
        """Refresh the per-second rates in every loaded topic's stats."""
        for topic in list(self.topics.values()):
            topic.update_rates()

    # -- partitioned topics ---------------------------------------------------------------

    def partitioned_topic_metadata(self, topic: str, create: bool = False) -> Deferred[int]:
        """The number of partitions (0: not partitioned). With ``create`` and
        ``allowAutoTopicCreationType=partitioned``, a topic that does not exist at all is
        created partitioned (``defaultNumPartitions``)."""
        return Deferred.fromCoroutine(self._partitioned_metadata(topic, create))

    async def _partitioned_metadata(self, name: str, create: bool) -> int:
        ref = self.topic_ref(name)
        if ref.partition_index >= 0:
            return 0
        found = await self.metadata_store.get(ref.partitioned_path)
        if found is not None:
            return int(json.loads(found.value)["partitions"])
        allowed, kind, partitions = self._auto_creation(ref.full)
        if create and allowed and kind == "partitioned":
            exists = ref.full in self.topics or (
                ref.persistent and await self.ledger_factory.exists(ref.managed_ledger_name)
            )
            if not exists:
                with contextlib.suppress(BadVersionError):
                    await self._put_partitions(ref, partitions, -1)
                return await self._partitioned_metadata(name, False)
        return 0

    def schema_compatibility(self, topic: str) -> str:
        """The schema compatibility strategy of a topic: its namespace's, else the broker's."""
        policy = self.schema_compatibility_policy
        chosen = None if policy is None else policy(topic)
        return chosen or str(_cfg(self.config, "schemaCompatibilityStrategy", "FULL"))

    def schema_flags(self, topic: str) -> tuple[bool, bool]:
        """Whether producers may add schema versions to a topic, and whether a producer
        without a schema is refused on a topic that has one: its namespace's, else the
        broker's settings."""
        policy = self.schema_flags_policy
        auto, enforced = (None, None) if policy is None else policy(topic)
        if auto is None:
            auto = bool(_cfg(self.config, "isAllowAutoUpdateSchemaEnabled", True))
        if enforced is None:
            enforced = bool(_cfg(self.config, "isSchemaValidationEnforced", False))
        return auto, enforced

    def _auto_creation(self, topic: str) -> tuple[bool, str, int]:
        """Whether a topic that does not exist may be created on first use, of which type and
        with how many partitions: the namespace's override, else the broker's settings."""
        chosen = None if self.auto_create_policy is None else self.auto_create_policy(topic)
        if chosen is not None:
            return chosen
        return self._auto_create, self._auto_create_type, self._default_partitions

    async def _put_partitions(self, ref: TopicRef, partitions: int, version: int | None) -> None:
        body = json.dumps({"partitions": partitions}).encode()
        await self.metadata_store.put(ref.partitioned_path, body, version)

    def create_partitioned_topic(self, topic: str, partitions: int) -> Deferred[None]:
        """Create a partitioned topic (``TopicAlreadyExistsError`` if the name is taken)."""
        return Deferred.fromCoroutine(self._create_partitioned(topic, partitions))

    async def _create_partitioned(self, name: str, partitions: int) -> None:
        ref = self.topic_ref(name)
        if PARTITION_SUFFIX in ref.local:
            raise InvalidTopicNameError(
                f"a partitioned topic name may not contain {PARTITION_SUFFIX!r}: {name}"
            )
        if partitions < 1:
            raise NotAllowedError(f"partitions must be at least 1, got {partitions}")
        if ref.full in self.topics or (
            ref.persistent and await self.ledger_factory.exists(ref.managed_ledger_name)
        ):
            raise TopicAlreadyExistsError(f"topic {ref.full} already exists")
        try:
            await self._put_partitions(ref, partitions, -1)
        except BadVersionError:
            raise TopicAlreadyExistsError(f"partitioned topic {ref.full} already exists") from None

    def update_partitioned_topic(self, topic: str, partitions: int) -> Deferred[None]:
        """Raise the number of partitions (it may only grow)."""
        return Deferred.fromCoroutine(self._update_partitioned(topic, partitions))

    async def _update_partitioned(self, name: str, partitions: int) -> None:
        ref = self.topic_ref(name)
        found = await self.metadata_store.get(ref.partitioned_path)
        if found is None:
            raise TopicNotFoundError(f"partitioned topic {ref.full} does not exist")
        current = int(json.loads(found.value)["partitions"])
        if partitions <= current:
            raise NotAllowedError(
                f"partitions may only grow: {ref.full} has {current}, asked {partitions}"
            )
        await self._put_partitions(ref, partitions, found.stat.version)

    def delete_partitioned_topic(
        self,
        topic: str,
        force: bool = False,
        *,
        delete_partition: Callable[[str, bool], Any] | None = None,
    ) -> Deferred[None]:
        """Delete every partition that exists, then the partitioned metadata.

        ``delete_partition(name, force)`` (awaitable) deletes one partition instead of this
        broker, e.g. asking its owner in a cluster; missing partitions are skipped."""
        return Deferred.fromCoroutine(self._delete_partitioned(topic, force, delete_partition))

    async def _delete_partitioned(
        self, name: str, force: bool, delete_partition: Callable[[str, bool], Any] | None
    ) -> None:
        ref = self.topic_ref(name)
        found = await self.metadata_store.get(ref.partitioned_path)
        if found is None:
            raise TopicNotFoundError(f"partitioned topic {ref.full} does not exist")
        partitions = int(json.loads(found.value)["partitions"])
        delete = delete_partition or self._delete_topic
        for i in range(partitions):
            with contextlib.suppress(TopicNotFoundError):
                await delete(ref.partition(i).full, force)
        with contextlib.suppress(NotFoundError):
            await self.metadata_store.delete(ref.partitioned_path)

    def topics_of_namespace(
        self, namespace: str, mode: TopicListMode = TopicListMode.PERSISTENT
    ) -> Deferred[list[str]]:
        """Full names of the namespace's topics (partitions listed one by one), sorted."""
        return Deferred.fromCoroutine(self._topics_of_namespace(namespace, mode))

    async def _topics_of_namespace(self, namespace: str, mode: TopicListMode) -> list[str]:
        parts = namespace.split("/")
        if len(parts) != 2 or not all(parts):
            raise InvalidTopicNameError(f"invalid namespace {namespace!r}")
        tenant, ns = parts
        found: set[str] = set()
        domains = []
        if mode in (TopicListMode.PERSISTENT, TopicListMode.ALL):
            domains.append("persistent")
            prefix = f"{tenant}/{ns}/persistent/"
            for ml_name in await self.ledger_factory.list(prefix):
                local = ml_name[len(prefix) :]
                if local and "/" not in local:
                    found.add(f"persistent://{tenant}/{ns}/{unquote(local)}")
        if mode in (TopicListMode.NON_PERSISTENT, TopicListMode.ALL):
            domains.append("non-persistent")
            for full, topic in self.topics.items():
                if not topic.persistent and full.startswith(f"non-persistent://{tenant}/{ns}/"):
                    found.add(full)
        for domain in domains:
            root = f"{PARTITIONED_ROOT}/{tenant}/{ns}/{domain}"
            for child in await self.metadata_store.children(root):
                meta = await self.metadata_store.get(f"{root}/{child}")
                if meta is None:
                    continue
                base = TopicRef(domain, tenant, ns, unquote(child))
                for i in range(int(json.loads(meta.value)["partitions"])):
                    found.add(base.partition(i).full)
        return sorted(found)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> Deferred[None]:
        """Close every topic, then the ledger factory."""
        return Deferred.fromCoroutine(self._close())

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for line in list(self._lines.values()):
            line.close(ServiceNotReadyError("the broker is stopping"))
        if self._rates is not None and self._rates.running:
            self._rates.stop()
        topics = list(self.topics.values())
        self.topics.clear()
        for topic in topics:
            try:
                await topic.close()
            except Exception as e:
                log.warning("closing topic failed", extra=kv(topic=topic.name, error=str(e)))
        await self.ledger_factory.close()
