"""MQTT crossing to and from the official Pulsar client, amqtt interop, exactly-once QoS 2
over a raw socket, and bad input that closes one connection while others are served."""

from __future__ import annotations

import asyncio
import gc
import socket

import pulsar
import pytest
import pytest_twisted
from amqtt.client import MQTTClient
from mqtt_harness import Broker, recv_exactly, start_broker, stop_broker, user_props
from twisted.internet import threads

from polybroker.protocols.mqtt import topics

CLIENT_LOG = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)


@pytest_twisted.ensureDeferred
async def test_pulsar_client_crossing_both_ways(broker: Broker) -> None:
    """MQTT publishes on a/b reach a Pulsar consumer of its mapped topic byte-identical with
    user properties as message properties, and Pulsar messages reach MQTT subscribers."""
    payload = bytes(range(256)) * 3
    full = topics.to_pulsar("cross/a")
    assert full == "persistent://public/default/cross%2Fa"

    def scenario() -> tuple[bytes, dict[str, str], bytes, list[tuple[str, str]]]:
        client = pulsar.Client(broker.pulsar_url, logger=CLIENT_LOG, operation_timeout_seconds=10)
        try:
            consumer = client.subscribe(full, "s1")
            mq = broker.client("m", v5=True)
            mq.subscribe("cross/b", 1)
            mq.publish("cross/a", payload, 1, properties=user_props(k="v"))
            msg = consumer.receive(timeout_millis=10_000)
            consumer.acknowledge(msg)
            producer = client.create_producer(topics.to_pulsar("cross/b"))
            producer.send(payload[::-1], properties={"from": "pulsar"})
            m = mq.get()
            mq.close()
            props = {k: v for k, v in msg.properties().items() if not k.startswith("mqtt.")}
            return msg.data(), props, m.payload, list(m.properties.UserProperty)
        finally:
            client.close()
            del client
            gc.collect()

    data, props, back, user = await threads.deferToThread(scenario)
    assert data == payload
    assert props == {"k": "v"}
    assert back == payload[::-1]
    assert user == [("from", "pulsar")]


@pytest_twisted.ensureDeferred
async def test_amqtt_client(broker: Broker) -> None:
    """amqtt connects, subscribes with a wildcard and receives QoS 0, 1 and 2 publishes."""

    async def amqtt_scenario() -> list[tuple[str, bytes, int]]:
        sub = MQTTClient(client_id="amqtt-sub")
        pub = MQTTClient(client_id="amqtt-pub")
        await sub.connect(f"mqtt://127.0.0.1:{broker.port}/")
        await pub.connect(f"mqtt://127.0.0.1:{broker.port}/")
        await sub.subscribe([("am/#", 2)])
        for qos in (0, 1, 2):
            await pub.publish("am/x", f"q{qos}".encode(), qos=qos)
        got = []
        for _ in range(3):
            m = await sub.deliver_message(timeout_duration=10)
            assert m is not None
            got.append((m.topic, bytes(m.data), m.qos))
        await sub.disconnect()
        await pub.disconnect()
        return got

    got = await threads.deferToThread(asyncio.run, amqtt_scenario())
    assert got == [("am/x", b"q0", 0), ("am/x", b"q1", 1), ("am/x", b"q2", 2)]


def _connect(s: socket.socket, client_id: bytes) -> None:
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id
    s.sendall(b"\x10" + bytes([len(body)]) + body)
    assert recv_exactly(s, 4) == b"\x20\x02\x00\x00"


@pytest_twisted.ensureDeferred
async def test_qos2_resent_publish_is_stored_once(broker: Broker) -> None:
    """A QoS 2 PUBLISH resent (DUP) before PUBREL is acknowledged again but stored once."""

    def scenario() -> tuple[list[bytes], bool]:
        sub = broker.client("sub")
        sub.subscribe("q2/x", 2)
        with broker.raw() as s:
            _connect(s, b"raw")
            publish = b"\x00\x04q2/x\x00\x07once"
            s.sendall(b"\x34" + bytes([len(publish)]) + publish)
            assert recv_exactly(s, 4) == b"\x50\x02\x00\x07"  # PUBREC 7
            s.sendall(b"\x3c" + bytes([len(publish)]) + publish)  # DUP resend
            assert recv_exactly(s, 4) == b"\x50\x02\x00\x07"
            s.sendall(b"\x62\x02\x00\x07")  # PUBREL 7
            assert recv_exactly(s, 4) == b"\x70\x02\x00\x07"  # PUBCOMP 7
            s.sendall(b"\xe0\x00")
        got = [m.payload for m in sub.get_n(1)]
        quiet = sub.nothing_more()
        sub.close()
        return got, quiet

    assert await broker.run(scenario) == ([b"once"], True)


