"""One Kafka client connection: Twisted glue between the codec and ``KafkaApis``.

Frames are decoded as they arrive and each request is handed to ``KafkaApis`` at once (a
long-polling Fetch does not hold up the next request's work), but responses leave strictly in
request order, as Kafka requires. A Produce with acks=0 gets no response.

Requests are taken (parsed and handed on) while fewer than ``MAX_IN_FLIGHT`` of them, and
under ``MAX_IN_FLIGHT_BYTES`` of their frames, await their responses (after that, until half of
them left; a Produce with acks=0 counts until its write is done), a Fetch only while fewer than
``MAX_FETCHES_IN_FLIGHT`` fetches await theirs, while the socket's send buffer is not full,
and while the broker-wide ``PublishBuffer`` (which counts Produce frames) is not; frames read
beyond that wait, and reading pauses until they are taken. A client that
sends requests but does not read their answers (a fetch answer may be megabytes) stops being
read, as Kafka stops reading a connection until its response is sent, instead of having every
answer buffered in the broker's memory: what is buffered is at most the answers to the
requests already taken. Clients keep one fetch in flight per broker; the fetch bound keeps one
that pipelines them from holding more than a few fetch answers at once.

Bad input (an oversize or malformed frame, an unknown API key, an unsupported version) closes
the connection after the responses already due; an unsupported ApiVersions version is answered
with error 35 and a v0 body. No exception escapes ``dataReceived``.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from twisted.internet.defer import maybeDeferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from polybroker.broker_core.protocol_handler import set_no_delay
from polybroker.logs import kv
from polybroker.netio import peer_text
from polybroker.protocols.kafka import codec as c
from polybroker.protocols.kafka.apis import NO_RESPONSE, KafkaApis

log = logging.getLogger(__name__)

#: Requests in flight on one connection, and the bytes of their frames (produced records,
#: mostly), before reading from it pauses.
MAX_IN_FLIGHT = 64
MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024
#: Fetches in flight on one connection before the next one waits.
MAX_FETCHES_IN_FLIGHT = 4
_FETCH_KEY = c.API_FETCH.to_bytes(2, "big")


class _Slot:
    __slots__ = ("buffered", "data", "done", "fetch", "size")

    def __init__(self, fetch: bool, size: int, buffered: int) -> None:
        self.done = False
        self.data: bytes | None = None
        self.fetch = fetch
        self.size = size
        self.buffered = buffered  # bytes taken from the publish buffer (a Produce's frame)


@implementer(IPushProducer)
class KafkaConnection(Protocol):
    """Serves one client socket (see the module docstring)."""

    def __init__(self, apis: KafkaApis, max_frame: int) -> None:
        self.apis = apis
        self.decoder = c.FrameDecoder(max_frame)
        self.pending: deque[_Slot] = deque()
        self.closed = False
        self.paused = False  # reading is paused (for one of the reasons below)
        self._frames: deque[bytes] = deque()  # read, not yet taken
        self._busy = False  # MAX_IN_FLIGHT requests (or _BYTES) awaited their answers
        self._pending_bytes = 0  # the frame bytes of the requests awaiting answers
        self._fetches = 0  # fetches awaiting their answers
        self._blocked = False  # the socket's send buffer is full
        self._buffer_held = False  # the broker-wide publish buffer is full
        self._buffer = apis.service.publish_buffer
        self._taking = False
        self.client_host = ""

    def connectionMade(self) -> None:
        set_no_delay(self.transport)
        # The transport tells (pauseProducing) when what was written waits in its buffer.
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        peer = self.transport.getPeer()  # type: ignore[union-attr]
        self.client_host = f"/{getattr(peer, 'host', '')}"

    def dataReceived(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._frames.extend(self.decoder.feed(data))
        except c.KafkaCodecError as e:
            self._fail(str(e))
            return
        self._take()

    def _take(self) -> None:
        """Take the frames read while there is room (see the module docstring), then pause or
        resume reading. Not re-entered: an answer given at once only makes room."""
        if self._taking:
            return
        self._taking = True
        try:
            frames = self._frames
            while frames and not (self._busy or self._blocked or self._buffer_held or self.closed):
                fetch = frames[0].startswith(_FETCH_KEY)
                if fetch and self._fetches >= MAX_FETCHES_IN_FLIGHT:
                    break
                frame = frames.popleft()
                try:
                    req = c.parse_request(frame, self.apis.settings.api_versions)
                except c.KafkaCodecError as e:
                    self._fail(str(e))
                    return
                self._dispatch(req, fetch, len(frame))
                if len(self.pending) >= MAX_IN_FLIGHT or self._pending_bytes >= MAX_IN_FLIGHT_BYTES:
                    self._busy = True
        finally:
            self._taking = False
        self._read_or_not()

    # -- IPushProducer: the transport's send buffer -----------------------------------------

    def pauseProducing(self) -> None:
        self._blocked = True
        self._read_or_not()

    def resumeProducing(self) -> None:
        self._blocked = False
        self._take()

    def stopProducing(self) -> None:
        self._blocked = True

    def _read_or_not(self) -> None:
        """Read the socket only while nothing waits to be taken and there is room."""
        pause = self._busy or self._blocked or self._buffer_held or bool(self._frames)
        if pause == self.paused or self.closed or self.transport is None:
            return
        self.paused = pause
        if pause:
            self.transport.pauseProducing()
        else:
            self.transport.resumeProducing()

    def _dispatch(self, req: c.Request, fetch: bool, size: int) -> None:
        buffered = size if req.api_key == c.API_PRODUCE else 0
        if buffered:
            self._buffer.take(buffered, self)
        slot = _Slot(fetch, size, buffered)
        self.pending.append(slot)
        self._pending_bytes += size
        self._fetches += fetch
        if not req.supported:
            slot.data = c.encode_unsupported_api_versions(
                req.correlation_id, self.apis.settings.api_versions
            )
            slot.done = True
            self._flush()
            return
        d = maybeDeferred(self.apis.handle, req, self.client_host)
        d.addCallbacks(self._answered, self._failed, callbackArgs=(req, slot), errbackArgs=(req,))

    def _answered(self, body: Any, req: c.Request, slot: _Slot) -> None:
        if body is not NO_RESPONSE:
            try:
                slot.data = c.encode_response(
                    req.api_key, req.api_version, req.correlation_id, body
                )
            except Exception as e:
                log.exception("cannot encode a Kafka response", extra=kv(api=req.api_key))
                self._fail(f"encode failed: {e!r}")
                return
        slot.done = True
        self._flush()

    def _failed(self, failure: Failure, req: c.Request) -> None:
        log.error(
            "Kafka request failed",
            extra=kv(api=req.api_key, version=req.api_version, error=repr(failure.value)),
        )
        self._fail("request failed")

    def _flush(self) -> None:
        out = []
        fetched = False
        while self.pending and self.pending[0].done:
            slot = self.pending.popleft()
            self._pending_bytes -= slot.size
            if slot.buffered:
                self._buffer.give(slot.buffered)
            if slot.fetch:
                self._fetches -= 1
                fetched = True
            if slot.data:
                out.append(slot.data)
        if out and not self.closed:
            self.transport.writeSequence(out)  # type: ignore[union-attr]
        if (
            self._busy
            and len(self.pending) < MAX_IN_FLIGHT // 2
            and self._pending_bytes < MAX_IN_FLIGHT_BYTES // 2
        ):
            self._busy = False
            self._take()
        elif fetched and self._frames:
            self._take()

    def _fail(self, reason: str) -> None:
        log.info(
            "closing Kafka connection", extra=kv(peer=peer_text(self.transport), reason=reason)
        )
        self._flush()
        self.closed = True
        self._drop_pending()
        self._frames.clear()
        if self.transport is not None:
            self.transport.loseConnection()

    def _drop_pending(self) -> None:
        """Forget the requests awaiting answers, giving back what they took of the buffer."""
        for slot in self.pending:
            if slot.buffered:
                self._buffer.give(slot.buffered)
        self.pending.clear()

    def publish_buffer_full(self, full: bool) -> None:
        """The broker-wide publish buffer filled (or drained): stop (or go on) taking and
        reading."""
        self._buffer_held = full
        if full:
            self._read_or_not()
        else:
            self._take()

    def close(self) -> None:
        """Close the connection."""
        self.closed = True
        if self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self.closed = True
        self._drop_pending()
        self._buffer.unwatch(self)
        factory = getattr(self, "factory", None)
        if isinstance(factory, KafkaFactory):
            factory.connections.discard(self)


class KafkaFactory(ServerFactory):
    """Builds a ``KafkaConnection`` per accepted socket and tracks the open ones."""

    def __init__(self, apis: KafkaApis, max_frame: int) -> None:
        self.apis = apis
        self.max_frame = max_frame
        self.connections: set[KafkaConnection] = set()

    def buildProtocol(self, addr: Any) -> KafkaConnection:
        conn = KafkaConnection(self.apis, self.max_frame)
        conn.factory = self
        self.connections.add(conn)
        return conn

    def close_all(self) -> None:
        """Close every open connection."""
        for conn in list(self.connections):
            conn.close()
