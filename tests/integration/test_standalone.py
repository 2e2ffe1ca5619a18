"""``polybroker standalone`` as a real process: ready line, health, signals, kill -9 and restart.

Every process is started with every port 0 (the ready line tells the ports) and stopped by PID
at teardown (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from standalone_process import READY, wait_for_line

_PLUGIN_INSTALL = Path(__file__).parent.parent / "plugins" / "echo_protocol" / "install.py"


@dataclass
class Broker:
    """A running standalone process and its bound ports."""

    pid: int
    ports: dict[str, int]
    data_dir: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['webServicePort']}"


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """One HTTP request; return (status, body) also for error statuses."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_healthy(broker: Broker, timeout: float = 30.0, endpoint: str = "health") -> None:
    """Poll ``/admin/v2/brokers/<endpoint>`` until it answers 200 ok, within ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            status, body = http("GET", f"{broker.http}/admin/v2/brokers/{endpoint}", timeout=2)
            if (status, body) == (200, b"ok"):
                return
            last = (status, body)
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"not healthy within {timeout}s: {last}")


class Standalones:
    """Starts standalone processes; stops all of them at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.count = 0

    def spawn(
        self,
        data_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        self.count += 1
        log = self.root / f"standalone-{self.count}.log"
        cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(data_dir)]
        for flag in ("--pulsar-port", "--http-port", "--kafka-port", "--mqtt-port"):
            if flag not in extra:
                cmd += [flag, "0"]
        if "--amqp-port" not in extra:
            cmd += ["--amqp-port", "0"]
        cmd += list(extra)
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, env={**os.environ, **(env or {})}
            )
        self.procs[proc.pid] = proc
        self.logs[proc.pid] = log
        return proc

    def start(
        self, data_dir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> Broker:
        """Start one and wait (bounded) for its ready line."""
        proc = self.spawn(data_dir, *extra, env=env)
        line = wait_for_line(proc, READY, self.logs[proc.pid], timeout, "standalone")
        ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
        return Broker(proc.pid, ports, data_dir)

    def run_to_exit(self, data_dir: Path, *extra: str, timeout: float = 60) -> tuple[int, str]:
        """Run one expected to refuse to start; return (exit status, stderr)."""
        proc = self.spawn(data_dir, *extra)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc.pid, signal.SIGKILL)
            raise AssertionError(f"kept running: {self.log(proc.pid)}") from None
        self.procs.pop(proc.pid)
        if proc.stdout is not None:
            proc.stdout.close()
        return code, self.log(proc.pid)

    def stop(self, pid: int, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal one by PID and wait for it; return its exit status."""
        proc = self.procs.pop(pid)
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def log(self, pid: int) -> str:
        return self.logs[pid].read_text(errors="replace")

    def close(self) -> None:
        for pid in list(self.procs):
            proc = self.procs[pid]
            if proc.poll() is None:
                try:
                    self.stop(pid, signal.SIGTERM, timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            else:
                self.procs.pop(pid)
                if proc.stdout is not None:
                    proc.stdout.close()


def _metric(text: bytes, name: str) -> float:
    """The value of the one sample of ``name`` in a Prometheus text page."""
    values = [
        float(line.rsplit(b" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name.encode() + b"{")
    ]
    assert len(values) == 1, (name, values)
    return values[0]


@pytest.fixture
def standalones(tmp_path: Path) -> Iterator[Standalones]:
    """A factory of standalone processes, all stopped at teardown."""
    factory = Standalones(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


def test_ready_healthy_defaults_and_sigterm(standalones: Standalones, tmp_path: Path) -> None:
    """The ready line lists the ports; health is ok; defaults exist; SIGTERM exits 0 quickly."""
    broker = standalones.start(tmp_path / "data")
    assert broker.ports["webServicePort"] > 0
    assert broker.ports["bookiePort"] > 0
    wait_healthy(broker)
    assert http("GET", f"{broker.http}/admin/v2/clusters") == (200, b'["standalone"]')
    assert http("GET", f"{broker.http}/admin/v2/namespaces/public") == (
        200,
        b'["public/default"]',
    )
    status, metrics = http("GET", f"{broker.http}/metrics")
    assert status == 200
    assert b"pulsar_broker_topics_count" in metrics
    started = time.monotonic()
    assert standalones.stop(broker.pid, signal.SIGTERM) == 0
    assert time.monotonic() - started < 10


def test_sigint_stops_cleanly(standalones: Standalones, tmp_path: Path) -> None:
    """Ctrl+C (SIGINT) stops it with exit status 0."""
    broker = standalones.start(tmp_path / "data")
    wait_healthy(broker)
    assert standalones.stop(broker.pid, signal.SIGINT) == 0


def test_kill9_then_restart_on_the_same_data_dir(standalones: Standalones, tmp_path: Path) -> None:
    """After kill -9 a restart is healthy, keeps its bookie address and every namespace."""
    data = tmp_path / "data"
    first = standalones.start(data)
    wait_healthy(first)
    body = {"allowedClusters": ["standalone"]}
    assert http("PUT", f"{first.http}/admin/v2/tenants/acme", body)[0] == 204
    assert http("PUT", f"{first.http}/admin/v2/namespaces/acme/orders")[0] == 204
    assert http("PUT", f"{first.http}/admin/v2/persistent/acme/orders/t/partitions", 2)[0] == 204
    standalones.stop(first.pid, signal.SIGKILL)
    second = standalones.start(data)
    wait_healthy(second)
    assert second.ports["bookiePort"] == first.ports["bookiePort"]
    assert http("GET", f"{second.http}/admin/v2/namespaces/public")[1] == b'["public/default"]'
    assert http("GET", f"{second.http}/admin/v2/namespaces/acme")[1] == b'["acme/orders"]'
    status, body_bytes = http("GET", f"{second.http}/admin/v2/persistent/acme/orders/t/partitions")
    assert (status, json.loads(body_bytes)) == (200, {"partitions": 2})
    assert standalones.stop(second.pid) == 0


def test_a_port_in_use_is_refused_and_nothing_stays_bound(
    standalones: Standalones, tmp_path: Path
) -> None:
    """A busy HTTP port exits 1 naming the key and port; the data dir is free again after."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = standalones.run_to_exit(tmp_path / "data", "--http-port", str(port))
    assert code == 1
    assert f"webServicePort (broker) on 127.0.0.1:{port}" in err
    broker = standalones.start(tmp_path / "data")
    wait_healthy(broker)


def test_an_unknown_protocol_is_refused(standalones: Standalones, tmp_path: Path) -> None:
    """messagingProtocols naming nothing installed exits 1 listing what is installed."""
    conf = tmp_path / "broker.conf"
    conf.write_text("messagingProtocols=nonesuch\n")
    code, err = standalones.run_to_exit(tmp_path / "data", "--config", str(conf))
    assert code == 1
    assert "unknown protocol(s) nonesuch; installed:" in err
    assert not (tmp_path / "data").exists()


def test_a_third_party_protocol_served_by_the_standalone(
    standalones: Standalones, tmp_path: Path
) -> None:
    """The echo plugin, installed as a distribution on PYTHONPATH, is served when enabled."""
    spec = importlib.util.spec_from_file_location("echo_plugin_install", _PLUGIN_INSTALL)
    assert spec is not None
    assert spec.loader is not None
    installer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installer)
    paths = installer.install_into(tmp_path / "site")
    pythonpath = os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])
    conf = tmp_path / "broker.conf"
    conf.write_text("messagingProtocols=echo\n")
    broker = standalones.start(
        tmp_path / "data", "--config", str(conf), env={"PYTHONPATH": pythonpath}
    )
    wait_healthy(broker)
    with socket.create_connection(("127.0.0.1", broker.ports["echoPort"]), timeout=10) as s:
        s.sendall(b"hello")
        received = b""
        deadline = time.monotonic() + 10
        while b"hello" not in received and time.monotonic() < deadline:
            chunk = s.recv(1024)
            if not chunk:
                break
            received += chunk
    assert received == b"echo from standalone\nhello"
    assert standalones.stop(broker.pid) == 0


