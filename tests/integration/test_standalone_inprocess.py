"""The standalone wiring in this process: real metadata store, bookie, ledger client and broker.

Messages published through the Broker API and a subscription's acknowledgements survive a
stop and a start on the same data dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet import reactor

from polybroker.broker_core.consumer import Delivery, SubType
from polybroker.config import Config
from polybroker.ledger.api import InitialPosition
from polybroker.standalone import Standalone


class _Consumer:
    """Records deliveries."""

    consumer_id = 1
    consumer_name = "c"
    priority_level = 0

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []

    def send_entries(self, deliveries: list[Delivery]) -> None:
        self.deliveries.extend(deliveries)

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        pass


def _config(data: Path) -> Config:
    return Config(
        {
            "dataDir": str(data),
            "messagingProtocols": "",
            "webServicePort": 0,
            "managedLedgerDefaultMarkDeleteRateLimit": 1000.0,
        }
    )


async def _eventually(check: Any, timeout: float = 10.0) -> None:
    from twisted.internet.task import deferLater

    deadline = reactor.seconds() + timeout
    while not check():
        assert reactor.seconds() < deadline, "condition not met in time"
        await deferLater(reactor, 0.01, lambda: None)


@pytest_twisted.ensureDeferred
async def test_published_and_acknowledged_state_survives_a_restart(tmp_path: Path) -> None:
    """After a clean stop and start, unacknowledged messages come again and acked ones do not."""
    data = tmp_path / "data"
    topic = "persistent://public/default/inproc"
    first = Standalone(_config(data), reactor)
    ports = await first.start()
    try:
        assert ports["webServicePort"] > 0
        for i in range(4):
            await first.service.publish(topic, f"m{i}".encode())
        consumer = _Consumer()
        server = await first.service.subscribe(
            topic, "s", consumer, SubType.EXCLUSIVE, InitialPosition.EARLIEST
        )
        server.flow(2)
        await _eventually(lambda: len(consumer.deliveries) == 2)
        await server.ack([d.entry.position for d in consumer.deliveries])
    finally:
        await first.stop()

    second = Standalone(_config(data), reactor)
    await second.start()
    try:
        consumer = _Consumer()
        server = await second.service.subscribe(topic, "s", consumer, SubType.EXCLUSIVE)
        server.flow(10)
        await _eventually(lambda: len(consumer.deliveries) == 2)
        assert [d.entry.data for d in consumer.deliveries] == [b"m2", b"m3"]
        assert await second.service.topics_of_namespace("public/default") == [topic]
    finally:
        await second.stop()


@pytest_twisted.ensureDeferred
async def test_namespace_retention_keeps_ledgers_nobody_subscribed_to(tmp_path: Path) -> None:
    """Without a subscription a topic keeps only its current ledger, unless its namespace's
    retention says otherwise (Pulsar's rule): then a reader from the start sees everything."""
    from polybroker.broker_core.admin_policies import PolicyStore

    config = _config(tmp_path / "data").with_overrides(
        {"managedLedgerMaxEntriesPerLedger": 2, "managedLedgerMinLedgerRolloverTimeMinutes": 0}
    )
    standalone = Standalone(config, reactor)
    await standalone.start()
    try:
        service = standalone.service
        policies = PolicyStore(service.metadata_store, "standalone")
        await policies.load()
        await policies.create_namespace("public/kept", None)
        await policies.update_policies(
            "public/kept", {"retention_policies": {"retentionTimeInMinutes": -1}}
        )
        service.retention_policy = policies.retention_of

        async def readable(topic: str) -> list[bytes]:
            for i in range(9):
                await service.publish(topic, f"m{i}".encode())
            consumer = _Consumer()
            server = await service.subscribe(
                topic, "r", consumer, SubType.EXCLUSIVE, InitialPosition.EARLIEST, durable=False
            )
            server.flow(100)
            await _eventually(lambda: any(d.entry.data == b"m8" for d in consumer.deliveries))
            return [d.entry.data for d in consumer.deliveries]

        assert await readable("persistent://public/kept/t") == [f"m{i}".encode() for i in range(9)]
        assert len(await readable("persistent://public/default/t")) < 9
    finally:
        policies.close()
        await standalone.stop()
