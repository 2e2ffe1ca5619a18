"""An echo protocol handler: every byte a client sends comes back, prefixed on connect by a
greeting naming the broker's cluster (so a test sees the handler got the BrokerContext).

It listens on ``echoPort`` at ``bindAddress``, always on a free port (0): a third-party
handler has no configuration key of its own in this minimal form.
"""

from __future__ import annotations

from twisted.internet.protocol import Factory, Protocol

from polybroker.broker_core.protocol_handler import BrokerContext, Listener, ProtocolHandler
from polybroker.config import Config


class _Echo(Protocol):
    def __init__(self, greeting: bytes) -> None:
        self.greeting = greeting

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(self.greeting)

    def dataReceived(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


class _EchoFactory(Factory):
    def __init__(self, greeting: bytes) -> None:
        self.greeting = greeting

    def buildProtocol(self, addr: object) -> _Echo:
        return _Echo(self.greeting)


class EchoHandler(ProtocolHandler):
    """The ``echo`` protocol."""

    name = "echo"

    def __init__(self) -> None:
        self.bind = "127.0.0.1"
        self.greeting = b""
        self.port = 0

    def initialize(self, config: Config) -> None:
        self.bind = str(config["bindAddress"])

    def start(self, broker: BrokerContext) -> None:
        self.greeting = f"echo from {broker.config['clusterName']}\n".encode()

    def listeners(self) -> dict[str, Listener]:
        return {"echoPort": Listener(self.bind, 0, _EchoFactory(self.greeting))}

    def bound(self, key: str, port: int) -> None:
        self.port = port

    def stop(self) -> None:
        self.port = 0
