"""``AmqpProtocolHandler``: AMQP 0-9-1 as a broker protocol handler.

Config keys: ``amqpListenerPort`` (default 5672), ``bindAddress``, ``amqpUsers`` (PLAIN logins,
``user:password`` comma-separated; default ``guest:guest``), ``amqpFrameMax``, ``amqpChannelMax``,
``amqpHeartbeatSeconds`` (offered in connection.tune), ``maxMessageSize`` (largest body),
``amqpMemoryHighWatermarkMB`` (bytes transient queues may hold before publishers are blocked).

Vhosts are namespaces: ``/`` (or empty) is ``public/default``, ``name`` is ``public/name`` and
``tenant/ns`` is itself. A vhost's durable exchanges, queues and bindings are loaded from the
metadata store the first time a connection opens it.
"""

from __future__ import annotations

import secrets
from typing import Any

from twisted.internet import defer
from twisted.internet.defer import Deferred, succeed

from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config, ConfigError
from polybroker.protocols.amqp.connection import AmqpFactory, AmqpSettings
from polybroker.protocols.amqp.vhost import MemoryGauge, VirtualHost

PORT_KEY = "amqpListenerPort"


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
            )
        )
        return None

    def vhost(self, name: str) -> Deferred[VirtualHost]:
        """The loaded vhost, loading its durable objects on first use."""
        ns = vhost_namespace(name)
        vh = self.vhosts.get(ns)
        if vh is not None:
            return succeed(vh)
        assert self.context is not None
        waiting = self._loading.get(ns)
        if waiting is None:
            service = self.context.service
            if getattr(service, "namespace_exists", None) is not None:
                known = service.namespace_exists(ns)
                if known is False:
                    return defer.fail(LookupError(f"namespace {ns} does not exist"))
            vh = VirtualHost(
                self.context.service, self.context.reactor, ns, self.incarnation, self.gauge
            )
            waiting = Deferred.fromCoroutine(vh.load())

            def loaded(_: object, v: VirtualHost = vh) -> VirtualHost:
                self.vhosts[ns] = v
                self._loading.pop(ns, None)
                return v

            def failed(f: Any) -> Any:
                self._loading.pop(ns, None)
                return f

            waiting.addCallbacks(loaded, failed)
            self._loading[ns] = waiting
        d: Deferred[VirtualHost] = Deferred()

        def fire(v: Any) -> Any:
            d.callback(v)
            return v

        def fail(f: Any) -> None:
            d.errback(f)

        waiting.addCallbacks(fire, fail)
        return d

    def listeners(self) -> dict[str, Listener]:
        if self.factory is None:
            raise RuntimeError("listeners() before start()")
        return {PORT_KEY: Listener(self.host, self.port, self.factory)}

    def stop(self) -> Deferred[None] | None:
        if self.factory is not None:
            self.factory.close_all()
        for vh in self.vhosts.values():
            vh.close()
        self.vhosts.clear()
        return None
