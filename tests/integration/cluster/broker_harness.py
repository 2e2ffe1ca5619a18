"""Real ``polybroker broker`` processes for the cluster tests.

``initialize(zk_url)`` runs ``polybroker initialize-cluster-metadata`` once for a cluster;
``BrokerProcesses.start(zk_url, config)`` runs a broker with every listener on a free loopback
port and returns once it printed its ready line (bounded), with the ports it bound;
``kill``/``stop`` act on that PID only; ``close`` stops what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from standalone_process import wait_for_line

READY = "polybroker broker ready "
#: Listener flag -> the port's key in the ready line.
PORT_FLAGS = {
    "--pulsar-port": "brokerServicePort",
    "--http-port": "webServicePort",
    "--kafka-port": "kafkaListenerPort",
    "--mqtt-port": "mqttListenerPort",
    "--amqp-port": "amqpListenerPort",
}
#: Short ZooKeeper sessions, so a killed broker's bundles are free within seconds.
SESSION_MS = 2000


def initialize(zk_url: str, cluster: str = "test-cluster", bundles: int = 4) -> None:
    """Initialise the cluster's metadata (fails the test if the command fails)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "polybroker",
            "initialize-cluster-metadata",
            "--cluster",
            cluster,
            "--metadata-store",
            zk_url,
            "--bundles",
            str(bundles),
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()


@dataclass
class Broker:
    """A running broker process and the ports it bound."""

    process: subprocess.Popen[bytes]
    ports: dict[str, int]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pulsar_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.ports['brokerServicePort']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['webServicePort']}"

    @property
    def broker_id(self) -> str:
        return f"127.0.0.1:{self.ports['webServicePort']}"

    def port(self, key: str) -> int:
        return self.ports[key]


class BrokerProcesses:
    """Starts and stops broker processes (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: list[Broker] = []
        self._count = 0

    def start(
        self,
        zk_url: str,
        config: dict[str, object] | None = None,
        cluster: str = "test-cluster",
        timeout: float = 60.0,
        ports: dict[str, int] | None = None,
    ) -> Broker:
        """Start a broker of ``cluster``; blocks until it is ready (bounded). ``ports`` (a
        ``Broker.ports``): bind those, as the broker that had them did (a restart)."""
        self._count += 1
        log = self.root / f"broker-{self._count}.log"
        conf = self.root / f"broker-{self._count}.conf"
        settings: dict[str, object] = {
            "metadataStoreSessionTimeoutMillis": SESSION_MS,
            "loadBalancerSheddingEnabled": "false",
            "logLevel": "info",
        }
        settings.update(config or {})
        conf.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        cmd = [sys.executable, "-m", "polybroker", "broker", "--metadata", zk_url]
        cmd += ["--cluster", cluster, "--bind", "127.0.0.1", "--config", str(conf)]
        for flag, key in PORT_FLAGS.items():
            cmd += [flag, str((ports or {}).get(key, 0))]
        with open(log, "wb") as err:
            process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        line = wait_for_line(process, READY, log, timeout, "broker")
        ports = {k: int(v) for k, _, v in (p.partition("=") for p in line[len(READY) :].split())}
        broker = Broker(process, ports, log)
        self.running.append(broker)
        return broker

    def stop(self, broker: Broker, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the broker, wait for it and return its exit status."""
        if broker.process.poll() is None:
            os.kill(broker.pid, sig)
        try:
            return broker.process.wait(timeout)
        finally:
            if broker.process.stdout is not None:
                broker.process.stdout.close()
            if broker in self.running:
                self.running.remove(broker)

    def kill(self, broker: Broker) -> None:
        """kill -9: a crash."""
        self.stop(broker, signal.SIGKILL)

    def close(self) -> None:
        for broker in list(self.running):
            try:
                self.stop(broker, signal.SIGTERM, timeout=20)
            except subprocess.TimeoutExpired:
                self.stop(broker, signal.SIGKILL)
