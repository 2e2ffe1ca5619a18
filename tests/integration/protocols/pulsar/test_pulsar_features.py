"""The official client against the Pulsar handler: asyncio API, batch-index acks, delayed
delivery, chunking, deduplication, access modes, non-persistent and multi-topic consumers."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pulsar
import pytest_twisted
from pulsar_harness import Broker, client, run_client_process, start_broker, stop_broker

EARLIEST = pulsar.InitialPosition.Earliest


ASYNCIO_SCENARIO = """
    import asyncio, json, logging, sys
    import pulsar
    import pulsar.asyncio

    log = logging.getLogger("client")
    log.setLevel(logging.ERROR)

    async def main():
        c = pulsar.asyncio.Client(sys.argv[1], logger=log)
        try:
            consumer = await c.subscribe(
                "t-aio", "sub", initial_position=pulsar.InitialPosition.Earliest
            )
            producer = await c.create_producer("t-aio")
            await asyncio.gather(*(producer.send(f"m{i}".encode()) for i in range(50)))
            got = []
            for _ in range(50):
                m = await consumer.receive()
                await consumer.acknowledge(m)
                got.append(m.data().decode())
            return got
        finally:
            await c.close()

    print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
"""


@pytest_twisted.ensureDeferred
async def test_asyncio_client_produce_consume(broker: Broker) -> None:
    """The asyncio API (batching on by default) produces and consumes in order.

    It runs in its own process, with its own asyncio loop, so the client's loop and threads
    never share a process with the reactor under test."""
    got = await broker.run(run_client_process, ASYNCIO_SCENARIO, broker.url)
    assert got == [f"m{i}" for i in range(50)]


@pytest_twisted.ensureDeferred
async def test_batch_index_ack_redelivers_only_unacked_messages(broker: Broker) -> None:
    """With batch-index acks, a reconnecting consumer gets only the batch's unacked messages."""

    def scenario() -> list[bytes]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(
                "t-bia", "sub", initial_position=EARLIEST, batch_index_ack_enabled=True
            )
            producer = c.create_producer(
                "t-bia", batching_enabled=True, batching_max_publish_delay_ms=100
            )
            for i in range(6):
                producer.send_async(f"m{i}".encode(), None)
            producer.flush()
            msgs = [consumer.receive(5000) for _ in range(6)]
            assert len({(m.message_id().ledger_id(), m.message_id().entry_id()) for m in msgs}) == 1
            for m in msgs[::2]:
                consumer.acknowledge(m)
            consumer.close()
            again = c.subscribe("t-bia", "sub", batch_index_ack_enabled=True)
            got = [again.receive(5000).data() for _ in range(3)]
            try:
                extra = again.receive(300)
                got.append(extra.data())
            except pulsar.Timeout:
                pass
            return got
        finally:
            c.close()

    assert await broker.run(scenario) == [b"m1", b"m3", b"m5"]


@pytest_twisted.ensureDeferred
async def test_delayed_delivery_on_shared(broker: Broker) -> None:
    """A message sent with deliver_after arrives no earlier than its delay."""

    def scenario() -> tuple[list[bytes], float]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(
                "t-delay",
                "sub",
                consumer_type=pulsar.ConsumerType.Shared,
                initial_position=EARLIEST,
            )
            producer = c.create_producer("t-delay")
            start = time.monotonic()
            producer.send(b"late", deliver_after=timedelta(milliseconds=800))
            producer.send(b"now")
            first = consumer.receive(5000)
            second = consumer.receive(5000)
            elapsed = time.monotonic() - start
            return [first.data(), second.data()], elapsed
        finally:
            c.close()

    order, elapsed = await broker.run(scenario)
    assert order == [b"now", b"late"]
    assert elapsed >= 0.7


@pytest_twisted.ensureDeferred
async def test_max_message_size_is_announced_and_chunking_crosses_it() -> None:
    """The client honours CONNECTED's max size: too big fails, chunked gets through."""
    broker = await start_broker({"maxMessageSize": 64 * 1024})
    try:

        def scenario() -> tuple[str, bytes]:
            c = client(broker.url)
            try:
                consumer = c.subscribe("t-chunk", "sub", initial_position=EARLIEST)
                plain = c.create_producer("t-chunk")
                big = bytes(range(256)) * 1000  # 256 000 bytes: 4 chunks of 64 KiB
                try:
                    plain.send(big)
                    refused = "sent"
                except pulsar.MessageTooBig:
                    refused = "too big"
                chunked = c.create_producer("t-chunk", chunking_enabled=True)
                chunked.send(big)
                return refused, consumer.receive(5000).data()
            finally:
                c.close()

        refused, data = await broker.run(scenario)
        assert refused == "too big"
        assert data == bytes(range(256)) * 1000
        topic = broker.service.topics["persistent://public/default/t-chunk"]
        assert topic.msg_in >= 4  # stored as chunks, each under the limit
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_deduplication_returns_last_sequence_id() -> None:
    """With deduplication on, a re-created producer resumes after its last sequence id."""
    broker = await start_broker({"brokerDeduplicationEnabled": True})
    try:

        def scenario() -> tuple[int, int]:
            c = client(broker.url)
            try:
                p = c.create_producer("t-dedup", producer_name="writer")
                for i in range(5):
                    p.send(f"m{i}".encode())
                p.close()
                again = c.create_producer("t-dedup", producer_name="writer")
                last = again.last_sequence_id()
                again.send(b"dup", sequence_id=2)  # a duplicate: acknowledged, not stored
                again.send(b"new")
                return last, again.last_sequence_id()
            finally:
                c.close()

        assert await broker.run(scenario) == (4, 5)
        assert broker.service.topics["persistent://public/default/t-dedup"].msg_in == 6
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_wait_for_exclusive_producer_takes_over(broker: Broker) -> None:
    """A WaitForExclusive producer is created once the exclusive holder closes."""

    def scenario() -> tuple[bool, bytes]:
        c = client(broker.url)
        try:
            holder = c.create_producer("t-wait", access_mode=pulsar.ProducerAccessMode.Exclusive)
            made: list[Any] = []

            def wait() -> None:
                made.append(
                    c.create_producer(
                        "t-wait", access_mode=pulsar.ProducerAccessMode.WaitForExclusive
                    )
                )

            waiter = threading.Thread(target=wait)
            waiter.start()
            waiter.join(0.5)
            waited = waiter.is_alive()
            holder.close()
            waiter.join(10)
            consumer = c.subscribe("t-wait", "sub", initial_position=EARLIEST)
            made[0].send(b"mine")
            return waited, consumer.receive(5000).data()
        finally:
            c.close()

    assert await broker.run(scenario) == (True, b"mine")