def _require_pulsar_handler() -> None:
    """The Pulsar handler must be installed for the client tests (it is part of the package)."""
    from polybroker.broker_core.host import installed_entry_points

    names = {ep.name for ep in installed_entry_points()}
    assert "pulsar" in names, f"the pulsar protocol handler is not installed: {sorted(names)}"


def test_pulsar_client_over_http_service_url(standalones: Standalones, tmp_path: Path) -> None:
    """The official client with an http:// service URL looks up over HTTP and round-trips."""
    import pulsar

    _require_pulsar_handler()
    broker = standalones.start(tmp_path / "data")
    wait_healthy(broker)
    client = pulsar.Client(broker.http, operation_timeout_seconds=20)
    try:
        topic = "persistent://public/default/over-http"
        consumer = client.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic)
        producer.send(b"hello-pulsar")
        msg = consumer.receive(timeout_millis=20_000)
        assert msg.data() == b"hello-pulsar"
        consumer.acknowledge(msg)

        # Partitioned metadata over HTTP: the client spreads keys over the three partitions.
        base = f"{broker.http}/admin/v2/persistent/public/default"
        assert http("PUT", f"{base}/parts/partitions", 3)[0] == 204
        parts = "persistent://public/default/parts"
        p_consumer = client.subscribe(parts, "s", initial_position=pulsar.InitialPosition.Earliest)
        p_producer = client.create_producer(parts)
        for i in range(12):
            p_producer.send(f"p{i}".encode(), partition_key=f"k{i}")
        got = set()
        for _ in range(12):
            m = p_consumer.receive(timeout_millis=20_000)
            got.add(m.data().decode())
            assert m.topic_name().startswith(f"{parts}-partition-")
            p_consumer.acknowledge(m)
        assert got == {f"p{i}" for i in range(12)}

        # The entry cache in /metrics: four logs, and the 13 entries delivered were read.
        status, text = http("GET", f"{broker.http}/metrics")
        assert status == 200
        assert _metric(text, "pulsar_ml_count") == 4
        used = _metric(text, "pulsar_ml_cache_used_size")  # 0 once every cursor acked
        assert 0 <= used <= _metric(text, "pulsar_ml_cache_max_size")
        assert _metric(text, "pulsar_ml_cache_max_size") > 0
        read = _metric(text, "pulsar_ml_cache_hits_total")
        assert read + _metric(text, "pulsar_ml_cache_misses_total") >= 13

        # A pattern subscription lists the namespace's topics over HTTP.
        pattern = re.compile(r"persistent://public/default/rx-.*")
        rx_producer = client.create_producer("persistent://public/default/rx-1")
        rx_consumer = client.subscribe(
            pattern, "rx", initial_position=pulsar.InitialPosition.Earliest
        )
        rx_producer.send(b"matched")
        assert rx_consumer.receive(timeout_millis=20_000).data() == b"matched"
    finally:
        client.close()
    assert standalones.stop(broker.pid) == 0


