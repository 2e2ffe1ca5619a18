"""Pulsar benchmark: polybroker standalone against pulsar-lite, with the official client.

Every case runs on both brokers in the same run, alternating which goes first (the machine is
noisy: medians of --repeat runs and the ratios are what count). The producer and the consumer
are separate processes (this script re-run with ``--role``); messages are 100 bytes, the first
sixteen holding the send time (CLOCK_MONOTONIC, the same for every process of the machine)
and the message's index in the run.

Cases:
  batched    sustained end-to-end rate (msgs/s, MB/s) with batching on, --batched messages
  unbatched  the same with batching off, --unbatched messages
  paced      publish and end-to-end latency p50/p99 at --rate msgs/s for --paced-seconds,
             batching on with a 1 ms batch window (pulsar-perf's default), --paced-repeat
             runs alternating the brokers (medians of each run's percentiles); each broker first
             idles for --settle-seconds (12 s: more than polybroker's 10 s checkpoint
             interval), so that neither is measured while it still flushes what the case
             before wrote (without it, the broker that ran last before the paced case was
             measured mid-flush and the other one rested)
  topics     --topics topics, each with a producer and a subscription: set-up time and the
             broker's RSS (polybroker: the whole standalone process, bookie and metadata
             store included)

pulsar-lite acknowledges without syncing to disk (strace of a paced run: no fsync, fdatasync or
sync_file_range), so polybroker's latency, which waits for the journal's fdatasync, also
carries the disk's sync latency; ``--journal-sync off`` measures polybroker the same way (the
targets are with it on).

Each run also reports how busy the whole machine's CPUs were over it (``/proc/stat``, this run
included): latency figures taken near 100% measure contention more than the brokers.

The end-to-end rate is messages / (last receive - first send). Each message carries its index:
the consumer counts a message received again as a duplicate, apart from the messages and their
latencies (pulsar-lite redelivers many in the throughput cases; counted as progress, they had
made its rates look higher than the messages it delivered). polybroker runs with its
defaults (journal fdatasync before every acknowledgement, group window 1 ms); pulsar-lite with
its own (RocksDB). Prints a table, then one JSON line as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before the sys.path filter below, which takes this folder (and benchlib) off the path.
from benchlib import free_port, percentile

# This file is named pulsar.py: keep its folder off the path so `import pulsar` is the client.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

SIZE = 100
_READY = "polybroker standalone ready "
_LITE_CONFIG = "[metrics]\nenabled = false\n"


_STAMP = struct.Struct(">qq")
_FILL = b"x" * (SIZE - _STAMP.size)


def payload(now_ns: int, index: int = 0) -> bytes:
    """A 100-byte message carrying its send time and its index in the run."""
    return _STAMP.pack(now_ns, index) + _FILL


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time ``pid`` has used so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_usage(pid: int | str = "self") -> dict[str, Any]:
    """What a process has used so far: CPU seconds (all threads), its threads' voluntary context
    switches (``switches``: each one a sleep and a wake-up, on a lock, the GIL or a socket) and
    involuntary ones (``preempted``: the scheduler gave the core to another task), and CPU
    seconds per thread (``main``, else the thread's name and id)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = 0.0
    switches = 0
    preempted = 0
    threads: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        name = "main" if task.name == str(pid if pid != "self" else os.getpid()) else name
        name = f"{name}-{task.name}" if name == "python" else name  # the client's threads
        fields = stat.rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / tick
        cpu += used
        threads[name] = threads.get(name, 0.0) + used
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                preempted += int(line.split()[1])
    return {"cpu_s": cpu, "switches": switches, "preempted": preempted, "threads": threads}


def usage_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after`` minus ``before`` (two ``process_usage`` results of one process)."""
    out = {k: after[k] - before[k] for k in ("cpu_s", "switches", "preempted")}
    out["threads"] = {
        name: round(v - before["threads"].get(name, 0.0), 3) for name, v in after["threads"].items()
    }
    return out


class ThreadStates:
    """Samples, in a thread of this process, what each thread of process ``pid`` is doing
    (``/proc/PID/task/TID/syscall``): running (or ready to), waiting for the network
    (``epoll_wait``), or waiting on a lock or condition (``futex``: the GIL, the client's
    queues). ``shares()`` gives each thread's share of samples in each state."""

    _STATES = {"running": "running", "202": "lock", "232": "network", "281": "network"}

    def __init__(self, pid: int, interval_s: float = 0.002) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.counts: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        root = Path(f"/proc/{self.pid}/task")
        while not self._stop.wait(self.interval_s):
            try:
                tasks = list(root.iterdir())
            except OSError:
                return  # the process ended
            for task in tasks:
                try:
                    call = (task / "syscall").read_text().split(maxsplit=1)[0]
                except (OSError, IndexError):
                    continue
                name = "main" if task.name == str(self.pid) else f"thread-{task.name}"
                state = self._STATES.get(call, "other")
                per = self.counts.setdefault(name, {})
                per[state] = per.get(state, 0) + 1

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling; return each busy thread's shares (threads mostly asleep left out)."""
        self._stop.set()
        self._thread.join(5)
        out = {}
        for name, per in self.counts.items():
            total = sum(per.values())
            if total and per.get("running", 0) / total >= 0.05:
                out[name] = {k: round(v / total, 3) for k, v in sorted(per.items())}
        return out


def machine_cpu() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, from ``/proc/stat``."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


# -- brokers ------------------------------------------------------------------------------------


@dataclass
class Broker:
    """A broker process this script started, and how to reach it."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    workdir: Path
    log: Path

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_polybroker(root: Path, journal_sync: bool = True) -> Broker:
    """Start ``polybroker standalone`` on free ports; return when it is ready.

    ``journal_sync`` False runs it with ``journalSyncData=false`` (no fdatasync)."""
    workdir = root / "polybroker"
    workdir.mkdir()
    log = workdir / "standalone.log"
    cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(workdir / "data")]
    if not journal_sync:
        config = workdir / "standalone.conf"
        config.write_text("journalSyncData=false\n")
        cmd += ["--config", str(config)]
    for flag in ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port", "--amqp-port"):
        cmd += [flag, "0"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"polybroker not ready: {log.read_text()[-2000:]}")
            if not sel.select(remaining):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            buffered += chunk
            for line in buffered.decode(errors="replace").splitlines():
                if line.startswith(_READY):
                    ports = dict(re.findall(r"(\w+)=(\d+)", line))
                    url = f"pulsar://127.0.0.1:{ports['brokerServicePort']}"
                    return Broker("polybroker", proc, url, workdir, log)


def lite_binary() -> Path:
    """The pulsar-lite binary inside its PyPI package."""
    import pulsar_lite

    return Path(pulsar_lite.__file__).parent / "bin" / "pulsar-lite"


def start_pulsar_lite(root: Path) -> Broker:
    """Start pulsar-lite on loopback with metrics off; return when its port accepts."""
    workdir = root / "pulsar-lite"
    workdir.mkdir()
    config = workdir / "pulsar-lite.toml"
    config.write_text(_LITE_CONFIG)
    port = free_port()
    log = workdir / "pulsar-lite.log"
    cmd = [str(lite_binary()), "--config", str(config), "--addr", f"127.0.0.1:{port}"]
    cmd += ["--db-path", str(workdir / "db"), "--log-level", "warn"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pulsar-lite exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return Broker("pulsar-lite", proc, f"pulsar://127.0.0.1:{port}", workdir, log)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("pulsar-lite did not listen within 30 s")


# -- roles (child processes) --------------------------------------------------------------------


def _client(url: str) -> Any:
    import pulsar

    return pulsar.Client(
        url, operation_timeout_seconds=60, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
    )


def role_consumer(args: argparse.Namespace) -> None:
    """Take --count messages; print one JSON line: first/last receive time, e2e latencies, the
    process's usage over the run, and the time it waited for messages (gaps over 1 ms between
    one message and the next: the consumer had nothing to take). With --detail also the
    entries the messages came in (a message with batch index 0 or none starts one)."""
    import pulsar

    client = _client(args.url)
    consumer = client.subscribe(
        args.topic,
        "bench",
        consumer_type=pulsar.ConsumerType.Exclusive,
        initial_position=pulsar.InitialPosition.Earliest,
        receiver_queue_size=2000,
    )
    print("ready", flush=True)
    usage = process_usage()
    latencies: list[float] = []
    first = last = 0
    got = 0
    duplicates = 0
    waited = 0
    waits = 0
    entries = 0
    detail = args.detail
    seen = bytearray(args.count)
    deadline = time.monotonic() + args.timeout
    msg = None
    while got < args.count and time.monotonic() < deadline:
        try:
            msg = consumer.receive(timeout_millis=1000)
        except pulsar.Timeout:
            continue
        now = time.monotonic_ns()
        sent, index = _STAMP.unpack_from(msg.data())
        if not 0 <= index < args.count or seen[index]:
            duplicates += 1  # counted apart: a redelivery is neither progress nor latency
            continue
        seen[index] = 1
        if not first:
            first = now
        elif now - last > 1_000_000:
            waited += now - last
            waits += 1
        last = now
        if detail and msg.message_id().batch_index() <= 0:
            entries += 1
        latencies.append((now - sent) / 1e6)
        got += 1
        if got % 1000 == 0:
            consumer.acknowledge_cumulative(msg)
    if msg is not None:
        consumer.acknowledge_cumulative(msg)
    used = usage_delta(process_usage(), usage)
    consumer.close()
    client.close()
    out = {"got": got, "duplicates": duplicates, "first_ns": first, "last_ns": last}
    out |= {"usage": used, "waited_s": waited / 1e9, "waits": waits, "entries": entries}
    print(json.dumps({**out, "e2e_ms": latencies}))


def role_producer(args: argparse.Namespace) -> None:
    """Send --count messages (paced at --rate if given); print one JSON line with timings, the
    process's usage over the run and the time ``send_async`` blocked (calls over 0.2 ms: the
    pending queue was full, so the client waited for receipts)."""
    import pulsar

    sys.setswitchinterval(0.0005)  # let the client's callback thread in promptly
    client = _client(args.url)
    producer = client.create_producer(
        args.topic,
        batching_enabled=args.batching,
        batching_max_publish_delay_ms=args.batch_delay_ms,
        batching_max_messages=1000,
        max_pending_messages=5000,
        block_if_queue_full=True,
        send_timeout_millis=120_000,
    )
    publish_ms: list[float] = []
    failed = [0]
    ok = pulsar.Result.Ok

    def sent_callback(start_ns: int) -> Any:
        def done(result: Any, _msg_id: Any) -> None:
            if result == ok:
                publish_ms.append((time.monotonic_ns() - start_ns) / 1e6)
            else:
                failed[0] += 1

        return done

    usage = process_usage()
    blocked = 0
    blocks = 0
    start = time.monotonic_ns()
    interval_ns = int(1e9 / args.rate) if args.rate else 0
    for i in range(args.count):
        if interval_ns:
            # Sleep, never spin: a spinning loop holds the GIL that the client's send callbacks
            # need, which would add up to the switch interval to every publish latency.
            due = start + i * interval_ns
            now = time.monotonic_ns()
            if due > now:
                time.sleep((due - now) / 1e9)
        now = time.monotonic_ns()
        producer.send_async(payload(now, i), sent_callback(now))
        took = time.monotonic_ns() - now
        if took > 200_000:
            blocked += took
            blocks += 1
    producer.flush()
    end = time.monotonic_ns()
    used = usage_delta(process_usage(), usage)
    producer.close()
    client.close()
    out = {"start_ns": start, "end_ns": end, "failed": failed[0], "publish_ms": publish_ms}
    out |= {"usage": used, "blocked_s": blocked / 1e9, "blocks": blocks}
    print(json.dumps(out))


def role_topics(args: argparse.Namespace) -> None:
    """Create --count topics, each with a producer and a subscription; print the set-up time."""

    async def main() -> dict[str, Any]:
        import pulsar
        import pulsar.asyncio as pa

        client = pa.Client(
            args.url,
            operation_timeout_seconds=120,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        )
        held: list[Any] = []
        start = time.monotonic()
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            topic = f"persistent://public/default/bench-topics-{args.tag}-{i}"
            async with sem:
                held.append(await client.create_producer(topic, batching_enabled=False))
                held.append(
                    await client.subscribe(
                        topic, "sub", initial_position=pulsar.InitialPosition.Earliest
                    )
                )
                if len(held) % 2000 == 0:
                    done = {"done": len(held) // 2, "elapsed_s": time.monotonic() - start}
                    print(json.dumps(done), flush=True)

        await asyncio.gather(*(one(i) for i in range(args.count)))
        elapsed = time.monotonic() - start
        if len(held) != 2 * args.count:
            raise RuntimeError(f"{len(held)} producers and consumers, not {2 * args.count}")
        print(json.dumps({"setup_s": elapsed, "held": len(held)}), flush=True)
        # Hold everything open until the parent has read the broker's RSS.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await client.close()
        return {}

    asyncio.run(main())


# -- cases (parent) -----------------------------------------------------------------------------


def _role(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Bytes read past the last full line, per role process (reads go straight to the fd, so a
# select() never waits on a line already sitting in a Python buffer).
_PENDING: dict[int, bytes] = {}


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffered = _PENDING.pop(proc.pid, b"")
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buffered:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                _PENDING[proc.pid] = buffered
                raise TimeoutError(f"no answer in {timeout}s")
            chunk = os.read(fd, 65536)
            if not chunk:
                _, err = proc.communicate(timeout=10)
                raise RuntimeError(f"role exited: {err[-2000:]}")
            buffered += chunk
    line, _, rest = buffered.partition(b"\n")
    _PENDING[proc.pid] = rest
    return line.decode() + "\n"


def _finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        raise RuntimeError(f"role did not finish in {timeout}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"role failed ({proc.returncode}): {err[-2000:]}")
    out = _PENDING.pop(proc.pid, b"").decode() + out
    return json.loads(out.strip().splitlines()[-1])


@dataclass
class Run:
    """One producer/consumer run's figures."""

    count: int
    seconds: float
    publish_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    #: The broker process's CPU time over the run, s.
    broker_cpu_s: float = 0.0
    #: Messages the consumer received again (not counted in ``count`` nor in the latencies).
    duplicates: int = 0
    #: Share of the machine's CPU time busy over the run (everything running, this run too).
    machine_busy: float = 0.0
    #: ``usage_delta`` of the broker, the producer and the consumer over the run.
    usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Seconds the producer's send_async blocked (queue full) and the consumer waited.
    blocked_s: float = 0.0
    waited_s: float = 0.0
    #: Entries the consumer saw (--detail only; else 0).
    entries: int = 0
    #: The producer's threads' states (``ThreadStates.stop``; --detail only).
    producer_threads: dict[str, dict[str, float]] = field(default_factory=dict)

    def per_msg(self, who: str, key: str = "cpu_s", scale: float = 1e6) -> float:
        """``who``'s usage ``key`` per message (CPU in us by default)."""
        return self.usage[who][key] * scale / self.count if who in self.usage else float("nan")

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0


