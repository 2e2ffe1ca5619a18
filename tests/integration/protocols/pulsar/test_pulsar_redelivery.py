"""The official client against the Pulsar handler: redelivery-driven features (dead-letter
topics, ack timeout) and schemas (registered, versioned, fetched, refused when incompatible).

(Regex discovery of topics created later is not tested end to end: the Python client ignores
``pattern_auto_discovery_period`` and polls every 60 s; the unit tests cover the listing.)"""

from __future__ import annotations

import pulsar
import pytest_twisted
from pulsar.schema import Integer, JsonSchema, Record, String, StringSchema
from pulsar_harness import Broker, client, run_client_process

EARLIEST = pulsar.InitialPosition.Earliest


DEAD_LETTER_SCENARIO = """
    import json, logging, sys
    import pulsar

    log = logging.getLogger("client")
    log.setLevel(logging.ERROR)
    c = pulsar.Client(sys.argv[1], logger=log, operation_timeout_seconds=10)
    consumer = c.subscribe(
        "t-dlq",
        "sub",
        consumer_type=pulsar.ConsumerType.Shared,
        initial_position=pulsar.InitialPosition.Earliest,
        negative_ack_redelivery_delay_ms=50,
        dead_letter_policy=pulsar.ConsumerDeadLetterPolicy(
            max_redeliver_count=2,
            dead_letter_topic="t-dlq-dead",
            initial_subscription_name="dead-sub",
        ),
    )
    c.create_producer("t-dlq").send(b"poison")
    counts = []
    for _ in range(3):
        m = consumer.receive(5000)
        counts.append(m.redelivery_count())
        consumer.negative_acknowledge(m)
    # Once the message is in the dead letter topic (a reader sees it), a consumer with no
    # initial position (Latest) still gets it: the dead letter producer's initial
    # subscription was made from the earliest message.
    reader = c.create_reader("t-dlq-dead", pulsar.MessageId.earliest)
    reader.read_next(5000)
    dead = c.subscribe("t-dlq-dead", "dead-sub")
    data = dead.receive(5000).data().decode()
    print("RESULT " + json.dumps({"counts": counts, "dead": data}), flush=True)
    c.close()
"""


@pytest_twisted.ensureDeferred
async def test_dead_letter_after_max_redeliveries(broker: Broker) -> None:
    """A message negatively acknowledged past max_redeliver_count lands in the DLQ topic,
    where the policy's initial subscription keeps it for a consumer that comes later.

    The client runs in its own process: closing a consumer with a dead-letter policy can
    crash the client library, which must not take the test run with it."""
    result = await broker.run(run_client_process, DEAD_LETTER_SCENARIO, broker.url)
    assert result == {"counts": [0, 1, 2], "dead": "poison"}


@pytest_twisted.ensureDeferred
async def test_ack_timeout_redelivers(broker: Broker) -> None:
    """A message not acknowledged within the ack timeout is delivered again."""

    def scenario() -> tuple[bytes, int]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(
                "t-ackto",
                "sub",
                consumer_type=pulsar.ConsumerType.Shared,
                initial_position=EARLIEST,
                unacked_messages_timeout_ms=10_000,
            )
            c.create_producer("t-ackto").send(b"slow")
            consumer.receive(5000)  # not acknowledged
            again = consumer.receive(20_000)
            consumer.acknowledge(again)
            return again.data(), again.redelivery_count()
        finally:
            c.close()

    data, count = await broker.run(scenario)
    assert data == b"slow"
    assert count >= 1


class Order(Record):
    item = String()


@pytest_twisted.ensureDeferred
async def test_string_and_json_schema_round_trip(broker: Broker) -> None:
    """Producers and consumers declaring String and JSON schemas exchange values."""

    def scenario() -> tuple[str, str]:
        c = client(broker.url)
        try:
            s_cons = c.subscribe("t-str", "sub", schema=StringSchema(), initial_position=EARLIEST)
            c.create_producer("t-str", schema=StringSchema()).send("hello")
            j_cons = c.subscribe(
                "t-json", "sub", schema=JsonSchema(Order), initial_position=EARLIEST
            )
            c.create_producer("t-json", schema=JsonSchema(Order)).send(Order(item="book"))
            return s_cons.receive(5000).value(), j_cons.receive(5000).value().item
        finally:
            c.close()

    assert await broker.run(scenario) == ("hello", "book")


class Book(Record):
    title = String()
    pages = Integer()


@pytest_twisted.ensureDeferred
async def test_schema_versions_and_incompatible_type(broker: Broker) -> None:
    """Record values round-trip carrying schema version 0; a String producer is refused."""

    def scenario() -> tuple[str, int, bytes, str]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(
                "t-book", "sub", schema=JsonSchema(Book), initial_position=EARLIEST
            )
            c.create_producer("t-book", schema=JsonSchema(Book)).send(Book(title="t", pages=3))
            m = consumer.receive(5000)
            try:
                c.create_producer("t-book", schema=StringSchema())
                refused = "accepted"
            except pulsar.IncompatibleSchema:
                refused = "incompatible"
            return m.value().title, m.value().pages, m.schema_version(), refused
        finally:
            c.close()

    title, pages, version, refused = await broker.run(scenario)
    assert (title, pages, refused) == ("t", 3, "incompatible")
    assert version == "\x00" * 8  # version 0 as 8 big-endian bytes (the client gives a str)
