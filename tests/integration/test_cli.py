"""``polybroker client`` and ``polybroker admin`` as real commands against a real standalone.

One ``polybroker standalone`` process (every port 0, stopped by PID at teardown) serves the
module; each test uses its own topics, tenants or namespaces. The commands run as
``python -m polybroker ...`` subprocesses, each bounded by a timeout.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

_READY = "polybroker standalone ready "
_CMD_TIMEOUT = 60.0


@dataclass
class Standalone:
    """A running standalone process and its URLs."""

    proc: subprocess.Popen[bytes]
    ports: dict[str, int]
    log: Path

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['webServicePort']}"

    @property
    def service_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.ports['brokerServicePort']}"


def _start(data_dir: Path, log: Path, timeout: float = 60.0) -> Standalone:
    cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(data_dir)]
    for flag in ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port", "--amqp-port"):
        cmd += [flag, "0"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _stop(proc)
                raise TimeoutError(f"not ready in {timeout}s: {log.read_text()}")
            if not sel.select(remaining):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                proc.wait(10)
                raise RuntimeError(f"standalone exited: {log.read_text()}")
            buffered += chunk
            for line in buffered.decode(errors="replace").splitlines():
                if line.startswith(_READY):
                    ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                    return Standalone(proc, ports, log)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def _wait_healthy(broker: Standalone, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            url = f"{broker.admin_url}/admin/v2/brokers/health"
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.read() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not healthy within {timeout}s")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """One standalone for the module, stopped (SIGTERM, then SIGKILL) at teardown."""
    root = tmp_path_factory.mktemp("cli")
    b = _start(root / "data", root / "standalone.log")
    try:
        _wait_healthy(b)
        yield b
    finally:
        assert _stop(b.proc) == 0, b.log.read_text()


def polybroker(*args: str, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``python -m polybroker ARGS`` to completion; return its result."""
    return subprocess.run(
        [sys.executable, "-m", "polybroker", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def admin(broker: Standalone, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one ``polybroker admin`` command against the broker."""
    return polybroker("admin", "--admin-url", broker.admin_url, *args)


def admin_json(broker: Standalone, *args: str) -> Any:
    """Run one admin command that must succeed and print JSON; return the decoded JSON."""
    r = admin(broker, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def admin_lines(broker: Standalone, *args: str) -> list[str]:
    """Run one admin command that must succeed; return its output lines."""
    r = admin(broker, *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def client(broker: Standalone, verb: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one ``polybroker client`` command against the broker to completion."""
    return polybroker("client", verb, "--service-url", broker.service_url, *args)


def start_consumer(broker: Standalone, *args: str) -> subprocess.Popen[str]:
    """Start ``polybroker client consume ARGS``; return once it says it has subscribed."""
    cmd = [sys.executable, "-m", "polybroker", "client", "consume"]
    proc = subprocess.Popen(
        [*cmd, "--service-url", broker.service_url, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + _CMD_TIMEOUT
    seen = ""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while "subscribed to " not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                proc.kill()
                _, err = proc.communicate(timeout=10)
                raise AssertionError(f"consumer did not subscribe: {seen}{err}")
            if sel.select(remaining):
                seen += proc.stderr.readline()
    return proc


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait (bounded) for a started command; return (status, stdout, rest of stderr)."""
    try:
        out, err = proc.communicate(timeout=_CMD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"did not finish: {out}{err}") from None
    return proc.returncode, out, err


def messages_of(output: str) -> list[str]:
    """The ``key:[..], properties:[..], content:..`` lines of ``client consume`` output."""
    return [line for line in output.splitlines() if line.startswith("key:[")]


def test_quick_start_step_by_step(broker: Standalone) -> None:
    """Pulsar's quick start: consume with a subscription, produce hello-pulsar, curl the stats."""
    consumer = start_consumer(broker, "my-topic", "-s", "first-subscription")
    produced = client(broker, "produce", "my-topic", "--messages", "hello-pulsar")
    assert produced.returncode == 0, produced.stderr
    assert "1 messages successfully produced" in produced.stdout
    status, out, err = finish(consumer)
    assert status == 0, err
    assert out.splitlines() == [
        "----- got message -----",
        "key:[null], properties:[], content:hello-pulsar",
        "1 messages successfully consumed",
    ]
    url = f"{broker.admin_url}/admin/v2/persistent/public/default/my-topic/stats"
    curl = shutil.which("curl")
    if curl is not None:
        fetched = subprocess.run([curl, "-s", url], capture_output=True, timeout=30, check=True)
        body = fetched.stdout
    else:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = resp.read()
    stats = json.loads(body)
    assert stats["msgInCounter"] == 1
    assert stats["subscriptions"]["first-subscription"]["msgOutCounter"] == 1
    assert stats["subscriptions"]["first-subscription"]["msgBacklog"] == 0


def test_produce_many_then_consume_from_earliest_with_key_and_properties(
    broker: Standalone,
) -> None:
    """-m twice with the separator, -n 3, a key and properties arrive in order on a new sub."""
    topic = "persistent://public/default/cli-many"
    produced = client(
        broker, "produce", topic, "-m", "a,b", "-m", "c", "-n", "3", "-k", "k1", "-p", "x=y"
    )
    assert produced.returncode == 0, produced.stderr
    assert "9 messages successfully produced" in produced.stdout
    consumed = client(
        broker, "consume", topic, "-s", "reader", "-p", "Earliest", "-t", "Shared", "-n", "9"
    )
    assert consumed.returncode == 0, consumed.stderr
    assert messages_of(consumed.stdout) == [
        f"key:[k1], properties:[x=y], content:{m}" for m in ["a", "b", "c"] * 3
    ]
    assert "9 messages successfully consumed" in consumed.stdout
    stats = admin_json(broker, "topics", "stats", topic)
    assert stats["subscriptions"]["reader"]["type"] == "Shared"
    assert stats["subscriptions"]["reader"]["msgBacklog"] == 0


def test_paced_produce_reports_progress_and_consume_forever_stops_on_ctrl_c(
    broker: Standalone,
) -> None:
    """A run longer than a second prints progress; -n 0 consumes until SIGINT, then exits 0."""
    topic = "cli-progress"
    consumer = start_consumer(broker, topic, "-s", "forever", "-n", "0")
    produced = client(broker, "produce", topic, "-m", "tick", "-n", "600", "-r", "400", "-db")
    assert produced.returncode == 0, produced.stderr
    assert re.search(r"produced \d+/600 messages \(\d+ msg/s\)", produced.stderr)
    # Wait (bounded) until the subscription has taken everything, then stop the consumer.
    deadline = time.monotonic() + _CMD_TIMEOUT
    while time.monotonic() < deadline:
        sub = admin_json(broker, "topics", "stats", topic)["subscriptions"]["forever"]
        if sub["msgOutCounter"] == 600 and sub["msgBacklog"] == 0:
            break
        time.sleep(0.1)
    consumer.send_signal(signal.SIGINT)
    status, out, err = finish(consumer)
    assert status == 0, err
    assert len(messages_of(out)) == 600
    assert "600 messages successfully consumed" in out


def test_admin_tenants_namespaces_and_clusters(broker: Standalone) -> None:
    """Create, list and delete a tenant and a namespace; set deduplication; list clusters."""
    assert admin_lines(broker, "clusters", "list") == ["standalone"]
    assert admin(broker, "tenants", "create", "acme").returncode == 0
    assert "acme" in admin_lines(broker, "tenants", "list")
    assert admin(broker, "namespaces", "create", "acme/orders").returncode == 0
    assert admin_lines(broker, "namespaces", "list", "acme") == ["acme/orders"]
    dedup = admin(broker, "namespaces", "set-deduplication", "acme/orders", "--enable")
    assert dedup.returncode == 0, dedup.stderr
    assert admin_json(broker, "namespaces", "get-deduplication", "acme/orders") is True
    assert admin_json(broker, "namespaces", "policies", "acme/orders")["deduplicationEnabled"]
    for verb, flag in [("max-producers-per-topic", "-p"), ("message-ttl", "--ttl")]:
        assert admin(broker, "namespaces", f"set-{verb}", "acme/orders", flag, "3").returncode == 0
        assert admin_json(broker, "namespaces", f"get-{verb}", "acme/orders") == 3
        assert admin(broker, "namespaces", f"remove-{verb}", "acme/orders").returncode == 0
        assert admin_json(broker, "namespaces", f"get-{verb}", "acme/orders") is None
    quota = ["-l", "10M", "-lt", "2h", "-p", "consumer_backlog_eviction"]
    assert admin(broker, "namespaces", "set-backlog-quota", "acme/orders", *quota).returncode == 0
    assert admin_json(broker, "namespaces", "get-backlog-quotas", "acme/orders") == {
        "destination_storage": {
            "limitSize": 10 << 20,
            "limitTime": 7200,
            "policy": "consumer_backlog_eviction",
        }
    }
    assert admin(broker, "namespaces", "remove-backlog-quota", "acme/orders").returncode == 0
    assert admin_json(broker, "namespaces", "get-backlog-quotas", "acme/orders") == {}
    negative = admin(broker, "namespaces", "set-max-consumers-per-topic", "acme/orders", "-c", "-1")
    assert negative.returncode == 1
    assert "HTTP 412" in negative.stderr

    dup = admin(broker, "tenants", "create", "acme")
    assert (dup.returncode, dup.stdout) == (1, "")
    assert dup.stderr.startswith("error: HTTP 409: ")
    busy = admin(broker, "tenants", "delete", "acme")
    assert busy.returncode == 1
    assert "HTTP 409" in busy.stderr

    assert admin(broker, "namespaces", "delete", "acme/orders").returncode == 0
    assert admin_lines(broker, "namespaces", "list", "acme") == []
    assert admin(broker, "tenants", "delete", "acme").returncode == 0
    assert "acme" not in admin_lines(broker, "tenants", "list")


def test_admin_topics_lifecycle_and_stats(broker: Standalone) -> None:
    """Create plain and partitioned topics, list them, read their stats, terminate, delete."""
    ns = "public/default"
    assert admin(broker, "topics", "create", "cli-plain").returncode == 0
    parts = admin(broker, "topics", "create-partitioned-topic", "cli-parts", "-p", "2")
    assert parts.returncode == 0, parts.stderr
    listed = admin_lines(broker, "topics", "list", ns)
    assert "persistent://public/default/cli-plain" in listed
    assert "persistent://public/default/cli-parts-partition-1" in listed
    assert "persistent://public/default/cli-parts" in admin_lines(
        broker, "topics", "list-partitioned-topics", ns
    )
    meta = admin_json(broker, "topics", "get-partitioned-topic-metadata", "cli-parts")
    assert meta == {"partitions": 2}
    for name in ("cli-plain", "cli-parts"):  # a topic's own policies
        assert admin(broker, "topics", "set-message-ttl", name, "-t", "30").returncode == 0
        assert admin_json(broker, "topics", "get-message-ttl", name) == 30
        assert admin(broker, "topics", "remove-message-ttl", name).returncode == 0
        assert admin_json(broker, "topics", "get-message-ttl", name) is None
    produced = client(broker, "produce", "cli-parts", "-m", "p", "-n", "4", "-db")
    assert produced.returncode == 0, produced.stderr
    pstats = admin_json(broker, "topics", "partitioned-stats", "cli-parts", "--per-partition")
    assert pstats["metadata"]["partitions"] == 2
    assert pstats["msgInCounter"] == 4
    internal = admin_json(broker, "topics", "partitioned-stats-internal", "cli-parts")
    assert sum(p["entriesAddedCounter"] for p in internal["partitions"].values()) >= 1
    assert sorted(pstats["partitions"]) == [
        f"persistent://public/default/cli-parts-partition-{i}" for i in (0, 1)
    ]

    produced = client(broker, "produce", "cli-plain", "-m", "one,two", "-db")
    assert produced.returncode == 0, produced.stderr
    assert admin_json(broker, "topics", "stats", "cli-plain")["msgInCounter"] == 2
    internal = admin_json(broker, "topics", "stats-internal", "cli-plain")
    assert internal["numberOfEntries"] == 2
    last = admin_json(broker, "topics", "last-message-id", "cli-plain")
    assert internal["lastConfirmedEntry"] == f"{last['ledgerId']}:{last['entryId']}"

    terminated = admin(broker, "topics", "terminate", "cli-plain")
    assert terminated.returncode == 0, terminated.stderr
    assert "Topic successfully terminated" in terminated.stdout
    refused = client(broker, "produce", "cli-plain", "-m", "three", "-db")
    assert refused.returncode == 1
    assert "error" in refused.stderr
    assert admin(broker, "topics", "unload", "cli-plain").returncode == 0
    assert admin(broker, "topics", "delete", "cli-plain").returncode == 0
    assert "persistent://public/default/cli-plain" not in admin_lines(broker, "topics", "list", ns)
    assert admin(broker, "topics", "delete-partitioned-topic", "cli-parts").returncode == 0
    missing = admin(broker, "topics", "stats", "cli-plain")
    assert missing.returncode == 1
    assert "HTTP 404" in missing.stderr


def test_admin_subscriptions_skip_reset_and_unsubscribe(broker: Standalone) -> None:
    """A subscription made by admin sees the backlog; skip -n and --all shrink and clear it;
    reset brings it back."""
    topic = "cli-subs"
    produced = client(broker, "produce", topic, "-m", "1,2,3,4,5", "-db")
    assert produced.returncode == 0, produced.stderr
    created = admin(broker, "topics", "create-subscription", topic, "-s", "audit", "-m", "earliest")
    assert created.returncode == 0, created.stderr
    assert admin(broker, "topics", "create-subscription", topic, "-s", "tail").returncode == 0
    assert sorted(admin_lines(broker, "topics", "subscriptions", topic)) == ["audit", "tail"]

    def backlog(sub: str) -> int:
        return int(admin_json(broker, "topics", "stats", topic)["subscriptions"][sub]["msgBacklog"])

    assert (backlog("audit"), backlog("tail")) == (5, 0)
    assert admin(broker, "topics", "skip", topic, "-s", "audit", "-n", "2").returncode == 0
    assert backlog("audit") == 3
    assert admin(broker, "topics", "skip", topic, "-s", "audit", "--all").returncode == 0
    assert backlog("audit") == 0
    assert admin(broker, "topics", "reset-cursor", topic, "-s", "audit", "-t", "1h").returncode == 0
    assert backlog("audit") == 5
    assert admin(broker, "topics", "clear-backlog", topic, "-s", "audit").returncode == 0
    assert backlog("audit") == 0
    first = admin_json(broker, "topics", "stats-internal", topic)["ledgers"][0]["ledgerId"]
    reset = admin(broker, "topics", "reset-cursor", topic, "-s", "audit", "-m", f"{first}:2")
    assert reset.returncode == 0, reset.stderr
    consumed = client(broker, "consume", topic, "-s", "audit", "-n", "3")
    assert consumed.returncode == 0, consumed.stderr
    assert [m.rsplit(":", 1)[1] for m in messages_of(consumed.stdout)] == ["3", "4", "5"]

    assert admin(broker, "topics", "unsubscribe", topic, "-s", "audit").returncode == 0
    assert admin_lines(broker, "topics", "subscriptions", topic) == ["tail"]
    gone = admin(broker, "topics", "unsubscribe", topic, "-s", "audit")
    assert gone.returncode == 1
    assert "HTTP 404" in gone.stderr


def test_admin_errors_are_clear_and_exit_non_zero(broker: Standalone) -> None:
    """Bad names, an unreachable URL and a missing resource print an error and exit 1."""
    bad = admin(broker, "topics", "stats", "a/b/c/d")
    assert (bad.returncode, bad.stdout) == (1, "")
    assert "invalid topic name" in bad.stderr
    bad_ns = admin(broker, "namespaces", "create", "no-slash")
    assert bad_ns.returncode == 1
    assert "invalid namespace name" in bad_ns.stderr
    unreachable = polybroker("admin", "--admin-url", "http://127.0.0.1:1", "tenants", "list")
    assert unreachable.returncode == 1
    assert "cannot reach http://127.0.0.1:1" in unreachable.stderr
    missing = admin(broker, "namespaces", "list", "no-such-tenant")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: HTTP 404: ")
    usage = polybroker("admin", "topics", "create-partitioned-topic", "x")
    assert usage.returncode == 2
    assert "--partitions" in usage.stderr


def test_files_hex_and_an_http_service_url(broker: Standalone, tmp_path: Path) -> None:
    """-f sends a file's bytes as they are; --hex shows them; http:// service URLs work too."""
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\x00\xffbin")
    http_url = ["--service-url", broker.admin_url]
    produced = polybroker("client", "produce", "cli-files", "-f", str(blob), *http_url)
    assert produced.returncode == 0, produced.stderr
    consumed = polybroker(
        "client", "consume", "cli-files", "-s", "s", "-p", "Earliest", "--hex", *http_url
    )
    assert consumed.returncode == 0, consumed.stderr
    assert messages_of(consumed.stdout) == ["key:[null], properties:[], content:00ff62696e"]
    missing = client(broker, "produce", "cli-files", "-f", str(tmp_path / "absent"))
    assert missing.returncode == 1
    assert "absent" in missing.stderr


def test_admin_schemas_get(broker: Standalone) -> None:
    """A schema a client registered is shown by `admin schemas get`; none is a 404 error."""
    import pulsar
    from pulsar.schema import StringSchema

    topic = "persistent://public/default/cli-schema"
    c = pulsar.Client(
        broker.service_url,
        operation_timeout_seconds=30,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
    )
    try:
        producer = c.create_producer(topic, schema=StringSchema())
        producer.send("typed")
    finally:
        c.close()
    schema = admin_json(broker, "schemas", "get", topic)
    assert schema["type"] == "STRING"
    assert schema["version"] == 0
    assert admin_json(broker, "schemas", "get", topic, "-v", "0") == schema
    assert admin(broker, "schemas", "get", topic, "-v", "1").returncode == 1
    none = admin(broker, "schemas", "get", "cli-no-schema")
    assert none.returncode == 1
    assert none.stderr.startswith("error: HTTP 404: ")


def test_admin_peek_get_by_id_find_by_time_and_expire(broker: Standalone) -> None:
    """Messages the official client sent (lone ones, and an LZ4 batch) are shown by
    peek-messages and get-message-by-id as pulsar-admin shows them (a batch message by
    message), found by time with get-message-id, and acknowledged by expire-messages;
    peeking consumes nothing."""
    import pulsar

    topic = "persistent://public/default/cli-peek"
    before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60))
    c = pulsar.Client(
        broker.service_url,
        operation_timeout_seconds=30,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
    )
    try:
        c.subscribe(topic, "peeker").close()
        lone = c.create_producer(topic, batching_enabled=False)
        ids = [lone.send(f"lone-{i}".encode(), properties={"n": str(i)}) for i in range(2)]
        batched = c.create_producer(
            topic,
            batching_enabled=True,
            batching_max_publish_delay_ms=100,
            compression_type=pulsar.CompressionType.LZ4,
        )
        for i in range(3):
            batched.send_async(f"batch-{i}".encode(), None)
        batched.flush()
    finally:
        c.close()
    ledger = ids[0].ledger_id()

    def backlog() -> int:  # in entries, as Pulsar counts it: the batch is one
        stats = admin_json(broker, "topics", "stats", topic)
        return int(stats["subscriptions"]["peeker"]["msgBacklog"])

    assert backlog() == 3
    peeked = admin_lines(broker, "topics", "peek-messages", topic, "-s", "peeker", "-n", "10")
    headers = [line for line in peeked if "Message ID: " in line]
    assert headers == [
        f"Message ID: {ledger}:0",
        f"Message ID: {ledger}:1",
        *(f"Batch Message ID: {ledger}:2:{i}" for i in range(3)),
    ]
    text = "\n".join(peeked)
    for payload in ("lone-0", "lone-1", "batch-0", "batch-1", "batch-2"):
        assert f"|{payload}" in text  # the dump's printable column
    assert '"n": "1"' in text
    second = peeked.index(f"Message ID: {ledger}:1")
    assert peeked[second + 1].startswith("Publish time: ")
    publish_ms = int(peeked[second + 1].split(": ")[1])
    assert abs(publish_ms - time.time() * 1000) < 120_000

    one = admin_lines(broker, "topics", "get-message-by-id", topic, "-l", str(ledger), "-e", "1")
    assert one[0] == f"Message ID: {ledger}:1"
    assert any("|lone-1" in line for line in one)
    missing = admin(broker, "topics", "get-message-by-id", topic, "-l", str(ledger), "-e", "9")
    assert (missing.returncode, missing.stderr) == (1, "error: HTTP 404: Message not found\n")
    found = admin_json(broker, "topics", "get-message-id", topic, "-d", before)
    assert (found["ledgerId"], found["entryId"]) == (ledger, 0)

    assert backlog() == 3  # peeking consumed nothing
    expire = ("topics", "expire-messages", topic, "-s", "peeker", "-t")
    assert admin(broker, *expire, "1h").returncode == 0
    assert backlog() == 3  # nothing is an hour old
    assert admin(broker, *expire, "0s").returncode == 0
    assert backlog() == 0
    reset = admin(broker, "topics", "reset-cursor", topic, "-s", "peeker", "-t", "1h")
    assert reset.returncode == 0, reset.stderr
    assert backlog() == 3
    cleared = admin(broker, "namespaces", "clear-backlog", "public/default", "-s", "peeker")
    assert cleared.returncode == 0, cleared.stderr
    assert backlog() == 0
    empty = admin(broker, "topics", "peek-messages", topic, "-s", "peeker")
    assert (empty.returncode, empty.stderr) == (1, "error: HTTP 404: Message not found\n")
    gone = admin(broker, "namespaces", "unsubscribe", "public/default", "-s", "peeker")
    assert gone.returncode == 0, gone.stderr
    assert "peeker" not in admin_lines(broker, "topics", "subscriptions", topic)


def test_admin_peek_shows_a_kafka_record_as_a_pulsar_message(broker: Standalone) -> None:
    """A record a Kafka client produced (stored in the Kafka format) is peeked as the Pulsar
    message a Pulsar consumer gets: value, key, headers as properties, timestamp as event
    time."""
    from kafka import KafkaProducer

    kp = KafkaProducer(bootstrap_servers=f"127.0.0.1:{broker.ports['kafkaListenerPort']}")
    try:
        kp.send(
            "cli-kpeek", value=b"from-kafka", key=b"kk", headers=[("h", b"v")], timestamp_ms=1234
        ).get(timeout=30)
    finally:
        kp.close()
    partition = "persistent://public/default/cli-kpeek-partition-0"
    created = admin(broker, "topics", "create-subscription", partition, "-s", "k", "-m", "earliest")
    assert created.returncode == 0, created.stderr
    peeked = admin_lines(broker, "topics", "peek-messages", partition, "-s", "k")
    assert peeked[0].startswith("Message ID: ")
    assert peeked[2] == "Event time: 1234"
    assert '"h": "v"' in "\n".join(peeked)
    assert any("|from-kafka" in line for line in peeked)


def test_admin_brokers(broker: Standalone) -> None:
    """brokers list, leader-broker, healthcheck and the configuration verbs: the standalone
    is its own cluster's only broker and leader, and shows every setting in force."""
    web = broker.admin_url.removeprefix("http://")
    assert admin_lines(broker, "brokers", "list") == [web]
    assert admin_lines(broker, "brokers", "list", "standalone") == [web]
    assert admin_json(broker, "brokers", "leader-broker") == {
        "brokerId": web,
        "serviceUrl": broker.admin_url,
    }
    assert admin_lines(broker, "brokers", "healthcheck") == ["ok"]
    runtime = admin_json(broker, "brokers", "get-runtime-config")
    assert runtime["webServicePort"] == "0"  # as configured: the bound port is chosen at start
    assert runtime["brokerDeduplicationEnabled"] == "false"
    assert all(isinstance(v, str) for v in runtime.values())
    assert admin_lines(broker, "brokers", "list-dynamic-config") == []
    assert "metadataStoreUrl" in admin_json(broker, "brokers", "get-internal-config")
    other = admin(broker, "brokers", "list", "elsewhere")
    assert (other.returncode, other.stderr) == (1, "error: HTTP 404: Cluster does not exist\n")


def test_admin_schemas_upload_and_delete(broker: Standalone, tmp_path: Path) -> None:
    """schemas upload registers a version from a file (a refused one exits 1 with the
    broker's reason), get shows it, delete removes every version."""
    topic = "persistent://public/default/cli-uploaded"
    record = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "string"}]}
    first = tmp_path / "v1.json"
    first.write_text(json.dumps({"type": "JSON", "schema": json.dumps(record)}))
    assert admin_json(broker, "schemas", "upload", topic, "-f", str(first)) == {"version": 0}
    record["fields"].append({"name": "b", "type": "int"})  # no default: FULL refuses it
    second = tmp_path / "v2.json"
    second.write_text(json.dumps({"type": "JSON", "schema": json.dumps(record)}))
    refused = admin(broker, "schemas", "upload", topic, "-f", str(second))
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: HTTP 409: ")
    shown = admin_json(broker, "schemas", "get", topic)
    assert (shown["version"], shown["type"], json.loads(shown["data"])["name"]) == (0, "JSON", "R")
    assert admin(broker, "schemas", "delete", topic).returncode == 0
    assert admin(broker, "schemas", "get", topic).returncode == 1
    missing = admin(broker, "schemas", "upload", topic, "-f", str(tmp_path / "absent.json"))
    assert missing.returncode == 1
    assert "cannot read a schema" in missing.stderr
