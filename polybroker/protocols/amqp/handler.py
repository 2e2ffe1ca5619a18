"""``AmqpProtocolHandler``: AMQP 0-9-1 as a broker protocol handler.

Config keys: ``amqpListenerPort`` (default 5672), ``bindAddress``, ``amqpUsers`` (PLAIN logins,
``user:password`` comma-separated; default ``guest:guest``), ``amqpFrameMax``, ``amqpChannelMax``,
``amqpHeartbeatSeconds`` (offered in connection.tune), ``maxMessageSize`` (largest body),
``amqpMemoryHighWatermarkMB`` (bytes transient queues may hold before publishers are blocked).

Vhosts are namespaces: ``/`` (or empty) is ``public/default``, ``name`` is ``public/name`` and
``tenant/ns`` is itself. A vhost's durable exchanges, queues and bindings are loaded from the
metadata store the first time a connection opens it.

Cluster (the Broker API's ownership spans several brokers):

Rule V1 (one broker per vhost): a vhost is served by the owner of the bundle of its control
        topic ``persistent://<ns>/amqp.vhost``, claimed through the normal ownership (loading
        the topic) by the first broker a connection to the vhost reaches while it is unowned.
        Only that broker holds the vhost's state (exchanges, queues, their windows, consumers,
        unacknowledged messages, exclusive owners); its queues read and write their topics
        wherever they are owned (the Broker API's forwarding).
Rule V2 (relay): a connection that opens a vhost another broker serves is relayed to that
        broker's AMQP listener (``proxy``); routing a connection is bounded by
        ``route_timeout_s`` (then connection.close 320, and the client reconnects).
Rule V3 (loss): the serving broker holds a non-durable subscription on the control topic;
        when the bundle leaves it (unload, session loss) the topic is closed, the subscription
        with it, and the vhost is dropped at once, before the bundle is released: its
        connections get connection.close 320 (CONNECTION_FORCED) and its state is let go.
        The next broker loads the durable definitions from the metadata store on first use,
        and durable queues resume from their durable subscriptions.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from twisted.internet.defer import Deferred, DeferredLock, succeed

from polybroker.broker_core.consumer import Delivery, SubType
from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.forwarding import ConsumerHandle
from polybroker.broker_core.ownership import NotOwnerError
from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config, ConfigError
from polybroker.logs import kv
from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.connection import AmqpFactory, AmqpSettings
from polybroker.protocols.amqp.proxy import OwnerAddress, parse_listener
from polybroker.protocols.amqp.vhost import MemoryGauge, VirtualHost

log = logging.getLogger(__name__)

PORT_KEY = "amqpListenerPort"
#: The local name of a vhost's control topic (Rule V1).
CONTROL_TOPIC = "amqp.vhost"
#: The subscription through which the serving broker hears it lost the vhost (Rule V3).
WATCH_SUBSCRIPTION = "amqp.vhost.owner"
#: How long routing one connection may take (Rule V2).
ROUTE_TIMEOUT_S = 10.0


def control_topic(namespace: str) -> str:
    """The topic whose owner serves the vhost of ``namespace`` (Rule V1)."""
    return f"persistent://{namespace}/{CONTROL_TOPIC}"


def vhost_namespace(vhost: str) -> str:
    """The namespace an AMQP vhost names."""
    name = vhost.strip("/")
    if not name:
        return "public/default"
    if "/" in name:
        return name
    return f"public/{name}"


def parse_users(text: str) -> dict[str, str]:
    """``user:password,...`` as a dict (raises ``ConfigError``)."""
    users: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        user, sep, password = item.partition(":")
        if not sep or not user:
            raise ConfigError(f"amqpUsers: expected user:password, got {item!r}")
        users[user] = password
    return users


class _OwnerWatch:
    """The Broker API consumer on a vhost's control topic: its ``disconnect`` means the
    topic's bundle left this broker (Rule V3). It never gets messages (no permits)."""

    consumer_name = "amqp-vhost-owner"
    priority_level = 0

    def __init__(self, handler: AmqpProtocolHandler, namespace: str, consumer_id: int) -> None:
        self.handler = handler
        self.namespace = namespace
        self.consumer_id = consumer_id
        self.handle: ConsumerHandle | None = None

    def send_entries(self, deliveries: list[Delivery]) -> None:
        pass

    def active_changed(self, is_active: bool) -> None:
        pass

    def reached_end_of_topic(self) -> None:
        pass

    def disconnect(self) -> None:
        self.handler.vhost_lost(self.namespace, self)


