"""Soak run: one ``polybroker standalone`` with all four protocols under a mixed load for minutes.

The broker runs as a subprocess on free loopback ports with a scratch data dir. Four client
processes (this script re-run with ``--worker``), each a producer and a consumer of one protocol,
drive a moderate paced load (``--rate`` msgs/s per protocol's own stream, a quarter of that per
cross-protocol stream), and a fifth churns topics through the admin REST API:

- pulsar: pulsar-client producer on ``soak-pulsar`` and ``soak-p2a``; a consumer of one durable
  subscription on ``soak-pulsar`` and ``soak-m2p`` (what MQTT published);
- kafka: confluent-kafka idempotent producer (acks=all) on ``soak-kafka`` (4 partitions) and
  ``soak-k2m``; a consumer group of two members on ``soak-kafka`` (auto-commit);
- mqtt: paho QoS 1 publisher on ``soak-mqtt`` and ``soak-m2p``; a persistent-session subscriber
  (clean session off, fixed client id) on ``soak-mqtt`` and ``soak-k2m`` (what Kafka produced);
- amqp: pika publisher with confirms (persistent messages) to queue ``soak-amqp``; a consumer
  with manual acks of ``soak-amqp`` and ``soak-p2a`` (bound to ``amq.topic``: what Pulsar
  produced);
- admin: a topic (every other one partitioned) is created, written and read through a new
  Pulsar connection, then deleted; then a pause of ``--admin-seconds``, and the next. Also
  ``soak-backlog``, written at a twentieth of ``--rate`` to a subscription nobody reads until
  the producers stop (a consumer far behind): its ledger has entries in every entry log, so
  only the bookie's compaction frees those.

Churn: every producer, consumer and connection lives for a random 0.5x-1.5x ``--churn-seconds``,
then closes and is made again (new connections and producers, a Kafka member leaving and a new
one joining the group, the MQTT subscriber away for 1-5 s then back to its persistent session,
the Pulsar and AMQP consumers closing with messages unacknowledged).

Every message's payload names its stream and sequence number. A producer records a sequence
once the broker acknowledged it (Pulsar send receipt, Kafka delivery report, MQTT PUBACK, AMQP
confirm); a consumer records every sequence it receives. At the end, after the producers stop
and the consumers drained (nothing new for 15 s), each acknowledged sequence must have been
received: the missing ones are lost; receiving one more than once is a duplicate (allowed:
every path here is at-least-once), counted apart.

Every ``--sample-seconds`` the broker's RSS, open fds, threads, CPU time and the data dir's size
are sampled (also written to ``samples.csv`` in the scratch dir). The summary: RSS at start,
middle and end and its least-squares slope after the warm-up (``--warmup-minutes``), fds and
threads at start and end, broker CPU per acknowledged message, lost and duplicates per stream,
the data dir's size, ERROR lines and tracebacks in the broker's log. Ledgers roll small and
young (``--ledger-entries``, one minute), entry logs roll small (``--entry-log-mb``) and the
bookie compacts them every minute (major, at half live) so that ledger deletion, garbage
collection and compaction run within the soak, as they do over hours and days at the
defaults.

Crashes: with ``--kill-every S`` the broker is killed (SIGKILL) every S seconds (0.5x-1.5x) while
the load runs, and started again at once on the same data dir and ports; the clients reconnect
as they would to any restarted broker. What a producer had acknowledged before a crash must
still be delivered after it (the durability contract); duplicates stay allowed. RSS, fds and
threads are then those of the current broker process, and its CPU is summed over all of them.

Prints a table, then one JSON line as the last line. Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# benchmarks/pulsar.py lives beside this file: keep the folder off the path so `import pulsar`
# is the client.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
# The launcher the tests use: every port bound at 0, the ports read from the ready line.
sys.path.insert(0, str(_HERE.parent / "tests" / "integration"))

from standalone_process import PORT_FLAGS, READY, wait_for_line  # noqa: E402

SIZE = 100
PROTOCOLS = ("pulsar", "kafka", "mqtt", "amqp")
#: Stream -> (producing worker, consuming worker); a stream's name is its topic's.
STREAMS = {
    "soak-pulsar": ("pulsar", "pulsar"),
    "soak-kafka": ("kafka", "kafka"),
    "soak-mqtt": ("mqtt", "mqtt"),
    "soak-amqp": ("amqp", "amqp"),
    "soak-m2p": ("mqtt", "pulsar"),
    "soak-k2m": ("kafka", "mqtt"),
    "soak-p2a": ("pulsar", "amqp"),
    "soak-backlog": ("admin", "admin"),
}
PREFIX = "persistent://public/default/"
#: The workers' names for the broker's listeners -> the ready line's keys.
LISTENERS = {
    "pulsar": "brokerServicePort",
    "http": "webServicePort",
    "kafka": "kafkaListenerPort",
    "mqtt": "mqttListenerPort",
    "amqp": "amqpListenerPort",
}
#: The standalone's port flags -> the workers' names (both in the same order).
FLAG_LISTENERS = dict(zip(PORT_FLAGS, LISTENERS, strict=True))


def payload(stream: str, seq: int) -> bytes:
    head = f"{stream}:{seq}:".encode()
    return head + b"x" * (SIZE - len(head))


def parse(body: bytes) -> tuple[str, int] | None:
    """(stream, sequence) of a soak message, None for anything else."""
    parts = bytes(body[:48]).split(b":", 2)
    if len(parts) < 3:
        return None
    try:
        return parts[0].decode(), int(parts[1])
    except ValueError:
        return None


# ----------------------------------------------------------------------------- workers


class Worker:
    """What one client process records, and the clock it runs on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.ports: dict[str, int] = json.loads(args.ports)
        self.start: float = args.start  # wall-clock seconds: producers begin
        self.end: float = args.end  # producers stop, churn stops
        self.rate: float = args.rate
        self.churn_s: float = args.churn_seconds
        self.drain_max_s: float = args.drain_seconds
        self.admin_s: float = args.admin_seconds
        self.acked: dict[str, list[int]] = {}
        self.received: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.error_count = 0
        self.churns: Counter[str] = Counter()
        self.last_rx = time.time()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def ack(self, stream: str, seq: int) -> None:
        self.acked.setdefault(stream, []).append(seq)

    def confirmer(self, what: str, stream: str, seq: int) -> Callable[[Any, Any], None]:
        """A send callback ``(error, _)``: acks ``seq`` of ``stream`` when error is None, or
        notes the error as ``what`` failing."""

        def confirm(error: Any, _: Any) -> None:
            if error is None:
                self.ack(stream, seq)
            else:
                self.note(f"{what} {stream}:{seq}: {error}")

        return confirm

    def got(self, body: bytes) -> None:
        p = parse(body)
        if p is None:
            self.note("foreign message: " + repr(bytes(body[:40])))
            return
        self.received.setdefault(p[0], []).append(p[1])
        self.last_rx = time.time()

    def note(self, what: str) -> None:
        with self.lock:
            self.error_count += 1
            if len(self.errors) < 20:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {what}"[:400])

    def session_end(self) -> float:
        """When a connection made now should be closed (churn), at most the producers' end."""
        return min(self.end, time.time() + self.churn_s * random.uniform(0.5, 1.5))

    def producing(self) -> bool:
        return time.time() < self.end

    def consuming(self) -> bool:
        """Keep consuming until the drain is over: nothing new for 15 s after the end."""
        now = time.time()
        if now < self.end + 10:
            return True
        return now - self.last_rx < 15 and now < self.end + self.drain_max_s

    def paced(self, rate: float, until: float) -> Iterator[None]:
        """Yield at ``rate`` per second until ``until`` (or the end)."""
        if rate <= 0:
            return
        gap = 1.0 / rate
        nxt = time.time()
        while True:
            now = time.time()
            if now >= until or now >= self.end:
                return
            if nxt > now:
                time.sleep(nxt - now)
            nxt += gap
            if nxt < now - 1.0:
                nxt = now  # fell behind by over a second: do not burst to catch up
            yield

    def loop(self, name: str, session: Callable[[], None], active: Callable[[], bool]) -> None:
        """Run ``session`` again and again while ``active()``; an error is noted, retried in 1 s."""

        def run() -> None:
            while active():
                try:
                    session()
                    self.churns[name] += 1
                except Exception as e:
                    self.note(f"{name}: {type(e).__name__}: {e}")
                    time.sleep(1.0)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def wait_start(self) -> None:
        time.sleep(max(0.0, self.start - time.time()))

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=self.end + self.drain_max_s + 120 - time.time())

    def result(self) -> dict[str, Any]:
        return {
            "acked": self.acked,
            "received": self.received,
            "errors": self.errors,
            "error_count": self.error_count,
            "sessions": dict(self.churns),
        }


