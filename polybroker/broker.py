"""``polybroker broker``: one stateless broker of a cluster, and ``initialize-cluster-metadata``.

A broker keeps nothing on local disk. Started in this order, stopped in the reverse one:

1. the protocol handlers are loaded and validated (no I/O yet);
2. the metadata store (``--metadata zk://host:port[,host:port]/chroot``); the cluster must have
   been initialised there (``initialize-cluster-metadata``) or the broker refuses to start;
3. the ledger client over the bookies registered under ``/bookies/available`` (E/Qw/Qa from
   ``managedLedgerDefault*``), the managed-ledger factory and the Broker API;
4. ownership (``broker_core.ownership``): topics are served only by the owner of their bundle;
   until step 6 this broker owns nothing and serves no topic;
5. the protocol handlers' listeners and the HTTP service, bound together;
6. this broker's registration under ``/loadbalance/brokers/<host>:<webServicePort>`` with the
   addresses of every bound listener, its load reports and the load-manager election.

Prints one ready line once registered::

    polybroker broker ready webServicePort=8080 brokerServicePort=6650 ...

``initialize-cluster-metadata`` writes the cluster, tenant ``public`` and namespace
``public/default`` into the metadata store once (idempotent), as Pulsar's command does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.config import Config, ConfigError
from polybroker.logs import kv
from polybroker.standalone import BrokerProcess, _advertised, config_from_args, run_process

log = logging.getLogger(__name__)

#: CLI flag (argparse dest) -> configuration key.
FLAG_KEYS: Mapping[str, str] = {
    "metadata": "metadataStoreUrl",
    "bind": "bindAddress",
    "advertised_address": "advertisedAddress",
    "cluster": "clusterName",
    "pulsar_port": "brokerServicePort",
    "http_port": "webServicePort",
    "kafka_port": "kafkaListenerPort",
    "mqtt_port": "mqttListenerPort",
    "amqp_port": "amqpListenerPort",
}

#: Bound port key -> the protocol name a ``BrokerInfo`` lists it under.
LISTENER_NAMES: Mapping[str, str] = {
    "kafkaListenerPort": "kafka",
    "mqttListenerPort": "mqtt",
    "amqpListenerPort": "amqp",
}


def broker_config(args: argparse.Namespace) -> Config:
    """The config of a broker run: file, then flags; every installed protocol by default."""
    config, _ = config_from_args(args, FLAG_KEYS)
    if not str(config["metadataStoreUrl"]).startswith("zk://"):
        raise ConfigError("a cluster broker needs --metadata zk://host:port[/chroot]")
    return config


class ClusterBroker(BrokerProcess):
    """Every component of one cluster broker; ``start`` and ``stop`` (module docstring)."""

    def __init__(
        self, config: Config, reactor: Any, *, discover: Callable[[], Any] | None = None
    ) -> None:
        super().__init__(config, reactor, discover=discover)
        self.ownership: Any = None

    async def _start(self) -> dict[str, int]:
        from polybroker.broker_core.admin_policies import CLUSTERS_ROOT, PolicyStore
        from polybroker.broker_core.ownership import BrokerInfo, ClusterOwnership
        from polybroker.broker_core.service import BrokerService
        from polybroker.ledger.client import BookKeeperClient
        from polybroker.ledger.managed import ManagedLedgerFactoryImpl
        from polybroker.ledger.registry import MetadataBookieRegistry, tcp_connector
        from polybroker.metadata import open_metadata_store

        config, reactor = self.config, self.reactor
        self._load_host()

        store = await open_metadata_store(
            config["metadataStoreUrl"],
            data_dir="",
            reactor=reactor,
            session_timeout_ms=int(config["metadataStoreSessionTimeoutMillis"]),
        )
        self._stops.append(("metadata store", store.close))
        cluster = str(config["clusterName"])
        if await store.get(f"{CLUSTERS_ROOT}/{cluster}") is None:
            raise ConfigError(
                f"cluster {cluster!r} is not initialised in {config['metadataStoreUrl']}: "
                "run `polybroker initialize-cluster-metadata` first"
            )

        registry = MetadataBookieRegistry(store)
        self._stops.append(("bookie registry", registry.close))
        client = BookKeeperClient(
            store,
            registry,
            tcp_connector(reactor),
            reactor,
            # A dead bookie is listed until its session expires: not retried before that.
            failed_bookie_quarantine_s=int(config["metadataStoreSessionTimeoutMillis"]) / 1000,
        )
        self._stops.append(("ledger client", client.close))
        factory = ManagedLedgerFactoryImpl(
            store,
            client,
            reactor,
            cache_size_bytes=int(config["managedLedgerCacheSizeMB"]) * 1024 * 1024,
            tail_cache_ms=int(config["managedLedgerCacheEvictionTimeThresholdMillis"]),
        )
        service = BrokerService(factory, reactor, config, store)
        self.service = service
        # Handlers that opt in (MQTT) serve topics other brokers own by forwarding to the owner
        # over its Pulsar port, and follow topics created anywhere through the ledger names.
        from polybroker.ledger.cursor import ROOT as LEDGER_NAMES_ROOT
        from polybroker.protocols.pulsar.forwarder import PulsarForwarder

        forwarder = PulsarForwarder(reactor, max_message_size=int(config["maxMessageSize"]))
        # Topic operations beyond publish and subscribe go to the owner's admin API (AMQP).
        from polybroker.broker_core.forwarding import OwnerAdmin

        forwarder.admin = OwnerAdmin(reactor)
        service.forwarder = forwarder
        service.ledger_names_root = LEDGER_NAMES_ROOT
        advertised = _advertised(config)
        # Named once the listeners are bound; until it starts it refuses every topic.
        ownership = ClusterOwnership(
            store,
            BrokerInfo(f"{advertised}:0", ""),
            reactor,
            unload_topic=service.unload_topic,
            topic_loads=service.topic_loads,
            config=config,
        )
        service.ownership = ownership
        self.ownership = ownership
        self._stops.append(("ownership", ownership.stop))
        # Closing the service closes the ledger factory too; it goes before ownership does.
        self._stops.append(("broker", service.close))
        self._stops.append(("forwarder", forwarder.close))

        policies = PolicyStore(
            store, cluster, default_bundles=int(config["defaultNumberOfNamespaceBundles"])
        )
        await policies.load()
        await self._serve(service, policies, advertised)

        web = self.ports["webServicePort"]
        pulsar = self.ports.get("brokerServicePort")
        ownership.set_local(
            BrokerInfo(
                broker_id=f"{advertised}:{web}",
                web_url=f"http://{advertised}:{web}",
                pulsar_url=f"pulsar://{advertised}:{pulsar}" if pulsar else "",
                listeners={
                    name: f"{advertised}:{self.ports[key]}"
                    for key, name in LISTENER_NAMES.items()
                    if key in self.ports
                },
            )
        )
        await ownership.start()
        log.info("broker started", extra=kv(**self.ports))
        return dict(self.ports)


def run_broker(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a cluster broker with the CLI's arguments; return the process exit status."""
    out = out if out is not None else sys.stdout
    try:
        config = broker_config(args)
        logs.setup(config["logLevel"], config["logFormat"])
    except (ConfigError, ValueError) as e:
        print(f"polybroker broker: {e}", file=sys.stderr, flush=True)
        return 1

    from twisted.internet import reactor

    broker = ClusterBroker(config, reactor)
    return run_process(reactor, "broker", broker.start, broker.stop, out)


