"""The ProtocolHandler seam: how a wire protocol plugs into the broker.

A handler is found through the entry-point group ``polybroker.protocol_handlers`` (the entry
point's name is the protocol's name, its object a zero-argument callable returning a
``ProtocolHandler``) and enabled only by config: ``messagingProtocols=pulsar,kafka``.

Lifecycle, driven by the broker host:

1. ``initialize(config)``: validate the handler's own settings; raise ``ConfigError`` with a
   clear message for bad ones. No I/O.
2. ``start(broker)``: the broker (a ``BrokerContext``) is ready; set up what the handler needs.
3. ``listeners()``: ``{port_key: (bind_host, port, factory)}``; the host binds every one of them
   (a clash with another listener is refused before anything binds) and tells the handler the
   ports it got through ``bound(port_key, port)`` (port 0 asks for a free one).
4. ``stop()``: close connections and release resources; the host stops listening first.

A handler talks only to the ``BrokerContext`` (the Broker API and configuration), never to
``ledger/`` or to another handler.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from polybroker.config import Config

ENTRY_POINT_GROUP = "polybroker.protocol_handlers"


@dataclass
class BrokerContext:
    """What a started handler may use: the Broker API, config, reactor and advertised address."""

    service: Any  # polybroker.broker_core.service.BrokerService
    config: Config
    reactor: IReactorTime
    advertised_host: str


@dataclass(frozen=True)
class Listener:
    """One socket a handler wants bound: ``factory`` is a Twisted ``IProtocolFactory``."""

    host: str
    port: int
    factory: Any
    #: Pending connections the socket queues (Twisted's default 50); a handler expecting
    #: bursts of connects (thousands of devices reconnecting) asks for more.
    backlog: int = 50


def set_no_delay(transport: Any) -> None:
    """Turn off Nagle's algorithm on a TCP transport (no-op on others, e.g. in unit tests).

    Every protocol's acknowledgements and deliveries are small writes a client waits for;
    holding them back for a delayed ACK costs tens of milliseconds a round trip."""
    setter = getattr(transport, "setTcpNoDelay", None)
    if setter is not None:
        setter(True)


class ProtocolHandler(abc.ABC):
    """One wire protocol served by the broker (see the module docstring for the lifecycle)."""

    #: The protocol's name as ``messagingProtocols`` lists it.
    name: str = ""

    @abc.abstractmethod
    def initialize(self, config: Config) -> None:
        """Validate this handler's settings; raise ``ConfigError`` on bad ones."""

    @abc.abstractmethod
    def start(self, broker: BrokerContext) -> Deferred[None] | None:
        """Prepare to serve; the Broker API is ready."""

    @abc.abstractmethod
    def listeners(self) -> dict[str, Listener]:
        """The sockets to bind, keyed by a name such as ``brokerServicePort``."""

    def bound(self, key: str, port: int) -> None:  # noqa: B027 - optional hook
        """Told the port the listener ``key`` actually got (useful with port 0)."""

    @abc.abstractmethod
    def stop(self) -> Deferred[None] | None:
        """Close every connection and release resources; listeners are already closed."""