class Seq:
    """Sequence numbers of one stream (thread-safe enough: one producer thread per stream)."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


def pulsar_worker(w: Worker) -> None:
    import pulsar

    url = f"pulsar://127.0.0.1:{w.ports['pulsar']}"
    seqs = {s: Seq() for s in ("soak-pulsar", "soak-p2a")}

    def consume() -> None:
        client = pulsar.Client(url, operation_timeout_seconds=30, logger=_quiet_pulsar_logger())
        try:
            consumer = client.subscribe(
                [PREFIX + "soak-pulsar", PREFIX + "soak-m2p"],
                "soak-sub",
                consumer_type=pulsar.ConsumerType.Shared,
                initial_position=pulsar.InitialPosition.Earliest,
                receiver_queue_size=200,
            )
            until = w.session_end()
            receive_all(
                w, consumer, lambda: w.consuming() and (time.time() < until or not w.producing())
            )
        finally:
            client.close()

    def produce() -> None:
        w.wait_start()
        client = pulsar.Client(url, operation_timeout_seconds=30, logger=_quiet_pulsar_logger())
        try:
            producers = {
                s: client.create_producer(
                    PREFIX + s, batching_enabled=True, batching_max_publish_delay_ms=5
                )
                for s in seqs
            }

            def sent(stream: str, seq: int) -> Callable[[Any, Any], None]:
                confirm = w.confirmer("pulsar send", stream, seq)
                return lambda res, msg_id: confirm(None if res == pulsar.Result.Ok else res, msg_id)

            for i, _ in enumerate(w.paced(w.rate * 1.25, w.session_end())):
                s = "soak-p2a" if i % 5 == 4 else "soak-pulsar"
                n = seqs[s].next()
                producers[s].send_async(payload(s, n), sent(s, n))
            for p in producers.values():
                p.flush()
                p.close()
        finally:
            client.close()

    w.loop("pulsar-consumer", consume, w.consuming)
    w.loop("pulsar-producer", produce, w.producing)


def receive_all(w: Worker, consumer: Any, more: Callable[[], bool]) -> None:
    """Receive, record and acknowledge with a Pulsar consumer while ``more()``; close it."""
    import pulsar

    while more():
        try:
            msg = consumer.receive(timeout_millis=500)
        except pulsar.Timeout:
            continue
        w.got(msg.data())
        consumer.acknowledge(msg)
    consumer.close()


def _quiet_pulsar_logger() -> Any:
    import logging

    lg = logging.getLogger("soak.pulsar-client")
    lg.setLevel(logging.ERROR)
    return lg


def kafka_worker(w: Worker) -> None:
    from confluent_kafka import Consumer, KafkaError, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    boot = f"127.0.0.1:{w.ports['kafka']}"
    admin = AdminClient({"bootstrap.servers": boot})
    for fut in admin.create_topics(
        [NewTopic("soak-kafka", 4, 1), NewTopic("soak-k2m", 2, 1)]
    ).values():
        try:
            fut.result(30)
        except Exception as e:
            if "already exists" not in str(e).lower() and "TOPIC_ALREADY" not in str(e):
                w.note(f"kafka create topics: {e}")
    seqs = {s: Seq() for s in ("soak-kafka", "soak-k2m")}

    def member() -> Any:
        c = Consumer(
            {
                "bootstrap.servers": boot,
                "group.id": "soak-group",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": True,
                "auto.commit.interval.ms": 1000,
                "session.timeout.ms": 10000,
                "heartbeat.interval.ms": 1000,
            }
        )
        c.subscribe(["soak-kafka"])
        return c

    def consume() -> None:
        # Two members of one group; one of them leaves (close) and a new one joins each session.
        members = [member(), member()]
        try:
            until = w.session_end()
            while w.consuming() and (time.time() < until or not w.producing()):
                for c in members:
                    msg = c.poll(0.1)
                    if msg is None:
                        continue
                    if msg.error():
                        if msg.error().code() != KafkaError._PARTITION_EOF:
                            w.note(f"kafka consume: {msg.error()}")
                        continue
                    w.got(msg.value())
            leaving = random.randrange(2)
            members[leaving].close()
            members[leaving] = member()
            # The other member and the newcomer go on for a while before the next session.
            t = time.time() + 5
            while time.time() < t and w.consuming():
                for c in members:
                    msg = c.poll(0.1)
                    if msg is not None and not msg.error():
                        w.got(msg.value())
        finally:
            for c in members:
                c.close()

    def fatal(error: Any) -> None:
        if error.fatal():  # the reason; produce() then only says "Fatal error"
            w.note(f"kafka producer fatal: {error}")

    def produce() -> None:
        w.wait_start()
        p = Producer(
            {
                "bootstrap.servers": boot,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 5,
                "error_cb": fatal,
            }
        )

        for i, _ in enumerate(w.paced(w.rate * 1.25, w.session_end())):
            s = "soak-k2m" if i % 5 == 4 else "soak-kafka"
            n = seqs[s].next()
            confirm = w.confirmer("kafka produce", s, n)
            try:
                p.produce(s, payload(s, n), key=str(n).encode(), on_delivery=confirm)
            except Exception:
                p.poll(0)  # serves the error callback: a fatal error's reason
                raise
            p.poll(0)
        left = p.flush(30)
        if left:
            w.note(f"kafka producer: {left} messages unflushed at close")

    w.loop("kafka-consumer", consume, w.consuming)
    w.loop("kafka-producer", produce, w.producing)


def mqtt_worker(w: Worker) -> None:
    import paho.mqtt.client as mqtt

    port = w.ports["mqtt"]
    seqs = {s: Seq() for s in ("soak-mqtt", "soak-m2p")}
    connected = threading.Event()

    def consume() -> None:
        sub = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id="soak-mqtt-sub",
            clean_session=False,
            protocol=mqtt.MQTTv311,
        )

        def on_connect(c: Any, _u: Any, _f: Any, rc: Any, _p: Any) -> None:
            if rc == 0:
                c.subscribe([("soak-mqtt", 1), ("soak-k2m", 1)])
                connected.set()
            else:
                w.note(f"mqtt subscriber connect: {rc}")

        sub.on_connect = on_connect
        sub.on_message = lambda _c, _u, m: w.got(m.payload)
        sub.connect("127.0.0.1", port, keepalive=30)
        sub.loop_start()
        try:
            until = w.session_end()
            while w.consuming() and (time.time() < until or not w.producing()):
                time.sleep(0.2)
        finally:
            sub.disconnect()
            sub.loop_stop()
        if w.producing():
            time.sleep(random.uniform(1, 5))  # away: the session keeps what arrives

    def produce() -> None:
        w.wait_start()
        connected.wait(30)
        pub = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"soak-mqtt-pub-{random.randrange(1 << 30)}",
            clean_session=True,
            protocol=mqtt.MQTTv311,
        )
        pub.max_queued_messages_set(0)
        pub.connect("127.0.0.1", port, keepalive=30)
        pub.loop_start()
        pending: list[tuple[Any, str, int]] = []

        def settle(final: bool) -> None:
            deadline = time.time() + (15 if final else 0)
            while pending:
                info, s, n = pending[0]
                if info.is_published():
                    w.ack(s, n)
                    pending.pop(0)
                elif time.time() < deadline:
                    time.sleep(0.01)
                else:
                    break

        try:
            for i, _ in enumerate(w.paced(w.rate * 1.25, w.session_end())):
                s = "soak-m2p" if i % 5 == 4 else "soak-mqtt"
                n = seqs[s].next()
                info = pub.publish(s, payload(s, n), qos=1)
                if info.rc == mqtt.MQTT_ERR_NO_CONN:
                    # The broker went away (a kill): end the session, as an application
                    # would, rather than note every publish until paho reconnects.
                    raise ConnectionError("mqtt publisher: connection lost")
                if info.rc != mqtt.MQTT_ERR_SUCCESS:
                    w.note(f"mqtt publish {s}:{n}: rc {info.rc}")
                    continue
                pending.append((info, s, n))
                if len(pending) > 64:
                    settle(False)
            settle(True)
            if pending:
                w.note(f"mqtt publisher: {len(pending)} publishes without PUBACK at close")
        finally:
            pub.disconnect()
            pub.loop_stop()

    w.loop("mqtt-subscriber", consume, w.consuming)
    w.loop("mqtt-publisher", produce, w.producing)


def amqp_worker(w: Worker) -> None:
    import pika

    params = pika.ConnectionParameters("127.0.0.1", w.ports["amqp"], heartbeat=30)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("soak-amqp", durable=True)
    ch.queue_declare("soak-p2a", durable=True)
    ch.queue_bind("soak-p2a", "amq.topic", routing_key="soak-p2a")
    conn.close()
    seq = Seq()

    def consume() -> None:
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=200)

            def on_msg(c: Any, method: Any, _props: Any, body: bytes) -> None:
                w.got(body)
                c.basic_ack(method.delivery_tag)

            ch.basic_consume("soak-amqp", on_msg)
            ch.basic_consume("soak-p2a", on_msg)
            until = w.session_end()
            while w.consuming() and (time.time() < until or not w.producing()):
                conn.process_data_events(time_limit=0.5)
        finally:
            if conn.is_open:
                conn.close()

    def produce() -> None:
        w.wait_start()
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            for _ in w.paced(w.rate, w.session_end()):
                n = seq.next()
                try:
                    ch.basic_publish("", "soak-amqp", payload("soak-amqp", n), props)
                except (pika.exceptions.NackError, pika.exceptions.UnroutableError) as e:
                    w.note(f"amqp publish soak-amqp:{n}: {type(e).__name__}")
                    continue
                w.ack("soak-amqp", n)
        finally:
            if conn.is_open:
                conn.close()

    w.loop("amqp-consumer", consume, w.consuming)
    w.loop("amqp-publisher", produce, w.producing)


def admin_worker(w: Worker) -> None:
    """Create, write, read and delete topics through the admin API and a new connection each."""
    import pulsar
    import requests

    http = f"http://127.0.0.1:{w.ports['http']}/admin/v2/persistent/public/default"
    url = f"pulsar://127.0.0.1:{w.ports['pulsar']}"
    state = {"i": 0, "ok": 0}

    def one() -> None:
        w.wait_start()
        i = state["i"] = state["i"] + 1
        name = f"soak-tmp-{i}"
        partitioned = i % 2 == 0
        if partitioned:
            r = requests.put(f"{http}/{name}/partitions", json=2, timeout=30)
        else:
            r = requests.put(f"{http}/{name}", timeout=30)
        if r.status_code not in (200, 204):
            w.note(f"create {name}: HTTP {r.status_code} {r.text[:100]}")
            return
        client = pulsar.Client(url, operation_timeout_seconds=30, logger=_quiet_pulsar_logger())
        try:
            consumer = client.subscribe(
                PREFIX + name, "tmp-sub", initial_position=pulsar.InitialPosition.Earliest
            )
            producer = client.create_producer(PREFIX + name)
            for n in range(1, 21):
                producer.send(payload(name, n))
            got = set()
            deadline = time.time() + 30
            while len(got) < 20 and time.time() < deadline:
                try:
                    msg = consumer.receive(timeout_millis=1000)
                except pulsar.Timeout:
                    continue
                p = parse(msg.data())
                if p is not None:
                    got.add(p[1])
                consumer.acknowledge(msg)
            if len(got) != 20:
                w.note(f"{name}: read {len(got)} of 20")
            producer.close()
            consumer.close()
        finally:
            client.close()
        suffix = "/partitions" if partitioned else ""
        r = requests.delete(f"{http}/{name}{suffix}", params={"force": "true"}, timeout=30)
        if r.status_code not in (200, 204):
            w.note(f"delete {name}: HTTP {r.status_code} {r.text[:100]}")
            return
        listed = requests.get(http, timeout=30).json()
        if any(t == PREFIX + name or t.startswith(PREFIX + name + "-partition-") for t in listed):
            w.note(f"{name} still listed after delete")
            return
        state["ok"] += 1
        w.churns["admin-topics-ok"] += 1
        pause_until = time.time() + w.admin_s
        while time.time() < pause_until and w.producing():
            time.sleep(0.5)

    backlog_seq = Seq()

    def backlog() -> None:
        """A subscription nobody reads until the producers stop (a consumer far behind, at a
        twentieth of the rate): its ledger stays open and has entries in every entry log, so
        only the bookie's compaction can free those logs. Drained at the end."""
        client = pulsar.Client(url, operation_timeout_seconds=30, logger=_quiet_pulsar_logger())
        topic = PREFIX + "soak-backlog"
        try:

            def subscribe() -> Any:
                return client.subscribe(
                    topic,
                    "behind",
                    initial_position=pulsar.InitialPosition.Earliest,
                    receiver_queue_size=200,
                )

            if w.producing():
                subscribe().close()  # the subscription holds everything from the first send
                w.wait_start()
                producer = client.create_producer(topic, batching_enabled=False)
                for _ in w.paced(max(1.0, w.rate / 20), w.session_end()):
                    n = backlog_seq.next()
                    producer.send(payload("soak-backlog", n))
                    w.ack("soak-backlog", n)
                producer.close()
                return
            receive_all(w, subscribe(), w.consuming)
        finally:
            client.close()

    w.loop("admin-topic", one, w.producing)
    w.loop("backlog", backlog, w.consuming)


