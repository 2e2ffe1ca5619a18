"""Harness: the MQTT handler (and the Pulsar one, for crossings) served by a BrokerService over
in-memory storage, on 127.0.0.1 port 0 with the real reactor, for paho-mqtt and amqtt.

How the threads meet: pytest-twisted runs the reactor in the test's thread. Each test writes its
client scenario as a plain blocking function and runs it with ``broker.run(fn)``
(``deferToThread``); paho runs its network loop in its own thread (``loop_start``). Waits are
bounded conditions (``Client.wait_for``), never sleeps.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred

sys.path.insert(0, str(Path(__file__).parents[3] / "unit" / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.mqtt.handler import PORT_KEY, MqttProtocolHandler
from polybroker.protocols.pulsar.handler import PORT_KEY as PULSAR_KEY
from polybroker.protocols.pulsar.handler import PulsarProtocolHandler

R = TypeVar("R")
WAIT_S = 10.0


@dataclass
class Broker:
    """A running broker: its MQTT port, the Pulsar URL, and helpers to run client code."""

    port: int
    service: BrokerService
    handler: MqttProtocolHandler
    listening: Any
    ledgers: FakeLedgerFactory
    store: FakeMetadataStore
    config: dict[str, Any]
    pulsar: tuple[PulsarProtocolHandler, Any]
    stopped: bool = False
    kafka: tuple[Any, Any] | None = None

    @property
    def kafka_bootstrap(self) -> str:
        assert self.kafka is not None
        return f"127.0.0.1:{self.kafka[1].getHost().port}"

    @property
    def pulsar_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.pulsar[1].getHost().port}"

    def run(self, fn: Callable[..., R], *args: Any) -> Deferred[R]:
        """Run blocking client code in a pool thread; fire with its result."""
        return threads.deferToThread(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From a scenario thread: run ``fn`` on the reactor and wait for its result."""
        return threads.blockingCallFromThread(reactor, fn, *args)

    def client(self, client_id: str = "", **kwargs: Any) -> Client:
        """A connected paho client (see ``Client``)."""
        return Client(self.port, client_id, **kwargs)

    def raw(self) -> socket.socket:
        """A plain TCP socket to the MQTT port."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)
        return s


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    properties: Any = None


@dataclass
class Client:
    """A paho client with synchronous connect/subscribe/publish and a queue of messages."""

    port: int
    client_id: str = ""
    v5: bool = False
    clean: bool = True
    keepalive: int = 60
    session_expiry: int | None = None
    will: tuple[str, bytes, int, bool] | None = None
    will_delay: int | None = None
    connect: bool = True
    messages: queue.Queue[Received] = field(default_factory=queue.Queue)
    connack: Any = None
    disconnected: threading.Event = field(default_factory=threading.Event)
    disconnect_reason: Any = None

    def __post_init__(self) -> None:
        protocol = paho.MQTTv5 if self.v5 else paho.MQTTv311
        kwargs: dict[str, Any] = {}
        if not self.v5:
            kwargs["clean_session"] = self.clean
        self.c = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=protocol,
            reconnect_on_failure=False,
            **kwargs,
        )
        self._connected = threading.Event()
        self._acks: dict[int, Any] = {}
        self._ack_cv = threading.Condition()
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_subscribe = self._on_sub
        self.c.on_unsubscribe = self._on_sub
        self.c.on_disconnect = self._on_disconnect
        if self.will is not None:
            props = None
            if self.v5 and self.will_delay is not None:
                props = Properties(paho.PacketTypes.WILLMESSAGE)
                props.WillDelayInterval = self.will_delay
            self.c.will_set(*self.will, properties=props)
        if self.connect:
            self.open()

    def open(self) -> None:
        props = None
        kwargs: dict[str, Any] = {}
        if self.v5:
            props = Properties(paho.PacketTypes.CONNECT)
            if self.session_expiry is not None:
                props.SessionExpiryInterval = self.session_expiry
            kwargs["clean_start"] = self.clean
        self._connected.clear()
        self.disconnected.clear()
        self.c.connect("127.0.0.1", self.port, keepalive=self.keepalive, properties=props, **kwargs)
        self.c.loop_start()
        assert self._connected.wait(WAIT_S), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, flags: Any, reason: Any, props: Any) -> None:
        self.connack = (flags, reason, props)
        self._connected.set()

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        self.disconnect_reason = reason
        self.disconnected.set()

    def _on_message(self, _c: Any, _u: Any, msg: Any) -> None:
        self.messages.put(
            Received(
                msg.topic,
                msg.payload,
                msg.qos,
                bool(msg.retain),
                bool(msg.dup),
                getattr(msg, "properties", None),
            )
        )

    def _on_sub(self, _c: Any, _u: Any, mid: int, reasons: Any, _props: Any) -> None:
        with self._ack_cv:
            self._acks[mid] = reasons
            self._ack_cv.notify_all()

    def _wait_ack(self, mid: int) -> Any:
        with self._ack_cv:
            assert self._ack_cv.wait_for(lambda: mid in self._acks, WAIT_S), "no SUBACK"
            return self._acks.pop(mid)

    @property
    def session_present(self) -> bool:
        return bool(self.connack[0].session_present)

    def subscribe(self, topic: str, qos: int = 0, **kwargs: Any) -> list[int]:
        """Subscribe and return the granted codes (ints)."""
        if self.v5:
            props = kwargs.pop("properties", None)
            result, mid = self.c.subscribe(
                topic, options=SubscribeOptions(qos=qos, **kwargs), properties=props
            )
        else:
            result, mid = self.c.subscribe(topic, qos)
        assert result == paho.MQTT_ERR_SUCCESS
        return [int(r.value) if hasattr(r, "value") else int(r) for r in self._wait_ack(mid)]

    def unsubscribe(self, topic: str) -> Any:
        result, mid = self.c.unsubscribe(topic)
        assert result == paho.MQTT_ERR_SUCCESS
        return self._wait_ack(mid)

    def publish(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, properties: Any = None
    ) -> None:
        """Publish and wait until the broker acknowledged it (QoS 1 and 2)."""
        info = self.c.publish(topic, payload, qos, retain, properties=properties)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"publish to {topic} not acknowledged"

    def get(self, timeout: float = WAIT_S) -> Received:
        return self.messages.get(timeout=timeout)

    def get_n(self, n: int, timeout: float = WAIT_S) -> list[Received]:
        deadline = time.monotonic() + timeout
        return [self.messages.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(n)]

    def nothing_more(self, within: float = 0.5) -> bool:
        """Whether no further message arrives within ``within`` seconds (a bounded wait for a
        negative, used only after a positive that proves delivery is flowing)."""
        try:
            extra = self.messages.get(timeout=within)
        except queue.Empty:
            return True
        self.messages.put(extra)
        return False

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT (an abnormal loss of the connection)."""
        self.c.loop_stop()
        sock = self.c.socket()
        if sock is not None:
            sock.close()