# -- initialize-cluster-metadata ----------------------------------------------------------


def initialize_cluster_metadata(args: argparse.Namespace) -> int:
    """Write the cluster, tenant ``public`` and namespace ``public/default`` (idempotent)."""
    url = str(args.metadata_store)
    if not url.startswith("zk://"):
        print(
            "polybroker initialize-cluster-metadata: --metadata-store must be zk://...",
            file=sys.stderr,
        )
        return 1
    from twisted.internet import task

    result: dict[str, Any] = {"code": 0}

    async def run(reactor: Any) -> None:
        from polybroker.broker_core.admin_policies import PolicyStore
        from polybroker.metadata import open_metadata_store

        store = await open_metadata_store(url, data_dir="", reactor=reactor)
        try:
            policies = PolicyStore(store, args.cluster, default_bundles=args.bundles)
            data = {
                "serviceUrl": args.web_service_url or "",
                "brokerServiceUrl": args.broker_service_url or "",
            }
            await policies.ensure_defaults(data)
        finally:
            await store.close()

    def main(reactor: Any) -> Deferred[None]:
        d = Deferred.fromCoroutine(run(reactor))

        def failed(f: Failure) -> None:
            result["code"] = 1
            print(
                f"polybroker initialize-cluster-metadata: {f.getErrorMessage()}",
                file=sys.stderr,
                flush=True,
            )

        return d.addErrback(failed)

    logs.setup("warning", "text")
    try:
        task.react(main)
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    if result["code"] == 0:
        print(f"cluster {args.cluster} initialised in {url}", flush=True)
    return int(result["code"])
