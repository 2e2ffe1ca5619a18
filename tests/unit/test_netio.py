"""``write_now``: a write goes to the socket at once when nothing is queued, and never out of
order, lost or past a closing connection; on accepted and on made connections alike.
``peer_text``: a connection's peer as logs show it."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet import tcp
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.testing import StringTransport

from polybroker.netio import peer_text, write_now


class FakeSocket:
    """Takes at most ``room`` bytes per send, or raises ``error``."""

    def __init__(self, room: int = 1 << 20, error: OSError | None = None) -> None:
        self.room = room
        self.error = error
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        if self.error is not None:
            raise self.error
        taken = bytes(data[: self.room])
        self.sent.append(taken)
        return len(taken)


def tcp_transport(sock: FakeSocket, kind: type = tcp.Server) -> tuple[Any, list[bytes]]:
    """A ``tcp.Server`` (or ``kind``) in the state of an open connection, its queued writes
    recorded."""
    conn: Any = kind.__new__(kind)
    conn.socket = sock
    conn.connected = 1
    conn.disconnecting = False
    conn._writeDisconnected = False
    conn.dataBuffer = b""
    conn.offset = 0
    conn._tempDataBuffer = []
    conn._tempDataLen = 0
    queued: list[bytes] = []
    conn.write = queued.append
    return conn, queued


@pytest.mark.parametrize("kind", [tcp.Server, tcp.Client])
def test_idle_connection_sends_at_once(kind: type) -> None:
    sock = FakeSocket()
    conn, queued = tcp_transport(sock, kind)
    write_now(conn, b"answer")
    assert sock.sent == [b"answer"]
    assert queued == []


def test_what_the_socket_does_not_take_is_queued() -> None:
    sock = FakeSocket(room=3)
    conn, queued = tcp_transport(sock)
    write_now(conn, b"abcdefgh")
    assert sock.sent == [b"abc"]
    assert queued == [b"defgh"]


@pytest.mark.parametrize(
    "error", [BlockingIOError(11, "again"), ConnectionResetError(104, "reset")]
)
def test_full_or_broken_socket_leaves_it_to_twisted(error: OSError) -> None:
    """A full buffer queues everything; any other error too, so Twisted reports it its way."""
    conn, queued = tcp_transport(FakeSocket(error=error))
    write_now(conn, b"answer")
    assert queued == [b"answer"]


@pytest.mark.parametrize(
    "state",
    [
        {"dataBuffer": b"earlier"},
        {"_tempDataBuffer": [b"earlier"]},
        {"disconnecting": True},
        {"_writeDisconnected": True},
        {"connected": 0},
        {"TLS": True},
    ],
)
def test_queued_bytes_or_a_closing_connection_keep_twisted_order(state: dict[str, Any]) -> None:
    sock = FakeSocket()
    conn, queued = tcp_transport(sock)
    for k, v in state.items():
        setattr(conn, k, v)
    write_now(conn, b"answer")
    assert sock.sent == []
    assert queued == [b"answer"]


def test_other_transports_use_write() -> None:
    t = StringTransport()
    write_now(t, b"answer")
    assert t.value() == b"answer"


def test_peer_text_names_host_and_port() -> None:
    v4 = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 35770))
    v6 = StringTransport(peerAddress=IPv6Address("TCP", "::1", 6650))
    assert peer_text(v4) == "127.0.0.1:35770"
    assert peer_text(v6) == "[::1]:6650"
    assert peer_text(None) == "?"
