"""Twisted TCP transport helpers: writing without waiting for the reactor's next turn, counting
what waits to be sent, and naming a connection's peer in logs."""

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


def peer_text(transport: Any) -> str:
    """The transport's peer as ``host:port`` for logs (``[host]:port`` for IPv6), or ``?``
    when it has none (a closed or in-memory transport that cannot say)."""
    try:
        peer = transport.getPeer()
        host, port = peer.host, peer.port
    except Exception:
        return "?"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
