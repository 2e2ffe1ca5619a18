"""The official pulsar-client against the Pulsar handler."""

from __future__ import annotations

import pulsar
import pytest_twisted
from pulsar_harness import Broker, client


@pytest_twisted.ensureDeferred
async def test_produce_consume_sync(broker: Broker) -> None:
    """Messages sent synchronously arrive in order with their keys and properties."""

    def scenario() -> list[tuple[bytes, str, dict[str, str]]]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-basic", "sub", initial_position=pulsar.InitialPosition.Earliest)
            producer = c.create_producer("t-basic")
            for i in range(10):
                producer.send(f"m{i}".encode(), partition_key=f"k{i}", properties={"i": str(i)})
            got = []
            for _ in range(10):
                m = consumer.receive(timeout_millis=5000)
                got.append((m.data(), m.partition_key(), m.properties()))
                consumer.acknowledge(m)
            return got
        finally:
            c.close()

    got = await broker.run(scenario)
    assert got == [(f"m{i}".encode(), f"k{i}", {"i": str(i)}) for i in range(10)]
