"""AMQP benchmark: polybroker's AMQP handler against RabbitMQ, side by side, with pika.

One run starts a private RabbitMQ node (loopback only, its own epmd port, scratch dirs) and a
``polybroker standalone`` (AMQP enabled, scratch data dir), then runs the shared pika benchmark
(``bench_amqp.py``) against each, case by case (each broker first in every other case), for:
no confirms, a confirm per message, async confirms with a window, each transient and persistent
(durable queue, delivery_mode 2), end to end with a concurrent consumer; and a backlog drain
(publish first, then consume); and both for a fanout to five durable queues (rates count
deliveries). The machine is shared and noisy: quote medians of ``--repeat`` runs and the ratios.
Each case also records the broker's CPU time per message (user + system time of its processes,
from ``/proc``, over the case; deliveries for the fanout cases), steadier than rates on a loaded
machine.

Prints a table, then one JSON line as the last line. Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import free_port, wait_port

BENCH = Path(os.environ.get("BENCH_AMQP", Path(__file__).parent / "clients" / "bench_amqp.py"))
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")

CASES: list[tuple[str, list[str], int]] = [
    # (name, bench_amqp.py arguments, message count divisor)
    ("noconfirm", ["--mode", "noconfirm"], 1),
    ("noconfirm-persistent", ["--mode", "noconfirm", "--persistent"], 1),
    ("confirm", ["--mode", "confirm"], 10),
    ("confirm-persistent", ["--mode", "confirm", "--persistent"], 10),
    # The same with no consumer (publish rate): RabbitMQ confirms a persistent message once it
    # is on disk *or* consumed and acknowledged on every queue, so with a fast consumer it may
    # confirm before any fsync; polybroker always confirms after the journal's fsync. Here
    # both confirm after the disk write.
    (
        "confirm-persistent-noconsumer",
        ["--mode", "confirm", "--persistent", "--consume", "none"],
        10,
    ),
    ("confirm-async", ["--mode", "confirm-async"], 1),
    ("confirm-async-persistent", ["--mode", "confirm-async", "--persistent"], 1),
    ("drain-backlog", ["--mode", "confirm-async", "--consume", "after"], 1),
    (
        "drain-backlog-persistent",
        ["--mode", "confirm-async", "--consume", "after", "--persistent"],
        1,
    ),
    # A fanout to five durable queues: rates count deliveries (five per message).
    (
        "fanout5-confirm-async-persistent",
        ["--mode", "confirm-async", "--persistent", "--fanout", "5"],
        5,
    ),
    (
        "fanout5-drain-backlog-persistent",
        ["--mode", "confirm-async", "--consume", "after", "--persistent", "--fanout", "5"],
        5,
    ),
]


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(session: int) -> float:
    """User + system CPU time of every process in session ``session`` (its leader's PID)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # Fields after the command name (which may hold spaces) start at the state.
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # session id
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


class Rabbit:
    """A private RabbitMQ node on loopback."""

    def __init__(self, scratch: Path) -> None:
        self.port = free_port()
        self.scratch = scratch
        self.env = {
            **os.environ,
            "HOME": str(scratch),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_NODENAME": f"bench{os.getpid()}@localhost",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(scratch / "mnesia"),
            "RABBITMQ_LOG_BASE": str(scratch / "log"),
            "RABBITMQ_CONFIG_FILE": str(scratch / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(scratch / "enabled_plugins"),
        }
        (scratch / "enabled_plugins").write_text("[].\n")
        (scratch / "rabbitmq.conf").write_text("loopback_users = none\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(RABBIT_BIN / "rabbitmq-server")],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_port(self.port, 90, self.proc)

    def stop(self) -> None:
        if self.proc is None:
            return
        subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "stop"],
            env=self.env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        # The server and the epmd it started run in the session we created: end that group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        # epmd daemonizes out of that group: find the one on our private epmd port by its PID.
        marker = f"ERL_EPMD_PORT={self.env['ERL_EPMD_PORT']}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if b"epmd" in (proc / "cmdline").read_bytes() and marker in (
                    proc / "environ"
                ).read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGTERM)
            except OSError:
                continue
        self.proc = None


