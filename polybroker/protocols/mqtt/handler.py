"""``MqttProtocolHandler``: MQTT 3.1.1 and 5.0 as a broker protocol handler.

Config keys: ``mqttListenerPort`` (default 1883), ``bindAddress``, ``maxMessageSize`` (packets
may exceed it by ``PACKET_OVERHEAD``), ``mqttSubscriptionDenyList`` (comma-separated filters a
SUBSCRIBE is refused: 0x80, or MQTT 5's 0x87), ``mqttReceiveMaximum`` (QoS 1/2 publishes an
MQTT 5 client may have unacknowledged), ``mqttMaxKeepAliveSeconds`` (0: the client's own; else
MQTT 5 clients asking for more, or for none, are told this one as the server keep-alive).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config, ConfigError
from polybroker.protocols.mqtt.connection import PACKET_OVERHEAD, MqttFactory, MqttSettings
from polybroker.protocols.mqtt.session import MqttBroker

PORT_KEY = "mqttListenerPort"
#: Pending connections the MQTT socket queues.
BACKLOG = 4096


class MqttProtocolHandler(ProtocolHandler):
    """Serves MQTT clients on ``mqttListenerPort``."""

    name = "mqtt"

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 1883
        self.bound_port: int | None = None
        self.max_packet_size = 5 * 1024 * 1024 + PACKET_OVERHEAD
        self.deny_list: list[str] = []
        self.receive_maximum = 1024
        self.max_keep_alive_s = 0
        self.broker: MqttBroker | None = None
        self.factory: MqttFactory | None = None

    def initialize(self, config: Config) -> None:
        port = int(config.get(PORT_KEY))
        if not 0 <= port <= 65535:
            raise ConfigError(f"{PORT_KEY}: {port} is not a TCP port")
        size = int(config.get("maxMessageSize"))
        if size < 1024:
            raise ConfigError(f"maxMessageSize: {size} is below the 1024-byte minimum")
        receive_max = int(config.get("mqttReceiveMaximum"))
        if not 1 <= receive_max <= 65535:
            raise ConfigError(f"mqttReceiveMaximum: {receive_max} is not in 1..65535")
        keep_alive = int(config.get("mqttMaxKeepAliveSeconds"))
        if not 0 <= keep_alive <= 65535:
            raise ConfigError(f"mqttMaxKeepAliveSeconds: {keep_alive} is not in 0..65535")
        deny = [d.strip() for d in str(config.get("mqttSubscriptionDenyList")).split(",")]
        self.port = port
        self.host = str(config.get("bindAddress"))
        self.max_packet_size = min(size + PACKET_OVERHEAD, 268_435_460)
        self.deny_list = [d for d in deny if d]
        self.receive_maximum = receive_max
        self.max_keep_alive_s = keep_alive

    def start(self, broker: BrokerContext) -> Deferred[None] | None:
        self.broker = MqttBroker(broker.service, broker.reactor, self.deny_list)
        self.factory = MqttFactory(
            MqttSettings(
                broker=self.broker,
                clock=broker.reactor,
                max_packet_size=self.max_packet_size,
                receive_maximum=self.receive_maximum,
                max_keep_alive_s=self.max_keep_alive_s,
            )
        )
        return self.broker.start()

    def listeners(self) -> dict[str, Listener]:
        if self.factory is None:
            raise RuntimeError("listeners() before start()")
        # Fleets of devices reconnect at once: queue their connects instead of dropping SYNs.
        return {PORT_KEY: Listener(self.host, self.port, self.factory, backlog=BACKLOG)}

    def bound(self, key: str, port: int) -> None:
        if key == PORT_KEY:
            self.bound_port = port

    def stop(self) -> Deferred[None] | None:
        if self.factory is not None:
            self.factory.close_all()
        if self.broker is not None:
            self.broker.stop()
        return None
