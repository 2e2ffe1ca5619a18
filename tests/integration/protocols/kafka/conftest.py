"""Fixtures of the Kafka integration tests (see ``kafka_harness`` for how threads meet)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_twisted

sys.path.insert(0, str(Path(__file__).parent))

from kafka_harness import Broker, start_broker, stop_broker


@pytest_twisted.async_yield_fixture(
    params=[("2.1", "pulsar"), ("modern", "kafka")],
    ids=["v2.1-pulsar-entries", "modern-kafka-entries"],
)
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """A running broker with the Kafka and Pulsar handlers, stopped after the test; every test
    runs with both advertised API tables (Kafka 2.1, and modern flexible versions) and both
    entry formats (record batches converted on write, and stored verbatim)."""
    versions, entry_format = request.param
    b = await start_broker({"kafkaApiVersions": versions, "kafkaEntryFormat": entry_format})
    try:
        yield b
    finally:
        await stop_broker(b)