WORKERS: dict[str, Callable[[Worker], None]] = {
    "pulsar": pulsar_worker,
    "kafka": kafka_worker,
    "mqtt": mqtt_worker,
    "amqp": amqp_worker,
    "admin": admin_worker,
}


def worker_main(args: argparse.Namespace) -> None:
    w = Worker(args)
    try:
        WORKERS[args.worker](w)
    except Exception:
        w.note("setup: " + traceback.format_exc()[-300:])
    w.join()
    Path(args.out).write_text(json.dumps(w.result()))


# ----------------------------------------------------------------------------- broker side


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MB), open fds, threads and CPU seconds of a process."""
    with open(f"/proc/{pid}/status") as f:
        status = {k: v for k, _, v in (line.partition(":") for line in f)}
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024.0,
        "fds": float(len(os.listdir(f"/proc/{pid}/fd"))),
        "threads": float(int(status["Threads"])),
        "cpu_s": (int(fields[11]) + int(fields[12])) / ticks,
    }


def dir_size_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 1e6


def slope_per_hour(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (seconds), per hour."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    return 3600 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def check(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per stream: acknowledged, received (distinct), lost (acknowledged, never received),
    duplicates (receptions beyond the first)."""
    out: dict[str, dict[str, int]] = {}
    for stream, (prod, cons) in STREAMS.items():
        acked = set(results.get(prod, {}).get("acked", {}).get(stream, []))
        rx = results.get(cons, {}).get("received", {}).get(stream, [])
        seen = set(rx)
        out[stream] = {
            "acked": len(acked),
            "received": len(seen),
            "lost": len(acked - seen),
            "dups": len(rx) - len(seen),
        }
        if acked - seen:
            out[stream]["first_lost"] = min(acked - seen)
    return out


