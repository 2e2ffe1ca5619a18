"""Cluster benchmark: ZooKeeper + 3 bookies + 2 brokers (E=3, Qw=2, Qa=2) against one standalone
broker, with the official Pulsar client, in the same run.

Cases:
  throughput  --messages messages of 100 bytes to a topic with 8 partitions (spread over both
              brokers in the cluster), batching on, one producer and one Shared consumer in this
              process: end-to-end msgs/s (messages / (last receive - first send)), end-to-end
              latency p50/p99, and the CPU seconds the polybroker processes spent per message
              (brokers and bookies, or the standalone process; ZooKeeper and the client are not
              counted). Two cores cannot show scale-out: CPU per message is the figure to hold
              (target: cluster at most 1.5x standalone). Each side also reports the entries
              its partitions stored (internal stats), messages per entry and CPU per entry
              (the cluster's split into brokers and bookies): the producer batches by time, so
              messages per entry, and with it CPU per message, move with timing, while CPU
              per entry moves far less. Per entry too, over all of a side's processes: user and
              system time, and wake-ups (voluntary context switches: each bookie round trip,
              journal hand-off and answer costs some), and the cluster's brokers and bookies
              apart; and the share of entries the brokers read from the bookies, not their
              entry caches (cache miss %). --repeat rounds, each running both sides
              (alternating which goes first); medians, and each round's ratio.
  broker-kill while producing at --rate msgs/s, kill -9 the broker that owns some partitions
              (the client's service URL names the other one, as a load balancer would): seconds
              until every partition acknowledged a send again (target: under 5 s). ZooKeeper
              sessions are --session-ms long: a dead broker's bundles are free after that.
  bookie-kill a spare 4th bookie joins; while producing, kill -9 a bookie the partitions' ledgers
              write to: seconds until every partition acknowledged a send again (target: 2 s).

Prints a table, then one JSON line as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before the sys.path filter below, which takes this folder (and benchlib) off the path.
from benchlib import percentile

# Keep this folder off the path so `import pulsar` is the client, not benchmarks/pulsar.py.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
# The ZooKeeper launcher the tests use (Debian's zookeeper package).
sys.path.insert(0, str(_HERE.parent / "tests" / "contract"))

import pulsar  # noqa: E402
from zk_server import ZooKeeperServer  # noqa: E402

PARTITIONS = 8
SIZE = 100
REPLICATION = {
    "managedLedgerDefaultEnsembleSize": 3,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
}


def cpu_seconds(pid: int) -> float:
    """CPU time every thread of a process has run so far (scheduler statistics, in ns; the
    clock-tick counters of /proc/<pid>/stat are too coarse for short runs)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


