"""``polybroker standalone`` with MQTT as a real process: what was acknowledged survives kill -9
(QoS 1 messages for a persistent session, retained messages, the session itself)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mqtt_harness import Client

_READY = "polybroker standalone ready "


class Process:
    """A standalone process started with every port 0; stopped by PID at teardown."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        conf = data_dir.parent / "broker.conf"
        conf.write_text("messagingProtocols=mqtt\nstatsUpdateFrequencyInSecs=0\n")
        cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(data_dir)]
        for flag in ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port", "--amqp-port"):
            cmd += [flag, "0"]
        cmd += ["--config", str(conf)]
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        self.mqtt_port = self._ready(60.0)["mqttListenerPort"]

    def _ready(self, timeout: float) -> dict[str, int]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffered = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                assert chunk, f"standalone exited: {self.log.read_text(errors='replace')[-2000:]}"
                buffered += chunk
                for line in buffered.decode(errors="replace").splitlines():
                    if line.startswith(_READY):
                        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
        raise AssertionError(f"not ready in {timeout}s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in started:
        p.stop()


def test_kill9_loses_no_acknowledged_message(processes: list[Process], tmp_path: Path) -> None:
    """QoS 1 publishes acknowledged before kill -9 reach the persistent session after a
    restart on the same data dir, which finds its session; the retained message survives."""
    data = tmp_path / "data"
    first = Process(data, tmp_path / "standalone.log")
    processes.append(first)
    dev = Client(first.mqtt_port, "dev", clean=False)
    dev.subscribe("k9/#", 1)
    dev.close()
    pub = Client(first.mqtt_port, "pub")
    n = 200
    for i in range(n):
        pub.publish(f"k9/{i % 4}", str(i).encode(), 1)
    pub.publish("k9/retained", b"kept", 1, retain=True)
    pub.drop()
    first.stop(signal.SIGKILL)

    second = Process(data, tmp_path / "standalone.log")
    processes.append(second)
    back = Client(second.mqtt_port, "dev", clean=False)
    assert back.session_present
    got = {m.payload for m in back.get_n(n + 1, timeout=30)}
    assert got == {str(i).encode() for i in range(n)} | {b"kept"}
    back.close()
    late = Client(second.mqtt_port, "late")
    late.subscribe("k9/retained", 0)
    m = late.get(timeout=10)
    assert (m.payload, m.retain) == (b"kept", True)
    late.close()
