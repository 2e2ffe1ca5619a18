"""Harness: the AMQP handler served by a BrokerService over in-memory storage, on 127.0.0.1
port 0 with the real reactor, for pika.

pytest-twisted runs the reactor in the test's thread; pika's BlockingConnection blocks, so each
scenario is a plain function run with ``broker.run(fn)`` in a pool thread while the reactor keeps
serving. A restart keeps the ledgers' data and the metadata store and builds a new service and
handler over them, as a broker process restarting on the same storage would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pika
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred

sys.path.insert(0, str(Path(__file__).parents[3] / "unit" / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.amqp.handler import PORT_KEY, AmqpProtocolHandler

R = TypeVar("R")


@dataclass
class Broker:
    """A running broker and helpers to run blocking client code beside the reactor."""

    port: int
    service: BrokerService
    handler: AmqpProtocolHandler
    listening: Any
    ledgers: FakeLedgerFactory
    store: FakeMetadataStore
    config: dict[str, Any]
    pulsar: Any = None  # (handler, listening port) when started with the Pulsar handler

    @property
    def pulsar_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.pulsar[1].getHost().port}"

    def params(self, **kwargs: Any) -> pika.ConnectionParameters:
        kwargs.setdefault("blocked_connection_timeout", 10)
        kwargs.setdefault("socket_timeout", 10)
        return pika.ConnectionParameters("127.0.0.1", self.port, **kwargs)

    def connect(self, **kwargs: Any) -> pika.BlockingConnection:
        return pika.BlockingConnection(self.params(**kwargs))

    def run(self, fn: Callable[..., R], *args: Any) -> Deferred[R]:
        """Run blocking client code in a pool thread; fire with its result."""
        return threads.deferToThread(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From a scenario thread: run ``fn`` on the reactor and wait for its result."""
        return threads.blockingCallFromThread(reactor, fn, *args)


async def start_broker(
    config: dict[str, Any] | None = None,
    ledgers: FakeLedgerFactory | None = None,
    store: FakeMetadataStore | None = None,
    *,
    with_pulsar: bool = False,
) -> Broker:
    """Start a BrokerService and the AMQP handler (and the Pulsar one if asked) on
    127.0.0.1 port 0."""
    values = {
        "amqpListenerPort": 0,
        "brokerServicePort": 0,
        "statsUpdateFrequencyInSecs": 0,
        **(config or {}),
    }
    cfg = Config(values)
    ledgers = ledgers or FakeLedgerFactory(reactor.seconds)
    store = store or FakeMetadataStore()
    service = BrokerService(ledgers, reactor, cfg, store)
    handler = AmqpProtocolHandler()
    handler.initialize(cfg)
    handler.start(BrokerContext(service, cfg, reactor, "127.0.0.1"))
    listener = handler.listeners()[PORT_KEY]
    listening = reactor.listenTCP(listener.port, listener.factory, interface=listener.host)
    port = listening.getHost().port
    handler.bound(PORT_KEY, port)
    broker = Broker(port, service, handler, listening, ledgers, store, dict(config or {}))
    if with_pulsar:
        from polybroker.protocols.pulsar.handler import PORT_KEY as PULSAR_KEY
        from polybroker.protocols.pulsar.handler import PulsarProtocolHandler

        ph = PulsarProtocolHandler()
        ph.initialize(cfg)
        ph.start(BrokerContext(service, cfg, reactor, "127.0.0.1"))
        pl = ph.listeners()[PULSAR_KEY]
        plistening = reactor.listenTCP(pl.port, pl.factory, interface=pl.host)
        ph.bound(PULSAR_KEY, plistening.getHost().port)
        broker.pulsar = (ph, plistening)
    return broker


async def stop_broker(broker: Broker) -> None:
    await broker.listening.stopListening()
    broker.handler.stop()
    if broker.pulsar is not None:
        await broker.pulsar[1].stopListening()
        broker.pulsar[0].stop()
    await broker.service.close()


async def restart_broker(broker: Broker) -> Broker:
    """Stop ``broker`` and start a new one over the same stored ledgers and metadata."""
    await stop_broker(broker)
    ledgers = FakeLedgerFactory(reactor.seconds)
    ledgers.logs = broker.ledgers.logs
    return await start_broker(broker.config, ledgers, broker.store)
