"""Spark benchmark: reading one topic's backlog with format("pulsar") vs the official client.

In one run, against one ``polybroker standalone`` process started here (ports 0, stopped by PID)
that seals a ledger every ``--entries-per-ledger`` entries, so the backlog (kept by a subscription)
lies in sealed ledgers but for the last one, as an older backlog does:

(a) fill:    --messages messages of --size bytes published with batching to one topic;
(b) client:  the same backlog read as a user reads it with the official Pulsar Python client: one
             process, one Reader from the earliest message, a ``read_next`` loop counting
             messages and bytes. Timed from the reader's creation to the last ``read_next``
             (``reader_s``: the creation alone); the client (its connection) is made before
             the clock starts, as the Spark cases' session is;
(c) batch:   ``spark.read.format("pulsar")`` of the backlog into an aggregation (count and total
             value length), on local[2] with the source's default options (``--min-partitions``
             and ``--entries-per-partition`` override them). Timed from ``load()`` to the
             collected result: the schema and planning calls to the admin API, Spark's planning,
             the tasks reading (from the bookies by default, ``spark_batch``; through the broker
             with ``readFromStorage=false``, ``spark_batch_broker``) and the aggregation. The
             session and its Python workers are started before, and every Spark case runs
             ``--warmup`` times untimed (the JVM compiles its per-row code), as in a running
             application: Spark's start-up and warm-up are not in the figures;
(d) stream:  ``readStream`` of the backlog with ``trigger(availableNow=True)`` into the noop sink,
             timed from ``load()`` to the end of the query: Spark's query start-up (it starts
             a Python process for the source, ``to_first_trigger_s``; the session is
             ``local_session``'s, whose fork server starts it), its planning and checkpoint
             writes, and the tasks reading. ``spark_rows_per_s`` (a separate column, not the
             figure compared) is Spark's own rate: rows over the triggers' time
             (``processedRowsPerSecond``), which leaves out the query's start and end;
(e) in memory: a Python data source of the same columns and as many partitions whose reads
             yield ready record batches, into the aggregation of (c): Spark's own cost per row;
(f) stream in memory: the same source as a stream of one micro-batch, timed as (d): what Spark
             itself costs a streaming query of this many rows, nothing read.

Rows/s of each case and its ratio to (b); CPU seconds of every process involved (this one with
the client's threads, Spark's JVM and Python workers, the broker with its bookie) per case, a
figure that moves less than rows/s on a shared machine. Every case, the client's included, runs
``--repeat`` times, alternating, and keeps its best run (``runs`` lists them all). Prints a
table, then one JSON line as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

_READY = "polybroker standalone ready "

# Run as a script, this folder comes first on sys.path, and benchmarks/pulsar.py would hide the
# Pulsar client package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system, with reaped children's) of ``root`` and every live process
    under it, by pid (Linux ``/proc``; empty elsewhere)."""
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        used[pid] = sum(int(x) for x in fields[11:15]) / _TICK
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return {pid: used[pid] for pid in tree if pid in used}


class CpuMeter:
    """CPU seconds spent by this process tree between ``start`` and ``stop``, and by ``broker``
    (a child) alone."""

    def __init__(self, broker: int) -> None:
        self.broker = broker
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.before = tree_cpu(os.getpid())

    def stop(self) -> dict[str, float]:
        after = tree_cpu(os.getpid())
        spent = {pid: t - self.before.get(pid, 0.0) for pid, t in after.items()}
        return {
            "cpu_s": round(sum(spent.values()), 3),
            "broker_cpu_s": round(spent.get(self.broker, 0.0), 3),
        }


