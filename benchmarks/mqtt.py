"""MQTT benchmark: polybroker's MQTT handler against Mosquitto and amqtt, side by side, with paho.

One run starts ``polybroker standalone`` (MQTT enabled, scratch data dir: QoS 1 publishes are
acknowledged after the fsync'd bookie write), Mosquitto (no persistence, no queue limit) and the
amqtt broker, each on a free loopback port, and runs the shared paho benchmark
(``bench_mqtt.py``, the same client, counts and arguments for every broker) against each,
alternating brokers case by case (each repeat starting with the next): burst QoS 0 and QoS 1
(end-to-end msgs/s, lost, duplicates, and the broker process's CPU per message, which moves
less than msgs/s on a shared machine, with the paho processes' own: on two cores the broker and
both clients share the CPU, so msgs/s follows their sum) and QoS 1 paced at 2k msgs/s (latency
percentiles).
Then it opens ``--idle-clients`` MQTT connections with keep-alive to polybroker and reports its
RSS and CPU while they sit idle. The machine is shared and noisy: quote medians of ``--repeat``
runs and ratios.

``--lone N`` runs instead N lone QoS 1 publishes (each an entry and a durable write of its own:
sent once the previous one was acknowledged and delivered) against polybroker and Mosquitto,
with a raw MQTT client in this process: latency and the broker's CPU per publish. With
``--callgrind FILE`` polybroker runs under callgrind, collecting only during the measured
publishes, and the exact instructions per publish are reported: the figure to compare trees
by on a machine whose CPU time moves with other load.

Prints a table, then one JSON line as the last line. Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import free_port, wait_port

BENCH = Path(os.environ.get("BENCH_MQTT", Path(__file__).parent / "clients" / "bench_mqtt.py"))

CASES: list[tuple[str, list[str], int]] = [
    # (name, bench_mqtt.py arguments, message count divisor)
    ("qos0", ["--qos", "0"], 1),
    ("qos1", ["--qos", "1"], 1),
    ("qos1-paced-2k", ["--qos", "1", "--rate", "2000"], 2),
]


class Server:
    """A broker process on a free loopback port, stopped by its PID."""

    name = ""

    def __init__(self, scratch: Path) -> None:
        self.port = free_port()
        self.scratch = scratch
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        log = (self.scratch / "server.log").open("wb")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            wait_port(self.port, 60, self.proc)
        except RuntimeError as e:
            tail = (self.scratch / "server.log").read_bytes()[-600:].decode(errors="replace")
            raise RuntimeError(f"{self.name}: {e}\n{tail}") from None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class Polybroker(Server):
    name = "polybroker"

    def __init__(self, scratch: Path, callgrind_out: Path | None = None) -> None:
        super().__init__(scratch)
        #: Run under callgrind with collection off until ``callgrind(True)`` (``--lone``).
        self.callgrind_out = callgrind_out

    def command(self) -> list[str]:
        conf = self.scratch / "broker.conf"
        conf.write_text("messagingProtocols=mqtt\nstatsUpdateFrequencyInSecs=60\n")
        prefix = []
        if self.callgrind_out is not None:
            prefix = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={self.callgrind_out}",
            ]
        return [
            *prefix,
            os.path.realpath(sys.executable),
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
            "--amqp-port",
            "0",
            "--mqtt-port",
            str(self.port),
            "--config",
            str(conf),
        ]


class Mosquitto(Server):
    name = "mosquitto"

    def command(self) -> list[str]:
        conf = self.scratch / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "max_queued_messages 0\n"
        )
        return ["mosquitto", "-c", str(conf)]


class Amqtt(Server):
    name = "amqtt"

    def command(self) -> list[str]:
        conf = self.scratch / "amqtt.yaml"
        conf.write_text(
            "listeners:\n  default:\n    type: tcp\n"
            f"    bind: 127.0.0.1:{self.port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        return [shutil.which("amqtt") or "amqtt", "-c", str(conf)]


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_case(port: int, args: list[str], n: int, timeout_s: float) -> dict[str, Any]:
    """Run the paho benchmark once; its result, with the CPU seconds of its processes
    (publisher and subscriber) as ``client_cpu_s``."""
    cmd = [sys.executable, str(BENCH), "--port", str(port), "-n", str(n)]
    cmd += ["--timeout", str(timeout_s), *args]
    cpu0 = _children_cpu_s()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s * 3, check=False)
    client_cpu_s = _children_cpu_s() - cpu0
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (done.stderr or done.stdout)[-300:]}
    return dict(json.loads(lines[-1]), client_cpu_s=client_cpu_s)


def _connect_raw(port: int, client_id: bytes) -> socket.socket:
    """A blocking MQTT 3.1.1 connection (clean session, keep-alive 60 s), CONNACK read."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(client_id).to_bytes(2, "big") + client_id
    s.sendall(b"\x10" + bytes([len(body)]) + body)
    assert _read_packet(s, bytearray())[0] == 0x20
    return s


