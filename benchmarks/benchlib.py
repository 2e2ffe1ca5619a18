"""Helpers shared by the benchmark scripts in this folder."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago (the caller binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once something accepts connections on 127.0.0.1:``port``.

    Raise RuntimeError if ``proc`` (when given) exits first, or after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s}s")


def percentile(values: Sequence[float], q: float) -> float:
    """Return the q-th percentile (0..100) of ``values`` by nearest rank; nan when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]
