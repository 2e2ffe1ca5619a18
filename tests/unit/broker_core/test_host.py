"""The protocol-handler host: discovery by entry point, enabling by config, binding, lifecycle."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor
from twisted.python.failure import Failure

from polybroker.broker_core.host import ListenerError, ProtocolHost
from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config, ConfigError

T = TypeVar("T")


def result_of(d: Deferred[T]) -> T:
    """Return what an already-fired Deferred fired with; raise its failure."""
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]  # type: ignore[return-value]


class _Port:
    def __init__(self, reactor: PortReactor, port: int) -> None:
        self.reactor = reactor
        self.port = port

    def getHost(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", self.port)

    def stopListening(self) -> None:
        self.reactor.events.append(f"unbind {self.port}")
        self.reactor.listening.discard(self.port)


class PortReactor(MemoryReactor):
    """A memory reactor that hands out ports for port 0 and refuses ports it is told are busy."""

    def __init__(self, events: list[str], busy: set[int] | None = None) -> None:
        super().__init__()
        self.events = events
        self.busy = busy or set()
        self.listening: set[int] = set()
        self.backlogs: dict[int, int] = {}
        self._next = 40000

    def listenTCP(  # type: ignore[override]
        self, port: int, factory: Any, backlog: int = 50, interface: str = ""
    ) -> _Port:
        if port in self.busy:
            raise CannotListenError(interface, port, OSError(98, "Address already in use"))
        if port == 0:
            self._next += 1
            port = self._next
        self.events.append(f"bind {port}")
        self.listening.add(port)
        self.backlogs[port] = backlog
        return _Port(self, port)


class RecordingHandler(ProtocolHandler):
    """A handler that records its lifecycle calls in a shared list."""

    def __init__(self, name: str, events: list[str], ports: dict[str, int]) -> None:
        self.name = name
        self.events = events
        self.ports = ports
        self.bound_ports: dict[str, int] = {}

    def initialize(self, config: Config) -> None:
        self.events.append(f"initialize {self.name}")

    def start(self, broker: BrokerContext) -> Deferred[None]:
        self.events.append(f"start {self.name}")
        return succeed(None)

    def listeners(self) -> dict[str, Listener]:
        self.events.append(f"listeners {self.name}")
        factory = Factory.forProtocol(Protocol)
        return {k: Listener("127.0.0.1", p, factory) for k, p in self.ports.items()}

    def bound(self, key: str, port: int) -> None:
        self.events.append(f"bound {self.name} {key}={port}")
        self.bound_ports[key] = port

    def stop(self) -> None:
        self.events.append(f"stop {self.name}")


@dataclass
class FakeEntryPoint:
    """An entry point whose ``load`` returns a prepared factory."""

    name: str
    target: Any

    def load(self) -> Any:
        return self.target


class Installed:
    """A fake set of installed handlers, remembering the instances they made."""

    def __init__(self, events: list[str], **ports: dict[str, int]) -> None:
        self.made: dict[str, RecordingHandler] = {}
        self.entry_points = [
            FakeEntryPoint(name, self._maker(name, events, p)) for name, p in ports.items()
        ]

    def _maker(self, name: str, events: list[str], ports: dict[str, int]) -> Any:
        def make() -> RecordingHandler:
            handler = RecordingHandler(name, events, ports)
            self.made[name] = handler
            return handler

        return make

    def __call__(self) -> list[FakeEntryPoint]:
        return self.entry_points


def _context(reactor: Any, config: Config) -> BrokerContext:
    return BrokerContext(service=None, config=config, reactor=reactor, advertised_host="127.0.0.1")


def _host(
    protocols: str, installed: Installed, reactor: PortReactor
) -> tuple[ProtocolHost, Config]:
    config = Config({"messagingProtocols": protocols})
    return ProtocolHost(config, reactor, discover=installed), config


def test_only_enabled_handlers_load_in_config_order() -> None:
    """Installed handlers not named in messagingProtocols are never instantiated."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 1}, b={"bPort": 2}, c={"cPort": 3})
    host, _ = _host("c,a", installed, PortReactor(events))
    handlers = host.load()
    assert [h.name for h in handlers] == ["c", "a"]
    assert sorted(installed.made) == ["a", "c"]
    assert events == ["initialize c", "initialize a"]


def test_unknown_protocol_lists_the_installed_ones() -> None:
    """A name nobody installed is a ConfigError that names it and lists what exists."""
    events: list[str] = []
    installed = Installed(events, pulsar={}, kafka={})
    host, _ = _host("pulsar,mqtt", installed, PortReactor(events))
    with pytest.raises(ConfigError, match=r"unknown protocol\(s\) mqtt; installed: kafka, pulsar"):
        host.load()
    assert installed.made == {}