def stop_workers(workers: dict[str, subprocess.Popen[bytes]]) -> None:
    """Kill (by PID) the worker processes still running."""
    for p in workers.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def collect(workers: dict[str, subprocess.Popen[bytes]], scratch: Path) -> dict[str, Any]:
    """Each worker's result (what it wrote to ``<scratch>/<name>.json``) once it is stopped;
    a worker that wrote none counts one error."""
    stop_workers(workers)
    results: dict[str, Any] = {}
    for name, p in workers.items():
        out = scratch / f"{name}.json"
        if out.exists():
            results[name] = json.loads(out.read_text())
        else:
            results[name] = {"error_count": 1, "errors": [f"no result (exit {p.returncode})"]}
    return results


def print_streams(streams: dict[str, dict[str, int]], results: dict[str, Any]) -> None:
    """Each stream's counts and each client's first errors."""
    print()
    for name, st in streams.items():
        print(f"{name:12} {st}")
    for name, r in results.items():
        for e in r.get("errors", [])[:5]:
            print(f"client {name}: {e}")


#: Run as the broker with ``--tracemalloc``: SIGUSR1 writes a snapshot to ``<dir>/tm-<n>.snap``.
_TRACEMALLOC_BOOT = r"""
import signal, sys, tracemalloc
tracemalloc.start(int(sys.argv[1]))
out, n = sys.argv[2], [0]
def dump(_sig, _frame):
    n[0] += 1
    tracemalloc.take_snapshot().dump(f"{out}/tm-{n[0]:04d}.snap")
signal.signal(signal.SIGUSR1, dump)
from polybroker.cli import main
sys.argv = ["polybroker", *sys.argv[3:]]
sys.exit(main())
"""


