"""The Java kafka-clients (what Spark's Kafka source and sink use) against the Kafka handler:
the driver's admin calls, the sink's idempotent producer and the executors' assign/seek/poll."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import pytest_twisted
from kafka_harness import Broker
from twisted.internet import threads

PROGRAM = Path(__file__).parent / "java" / "SparkKafkaCalls.java"


def _classpath() -> str | None:
    try:
        import pyflink
    except ImportError:
        return None
    jar = Path(next(iter(pyflink.__path__))) / "lib" / "kafka-clients.jar"
    extra = [Path("/usr/share/java/slf4j-api.jar"), Path("/usr/share/java/slf4j-nop.jar")]
    try:  # lz4-java, as Spark ships it beside the connector
        import pyspark

        extra += sorted((Path(pyspark.__file__).parent / "jars").glob("lz4-java-*.jar"))
    except ImportError:
        pass
    if not jar.exists():
        return None
    return ":".join(str(p) for p in [jar, *extra] if p.exists())


@pytest.mark.skipif(shutil.which("java") is None, reason="Java is not installed")
@pytest_twisted.ensureDeferred
async def test_spark_driver_sink_and_executor_calls(broker: Broker) -> None:
    """describeTopics, listOffsets (earliest, latest, by time), an idempotent acks=all lz4
    producer, and an executor consumer's assign/seek/poll/position all behave as on Kafka."""
    cp = _classpath()
    if cp is None:
        pytest.skip("kafka-clients.jar (shigawire-apache-flink-libraries) is not installed")

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["java", "-cp", cp, str(PROGRAM), broker.bootstrap, "spark-topic"],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    done = await threads.deferToThread(run)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={done.returncode} {done.stdout[-2000:]} {done.stderr[-4000:]}"
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["partitions"] == 2
    assert r["earliest"] == [0, 0]
    assert r["latest"] == [10, 10]
    assert r["by_time"] == [0, 0]
    assert r["consumed"] == 17
    assert r["position"] == 10
    assert r["beginning"] == 0
    assert r["end"] == 10