def test_an_entry_point_that_is_not_a_handler_is_refused() -> None:
    """An entry point returning something other than a ProtocolHandler is a clear error."""
    host = ProtocolHost(
        Config({"messagingProtocols": "odd"}),
        PortReactor([]),
        discover=lambda: [FakeEntryPoint("odd", lambda: object())],
    )
    with pytest.raises(ConfigError, match="'odd' is not a ProtocolHandler"):
        host.load()


def test_lifecycle_order_and_bound_ports() -> None:
    """Handlers start in order, are told their ports, and stop in reverse after unbinding."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 0}, b={"bPort": 7001})
    reactor = PortReactor(events)
    host, config = _host("a,b", installed, reactor)
    host.load()
    ports = result_of(host.start(_context(reactor, config)))
    assert ports == {"aPort": 40001, "bPort": 7001}
    assert installed.made["a"].bound_ports == {"aPort": 40001}
    assert events == [
        "initialize a",
        "initialize b",
        "start a",
        "start b",
        "listeners a",
        "listeners b",
        "bind 40001",
        "bind 7001",
        "bound a aPort=40001",
        "bound b bPort=7001",
    ]
    events.clear()
    result_of(host.stop())
    assert events == ["unbind 7001", "unbind 40001", "stop b", "stop a"]
    assert reactor.listening == set()


def test_port_clash_is_refused_before_anything_binds() -> None:
    """Two listeners on one port are refused naming both keys and the port; nothing binds."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 7000}, b={"bPort": 7000})
    reactor = PortReactor(events)
    host, config = _host("a,b", installed, reactor)
    host.load()
    expected = r"port clash: aPort \(a\) and bPort \(b\) both want port 7000"
    with pytest.raises(ConfigError, match=expected):
        result_of(host.start(_context(reactor, config)))
    assert not any(e.startswith("bind") for e in events)
    assert events[-2:] == ["stop b", "stop a"]


def test_clash_with_the_brokers_own_listener() -> None:
    """A handler's port that equals the broker's HTTP port is refused too."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 8080})
    reactor = PortReactor(events)
    host, config = _host("a", installed, reactor)
    host.load()
    host.add_listener("webServicePort", Listener("0.0.0.0", 8080, Factory.forProtocol(Protocol)))
    with pytest.raises(ConfigError, match=r"webServicePort \(broker\) and aPort \(a\)"):
        result_of(host.start(_context(reactor, config)))
    assert reactor.listening == set()


def test_port_zero_never_clashes() -> None:
    """Several listeners asking for any free port each get their own."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 0, "aOther": 0}, b={"bPort": 0})
    reactor = PortReactor(events)
    host, config = _host("a,b", installed, reactor)
    host.load()
    ports = result_of(host.start(_context(reactor, config)))
    assert len(set(ports.values())) == 3


def test_port_in_use_unbinds_everything_and_stops_handlers() -> None:
    """A busy port fails the start naming key and port; what was bound is closed again."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 7001}, b={"bPort": 7002})
    reactor = PortReactor(events, busy={7002})
    host, config = _host("a,b", installed, reactor)
    host.load()
    with pytest.raises(ListenerError, match=r"bPort \(b\) on 127.0.0.1:7002: .*in use"):
        result_of(host.start(_context(reactor, config)))
    assert reactor.listening == set()
    assert events[-3:] == ["unbind 7001", "stop b", "stop a"]
    assert host.ports == {}


def test_a_failing_start_stops_the_handlers_already_started() -> None:
    """When the second handler's start fails, the first is stopped and nothing binds."""
    events: list[str] = []

    class Failing(RecordingHandler):
        def start(self, broker: BrokerContext) -> Deferred[None]:
            raise RuntimeError("cannot start")

    host = ProtocolHost(
        Config({"messagingProtocols": "a,bad"}),
        PortReactor(events),
        discover=lambda: [
            FakeEntryPoint("a", lambda: RecordingHandler("a", events, {"aPort": 1})),
            FakeEntryPoint("bad", lambda: Failing("bad", events, {})),
        ],
    )
    host.load()
    with pytest.raises(RuntimeError, match="cannot start"):
        result_of(host.start(_context(host.reactor, host.config)))
    assert events == ["initialize a", "initialize bad", "start a", "stop a"]


