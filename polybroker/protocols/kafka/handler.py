"""``KafkaProtocolHandler``: the Kafka wire protocol as a broker protocol handler.

Config keys: ``kafkaListenerPort`` (default 9092), ``bindAddress``, ``advertisedAddress``,
``maxMessageSize`` (the largest record batch; frames may exceed it by ``FRAME_OVERHEAD``),
``clusterName`` (the Kafka cluster id), ``defaultNumPartitions`` and ``allowAutoTopicCreation``
(topics a Kafka client names are created partitioned), ``kafkaEntryFormat`` (``kafka``, the
default: each record batch is stored verbatim behind a format tag, cheaper to write and to
fetch, and converted when another protocol reads it; ``pulsar``: each batch is converted to a
Pulsar message batch on write, which every protocol reads as is), ``kafkaApiVersions``
(``modern``, the default: flexible versions and topic ids, as the clients use them with
Kafka 3.x brokers; ``2.1``: the Kafka 2.1 table with no flexible versions, which every client
also accepts).

In a cluster (the Broker API's ownership is clustered) each broker's node id is registered in
the metadata store, partitions are led by their topic's owner and groups coordinated by the
owner of their coordinator slot (``cluster``: Rules K1-K4); standalone, this broker is node
``NODE_ID`` and leads and coordinates everything.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config, ConfigError
from polybroker.protocols.kafka.apis import KafkaApis, Settings
from polybroker.protocols.kafka.cluster import KafkaCluster, clustered, http_claim_at
from polybroker.protocols.kafka.codec import TABLES
from polybroker.protocols.kafka.connection import KafkaFactory

PORT_KEY = "kafkaListenerPort"
#: What a request frame may hold beyond one record batch of ``maxMessageSize``.
FRAME_OVERHEAD = 1024 * 1024
NODE_ID = 0


class KafkaProtocolHandler(ProtocolHandler):
    """Serves Kafka clients on ``kafkaListenerPort``."""

    name = "kafka"

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 9092
        self.bound_port: int | None = None
        self.max_message_size = 5 * 1024 * 1024
        self.cluster_id = "standalone"
        self.default_partitions = 1
        self.auto_create = True
        self.entry_format = "kafka"
        self.api_versions = "modern"
        self.context: BrokerContext | None = None
        self.apis: KafkaApis | None = None
        self.factory: KafkaFactory | None = None

    def initialize(self, config: Config) -> None:
        port = int(config.get(PORT_KEY))
        if not 0 <= port <= 65535:
            raise ConfigError(f"{PORT_KEY}: {port} is not a TCP port")
        size = int(config.get("maxMessageSize"))
        if size < 1024:
            raise ConfigError(f"maxMessageSize: {size} is below the 1024-byte minimum")
        partitions = int(config.get("defaultNumPartitions"))
        if partitions < 1:
            raise ConfigError(f"defaultNumPartitions: {partitions} is below 1")
        entry_format = str(config.get("kafkaEntryFormat"))
        if entry_format not in ("pulsar", "kafka"):
            raise ConfigError(f"kafkaEntryFormat: {entry_format!r} is not one of pulsar, kafka")
        self.entry_format = entry_format
        table = str(config.get("kafkaApiVersions"))
        if table not in TABLES:
            raise ConfigError(f"kafkaApiVersions: {table!r} is not one of {', '.join(TABLES)}")
        self.api_versions = table
        self.port = port
        self.max_message_size = size
        self.default_partitions = partitions
        self.auto_create = bool(config.get("allowAutoTopicCreation"))
        self.cluster_id = str(config.get("clusterName"))
        self.host = str(config.get("bindAddress"))

    def start(self, broker: BrokerContext) -> Deferred[None] | None:
        self.context = broker
        ownership = getattr(broker.service, "ownership", None)
        cluster = None
        if clustered(ownership):
            cluster = KafkaCluster(
                ownership,
                broker.service.metadata_store,
                broker.reactor,
                claim_at=http_claim_at(broker.reactor),
            )
        self.apis = KafkaApis(
            broker.service,
            broker.reactor,
            Settings(
                node_id=NODE_ID,
                host=self.advertised_host,
                port=self.advertised_port,
                cluster_id=self.cluster_id,
                max_message_size=self.max_message_size,
                default_partitions=self.default_partitions,
                auto_create=self.auto_create,
                entry_format=self.entry_format,
                api_versions=dict(TABLES[self.api_versions]),
            ),
            cluster,
        )
        self.factory = KafkaFactory(self.apis, self.max_message_size + FRAME_OVERHEAD)
        return None

    def advertised_host(self) -> str:
        """The host Metadata and FindCoordinator answer."""
        return self.context.advertised_host if self.context is not None else self.host

    def advertised_port(self) -> int:
        """The port Metadata and FindCoordinator answer (the bound one with port 0)."""
        return self.bound_port if self.bound_port is not None else self.port

    def listeners(self) -> dict[str, Listener]:
        if self.factory is None:
            raise RuntimeError("listeners() before start()")
        return {PORT_KEY: Listener(self.host, self.port, self.factory)}

    def bound(self, key: str, port: int) -> None:
        if key == PORT_KEY:
            self.bound_port = port

    def stop(self) -> Deferred[None] | None:
        if self.apis is not None:
            self.apis.close()
        if self.factory is not None:
            self.factory.close_all()
        return None