def start_broker(
    data_dir: Path, entries_per_ledger: int
) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start a standalone broker that seals a ledger every ``entries_per_ledger`` entries;
    return it with its service and admin URLs."""
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = data_dir.parent / "broker.conf"
    conf.write_text(
        f"managedLedgerMaxEntriesPerLedger={entries_per_ledger}\n"
        "managedLedgerMinLedgerRolloverTimeMinutes=0\n"
    )
    cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(data_dir)]
    cmd += ["--config", str(conf)]
    for flag in ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port", "--amqp-port"):
        cmd += [flag, "0"]
    log = open(data_dir.parent / "standalone.log", "wb")  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(1):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buffered += chunk
            for line in buffered.decode(errors="replace").splitlines():
                if line.startswith(_READY):
                    ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                    return (
                        proc,
                        f"pulsar://127.0.0.1:{ports['brokerServicePort']}",
                        f"http://127.0.0.1:{ports['webServicePort']}",
                    )
    proc.kill()
    raise RuntimeError("standalone did not start")


def fill(client: Any, topic: str, count: int, size: int) -> float:
    """Publish ``count`` messages of ``size`` bytes with batching; return the seconds taken."""
    producer = client.create_producer(
        topic,
        batching_enabled=True,
        batching_max_messages=1000,
        batching_max_allowed_size_in_bytes=1 << 20,
        batching_max_publish_delay_ms=5,
        block_if_queue_full=True,
        max_pending_messages=20_000,
    )
    payload = b"x" * size
    started = time.perf_counter()
    for _ in range(count):
        producer.send_async(payload, None)
    producer.flush()
    producer.close()
    return time.perf_counter() - started


def read_with_client(client: Any, topic: str, count: int) -> dict[str, float]:
    """(b): one Reader from the earliest message; rows/s over ``count`` messages."""
    import pulsar

    started = time.perf_counter()
    reader = client.create_reader(topic, pulsar.MessageId.earliest, receiver_queue_size=5000)
    created = time.perf_counter()
    total = 0
    for _ in range(count):
        total += len(reader.read_next(30_000).data())
    seconds = time.perf_counter() - started
    reader.close()
    return {
        "rows": count,
        "bytes": total,
        "seconds": seconds,
        "rows_per_s": count / seconds,
        "reader_s": round(created - started, 4),
    }


def keep_backlog(admin_url: str, topic: str) -> None:
    """Create the topic with a subscription: its sealed ledgers are its backlog, kept."""
    import urllib.request

    path = admin_url + "/admin/v2/" + topic.replace("://", "/")
    for url in (path, path + "/subscription/backlog"):
        with urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=30):
            pass


def read_with_spark_batch(spark: Any, options: dict[str, str], count: int) -> dict[str, float]:
    """(c): a batch read of the backlog into count + sum(length(value))."""
    from pyspark.sql import functions as F

    started = time.perf_counter()
    df = spark.read.format("pulsar").options(**options).load()
    row = df.agg(F.count("*").alias("n"), F.sum(F.length("value")).alias("b")).collect()[0]
    seconds = time.perf_counter() - started
    if row["n"] != count:
        raise AssertionError(f"batch read {row['n']} rows, expected {count}")
    return {
        "rows": count,
        "bytes": int(row["b"]),
        "seconds": seconds,
        "rows_per_s": count / seconds,
        "partitions": df.rdd.getNumPartitions(),
    }


def in_memory_source(size: int, rows: int, partitions: int) -> Any:
    """(e) and (f): a Python data source of the pulsar source's columns whose partitions yield
    ready record batches of ``size``-byte values: what Spark itself costs per row, nothing read.
    Its stream reader offers the ``rows`` rows as one micro-batch of ``partitions`` partitions."""
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceReader,
        DataSourceStreamReader,
        InputPartition,
    )

    from polybroker.spark.source import READ_SCHEMA

    class Part(InputPartition):
        def __init__(self, rows: int) -> None:
            self.rows = rows

    def split(n: int) -> list[InputPartition]:
        return [Part(n // partitions + (i < n % partitions)) for i in range(partitions)]

    def ready(partition: InputPartition) -> Any:
        import pyarrow as pa

        from polybroker.spark.reading import arrow_schema

        schema = arrow_schema()
        left = partition.rows  # type: ignore[attr-defined]
        while left > 0:
            n = min(left, 10_000)
            left -= n
            offsets = pa.py_buffer(bytes(4 * (n + 1)))
            ts = schema.field("__publishTime").type
            yield pa.RecordBatch.from_arrays(
                [
                    pa.nulls(n, pa.binary()),
                    pa.array([b"x" * size] * n, pa.binary()),
                    pa.repeat(pa.scalar("persistent://public/default/bench"), n),
                    pa.array([b"\x08\x05\x10\x06\x20\x81\x01\x30\x02"] * n, pa.binary()),
                    pa.repeat(pa.scalar(1_700_000_000_000_000, ts), n),
                    pa.nulls(n, ts),
                    pa.MapArray.from_arrays(
                        pa.Array.from_buffers(pa.int32(), n + 1, [None, offsets]),
                        pa.array([], pa.string()),
                        pa.array([], pa.string()),
                    ),
                ],
                schema=schema,
            )

    class Reader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return split(rows)

        def read(self, partition: InputPartition) -> Any:
            return ready(partition)

    class StreamReader(DataSourceStreamReader):
        def initialOffset(self) -> dict:
            return {"rows": 0}

        def latestOffset(self) -> dict:
            return {"rows": rows}

        def partitions(self, start: dict, end: dict) -> list[InputPartition]:
            n = end["rows"] - start["rows"]
            return split(n) if n > 0 else []

        def read(self, partition: InputPartition) -> Any:
            return ready(partition)

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "bench_in_memory"

        def schema(self) -> Any:
            return READ_SCHEMA

        def reader(self, schema: Any) -> DataSourceReader:
            return Reader()

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return StreamReader()

    return Source


def read_in_memory(spark: Any, count: int) -> dict[str, float]:
    """(e): the in-memory source into the same aggregation as (c)."""
    from pyspark.sql import functions as F

    started = time.perf_counter()
    df = spark.read.format("bench_in_memory").load()
    row = df.agg(F.count("*").alias("n"), F.sum(F.length("value")).alias("b")).collect()[0]
    seconds = time.perf_counter() - started
    if row["n"] != count:
        raise AssertionError(f"in-memory read {row['n']} rows, expected {count}")
    return {"rows": count, "seconds": seconds, "rows_per_s": count / seconds}


def read_with_spark_stream(
    spark: Any, fmt: str, options: dict[str, str], count: int, checkpoint: Path
) -> dict[str, float]:
    """(d) and (f): availableNow over the backlog into the noop sink, timed from ``load()``.
    Besides the total, the seconds from ``load()`` to the first trigger's start (Spark's query
    start-up, which starts the source's Python runner), the seconds in triggers
    (``triggerExecution``) and Spark's own rate over them."""
    began = time.time()
    started = time.perf_counter()
    query = (
        spark.readStream.format(fmt)
        .options(**options)
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    progress = query.recentProgress
    rows = sum(p["numInputRows"] for p in progress)
    if rows != count:
        raise AssertionError(f"stream read {rows} rows, expected {count}")
    first = datetime.fromisoformat(progress[0]["timestamp"]).timestamp() if progress else began
    trigger_s = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    return {
        "rows": rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "to_first_trigger_s": round(first - began, 3),
        "trigger_s": trigger_s,
        "spark_rows_per_s": rows / trigger_s if trigger_s else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument(
        "--entries-per-partition",
        type=int,
        default=None,
        help="maxEntriesPerPartition (default: the source's)",
    )
    parser.add_argument(
        "--min-partitions",
        type=int,
        default=None,
        help="minPartitions (default: the source's, the driver's CPU count)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case (best)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed runs of each Spark case before"
    )
    parser.add_argument(
        "--entries-per-ledger",
        type=int,
        default=100,
        help="managedLedgerMaxEntriesPerLedger: the backlog's sealed ledgers hold this many",
    )
    args = parser.parse_args()

    import pulsar

    from polybroker.spark.session import local_session

    with tempfile.TemporaryDirectory(prefix="spark-bench-") as tmp:
        root = Path(tmp)
        proc, service_url, admin_url = start_broker(root / "data", args.entries_per_ledger)
        client = None
        spark = None
        best: dict[str, dict[str, Any]] = {}
        try:
            log = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
            client = pulsar.Client(service_url, logger=log)
            topic = "persistent://public/default/bench"
            keep_backlog(admin_url, topic)
            fill_s = fill(client, topic, args.messages, args.size)
            meter = CpuMeter(proc.pid)

            def measured(run: Any, *run_args: Any) -> dict[str, float]:
                meter.start()
                got = run(*run_args)
                got.update(meter.stop())
                got["cpu_us_per_row"] = round(got["cpu_s"] / got["rows"] * 1e6, 3)
                return dict(got)

            spark = local_session("polybroker-spark-bench")
            spark.sparkContext.setLogLevel("ERROR")
            options = {"service.url": service_url, "admin.url": admin_url, "topic": topic}
            if args.entries_per_partition is not None:
                options["maxEntriesPerPartition"] = str(args.entries_per_partition)
            if args.min_partitions is not None:
                options["minPartitions"] = str(args.min_partitions)
            # Warm the session and the Python workers on a tiny read first.
            spark.read.format("pulsar").options(
                **options, endingOffsets=json.dumps({topic: "0:1"})
            ).load().count()
            broker_options = {**options, "readFromStorage": "false"}
            parts = spark.read.format("pulsar").options(**options).load().rdd.getNumPartitions()
            spark.dataSource.register(in_memory_source(args.size, args.messages, parts))
            n = args.messages
            cases: dict[str, tuple[Any, ...]] = {
                "client": (read_with_client, client, topic, n),
                "spark_batch": (read_with_spark_batch, spark, options, n),
                "spark_batch_broker": (read_with_spark_batch, spark, broker_options, n),
                "spark_stream": (
                    read_with_spark_stream,
                    spark,
                    "pulsar",
                    {**options, "startingOffsets": "earliest"},
                    n,
                    root / "ckpt",
                ),
                "spark_in_memory": (read_in_memory, spark, n),
                "spark_stream_in_memory": (
                    read_with_spark_stream,
                    spark,
                    "bench_in_memory",
                    {},
                    n,
                    root / "ckpt",
                ),
            }
            # Untimed runs of every Spark case first: the JVM compiles its per-row code as a
            # long-running application has. Then alternate the cases, the client's too, and keep
            # each one's best run (other jobs on the machine come and go).
            for w in range(args.warmup):
                for name, (run, *run_args) in cases.items():
                    if name.startswith("spark_stream"):
                        run_args[-1] = root / f"{name}-warm{w}"
                    if name != "client":
                        run(*run_args)
            for r in range(args.repeat):
                for name, (run, *run_args) in cases.items():
                    if name.startswith("spark_stream"):
                        run_args[-1] = root / f"{name}-ckpt{r}"
                    got = measured(run, *run_args)
                    seen = best.get(name, {"rows_per_s": 0.0, "runs": []})
                    runs = [*seen["runs"], round(got["rows_per_s"])]
                    kept = max(seen, got, key=lambda x: x["rows_per_s"]) | {"runs": runs}
                    if "to_first_trigger_s" in got:
                        kept["to_first_trigger_runs"] = [
                            *seen.get("to_first_trigger_runs", []),
                            got["to_first_trigger_s"],
                        ]
                    best[name] = kept
        finally:
            if spark is not None:
                spark.stop()
            if client is not None:
                client.close()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    client_rps = best["client"]["rows_per_s"]
    result: dict[str, Any] = {
        "messages": args.messages,
        "size": args.size,
        "cpus": os.cpu_count(),
        "fill_rows_per_s": args.messages / fill_s,
        **best,
        **{
            f"{name[6:]}_vs_client": best[name]["rows_per_s"] / client_rps
            for name in best
            if name != "client"
        },
        # Each round's ratio to the client's run of the same round (other jobs on the machine
        # come and go between rounds, less within one).
        **{
            f"{name[6:]}_vs_client_rounds": [
                round(x / c, 2)
                for x, c in zip(best[name]["runs"], best["client"]["runs"], strict=True)
            ]
            for name in best
            if name != "client"
        },
    }
    print(
        f"{'case':<24}{'rows/s':>10}{'vs client':>10}{'seconds':>9}{'cpu s':>8}{'us/row':>8}"
        f"{'spark own':>11}  vs client by round"
    )
    for name in best:
        r = result[name]
        ratio = r["rows_per_s"] / client_rps
        rounds = result.get(f"{name[6:]}_vs_client_rounds", [])
        own = f"{r['spark_rows_per_s']:>11.0f}" if "spark_rows_per_s" in r else f"{'':>11}"
        print(
            f"{name:<24}{r['rows_per_s']:>10.0f}{ratio:>10.2f}{r['seconds']:>9.2f}"
            f"{r.get('cpu_s', 0.0):>8.2f}{r.get('cpu_us_per_row', 0.0):>8.2f}{own}"
            f"  {' '.join(f'{x:.2f}' for x in rounds)}"
        )
    print(
        "spark own: Spark's rate over its triggers' time (processedRowsPerSecond), not the "
        "figure compared; the client's time includes its reader's creation"
    )
    for name in best:
        if "to_first_trigger_runs" in best[name]:
            print(
                f"{name}: seconds from load() to the first trigger by round: "
                + " ".join(f"{x:.2f}" for x in best[name]["to_first_trigger_runs"])
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
