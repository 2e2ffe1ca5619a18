"""Storage benchmark: raw group-committed fdatasync vs managed-ledger appends over bookies.

In one run, alternating the cases (the machine is noisy, so medians and ratios are what count):

(a) raw:      1 KiB records appended to a preallocated file, one os.write + os.fdatasync per group,
              256 records outstanding (a closed loop: a group is everything pending, as the journal
              takes it);
(b) ml-1:     managed-ledger appends of 1 KiB entries, 256 outstanding, over 1 bookie process
              (E=1, Qw=1, Qa=1), journal fsync on;
(c) ml-3:     the same over 3 bookie processes (E=3, Qw=2, Qa=2).
(d) ml-1-many: (b) through ``ManagedLedger.append_many``, groups of 64 entries, 4 groups
              outstanding (each entry's latency is its group's); only when asked (--cases).
Then the restart time and RSS of a bookie holding --fill-gb of data after kill -9.

Prints a human-readable table, then one JSON line as the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from benchlib import free_port, percentile

RECORD = 1024
OUTSTANDING = 256
THRESHOLD = 512 * 1024  # journalBufferedWritesThreshold


def summarize(
    name: str, count: int, seconds: float, latencies: Sequence[float]
) -> dict[str, float]:
    """Return entries/s, MB/s and latency percentiles (ms) of one case."""
    return {
        "case": name,
        "entries": count,
        "entries_per_s": count / seconds,
        "mb_per_s": count * RECORD / seconds / 1e6,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "p999_ms": percentile(latencies, 99.9) * 1e3,
    }


def host_ms() -> float:
    """CPU milliseconds of a fixed pure-Python loop (median of 3): how fast this host runs the
    same instructions right now. It moves by up to ~1.8x within an hour here (other tenants),
    and every case's CPU per entry moves with it; raw, waiting on fdatasync, does not."""

    def once() -> float:
        t0 = time.thread_time()
        x = 0
        for i in range(1_000_000):
            x += i & 7
        return (time.thread_time() - t0) * 1e3

    return statistics.median(once() for _ in range(3))


def run_raw(directory: Path, seconds: float, window_s: float) -> dict[str, float]:
    """(a): write + fdatasync groups of everything outstanding, for ``seconds``.

    A group is flushed when its oldest record has waited ``window_s`` (the journal's
    journalMaxGroupWaitMSec) or the journal's byte threshold is buffered; in a closed loop with 256
    outstanding nothing new arrives during the window, so each group waits the window out."""
    path = directory / "raw.journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, 16 * 1024 * 1024)
        group = os.urandom(RECORD) * OUTSTANDING
        latencies: list[float] = []
        written = 0
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            issued = time.perf_counter()
            if issued >= deadline:
                break
            if window_s > 0 and len(group) < THRESHOLD:
                time.sleep(window_s)
            if written + len(group) > 16 * 1024 * 1024:
                os.lseek(fd, 0, os.SEEK_SET)
                written = 0
            os.write(fd, group)
            os.fdatasync(fd)
            written += len(group)
            done = time.perf_counter()
            latencies.extend([done - issued] * OUTSTANDING)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return summarize("raw" if window_s else "raw-nowait", len(latencies), elapsed, latencies)


class BookieProcess:
    """A `polybroker bookie` child process, stopped by its PID. With ``log_path`` it logs at
    debug level there (its checkpoints, for ``--timeline``)."""

    def __init__(self, data_dir: Path, port: int | None = None, log_path: Path | None = None):
        self.data_dir = data_dir
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> float:
        """Start it and return the seconds until it listens."""
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "polybroker", "bookie", "--data-dir", str(self.data_dir)]
        cmd += ["--port", str(self.port)]
        stderr: Any = subprocess.DEVNULL
        if self.log_path is not None:
            conf = self.log_path.with_suffix(".conf")
            conf.write_text("logLevel=debug\n")
            cmd += ["--config", str(conf)]
            stderr = self.log_path.open("a")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bookie exited with {self.proc.wait()}")
            if "bookie listening on" in line:
                return time.perf_counter() - t0
        raise TimeoutError("bookie did not start")

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process used so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)


