"""Unit tests of KafkaProtocolHandler's lifecycle: config, listeners, advertised address, stop."""

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
from polybroker.protocols.kafka.handler import PORT_KEY, KafkaProtocolHandler


def started(config: dict[str, object], host: str = "127.0.0.1") -> KafkaProtocolHandler:
    clock = Clock()
    cfg = Config({"statsUpdateFrequencyInSecs": 0, **config})
    service = BrokerService(FakeLedgerFactory(clock.seconds), clock, cfg, FakeMetadataStore())
    handler = KafkaProtocolHandler()
    handler.initialize(cfg)
    handler.start(BrokerContext(service, cfg, clock, host))
    return handler


def test_listener_defaults_to_9092_on_the_bind_address() -> None:
    """The one listener is kafkaListenerPort (9092) on bindAddress."""
    listener = started({}).listeners()[PORT_KEY]
    assert (listener.host, listener.port) == ("127.0.0.1", 9092)
    other = started({"kafkaListenerPort": 19092, "bindAddress": "0.0.0.0"}).listeners()[PORT_KEY]
    assert (other.host, other.port) == ("0.0.0.0", 19092)


def test_metadata_advertises_the_advertised_host_and_bound_port() -> None:
    """With port 0, clients are told the port actually bound and the advertised host."""
    handler = started({"kafkaListenerPort": 0}, host="broker.example")
    handler.bound(PORT_KEY, 40999)
    assert (handler.advertised_host(), handler.advertised_port()) == ("broker.example", 40999)


@pytest.mark.parametrize(
    "config",
    [
        {"kafkaListenerPort": 70000},
        {"maxMessageSize": 10},
        {"defaultNumPartitions": 0},
        {"kafkaEntryFormat": "avro"},
    ],
)
def test_bad_settings_are_refused(config: dict[str, object]) -> None:
    """A bad port, message size, partition count or entry format is a ConfigError."""
    with pytest.raises(ConfigError):
        KafkaProtocolHandler().initialize(Config(config))


def test_stop_closes_open_connections() -> None:
    """stop() closes every connection the factory made."""
    handler = started({})
    factory = handler.listeners()[PORT_KEY].factory
    conn = factory.buildProtocol(None)
    transport = StringTransport()
    conn.makeConnection(transport)
    handler.stop()
    assert transport.disconnecting


def test_the_handler_is_installed_as_an_entry_point() -> None:
    """``messagingProtocols=kafka`` finds the handler through its entry point."""
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="polybroker.protocol_handlers")}
    assert found["kafka"] == "polybroker.protocols.kafka.handler:KafkaProtocolHandler"
