"""A ledger client's connection to a bookie served by the same process, without a socket.

Rule 1: ``local_connector`` gives a ``LocalBookieClient`` for the address of a bookie this
        process serves and a ``TcpBookieClient`` for any other. The bookie still listens on TCP
        under that address (other processes and direct readers use it) and ledgers still name
        it; only this process's own client skips the loopback socket.
Rule 2: a ``LocalBookieClient`` is the TCP client (handshake and pinned identity, pipelining,
        timeouts, batched adds: its rules) over a pair of in-memory transports. The bytes are
        the same frames, decoded by the same bookie protocol, so every bookie rule holds: an
        add is answered after its journal group was synced, fencing, backpressure.
Rule 3: bytes written go to the peer's ``dataReceived`` at once, unless a delivery on this
        connection is already on the stack (the writer runs inside one), the receiver paused
        reading, or earlier bytes still wait: then they wait, in order, for the next reactor
        turn. At most one delivery is ever on the stack, so neither side is re-entered, and a
        journal completion reaches the client in the reactor turn that answered it. Writes
        that waited are delivered together, as the list of what was written to a protocol that
        takes parts (``data_received_parts``: the bookie's and the client's), joined to any
        other: joining megabytes of entries would copy every byte once more on the reactor.
Rule 4: connecting takes a reactor turn and is refused while the bookie is not serving. A
        close delivers what the closing side wrote, then tells both protocols on a later turn;
        an abort delivers nothing more. An exception raised by a receiver is logged and aborts
        the connection, as the reactor does for a socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionRefusedError
from twisted.internet.interfaces import IPushProducer, ITransport
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from zope.interface import implementer

from polybroker.ledger.api import BookieClient
from polybroker.ledger.bookie_client import _CONNECTING, TcpBookieClient, _ClientProtocol
from polybroker.ledger.registry import tcp_connector

log = logging.getLogger(__name__)

#: What a local client asks for when it connects: a factory of the bookie's connection
#: protocol, or None while the bookie does not serve (refused, like a closed port).
ServeFn = Callable[[], Factory | None]


def _address(address: str) -> IPv4Address:
    host, _, port = address.rpartition(":")
    return IPv4Address("TCP", host.strip("[]"), int(port) if port.isdigit() else 0)


class _Link:
    """One in-memory connection: two ends and the deliveries between them (Rule 3)."""

    def __init__(self, reactor: Any, client_address: str, server_address: str) -> None:
        self.reactor = reactor
        self.delivering = False
        self.closed = False
        self._drain_call: Any = None
        self.client = _End(self, _address(client_address), _address(server_address))
        self.server = _End(self, _address(server_address), _address(client_address))
        self.client.peer = self.server
        self.server.peer = self.client

    def send(self, to: _End, data: bytes) -> None:
        if self.delivering or to.paused or to.inbox:
            to.inbox.append(data)
            self.schedule()
        else:
            self.deliver(to, data)

    def deliver(self, to: _End, data: bytes) -> None:
        protocol = to.protocol
        assert protocol is not None
        self.delivering = True
        try:
            protocol.dataReceived(data)
        except Exception:
            log.exception("in-process bookie connection: receiver failed; dropping it")
            self.abort(to)
        finally:
            self.delivering = False

    def schedule(self) -> None:
        if self._drain_call is None and not self.closed:
            self._drain_call = self.reactor.callLater(0, self._drain)

    def _drain(self) -> None:
        self._drain_call = None
        for end in (self.server, self.client):
            if self.closed:
                return
            if end.inbox and not end.paused:
                self._drain_end(end)

    def _drain_end(self, end: _End) -> None:
        """Deliver ``end``'s inbox in one delivery (Rule 3): as parts to a protocol that takes
        them (``data_received_parts``), joined to any other."""
        pieces, end.inbox = end.inbox, []
        if len(pieces) == 1:
            self.deliver(end, pieces[0])
            return
        protocol = end.protocol
        if getattr(protocol, "data_received_parts", None) is None:
            self.deliver(end, b"".join(pieces))
            return
        self.delivering = True
        try:
            protocol.data_received_parts(pieces)  # type: ignore[union-attr]
        except Exception:
            log.exception("in-process bookie connection: receiver failed; dropping it")
            self.abort(end)
        finally:
            self.delivering = False

    def close(self, by: _End) -> None:
        """``by`` closes: what it wrote is delivered, then both sides are told (Rule 4)."""
        self.reactor.callLater(0, self._close, by)

    def _close(self, by: _End) -> None:
        if self.closed:
            return
        peer = by.peer
        if peer.inbox:
            data = b"".join(peer.inbox)
            peer.inbox.clear()
            self.deliver(peer, data)
        if not self.closed:
            self._finish(by, Failure(ConnectionDone()), Failure(ConnectionDone()))

    def abort(self, by: _End) -> None:
        """``by`` aborts: nothing more is delivered; both sides are told on a later turn."""
        if self.closed:
            return
        self.closed = True
        self.reactor.callLater(
            0, self._finish, by, Failure(ConnectionAborted()), Failure(ConnectionDone())
        )

    def _finish(self, by: _End, own: Failure, other: Failure) -> None:
        self.closed = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        self._drain_call = None
        for end, reason in ((by, own), (by.peer, other)):
            end.inbox.clear()
            protocol, end.protocol = end.protocol, None
            if protocol is not None and not end.lost:
                end.lost = True
                try:
                    protocol.connectionLost(reason)
                except Exception:
                    log.exception("in-process bookie connection: connectionLost failed")


@implementer(ITransport, IPushProducer)
class _End:
    """One side's transport: what it writes is delivered to the other side's protocol."""

    def __init__(self, link: _Link, host: IPv4Address, peer_address: IPv4Address) -> None:
        self.link = link
        self.peer: _End = self
        self.protocol: Protocol | None = None
        self.inbox: list[bytes] = []  # bytes waiting for this side's protocol
        self.paused = False
        self.disconnecting = False
        self.lost = False
        self._host = host
        self._peer_address = peer_address

    def write(self, data: bytes) -> None:
        # A side that closed reads no more: what is written to it is dropped, as a socket's.
        if data and not self.disconnecting and not self.peer.disconnecting and not self.link.closed:
            self.link.send(self.peer, data)

    def writeSequence(self, data: list[bytes]) -> None:
        self.write(b"".join(data))

    def loseConnection(self) -> None:
        if not self.disconnecting and not self.link.closed:
            self.disconnecting = True
            self.link.close(self)

    def abortConnection(self) -> None:
        self.disconnecting = True
        self.link.abort(self)

    def getPeer(self) -> IPv4Address:
        return self._peer_address

    def getHost(self) -> IPv4Address:
        return self._host

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        if self.inbox:
            self.link.schedule()

    def stopProducing(self) -> None:
        self.loseConnection()


class _Connecting:
    """A connection attempt under way (what ``TcpBookieClient.close`` may stop)."""

    def __init__(self, client: LocalBookieClient) -> None:
        self.client = client
        self.call: Any = client._reactor.callLater(0, self._connect)

    def _connect(self) -> None:
        self.call = None
        self.client._local_connect(self)

    def stopConnecting(self) -> None:
        if self.call is not None and self.call.active():
            self.call.cancel()
            self.call = None
            self.client._local_failed(self, "connection was cancelled")


class LocalBookieClient(TcpBookieClient):
    """A ``TcpBookieClient`` whose connection is in memory to a bookie of this process."""

    def __init__(self, address: str, reactor: Any, serve: ServeFn, **kwargs: Any) -> None:
        super().__init__(address, reactor, **kwargs)
        self._serve = serve

    def _connect(self) -> None:
        self._state = _CONNECTING
        self._connector = _Connecting(self)

    def _local_connect(self, attempt: _Connecting) -> None:
        if attempt is not self._connector:
            return
        factory = self._serve()
        if factory is None:
            self._local_failed(attempt, "the bookie is not serving")
            return
        link = _Link(self._reactor, "127.0.0.1:0", self.address)
        server = factory.buildProtocol(link.server.getPeer())
        client = _ClientProtocol(self, self.max_frame_size)
        link.server.protocol = server
        link.client.protocol = client
        server.makeConnection(link.server)
        client.makeConnection(link.client)

    def _local_failed(self, attempt: _Connecting, why: str) -> None:
        if attempt is self._connector:
            self._connect_failed(Failure(ConnectionRefusedError(f"{self.address}: {why}")))


def local_connector(
    reactor: Any, local: Mapping[str, ServeFn], **kwargs: Any
) -> Callable[[str], BookieClient]:
    """Return a connect function: in memory to the bookies ``local`` names (address -> what
    serves it), over TCP to any other (Rule 1). ``kwargs`` go to each client."""
    tcp = tcp_connector(reactor)

    def connect(address: str) -> BookieClient:
        serve = local.get(address)
        if serve is None:
            return tcp(address)
        return LocalBookieClient(address, reactor, serve, **kwargs)

    return connect


def serving(server: Any) -> ServeFn:
    """What serves a ``BookieServer``'s connections: its bookie's protocol factory while it
    runs and is not closing, else None."""
    from polybroker.ledger.bookie.server import BookieFactory

    def serve() -> Factory | None:
        bookie = server.bookie
        if bookie is None or bookie.closing:
            return None
        return BookieFactory(bookie, server.max_frame_size)

    return serve
