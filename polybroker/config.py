"""Configuration: a ``broker.conf``-style ``key=value`` file, overridden by CLI flags.

Keys are Pulsar's (and BookKeeper's) names where those projects have one. Every key is declared
here with its type and default; an unknown key or a value of the wrong type is an error that names
the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file or flag is invalid."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its type, default and meaning."""

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] = ()  # a string key's only values (empty: any)


_KEYS: tuple[Key, ...] = (
    # Broker and listeners
    Key("clusterName", str, "standalone", "Name of this cluster"),
    Key("bindAddress", str, "127.0.0.1", "Address every listener binds"),
    Key("advertisedAddress", str, "", "Host clients are told to connect to (default: bind)"),
    Key(
        "brokerMaxConnections",
        int,
        0,
        "Client connections on all listeners at once (0: as many as the open-files limit "
        "leaves after the descriptors kept for storage)",
    ),
    Key("brokerServicePort", int, 6650, "Pulsar binary protocol port"),
    Key("webServicePort", int, 8080, "HTTP admin and lookup port"),
    Key("kafkaListenerPort", int, 9092, "Kafka protocol port"),
    Key(
        "kafkaEntryFormat",
        str,
        "kafka",
        "How Kafka record batches are stored: kafka (verbatim, converted when read through "
        "another protocol) or pulsar (converted on write)",
    ),
    Key(
        "kafkaApiVersions",
        str,
        "modern",
        "Kafka API table advertised: modern (flexible, topic ids) or 2.1 (no flexible versions)",
    ),
    Key("mqttListenerPort", int, 1883, "MQTT port"),
    Key("mqttSubscriptionDenyList", str, "", "Comma-separated MQTT filters SUBSCRIBE refuses"),
    Key("mqttReceiveMaximum", int, 1024, "MQTT 5 QoS 1/2 publishes a client may have unacked"),
    Key("mqttMaxKeepAliveSeconds", int, 0, "Cap on MQTT keep-alive (0: the client's own)"),
    Key("amqpListenerPort", int, 5672, "AMQP 0-9-1 port"),
    Key("amqpUsers", str, "guest:guest", "AMQP PLAIN logins as user:password,user:password"),
    Key("amqpFrameMax", int, 131072, "AMQP frame-max offered in connection.tune"),
    Key("amqpChannelMax", int, 2047, "AMQP channel-max offered in connection.tune"),
    Key("amqpHeartbeatSeconds", int, 60, "AMQP heartbeat offered in connection.tune (0: off)"),
    Key("amqpMemoryHighWatermarkMB", int, 512, "AMQP transient queues' memory before blocking"),
    Key("messagingProtocols", str, "pulsar", "Comma-separated protocol handlers to enable"),
    Key("maxMessageSize", int, 5 * 1024 * 1024, "Largest message (bytes); frames add overhead"),
    Key("keepAliveIntervalSeconds", int, 30, "Ping idle Pulsar clients this often (0: never)"),
    Key(
        "maxMessagePublishBufferSizeInMB",
        int,
        512,
        "Publishes on their way to storage, all connections' (0 or less: no bound)",
    ),
    Key(
        "maxPendingPublishRequestsPerConnection",
        int,
        1000,
        "Pulsar SENDs awaiting receipts before a connection is not read (until half are)",
    ),
    Key("metadataStoreUrl", str, "", "Metadata store: empty = embedded under dataDir, zk://..."),
    Key("metadataStoreSessionTimeoutMillis", int, 30_000, "ZooKeeper session timeout"),
    Key("dataDir", str, "./data", "Where embedded metadata and bookie data live"),
    # Managed ledger (Pulsar's defaults)
    Key("managedLedgerDefaultEnsembleSize", int, 1, "E for new ledgers"),
    Key("managedLedgerDefaultWriteQuorum", int, 1, "Qw for new ledgers"),
    Key("managedLedgerDefaultAckQuorum", int, 1, "Qa for new ledgers"),
    Key("managedLedgerMaxEntriesPerLedger", int, 50_000, "Roll a ledger after this many entries"),
    Key("managedLedgerMaxSizePerLedgerMbytes", int, 2048, "Roll a ledger after this size"),
    Key("managedLedgerMaxLedgerRolloverTimeMinutes", int, 240, "Roll a ledger after this age"),
    Key("managedLedgerMinLedgerRolloverTimeMinutes", int, 10, "Never roll a younger ledger"),
    Key("managedLedgerCacheSizeMB", int, 256, "Entry cache for tailing reads"),
    Key("managedLedgerCacheEvictionTimeThresholdMillis", int, 1000, "Cached entries' age limit"),
    Key("managedLedgerDefaultMarkDeleteRateLimit", float, 1.0, "Cursor persists per second"),
    Key("defaultRetentionTimeInMinutes", int, 0, "Keep consumed ledgers this long (-1: forever)"),
    Key("defaultRetentionSizeInMB", int, 0, "Keep consumed ledgers up to this size (-1: no cap)"),
    # Topics, dispatch and deduplication (Pulsar's names and defaults)
    Key("allowAutoTopicCreation", bool, True, "Create topics on first produce/subscribe"),
    Key("allowAutoTopicCreationType", str, "non-partitioned", "non-partitioned or partitioned"),
    Key("defaultNumPartitions", int, 1, "Partitions of auto-created partitioned topics"),
    Key(
        "schemaCompatibilityStrategy",
        str,
        "FULL",
        "How a topic's schema may change where its namespace sets no strategy",
    ),
    Key(
        "isAllowAutoUpdateSchemaEnabled",
        bool,
        True,
        "Producers may add schema versions where the namespace does not say",
    ),
    Key(
        "isSchemaValidationEnforced",
        bool,
        False,
        "Refuse producers without a schema on topics with one, where the namespace does not say",
    ),
    Key("ttlDurationDefaultInSeconds", int, 0, "Message TTL of namespaces that set none; 0: none"),
    Key(
        "messageExpiryCheckIntervalInMinutes",
        float,
        5.0,
        "How often messages older than their TTL are acknowledged",
    ),
    Key("brokerDeduplicationEnabled", bool, False, "Deduplicate by producer sequence id"),
    Key("brokerDeduplicationEntriesInterval", int, 1000, "Entries between dedup snapshots"),
    Key("dispatcherMaxReadBatchSize", int, 100, "Most entries a dispatcher reads at once"),
    Key("maxUnackedMessagesPerConsumer", int, 50_000, "Shared consumers pause here (0: no cap)"),
    Key("backlogQuotaCheckEnabled", bool, True, "Enforce backlog quotas"),
    Key("backlogQuotaCheckIntervalInSeconds", float, 60.0, "How often backlog quotas are checked"),
    Key("backlogQuotaDefaultLimitBytes", int, -1, "Backlog quota size of namespaces (-1: none)"),
    Key("backlogQuotaDefaultLimitSecond", int, -1, "Backlog quota age of namespaces (-1: none)"),
    Key(
        "backlogQuotaDefaultRetentionPolicy",
        str,
        "producer_request_hold",
        "What a topic over its default backlog quota does",
        ("producer_request_hold", "producer_exception", "consumer_backlog_eviction"),
    ),
    Key("maxProducersPerTopic", int, 0, "Producers a topic takes (0: no limit)"),
    Key("maxConsumersPerTopic", int, 0, "Consumers a topic takes (0: no limit)"),
    Key("maxConsumersPerSubscription", int, 0, "Consumers a subscription takes (0: no limit)"),
    Key("delayedDeliveryEnabled", bool, True, "Honour deliver-at times (Shared, Key_Shared)"),
    Key("statsUpdateFrequencyInSecs", int, 60, "How often topic rates are recomputed"),
    # Cluster: bundles, ownership and the load manager (Pulsar's names and defaults)
    Key("defaultNumberOfNamespaceBundles", int, 4, "Bundles (hash ranges) of a new namespace"),
    Key("loadBalancerReportUpdateMinIntervalMillis", int, 5000, "Write this broker's load"),
    Key("loadBalancerSheddingEnabled", bool, True, "The leader unloads bundles of busy brokers"),
    Key("loadBalancerSheddingIntervalMinutes", float, 1.0, "How often the leader sheds"),
    Key("loadBalancerBrokerThresholdShedderPercentage", int, 10, "Rate over average that sheds"),
    Key(
        "loadBalancerSheddingGracePeriodMinutes",
        float,
        30.0,
        "A bundle the leader shed is not shed again for this long",
    ),
    Key("loadBalancerAutoBundleSplitEnabled", bool, True, "Split bundles that grow too big"),
    Key("loadBalancerNamespaceBundleMaxTopics", int, 1000, "Split a bundle above this"),
    Key("loadBalancerNamespaceBundleMaxMsgRate", int, 30000, "Split a bundle above this"),
    Key("loadBalancerNamespaceMaximumBundles", int, 128, "Never split beyond this"),
    # Bookie (BookKeeper's names)
    Key("bookiePort", int, 3181, "Bookie protocol port"),
    Key(
        "allowBookieAddressChange",
        bool,
        False,
        "Let a bookie start under another address than its data dir was registered under "
        "(ledgers naming the old address lose it and are re-replicated by the auditor)",
    ),
    Key("journalSyncData", bool, True, "fdatasync the journal before acknowledging adds"),
    Key("journalMaxGroupWaitMSec", float, 1.0, "Longest an add waits for its group commit"),
    Key("journalBufferedWritesThreshold", int, 512 * 1024, "Flush a group at this many bytes"),
    Key("journalMaxSizeMB", int, 2048, "Roll journal files at this size"),
    Key("journalPreAllocSizeMB", int, 16, "Grow journal files by this much at a time"),
    Key("entryLogSizeLimit", int, 1024 * 1024 * 1024, "Roll entry log files at this size"),
    Key("dbStorage_writeCacheMaxSizeMb", int, 64, "Write cache of recent entries"),
    Key("dbStorage_readAheadCacheMaxSizeMb", int, 64, "Read cache of entry log data"),
    Key("flushInterval", int, 10_000, "Checkpoint interval (ms)"),
    Key(
        "diskUsageThreshold",
        float,
        0.95,
        "Refuse adds (read-only) when the bookie's disk is used above this fraction (1: never)",
    ),
    Key("diskUsageLwmThreshold", float, 0.90, "Take adds again below this used fraction"),
    Key("diskCheckInterval", int, 10_000, "How often the bookie checks its disk usage (ms)"),
    Key("gcWaitTime", int, 60_000, "Entry log garbage collection interval (ms)"),
    Key(
        "minorCompactionThreshold",
        float,
        0.2,
        "Compact entry logs whose live fraction is under this, every minorCompactionInterval",
    ),
    Key("minorCompactionInterval", float, 3600.0, "Seconds between minor compactions (0: never)"),
    Key(
        "majorCompactionThreshold",
        float,
        0.5,
        "Compact entry logs whose live fraction is under this, every majorCompactionInterval",
    ),
    Key("majorCompactionInterval", float, 86400.0, "Seconds between major compactions (0: never)"),
    # Autorecovery (BookKeeper's names): an auditor elected among the bookies re-replicates
    Key("autoRecoveryDaemonEnabled", bool, True, "Bookies with a metadata store run the auditor"),
    Key("lostBookieRecoveryDelay", float, 5.0, "Seconds a bookie is gone before re-replication"),
    Key("auditorPeriodicCheckInterval", float, 3600.0, "Seconds between full audits (0: never)"),
    # Operations
    Key("logFormat", str, "text", "Log lines as 'text' or 'json'"),
    Key("logLevel", str, "info", "debug, info, warning or error"),
)

