"""Cluster soak: soak.py's four-protocol load on ZooKeeper + bookies + brokers, killing them.

ZooKeeper, ``--bookies`` bookies and ``--brokers`` brokers run as processes under a scratch
directory (E=3, Qw=2, Qa=2; load shedding on, as by default, so bundles also move between live
brokers). The clients are soak.py's workers (its ``--worker`` mode), each given one broker's
ports as a load balancer would spread them; cluster mode forwards, relays and redirects what
another broker owns. Every ``--kill-every`` seconds (0.5x-1.5x) a random broker, or with
``--bookie-share`` a random bookie, is killed (SIGKILL) and started again at once on the same
ports and data dir: the clients reconnect on their own, the survivors take the dead broker's
bundles once its ZooKeeper session expires (``--session-ms``), and a bookie's ledgers change
ensembles around it.

The check is soak.py's: every sequence a producer saw acknowledged must be received; duplicates
are counted apart (at-least-once). Prints each kill, then the streams, the clients' errors, the
warnings and tracebacks in each process's log, and one JSON line as the last line. Every process
it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import free_port

# soak.py's workers and checks; it keeps this folder off the path once imported.
import soak  # isort: skip

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests" / "contract"))

from standalone_process import wait_for_line  # noqa: E402
from zk_server import ZooKeeperServer  # noqa: E402

REPLICATION = {
    "managedLedgerDefaultEnsembleSize": 3,
    "managedLedgerDefaultWriteQuorum": 2,
    "managedLedgerDefaultAckQuorum": 2,
}


class Node:
    """One bookie or broker process: started (and started again) on fixed ports and data dir."""

    def __init__(self, kind: str, n: int, root: Path, metadata: str, conf: Path) -> None:
        self.kind, self.name = kind, f"{kind}-{n}"
        self.log = root / f"{self.name}.log"
        self.data = root / self.name
        self.metadata, self.conf = metadata, conf
        if kind == "bookie":
            self.ports = {"bookie": free_port()}
        else:
            self.ports = {name: free_port() for name in soak.LISTENERS}
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        if self.kind == "bookie":
            return [
                "bookie",
                "--data-dir",
                str(self.data),
                "--port",
                str(self.ports["bookie"]),
                "--bind",
                "127.0.0.1",
                "--metadata",
                self.metadata,
                "--config",
                str(self.conf),
            ]
        cmd = ["broker", "--metadata", self.metadata, "--cluster", "soak", "--bind", "127.0.0.1"]
        for flag in soak.PORT_FLAGS:
            cmd += [flag, str(self.ports[soak.FLAG_LISTENERS[flag]])]
        return [*cmd, "--config", str(self.conf)]

    def start(self) -> None:
        """Start the process and wait (bounded) for its ready line."""
        marker = "bookie listening on " if self.kind == "bookie" else "polybroker broker ready "
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "polybroker", *self.command()],
                stdout=subprocess.PIPE,
                stderr=log,
            )
        wait_for_line(self.process, marker, self.log, 120, self.name)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def stop(self) -> None:
        if not self.running():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(60)
        self.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10, help="how long the load runs")
    ap.add_argument("--rate", type=float, default=40, help="msgs/s per protocol's own stream")
    ap.add_argument("--kill-every", type=float, default=30, help="seconds between kills (0: none)")
    ap.add_argument("--bookie-share", type=float, default=0.3, help="share of kills on bookies")
    ap.add_argument("--bookies", type=int, default=4, help="at least 4: E=3 needs a spare")
    ap.add_argument("--brokers", type=int, default=2)
    ap.add_argument("--session-ms", type=int, default=6000, help="ZooKeeper session timeout")
    ap.add_argument("--churn-seconds", type=float, default=60, help="mean life of a connection")
    ap.add_argument("--drain-seconds", type=float, default=240, help="longest drain at the end")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="polybroker-cluster-soak-"))
    zk = ZooKeeperServer.start(root / "zk")
    nodes: list[Node] = []
    workers: dict[str, subprocess.Popen[bytes]] = {}
    kills: list[dict[str, Any]] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        metadata = zk.url("/soak")
        init = ["initialize-cluster-metadata", "--cluster", "soak", "--metadata-store", metadata]
        subprocess.run([sys.executable, "-m", "polybroker", *init], check=True, capture_output=True)
        conf = root / "broker.conf"
        settings = {
            **REPLICATION,
            "messagingProtocols": "pulsar,kafka,mqtt,amqp",
            "metadataStoreSessionTimeoutMillis": args.session_ms,
            "managedLedgerMaxEntriesPerLedger": 5000,
            "managedLedgerMinLedgerRolloverTimeMinutes": 1,
        }
        conf.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        bookies = [Node("bookie", n + 1, root, metadata, conf) for n in range(args.bookies)]
        brokers = [Node("broker", n + 1, root, metadata, conf) for n in range(args.brokers)]
        nodes = bookies + brokers
        for node in nodes:
            node.start()
        start = time.time() + 20  # consumers subscribe first
        end = start + args.minutes * 60
        for i, name in enumerate(soak.WORKERS):
            cmd = [sys.executable, str(_HERE / "soak.py"), "--worker", name]
            cmd += ["--ports", json.dumps(brokers[i % len(brokers)].ports)]
            cmd += ["--start", str(start), "--end", str(end), "--rate", str(args.rate)]
            cmd += ["--churn-seconds", str(args.churn_seconds)]
            cmd += ["--drain-seconds", str(args.drain_seconds)]
            cmd += ["--out", str(root / f"{name}.json")]
            with (root / f"worker-{name}.log").open("wb") as out:
                workers[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        hard_end = end + args.drain_seconds + 180
        next_kill = start + args.kill_every * random.uniform(0.5, 1.5) if args.kill_every else end
        while any(p.poll() is None for p in workers.values()) and time.time() < hard_end:
            for node in nodes:
                if not node.running():
                    raise RuntimeError(f"{node.name} exited during the soak: see {node.log}")
            now = time.time()
            if start <= now < end and now >= next_kill:
                pool = bookies if random.random() < args.bookie_share else brokers
                node = random.choice(pool)
                node.kill()
                node.start()
                kills.append(
                    {"t": round(now - start), "node": node.name, "ready_s": time.time() - now}
                )
                print(
                    f"t={now - start:5.0f}s kill -9 {node.name}; ready again in "
                    f"{kills[-1]['ready_s']:.2f}s",
                    flush=True,
                )
                next_kill = time.time() + args.kill_every * random.uniform(0.5, 1.5)
            time.sleep(0.5)
        results = soak.collect(workers, root)
    finally:
        soak.stop_workers(workers)
        for node in reversed(nodes):
            node.stop()
        zk.stop()

    streams = soak.check(results)
    logs = {node.name: soak.log_problems(node.log) for node in nodes}
    summary = {
        "minutes": args.minutes,
        "rate_per_protocol": args.rate,
        "kills": len(kills),
        "kills_by_node": {n: sum(k["node"] == n for k in kills) for n in logs},
        "ready_s_max": round(max(k["ready_s"] for k in kills), 2) if kills else None,
        "acked_msgs": sum(v["acked"] for v in streams.values()),
        "lost": sum(v["lost"] for v in streams.values()),
        "dups": sum(v["dups"] for v in streams.values()),
        "log_errors": sum(lv["error"] + lv["critical"] for lv, _, _ in logs.values()),
        "log_warnings": sum(lv["warning"] for lv, _, _ in logs.values()),
        "log_tracebacks": sum(tb for _, tb, _ in logs.values()),
        "client_errors": {n: r.get("error_count", 0) for n, r in results.items()},
        "streams": streams,
        "scratch": str(root) if args.keep else None,
    }
    soak.print_streams(streams, results)
    for name, (_, _, first) in logs.items():
        for line in first:
            print(f"{name} log: {line}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