def run_on_reactor(body: Callable[..., object]) -> object:
    """Run ``body(reactor)`` (returning a Deferred) on a fresh reactor; return its result."""
    from twisted.internet import reactor as _reactor
    from twisted.internet.defer import ensureDeferred

    reactor: object = _reactor
    box: dict[str, object] = {}

    def go() -> None:
        d = ensureDeferred(body(reactor))

        def done(result: object) -> None:
            box["result"] = result
            reactor.stop()  # type: ignore[attr-defined]

        d.addBoth(done)

    reactor.callWhenRunning(go)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    result = box.get("result")
    if hasattr(result, "raiseException"):
        result.raiseException()  # type: ignore[union-attr]
    return result


async def _ml_appends(
    reactor: object,
    addresses: list[str],
    ensemble: tuple[int, int, int],
    seconds: float,
    freeze_gc: bool = True,
    group: int = 0,
    done_times: list[float] | None = None,
) -> dict[str, float]:
    """(b)/(c): managed-ledger appends of 1 KiB with 256 outstanding for ``seconds``; (d) with
    ``group``: ``append_many`` of that many entries, as many groups as make 256."""
    from twisted.internet.defer import Deferred

    from polybroker.ledger.api import ManagedLedgerConfig
    from polybroker.ledger.bookie_client import TcpBookieClient
    from polybroker.ledger.client import BookKeeperClient
    from polybroker.ledger.managed import ManagedLedgerFactoryImpl
    from polybroker.ledger.registry import StaticBookieRegistry
    from polybroker.metadata.memory import MemoryMetadataStore

    e, qw, qa = ensemble
    store = MemoryMetadataStore(reactor)
    client = BookKeeperClient(
        store, StaticBookieRegistry(addresses), lambda a: TcpBookieClient(a, reactor), reactor
    )
    config = ManagedLedgerConfig(ensemble_size=e, write_quorum=qw, ack_quorum=qa)
    factory = ManagedLedgerFactoryImpl(store, client, reactor, default_config=config)
    ml = await factory.open("bench/storage", config)
    payload = os.urandom(RECORD)
    if freeze_gc:
        # What a long-running broker does after start-up: the objects made so far are not
        # scanned again by every full collection (each took 10-20 ms, a p99 of its own).
        gc.freeze()
    # Arrays, not lists of float objects: a full collection walks every item of a list (a
    # cache miss each), so a list of the run's latencies made the collections it measures
    # take 13-23 ms each (several a run), a tail of the benchmark's own making.
    latencies = array("d")
    done_at = array("d") if done_times is not None else None
    done: Deferred[None] = Deferred()
    state = {"outstanding": 0, "stop": False}
    start = time.perf_counter()
    deadline = start + seconds

    # One callback pair for every append, the issue time passed along: what is measured is the
    # managed ledger, not the making of two closures per append (nor a Deferred per append: the
    # broker's publish path uses ``append_then`` too).
    def ok(_: object, t0: float) -> None:
        now = time.perf_counter()
        latencies.append(now - t0)
        if done_at is not None:
            done_at.append(now)
        state["outstanding"] -= 1
        if now < deadline:
            issue()
        elif state["outstanding"] == 0 and not done.called:
            done.callback(None)

    def failed(error: Exception, _: object) -> None:
        if not done.called:
            done.errback(error)

    def issue() -> None:
        state["outstanding"] += 1
        ml.append_then(payload, ok, failed, time.perf_counter())

    batch = [payload] * max(group, 1)

    def issue_group() -> None:
        t0 = time.perf_counter()
        state["outstanding"] += 1

        def ok(entries: list[object]) -> None:
            now = time.perf_counter()
            latencies.extend([now - t0] * len(entries))
            state["outstanding"] -= 1
            if now < deadline:
                issue_group()
            elif state["outstanding"] == 0 and not done.called:
                done.callback(None)

        def failed(f: object) -> None:
            if not done.called:
                done.errback(f)

        ml.append_many(batch).addCallbacks(ok, failed)

    cpu0 = time.process_time()
    if group:
        for _ in range(OUTSTANDING // group):
            issue_group()
    else:
        for _ in range(OUTSTANDING):
            issue()
    await done
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    await factory.close()
    name = f"ml-{len(addresses)}" + ("-many" if group else "")
    result = summarize(name, len(latencies), elapsed, latencies)
    if done_times is not None and done_at is not None:
        # (issue, done) of every append, on the wall clock the bookies' logs use.
        to_wall = time.time() - time.perf_counter()
        spans = [
            (d - lat + to_wall, d + to_wall) for d, lat in zip(done_at, latencies, strict=True)
        ]
        done_times[:] = [x for span in spans for x in span]
    # CPU per entry does not depend on what else the machine runs, unlike entries/s.
    result["client_cpu_us"] = cpu / len(latencies) * 1e6
    return result


def case_main(args: argparse.Namespace) -> None:
    """Run one case in this process and print its JSON (a reactor runs once per process)."""
    with tempfile.TemporaryDirectory(prefix="pb-bench-") as tmp:
        root = Path(tmp)
        if args.case in ("raw", "raw-nowait"):
            window = args.window_ms / 1e3 if args.case == "raw" else 0.0
            print(json.dumps(run_raw(root, args.seconds, window)))
            return
        count = 3 if args.case == "ml-3" else 1
        ensemble = (1, 1, 1) if count == 1 else (3, 2, 2)
        group = 64 if args.case == "ml-1-many" else 0
        logs = [root / f"bookie-{i}.log" if args.timeline else None for i in range(count)]
        bookies = [BookieProcess(root / f"bookie-{i}", log_path=logs[i]) for i in range(count)]
        spans: list[float] | None = [] if args.timeline else None
        try:
            for b in bookies:
                b.start()
            cpu0 = sum(b.cpu_s() for b in bookies)
            addresses = [b.address for b in bookies]
            result = run_on_reactor(
                lambda r: _ml_appends(
                    r, addresses, ensemble, args.seconds, not args.no_freeze, group, spans
                )
            )
            assert isinstance(result, dict)
            cpu = sum(b.cpu_s() for b in bookies) - cpu0
            result["bookie_cpu_us"] = cpu / result["entries"] * 1e6
        finally:
            for b in bookies:
                b.kill(signal.SIGTERM)
        if spans is not None:
            checkpoints = [c for path in logs if path is not None for c in checkpoints_of(path)]
            result.update(timeline(list(zip(spans[::2], spans[1::2], strict=True)), checkpoints))
        print(json.dumps(result))


def checkpoints_of(log_path: Path) -> list[tuple[float, float]]:
    """(start, end) wall times of the checkpoints a bookie's debug log reports."""
    out = []
    for line in log_path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[3] != "checkpoint":
            continue
        fields = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
        if "seconds" not in fields:
            continue
        end = datetime.strptime(parts[0], "%Y-%m-%dT%H:%M:%S.%fZ")
        end_s = (end - datetime(1970, 1, 1)).total_seconds()
        out.append((end_s - float(fields["seconds"]), end_s))
    return out


def timeline(
    spans: list[tuple[float, float]], checkpoints: list[tuple[float, float]], bucket: float = 0.25
) -> dict[str, float]:
    """Print the appends' latency per ``bucket`` seconds beside the bookies' checkpoints (to
    stderr) and return the share of appends that overlapped a checkpoint, with their latency
    percentiles and those of the others (ms). The log's times have millisecond resolution."""
    if not spans:
        return {}
    start = min(s for s, _ in spans)

    def during(span: tuple[float, float]) -> bool:
        return any(a < span[1] and b > span[0] for a, b in checkpoints)

    buckets: dict[int, list[float]] = {}
    for s, e in spans:
        buckets.setdefault(int((e - start) / bucket), []).append(e - s)
    print(f"{'t s':>6} {'done':>6} {'p50 ms':>7} {'max ms':>7}  checkpoint", file=sys.stderr)
    for k in sorted(buckets):
        lat = buckets[k]
        t0, t1 = start + k * bucket, start + (k + 1) * bucket
        mark = "C" if any(a < t1 and b > t0 for a, b in checkpoints) else ""
        print(
            f"{k * bucket:6.2f} {len(lat):6d} {percentile(lat, 50) * 1e3:7.2f} "
            f"{max(lat) * 1e3:7.2f}  {mark}",
            file=sys.stderr,
        )
    inside = [e - s for s, e in spans if during((s, e))]
    outside = [e - s for s, e in spans if not during((s, e))]
    result = {"checkpoints": len(checkpoints), "ckpt_share": len(inside) / len(spans)}
    for name, lat in (("in_ckpt", inside), ("outside_ckpt", outside)):
        if lat:
            result[f"p50_{name}_ms"] = percentile(lat, 50) * 1e3
            result[f"p99_{name}_ms"] = percentile(lat, 99) * 1e3
    return result


def restart_case(fill_gb: float) -> dict[str, float]:
    """Fill a bookie with ``fill_gb`` of entries, kill -9 it, and time its restart and RSS."""
    with tempfile.TemporaryDirectory(prefix="pb-bench-") as tmp:
        bookie = BookieProcess(Path(tmp) / "bookie")
        bookie.start()
        try:
            subprocess.run(
                [sys.executable, __file__, "--fill", bookie.address, "--fill-gb", str(fill_gb)],
                check=True,
                timeout=1800,
            )
            bookie.kill(signal.SIGKILL)
            restart_s = bookie.start()
            subprocess.run(
                [sys.executable, __file__, "--probe", bookie.address], check=True, timeout=120
            )
            rss = bookie.rss_mb()
        finally:
            bookie.kill(signal.SIGTERM)
    return {"restart_s": restart_s, "rss_mb": rss, "fill_gb": fill_gb}


async def _fill(reactor: object, address: str, fill_gb: float) -> None:
    """Write ``fill_gb`` of 64 KiB entries into ledger 1 of a bookie, 64 outstanding."""
    from twisted.internet.defer import DeferredList

    from polybroker.ledger.bookie_client import TcpBookieClient

    client = TcpBookieClient(address, reactor)
    blob = os.urandom(64 * 1024)
    total = int(fill_gb * 1024 * 1024 * 1024) // len(blob)
    entry = 0
    while entry < total:
        batch = range(entry, min(total, entry + 64))
        await DeferredList(
            [client.add_entry(1, e, e - 1, blob) for e in batch], fireOnOneErrback=True
        )
        entry = batch[-1] + 1
    await client.close()


async def _probe(reactor: object, address: str) -> None:
    """Read a few entries back, so the restarted bookie has served real reads."""
    from polybroker.ledger.bookie_client import TcpBookieClient

    client = TcpBookieClient(address, reactor)
    for e in (0, 1, 100, 1000):
        data = await client.read_entry(1, e)
        assert len(data) == 64 * 1024
    await client.close()


def _closed_loop(ml: object, payload: bytes, count: int, outstanding: int) -> object:
    """Append ``payload`` ``count`` times, ``outstanding`` at a time; a Deferred of the end."""
    from twisted.internet.defer import Deferred

    done: Deferred[None] = Deferred()
    state = {"issued": 0, "acked": 0}

    def ok(_: object, __: object) -> None:
        state["acked"] += 1
        if state["issued"] < count:
            issue()
        elif state["acked"] == count and not done.called:
            done.callback(None)

    def failed(error: Exception, _: object) -> None:
        if not done.called:
            done.errback(error)

    def issue() -> None:
        state["issued"] += 1
        ml.append_then(payload, ok, failed)  # type: ignore[attr-defined]

    for _ in range(outstanding):
        issue()
    return done


async def _reactor_sizes(reactor: object, sizes: list[int]) -> dict[str, dict[str, float]]:
    """The standalone's own stack in this process (a bookie, the ledger client reaching it in
    memory, a managed ledger; journal fsync on): per entry size, appends with 64 outstanding,
    and the CPU of this (the reactor's) thread per entry and per byte, which the journal's
    threads do not count in."""
    import tempfile as _tempfile

    from polybroker.config import Config
    from polybroker.ledger.api import ManagedLedgerConfig
    from polybroker.ledger.bookie.server import BookieServer
    from polybroker.ledger.client import BookKeeperClient
    from polybroker.ledger.local import local_connector, serving
    from polybroker.ledger.managed import ManagedLedgerFactoryImpl
    from polybroker.ledger.registry import StaticBookieRegistry
    from polybroker.metadata.memory import MemoryMetadataStore

    outstanding = 64
    store = MemoryMetadataStore(reactor)
    config = Config({"maxMessageSize": max(sizes) + 1024 * 1024})
    results: dict[str, dict[str, float]] = {}
    with _tempfile.TemporaryDirectory(prefix="storage-bench-") as data_dir:
        bookie = BookieServer(config, data_dir, reactor, metadata_store=store)
        await bookie.start()
        connect = local_connector(reactor, {bookie.address: serving(bookie)})
        client = BookKeeperClient(store, StaticBookieRegistry([bookie.address]), connect, reactor)
        factory = ManagedLedgerFactoryImpl(store, client, reactor)
        try:
            for size in sizes:
                ml = await factory.open(f"bench/size-{size}", ManagedLedgerConfig(1, 1, 1))
                payload = os.urandom(size)
                count = max(2000, min(20000, 40 * 1024 * 1024 // size))
                for _ in range(50):  # warm up
                    await ml.append(payload)
                gc.collect()
                journal = bookie.bookie.journal  # type: ignore[union-attr]
                groups0, wakeups0 = journal.groups_written, getattr(journal, "wakeups", 0)
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                await _closed_loop(ml, payload, count, outstanding)
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
                us = cpu / count * 1e6
                results[str(size)] = {
                    "reactor_us_per_entry": us,
                    "reactor_ns_per_byte": us * 1000 / size,
                    "entries_per_s": count / wall,
                    "journal_groups": journal.groups_written - groups0,
                    "journal_wakeups": getattr(journal, "wakeups", 0) - wakeups0,
                }
                print(f"size {size}: {json.dumps(results[str(size)])}", file=sys.stderr)
        finally:
            await factory.close()
            await client.close()
            await bookie.stop()
    return results


async def _lone(reactor: object, count: int, gap_s: float, size: int) -> dict[str, float]:
    """The standalone's own stack in this process (as ``--reactor-sizes``), one append at a
    time, each issued ``gap_s`` after the previous one completed: the latency of a lone
    acknowledged publish (journal fsync on), its percentiles, the reactor thread's CPU per
    append, the whole process's (the journal's threads too) and the journal writer's wake-ups."""
    import tempfile as _tempfile

    from twisted.internet.defer import Deferred

    from polybroker.config import Config
    from polybroker.ledger.api import ManagedLedgerConfig
    from polybroker.ledger.bookie.server import BookieServer
    from polybroker.ledger.client import BookKeeperClient
    from polybroker.ledger.local import local_connector, serving
    from polybroker.ledger.managed import ManagedLedgerFactoryImpl
    from polybroker.ledger.registry import StaticBookieRegistry
    from polybroker.metadata.memory import MemoryMetadataStore
    from polybroker.runtime import settle_heap

    store = MemoryMetadataStore(reactor)
    with _tempfile.TemporaryDirectory(prefix="storage-bench-") as data_dir:
        bookie = BookieServer(Config({}), data_dir, reactor, metadata_store=store)
        await bookie.start()
        connect = local_connector(reactor, {bookie.address: serving(bookie)})
        client = BookKeeperClient(store, StaticBookieRegistry([bookie.address]), connect, reactor)
        factory = ManagedLedgerFactoryImpl(store, client, reactor)
        try:
            ml = await factory.open("bench/lone", ManagedLedgerConfig(1, 1, 1))
            payload = os.urandom(size)
            for _ in range(50):  # warm up
                await ml.append(payload)
            settle_heap(reactor)  # as the standalone does once it has started
            journal = bookie.bookie.journal  # type: ignore[union-attr]
            groups0, wakeups0 = journal.groups_written, journal.wakeups
            lone0 = getattr(journal, "lone_groups", 0)
            latencies: list[float] = []
            done: Deferred[None] = Deferred()

            def issue() -> None:
                t0 = time.perf_counter()

                def ok(_: object) -> None:
                    latencies.append(time.perf_counter() - t0)
                    if len(latencies) < count:
                        reactor.callLater(gap_s, issue)  # type: ignore[attr-defined]
                    else:
                        done.callback(None)

                ml.append(payload).addCallbacks(ok, done.errback)

            cpu0, proc0 = time.thread_time(), time.process_time()
            issue()
            await done
            cpu, proc = time.thread_time() - cpu0, time.process_time() - proc0
            return {
                "appends": count,
                "p10_ms": percentile(latencies, 10) * 1e3,
                "p50_ms": percentile(latencies, 50) * 1e3,
                "p90_ms": percentile(latencies, 90) * 1e3,
                "p99_ms": percentile(latencies, 99) * 1e3,
                "p999_ms": percentile(latencies, 99.9) * 1e3,
                "reactor_us_per_append": cpu / count * 1e6,
                "process_us_per_append": proc / count * 1e6,
                "journal_groups": journal.groups_written - groups0,
                "journal_wakeups": journal.wakeups - wakeups0,
                "journal_lone_groups": getattr(journal, "lone_groups", 0) - lone0,
            }
        finally:
            await factory.close()
            await client.close()
            await bookie.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each case")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the cases")
    parser.add_argument("--window-ms", type=float, default=1.0, help="journal group window")
    parser.add_argument(
        "--fill-gb", type=float, default=1.0, help="data for the restart case (0: skip it)"
    )
    parser.add_argument(
        "--no-freeze", action="store_true", help="no gc.freeze() in the appending process"
    )
    cases = ["raw", "raw-nowait", "ml-1", "ml-3"]
    parser.add_argument(
        "--cases", default=",".join(cases), help="comma-separated cases (raw is always run)"
    )
    cases.append("ml-1-many")
    parser.add_argument(
        "--reactor-sizes",
        metavar="BYTES,...",
        help="instead: the standalone's in-process stack, reactor CPU per entry of these sizes",
    )
    parser.add_argument(
        "--lone",
        type=int,
        metavar="COUNT",
        help="instead: COUNT lone appends of --lone-size bytes on the standalone's in-process "
        "stack, each --lone-gap-ms after the previous one completed; their latency",
    )
    parser.add_argument("--lone-gap-ms", type=float, default=2.0)
    parser.add_argument("--lone-size", type=int, default=200)
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="managed-ledger cases: print add latency per 250 ms beside the bookies' "
        "checkpoints (stderr), and the latency of appends during checkpoints and outside",
    )
    parser.add_argument("--case", choices=cases, help=argparse.SUPPRESS)
    parser.add_argument("--fill", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--probe", metavar="ADDR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        case_main(args)
        return
    if args.fill:
        run_on_reactor(lambda r: _fill(r, args.fill, args.fill_gb))
        return
    if args.probe:
        run_on_reactor(lambda r: _probe(r, args.probe))
        return
    if args.lone:
        lone = run_on_reactor(lambda r: _lone(r, args.lone, args.lone_gap_ms / 1e3, args.lone_size))
        print(json.dumps({"lone": lone}))
        return
    if args.reactor_sizes:
        sizes = [int(x) for x in args.reactor_sizes.split(",")]
        by_size = run_on_reactor(lambda r: _reactor_sizes(r, sizes))
        assert isinstance(by_size, dict)
        print(f"{'size':>8} {'us/entry':>9} {'ns/byte':>8} {'entries/s':>10}")
        for size, r in by_size.items():
            print(
                f"{size:>8} {r['reactor_us_per_entry']:9.1f} {r['reactor_ns_per_byte']:8.2f} "
                f"{r['entries_per_s']:10.0f}"
            )
        print(json.dumps({"reactor_sizes": by_size}))
        return

    chosen = ["raw"] + [c for c in args.cases.split(",") if c in cases and c != "raw"]
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in chosen}
    for round_no in range(args.rounds):
        for case in runs:
            host = host_ms()
            out = (
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--case",
                        case,
                        "--seconds",
                        str(args.seconds),
                        "--window-ms",
                        str(args.window_ms),
                        *(["--no-freeze"] if args.no_freeze else []),
                        *(["--timeline"] if args.timeline else []),
                    ],
                    check=True,
                    stdout=subprocess.PIPE,
                    stderr=None if args.timeline else subprocess.PIPE,  # the series goes through
                    text=True,
                    timeout=600,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            runs[case].append({**json.loads(out), "host_ms": host})
            print(f"round {round_no + 1} {case}: {json.dumps(runs[case][-1])}", file=sys.stderr)

    def med(case: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[case])

    result: dict[str, object] = {}
    for case in runs:
        keys = ("entries_per_s", "mb_per_s", "p50_ms", "p99_ms", "p999_ms", "host_ms")
        keys += ("client_cpu_us", "bookie_cpu_us")
        keys += ("ckpt_share", "p50_in_ckpt_ms", "p99_in_ckpt_ms")
        keys += ("p50_outside_ckpt_ms", "p99_outside_ckpt_ms")
        result[case] = {k: med(case, k) for k in keys if all(k in r for r in runs[case])}
    for case in ("ml-1", "ml-3", "ml-1-many"):
        if case not in runs:
            continue
        result[f"{case}_vs_raw_throughput"] = med(case, "entries_per_s") / med(
            "raw", "entries_per_s"
        )
        result[f"{case}_vs_raw_p99"] = med(case, "p99_ms") / med("raw", "p99_ms")
    if args.fill_gb > 0:
        result["restart"] = restart_case(args.fill_gb)
    print(f"{'case':9} {'entries/s':>10} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for case in runs:
        r = result[case]
        assert isinstance(r, dict)
        print(
            f"{case:9} {r['entries_per_s']:10.0f} {r['mb_per_s']:8.1f} "
            f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