def kernel_split(pid: int) -> tuple[float, float, int]:
    """(user seconds, system seconds, voluntary context switches) of every thread of a process
    so far: the clock-tick counters of /proc/<pid>/stat (10 ms steps, so only a split of
    ``cpu_seconds``) and each thread's switches, one per time it slept (a wake-up each)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            switches += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return int(fields[11]) / tick, int(fields[12]) / tick, switches


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    ready: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def port(self, key: str) -> int:
        for item in self.ready.split():
            k, _, v = item.partition("=")
            if k == key:
                return int(v)
        raise KeyError(key)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(cmd: list[str], marker: str, log: Path, timeout: float = 60.0) -> Proc:
    """Start ``polybroker ...`` and wait (bounded) for its line starting with ``marker``."""
    with open(log, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "polybroker", *cmd], stdout=subprocess.PIPE, stderr=err
        )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        while True:
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")
            if not sel.select(1.0):
                continue
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{cmd[0]} exited: {log.read_text()[-2000:]}")
            seen += chunk
            for line in seen.decode(errors="replace").splitlines():
                if line.startswith(marker):
                    return Proc(process, line[len(marker) :])


def write_conf(path: Path, settings: dict[str, object]) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    return path


PORT_FLAGS = ["--pulsar-port", "0", "--http-port", "0", "--kafka-port", "0"]
PORT_FLAGS += ["--mqtt-port", "0", "--amqp-port", "0"]


class Cluster:
    """ZooKeeper, bookies and brokers as processes under one directory."""

    def __init__(self, root: Path, session_ms: int) -> None:
        self.root = root
        self.session_ms = session_ms
        self.zk = ZooKeeperServer.start(root / "zk")
        self.url = self.zk.url("/bench")
        self.bookies: list[Proc] = []
        self.brokers: list[Proc] = []
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "polybroker",
                "initialize-cluster-metadata",
                "--cluster",
                "bench",
                "--metadata-store",
                self.url,
            ],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.decode())

    def add_bookie(self) -> Proc:
        n = len(self.bookies) + 1
        cmd = ["bookie", "--data-dir", str(self.root / f"bookie-{n}"), "--port", "0"]
        cmd += ["--bind", "127.0.0.1", "--metadata", self.url]
        bookie = spawn(cmd, "bookie listening on ", self.root / f"bookie-{n}.log")
        self.bookies.append(bookie)
        return bookie

    def add_broker(self) -> Proc:
        n = len(self.brokers) + 1
        conf = write_conf(
            self.root / f"broker-{n}.conf",
            {
                **REPLICATION,
                "metadataStoreSessionTimeoutMillis": self.session_ms,
                "loadBalancerSheddingEnabled": "false",
                "logLevel": "warning",
            },
        )
        cmd = ["broker", "--metadata", self.url, "--cluster", "bench", "--bind", "127.0.0.1"]
        cmd += ["--config", str(conf), *PORT_FLAGS]
        broker = spawn(cmd, "polybroker broker ready ", self.root / f"broker-{n}.log")
        self.brokers.append(broker)
        return broker

    def pids(self) -> list[int]:
        return [p.pid for p in self.bookies + self.brokers if p.process.poll() is None]

    def close(self) -> None:
        for p in self.brokers + self.bookies:
            p.stop()
        self.zk.stop()


def http_put(url: str, body: Any) -> None:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"content-type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=60).read()


def http_get(url: str) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=60).read())


def cache_counts(http_urls: list[str]) -> tuple[float, float]:
    """Entries the brokers at ``http_urls`` read from their entry caches and from the bookies
    so far (``pulsar_ml_cache_hits_total``, ``pulsar_ml_cache_misses_total``)."""
    hits = misses = 0.0
    for url in http_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                series, _, value = line.rpartition(" ")
                name = series.partition("{")[0]
                if name == "pulsar_ml_cache_hits_total":
                    hits += float(value)
                elif name == "pulsar_ml_cache_misses_total":
                    misses += float(value)
    return hits, misses


def throughput(
    service_url: str,
    http_url: str,
    topic: str,
    n: int,
    roles: dict[str, list[int]],
    broker_urls: list[str],
) -> dict[str, float]:
    """Send ``n`` messages through a fresh partitioned topic and receive them all; CPU of the
    processes in ``roles`` (role name -> pids), per message and per stored entry, and the share
    of entries the brokers (``broker_urls``) read from the bookies rather than their caches."""
    http_put(f"{http_url}/admin/v2/persistent/public/default/{topic}/partitions", PARTITIONS)
    client = pulsar.Client(
        service_url,
        operation_timeout_seconds=60,
        io_threads=2,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),
    )
    full = f"persistent://public/default/{topic}"
    latencies: list[float] = []
    done = threading.Event()
    last = [0.0]

    def listener(consumer: Any, msg: Any) -> None:
        now = time.monotonic_ns()
        latencies.append((now - struct.unpack_from(">q", msg.data())[0]) / 1e6)
        consumer.acknowledge(msg)
        if len(latencies) >= n:
            last[0] = time.monotonic()
            done.set()

    client.subscribe(
        full,
        "bench",
        consumer_type=pulsar.ConsumerType.Shared,
        message_listener=listener,
        receiver_queue_size=2000,
    )
    producer = client.create_producer(
        full,
        batching_enabled=True,
        batching_max_publish_delay_ms=1,
        block_if_queue_full=True,
        max_pending_messages=2000,
    )
    filler = b"x" * (SIZE - 8)
    cpu0 = {p: cpu_seconds(p) for pids in roles.values() for p in pids}
    split0 = {p: kernel_split(p) for p in cpu0}
    hits0, misses0 = cache_counts(broker_urls)
    start = time.monotonic()
    for i in range(n):
        producer.send_async(
            struct.pack(">q", time.monotonic_ns()) + filler, None, partition_key=str(i)
        )
    producer.flush()
    if not done.wait(300):
        raise RuntimeError(f"received {len(latencies)} of {n}")
    cpu_by_pid = {p: cpu_seconds(p) - c for p, c in cpu0.items()}
    split_by_pid = {
        p: tuple(b - a for a, b in zip(split0[p], kernel_split(p), strict=True)) for p in cpu0
    }
    cpu = sum(cpu_by_pid.values())
    hits1, misses1 = cache_counts(broker_urls)
    client.close()
    entries = stored_entries(http_url, topic)
    out = {
        "msgs_per_s": n / (last[0] - start),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "cpu_us_per_msg": cpu / n * 1e6,
        "entries": float(entries),
        "msgs_per_entry": n / entries,
        "cpu_us_per_entry": cpu / entries * 1e6,
        "cache_miss_pct": 100 * (misses1 - misses0) / max(1.0, hits1 - hits0 + misses1 - misses0),
    }
    for role, role_pids in roles.items():
        out[f"{role}_us_per_entry"] = sum(cpu_by_pid[p] for p in role_pids) / entries * 1e6
    # Where the CPU goes, over every process of the side: user and system time per entry, and
    # wake-ups (voluntary context switches) per entry.
    for i, name in enumerate(("user_us_per_entry", "sys_us_per_entry", "wakeups_per_entry")):
        scale = 1e6 if i < 2 else 1
        out[name] = sum(split_by_pid[p][i] for p in cpu0) / entries * scale
        if len(roles) > 1:  # each role's own share (brokers, bookies)
            for role, role_pids in roles.items():
                share = sum(split_by_pid[p][i] for p in role_pids)
                out[f"{role}_{name}"] = share / entries * scale
    return out


def stored_entries(http_url: str, topic: str) -> int:
    """Entries the partitions of ``topic`` stored (each partition's internal stats; a cluster
    broker redirects to the owner)."""
    total = 0
    for i in range(PARTITIONS):
        stats = http_get(
            f"{http_url}/admin/v2/persistent/public/default/{topic}-partition-{i}/internalStats"
        )
        total += int(stats["entriesAddedCounter"])
    return total


class PacedSender:
    """Sends to a partitioned topic at a fixed rate; records acknowledgement times per partition."""

    def __init__(self, service_url: str, topic: str, rate: int) -> None:
        self.client = pulsar.Client(
            service_url,
            operation_timeout_seconds=60,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),
        )
        self.producer = self.client.create_producer(
            topic, batching_enabled=False, send_timeout_millis=60_000, block_if_queue_full=True
        )
        self.acks: dict[int, list[float]] = {}
        self.errors = 0
        self.rate = rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        start = time.monotonic()
        while not self._stop.is_set():

            def acked(res: Any, msg_id: Any) -> None:
                if res == pulsar.Result.Ok:
                    self.acks.setdefault(msg_id.partition(), []).append(time.monotonic())
                else:
                    self.errors += 1

            self.producer.send_async(b"p" * SIZE, acked, partition_key=str(i))
            i += 1
            ahead = start + i / self.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)

    def resumed_after(self, at: float, timeout: float = 120.0) -> float:
        """Seconds from ``at`` until every partition acknowledged a send after it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            firsts = [
                min((t for t in times if t > at), default=None) for times in self.acks.values()
            ]
            if len(firsts) == PARTITIONS and all(f is not None for f in firsts):
                return max(firsts) - at  # type: ignore[type-var,operator]
            time.sleep(0.05)
        raise RuntimeError("partitions did not all resume")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5, help="alternating rounds (medians)")
    parser.add_argument("--rate", type=int, default=500, help="paced rate of the kill cases")
    parser.add_argument("--session-ms", type=int, default=2000)
    parser.add_argument(
        "--cases",
        default="throughput,broker-kill,bookie-kill",
        help="comma-separated cases to run (throughput, broker-kill, bookie-kill)",
    )
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    unknown = cases - {"throughput", "broker-kill", "bookie-kill"}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        root = Path(tmp)
        # -- standalone
        conf = write_conf(root / "standalone.conf", {"logLevel": "warning"})
        standalone = spawn(
            [
                "standalone",
                "--data-dir",
                str(root / "standalone"),
                "--config",
                str(conf),
                *PORT_FLAGS,
            ],
            "polybroker standalone ready ",
            root / "standalone.log",
        )
        cluster = Cluster(root, args.session_ms)
        try:
            for _ in range(3):
                cluster.add_bookie()
            a, b = cluster.add_broker(), cluster.add_broker()
            s_url = f"pulsar://127.0.0.1:{standalone.port('brokerServicePort')}"
            s_http = f"http://127.0.0.1:{standalone.port('webServicePort')}"
            c_url = f"pulsar://127.0.0.1:{a.port('brokerServicePort')}"
            c_http = f"http://127.0.0.1:{a.port('webServicePort')}"
            if "throughput" in cases:
                roles = {
                    "brokers": [p.pid for p in cluster.brokers],
                    "bookies": [p.pid for p in cluster.bookies],
                }
                brokers = [f"http://127.0.0.1:{p.port('webServicePort')}" for p in (a, b)]
                results.update(
                    compare(args, (s_url, s_http, standalone.pid), (c_url, c_http, roles), brokers)
                )
            standalone.stop()

            if "broker-kill" in cases or "bookie-kill" in cases:
                results.update(failover(args, cluster, c_url, c_http, b))
        finally:
            standalone.stop()
            cluster.close()

    if "standalone" in results:
        print(
            f"{'':12s}{'msgs/s':>10s}{'p50 ms':>9s}{'p99 ms':>9s}{'CPU us/msg':>12s}"
            f"{'msgs/entry':>12s}{'CPU us/entry':>14s}{'cache miss %':>14s}"
        )
        for which in ("standalone", "cluster"):
            r = results[which]
            print(
                f"{which:12s}{r['msgs_per_s']:10.0f}{r['p50_ms']:9.1f}{r['p99_ms']:9.1f}"
                f"{r['cpu_us_per_msg']:12.1f}{r['msgs_per_entry']:12.1f}"
                f"{r['cpu_us_per_entry']:14.0f}{r['cache_miss_pct']:14.1f}"
            )
        for which in ("standalone", "cluster"):
            r = results[which]
            print(
                f"{which:12s}per entry: user {r['user_us_per_entry']:.0f} us, system "
                f"{r['sys_us_per_entry']:.0f} us, {r['wakeups_per_entry']:.1f} wake-ups"
            )
        for role in ("brokers", "bookies"):
            r = results["cluster"]
            print(
                f"  {role:10s}per entry: {r[f'{role}_us_per_entry']:.0f} us (user "
                f"{r[f'{role}_user_us_per_entry']:.0f} us, system "
                f"{r[f'{role}_sys_us_per_entry']:.0f} us), "
                f"{r[f'{role}_wakeups_per_entry']:.1f} wake-ups"
            )
        print(
            f"CPU per message, cluster / standalone: {results['cpu_ratio']:.2f}x (target <= 1.5x; "
            f"median of the rounds' ratios {results['cpu_ratio_median_round']:.2f}x); "
            f"per entry {results['cpu_ratio_per_entry']:.2f}x"
        )
    print(json.dumps({"benchmark": "cluster", **results}))