KEYS: Mapping[str, Key] = {k.name: k for k in _KEYS}


def _convert(key: Key, raw: Any) -> Any:
    value = _typed(key, raw)
    if key.choices and value not in key.choices:
        raise ConfigError(f"{key.name}: expected one of {', '.join(key.choices)}, got {raw!r}")
    return value


def _typed(key: Key, raw: Any) -> Any:
    if isinstance(raw, key.type) and not (key.type is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if key.type is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        return key.type(text)
    except ValueError:
        raise ConfigError(f"{key.name}: expected {key.type.__name__}, got {text!r}") from None


class Config:
    """A validated, immutable set of configuration values."""

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        merged = {k.name: k.default for k in _KEYS}
        for name, raw in (values or {}).items():
            key = KEYS.get(name)
            if key is None:
                raise ConfigError(f"unknown configuration key {name!r}")
            merged[name] = _convert(key, raw)
        self._values = merged

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def get(self, name: str) -> Any:
        """Return the value of a declared key (KeyError for an undeclared one)."""
        return self._values[name]

    def with_overrides(self, overrides: Mapping[str, Any]) -> Config:
        """Return a copy with ``overrides`` applied (None values are ignored)."""
        values = dict(self._values)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return Config(values)

    def as_dict(self) -> dict[str, Any]:
        """Return every key and value."""
        return dict(self._values)

    @property
    def protocols(self) -> list[str]:
        """The enabled protocol handler names, in order."""
        return [p.strip() for p in self["messagingProtocols"].split(",") if p.strip()]


def parse_lines(lines: Iterable[str], source: str = "<config>") -> dict[str, str]:
    """Parse ``key=value`` lines; ``#`` starts a comment line; blank lines are skipped."""
    values: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{source}:{number}: expected key=value, got {stripped!r}")
        values[name.strip()] = value.strip()
    return values


def load(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load a config file (if given), then apply ``overrides`` (CLI flags; None = not given)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
        values.update(parse_lines(text.splitlines(), str(p)))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Config(values)
