"""A client connection whose vhost another broker of the cluster serves: relayed to that broker.

AMQP 0-9-1 has no redirect, and a vhost's state (its queues' unacknowledged messages,
consumers, prefetch, exclusive owners) lives on one broker only (``handler``). So when a
client's connection.open names a vhost another broker serves, this broker becomes a relay:

Rule P1 (handshake replay): the ``OwnerLink`` opens a connection to the owner's AMQP listener
        and replays the client's handshake there: the protocol header, the client's start-ok
        (same mechanism, credentials and properties, plus ``PROXIED``), the tune-ok this broker
        negotiated with the client, and the client's connection.open. The owner's open-ok is
        the client's open-ok.
Rule P2 (relay): from the owner's open-ok on, bytes go both ways unchanged (heartbeats
        included: client and owner agreed on the same interval through this broker), with
        flow control between the two sockets; when either side closes, the other is closed.
Rule P3 (bounds and errors): the connection to the owner and the replayed handshake are
        bounded by ``timeout_s``. An owner offering a smaller frame-max or channel-max than
        the client agreed with this broker (brokers configured differently) gives the client
        541 (INTERNAL_ERROR). An owner that cannot be reached, does not answer in time,
        or answers something else than the handshake gives the client connection.close 320
        (CONNECTION_FORCED: the client reconnects, possibly through another broker); an owner
        that refuses the handshake (wrong credentials, unknown vhost, not the owner any more)
        gives the client its connection.close, with its reply code and text.
Rule P4 (no loops): a broker that receives a replayed handshake (``PROXIED``) for a vhost it
        does not serve refuses it with 320 instead of relaying it once more.

The ``OwnerLink`` is Twisted glue over the sans-IO codec; the client's side is the
``AmqpConnection`` (its ``relay_*`` methods).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from typing_extensions import override

from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.logs import kv
from polybroker.protocols.amqp import codec as c

log = logging.getLogger(__name__)

#: The client property a replayed start-ok carries (Rule P4).
PROXIED = "x-polybroker-relayed"
#: How long reaching the owner and its handshake may take (Rule P3).
LINK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class OwnerAddress:
    """The AMQP listener of the broker that serves a vhost."""

    host: str
    port: int
    broker_id: str = ""


def parse_listener(listener: str) -> tuple[str, int] | None:
    """``host:port`` as (host, port), or None when it is not one."""
    host, _, port = listener.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return None
    if not host or not 0 < number < 65536:
        return None
    return host.strip("[]"), number


class RelayClient(TypingProtocol):
    """The client's side of a relay (``AmqpConnection``)."""

    def relay_started(self, link: OwnerLink, rest: bytes) -> None:
        """The owner opened the connection; ``rest`` is what it sent after its open-ok."""
        ...

    def relay_failed(self, code: int, text: str) -> None:
        """The owner could not be reached or refused the handshake (Rule P3)."""
        ...

    def relay_data(self, data: bytes) -> None:
        """Bytes from the owner, to write to the client as they are."""
        ...

    def relay_closed(self) -> None:
        """The owner's side closed once relaying."""
        ...


#: Connects a protocol to (host, port); fires once connected (fails if it cannot be).
Connect = Callable[[str, int, Protocol], Deferred[Any]]


def tcp_connect(clock: IReactorTime, timeout_s: float = LINK_TIMEOUT_S) -> Connect:
    """A ``Connect`` over TCP, bounded by ``timeout_s``."""

    def connect(host: str, port: int, proto: Protocol) -> Deferred[Any]:
        endpoint = TCP4ClientEndpoint(clock, host, port, timeout=max(1, int(timeout_s)))
        return connectProtocol(endpoint, proto)

    return connect


