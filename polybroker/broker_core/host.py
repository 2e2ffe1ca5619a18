"""The protocol-handler host: finds, enables, starts, binds and stops protocol handlers.

Contract:

- Discovery: every entry point of ``ENTRY_POINT_GROUP`` is a candidate; its name is the
  protocol's name. Only the names in ``messagingProtocols`` are loaded (in that order); a name
  no installed package provides is a ``ConfigError`` listing what is installed.
- ``load()`` instantiates and ``initialize``s every enabled handler, with no I/O: a bad setting
  fails here, before anything starts.
- ``start(context)`` starts the handlers in order, collects every listener (theirs and the
  broker's own, added with ``add_listener``), refuses clashes (two listeners on one non-zero
  port of overlapping addresses) before binding anything, then binds each with
  ``reactor.listenTCP``. If any bind fails (e.g. the port is in use) every socket bound so far
  is closed and the started handlers are stopped: nothing stays bound. Each handler is told
  its bound ports through ``bound(key, port)``.
- ``stop()`` closes every listening socket first, then stops the handlers in reverse order.
  A failing ``stop`` of one handler is logged and does not keep the others running.
- Every listener's connections count against one ``ConnectionBudget``: ``brokerMaxConnections``,
  or (0) the open-files limit less ``RESERVED_FDS``. Storage shares the process's file
  descriptors (a standalone's bookie opens index files and entry logs as it goes), so a flood
  of connections must not take the last of them: past the budget a connection is closed as
  soon as it is accepted, and the refusals are logged (at most every 10 s).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.defer import Deferred, DeferredList, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure

from polybroker.broker_core.protocol_handler import (
    ENTRY_POINT_GROUP,
    BrokerContext,
    Listener,
    ProtocolHandler,
)
from polybroker.config import Config, ConfigError
from polybroker.logs import kv
from polybroker.runtime import RESERVED_FDS, raise_fd_limit

log = logging.getLogger(__name__)

#: Addresses that listen on every interface of their family.
_WILDCARDS = frozenset(("", "0.0.0.0", "::", "::0"))

#: Who owns a listener that no handler declared (the broker's own HTTP port).
BROKER_OWNER = "broker"


class EntryPointLike(Protocol):
    """What the host needs of an ``importlib.metadata.EntryPoint``."""

    @property
    def name(self) -> str: ...

    def load(self) -> Any: ...


class ListenerError(Exception):
    """A listener could not be bound (the port is in use, the address is not local, ...)."""


def installed_entry_points() -> list[EntryPointLike]:
    """Every entry point of the protocol-handler group in the installed distributions."""
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


class ConnectionBudget:
    """Client connections open at once on every listener it guards, against ``limit``."""

    WARN_EVERY_S = 10.0

    def __init__(self, limit: int, clock: Any) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0
        self._clock = clock
        self._warned_at: float | None = None
        self._refused_then = 0

    @classmethod
    def for_process(cls, config: Config, clock: Any) -> ConnectionBudget:
        """The budget of ``brokerMaxConnections``, or of what the open-files limit (raised to
        its hard limit first) leaves after ``RESERVED_FDS``."""
        soft = raise_fd_limit()
        by_fds = soft - RESERVED_FDS if soft > 2 * RESERVED_FDS else soft // 2
        wanted = int(config.get("brokerMaxConnections"))
        return cls(min(wanted, by_fds) if wanted > 0 else by_fds, clock)

    def guard(self, factory: Any) -> None:
        """Count the connections ``factory`` builds; refuse (close at once) those past the
        limit."""
        build = factory.buildProtocol

        def build_within_budget(addr: Any) -> Any:
            if self.open >= self.limit:
                self._refuse(addr)
                return None
            proto = build(addr)
            if proto is not None:
                self.open += 1
                lost = proto.connectionLost

                def counted_lost(*reason: Failure) -> None:
                    self.open -= 1
                    lost(*reason)

                proto.connectionLost = counted_lost
            return proto

        factory.buildProtocol = build_within_budget

    def _refuse(self, addr: Any) -> None:
        self.refused += 1
        now = self._clock.seconds()
        if self._warned_at is None or now - self._warned_at >= self.WARN_EVERY_S:
            log.warning(
                "connection refused: too many connections",
                extra=kv(
                    peer=str(getattr(addr, "host", addr)),
                    open=self.open,
                    limit=self.limit,
                    refused=self.refused - self._refused_then,
                ),
            )
            self._warned_at = now
            self._refused_then = self.refused


@dataclass(frozen=True)
class _Binding:
    owner: str
    key: str
    listener: Listener
    handler: ProtocolHandler | None = None


def _overlap(a: str, b: str) -> bool:
    return a == b or a in _WILDCARDS or b in _WILDCARDS


class ProtocolHost:
    """Runs the protocol handlers that ``messagingProtocols`` enables (module docstring)."""

    def __init__(
        self,
        config: Config,
        reactor: Any,
        *,
        discover: Callable[[], Iterable[EntryPointLike]] = installed_entry_points,
    ) -> None:
        self.config = config
        self.reactor = reactor
        self._discover = discover
        self.handlers: list[ProtocolHandler] = []
        self._extra: dict[str, Listener] = {}
        self._ports: list[tuple[_Binding, Any]] = []
        self._started: list[ProtocolHandler] = []
        #: Bound port of every listener key, once started.
        self.ports: dict[str, int] = {}
        #: The connections of every listener, once bound.
        self.budget: ConnectionBudget | None = None

    # -- discovery ------------------------------------------------------------------------

    def available(self) -> dict[str, EntryPointLike]:
        """Installed handlers by protocol name (the first entry point of a name wins)."""
        found: dict[str, EntryPointLike] = {}
        for ep in self._discover():
            if ep.name in found:
                log.warning("protocol handler installed twice", extra=kv(protocol=ep.name))
                continue
            found[ep.name] = ep
        return found

    def load(self) -> list[ProtocolHandler]:
        """Instantiate and initialize the enabled handlers; raise ``ConfigError``."""
        if self.handlers:
            raise RuntimeError("handlers are already loaded")
        available = self.available()
        enabled = self.config.protocols
        unknown = [name for name in enabled if name not in available]
        if unknown:
            installed = ", ".join(sorted(available)) or "none"
            raise ConfigError(
                f"messagingProtocols: unknown protocol(s) {', '.join(unknown)}; "
                f"installed: {installed}"
            )
        if len(set(enabled)) != len(enabled):
            raise ConfigError(f"messagingProtocols names a protocol twice: {','.join(enabled)}")
        handlers: list[ProtocolHandler] = []
        for name in enabled:
            handler = self._instantiate(name, available[name])
            handler.initialize(self.config)
            handlers.append(handler)
        self.handlers = handlers
        return handlers

    @staticmethod
    def _instantiate(name: str, ep: EntryPointLike) -> ProtocolHandler:
        try:
            make = ep.load()
        except Exception as e:
            raise ConfigError(f"protocol handler {name!r} cannot be loaded: {e}") from e
        handler = make()
        if not isinstance(handler, ProtocolHandler):
            raise ConfigError(
                f"protocol handler {name!r} is not a ProtocolHandler: {type(handler).__name__}"
            )
        if not handler.name:
            handler.name = name
        return handler

    # -- listeners ------------------------------------------------------------------------

    def add_listener(self, key: str, listener: Listener) -> None:
        """Bind ``listener`` with the handlers' ones (the broker's own ports, e.g. HTTP)."""
        if self._ports:
            raise RuntimeError("listeners are already bound")
        self._extra[key] = listener

    def _collect(self) -> list[_Binding]:
        bindings = [_Binding(BROKER_OWNER, k, lsn) for k, lsn in self._extra.items()]
        for handler in self.handlers:
            for key, listener in handler.listeners().items():
                bindings.append(_Binding(handler.name, key, listener, handler))
        seen: dict[str, _Binding] = {}
        for b in bindings:
            if b.key in seen:
                raise ConfigError(
                    f"listener {b.key} is declared twice ({seen[b.key].owner} and {b.owner})"
                )
            seen[b.key] = b
        for i, a in enumerate(bindings):
            for b in bindings[i + 1 :]:
                la, lb = a.listener, b.listener
                if la.port != 0 and la.port == lb.port and _overlap(la.host, lb.host):
                    raise ConfigError(
                        f"port clash: {a.key} ({a.owner}) and {b.key} ({b.owner}) both want "
                        f"port {la.port} on {la.host or '*'}/{lb.host or '*'}"
                    )
        return bindings

    def _bind_all(self, bindings: list[_Binding]) -> None:
        self.budget = ConnectionBudget.for_process(self.config, self.reactor)
        for b in bindings:
            lsn = b.listener
            self.budget.guard(lsn.factory)
            try:
                port = self.reactor.listenTCP(
                    lsn.port, lsn.factory, backlog=lsn.backlog, interface=lsn.host
                )
            except CannotListenError as e:
                reason = e.socketError if e.socketError is not None else e
                raise ListenerError(
                    f"cannot listen for {b.key} ({b.owner}) on {lsn.host or '*'}:{lsn.port}: "
                    f"{reason}"
                ) from e
            self._ports.append((b, port))
            self.ports[b.key] = port.getHost().port

    def _unbind_now(self) -> Deferred[None]:
        ports, self._ports = self._ports, []
        self.ports = {}
        waits = [maybeDeferred(p.stopListening) for _, p in reversed(ports)]
        return _all_done(waits)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, context: BrokerContext) -> Deferred[dict[str, int]]:
        """Start the handlers, bind every listener; fire with ``{key: bound port}``."""
        return Deferred.fromCoroutine(self._start(context))

    async def _start(self, context: BrokerContext) -> dict[str, int]:
        try:
            for handler in self.handlers:
                await maybeDeferred(handler.start, context)
                self._started.append(handler)
            bindings = self._collect()
            self._bind_all(bindings)
        except BaseException:
            # Nothing may stay bound or running after a refused start.
            await self._unbind_now()
            await self._stop_handlers()
            raise
        for b, _ in self._ports:
            if b.handler is not None:
                b.handler.bound(b.key, self.ports[b.key])
        log.info("listeners bound", extra=kv(**self.ports))
        return dict(self.ports)

    def stop(self) -> Deferred[None]:
        """Close every listener, then stop the handlers in reverse order."""
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        await self._unbind_now()
        await self._stop_handlers()

    async def _stop_handlers(self) -> None:
        started, self._started = self._started, []
        for handler in reversed(started):
            try:
                await maybeDeferred(handler.stop)
            except Exception as e:
                log.error(
                    "protocol handler failed to stop", extra=kv(protocol=handler.name, error=str(e))
                )


def _all_done(waits: list[Deferred[Any]]) -> Deferred[None]:
    d = DeferredList(waits, consumeErrors=True)
    return d.addCallback(lambda _: None)