def compare(
    args: argparse.Namespace,
    standalone: tuple[str, str, int],
    cluster: tuple[str, str, dict[str, list[int]]],
    cluster_brokers: list[str],
) -> dict[str, Any]:
    """The throughput case: ``--repeat`` rounds, each one run on both sides (alternating which
    goes first), then medians per side and the cluster / standalone ratios."""
    s_url, s_http, s_pid = standalone
    c_url, c_http, c_roles = cluster
    runs: dict[str, list[dict[str, float]]] = {"standalone": [], "cluster": []}
    for r in range(args.repeat):
        order = ["standalone", "cluster"] if r % 2 == 0 else ["cluster", "standalone"]
        for which in order:
            if which == "standalone":
                res = throughput(
                    s_url, s_http, f"s{r}", args.messages, {"standalone": [s_pid]}, [s_http]
                )
            else:
                res = throughput(c_url, c_http, f"c{r}", args.messages, c_roles, cluster_brokers)
            runs[which].append(res)
            print(
                f"{which:10s} run {r}: " + " ".join(f"{k}={v:.1f}" for k, v in res.items()),
                flush=True,
            )
    out: dict[str, Any] = {}
    for which, rs in runs.items():
        out[which] = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
    c, s = out["cluster"], out["standalone"]
    rounds = [
        x["cpu_us_per_msg"] / y["cpu_us_per_msg"]
        for x, y in zip(runs["cluster"], runs["standalone"], strict=True)
    ]
    out["cpu_ratio"] = c["cpu_us_per_msg"] / s["cpu_us_per_msg"]
    out["cpu_ratio_rounds"] = [round(x, 3) for x in rounds]
    out["cpu_ratio_median_round"] = statistics.median(rounds)
    out["cpu_ratio_per_entry"] = c["cpu_us_per_entry"] / s["cpu_us_per_entry"]
    out["throughput_ratio"] = c["msgs_per_s"] / s["msgs_per_s"]
    return out