class Polybroker:
    """``polybroker standalone`` with AMQP on a free port."""

    def __init__(self, scratch: Path) -> None:
        self.port = free_port()
        self.scratch = scratch
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = self.scratch / "broker.conf"
        conf.write_text("messagingProtocols=amqp\nstatsUpdateFrequencyInSecs=60\n")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "polybroker",
                "standalone",
                "--data-dir",
                str(self.scratch / "data"),
                "--pulsar-port",
                "0",
                "--http-port",
                "0",
                "--kafka-port",
                "0",
                "--mqtt-port",
                "0",
                "--amqp-port",
                str(self.port),
                "--config",
                str(conf),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_port(self.port, 60, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def run_case(port: int, args: list[str], n: int, timeout_s: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(BENCH),
        "--port",
        str(port),
        "-n",
        str(n),
        "--timeout",
        str(timeout_s),
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s * 3, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stderr or done.stdout)[-300:]}
    return dict(json.loads(lines[-1]))


def rate_of(result: dict[str, Any], case: str) -> float | None:
    if "drain" in case:
        key = "consume_msgs_per_s"
    elif "noconsumer" in case:
        key = "pub_msgs_per_s"
    else:
        key = "e2e_msgs_per_s"
    value = result.get(key)
    return float(value) if isinstance(value, int | float) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000, help="messages per case (confirm: n/10)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--no-rabbit", action="store_true", help="polybroker only")
    a = ap.parse_args()
    wanted = set(a.cases.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="amqp-bench-"))
    brokers: dict[str, Any] = {"polybroker": Polybroker(scratch / "pb")}
    (scratch / "pb").mkdir()
    if not a.no_rabbit and (RABBIT_BIN / "rabbitmq-server").exists():
        (scratch / "rabbit").mkdir()
        brokers["rabbitmq"] = Rabbit(scratch / "rabbit")
    results: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    try:
        for b in brokers.values():
            b.start()
        turn = 0
        for _ in range(a.repeat):
            for case, args, divisor in CASES:
                if case not in wanted:
                    continue
                # Each broker goes first every other case: neither always meets the other's
                # leftovers (queue deletion, compaction, a warm page cache) or a quieter moment.
                order = list(brokers.items())
                if turn % 2:
                    order.reverse()
                turn += 1
                for name, b in order:
                    n = max(100, a.n // divisor)
                    before = cpu_seconds(b.proc.pid)
                    r = run_case(b.port, args, n, a.timeout)
                    # Microseconds per delivery (a fanout delivers each message five times).
                    us = (
                        (cpu_seconds(b.proc.pid) - before)
                        * 1e6
                        / (n * (divisor if "fanout" in case else 1))
                    )
                    rate = rate_of(r, case)
                    shown = f"{rate:.1f} msg/s, {us:.0f} us CPU/msg" if rate is not None else r
                    print(f"{case:26} {name:10} {shown}", flush=True)
                    if rate is not None:
                        results.setdefault(case, {}).setdefault(name, []).append(rate)
                        cpu.setdefault(case, {}).setdefault(name, []).append(us)
    finally:
        for b in brokers.values():
            b.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    summary: dict[str, Any] = {}
    for case, per in results.items():
        medians = {name: statistics.median(v) for name, v in per.items()}
        row: dict[str, Any] = {f"{k}_msgs_per_s": round(v, 1) for k, v in medians.items()}
        for k, v in cpu.get(case, {}).items():
            row[f"{k}_cpu_us_per_msg"] = round(statistics.median(v), 1)
        if medians.get("rabbitmq"):
            row["ratio"] = round(medians.get("polybroker", 0.0) / medians["rabbitmq"], 3)
        summary[case] = row
    print(json.dumps({"benchmark": "amqp", "n": a.n, "repeat": a.repeat, "cases": summary}))


if __name__ == "__main__":
    main()
