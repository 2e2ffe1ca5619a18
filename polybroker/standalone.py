"""``polybroker standalone``: metadata store, bookie and broker in one process (laptop, tests).

Wiring, started in this order and stopped in the reverse one:

1. the protocol handlers are loaded and validated (no I/O yet: a bad config touches no data);
2. the metadata store (embedded under ``<data-dir>/metadata`` unless ``metadataStoreUrl``);
3. a bookie on ``<data-dir>/bookie``, on 127.0.0.1 only. Ledgers record their bookies'
   addresses, so the bookie must come back at the same address after a restart: without an
   explicit ``bookiePort`` the port picked on the first start is kept in
   ``<data-dir>/bookie-port`` and reused;
4. the ledger client (reaching that bookie in memory, ``ledger.local``), the managed-ledger
   factory and the Broker API;
5. cluster ``standalone`` (``clusterName``), tenant ``public`` and namespace ``public/default``,
   created on the first start;
6. the protocol handlers' listeners and the HTTP service (``webServicePort``), bound together
   so that a port clash is refused before anything listens.

Prints one ready line on stdout once every port is bound::

    polybroker standalone ready webServicePort=8080 brokerServicePort=6650 bookiePort=3181

SIGTERM or SIGINT stop it cleanly (exit 0); a refusal to start exits 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.config import Config, ConfigError, load, parse_lines
from polybroker.logs import kv
from polybroker.runtime import settle_heap

log = logging.getLogger(__name__)

#: The protocols a standalone broker enables when ``messagingProtocols`` is not given:
#: each of these that is installed.
STANDALONE_PROTOCOLS = ("pulsar", "kafka", "mqtt", "amqp")

#: CLI flag (argparse dest) -> configuration key.
FLAG_KEYS: Mapping[str, str] = {
    "bind": "bindAddress",
    "pulsar_port": "brokerServicePort",
    "http_port": "webServicePort",
    "kafka_port": "kafkaListenerPort",
    "mqtt_port": "mqttListenerPort",
    "amqp_port": "amqpListenerPort",
    "data_dir": "dataDir",
}

BOOKIE_PORT_FILE = "bookie-port"


def standalone_config(args: argparse.Namespace) -> tuple[Config, set[str]]:
    """The config of a standalone run and the keys the user set (file or flag).

    Standalone binds 127.0.0.1 unless told otherwise; without ``messagingProtocols`` it
    enables every installed protocol of ``STANDALONE_PROTOCOLS``."""
    return config_from_args(args, FLAG_KEYS)


def config_from_args(
    args: argparse.Namespace, flag_keys: Mapping[str, str]
) -> tuple[Config, set[str]]:
    """The config file (``args.config``) overridden by the flags ``flag_keys`` names (argparse
    dest -> key), and the keys the user set; without ``messagingProtocols``, every installed
    protocol of ``STANDALONE_PROTOCOLS``."""
    explicit: set[str] = set()
    if args.config is not None:
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {args.config}: {e.strerror}") from None
        explicit.update(parse_lines(text.splitlines(), str(args.config)))
    overrides = {key: getattr(args, dest, None) for dest, key in flag_keys.items()}
    explicit.update(k for k, v in overrides.items() if v is not None)
    if "messagingProtocols" not in explicit:
        from polybroker.broker_core.host import installed_entry_points

        installed = {ep.name for ep in installed_entry_points()}
        overrides["messagingProtocols"] = ",".join(
            p for p in STANDALONE_PROTOCOLS if p in installed
        )
    return load(args.config, overrides), explicit


def _advertised(config: Config) -> str:
    host = str(config["advertisedAddress"] or config["bindAddress"])
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return host


class BrokerProcess:
    """What a standalone and a cluster broker share: components started in order and stopped
    in reverse (``_stops``), the protocol host, and the broker's HTTP and protocol listeners
    over a Broker API (``_serve``). Subclasses write ``_start``."""

    def __init__(
        self, config: Config, reactor: Any, *, discover: Callable[[], Any] | None = None
    ) -> None:
        self.config = config
        self.reactor = reactor
        self._discover = discover
        self.ports: dict[str, int] = {}
        self._stops: list[tuple[str, Callable[[], Any]]] = []
        self.service: Any = None
        self.host: Any = None

    def start(self) -> Deferred[dict[str, int]]:
        """Start everything; fire with every bound port. On failure, what started is stopped."""
        return Deferred.fromCoroutine(self._start_or_undo())

    async def _start_or_undo(self) -> dict[str, int]:
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> dict[str, int]:
        raise NotImplementedError

    def _load_host(self) -> Any:
        """The protocol handlers, loaded and validated (no I/O yet)."""
        from polybroker.broker_core.host import ProtocolHost

        if self._discover is None:
            host = ProtocolHost(self.config, self.reactor)
        else:
            host = ProtocolHost(self.config, self.reactor, discover=self._discover)
        host.load()
        self.host = host
        return host

    async def _serve(self, service: Any, policies: Any, advertised: str) -> None:
        """Give the Broker API its namespace policies, then bind the HTTP service and every
        protocol handler's listeners together (``self.ports`` gets what they bound)."""
        from polybroker.broker_core.admin import AdminServer
        from polybroker.broker_core.backlog_quota import BacklogQuotas
        from polybroker.broker_core.expiry import MessageExpiry
        from polybroker.broker_core.protocol_handler import BrokerContext, Listener

        config = self.config
        self._stops.append(("policy watches", policies.close))
        service.namespace_exists = policies.namespace_exists
        service.deduplication_policy = policies.deduplication_of
        service.retention_policy = policies.retention_of
        service.auto_create_policy = policies.auto_topic_creation_of
        service.schema_compatibility_policy = policies.schema_compatibility_of
        service.schema_flags_policy = policies.schema_flags_of
        service.limits_policy = policies.limits_of
        service.follow_topic_policies = policies.follow_topic
        service.unfollow_topic_policies = policies.unfollow_topic
        expiry = MessageExpiry(
            lambda: service.topics.values(),
            policies.message_ttl_of,
            int(config["ttlDurationDefaultInSeconds"]),
            self.reactor,
            60.0 * float(config["messageExpiryCheckIntervalInMinutes"]),
        )
        expiry.start()
        self._stops.append(("message expiry", expiry.stop))
        quotas = BacklogQuotas(
            lambda: service.topics.values(),
            policies.backlog_quota_of,
            (
                int(config["backlogQuotaDefaultLimitBytes"]),
                int(config["backlogQuotaDefaultLimitSecond"]),
                str(config["backlogQuotaDefaultRetentionPolicy"]),
            ),
            self.reactor,
            float(config["backlogQuotaCheckIntervalInSeconds"]),
        )
        if config["backlogQuotaCheckEnabled"]:
            service.producer_gate = quotas.producer_refusal
            quotas.start()
            self._stops.append(("backlog quotas", quotas.stop))

        def urls() -> dict[str, str]:
            out = {"httpUrl": f"http://{advertised}:{self.ports.get('webServicePort', 0)}"}
            pulsar = self.ports.get("brokerServicePort")
            out["brokerUrl"] = f"pulsar://{advertised}:{pulsar}" if pulsar else ""
            return out

        admin = AdminServer(service, policies, urls=urls)
        bind = str(config["bindAddress"])
        self.host.add_listener(
            "webServicePort", Listener(bind, config["webServicePort"], admin.site())
        )
        self._stops.append(("listeners and protocol handlers", self.host.stop))
        bound = await self.host.start(BrokerContext(service, config, self.reactor, advertised))
        self.ports.update(bound)

    def stop(self) -> Deferred[None]:
        """Stop what started, in reverse order; each failure is logged, the rest still stop."""
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        stops, self._stops = self._stops, []
        for what, stop in reversed(stops):
            try:
                await maybeDeferred(stop)
            except Exception as e:
                log.error("unclean stop", extra=kv(component=what, error=str(e)))