def _read_packet(s: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """The next packet (first byte, body) of ``s`` (remaining length < 128), ``buf`` kept."""
    while len(buf) < 2 or len(buf) < 2 + buf[1]:
        data = s.recv(65536)
        if not data:
            raise RuntimeError("connection closed")
        buf += data
    if buf[1] >= 128:
        raise RuntimeError("unexpected packet size")
    first, body = buf[0], bytes(buf[2 : 2 + buf[1]])
    del buf[: 2 + buf[1]]
    return first, body


def lone_publishes(
    server: Server, count: int, warm: int, gap_s: float, on_warm: Any = None
) -> dict[str, Any]:
    """``warm`` then ``count`` QoS 1 publishes of 100 bytes, each sent ``gap_s`` after the
    previous one was acknowledged and delivered (to a QoS 1 subscriber, which acknowledges it):
    every publish is a lone one (an entry and a durable write of its own). Returns the
    latency (publish to both PUBACK and delivery) and the broker's CPU per publish, taken
    after the warm-up (``on_warm()`` runs then)."""
    assert server.proc is not None
    topic = b"bench/lone"
    sub, pub = _connect_raw(server.port, b"lone-sub"), None
    sub_buf, pub_buf = bytearray(), bytearray()
    body = b"\x00\x01" + len(topic).to_bytes(2, "big") + topic + b"\x01"
    sub.sendall(b"\x82" + bytes([len(body)]) + body)
    assert _read_packet(sub, sub_buf)[0] == 0x90
    pub = _connect_raw(server.port, b"lone-pub")
    lat: list[float] = []
    cpu0 = 0.0
    try:
        for i in range(warm + count):
            if i == warm:
                if on_warm is not None:
                    on_warm()
                _, cpu0 = proc_stats(server.proc.pid)
            pid = i % 65535 + 1
            body = len(topic).to_bytes(2, "big") + topic + pid.to_bytes(2, "big")
            body += i.to_bytes(8, "big") + bytes(92)
            t0 = time.perf_counter()
            pub.sendall(b"\x32" + bytes([len(body)]) + body)
            first, _ = _read_packet(pub, pub_buf)
            assert first == 0x40, first
            first, got = _read_packet(sub, sub_buf)
            assert first & 0xF0 == 0x30, first
            tl = int.from_bytes(got[:2], "big")
            sub.sendall(b"\x40\x02" + got[2 + tl : 4 + tl])
            if i >= warm:
                lat.append(time.perf_counter() - t0)
            time.sleep(gap_s)
        _, cpu1 = proc_stats(server.proc.pid)
    finally:
        sub.close()
        pub.close()
    lat.sort()
    return {
        "publishes": count,
        "lat_ms_p50": round(1e3 * lat[len(lat) // 2], 3),
        "lat_ms_p99": round(1e3 * lat[int(len(lat) * 0.99)], 3),
        "cpu_us_per_msg": round(1e6 * (cpu1 - cpu0) / count, 1),
    }


def callgrind_total(path: Path) -> int | None:
    """The instruction count callgrind wrote to ``path`` (the larger of its ``summary:`` and
    ``totals:`` lines: with collection switched on late, ``summary:`` may read 0)."""
    counts = []
    try:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                counts.append(int(line.split()[1]))
    except (OSError, ValueError, IndexError):
        return None
    return max(counts) if counts else None


def lone_main(args: argparse.Namespace, scratch: Path) -> None:
    """``--lone``: lone publishes against polybroker and Mosquitto; with ``--callgrind``,
    polybroker runs under callgrind, collecting only during the measured publishes, and the
    instructions per publish are reported (the client runs in this process, not counted)."""
    out = Path(args.callgrind).resolve() if args.callgrind else None
    poly = Polybroker(scratch / "polybroker", out)
    servers: list[Server] = [poly] if out is not None else [poly, Mosquitto(scratch / "mosq")]
    results: dict[str, Any] = {}
    try:
        for s in servers:
            s.start()

        def toggle(on: bool) -> None:
            assert poly.proc is not None
            subprocess.run(
                ["callgrind_control", "-i", "on" if on else "off", str(poly.proc.pid)],
                capture_output=True,
                timeout=60,
                check=True,
            )

        for s in servers:
            grind = out is not None and s is poly
            r = lone_publishes(
                s,
                args.lone,
                args.lone_warm,
                args.lone_gap_ms / 1e3,
                (lambda: toggle(True)) if grind else None,
            )
            if grind:
                toggle(False)
            results[s.name] = r
    finally:
        for s in servers:
            s.stop()
    if out is not None:
        total = callgrind_total(out)
        if total is not None:
            results["polybroker"]["instructions_per_msg"] = round(total / args.lone)
        if not args.keep_callgrind:
            out.unlink(missing_ok=True)
    for name, r in results.items():
        print(f"lone {name:11} {r}")
    print(json.dumps({"lone": results}))


_IDLE_SCRIPT = r"""
import socket, sys, time
port, n, keep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    cid = f"idle-{i}".encode()
    body = b"\x00\x04MQTT\x04\x02" + keep.to_bytes(2, "big") + len(cid).to_bytes(2, "big") + cid
    s.sendall(b"\x10" + bytes([len(body)]) + body)
    socks.append(s)
    if i % 500 == 499:
        for t in socks[-500:]:
            assert t.recv(4) == b"\x20\x02\x00\x00"
for t in socks[len(socks) - len(socks) % 500:]:
    assert t.recv(4) == b"\x20\x02\x00\x00"
print("READY", flush=True)
sys.stdin.readline()
"""


def proc_stats(pid: int) -> tuple[float, float]:
    """(RSS MB, CPU seconds) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024.0, (int(fields[11]) + int(fields[12])) / ticks


def idle_clients(server: Server, n: int, idle_s: float) -> dict[str, Any]:
    """Connect ``n`` clients (keep-alive 60 s), then measure RSS and CPU while idle."""
    assert server.proc is not None
    rss0, _ = proc_stats(server.proc.pid)
    holder = subprocess.Popen(
        [sys.executable, "-c", _IDLE_SCRIPT, str(server.port), str(n), "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        t0 = time.monotonic()
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if not line.startswith("READY"):
            return {"error": "idle clients did not connect"}
        connect_s = time.monotonic() - t0
        _, cpu0 = proc_stats(server.proc.pid)
        time.sleep(idle_s)
        rss, cpu1 = proc_stats(server.proc.pid)
        return {
            "clients": n,
            "connect_s": round(connect_s, 2),
            "rss_mb_before": round(rss0, 1),
            "rss_mb": round(rss, 1),
            "idle_cpu_pct": round(100 * (cpu1 - cpu0) / idle_s, 2),
        }
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20000, help="messages per burst case")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--idle-clients", type=int, default=10000)
    ap.add_argument("--idle-seconds", type=float, default=20)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument(
        "--lone",
        type=int,
        default=0,
        help="instead: this many lone QoS 1 publishes (each after the previous one completed)",
    )
    ap.add_argument("--lone-warm", type=int, default=200, help="lone publishes before measuring")
    ap.add_argument("--lone-gap-ms", type=float, default=0.5)
    ap.add_argument(
        "--callgrind",
        metavar="FILE",
        help="with --lone: run polybroker under callgrind and report instructions per publish",
    )
    ap.add_argument("--keep-callgrind", action="store_true", help="keep the --callgrind FILE")
    args = ap.parse_args()
    wanted = set(args.cases.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="bench-mqtt-"))
    if args.lone:
        try:
            lone_main(args, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    servers: list[Server] = [
        Polybroker(scratch / "polybroker"),
        Mosquitto(scratch / "mosquitto"),
        Amqtt(scratch / "amqtt"),
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {} for s in servers}
    idle: dict[str, Any] = {}
    try:
        for s in servers:
            s.start()
        for rep in range(args.repeat):
            # Each repeat starts with another broker: none is always first after a pause.
            order = servers[rep % len(servers) :] + servers[: rep % len(servers)]
            for case, case_args, div in CASES:
                if case not in wanted:
                    continue
                for s in order:
                    assert s.proc is not None
                    _, cpu0 = proc_stats(s.proc.pid)
                    r = run_case(s.port, case_args, args.n // div, args.timeout)
                    _, cpu1 = proc_stats(s.proc.pid)
                    if r.get("received"):
                        r["cpu_us_per_msg"] = round(1e6 * (cpu1 - cpu0) / r["received"], 1)
                        r["client_cpu_us_per_msg"] = round(
                            1e6 * r["client_cpu_s"] / r["received"], 1
                        )
                    results[s.name].setdefault(case, []).append(r)
        if args.idle_clients > 0:
            idle = idle_clients(servers[0], args.idle_clients, args.idle_seconds)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    def med(name: str, case: str, key: str) -> float | None:
        vals = [r[key] for r in results[name].get(case, []) if r.get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None

    summary: dict[str, Any] = {"n": args.n, "repeat": args.repeat, "cases": {}}
    print(
        f"{'case':16} {'broker':11} {'e2e msg/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'lost':>6}"
        f" {'cpu us/msg':>10} {'clients':>8}"
    )
    for case, _a, div in CASES:
        if case not in wanted:
            continue
        row: dict[str, Any] = {}
        for s in servers:
            runs = results[s.name].get(case, [])
            lost = max((args.n // div - r.get("received", 0) for r in runs), default=None)
            row[s.name] = {
                "e2e_msgs_per_s": med(s.name, case, "e2e_msgs_per_s"),
                "lat_ms_p50": med(s.name, case, "lat_ms_p50"),
                "lat_ms_p99": med(s.name, case, "lat_ms_p99"),
                "cpu_us_per_msg": med(s.name, case, "cpu_us_per_msg"),
                "client_cpu_us_per_msg": med(s.name, case, "client_cpu_us_per_msg"),
                "lost_max": lost,
                "dups_max": max((r.get("dups", 0) for r in runs), default=None),
                "errors": [r["error"] for r in runs if "error" in r],
            }
            v = row[s.name]
            print(
                f"{case:16} {s.name:11} {v['e2e_msgs_per_s']!s:>10} {v['lat_ms_p50']!s:>9} "
                f"{v['lat_ms_p99']!s:>9} {lost!s:>6} {v['cpu_us_per_msg']!s:>10}"
                f" {v['client_cpu_us_per_msg']!s:>8}"
            )
        pb, mq, am = (row[k]["e2e_msgs_per_s"] for k in ("polybroker", "mosquitto", "amqtt"))
        if pb and mq:
            row["ratio_vs_mosquitto"] = round(pb / mq, 2)
        if pb and am:
            row["ratio_vs_amqtt"] = round(pb / am, 2)
        p99_pb, p99_mq = row["polybroker"]["lat_ms_p99"], row["mosquitto"]["lat_ms_p99"]
        if p99_pb and p99_mq:
            row["p99_ratio_vs_mosquitto"] = round(p99_pb / p99_mq, 2)
        summary["cases"][case] = row
    if idle:
        print(f"idle clients: {idle}")
        summary["idle"] = idle
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
