"""Unit tests of PulsarProtocolHandler's lifecycle: config, listeners, lookup URL, stop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config, ConfigError
from polybroker.protocols.pulsar.handler import PORT_KEY, PulsarProtocolHandler
from polybroker.protocols.pulsar.inspector import PulsarEntryInspector


def started(config: dict[str, object], host: str = "127.0.0.1") -> PulsarProtocolHandler:
    clock = Clock()
    cfg = Config({"statsUpdateFrequencyInSecs": 0, **config})
    service = BrokerService(FakeLedgerFactory(clock.seconds), clock, cfg, FakeMetadataStore())
    handler = PulsarProtocolHandler()
    handler.initialize(cfg)
    handler.start(BrokerContext(service, cfg, clock, host))
    return handler


def test_listener_uses_configured_port_and_bind_address() -> None:
    """The one listener is brokerServicePort on bindAddress."""
    handler = started({"brokerServicePort": 7777, "bindAddress": "0.0.0.0"})
    listener = handler.listeners()[PORT_KEY]
    assert (handler.name, listener.host, listener.port) == ("pulsar", "0.0.0.0", 7777)


def test_default_port_is_6650() -> None:
    """Without configuration the handler listens on 6650."""
    assert started({}).listeners()[PORT_KEY].port == 6650


def test_service_url_follows_the_bound_port_and_advertised_host() -> None:
    """Lookups answer the advertised host and the port actually bound (port 0 case)."""
    handler = started({"brokerServicePort": 0}, host="broker.example")
    handler.bound(PORT_KEY, 40123)
    assert handler.service_url() == "pulsar://broker.example:40123"
    v6 = started({"brokerServicePort": 6650}, host="::1")
    assert v6.service_url() == "pulsar://[::1]:6650"


@pytest.mark.parametrize(
    "config",
    [
        {"maxMessageSize": 10},
        {"keepAliveIntervalSeconds": -1},
        {"maxPendingPublishRequestsPerConnection": 0},
    ],
)
def test_bad_settings_are_refused(config: dict[str, object]) -> None:
    """A message size below the minimum, a negative keep-alive or no pending SEND allowed is
    a ConfigError."""
    with pytest.raises(ConfigError):
        PulsarProtocolHandler().initialize(Config(config))


def test_keep_alive_interval_comes_from_config() -> None:
    """keepAliveIntervalSeconds sets the connections' PING period."""
    handler = started({"keepAliveIntervalSeconds": 7})
    factory = handler.listeners()[PORT_KEY].factory
    assert factory.settings.keep_alive_s == 7.0


def test_pending_sends_bound_comes_from_config() -> None:
    """maxPendingPublishRequestsPerConnection bounds each connection's SENDs awaiting receipts."""
    assert started({}).listeners()[PORT_KEY].factory.settings.max_pending_sends == 1000
    handler = started({"maxPendingPublishRequestsPerConnection": 50})
    assert handler.listeners()[PORT_KEY].factory.settings.max_pending_sends == 50


def test_start_installs_the_pulsar_entry_inspector() -> None:
    """Starting the handler lets the broker read keys and delays of Pulsar entries."""
    handler = started({})
    assert handler.context is not None
    assert isinstance(handler.context.service.inspector, PulsarEntryInspector)


def test_stop_closes_open_connections() -> None:
    """stop() closes every connection the listener accepted."""
    handler = started({})
    factory = handler.listeners()[PORT_KEY].factory
    conn = factory.buildProtocol(None)
    transport = StringTransport()
    conn.makeConnection(transport)
    assert factory.connections == {conn}
    handler.stop()
    assert transport.disconnecting
    assert factory.connections == set()