def test_a_failing_stop_does_not_keep_others_running() -> None:
    """One handler's failing stop is logged; the handlers before it still stop."""
    events: list[str] = []

    class BadStop(RecordingHandler):
        def stop(self) -> None:
            events.append("stop bad")
            raise RuntimeError("stuck")

    host = ProtocolHost(
        Config({"messagingProtocols": "a,bad"}),
        PortReactor(events),
        discover=lambda: [
            FakeEntryPoint("a", lambda: RecordingHandler("a", events, {})),
            FakeEntryPoint("bad", lambda: BadStop("bad", events, {})),
        ],
    )
    host.load()
    result_of(host.start(_context(host.reactor, host.config)))
    result_of(host.stop())
    assert events[-2:] == ["stop bad", "stop a"]


def test_a_listeners_backlog_reaches_the_socket() -> None:
    """The host binds each listener with the backlog it asks for (Twisted's 50 by default)."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 7001})
    reactor = PortReactor(events)
    host, config = _host("a", installed, reactor)
    host.load()
    handler = installed.made["a"]
    plain = handler.listeners

    def deep() -> dict[str, Listener]:
        return {k: replace(v, backlog=4096) for k, v in plain().items()}

    handler.listeners = deep  # type: ignore[method-assign]
    result_of(host.start(_context(reactor, config)))
    assert reactor.backlogs == {7001: 4096}
    result_of(host.stop())
    assert Listener("h", 1, None).backlog == 50


def test_connections_past_the_budget_are_refused_until_one_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every guarded listener counts against one budget: past it a connection is refused
    (no protocol, so the transport closes it); one that closes makes room again. Refusals are
    logged at most every 10 s."""
    from twisted.internet.task import Clock

    from polybroker.broker_core.host import ConnectionBudget

    clock = Clock()
    budget = ConnectionBudget(2, clock)
    a, b = Factory.forProtocol(Protocol), Factory.forProtocol(Protocol)
    budget.guard(a)
    budget.guard(b)
    addr = IPv4Address("TCP", "127.0.0.1", 1)
    first, second = a.buildProtocol(addr), b.buildProtocol(addr)
    assert first is not None
    assert second is not None
    with caplog.at_level("WARNING"):
        assert a.buildProtocol(addr) is None
        assert b.buildProtocol(addr) is None
        clock.advance(10)
        assert a.buildProtocol(addr) is None
    warned = [r for r in caplog.records if "too many connections" in r.getMessage()]
    assert len(warned) == 2
    assert (budget.open, budget.refused) == (2, 3)
    first.connectionLost(Failure(Exception("gone")))
    assert budget.open == 1
    third = b.buildProtocol(addr)
    assert third is not None
    assert budget.open == 2


def test_the_budget_leaves_descriptors_to_storage() -> None:
    """By default the budget is the open-files limit (raised to the hard limit) less the
    descriptors kept for storage; brokerMaxConnections lowers it, never raises it."""
    import resource

    from polybroker.broker_core.host import ConnectionBudget
    from polybroker.runtime import RESERVED_FDS

    by_default = ConnectionBudget.for_process(Config({}), None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY  # raised as far as allowed
    assert by_default.limit == (soft - RESERVED_FDS if soft > 2 * RESERVED_FDS else soft // 2)
    assert ConnectionBudget.for_process(Config({"brokerMaxConnections": 7}), None).limit == 7
    huge = ConnectionBudget.for_process(Config({"brokerMaxConnections": 1 << 40}), None)
    assert huge.limit == by_default.limit


def test_bound_listeners_are_guarded_by_the_hosts_budget() -> None:
    """Binding puts every listener, the broker's own included, under one budget."""
    events: list[str] = []
    installed = Installed(events, a={"aPort": 0})
    reactor = PortReactor(events)
    bound: list[Any] = []
    listen = reactor.listenTCP

    def recording(port: int, factory: Any, backlog: int = 50, interface: str = "") -> _Port:
        bound.append(factory)
        return listen(port, factory, backlog, interface)

    reactor.listenTCP = recording  # type: ignore[method-assign]
    reactor.seconds = lambda: 0.0  # type: ignore[attr-defined]  # the clock refusals are logged by
    host, config = _host("a", installed, reactor)
    host.add_listener("webServicePort", Listener("127.0.0.1", 0, Factory.forProtocol(Protocol)))
    host.load()
    result_of(host.start(_context(reactor, config)))
    assert host.budget is not None
    host.budget.limit = 1
    addr = IPv4Address("TCP", "127.0.0.1", 1)
    own, handlers = bound
    assert own.buildProtocol(addr) is not None
    assert handlers.buildProtocol(addr) is None
    assert host.budget.refused == 1
