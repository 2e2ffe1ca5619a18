"""Twisted TCP transport helpers: writing without waiting for the reactor's next turn, counting
what waits to be sent, holding a connection's reading for named reasons, and naming a
connection's peer in logs."""

from __future__ import annotations

from typing import Any

from twisted.internet import tcp


def write_now(transport: Any, data: bytes) -> None:
    """Write ``data`` on ``transport``, in order with what was written before.

    On a plain TCP connection with nothing queued, the bytes go to the socket at once and only
    what it does not take is queued: Twisted's ``write`` would register the socket for
    writability and send on the next reactor turn, two ``epoll_ctl`` calls and one more turn
    per write. Any other transport (TLS too), or one with queued bytes, a closing one or an
    error other than a full socket buffer, takes the ordinary ``write`` (which reports the error
    its way). Callers write what one turn produced in one call: each call is one ``send``."""
    if (
        not isinstance(transport, tcp.Connection)
        or transport.TLS
        or transport.dataBuffer
        or transport._tempDataBuffer
        or not transport.connected
        or transport.disconnecting
        or transport._writeDisconnected
    ):
        transport.write(data)
        return
    try:
        sent = transport.socket.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    except OSError:
        transport.write(data)
        return
    if sent < len(data):
        transport.write(data[sent:])


#: Bytes of answers a connection may hold for a client that does not read them; beyond this
#: the client's socket is no longer read until they have been sent.
MAX_UNREAD = 4 * 1024 * 1024


def unsent(transport: Any) -> int:
    """Bytes written to ``transport`` that wait in its buffer (0 for one that does not say)."""
    try:
        return len(transport.dataBuffer) + transport._tempDataLen  # type: ignore[no-any-return]
    except AttributeError:
        return 0


class ReadHolds:
    """Mixin of a Twisted protocol: the reasons its socket is not read (``holds``, which the
    protocol sets to an empty set when made). The transport is paused while any reason holds
    and resumed when the last one is lifted (a transport being closed is left alone)."""

    transport: Any
    holds: set[str]

    def hold_reading(self, reason: str, on: bool = True) -> None:
        """Add (``on``) or lift ``reason``."""
        holds = self.holds
        was = bool(holds)
        if on:
            holds.add(reason)
        else:
            holds.discard(reason)
        transport = self.transport
        if (
            bool(holds) != was
            and transport is not None
            and not getattr(transport, "disconnecting", False)
        ):
            if was:
                transport.resumeProducing()
            else:
                transport.pauseProducing()

    def hold_if_unread(self, limit: int) -> None:
        """From ``pauseProducing``: once more than ``limit`` bytes of answers wait for the
        client (``MAX_UNREAD``), hold the reading for "unread" until the buffer drained."""
        if "unread" not in self.holds and unsent(self.transport) > limit:
            self.hold_reading("unread")


def peer_text(transport: Any) -> str:
    """The transport's peer as ``host:port`` for logs (``[host]:port`` for IPv6), or ``?``
    when it has none (a closed or in-memory transport that cannot say)."""
    try:
        peer = transport.getPeer()
        host, port = peer.host, peer.port
    except Exception:
        return "?"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
