"""Fixtures of the Spark tests: one ``polybroker standalone`` process and one local[2] session.

The broker runs as a real process on free ports and is stopped by PID; Spark's workers run
the test's own interpreter (``PYSPARK_PYTHON``, through the launcher of ``local_session``), as the
data source requires.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from spark_harness import Broker, start_broker, wait_healthy


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A standalone broker for the module, stopped (SIGTERM, then SIGKILL) at its end."""
    root = tmp_path_factory.mktemp("standalone")
    b = start_broker(root / "data", root / "standalone.log")
    try:
        wait_healthy(b)
        yield b
    finally:
        b.proc.send_signal(signal.SIGTERM)
        try:
            b.proc.wait(20)
        except subprocess.TimeoutExpired:
            b.proc.kill()
            b.proc.wait(10)
        if b.proc.stdout is not None:
            b.proc.stdout.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] SparkSession for every Spark test; workers run this interpreter, through
    the launcher ``local_session`` gives them (``polybroker.spark.session.worker_python``), and
    streaming sources start from its fork server (``start_fork_server``), stopped after it."""
    from polybroker.spark.session import start_fork_server, stop_fork_server, worker_python

    python = worker_python()
    os.environ["PYSPARK_PYTHON"] = python
    os.environ["PYSPARK_DRIVER_PYTHON"] = python
    from pyspark.sql import SparkSession

    start_fork_server()

    session = (
        SparkSession.builder.master("local[2]")
        .appName("polybroker-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        stop_fork_server()


@pytest.fixture
def pulsar_client(broker: Broker) -> Iterator[Any]:
    """A Pulsar client of the module's broker, closed (and collected) after the test."""
    c = pulsar.Client(broker.service_url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        yield c
    finally:
        c.close()
        gc.collect()
