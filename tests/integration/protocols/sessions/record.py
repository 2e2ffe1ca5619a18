"""Record the seeds of ``test_mutated_sessions``: what real clients send a standalone.

Run by hand (``python tests/integration/protocols/sessions/record.py``), never by the tests:
it starts ``polybroker standalone`` advertising 127.0.0.2, puts a recording relay on
127.0.0.2 in front of each listener (Linux routes all of 127/8 to loopback), so that the
connections a client makes after a lookup or a metadata answer pass the relay too, and runs
each client through a short session: paho-mqtt (MQTT 5: subscribe, QoS 1 and 2 publishes),
kafka-python (lz4 producer with headers, a group consumer that commits), pika (confirmed
persistent publishes with headers, consume and ack) and pulsar-client (subscribe, an LZ4
producer with properties, acks, a batching producer). Each client-to-broker byte stream is
written to ``<protocol>-<n>.bin`` beside this file.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from standalone_process import start_standalone, stop_process  # noqa: E402

RELAY_HOST = "127.0.0.2"


class Relay:
    """Forwards connections on RELAY_HOST:port to 127.0.0.1:port; keeps what clients sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sessions: list[bytearray] = []
        self._recorders: list[threading.Thread] = []
        self._listener = socket.create_server((RELAY_HOST, port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            recorded = bytearray()
            self.sessions.append(recorded)
            recorder = threading.Thread(target=_pipe, args=(client, server, recorded), daemon=True)
            recorder.start()
            self._recorders.append(recorder)
            threading.Thread(target=_pipe, args=(server, client, None), daemon=True).start()

    def close(self) -> None:
        """Stop accepting; wait (bounded) until every client closed its side."""
        self._listener.close()
        for recorder in self._recorders:
            recorder.join(10)


def _pipe(src: socket.socket, dst: socket.socket, recorded: bytearray | None) -> None:
    try:
        while data := src.recv(65536):
            if recorded is not None:
                recorded += data
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def mqtt_session(port: int) -> None:
    import paho.mqtt.client as mqtt

    c = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id="seed",
        protocol=mqtt.MQTTv5,
    )
    c.connect(RELAY_HOST, port)
    c.loop_start()
    c.subscribe("seed/#", qos=1)
    for i in range(3):
        c.publish("seed/a", b"hello %d" % i, qos=1).wait_for_publish(10)
    c.publish("seed/b", b"x" * 300, qos=2, retain=True).wait_for_publish(10)
    time.sleep(0.5)  # a recording tool: let the deliveries and their acks pass the relay
    c.disconnect()
    c.loop_stop()


def kafka_session(port: int) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    producer = KafkaProducer(bootstrap_servers=f"{RELAY_HOST}:{port}", compression_type="lz4")
    for i in range(3):
        producer.send("seed", key=b"k", value=b"v%d" % i, headers=[("h", b"1")]).get(10)
    producer.close()
    consumer = KafkaConsumer(
        "seed",
        bootstrap_servers=f"{RELAY_HOST}:{port}",
        group_id="seed-group",
        auto_offset_reset="earliest",
        consumer_timeout_ms=3000,
    )
    assert sum(1 for _ in consumer) == 3
    consumer.commit()
    consumer.close()


def amqp_session(port: int) -> None:
    import pika

    conn = pika.BlockingConnection(pika.ConnectionParameters(RELAY_HOST, port))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("seed", durable=True)
    props = pika.BasicProperties(delivery_mode=2, headers={"a": 1})
    for i in range(3):
        ch.basic_publish("", "seed", b"m%d" % i, props)
    got = 0
    for method, _, _ in ch.consume("seed", inactivity_timeout=2):
        if method is None:
            break
        ch.basic_ack(method.delivery_tag)
        got += 1
    ch.cancel()
    conn.close()
    assert got == 3


def pulsar_session(port: int) -> None:
    import pulsar

    client = pulsar.Client(f"pulsar://{RELAY_HOST}:{port}")
    consumer = client.subscribe("seed", "s")
    producer = client.create_producer("seed", compression_type=pulsar.CompressionType.LZ4)
    for i in range(3):
        producer.send(b"p%d" % i, properties={"a": "b"})
    for _ in range(3):
        consumer.acknowledge(consumer.receive(10_000))
    batching = client.create_producer("seed", batching_enabled=True)
    for i in range(10):
        batching.send_async(b"b%d" % i, None)
    batching.flush()
    client.close()


SESSIONS = {
    "mqtt": ("mqttListenerPort", mqtt_session),
    "kafka": ("kafkaListenerPort", kafka_session),
    "amqp": ("amqpListenerPort", amqp_session),
    "pulsar": ("brokerServicePort", pulsar_session),
}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="record-sessions-") as tmp:
        root = Path(tmp)
        proc, ports = start_standalone(
            root / "data", root / "standalone.log", {"advertisedAddress": RELAY_HOST}
        )
        try:
            for name, (key, session) in SESSIONS.items():
                relay = Relay(ports[key])
                session(relay.port)
                relay.close()
                for old in HERE.glob(f"{name}-*.bin"):
                    old.unlink()
                for n, recorded in enumerate(s for s in relay.sessions if s):
                    (HERE / f"{name}-{n}.bin").write_bytes(recorded)
                print(name, [len(s) for s in relay.sessions])
        finally:
            stop_process(proc)


if __name__ == "__main__":
    main()
