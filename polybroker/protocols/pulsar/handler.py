"""``PulsarProtocolHandler``: the Pulsar binary protocol as a broker protocol handler.

Config keys: ``brokerServicePort`` (default 6650), ``bindAddress``, ``advertisedAddress``,
``maxMessageSize`` (announced in CONNECTED; frames may exceed it by ``FRAME_OVERHEAD``),
``keepAliveIntervalSeconds`` (PING period; a client silent for a period after one is dropped).
On start it installs ``PulsarEntryInspector`` so the broker can read keys, deliver-at times
and producer sequence ids from stored entries.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.broker_core.schemas import SchemaRegistry
from polybroker.config import Config, ConfigError
from polybroker.protocols.pulsar.connection import PulsarFactory, PulsarSettings
from polybroker.protocols.pulsar.inspector import PulsarEntryInspector

PORT_KEY = "brokerServicePort"


class PulsarProtocolHandler(ProtocolHandler):
    """Serves Pulsar clients on ``brokerServicePort``."""

    name = "pulsar"

    def __init__(self) -> None:
        self.config: Config | None = None
        self.host = "127.0.0.1"
        self.port = 6650
        self.bound_port: int | None = None
        self.max_message_size = 5 * 1024 * 1024
        self.keep_alive_s = 30.0
        self.max_pending_sends = 1000
        self.context: BrokerContext | None = None
        self.factory: PulsarFactory | None = None

    def initialize(self, config: Config) -> None:
        self.config = config
        port = int(config.get(PORT_KEY))
        if not 0 <= port <= 65535:
            raise ConfigError(f"{PORT_KEY}: {port} is not a TCP port")
        size = int(config.get("maxMessageSize"))
        if size < 1024:
            raise ConfigError(f"maxMessageSize: {size} is below the 1024-byte minimum")
        keep_alive = int(config.get("keepAliveIntervalSeconds"))
        if keep_alive < 0:
            raise ConfigError(f"keepAliveIntervalSeconds: {keep_alive} is negative")
        pending = int(config.get("maxPendingPublishRequestsPerConnection"))
        if pending < 1:
            raise ConfigError(f"maxPendingPublishRequestsPerConnection: {pending} is below 1")
        self.port = port
        self.max_message_size = size
        self.max_pending_sends = pending
        self.keep_alive_s = float(keep_alive)
        self.host = str(config.get("bindAddress"))

    def start(self, broker: BrokerContext) -> Deferred[None] | None:
        self.context = broker
        broker.service.set_entry_inspector(PulsarEntryInspector())
        self.factory = PulsarFactory(
            PulsarSettings(
                service=broker.service,
                clock=broker.reactor,
                max_message_size=self.max_message_size,
                keep_alive_s=self.keep_alive_s,
                max_pending_sends=self.max_pending_sends,
                service_url=self.service_url,
                schemas=SchemaRegistry(
                    broker.service.metadata_store, broker.service.reactor.seconds
                ),
            )
        )
        return None

    def service_url(self) -> str:
        """``pulsar://host:port`` of this broker, as lookups answer it."""
        host = self.context.advertised_host if self.context is not None else self.host
        port = self.bound_port if self.bound_port is not None else self.port
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"pulsar://{host}:{port}"

    def listeners(self) -> dict[str, Listener]:
        if self.factory is None:
            raise RuntimeError("listeners() before start()")
        return {PORT_KEY: Listener(self.host, self.port, self.factory)}

    def bound(self, key: str, port: int) -> None:
        if key == PORT_KEY:
            self.bound_port = port

    def stop(self) -> Deferred[None] | None:
        if self.factory is not None:
            self.factory.close_all()
        return None
