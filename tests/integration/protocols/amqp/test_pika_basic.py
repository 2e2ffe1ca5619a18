"""pika against the AMQP handler: publish, consume, get, ack, confirms over loopback."""

from __future__ import annotations

import pika
import pytest_twisted
from amqp_harness import Broker


@pytest_twisted.ensureDeferred
async def test_publish_and_get_through_default_exchange(broker: Broker) -> None:
    """A message published to the default exchange is fetched with basic.get."""

    def scenario() -> tuple[bytes, str | None, bool]:
        conn = broker.connect()
        ch = conn.channel()
        ch.queue_declare("q1")
        ch.basic_publish("", "q1", b"hello", pika.BasicProperties(content_type="text/plain"))
        _, props, body = ch.basic_get("q1", auto_ack=True)
        empty = ch.basic_get("q1")
        conn.close()
        return body, props.content_type, empty == (None, None, None)

    body, ctype, empty = await broker.run(scenario)
    assert body == b"hello"
    assert ctype == "text/plain"
    assert empty