class AmqpProtocolHandler(ProtocolHandler):
    """Serves AMQP 0-9-1 clients on ``amqpListenerPort``."""

    name = "amqp"

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 5672
        self.users: dict[str, str] = {}
        self.frame_max = 131072
        self.channel_max = 2047
        self.heartbeat_s = 60
        self.max_message_size = 5 * 1024 * 1024
        self.context: BrokerContext | None = None
        self.factory: AmqpFactory | None = None
        self.vhosts: dict[str, VirtualHost] = {}
        self.gauge = MemoryGauge(0)
        self._loading: dict[str, Deferred[Any]] = {}
        #: Tags transient messages and queues: a restarted broker drops the older ones.
        self.incarnation = secrets.token_hex(4)
        #: Cluster mode (Rules V1-V3): the vhosts this broker serves, by namespace.
        self.clustered = False
        self.route_timeout_s = ROUTE_TIMEOUT_S
        self._watches: dict[str, _OwnerWatch] = {}
        self._claims: dict[str, DeferredLock] = {}
        self._watch_ids = 0
        self._stopped = False

    def initialize(self, config: Config) -> None:
        port = int(config.get(PORT_KEY))
        if not 0 <= port <= 65535:
            raise ConfigError(f"{PORT_KEY}: {port} is not a TCP port")
        frame_max = int(config.get("amqpFrameMax"))
        if frame_max < 4096:
            raise ConfigError(f"amqpFrameMax: {frame_max} is below the 4096-octet minimum")
        channel_max = int(config.get("amqpChannelMax"))
        if not 1 <= channel_max <= 65535:
            raise ConfigError(f"amqpChannelMax: {channel_max} is not in 1..65535")
        heartbeat = int(config.get("amqpHeartbeatSeconds"))
        if not 0 <= heartbeat <= 65535:
            raise ConfigError(f"amqpHeartbeatSeconds: {heartbeat} is not in 0..65535")
        self.users = parse_users(str(config.get("amqpUsers")))
        if not self.users:
            raise ConfigError("amqpUsers: no user can log in")
        self.port = port
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat_s = heartbeat
        self.max_message_size = int(config.get("maxMessageSize"))
        self.host = str(config.get("bindAddress"))
        watermark = int(config.get("amqpMemoryHighWatermarkMB"))
        if watermark < 0:
            raise ConfigError(f"amqpMemoryHighWatermarkMB: {watermark} is negative")
        self.gauge = MemoryGauge(watermark * 1024 * 1024)

    def start(self, broker: BrokerContext) -> Deferred[None] | None:
        self.context = broker
        ownership = getattr(broker.service, "ownership", None)
        self.clustered = bool(ownership is not None and ownership.clustered)
        self.factory = AmqpFactory(
            AmqpSettings(
                service=broker.service,
                clock=broker.reactor,
                users=self.users,
                vhost=self.vhost,
                frame_max=self.frame_max,
                channel_max=self.channel_max,
                heartbeat_s=self.heartbeat_s,
                max_message_size=self.max_message_size,
                gauge=self.gauge,
                route=self.route if self.clustered else None,
            )
        )
        return None

    # -- cluster (Rules V1-V3) ---------------------------------------------------------------

    def route(self, name: str, proxied: bool = False) -> Deferred[VirtualHost | OwnerAddress]:
        """The vhost when this broker serves it (claiming it when nobody does), else the
        AMQP listener of the broker that does; ``proxied``: the connection is a relay
        already, so another broker's vhost is refused with 320 (``proxy``, Rule P4).

        Fails with ``LookupError`` for a vhost whose namespace does not exist, ``AmqpError``
        for a refusal, ``ServiceNotReadyError`` when no broker serves it within
        ``route_timeout_s``."""
        return Deferred.fromCoroutine(self._route(name, proxied))

    async def _route(self, name: str, proxied: bool) -> VirtualHost | OwnerAddress:
        assert self.context is not None
        service, clock = self.context.service, self.context.reactor
        ns = vhost_namespace(name)
        exists = getattr(service, "namespace_exists", None)
        if exists is not None:
            known = exists(ns)
            if isinstance(known, Deferred):
                known = await known
            if known is False:
                raise LookupError(f"namespace {ns} does not exist")
        deadline = clock.seconds() + self.route_timeout_s
        delay = 0.05
        while True:
            try:
                if not self.serves(ns):
                    await self._claim(ns)
                return await self.vhost(name)
            except NotOwnerError as e:
                owner = e.owner
                address = parse_listener(owner.listeners.get("amqp", "")) if owner else None
                if owner is not None and address is not None:
                    if proxied:
                        raise c.AmqpError(
                            c.CONNECTION_FORCED, f"vhost '{name}' moved to another broker"
                        ) from None
                    return OwnerAddress(address[0], address[1], owner.broker_id)
                last: Exception = e
            except ServiceNotReadyError as e:
                last = e
            if self._stopped or clock.seconds() + delay > deadline:
                raise last
            d: Deferred[None] = Deferred()
            clock.callLater(delay, d.callback, None)
            await d
            delay = min(delay * 2, 1.0)

    def serves(self, namespace: str) -> bool:
        """Whether this broker serves the vhost of ``namespace`` now (standalone: always)."""
        if not self.clustered:
            return True
        assert self.context is not None
        ownership = self.context.service.ownership
        return namespace in self._watches and ownership.owns(control_topic(namespace))

    async def _claim(self, namespace: str) -> None:
        """Own the vhost's control topic and watch it (one claim per vhost at a time)."""
        lock = self._claims.setdefault(namespace, DeferredLock())
        await lock.acquire()
        try:
            if self.serves(namespace):
                return
            assert self.context is not None
            service = self.context.service
            control = control_topic(namespace)
            await service.get_topic(control, create=True)  # NotOwnerError: another serves it
            self._watch_ids += 1
            watch = _OwnerWatch(self, namespace, self._watch_ids)
            old = self._watches.get(namespace)
            if old is not None:  # a watch whose bundle went without a word: drop it too
                self.vhost_lost(namespace, old)
            self._watches[namespace] = watch
            try:
                watch.handle = await service.subscribe(
                    control, WATCH_SUBSCRIPTION, watch, SubType.EXCLUSIVE, durable=False
                )
            except Exception:
                if self._watches.get(namespace) is watch:
                    del self._watches[namespace]
                raise
            log.info("AMQP vhost served here", extra=kv(namespace=namespace))
        finally:
            lock.release()

    def vhost_lost(self, namespace: str, watch: _OwnerWatch) -> None:
        """The vhost's bundle left this broker: close its connections (320) and drop its
        state (Rule V3)."""
        if self._watches.get(namespace) is not watch:
            return  # an older watch's news
        del self._watches[namespace]
        vh = self.vhosts.pop(namespace, None)
        if vh is None or self._stopped:
            return
        log.warning("AMQP vhost moved away", extra=kv(namespace=namespace))
        if self.factory is not None:
            for conn in list(self.factory.connections):
                if conn.vhost is vh:
                    conn.connection_error(
                        c.AmqpError(
                            c.CONNECTION_FORCED,
                            "CONNECTION_FORCED - vhost moved to another broker; reconnect",
                        )
                    )
        vh.close()

    def vhost(self, name: str) -> Deferred[VirtualHost]:
        """The loaded vhost, loading its durable objects on first use."""
        ns = vhost_namespace(name)
        vh = self.vhosts.get(ns)
        if vh is not None:
            return succeed(vh)
        assert self.context is not None
        waiting = self._loading.get(ns)
        if waiting is None:
            watch = self._watches.get(ns)
            waiting = Deferred.fromCoroutine(self._open_vhost(ns))

            def loaded(v: VirtualHost) -> VirtualHost:
                self._loading.pop(ns, None)
                if self.clustered and (watch is None or self._watches.get(ns) is not watch):
                    v.close()  # the vhost moved away while it was loading (Rule V3)
                    raise ServiceNotReadyError(f"vhost of {ns} moved away while loading")
                self.vhosts[ns] = v
                return v

            def failed(f: Any) -> Any:
                self._loading.pop(ns, None)
                return f

            # Registered first: a load that completed at once unregisters itself below.
            self._loading[ns] = waiting
            waiting.addCallbacks(loaded, failed)
        d: Deferred[VirtualHost] = Deferred()

        def fire(v: Any) -> Any:
            d.callback(v)
            return v

        def fail(f: Any) -> None:
            d.errback(f)

        waiting.addCallbacks(fire, fail)
        return d

    async def _open_vhost(self, ns: str) -> VirtualHost:
        """A vhost of namespace ``ns`` with its durable objects loaded; ``LookupError`` when
        the namespace does not exist (RabbitMQ's "vhost not found")."""
        assert self.context is not None
        service = self.context.service
        if getattr(service, "namespace_exists", None) is not None:
            known = service.namespace_exists(ns)
            if isinstance(known, Deferred):
                known = await known
            if not known:
                raise LookupError(f"namespace {ns} does not exist")
        vh = VirtualHost(service, self.context.reactor, ns, self.incarnation, self.gauge)
        await vh.load()
        return vh

    def listeners(self) -> dict[str, Listener]:
        if self.factory is None:
            raise RuntimeError("listeners() before start()")
        return {PORT_KEY: Listener(self.host, self.port, self.factory)}

    def stop(self) -> Deferred[None] | None:
        self._stopped = True
        if self.factory is not None:
            self.factory.close_all()
        for vh in self.vhosts.values():
            vh.close()
        self.vhosts.clear()
        return None