def test_kill9_loses_no_acknowledged_message_and_keeps_acks(
    standalones: Standalones, tmp_path: Path
) -> None:
    """Produce, consume and ack half, kill -9, restart: the other half arrives, in order."""
    import pulsar

    _require_pulsar_handler()
    data = tmp_path / "data"
    conf = tmp_path / "broker.conf"
    # Persist every mark-delete at once, so the test knows when acks are durable.
    conf.write_text("managedLedgerDefaultMarkDeleteRateLimit=1000\n")
    first = standalones.start(data, "--config", str(conf))
    wait_healthy(first)
    topic = "persistent://public/default/durable"
    url = f"pulsar://127.0.0.1:{first.ports['brokerServicePort']}"
    client = pulsar.Client(url, operation_timeout_seconds=20)
    try:
        consumer = client.subscribe(topic, "keep", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(20):
            producer.send(f"m{i}".encode())  # returns once the broker acknowledged it
        for i in range(10):
            msg = consumer.receive(timeout_millis=20_000)
            assert msg.data() == f"m{i}".encode()
            consumer.acknowledge(msg)
        stats_url = f"{first.http}/admin/v2/persistent/public/default/durable/stats"
        deadline = time.monotonic() + 20
        backlog = -1
        while time.monotonic() < deadline:
            stats = json.loads(http("GET", stats_url)[1])
            backlog = stats["subscriptions"]["keep"]["msgBacklog"]
            if backlog == 10:
                break
            time.sleep(0.05)
        assert backlog == 10
        internal_url = f"{first.http}/admin/v2/persistent/public/default/durable/internalStats"
        deadline = time.monotonic() + 20
        persisted = ""
        while time.monotonic() < deadline:
            internal = json.loads(http("GET", internal_url)[1])
            cursor = internal["cursors"]["keep"]
            persisted = cursor.get("persistedMarkDeletePosition", "")
            if persisted.endswith(":9"):
                break
            time.sleep(0.05)
        assert persisted.endswith(":9")
    finally:
        client.close()
    standalones.stop(first.pid, signal.SIGKILL)

    second = standalones.start(data, "--config", str(conf))
    wait_healthy(second)
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{second.ports['brokerServicePort']}", operation_timeout_seconds=20
    )
    try:
        consumer = client.subscribe(topic, "keep")
        got = []
        for _ in range(10):
            msg = consumer.receive(timeout_millis=20_000)
            got.append(msg.data().decode())
            consumer.acknowledge(msg)
        assert got == [f"m{i}" for i in range(10, 20)]
        with pytest.raises(pulsar.Timeout):
            consumer.receive(timeout_millis=500)
    finally:
        client.close()
    assert standalones.stop(second.pid) == 0