def recv_exactly(s: socket.socket, n: int) -> bytes:
    """Read ``n`` bytes (fewer only when the peer closes), waiting at most ``WAIT_S``."""
    s.settimeout(WAIT_S)
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def user_props(**pairs: str) -> Properties:
    p = Properties(paho.PacketTypes.PUBLISH)
    p.UserProperty = list(pairs.items())
    return p


async def start_broker(
    config: dict[str, Any] | None = None,
    ledgers: FakeLedgerFactory | None = None,
    store: FakeMetadataStore | None = None,
    *,
    with_kafka: bool = False,
) -> Broker:
    """Start a BrokerService with the MQTT and Pulsar handlers (and Kafka if asked) on
    127.0.0.1 port 0."""
    values = {
        "mqttListenerPort": 0,
        "brokerServicePort": 0,
        "kafkaListenerPort": 0,
        "statsUpdateFrequencyInSecs": 0,
        **(config or {}),
    }
    cfg = Config(values)
    ledgers = ledgers or FakeLedgerFactory(reactor.seconds)
    store = store or FakeMetadataStore()
    service = BrokerService(ledgers, reactor, cfg, store)
    context = BrokerContext(service, cfg, reactor, "127.0.0.1")
    handler = MqttProtocolHandler()
    handler.initialize(cfg)
    await handler.start(context)
    listener = handler.listeners()[PORT_KEY]
    listening = reactor.listenTCP(listener.port, listener.factory, interface=listener.host)
    port = listening.getHost().port
    handler.bound(PORT_KEY, port)
    ph = PulsarProtocolHandler()
    ph.initialize(cfg)
    ph.start(context)
    pl = ph.listeners()[PULSAR_KEY]
    plistening = reactor.listenTCP(pl.port, pl.factory, interface=pl.host)
    ph.bound(PULSAR_KEY, plistening.getHost().port)
    broker = Broker(
        port, service, handler, listening, ledgers, store, dict(config or {}), (ph, plistening)
    )
    if with_kafka:
        from polybroker.protocols.kafka.handler import PORT_KEY as KAFKA_KEY
        from polybroker.protocols.kafka.handler import KafkaProtocolHandler

        kh = KafkaProtocolHandler()
        kh.initialize(cfg)
        kh.start(context)
        kl = kh.listeners()[KAFKA_KEY]
        klistening = reactor.listenTCP(kl.port, kl.factory, interface=kl.host)
        kh.bound(KAFKA_KEY, klistening.getHost().port)
        broker.kafka = (kh, klistening)
    return broker


async def stop_broker(broker: Broker) -> None:
    """Stop a broker (once; stopping a stopped one does nothing)."""
    if broker.stopped:
        return
    broker.stopped = True
    await broker.listening.stopListening()
    broker.handler.stop()
    await broker.pulsar[1].stopListening()
    broker.pulsar[0].stop()
    if broker.kafka is not None:
        await broker.kafka[1].stopListening()
        broker.kafka[0].stop()
    await broker.service.close()


async def restart_broker(broker: Broker) -> Broker:
    """Stop ``broker`` and start a new one over the same stored ledgers and metadata."""
    await stop_broker(broker)
    ledgers = FakeLedgerFactory(reactor.seconds)
    ledgers.logs = broker.ledgers.logs
    return await start_broker(broker.config, ledgers, broker.store)