#: Where py-spy profiles of polybroker go (--profile-dir); None: no profiling.
_PROFILE_DIR: Path | None = None
#: Where each run's raw latencies go (--raw-dir); None: not kept.
_RAW_DIR: Path | None = None
#: Whether the consumer counts the entries its messages came in (--detail).
_DETAIL = False


def _start_profile(broker: Broker, topic: str) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record`` (raw stacks, 1000 Hz) on the polybroker standalone, if asked."""
    if _PROFILE_DIR is None or broker.name != "polybroker":
        return None
    out = _PROFILE_DIR / f"{topic.rsplit('/', 1)[-1]}.txt"
    cmd = ["py-spy", "record", "-p", str(broker.proc.pid), "-r", "1000", "-f", "raw", "-o"]
    return subprocess.Popen([*cmd, str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_pair(
    broker: Broker, topic: str, count: int, batching: bool, rate: float, timeout: float
) -> Run:
    """Start a consumer, then a producer, in their own processes; return what they measured."""
    common = ["--url", broker.url, "--topic", topic, "--count", str(count)]
    detail = ["--detail"] if _DETAIL else []
    consumer = _role("--role", "consumer", *common, "--timeout", str(timeout), *detail)
    cpu_before = cpu_seconds(broker.proc.pid)
    broker_before = process_usage(broker.proc.pid)
    machine_before = machine_cpu()
    spy = _start_profile(broker, topic)
    try:
        if _read_line(consumer, 120).strip() != "ready":
            raise RuntimeError("consumer did not subscribe")
        extra = ["--rate", str(rate), "--batch-delay-ms", "1" if rate else "10"]
        if batching:
            extra.append("--batching")
        producer = _role("--role", "producer", *common, *extra)
        states = ThreadStates(producer.pid) if _DETAIL else None
        prod = _finish(producer, timeout + 60)
        threads = states.stop() if states is not None else {}
        cons = _finish(consumer, timeout + 60)
    finally:
        for p in (consumer,):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10)
    if cons["got"] < count or prod["failed"]:
        raise RuntimeError(
            f"{broker.name}: consumer got {cons['got']} of {count}, {prod['failed']} send failures"
        )
    seconds = (cons["last_ns"] - prod["start_ns"]) / 1e9
    cpu = cpu_seconds(broker.proc.pid) - cpu_before
    usage = {
        "broker": usage_delta(process_usage(broker.proc.pid), broker_before),
        "producer": prod["usage"],
        "consumer": cons["usage"],
    }
    busy, total = (a - b for a, b in zip(machine_cpu(), machine_before, strict=True))
    if _RAW_DIR is not None:
        raw = {"publish_ms": prod["publish_ms"], "e2e_ms": cons["e2e_ms"]}
        name = f"{broker.name}-{topic.rsplit('/', 1)[-1]}.json"
        (_RAW_DIR / name).write_text(json.dumps(raw))
    return Run(
        count,
        seconds,
        prod["publish_ms"],
        cons["e2e_ms"],
        cpu,
        cons["duplicates"],
        busy / total if total else 0.0,
        usage,
        prod["blocked_s"],
        cons["waited_s"],
        cons["entries"],
        threads,
    )


def run_topics(broker: Broker, count: int, tag: str, timeout: float) -> dict[str, Any]:
    """Set up ``count`` topics with a producer and a subscription each; time and RSS.

    A set-up still under way after ``timeout`` seconds is reported with how far it got."""
    before = rss_mb(broker.proc.pid)
    proc = _role("--role", "topics", "--url", broker.url, "--count", str(count), "--tag", tag)
    out: dict[str, Any] = {"topics": count, "rss_mb_before": round(before, 1)}
    deadline = time.monotonic() + timeout
    done, elapsed = 0, 0.0
    try:
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = _read_line(proc, max(remaining, 0.001))
            except TimeoutError:
                out.update(completed=done, timed_out_after_s=round(timeout), setup_s=None)
                out["rss_mb"] = round(rss_mb(broker.proc.pid), 1)
                out["progress_rate_per_s"] = round(done / elapsed, 1) if elapsed else None
                return out
            if not line.startswith("{"):  # anything the client library printed
                continue
            report = json.loads(line)
            if "done" in report:
                done, elapsed = report["done"], report["elapsed_s"]
                print(f"  {broker.name}: {done} topics in {elapsed:.1f} s", file=sys.stderr)
                continue
            out["setup_s"] = round(report["setup_s"], 2)
            out["rss_mb"] = round(rss_mb(broker.proc.pid), 1)
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            proc.communicate(timeout=120)
            return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _usage_line(run: Run) -> str:
    """One run's per-process figures: CPU us per message, voluntary and involuntary context
    switches per 1000 messages, what blocked the producer and what the consumer waited."""
    parts = []
    for who in ("broker", "producer", "consumer"):
        if who not in run.usage:
            continue
        parts.append(
            f"{who} {run.per_msg(who):.1f} us"
            f" {run.per_msg(who, 'switches', 1e3):.0f} sw"
            f" {run.per_msg(who, 'preempted', 1e3):.0f} pre"
        )
    line = "per msg (per 1000 for sw/pre): " + ", ".join(parts)
    line += f"; producer blocked {run.blocked_s:.2f} s, consumer waited {run.waited_s:.2f} s"
    if run.entries:
        line += f", {run.count / run.entries:.0f} msgs/entry"
    for name, shares in run.producer_threads.items():
        line += f"; producer {name} " + " ".join(f"{k} {v:.0%}" for k, v in shares.items())
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("consumer", "producer", "topics"), default=None)
    parser.add_argument("--url", default="")
    parser.add_argument("--topic", default="")
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--batching", action="store_true")
    parser.add_argument("--batch-delay-ms", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of each case, s")
    parser.add_argument("--tag", default="")
    parser.add_argument("--batched", type=int, default=1_000_000, help="messages, batching on")
    parser.add_argument("--unbatched", type=int, default=200_000, help="messages, batching off")
    parser.add_argument("--paced-rate", type=float, default=10_000.0, help="msgs/s of latency run")
    parser.add_argument("--paced-seconds", type=float, default=10.0)
    parser.add_argument(
        "--settle-seconds", type=float, default=12.0, help="idle time before each paced run"
    )
    parser.add_argument("--topics", type=int, default=10_000, help="topics of the topics case")
    parser.add_argument(
        "--topics-timeout", type=float, default=300.0, help="report how far set-up got after s"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each throughput case")
    parser.add_argument(
        "--paced-repeat", type=int, default=1, help="runs of the paced case (medians reported)"
    )
    parser.add_argument("--brokers", default="polybroker,pulsar-lite")
    parser.add_argument("--cases", default="batched,unbatched,paced,topics")
    parser.add_argument(
        "--profile-dir", default="", help="py-spy raw profiles of polybroker, one per run"
    )
    parser.add_argument("--raw-dir", default="", help="each run's raw latencies, as JSON")
    parser.add_argument(
        "--detail",
        action="store_true",
        help="the consumer also counts entries (messages per entry; costs it a little CPU) and"
        " the producer's threads' states are sampled (running, waiting for the network or on a"
        " lock: e.g. its I/O thread idle while receipts are under way)",
    )
    parser.add_argument(
        "--journal-sync",
        choices=("on", "off"),
        default="on",
        help="polybroker's journal fdatasync (off: as pulsar-lite, which does not sync)",
    )
    args = parser.parse_args()
    if args.role == "consumer":
        role_consumer(args)
        return 0
    if args.role == "producer":
        role_producer(args)
        return 0
    if args.role == "topics":
        role_topics(args)
        return 0

    # Stop the brokers (finally below) on SIGTERM and on Ctrl+C, even when started in background.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    global _PROFILE_DIR, _RAW_DIR, _DETAIL
    _DETAIL = args.detail
    if args.profile_dir:
        _PROFILE_DIR = Path(args.profile_dir)
        _PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    if args.raw_dir:
        _RAW_DIR = Path(args.raw_dir)
        _RAW_DIR.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.brokers.split(",") if n]
    wanted = {c for c in args.cases.split(",") if c}
    notes = []
    if "batched" in wanted and args.batched < 1_000_000:
        notes.append(f"batched case over {args.batched} messages, not 1M (2-core shared machine)")
    if "unbatched" in wanted and args.unbatched < 200_000:
        notes.append(f"unbatched case over {args.unbatched} messages, not 200k")
    if "topics" in wanted and args.topics < 10_000:
        notes.append(f"topics case with {args.topics} topics, not 10,000")
    results: dict[str, dict[str, Any]] = {n: {} for n in names}
    journal_sync = args.journal_sync == "on"
    if not journal_sync:
        notes.append("polybroker without journal fdatasync (journalSyncData=false)")
    starters = {
        "polybroker": lambda root: start_polybroker(root, journal_sync),
        "pulsar-lite": start_pulsar_lite,
    }
    with tempfile.TemporaryDirectory(prefix="bench-pulsar-") as tmp:
        root = Path(tmp)
        brokers = {n: starters[n](root) for n in names}
        try:
            paced_count = int(args.paced_rate * args.paced_seconds)
            cases = [
                ("batched", args.batched, True, 0.0),
                ("unbatched", args.unbatched, False, 0.0),
                ("paced", paced_count, True, args.paced_rate),
            ]
            cases = [c for c in cases if c[0] in wanted]
            for case_index, (case, count, batching, rate) in enumerate(cases):
                repeats = args.paced_repeat if case == "paced" else args.repeat
                runs: dict[str, list[Run]] = {n: [] for n in names}
                for r in range(repeats):
                    order = names if (case_index + r) % 2 == 0 else names[::-1]
                    for n in order:
                        topic = f"persistent://public/default/bench-{case}-{r}"
                        if rate:
                            # Both brokers idle alike before a latency run (see the docstring).
                            time.sleep(args.settle_seconds)
                        run = run_pair(brokers[n], topic, count, batching, rate, args.timeout)
                        runs[n].append(run)
                        print(
                            f"{n:12} {case:9} run {r}: {run.count} msgs in {run.seconds:.2f} s"
                            f" = {run.rate:,.0f} msg/s,"
                            f" broker CPU {run.broker_cpu_s * 1e6 / run.count:.1f} us/msg,"
                            f" machine {run.machine_busy:.0%} busy,"
                            f" publish p50 {percentile(run.publish_ms, 50):.1f} ms,"
                            f" e2e p99 {percentile(run.e2e_ms, 99):.1f} ms"
                            + (f", {run.duplicates} duplicates" if run.duplicates else ""),
                            file=sys.stderr,
                            flush=True,
                        )
                        print(f"{'':12} {_usage_line(run)}", file=sys.stderr, flush=True)
                    if len(names) == 2 and all(len(runs[m]) > r for m in names):
                        a, b = (runs[m][r].rate for m in names)
                        print(
                            f"{'':12} {case:9} run {r}: {names[0]} / {names[1]}"
                            f" = {a / b if b else float('nan'):.3f}",
                            file=sys.stderr,
                            flush=True,
                        )
                for n in names:
                    rates = [x.rate for x in runs[n]]
                    entry: dict[str, Any] = {
                        "messages": count,
                        "msgs_per_s": round(_median(rates)),
                        "mb_per_s": round(_median(rates) * SIZE / 1e6, 2),
                        "cpu_us_per_msg": round(
                            _median([x.broker_cpu_s * 1e6 / x.count for x in runs[n]]), 2
                        ),
                        "duplicates": sum(x.duplicates for x in runs[n]),
                        "machine_busy": round(_median([x.machine_busy for x in runs[n]]), 2),
                        "rates": [round(x.rate) for x in runs[n]],
                    }
                    for who in ("producer", "consumer"):
                        entry[f"{who}_cpu_us_per_msg"] = round(
                            _median([x.per_msg(who) for x in runs[n]]), 2
                        )
                    for who in ("broker", "producer", "consumer"):
                        entry[f"{who}_switches_per_kmsg"] = round(
                            _median([x.per_msg(who, "switches", 1e3) for x in runs[n]]), 1
                        )
                    if case == "paced":
                        entry["rate"] = args.paced_rate
                        for key, q in (("p50", 50), ("p99", 99)):
                            # Medians over the runs of each run's percentile.
                            publish = [percentile(x.publish_ms, q) for x in runs[n]]
                            e2e = [percentile(x.e2e_ms, q) for x in runs[n]]
                            entry[f"publish_{key}_ms"] = round(_median(publish), 2)
                            entry[f"e2e_{key}_ms"] = round(_median(e2e), 2)
                            entry[f"e2e_{key}_ms_runs"] = [round(v, 2) for v in e2e]
                    results[n][case] = entry
            for i, n in enumerate(names[::-1] if "topics" in wanted else []):
                bound = args.topics_timeout
                results[n]["topics"] = run_topics(brokers[n], args.topics, str(i), bound)
                print(f"{n:12} topics   : {results[n]['topics']}", file=sys.stderr, flush=True)
        finally:
            for b in brokers.values():
                b.stop()

    print(f"{'broker':12} {'case':10} {'msgs/s':>10} {'MB/s':>7} {'CPU us/msg':>10}  latency (ms)")
    for n in names:
        for case in ("batched", "unbatched", "paced"):
            if case not in results[n]:
                continue
            e = results[n][case]
            lat = ""
            if case == "paced":
                lat = (
                    f"publish p50 {e['publish_p50_ms']} p99 {e['publish_p99_ms']}, "
                    f"e2e p50 {e['e2e_p50_ms']} p99 {e['e2e_p99_ms']}"
                )
            print(
                f"{n:12} {case:10} {e['msgs_per_s']:>10,} {e['mb_per_s']:>7}"
                f" {e['cpu_us_per_msg']:>10}  {lat}"
            )
        if "topics" in results[n]:
            t = results[n]["topics"]
            if t.get("setup_s") is None:
                print(
                    f"{n:12} topics     {t['completed']} of {t['topics']} set up when stopped"
                    f" after {t['timed_out_after_s']} s, RSS {t['rss_mb']} MB"
                )
            else:
                print(
                    f"{n:12} topics     {t['topics']} topics set up in {t['setup_s']} s,"
                    f" RSS {t['rss_mb']} MB"
                )
    for note in notes:
        print(f"note: {note}")
    summary: dict[str, Any] = {"benchmark": "pulsar", "message_bytes": SIZE, **results}
    if "polybroker" in results and "pulsar-lite" in results:
        ours, theirs = results["polybroker"], results["pulsar-lite"]

        def versus(case: str, key: str) -> float | None:
            a, b = ours.get(case, {}).get(key), theirs.get(case, {}).get(key)
            partial = "timed_out_after_s" in ours.get(
                case, {}
            ) or "timed_out_after_s" in theirs.get(case, {})
            if not isinstance(a, int | float) or not isinstance(b, int | float) or not b or partial:
                return None
            return round(a / b, 3)

        summary["ratios"] = {
            "batched_throughput": versus("batched", "msgs_per_s"),
            "unbatched_throughput": versus("unbatched", "msgs_per_s"),
            "batched_cpu_per_msg": versus("batched", "cpu_us_per_msg"),
            "unbatched_cpu_per_msg": versus("unbatched", "cpu_us_per_msg"),
            "publish_p99": versus("paced", "publish_p99_ms"),
            "e2e_p99": versus("paced", "e2e_p99_ms"),
            "topics_rss": versus("topics", "rss_mb"),
            "topics_setup": versus("topics", "setup_s"),
        }
    summary["notes"] = notes
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