def test_namespace_deduplication_set_over_http(standalones: Standalones, tmp_path: Path) -> None:
    """With deduplication enabled on the namespace, a resent sequence id is stored once."""
    import pulsar

    _require_pulsar_handler()
    broker = standalones.start(tmp_path / "data")
    wait_healthy(broker)
    dedup = f"{broker.http}/admin/v2/namespaces/public/default/deduplication"
    assert http("POST", dedup, True)[0] == 204
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{broker.ports['brokerServicePort']}", operation_timeout_seconds=20
    )
    try:
        topic = "persistent://public/default/dedup"
        consumer = client.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(topic, producer_name="p1", batching_enabled=False)
        for seq in range(3):
            producer.send(f"m{seq}".encode(), sequence_id=seq)
        producer.close()
        again = client.create_producer(topic, producer_name="p1", batching_enabled=False)
        assert again.last_sequence_id() == 2
        again.send(b"m1-again", sequence_id=1)
        again.send(b"m3", sequence_id=3)
        got = [consumer.receive(timeout_millis=20_000).data() for _ in range(4)]
        assert got == [b"m0", b"m1", b"m2", b"m3"]
    finally:
        client.close()
    assert standalones.stop(broker.pid) == 0


def test_a_port_clash_between_protocol_and_http_is_refused(
    standalones: Standalones, tmp_path: Path
) -> None:
    """The Pulsar port equal to the HTTP port is refused before anything binds."""
    _require_pulsar_handler()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, err = standalones.run_to_exit(
        tmp_path / "data", "--http-port", str(port), "--pulsar-port", str(port)
    )
    assert code == 1
    assert "port clash: webServicePort (broker) and brokerServicePort (pulsar)" in err
    assert str(port) in err


def test_sigterm_with_connected_clients_exits_cleanly(
    standalones: Standalones, tmp_path: Path
) -> None:
    """SIGTERM while a producer and a consumer are connected still exits 0 promptly."""
    import pulsar

    _require_pulsar_handler()
    broker = standalones.start(tmp_path / "data")
    wait_healthy(broker)
    client = pulsar.Client(
        f"pulsar://127.0.0.1:{broker.ports['brokerServicePort']}", operation_timeout_seconds=5
    )
    try:
        topic = "persistent://public/default/busy"
        client.subscribe(topic, "s")
        client.create_producer(topic).send(b"x")
        started = time.monotonic()
        assert standalones.stop(broker.pid, signal.SIGTERM) == 0
        assert time.monotonic() - started < 10
    finally:
        client.close()


def test_a_busy_remembered_bookie_port_is_explained(
    standalones: Standalones, tmp_path: Path
) -> None:
    """A restart whose remembered bookie port is taken exits 1 saying why the port is fixed."""
    data = tmp_path / "data"
    first = standalones.start(data)
    wait_healthy(first)
    assert standalones.stop(first.pid) == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first.ports["bookiePort"]))
        busy.listen()
        code, err = standalones.run_to_exit(data)
    assert code == 1
    assert f"bookiePort on 127.0.0.1:{first.ports['bookiePort']}" in err
    assert "ledgers record that address" in err


def _kafka_produce(port: int, value: bytes) -> Any:
    """Produce one record with confluent-kafka, no retries; return the delivery error (a
    ``KafkaError``), or None."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": f"127.0.0.1:{port}", "acks": "all", "retries": 0})
    outcome: list[Any] = []
    producer.produce("disk", value, on_delivery=lambda err, _: outcome.append(err))
    producer.flush(30)
    assert len(outcome) == 1, "no delivery report within 30 s"
    return outcome[0]


def test_a_full_disk_refuses_writes_with_an_error_and_keeps_serving(
    standalones: Standalones, tmp_path: Path
) -> None:
    """A bookie whose disk is above diskUsageThreshold refuses adds: a produce fails with
    Kafka's storage error (retriable: a client with retries left would try again), not a hang
    or a crash; the broker keeps serving, its health check says why it cannot store (ready
    stays ok) and so does its log; on the same data dir with room again, the produce
    succeeds and health is ok."""
    from confluent_kafka import KafkaError

    conf = tmp_path / "full.conf"
    # Any real disk holds more than a millionth of itself: read-only from the start.
    conf.write_text("diskUsageThreshold=0.000001\ndiskUsageLwmThreshold=0.0000001\n")
    data = tmp_path / "data"
    broker = standalones.start(data, "--config", str(conf))
    wait_healthy(broker, endpoint="ready")
    error = _kafka_produce(broker.ports["kafkaListenerPort"], b"refused")
    assert error is not None
    assert error.code() == KafkaError.KAFKA_STORAGE_ERROR, error
    status, body = http("GET", f"{broker.http}/admin/v2/brokers/health")
    assert (status, json.loads(body)) == (
        503,
        {"reason": "writable bookies: 0 of the 1 a new ledger needs []"},
    )
    wait_healthy(broker, endpoint="ready")
    assert "bookie read-only: refusing adds" in standalones.log(broker.pid)
    assert standalones.stop(broker.pid) == 0

    again = standalones.start(data)
    wait_healthy(again)
    assert _kafka_produce(again.ports["kafkaListenerPort"], b"taken") is None
    assert standalones.stop(again.pid) == 0
