"""Unit tests of the MQTT handler's configuration and lifecycle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore, result_of

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config, ConfigError
from polybroker.protocols.mqtt import codec as c
from polybroker.protocols.mqtt.handler import BACKLOG, PORT_KEY, MqttProtocolHandler


@pytest.mark.parametrize(
    "bad",
    [
        {"mqttListenerPort": 70000},
        {"mqttReceiveMaximum": 0},
        {"mqttMaxKeepAliveSeconds": -1},
        {"maxMessageSize": 10},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, int]) -> None:
    """Out-of-range settings raise ConfigError naming the key."""
    with pytest.raises(ConfigError, match=next(iter(bad))):
        MqttProtocolHandler().initialize(Config(bad))


def test_lifecycle_serves_and_stop_closes_connections() -> None:
    """After start the listener (with a deep backlog) serves MQTT; stop closes every
    connection, telling MQTT 5 clients the server is shutting down."""
    clock = Clock()
    cfg = Config({"mqttListenerPort": 0, "mqttSubscriptionDenyList": "a/#, b"})
    service = BrokerService(FakeLedgerFactory(clock.seconds), clock, cfg, FakeMetadataStore())
    handler = MqttProtocolHandler()
    handler.initialize(cfg)
    assert handler.deny_list == ["a/#", "b"]
    result_of(handler.start(BrokerContext(service, cfg, clock, "127.0.0.1")))  # type: ignore[arg-type]
    listener = handler.listeners()[PORT_KEY]
    assert (listener.port, listener.backlog) == (0, BACKLOG)
    conn = listener.factory.buildProtocol(None)
    transport = StringTransport()
    conn.makeConnection(transport)
    conn.dataReceived(c.encode(c.Connect("x", c.LEVEL_5), c.LEVEL_5))
    handler.stop()
    reader = c.PacketReader(level=c.LEVEL_5)
    reader.feed(transport.value())
    connack, disconnect = reader.packets()
    assert isinstance(connack, c.ConnAck)
    assert disconnect == c.Disconnect(c.SERVER_SHUTTING_DOWN)
    assert transport.disconnecting
