"""Test helper: ``polybroker`` processes started by a test and stopped by their PID.

``wait_for_line`` waits (bounded) for a process's ready line; ``start_standalone`` runs
``polybroker standalone`` on free loopback ports and returns its listener ports by config key;
``stop_process`` signals a process and waits for it; ``rss_mb`` and ``wait_until_idle``
watch one by its PID.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

READY = "polybroker standalone ready "
PORT_FLAGS = ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port", "--amqp-port")
#: Settings for small caches (16 MB each), so that a test's memory figures are not theirs.
SMALL_CACHES = {"managedLedgerCacheSizeMB": 16, "dbStorage_writeCacheMaxSizeMb": 16}


def wait_for_line(
    process: subprocess.Popen[bytes], marker: str, log: Path, timeout: float, what: str
) -> str:
    """The first line ``process`` prints on stdout that starts with ``marker`` (bounded); the
    process is killed if it takes longer, and its log is in the error if it exits first."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                process.kill()
                process.wait(10)
                raise TimeoutError(f"{what} did not start in {timeout}s: {log.read_text()}")
            if not sel.select(remaining):
                continue
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                code = process.wait(10)
                raise RuntimeError(f"{what} exited with {code}: {log.read_text()}")
            seen += chunk
            for line in seen.decode(errors="replace").splitlines():
                if line.startswith(marker):
                    return line


def start_standalone(
    data_dir: Path,
    log: Path,
    config: dict[str, object] | None = None,
    timeout: float = 60.0,
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Start ``polybroker standalone`` on free ports (with ``config`` keys, if given; the file
    goes beside ``log``); return the process once ready and its ports (``brokerServicePort``,
    ``webServicePort``, ``kafkaListenerPort``, ...). The log is appended to across restarts."""
    cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(data_dir)]
    for flag in PORT_FLAGS:
        cmd += [flag, "0"]
    if config:
        conf = log.with_suffix(".conf")
        conf.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
        cmd += ["--config", str(conf)]
    with open(log, "ab") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    line = wait_for_line(process, READY, log, timeout, "standalone")
    return process, {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def stop_and_remove(process: subprocess.Popen[bytes], data_dir: Path) -> None:
    """Stop the standalone (``stop_process``) and delete its data: for tests that write
    gigabytes, which pytest would otherwise keep for its last three runs."""
    stop_process(process)
    shutil.rmtree(data_dir, ignore_errors=True)


def stop_process(
    process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> None:
    """Send ``sig`` to the process (by its PID) and wait for it; SIGKILL if it outlives
    ``timeout``."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    if process.stdout is not None:
        process.stdout.close()


def rss_mb(pid: int) -> float:
    """The process's resident set size, in MB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_until_idle(pid: int, quiet_s: float = 0.5, bound_s: float = 60.0) -> None:
    """Wait (bounded) until the process has used no CPU for ``quiet_s``: it did all it could
    with what it was given."""
    deadline = time.monotonic() + bound_s
    last, since = _cpu_ticks(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _cpu_ticks(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise AssertionError("the process never went idle")


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    """One admin REST call (``body`` sent as JSON); its decoded JSON answer, or None when
    empty. An error status raises ``urllib.error.HTTPError``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None
