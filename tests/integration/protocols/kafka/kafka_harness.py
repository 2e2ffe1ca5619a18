"""Harness: the Kafka (and Pulsar) handlers served by one BrokerService over in-memory storage,
on 127.0.0.1 port 0 with the real reactor, for the real Kafka clients.

Threads meet as in the Pulsar harness: pytest-twisted runs the reactor in the test's thread; each
scenario is a plain blocking function run with ``broker.run(fn)`` (``deferToThread``).
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

from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred

sys.path.insert(0, str(Path(__file__).parents[3] / "unit" / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.kafka.handler import PORT_KEY, KafkaProtocolHandler
from polybroker.protocols.pulsar.handler import PORT_KEY as PULSAR_PORT_KEY
from polybroker.protocols.pulsar.handler import PulsarProtocolHandler

R = TypeVar("R")


@dataclass
class Broker:
    """A running broker: its Kafka bootstrap address and Pulsar URL."""

    bootstrap: str
    pulsar_url: str
    service: BrokerService
    handler: KafkaProtocolHandler
    pulsar: PulsarProtocolHandler
    listening: list[Any]
    #: (api key, api version) of every request the Kafka handler answered.
    seen: set[tuple[int, int]]

    def run(self, fn: Callable[..., R], *args: Any) -> Deferred[R]:
        """Run blocking client code in a pool thread; fire with its result."""
        return threads.deferToThread(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From a scenario thread: run ``fn`` on the reactor and wait for its result."""
        return threads.blockingCallFromThread(reactor, fn, *args)


def run_client_process(script: str, *args: str, timeout_s: float = 90.0) -> Any:
    """Run ``script`` (arguments in ``sys.argv[1:]``; prints ``RESULT <json>``) in its own
    Python process and return that result; the process is killed if it outlives the timeout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"client process printed no result (rc={done.returncode}): {done.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


async def start_broker(config: dict[str, Any] | None = None) -> Broker:
    """Start a BrokerService with the Kafka and Pulsar handlers on 127.0.0.1 port 0."""
    cfg = Config(
        {
            PORT_KEY: 0,
            PULSAR_PORT_KEY: 0,
            "statsUpdateFrequencyInSecs": 0,
            **(config or {}),
        }
    )
    service = BrokerService(FakeLedgerFactory(reactor.seconds), reactor, cfg, FakeMetadataStore())
    context = BrokerContext(service, cfg, reactor, "127.0.0.1")
    kafka = KafkaProtocolHandler()
    kafka.initialize(cfg)
    kafka.start(context)
    pulsar = PulsarProtocolHandler()
    pulsar.initialize(cfg)
    pulsar.start(context)
    seen: set[tuple[int, int]] = set()
    apis = kafka.apis
    assert apis is not None
    answer = apis.handle

    def recording(req: Any, host: str) -> Any:
        seen.add((req.api_key, req.api_version))
        return answer(req, host)

    apis.handle = recording  # type: ignore[method-assign]
    listening = []
    ports = {}
    for handler, key in ((kafka, PORT_KEY), (pulsar, PULSAR_PORT_KEY)):
        listener = handler.listeners()[key]
        port = reactor.listenTCP(listener.port, listener.factory, interface=listener.host)
        listening.append(port)
        ports[key] = port.getHost().port
        handler.bound(key, ports[key])
    return Broker(
        f"127.0.0.1:{ports[PORT_KEY]}",
        f"pulsar://127.0.0.1:{ports[PULSAR_PORT_KEY]}",
        service,
        kafka,
        pulsar,
        listening,
        seen,
    )


async def stop_broker(broker: Broker) -> None:
    for port in broker.listening:
        await port.stopListening()
    broker.handler.stop()
    broker.pulsar.stop()
    await broker.service.close()
