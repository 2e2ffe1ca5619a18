"""A unit-test peer: the AMQP handler over the fake ledger and a Clock, and one connection to
it over StringTransport (shared by the AMQP unit tests)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeLedgerFactory, FakeMetadataStore

from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.broker_core.service import BrokerService
from polybroker.config import Config
from polybroker.protocols.amqp import codec as c
from polybroker.protocols.amqp.handler import AmqpProtocolHandler


class Peer:
    """A handler, one connection under test and the client end of its transport."""

    def __init__(
        self,
        ledgers: FakeLedgerFactory | None = None,
        store: FakeMetadataStore | None = None,
        ownership: Any = None,
        **config: Any,
    ) -> None:
        """A fresh broker, or (given the ``ledgers`` and ``store`` of a stopped one) the same
        broker restarted over what it stored; ``ownership`` makes it a broker of a cluster."""
        self.clock = Clock()
        self.ledgers = FakeLedgerFactory(self.clock.seconds)
        if ledgers is not None:
            self.ledgers.logs = ledgers.logs
        self.store = store or FakeMetadataStore()
        cfg = Config({"statsUpdateFrequencyInSecs": 0, "amqpListenerPort": 0, **config})
        self.service = BrokerService(self.ledgers, self.clock, cfg, self.store)
        self.service.ownership = ownership  # a clustered one: the handler's cluster mode
        self.handler = AmqpProtocolHandler()
        self.handler.initialize(cfg)
        self.handler.start(BrokerContext(self.service, cfg, self.clock, "127.0.0.1"))
        self.conn = self.connect()
        self.transport: StringTransport = self.conn.transport

    def connect(self) -> Any:
        return self.connect_with(StringTransport())

    def connect_with(self, transport: StringTransport) -> Any:
        """A new connection to the handler over ``transport``."""
        factory = self.handler.listeners()["amqpListenerPort"].factory
        conn = factory.buildProtocol(None)
        conn.makeConnection(transport)
        return conn

    def send(self, data: bytes) -> None:
        self.conn.dataReceived(data)

    def method(self, channel: int, m: c.Method) -> None:
        self.send(c.encode_method(channel, m))

    def received(self) -> list[c.Frame]:
        data = self.transport.value()
        self.transport.clear()
        reader = c.FrameReader(1 << 20, expect_header=False)
        reader.feed(data)
        return reader.frames()

    def methods(self) -> list[c.Method]:
        return [f.method for f in self.received() if isinstance(f, c.MethodFrame)]

    def handshake(self, user: bytes = b"guest", password: bytes = b"guest") -> list[c.Method]:
        self.send(c.PROTOCOL_HEADER)
        start = self.methods()
        assert isinstance(start[0], c.ConnectionStart)
        self.method(0, c.ConnectionStartOk({}, "PLAIN", b"\x00" + user + b"\x00" + password))
        out = self.methods()
        if not out or not isinstance(out[0], c.ConnectionTune):
            return out
        self.method(0, c.ConnectionTuneOk(100, 8192, 10))
        self.method(0, c.ConnectionOpen("/"))
        out += self.methods()
        return out

    def publish(self, channel: int, exchange: str, key: str, body: bytes, **props: Any) -> None:
        self.method(channel, c.BasicPublish(exchange=exchange, routing_key=key))
        header = (
            (60).to_bytes(2, "big")
            + b"\x00\x00"
            + len(body).to_bytes(8, "big")
            + c.BasicProperties(**props).encode()
        )
        self.send(c._frame(c.FRAME_HEADER, channel, header))
        for start in range(0, len(body), 8000):
            self.send(c._frame(c.FRAME_BODY, channel, body[start : start + 8000]))


def consuming_peer() -> Peer:
    """A peer whose channel 1 consumes the durable queue ``q`` (tag ``ct``, no-ack), with the
    set-up's answers read."""
    p = Peer()
    p.handshake()
    p.method(1, c.ChannelOpen())
    p.method(1, c.QueueDeclare(queue="q", durable=True))
    p.method(1, c.BasicConsume(queue="q", consumer_tag="ct", no_ack=True))
    p.clock.advance(0)
    p.methods()
    return p