@pytest_twisted.ensureDeferred
async def test_non_persistent_topic_delivers_to_connected_consumers(broker: Broker) -> None:
    """A non-persistent topic delivers to a connected consumer."""

    def scenario() -> list[bytes]:
        c = client(broker.url)
        try:
            topic = "non-persistent://public/default/t-np"
            consumer = c.subscribe(topic, "sub")
            producer = c.create_producer(topic)
            for i in range(5):
                producer.send(f"m{i}".encode())
            return [consumer.receive(5000).data() for _ in range(5)]
        finally:
            c.close()

    assert await broker.run(scenario) == [f"m{i}".encode() for i in range(5)]


@pytest_twisted.ensureDeferred
async def test_multi_topic_consumer(broker: Broker) -> None:
    """A consumer of a list of topics receives from each of them."""

    def scenario() -> list[bytes]:
        c = client(broker.url)
        try:
            consumer = c.subscribe(["t-mt-a", "t-mt-b"], "sub", initial_position=EARLIEST)
            c.create_producer("t-mt-a").send(b"a")
            c.create_producer("t-mt-b").send(b"b")
            got = sorted(consumer.receive(5000).data() for _ in range(2))
            return got
        finally:
            c.close()

    assert await broker.run(scenario) == [b"a", b"b"]


@pytest_twisted.ensureDeferred
async def test_terminated_topic_refuses_producers(broker: Broker) -> None:
    """After termination the topic refuses new messages with TopicTerminated."""

    def produce() -> None:
        c = client(broker.url)
        try:
            c.create_producer("t-term").send(b"last")
        finally:
            c.close()

    await broker.run(produce)
    await broker.service.terminate_topic("t-term")

    def again() -> str:
        c = client(broker.url)
        try:
            try:
                c.create_producer("t-term").send(b"more")
            except pulsar.TopicTerminated:
                return "terminated"
            return "accepted"
        finally:
            c.close()

    assert await broker.run(again) == "terminated"


@pytest_twisted.ensureDeferred
async def test_failover_spreads_partitions_over_consumers(broker: Broker) -> None:
    """Failover consumers of a partitioned topic each become active on some partitions."""
    await broker.service.create_partitioned_topic("t-fo-part", 4)

    def scenario() -> dict[str, set[str]]:
        c = client(broker.url)
        try:
            kw: dict[str, Any] = {
                "consumer_type": pulsar.ConsumerType.Failover,
                "initial_position": EARLIEST,
            }
            consumers = {n: c.subscribe("t-fo-part", "sub", consumer_name=n, **kw) for n in "ab"}
            producer = c.create_producer("t-fo-part")
            for i in range(40):
                producer.send(f"m{i}".encode(), partition_key=f"k{i}")
            seen: dict[str, set[str]] = {n: set() for n in consumers}
            total = 0
            deadline = time.monotonic() + 10
            while total < 40 and time.monotonic() < deadline:
                for n, cons in consumers.items():
                    try:
                        m = cons.receive(50)
                    except pulsar.Timeout:
                        continue
                    cons.acknowledge(m)
                    seen[n].add(m.topic_name())
                    total += 1
            return seen
        finally:
            c.close()

    seen = await broker.run(scenario)
    assert seen["a"]
    assert seen["b"]
    assert not seen["a"] & seen["b"]
    assert len(seen["a"] | seen["b"]) == 4


@pytest_twisted.ensureDeferred
async def test_exclusive_with_fencing_takes_over(broker: Broker) -> None:
    """An ExclusiveWithFencing producer fences the current one, whose sends then fail."""

    def scenario() -> tuple[str, bytes]:
        c = client(broker.url)
        try:
            consumer = c.subscribe("t-fence", "sub", initial_position=EARLIEST)
            old = c.create_producer("t-fence", access_mode=pulsar.ProducerAccessMode.Exclusive)
            old.send(b"old")
            new = c.create_producer(
                "t-fence", access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing
            )
            new.send(b"new")
            try:
                old.send(b"stale")
                outcome = "sent"
            except pulsar.ProducerFenced:
                outcome = "ProducerFenced"
            got = [consumer.receive(5000).data() for _ in range(2)]
            assert nothing_left(consumer)
            return outcome, b",".join(got)
        finally:
            c.close()

    outcome, got = await broker.run(scenario)
    assert outcome == "ProducerFenced"
    assert got == b"old,new"


def nothing_left(consumer: Any) -> bool:
    """True when no further message arrives within a short wait."""
    try:
        consumer.receive(300)
    except pulsar.Timeout:
        return True
    return False
