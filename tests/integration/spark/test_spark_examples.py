"""The example pipelines, each run as its one command on local[2] against the standalone broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pulsar
import pytest
from spark_harness import Broker, produce

pytestmark = pytest.mark.slow


def _run(module: str, *args: str, timeout: float = 240) -> str:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_batch_export_writes_the_topic_to_parquet(
    spark: Any, broker: Broker, pulsar_client: Any, tmp_path: Path
) -> None:
    """The export command writes every message, with its columns, to a Parquet dataset."""
    topic = "persistent://public/default/export-me"
    produce(
        pulsar_client,
        topic,
        [{"value": f"row{i}".encode(), "key": f"k{i}", "props": {"n": str(i)}} for i in range(50)],
    )
    path = tmp_path / "export"
    out = _run(
        "polybroker.spark.export",
        "--service-url", broker.service_url,
        "--admin-url", broker.admin_url,
        "--topic", "export-me",
        "--path", str(path),
    )  # fmt: skip
    assert json.loads(out.strip().splitlines()[-1]) == {"rows": 50, "path": str(path)}
    rows = spark.read.parquet(str(path)).collect()
    assert sorted((r.value, r.key, r["__messageProperties"]["n"]) for r in rows) == sorted(
        (f"row{i}".encode(), f"k{i}".encode(), str(i)) for i in range(50)
    )
    assert {r["__topic"] for r in rows} == {topic}


def test_streaming_etl_publishes_windowed_aggregates(
    broker: Broker, pulsar_client: Any, tmp_path: Path
) -> None:
    """JSON readings become per-sensor, per-minute count/avg/max messages on the output topic."""
    minute = 1_700_000_040_000  # a whole minute, in ms
    readings = [
        {"sensor": "s1", "reading": 1.0, "at": minute + 1_000},
        {"sensor": "s1", "reading": 3.0, "at": minute + 2_000},
        {"sensor": "s2", "reading": 10.0, "at": minute + 3_000},
        {"sensor": "s1", "reading": 5.0, "at": minute + 61_000},
    ]
    messages: list[dict[str, Any]] = [
        {"value": json.dumps(r).encode(), "event": r["at"]} for r in readings
    ]
    messages.append({"value": b"not json", "event": minute})
    produce(pulsar_client, "persistent://public/default/readings", messages)
    _run(
        "polybroker.spark.etl",
        "--service-url", broker.service_url,
        "--admin-url", broker.admin_url,
        "--input", "readings",
        "--output", "aggregates",
        "--checkpoint", str(tmp_path / "ckpt"),
        "--available-now",
    )  # fmt: skip
    reader = pulsar_client.create_reader(
        "persistent://public/default/aggregates", pulsar.MessageId.earliest
    )
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    while reader.has_message_available():
        m = reader.read_next(10_000)
        body = json.loads(m.data())
        assert m.partition_key() == body["sensor"]
        latest[(body["sensor"], body["window_start"])] = body
    reader.close()
    figures = {k: (v["count"], v["avg"], v["max"]) for k, v in latest.items()}
    assert figures == {
        ("s1", "2023-11-14T22:14:00Z"): (2, 2.0, 3.0),
        ("s2", "2023-11-14T22:14:00Z"): (1, 10.0, 10.0),
        ("s1", "2023-11-14T22:15:00Z"): (1, 5.0, 5.0),
    }