def tracemalloc_growth(snaps: list[Path], top: int = 15) -> list[str]:
    """The lines whose allocations grew most from the first snapshot to the last."""
    import tracemalloc

    if len(snaps) < 2:
        return []
    first = tracemalloc.Snapshot.load(str(snaps[0]))
    last = tracemalloc.Snapshot.load(str(snaps[-1]))
    stats = last.compare_to(first, "lineno")
    return [str(st) for st in stats[:top]]


def log_problems(path: Path) -> tuple[Counter[str], int, list[str]]:
    """(lines per level, tracebacks, the first few lines at WARNING or above and tracebacks) of
    the broker's log (text lines ``<time> <level> <logger> ...``, or JSON lines)."""
    levels: Counter[str] = Counter()
    tracebacks, first = 0, []
    with path.open(errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    level = str(json.loads(line).get("level", "")).lower()
                except ValueError:
                    level = ""
            else:
                parts = line.split(" ", 2)
                level = parts[1].lower() if len(parts) > 2 else ""
            is_tb = line.startswith("Traceback")
            tracebacks += is_tb
            if level in ("debug", "info", "warning", "error", "critical"):
                levels[level] += 1
            if (level in ("warning", "error", "critical") or is_tb) and len(first) < 8:
                first.append(line.strip()[:300])
    return levels, tracebacks, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10, help="how long the load runs")
    ap.add_argument("--rate", type=float, default=200, help="msgs/s per protocol's own stream")
    ap.add_argument("--churn-seconds", type=float, default=60, help="mean life of a connection")
    ap.add_argument("--admin-seconds", type=float, default=15, help="pause between topics")
    ap.add_argument("--sample-seconds", type=float, default=5)
    ap.add_argument("--warmup-minutes", type=float, default=None, help="default: 20%% of run")
    ap.add_argument("--drain-seconds", type=float, default=180, help="longest drain at the end")
    ap.add_argument("--ledger-entries", type=int, default=20000, help="0: broker defaults")
    ap.add_argument(
        "--entry-log-mb", type=int, default=16, help="bookie entry log size (0: the defaults)"
    )
    ap.add_argument("--nice", type=int, default=10, help="niceness of the client processes")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument(
        "--tracemalloc",
        type=float,
        default=0,
        help="run the broker under tracemalloc, a snapshot every this many seconds after the "
        "warm-up; report the lines that grew most from the first snapshot to the last",
    )
    ap.add_argument("--tracemalloc-frames", type=int, default=1)
    ap.add_argument(
        "--kill-every",
        type=float,
        default=0,
        help="kill -9 the broker every this many seconds (0.5x-1.5x) while the load runs and "
        "start it again on the same data dir and ports (0: never)",
    )
    # worker mode (internal)
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--end", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return

    scratch = Path(tempfile.mkdtemp(prefix="polybroker-soak-"))
    conf = scratch / "broker.conf"
    lines = ["messagingProtocols=pulsar,kafka,mqtt,amqp"]
    if args.ledger_entries > 0:
        lines += [
            f"managedLedgerMaxEntriesPerLedger={args.ledger_entries}",
            "managedLedgerMinLedgerRolloverTimeMinutes=1",
        ]
    if args.entry_log_mb > 0:
        lines += [
            f"entryLogSizeLimit={args.entry_log_mb * 1024 * 1024}",
            "gcWaitTime=20000",
            "majorCompactionInterval=60",
        ]
    conf.write_text("\n".join(lines) + "\n")
    boot = ["-m", "polybroker"]
    if args.tracemalloc:
        boot = ["-c", _TRACEMALLOC_BOOT, str(args.tracemalloc_frames), str(scratch)]
    log_path = scratch / "broker.log"

    Broker = subprocess.Popen[bytes]

    def start_broker(ports: dict[str, int] | None) -> tuple[Broker, dict[str, int]]:
        """Start the standalone on ``ports`` (the workers' names; None: free ones) and wait
        until it is ready; return it and the ports it bound."""
        cmd = [
            os.path.realpath(sys.executable),
            *boot,
            "standalone",
            "--data-dir",
            str(scratch / "data"),
        ]
        for flag in PORT_FLAGS:
            cmd += [flag, str(ports[FLAG_LISTENERS[flag]] if ports else 0)]
        cmd += ["--config", str(conf)]
        with log_path.open("ab") as log:
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
        try:
            line = wait_for_line(process, READY, log_path, 60, "standalone")
        except BaseException:
            process.kill()
            process.wait()
            raise
        bound = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
        return process, {name: bound[key] for name, key in LISTENERS.items()}

    broker: Broker | None = None
    workers: dict[str, subprocess.Popen[bytes]] = {}
    samples: list[dict[str, float]] = []
    results: dict[str, dict[str, Any]] = {}
    cpu_before = 0.0  # CPU seconds of the brokers killed so far
    restarts: list[float] = []  # seconds from each kill -9 until the broker was ready again
    try:
        broker, ports = start_broker(None)
        t0 = time.time()
        start = t0 + 15  # consumers subscribe first
        end = start + args.minutes * 60
        for name in WORKERS:
            wcmd = [
                "nice",
                "-n",
                str(args.nice),
                os.path.realpath(sys.executable),
                os.path.realpath(__file__),
                "--worker",
                name,
                "--ports",
                json.dumps(ports),
                "--start",
                str(start),
                "--end",
                str(end),
                "--rate",
                str(args.rate),
                "--churn-seconds",
                str(args.churn_seconds),
                "--drain-seconds",
                str(args.drain_seconds),
                "--admin-seconds",
                str(args.admin_seconds),
                "--out",
                str(scratch / f"{name}.json"),
            ]
            with (scratch / f"{name}.log").open("wb") as wlog:
                workers[name] = subprocess.Popen(wcmd, stdout=wlog, stderr=subprocess.STDOUT)
        hard_end = end + args.drain_seconds + 180
        next_print = t0
        warm_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else args.minutes / 5)
        next_snap = start + warm_s
        next_kill = start + args.kill_every * random.uniform(0.5, 1.5) if args.kill_every else end
        while any(p.poll() is None for p in workers.values()) and time.time() < hard_end:
            if broker.poll() is not None:
                raise RuntimeError(f"broker exited with {broker.returncode} during the soak")
            if time.time() >= next_kill and time.time() < end:
                cpu_before += proc_sample(broker.pid)["cpu_s"]
                killed = time.time()
                broker.kill()
                broker.wait()
                if broker.stdout is not None:
                    broker.stdout.close()
                broker, _ = start_broker(ports)
                restarts.append(time.time() - killed)
                print(f"t={killed - start:7.0f}s kill -9; ready again in {restarts[-1]:.2f}s")
                next_kill = time.time() + args.kill_every * random.uniform(0.5, 1.5)
            s = proc_sample(broker.pid)
            s["cpu_s"] += cpu_before
            s["t"] = time.time() - start
            s["data_mb"] = dir_size_mb(scratch / "data")
            # Entry logs and index: what garbage collection and compaction keep in check (the
            # journal, the rest of the data dir, rolls at 2 GB).
            s["ledgers_mb"] = dir_size_mb(scratch / "data" / "bookie" / "ledgers")
            samples.append(s)
            if time.time() >= next_print:
                print(
                    f"t={s['t']:7.0f}s rss={s['rss_mb']:6.1f}MB fds={s['fds']:4.0f} "
                    f"threads={s['threads']:3.0f} cpu={s['cpu_s']:7.1f}s "
                    f"data={s['data_mb']:7.1f}MB ledgers={s['ledgers_mb']:6.1f}MB",
                    flush=True,
                )
                next_print += 60
            if args.tracemalloc and next_snap <= time.time() <= end:
                broker.send_signal(signal.SIGUSR1)
                next_snap += args.tracemalloc
            time.sleep(args.sample_seconds)
        results = collect(workers, scratch)
        if broker.poll() is not None:
            raise RuntimeError(f"broker exited with {broker.returncode} during the soak")
        final = proc_sample(broker.pid)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        # The workers, reaped above (and the brokers killed, reaped too: their CPU is not).
        clients_cpu_s = ru.ru_utime + ru.ru_stime - cpu_before
    finally:
        stop_workers(workers)
        if broker is not None and broker.poll() is None:
            broker.send_signal(signal.SIGTERM)
            try:
                broker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                broker.kill()
                broker.wait()
        if broker is not None and broker.stdout is not None:
            broker.stdout.close()

    with (scratch / "samples.csv").open("w") as f:
        keys = ["t", "rss_mb", "fds", "threads", "cpu_s", "data_mb", "ledgers_mb"]
        f.write(",".join(keys) + "\n")
        for s in samples:
            f.write(",".join(f"{s[k]:.2f}" for k in keys) + "\n")

    streams = check(results)
    run = [s for s in samples if 0 <= s["t"] <= args.minutes * 60]
    warm = warm_s
    growth = tracemalloc_growth(sorted(scratch.glob("tm-*.snap")))
    after = [s for s in run if s["t"] >= warm]
    acked_total = sum(v["acked"] for v in streams.values())
    cpu_s = run[-1]["cpu_s"] - run[0]["cpu_s"] if run else 0.0
    levels, tracebacks, first = log_problems(log_path)
    slope = slope_per_hour([s["t"] for s in after], [s["rss_mb"] for s in after])
    fd_slope = slope_per_hour([s["t"] for s in after], [s["fds"] for s in after])
    summary: dict[str, Any] = {
        "minutes": args.minutes,
        "rate_per_protocol": args.rate,
        "churn_seconds": args.churn_seconds,
        "kills": len(restarts),
        "restart_s_max": round(max(restarts), 2) if restarts else None,
        "samples": len(samples),
        "rss_mb_start": round(run[0]["rss_mb"], 1) if run else None,
        "rss_mb_after_warmup": round(after[0]["rss_mb"], 1) if after else None,
        "rss_mb_middle": round(run[len(run) // 2]["rss_mb"], 1) if run else None,
        "rss_mb_end": round(run[-1]["rss_mb"], 1) if run else None,
        "rss_mb_max": round(max(s["rss_mb"] for s in samples), 1) if samples else None,
        "rss_slope_mb_per_hour": round(slope, 2) if slope is not None else None,
        "fds_start": run[0]["fds"] if run else None,
        "fds_end": run[-1]["fds"] if run else None,
        "fds_max": max(s["fds"] for s in samples) if samples else None,
        "fds_slope_per_hour": round(fd_slope, 2) if fd_slope is not None else None,
        "threads_start": run[0]["threads"] if run else None,
        "threads_end": run[-1]["threads"] if run else None,
        "threads_max": max(s["threads"] for s in samples) if samples else None,
        "final_rss_mb": round(final["rss_mb"], 1),
        "final_fds": final["fds"],
        "final_threads": final["threads"],
        "acked_msgs": acked_total,
        "broker_cpu_s": round(cpu_s, 1),
        "cpu_us_per_msg": round(1e6 * cpu_s / acked_total, 1) if acked_total else None,
        "clients_cpu_s": round(clients_cpu_s, 1),
        "lost": sum(v["lost"] for v in streams.values()),
        "dups": sum(v["dups"] for v in streams.values()),
        "data_mb_end": round(run[-1]["data_mb"], 1) if run else None,
        "data_mb_max": round(max(s["data_mb"] for s in samples), 1) if samples else None,
        "ledgers_mb_end": round(run[-1]["ledgers_mb"], 1) if run else None,
        "ledgers_mb_max": round(max(s["ledgers_mb"] for s in samples), 1) if samples else None,
        "log_errors": levels["error"] + levels["critical"],
        "log_warnings": levels["warning"],
        "log_tracebacks": tracebacks,
        "client_errors": {n: r.get("error_count", 0) for n, r in results.items()},
        "sessions": {n: r.get("sessions", {}) for n, r in results.items()},
        "streams": streams,
        "tracemalloc_growth": growth[:5],
        "scratch": str(scratch) if args.keep else None,
    }
    print_streams(streams, results)
    for line in first:
        print(f"broker log: {line}")
    for line in growth:
        print(f"tracemalloc growth: {line}")
    for k, v in summary.items():
        if k not in ("streams", "sessions", "client_errors"):
            print(f"{k:24} {v}")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