BAD_INPUTS = {
    "garbage": b"\xde\xad\xbe\xef" * 8,
    "publish-before-connect": b"\x30\x05\x00\x01tabc",
    "unknown-level": b"\x10\x0c\x00\x04MQTT\x09\x02\x00\x3c\x00\x00",
    "oversize": b"\x10\xff\xff\xff\x7f",
    "truncated-connect": b"\x10\x04\x00\x04MQ",
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
@pytest_twisted.ensureDeferred
async def test_bad_input_closes_only_that_connection(broker: Broker, name: str) -> None:
    """Bad input gets the spec's answer and a closed connection; other clients carry on."""

    def scenario() -> tuple[bytes, bytes]:
        good = broker.client("good")
        good.subscribe("alive", 1)
        with broker.raw() as s:
            s.sendall(BAD_INPUTS[name])
            if name == "truncated-connect":
                s.shutdown(socket.SHUT_WR)
            answer = recv_exactly(s, 64)
        broker.client("p").publish("alive", b"yes", 1)
        m = good.get()
        good.close()
        return answer, m.payload

    answer, payload = await broker.run(scenario)
    assert payload == b"yes"
    if name == "unknown-level":
        assert answer == b"\x20\x02\x00\x01"  # CONNACK: unacceptable protocol version
    else:
        assert answer == b""


@pytest_twisted.ensureDeferred
async def test_malformed_packet_from_v5_client_gets_disconnect_reason(broker: Broker) -> None:
    """After an MQTT 5 CONNECT, a malformed packet is answered with DISCONNECT 0x81."""

    def scenario() -> bytes:
        with broker.raw() as s:
            body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01v"
            s.sendall(b"\x10" + bytes([len(body)]) + body)
            connack = recv_exactly(s, 2)
            assert connack[0] == 0x20
            recv_exactly(s, connack[1])
            s.sendall(b"\xc1\x00")  # PINGREQ with reserved flags set
            return recv_exactly(s, 3)

    head = await broker.run(scenario)
    assert head[0] == 0xE0  # DISCONNECT
    assert head[2] == 0x81  # malformed packet


@pytest_twisted.ensureDeferred
async def test_kafka_client_crossing_both_ways() -> None:
    """kafka-python records on a topic reach MQTT subscribers of the same name byte-identical
    with headers as user properties, and MQTT publishes reach a Kafka consumer."""
    from kafka import KafkaConsumer, KafkaProducer

    broker = await start_broker(with_kafka=True)
    payload = bytes(range(200))
    try:

        def scenario() -> tuple[bytes, list[tuple[str, str]], bytes, list[tuple[str, bytes]]]:
            mq = broker.client("m", v5=True)
            mq.subscribe("kin", 1)
            producer = KafkaProducer(bootstrap_servers=broker.kafka_bootstrap)
            producer.send("kin", payload, headers=[("h", b"v")]).get(timeout=10)
            producer.close()
            m = mq.get()
            mq.publish("kout", payload[::-1], 1, properties=user_props(k="v"))
            consumer = KafkaConsumer(
                "kout",
                bootstrap_servers=broker.kafka_bootstrap,
                auto_offset_reset="earliest",
                consumer_timeout_ms=10_000,
            )
            record = next(iter(consumer))
            consumer.close()
            mq.close()
            headers = [(k, v) for k, v in record.headers if not k.startswith("mqtt.")]
            return m.payload, list(m.properties.UserProperty), record.value, headers

        got, user, back, headers = await broker.run(scenario)
        assert got == payload
        assert user == [("h", "v")]
        assert back == payload[::-1]
        assert headers == [("k", b"v")]
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_kafka_created_topic_is_one_mqtt_topic() -> None:
    """A topic a Kafka producer created (partitioned) is subscribed and published by MQTT
    clients under its Kafka name."""
    from kafka import KafkaConsumer, KafkaProducer

    broker = await start_broker({"defaultNumPartitions": 2}, with_kafka=True)
    try:

        def scenario() -> tuple[list[bytes], set[bytes]]:
            producer = KafkaProducer(bootstrap_servers=broker.kafka_bootstrap)
            producer.send("kfirst", b"k0", partition=0).get(timeout=10)
            mq = broker.client("m")
            mq.subscribe("kfirst", 1)
            producer.send("kfirst", b"k1", partition=1).get(timeout=10)
            producer.close()
            got = [mq.get().payload]
            mq.publish("kfirst", b"from-mqtt", 1)
            got.append(mq.get().payload)
            consumer = KafkaConsumer(
                "kfirst",
                bootstrap_servers=broker.kafka_bootstrap,
                auto_offset_reset="earliest",
                consumer_timeout_ms=5_000,
            )
            seen: set[bytes] = set()
            for record in consumer:
                seen.add(record.value)
                if len(seen) == 3:
                    break
            consumer.close()
            mq.close()
            return got, seen

        got, seen = await broker.run(scenario)
        assert got == [b"k1", b"from-mqtt"]
        assert seen == {b"k0", b"k1", b"from-mqtt"}
    finally:
        await stop_broker(broker)


@pytest_twisted.ensureDeferred
async def test_wildcard_covers_a_topic_a_pulsar_producer_creates_later(broker: Broker) -> None:
    """A wildcard subscription receives from a topic first created by a Pulsar producer
    after the SUBSCRIBE, under the topic's MQTT name."""

    def scenario() -> tuple[str, bytes]:
        mq = broker.client("m")
        mq.subscribe("news/#", 1)
        client = pulsar.Client(broker.pulsar_url, logger=CLIENT_LOG, operation_timeout_seconds=10)
        try:
            producer = client.create_producer(topics.to_pulsar("news/sport"))
            producer.send(b"goal")
            m = mq.get()
            mq.close()
            return m.topic, m.payload
        finally:
            client.close()
            del client
            gc.collect()

    assert await threads.deferToThread(scenario) == ("news/sport", b"goal")