def failover(
    args: argparse.Namespace, cluster: Cluster, c_url: str, c_http: str, b: Proc
) -> dict[str, Any]:
    """The kill cases, under one paced sender: kill -9 of broker ``b``, then of a bookie."""
    results: dict[str, Any] = {}
    # -- broker kill -9
    topic = "persistent://public/default/failover"
    http_put(f"{c_http}/admin/v2/persistent/public/default/failover/partitions", PARTITIONS)
    sender = PacedSender(c_url, topic, args.rate)
    time.sleep(3)  # warm up: every partition has a producer and has acknowledged sends
    owners = http_get(f"{c_http}/admin/v2/namespaces/public/default/owners")
    b_id = f"127.0.0.1:{b.port('webServicePort')}"
    if b_id not in owners.values():
        raise RuntimeError(f"the second broker owns no bundle: {owners}")
    killed = time.monotonic()
    b.kill()
    results["broker_kill_resume_s"] = sender.resumed_after(killed)
    print(
        f"broker kill -9: every partition serving again after "
        f"{results['broker_kill_resume_s']:.2f}s",
        flush=True,
    )

    # -- bookie kill -9 (a spare bookie lets every ensemble change find a replacement)
    cluster.add_bookie()
    time.sleep(2)
    killed = time.monotonic()
    cluster.bookies[0].kill()
    results["bookie_kill_resume_s"] = sender.resumed_after(killed)
    results["paced_send_errors"] = sender.errors
    sender.close()
    print(
        f"bookie kill -9: every partition writing again after "
        f"{results['bookie_kill_resume_s']:.2f}s",
        flush=True,
    )
    return results


if __name__ == "__main__":
    main()
