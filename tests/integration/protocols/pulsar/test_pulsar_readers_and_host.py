"""The official client against the Pulsar handler: reader seeks, Key_Shared consumers joining
mid-stream, and the handler loaded by the protocol host through its entry point."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pulsar
import pytest_twisted
from fake_ledger import FakeLedgerFactory, FakeMetadataStore
from pulsar_harness import Broker, client
from twisted.internet import reactor, threads

from polybroker.broker_core.host import ProtocolHost
from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.pulsar.handler import PulsarProtocolHandler

EARLIEST = pulsar.InitialPosition.Earliest


@pytest_twisted.ensureDeferred
async def test_reader_seek_by_id_and_time(broker: Broker) -> None:
    """A reader seeks back to a message id and to a publish time and reads on from there."""

    def scenario() -> tuple[list[bytes], list[bytes]]:
        c = client(broker.url)
        try:
            producer = c.create_producer("t-rseek")
            ids = [producer.send(f"m{i}".encode()) for i in range(6)]
            reader = c.create_reader("t-rseek", pulsar.MessageId.earliest)
            for _ in range(6):
                reader.read_next(5000)
            reader.seek(ids[2])
            by_id = [reader.read_next(5000).data() for _ in range(3)]
            reader.seek(0)
            by_time = [reader.read_next(5000).data() for _ in range(6)]
            return by_id, by_time
        finally:
            c.close()

    by_id, by_time = await broker.run(scenario)
    assert by_id == [b"m3", b"m4", b"m5"]
    assert by_time == [f"m{i}".encode() for i in range(6)]


@pytest_twisted.ensureDeferred
async def test_key_shared_order_holds_when_a_consumer_joins(broker: Broker) -> None:
    """A Key_Shared consumer joining mid-stream never sees a key out of order."""

    def scenario() -> dict[str, list[int]]:
        c = client(broker.url)
        try:
            kw: dict[str, Any] = {
                "consumer_type": pulsar.ConsumerType.KeyShared,
                "initial_position": EARLIEST,
                "receiver_queue_size": 5,
            }
            first = c.subscribe("t-ksj", "sub", consumer_name="a", **kw)
            producer = c.create_producer("t-ksj")
            for i in range(40):
                producer.send(f"{i}".encode(), partition_key=f"k{i % 8}")
            per_key: dict[str, list[int]] = defaultdict(list)
            held = [first.receive(5000) for _ in range(5)]  # in flight, unacked, at the join
            second = c.subscribe("t-ksj", "sub", consumer_name="b", **kw)
            for m in held:
                per_key[m.partition_key()].append(int(m.data()))
                first.acknowledge(m)
            total = len(held)
            deadline = time.monotonic() + 10
            while total < 40 and time.monotonic() < deadline:
                for cons in (first, second):
                    try:
                        m = cons.receive(50)
                    except pulsar.Timeout:
                        continue
                    per_key[m.partition_key()].append(int(m.data()))
                    cons.acknowledge(m)
                    total += 1
            return dict(per_key)
        finally:
            c.close()

    per_key = await broker.run(scenario)
    assert sum(len(v) for v in per_key.values()) == 40
    for key, values in per_key.items():
        assert values == sorted(values), key


@pytest_twisted.ensureDeferred
async def test_host_loads_the_handler_by_entry_point() -> None:
    """messagingProtocols=pulsar makes the host load this handler and bind it; clients work."""
    cfg = Config(
        {"messagingProtocols": "pulsar", "brokerServicePort": 0, "statsUpdateFrequencyInSecs": 0}
    )
    service = BrokerService(FakeLedgerFactory(reactor.seconds), reactor, cfg, FakeMetadataStore())
    host = ProtocolHost(cfg, reactor)
    (handler,) = host.load()
    assert isinstance(handler, PulsarProtocolHandler)
    ports = await host.start(BrokerContext(service, cfg, reactor, "127.0.0.1"))
    try:
        url = f"pulsar://127.0.0.1:{ports['brokerServicePort']}"
        assert handler.service_url() == url

        def scenario() -> bytes:
            c = client(url)
            try:
                consumer = c.subscribe("t-host", "sub", initial_position=EARLIEST)
                c.create_producer("t-host").send(b"via host")
                return consumer.receive(5000).data()
            finally:
                c.close()

        assert await threads.deferToThread(scenario) == b"via host"
    finally:
        await host.stop()
        await service.close()
