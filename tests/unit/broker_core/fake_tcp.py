"""A Twisted TCP connection over a fake socket, for tests of what goes to the kernel at once
(``polybroker.netio.write_now``) and what waits for the reactor's next poll."""

from __future__ import annotations

from twisted.internet import tcp
from twisted.internet.testing import StringTransport


class KernelSocket:
    """A socket whose sends reach ``inner`` (what the kernel took), counted."""

    def __init__(self, inner: StringTransport) -> None:
        self.inner = inner
        self.sends = 0

    def send(self, data: bytes) -> int:
        self.sends += 1
        self.inner.write(bytes(data))
        return len(data)


class FakeTcp(tcp.Server):
    """A ``tcp.Server`` in the state of an open connection over a ``KernelSocket`` into
    ``inner``; what goes through Twisted's own ``write`` (sent when the reactor next polls) is
    kept in ``queued``; any other attribute is ``inner``'s."""

    def __init__(self, inner: StringTransport) -> None:
        self.inner = inner
        self.socket = KernelSocket(inner)
        self.connected = 1
        self.disconnecting = False
        self._writeDisconnected = False
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataBuffer: list[bytes] = []
        self._tempDataLen = 0
        self.queued: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.queued.append(bytes(data))

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class SlowClient(StringTransport):
    """A transport whose client reads nothing until ``drain``. It counts what waits as
    Twisted's does (``dataBuffer`` plus ``_tempDataLen``, what ``polybroker.netio.unsent``
    reads) and, as Twisted's does, calls its producer's ``pauseProducing`` on every write
    while more than ``limit`` bytes wait; ``drain`` sends them all and resumes it."""

    def __init__(self, limit: int = 64 * 1024) -> None:
        super().__init__()
        self.limit = limit
        self.dataBuffer = b""
        self._tempDataLen = 0

    @property
    def unsent(self) -> int:
        return self._tempDataLen

    def write(self, data: bytes) -> None:
        super().write(data)
        self._tempDataLen += len(data)
        if self._tempDataLen > self.limit and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> None:
        self._tempDataLen = 0
        if self.producer is not None:
            self.producer.resumeProducing()
