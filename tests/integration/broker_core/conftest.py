"""Fixtures for the broker's HTTP service: a BrokerService over in-memory storage, served on
127.0.0.1 port 0, and a small HTTP client over Twisted's ``Agent``.

``admin`` is a running service with the default config; ``admin_factory(config)`` starts one
with other settings. Everything started is stopped at teardown.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "unit" / "broker_core"))

from fake_ledger import FakeLedgerFactory

from polybroker.broker_core.admin import AdminServer
from polybroker.broker_core.admin_policies import PolicyStore
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.metadata.memory import MemoryMetadataStore


@implementer(IBodyProducer)
class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self.data)
        d: Deferred[None] = Deferred()
        d.callback(None)
        return d

    def pauseProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _Collect(Protocol):
    def __init__(self, done: Deferred[bytes]) -> None:
        self.done = done
        self.parts: list[bytes] = []

    def dataReceived(self, data: bytes) -> None:
        self.parts.append(data)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if reason is None or reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self.parts))
        else:
            self.done.errback(reason)


def _read_body(response: Any) -> Deferred[bytes]:
    done: Deferred[bytes] = Deferred()
    response.deliverBody(_Collect(done))
    return done


@dataclass
class Reply:
    """An HTTP answer."""

    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class AdminFixture:
    """A running HTTP service and what it serves."""

    service: BrokerService
    policies: PolicyStore
    store: MemoryMetadataStore
    port: int
    listening: Any

    async def request(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> Reply:
        """Send one request; ``body`` is sent as JSON, ``raw`` as is."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        agent = Agent(reactor)
        headers = Headers({b"content-type": [b"application/json"]})
        response = await agent.request(
            method.encode(),
            f"http://127.0.0.1:{self.port}{path}".encode(),
            headers,
            _Body(data) if data is not None else None,
        )
        content = await _read_body(response)
        ctype = response.headers.getRawHeaders(b"content-type") or [b""]
        headers = {
            name.decode().lower(): values[-1].decode()
            for name, values in response.headers.getAllRawHeaders()
        }
        return Reply(response.code, content, ctype[0].decode(), headers)

    async def stop(self) -> None:
        await self.listening.stopListening()
        await self.service.close()
        await self.store.close()


async def start_admin(config: dict[str, Any] | None = None) -> AdminFixture:
    """Serve a fresh broker (cluster ``standalone``, ``public/default``) on a free port."""
    cfg = Config({"statsUpdateFrequencyInSecs": 0, **(config or {})})
    store = MemoryMetadataStore(reactor)
    service = BrokerService(FakeLedgerFactory(), reactor, cfg, store)
    policies = PolicyStore(store, "standalone")
    await policies.ensure_defaults({"serviceUrl": "http://127.0.0.1:8080"})
    service.namespace_exists = policies.namespace_exists
    service.deduplication_policy = policies.deduplication_of
    service.retention_policy = policies.retention_of
    service.auto_create_policy = policies.auto_topic_creation_of
    service.schema_compatibility_policy = policies.schema_compatibility_of
    service.schema_flags_policy = policies.schema_flags_of
    holder: dict[str, int] = {}

    def urls() -> dict[str, str]:
        return {
            "brokerUrl": "pulsar://127.0.0.1:6650",
            "httpUrl": f"http://127.0.0.1:{holder['port']}",
        }

    server = AdminServer(service, policies, urls=urls)
    listening = reactor.listenTCP(0, server.site(), interface="127.0.0.1")
    holder["port"] = listening.getHost().port
    return AdminFixture(service, policies, store, holder["port"], listening)


@pytest_twisted.async_yield_fixture
async def admin_factory() -> AsyncIterator[Callable[..., Awaitable[AdminFixture]]]:
    """Start HTTP services with a given config; stop them all at teardown."""
    started: list[AdminFixture] = []

    async def make(config: dict[str, Any] | None = None) -> AdminFixture:
        fx = await start_admin(config)
        started.append(fx)
        return fx

    yield make
    for fx in started:
        await fx.stop()


@pytest_twisted.async_yield_fixture
async def admin() -> AsyncIterator[AdminFixture]:
    """A running HTTP service over a fresh broker."""
    fx = await start_admin()
    yield fx
    await fx.stop()
