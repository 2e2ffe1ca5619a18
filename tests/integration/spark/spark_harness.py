"""Helpers of the Spark tests: a standalone broker process, producing, admin calls."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulsar
from standalone_process import start_standalone


@dataclass
class Broker:
    """A running standalone broker: its URLs and process."""

    proc: subprocess.Popen[bytes]
    service_url: str
    admin_url: str
    log: Path
    kafka_port: int = 0

    def options(self, **extra: str) -> dict[str, str]:
        """The data source options that reach this broker, plus ``extra``."""
        return {"service.url": self.service_url, "admin.url": self.admin_url, **extra}


def start_broker(
    data_dir: Path, log: Path, timeout: float = 60, config: dict[str, str] | None = None
) -> Broker:
    """Start ``polybroker standalone`` on free ports (with ``config`` keys, if given)."""
    proc, ports = start_standalone(data_dir, log, dict(config or {}), timeout)
    return Broker(
        proc,
        f"pulsar://127.0.0.1:{ports['brokerServicePort']}",
        f"http://127.0.0.1:{ports['webServicePort']}",
        log,
        ports.get("kafkaListenerPort", 0),
    )


def wait_healthy(broker: Broker, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(broker.admin_url + "/admin/v2/brokers/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def produce(
    client: Any,
    topic: str,
    messages: list[dict[str, Any]],
    *,
    batching: bool = True,
) -> None:
    """Publish ``messages`` (``value`` and optional ``key``, ``props``, ``event``), all acked."""
    producer = client.create_producer(
        topic,
        batching_enabled=batching,
        batching_max_messages=7,
        batching_max_publish_delay_ms=50,
        block_if_queue_full=True,
    )
    failures: list[Any] = []

    def done(res: Any, _mid: Any) -> None:
        if res != pulsar.Result.Ok:
            failures.append(res)

    for m in messages:
        kwargs: dict[str, Any] = {}
        if "key" in m:
            kwargs["partition_key"] = m["key"]
        if "props" in m:
            kwargs["properties"] = m["props"]
        if "event" in m:
            kwargs["event_timestamp"] = m["event"]
        producer.send_async(m["value"], done, **kwargs)
    producer.flush()
    producer.close()
    assert failures == []


def admin_put(broker: Broker, path: str) -> None:
    """PUT an admin path (``/admin/v2/...``) with no body; it must answer 204."""
    req = urllib.request.Request(broker.admin_url + path, method="PUT")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 204


def admin_get(broker: Broker, path: str) -> Any:
    """GET an admin path; its JSON."""
    with urllib.request.urlopen(broker.admin_url + path, timeout=10) as resp:
        return json.loads(resp.read())


def create_partitioned(broker: Broker, topic: str, partitions: int) -> None:
    """Create ``public/default/<topic>`` with ``partitions`` partitions through the admin API."""
    req = urllib.request.Request(
        f"{broker.admin_url}/admin/v2/persistent/public/default/{topic}/partitions",
        data=str(partitions).encode(),
        method="PUT",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 204


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