class Standalone(BrokerProcess):
    """Every component of a standalone broker; ``start`` and ``stop`` (module docstring)."""

    def __init__(
        self,
        config: Config,
        reactor: Any,
        *,
        explicit: set[str] | None = None,
        discover: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__(config, reactor, discover=discover)
        self.data_dir = Path(config["dataDir"])
        self.explicit = explicit or set()

    def _bookie_port(self) -> int:
        if "bookiePort" in self.explicit:
            return int(self.config["bookiePort"])
        remembered = self.data_dir / BOOKIE_PORT_FILE
        try:
            return int(remembered.read_text().strip())
        except (OSError, ValueError):
            return 0

    def _remember_bookie_port(self, port: int) -> None:
        path = self.data_dir / BOOKIE_PORT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{port}\n")
        tmp.replace(path)

    async def _start(self) -> dict[str, int]:
        from polybroker.broker_core.admin_policies import PolicyStore
        from polybroker.broker_core.service import BrokerService
        from polybroker.ledger.bookie.server import BookieServer
        from polybroker.ledger.client import BookKeeperClient
        from polybroker.ledger.local import local_connector, serving
        from polybroker.ledger.managed import ManagedLedgerFactoryImpl
        from polybroker.ledger.registry import StaticBookieRegistry
        from polybroker.metadata import open_metadata_store

        config, reactor = self.config, self.reactor
        self._load_host()

        self.data_dir.mkdir(parents=True, exist_ok=True)
        store = await open_metadata_store(
            config["metadataStoreUrl"], data_dir=self.data_dir, reactor=reactor
        )
        self._stops.append(("metadata store", store.close))

        # The bookie serves only this process: it stays on loopback under one fixed address,
        # whatever the broker binds or advertises, because ledgers record that address.
        bookie = BookieServer(
            config.with_overrides({"advertisedAddress": ""}),
            self.data_dir / "bookie",
            reactor,
            port=self._bookie_port(),
            bind="127.0.0.1",
            metadata_store=store,
        )
        try:
            bookie_port = await bookie.start()
        except CannotListenError as e:
            from polybroker.broker_core.host import ListenerError

            raise ListenerError(
                f"cannot listen for bookiePort on 127.0.0.1:{e.port}: {e.socketError}; "
                f"the bookie keeps its port (in {self.data_dir / BOOKIE_PORT_FILE}, or "
                "bookiePort) because its ledgers record that address"
            ) from e
        self._stops.append(("bookie", bookie.stop))
        self._remember_bookie_port(bookie_port)
        self.ports["bookiePort"] = bookie_port

        # The broker reaches its own bookie in memory (same frames, no loopback socket); the
        # bookie still listens on its address for everyone else.
        connect = local_connector(reactor, {bookie.address: serving(bookie)})
        # A bookie refusing adds (its disk is full) is left out of new ensembles, so appends
        # fail at once with "no bookie" instead of making a ledger that cannot take them.
        registry = StaticBookieRegistry([bookie.address], lambda _: not bookie.read_only)
        client = BookKeeperClient(store, registry, connect, reactor)
        self._stops.append(("ledger client", client.close))
        factory = ManagedLedgerFactoryImpl(
            store,
            client,
            reactor,
            cache_size_bytes=int(config["managedLedgerCacheSizeMB"]) * 1024 * 1024,
            tail_cache_ms=int(config["managedLedgerCacheEvictionTimeThresholdMillis"]),
        )
        service = BrokerService(factory, reactor, config, store)
        # Closing the service closes the ledger factory too.
        self._stops.append(("broker", service.close))
        self.service = service

        cluster = str(config["clusterName"])
        policies = PolicyStore(
            store, cluster, default_bundles=int(config["defaultNumberOfNamespaceBundles"])
        )
        advertised = _advertised(config)
        await policies.ensure_defaults(
            {
                "serviceUrl": f"http://{advertised}:{config['webServicePort']}",
                "brokerServiceUrl": f"pulsar://{advertised}:{config['brokerServicePort']}",
            }
        )
        await self._serve(service, policies, advertised)
        log.info("standalone started", extra=kv(**self.ports))
        return dict(self.ports)


def ready_line(ports: Mapping[str, int], kind: str = "standalone") -> str:
    """The line printed once every port is bound."""
    order = ["webServicePort", "brokerServicePort"]
    keys = [k for k in order if k in ports] + sorted(k for k in ports if k not in order)
    return f"polybroker {kind} ready " + " ".join(f"{k}={ports[k]}" for k in keys)


def run_standalone(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a standalone broker with the CLI's arguments; return the process exit status."""
    out = out if out is not None else sys.stdout
    try:
        config, explicit = standalone_config(args)
        logs.setup(config["logLevel"], config["logFormat"])
    except (ConfigError, ValueError) as e:
        print(f"polybroker standalone: {e}", file=sys.stderr, flush=True)
        return 1

    from twisted.internet import reactor

    standalone = Standalone(config, reactor, explicit=explicit)
    return run_process(reactor, "standalone", standalone.start, standalone.stop, out)


def run_process(
    reactor: Any,
    kind: str,
    start: Callable[[], Deferred[dict[str, int]]],
    stop: Callable[[], Deferred[None]],
    out: TextIO,
) -> int:
    """Run the reactor: ``start`` once running (print the ready line, or the reason it could
    not start and exit 1), ``stop`` before shutdown (SIGTERM, SIGINT); return the exit status."""
    status = {"code": 0}

    def failed(f: Failure) -> None:
        status["code"] = 1
        print(
            f"polybroker {kind}: cannot start: {f.getErrorMessage()}", file=sys.stderr, flush=True
        )
        from polybroker.broker_core.host import ListenerError
        from polybroker.ledger.api import StorageError
        from polybroker.metadata.api import MetadataError

        expected = (ConfigError, ListenerError, CannotListenError, StorageError, MetadataError)
        if f.check(*expected) is None:
            log.error(f"{kind} failed to start", exc_info=(f.type, f.value, f.tb))
        if reactor.running:
            reactor.stop()

    def ready(ports: dict[str, int]) -> None:
        print(ready_line(ports, kind), file=out, flush=True)
        settle_heap(reactor)

    def begin() -> None:
        d = start()
        d.addCallback(ready)
        d.addErrback(failed)

    reactor.callWhenRunning(begin)
    reactor.addSystemEventTrigger("before", "shutdown", stop)
    reactor.run()
    return status["code"]
