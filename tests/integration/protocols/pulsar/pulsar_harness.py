"""Harness: the Pulsar handler served by a BrokerService over in-memory storage, on
127.0.0.1 port 0 with the real reactor, for the official ``pulsar-client``.

How the threads meet: pytest-twisted runs the reactor in the test's thread. The official client
is C++ with blocking calls and its own threads, so each test writes its client scenario as a
plain blocking function and runs it with ``broker.run(fn)`` (``deferToThread``): the reactor
keeps serving while the scenario blocks in a pool thread, and the test waits on the Deferred.
Nothing touches broker objects from the scenario thread except through the reactor
(``broker.call``, which uses ``blockingCallFromThread``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pulsar
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred

sys.path.insert(0, str(Path(__file__).parents[3] / "unit" / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.pulsar.handler import PORT_KEY, PulsarProtocolHandler

R = TypeVar("R")

#: The client logs errors only, from C++ straight to stderr: a Python logger would be called
#: from the client's own threads, also while the interpreter shuts down.
CLIENT_LOG = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


@dataclass
class Broker:
    """A running broker: its Pulsar URL and helpers to run client code beside the reactor."""

    url: str
    service: BrokerService
    handler: PulsarProtocolHandler
    port: int
    listening: Any

    def run(self, fn: Callable[..., R], *args: Any) -> Deferred[R]:
        """Run blocking client code in a pool thread; fire with its result."""
        return threads.deferToThread(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From a scenario thread: run ``fn`` on the reactor and wait for its result."""
        return threads.blockingCallFromThread(reactor, fn, *args)


def client(url: str, **kwargs: Any) -> Any:
    """An official client with short timeouts and quiet logs."""
    kwargs.setdefault("operation_timeout_seconds", 10)
    return pulsar.Client(url, logger=CLIENT_LOG, **kwargs)


def run_client_process(script: str, url: str, timeout_s: float = 60.0) -> Any:
    """Run ``script`` (which reads the broker URL from ``sys.argv[1]`` and prints one JSON
    line as its result) in its own Python process; return that result.

    For client features whose teardown can crash the client library (the dead-letter
    producer): the crash then ends that process only, after it has printed its result.
    ``subprocess.run`` kills the process it started if it outlives ``timeout_s``."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"client process printed no result (rc={done.returncode}): {done.stderr[-2000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


async def start_broker(config: dict[str, Any] | None = None) -> Broker:
    """Start a BrokerService and the Pulsar handler on 127.0.0.1 port 0."""
    cfg = Config({"brokerServicePort": 0, "statsUpdateFrequencyInSecs": 0, **(config or {})})
    service = BrokerService(FakeLedgerFactory(reactor.seconds), reactor, cfg, FakeMetadataStore())
    handler = PulsarProtocolHandler()
    handler.initialize(cfg)
    handler.start(BrokerContext(service, cfg, reactor, "127.0.0.1"))
    listener = handler.listeners()[PORT_KEY]
    listening = reactor.listenTCP(listener.port, listener.factory, interface=listener.host)
    port = listening.getHost().port
    handler.bound(PORT_KEY, port)
    return Broker(f"pulsar://127.0.0.1:{port}", service, handler, port, listening)


async def stop_broker(broker: Broker) -> None:
    await broker.listening.stopListening()
    broker.handler.stop()
    await broker.service.close()