class OwnerLink(Protocol):
    """This broker's connection to a vhost's owner on behalf of one client (module doc)."""

    def __init__(
        self,
        client: RelayClient,
        start_ok: c.ConnectionStartOk,
        tune_ok: c.ConnectionTuneOk,
        open_: c.ConnectionOpen,
        clock: IReactorTime,
        timeout_s: float = LINK_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.start_ok = start_ok
        self.tune_ok = tune_ok
        self.open_method = open_
        self.clock = clock
        frame_max = tune_ok.frame_max or c.FRAME_MIN_SIZE * 32
        self.reader = c.FrameReader(max(frame_max, c.FRAME_MIN_SIZE), expect_header=False)
        self.state = "connecting"  # -> "start" -> "tune" -> "open" -> "relay" | "done"
        self._timer: IDelayedCall | None = clock.callLater(timeout_s, self._expired)

    # -- Twisted -----------------------------------------------------------------------------

    @override
    def connectionMade(self) -> None:
        if self.state == "done":  # the client left, or the bound passed, while connecting
            self.transport.loseConnection()
            return
        set_no_delay(self.transport)
        self.state = "start"
        self.transport.write(c.PROTOCOL_HEADER)

    @override
    def dataReceived(self, data: bytes) -> None:
        if self.state == "relay":
            self.client.relay_data(data)
            return
        if self.state == "done":
            return
        self.reader.feed(data)
        try:
            # One frame at a time: what follows the open-ok is relayed as it came.
            while self.state not in ("relay", "done"):
                frames = self.reader.frames(1)
                if not frames:
                    break
                self._handshake(frames[0])
        except c.AmqpError as e:
            self._fail(c.CONNECTION_FORCED, f"the vhost's broker answered badly: {e.text}")
            return
        if self.state == "relay":
            self.client.relay_started(self, self.reader.take_rest())

    @override
    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        if self.state == "relay":
            self.state = "done"
            self.client.relay_closed()
        elif self.state != "done":
            self._fail(c.CONNECTION_FORCED, "the vhost's broker closed the connection")

    # -- handshake (Rule P1) -----------------------------------------------------------------

    def _handshake(self, frame: c.Frame) -> None:
        if isinstance(frame, c.HeartbeatFrame):
            return
        if not isinstance(frame, c.MethodFrame) or frame.channel != 0:
            raise c.AmqpError(c.UNEXPECTED_FRAME, "a frame outside the handshake")
        m = frame.method
        if isinstance(m, c.ConnectionClose):
            # The owner refused: the client hears its reason.
            self.transport.write(c.encode_method(0, c.ConnectionCloseOk()))
            self._fail(m.reply_code, m.reply_text)
            return
        if self.state == "start" and isinstance(m, c.ConnectionStart):
            props = {**self.start_ok.client_properties, PROXIED: True}
            replay = c.ConnectionStartOk(
                props, self.start_ok.mechanism, self.start_ok.response, self.start_ok.locale
            )
            self._send(replay)
            self.state = "tune"
        elif self.state == "tune" and isinstance(m, c.ConnectionTune):
            tune = self.tune_ok
            if (m.frame_max and m.frame_max < tune.frame_max) or (
                m.channel_max and m.channel_max < tune.channel_max
            ):
                # The client may use what it agreed with this broker: the owner must take it.
                self._send(c.ConnectionClose(c.NOT_ALLOWED, "tune-ok above the offered limits"))
                self._fail(
                    c.INTERNAL_ERROR,
                    "the vhost's broker offers a smaller frame-max or channel-max than this one",
                )
                return
            self._send(tune)
            self._send(self.open_method)
            self.state = "open"
        elif self.state == "open" and isinstance(m, c.ConnectionOpenOk):
            self._cancel_timer()
            self.state = "relay"
        else:
            raise c.AmqpError(c.COMMAND_INVALID, f"unexpected {m.NAME} in the handshake")

    def _send(self, m: c.Method) -> None:
        self.transport.write(c.encode_method(0, m))

    # -- ends --------------------------------------------------------------------------------

    def _expired(self) -> None:
        self._timer = None
        if self.state not in ("relay", "done"):
            self._fail(c.CONNECTION_FORCED, "the vhost's broker did not answer in time")

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _fail(self, code: int, text: str) -> None:
        if self.state == "done":
            return
        self.state = "done"
        self._cancel_timer()
        if self.transport is not None:
            self.transport.loseConnection()
        log.info("AMQP relay not opened", extra=kv(code=code, text=text))
        self.client.relay_failed(code, text)

    def connect_failed(self, reason: Failure) -> None:
        """The connection to the owner could not be made (Rule P3)."""
        self._fail(
            c.CONNECTION_FORCED,
            f"cannot reach the vhost's broker: {reason.getErrorMessage()}"[:200],
        )

    def abandon(self) -> None:
        """The client went away: close the owner's side, whatever the state."""
        self._cancel_timer()
        self.state = "done"
        if self.transport is not None:
            self.transport.loseConnection()
