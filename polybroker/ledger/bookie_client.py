"""``TcpBookieClient``: the ``BookieClient`` of ``ledger.api`` over one TCP connection.

Rule 1: the connection is made on the first request and again on the first request after it
        dropped; a HELLO goes first on each connection and requests wait for its answer, so none
        reaches a bookie before its identity was checked.
Rule 2: the first instance id a bookie answers is pinned; a later connection that answers another
        one (the data dir was wiped or replaced) fails every request, then and after, with
        ``BookieUnavailableError``: a new bookie at the old address is not the old bookie.
Rule 3: requests are pipelined and matched to answers by request id; each fails with
        ``BookieUnavailableError`` after its timeout (checked by one sweep timer on the injected
        reactor; long polls have their own timer) and all pending ones fail with it when the
        connection drops. A late answer to a timed-out request is ignored.
Rule 4: answers map to the api's errors: FENCED -> ``LedgerFencedError``, NO_SUCH_ENTRY ->
        ``NoSuchEntryError``, NO_SUCH_LEDGER -> ``NoSuchLedgerError``, BAD_REQUEST, BAD_VERSION and
        TOO_LARGE -> ``BookieProtocolError``, ERROR -> ``BookieError``. A frame the client cannot
        decode drops the connection (pending requests fail as in Rule 3).
Rule 5: ``add_entry_batched`` (``add_record_batched``: of ready records) stages adds and
        sends those of one ledger made in one reactor turn as one ADD_MULTI frame (sent early,
        handed to the kernel at once, when it holds ``batch_bytes``, so the bookie journals it
        while the turn goes on; never above the frame limit) to a bookie that negotiated wire
        version 2, as single ADD frames to an older one; the listener hears once per frame
        which entries were acknowledged or failed, with no Deferred per entry. The frames of
        one turn leave in one write handed to the kernel at once (``netio.write_now``), at the
        turn's end (``turns.at_turn_end``, the pass an in-process bookie's journal hand-off
        shares, so a lone add takes one reactor turn). Staged
        adds that cannot be sent (the connection failed, the client closed) fail like pending
        ones.
Rule 6: a request of a frame type that the bookie's chosen wire version lacks (``READ_STRIDE``
        before version 3) is never sent: it fails with ``BookieProtocolError``, and the caller
        reads another way.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.python.failure import Failure
from typing_extensions import override

from polybroker.ledger.api import (
    BookieClient,
    BookieError,
    BookieProtocolError,
    BookieUnavailableError,
    FenceResult,
    LedgerFencedError,
    NoSuchEntryError,
    NoSuchLedgerError,
    ReadResult,
)
from polybroker.ledger.wire import (
    ADD_FIELDS_SIZE,
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    LATEST_VERSION,
    MULTI_ADD_VERSION,
    MULTI_HEAD_SIZE,
    RECORD_HEAD_SIZE,
    STRIDE_READ_VERSION,
    WIRE_VERSION,
    AddResponse,
    Buffer,
    DeleteLedgerRequest,
    DeleteLedgerResponse,
    ErrorResponse,
    FenceRequest,
    FenceResponse,
    FrameDecoder,
    HelloRequest,
    HelloResponse,
    Message,
    MultiAddResponse,
    ReadLacRequest,
    ReadLacResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
    WriteLacRequest,
    WriteLacResponse,
    encode_add_record,
    encode_add_request,
    encode_add_request_of_record,
    encode_multi_add_parts,
)
from polybroker.netio import write_now
from polybroker.turns import at_turn_end

log = logging.getLogger(__name__)

_ERRORS: dict[int, type[BookieError]] = {
    Status.FENCED: LedgerFencedError,
    Status.NO_SUCH_ENTRY: NoSuchEntryError,
    Status.NO_SUCH_LEDGER: NoSuchLedgerError,
    Status.BAD_REQUEST: BookieProtocolError,
    Status.BAD_VERSION: BookieProtocolError,
    Status.TOO_LARGE: BookieProtocolError,
    Status.ERROR: BookieError,
}

# What each kind of request expects back.
_ADD, _READ, _RANGE, _LAC, _FENCE, _DELETE, _HELLO, _WRITE_LAC, _MULTI = range(9)
_EXPECT: dict[int, type] = {
    _MULTI: MultiAddResponse,
    _ADD: AddResponse,
    _READ: ReadResponse,
    _RANGE: ReadRangeResponse,
    _LAC: ReadLacResponse,
    _FENCE: FenceResponse,
    _DELETE: DeleteLedgerResponse,
    _HELLO: HelloResponse,
    _WRITE_LAC: WriteLacResponse,
}
_NAMES = ("add", "read", "read range", "read LAC", "fence", "delete", "hello", "write LAC", "add")

_IDLE, _CONNECTING, _HANDSHAKING, _READY = range(4)

# What an ADD_MULTI record adds to an add's data: its head and the ADD fields.
_RECORD_OVERHEAD = RECORD_HEAD_SIZE + ADD_FIELDS_SIZE

# A batch this big leaves before its turn ends, so the bookie works while the client still does.
DEFAULT_BATCH_BYTES = 64 * 1024


class AddListener(typing.Protocol):
    """Who hears the outcome of batched adds (Rule 5): called once per frame answered."""

    def entries_acked(self, address: str, entry_ids: Sequence[int]) -> None:
        """The bookie at ``address`` journaled these entries."""

    def entries_failed(self, address: str, entry_ids: Sequence[int], error: BookieError) -> None:
        """These entries failed on the bookie at ``address``."""


class _Group:
    """Batched adds of one ledger staged in this reactor turn, as ADD_MULTI records (each
    as its parts, the first starting with the record's head)."""

    __slots__ = ("entry_ids", "listener", "nbytes", "records")

    def __init__(self, listener: AddListener) -> None:
        self.listener = listener
        self.records: list[Sequence[Buffer]] = []
        self.entry_ids: list[int] = []
        self.nbytes = 0  # of the records


class _Pending:
    """A request waiting for its answer: a Deferred's, or a listener's (batched adds)."""

    __slots__ = ("d", "deadline", "entry_id", "entry_ids", "kind", "ledger_id", "listener", "timer")

    def __init__(
        self,
        d: Deferred[Any] | None,
        deadline: float,
        kind: int,
        ledger_id: int,
        entry_id: int,
        listener: AddListener | None = None,
        entry_ids: list[int] | None = None,
    ):
        self.d = d
        self.deadline = deadline
        self.kind = kind
        self.ledger_id = ledger_id
        self.entry_id = entry_id
        self.timer: Any = None
        self.listener = listener
        self.entry_ids = entry_ids

    def describe(self) -> str:
        what = _NAMES[self.kind]
        if self.kind == _MULTI and self.entry_ids:
            return f"{what} {self.ledger_id}:{self.entry_ids[0]}..{self.entry_ids[-1]}"
        if self.kind in (_ADD, _READ, _RANGE):
            return f"{what} {self.ledger_id}:{self.entry_id}"
        if self.kind == _HELLO:
            return what
        return f"{what} of ledger {self.ledger_id}"


class _ClientProtocol(Protocol):
    def __init__(self, client: TcpBookieClient, max_frame_size: int) -> None:
        self.client = client
        self.decoder = FrameDecoder(max_frame_size)

    @override
    def connectionMade(self) -> None:
        # Adds are small writes whose answers gate acknowledgements: never hold them back.
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)
        self.client._connected(self)

    @override
    def dataReceived(self, data: bytes) -> None:
        self.data_received_parts([data])

    def data_received_parts(self, parts: list[bytes]) -> None:
        """``dataReceived`` of ``parts`` joined, without joining them (the in-memory link's
        hand-over of what waited for a reactor turn)."""
        decoder = self.decoder
        for part in parts:
            decoder.receive_data(part)
        answer = self.client._answer
        for msg in decoder.drain():
            answer(msg)
        if decoder.error is not None:
            self.client._bad_input(self, str(decoder.error))

    @override
    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.client._disconnected(self, reason)


class _Factory(ClientFactory):
    noisy = False

    def __init__(self, client: TcpBookieClient) -> None:
        self.client = client

    @override
    def buildProtocol(self, addr: Any) -> _ClientProtocol:
        return _ClientProtocol(self.client, self.client.max_frame_size)

    @override
    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.client._connect_failed(reason)


class TcpBookieClient(BookieClient):
    """A ``BookieClient`` over one lazily made, pipelined TCP connection (see the rules)."""

    def __init__(
        self,
        address: str,
        reactor: Any,
        *,
        timeout_s: float = 30.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        client_name: str = "polybroker",
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bookie address must be host:port, got {address!r}")
        self.address = address
        self._host = host.strip("[]")
        self._port = int(port)
        self._reactor = reactor
        self._seconds = reactor.seconds
        self._write: Any = None  # the transport's write while the connection is ready
        self.timeout_s = timeout_s
        self.max_frame_size = max_frame_size
        self._max_data = max_frame_size - HEADER_SIZE - ADD_FIELDS_SIZE
        # A record alone in an ADD_MULTI, and the records one frame may hold.
        self._max_records = max_frame_size - HEADER_SIZE - MULTI_HEAD_SIZE
        self._max_record = min(self._max_data + _RECORD_OVERHEAD, self._max_records)
        self._client_name = client_name
        self._state = _IDLE
        self._proto: _ClientProtocol | None = None
        self._connector: Any = None
        self._backlog: list[tuple[bytes, int, int]] = []  # (frame, request id, version)
        self._pending: dict[int, _Pending] = {}
        self._long_polls: dict[int, _Pending] = {}
        self._next_id = 1
        self._sweep_call: Any = None
        self._sweep_interval = max(0.01, min(1.0, timeout_s / 4))
        self._identity: str | None = None
        self._identity_error: BookieUnavailableError | None = None
        self._closed = False
        self._close_waiters: list[Deferred[None]] = []
        self._version = WIRE_VERSION  # what the bookie chose at the handshake
        self._staged: dict[int, _Group] = {}  # batched adds of this reactor turn, by ledger
        self._unsent: list[tuple[int, _Group]] = []  # flushed before the handshake ended
        self._flush_call: Any = None
        self._out: list[Buffer] | None = None  # frames gathered by _flush for one write
        self._batch_bytes = batch_bytes

    # -- the BookieClient API ---------------------------------------------------------------

    @override
    def add_entry(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, *, recovery: bool = False
    ) -> Deferred[None]:
        if len(data) > self._max_data:
            return fail(
                BookieProtocolError(
                    f"{self.address}: add {ledger_id}:{entry_id}: {len(data)} bytes exceed the "
                    f"frame limit {self.max_frame_size}"
                )
            )
        if self._closed or self._identity_error is not None:
            return self._register(_ADD, ledger_id, entry_id)[1]
        # The hot path: _register and _send inlined.
        rid = self._next_id
        self._next_id = rid + 1
        d: Deferred[None] = Deferred()
        self._pending[rid] = _Pending(
            d, self._seconds() + self.timeout_s, _ADD, ledger_id, entry_id
        )
        if self._sweep_call is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval, self._sweep)
        frame = encode_add_request(rid, ledger_id, entry_id, lac, data, recovery)
        if self._write is not None:
            self._write(frame)
        else:
            self._send(frame)
        return d

    def add_entry_batched(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, listener: AddListener
    ) -> None:
        """Stage an add to go out with the others of this reactor turn (Rule 5); ``listener``
        hears of it once, possibly before this returns (an add refused at once)."""
        if len(data) > self._max_data:
            self._too_large(ledger_id, entry_id, len(data), listener)
            return
        self.add_record_batched(
            ledger_id, entry_id, encode_add_record(ledger_id, entry_id, lac, data), listener
        )

    def add_record_batched(
        self, ledger_id: int, entry_id: int, record: bytes, listener: AddListener
    ) -> None:
        """``add_entry_batched`` of a ready ADD_MULTI record (``wire.encode_add_record`` of
        this ledger and entry, no flag): a writer makes it once for all its bookies."""
        self.add_parts_batched(ledger_id, entry_id, (record,), len(record), listener)

    def add_parts_batched(
        self,
        ledger_id: int,
        entry_id: int,
        parts: Sequence[Buffer],
        size: int,
        listener: AddListener,
    ) -> None:
        """``add_record_batched`` of a record given as its parts (``size`` bytes in all, the
        first part starting with the record's head): the parts are joined only into the frame
        written, so the data is copied once."""
        if size > self._max_record:
            self._too_large(ledger_id, entry_id, size - _RECORD_OVERHEAD, listener)
            return
        if self._closed or self._identity_error is not None:
            error = self._identity_error or BookieUnavailableError(f"{self.address}: closed")
            self._tell_failed(listener, [entry_id], error)
            return
        group = self._staged.get(ledger_id)
        if group is not None and (
            group.listener is not listener or group.nbytes + size > self._max_records
        ):
            del self._staged[ledger_id]
            self._flush_group(ledger_id, group)
            group = None
        if group is None:
            group = self._staged[ledger_id] = _Group(listener)
        group.records.append(parts)
        group.entry_ids.append(entry_id)
        nbytes = group.nbytes = group.nbytes + size
        if nbytes >= self._batch_bytes:
            # Send now: the bookie journals this frame while the rest of the turn is encoded.
            del self._staged[ledger_id]
            self._flush_group(ledger_id, group)
        elif self._flush_call is None:
            self._flush_call = at_turn_end(self._reactor, self._flush)

    def _too_large(self, ledger_id: int, entry_id: int, size: int, listener: AddListener) -> None:
        self._tell_failed(
            listener,
            [entry_id],
            BookieProtocolError(
                f"{self.address}: add {ledger_id}:{entry_id}: {size} bytes exceed the "
                f"frame limit {self.max_frame_size}"
            ),
        )

    @override
    def read_entry(self, ledger_id: int, entry_id: int, *, fence: bool = False) -> Deferred[bytes]:
        rid, d = self._register(_READ, ledger_id, entry_id)
        if not d.called:
            self._send(ReadRequest(rid, ledger_id, entry_id, fence).encode())
        return d

    @override
    def read_range(
        self,
        ledger_id: int,
        first_entry_id: int,
        last_entry_id: int,
        max_bytes: int,
        stride: int = 1,
    ) -> Deferred[list[ReadResult]]:
        rid, d = self._register(_RANGE, ledger_id, first_entry_id)
        if not d.called:
            req = ReadRangeRequest(rid, ledger_id, first_entry_id, last_entry_id, max_bytes, stride)
            self._send(req.encode(), rid, WIRE_VERSION if stride == 1 else STRIDE_READ_VERSION)
        return d

    @override
    def read_lac(
        self, ledger_id: int, *, previous_lac: int | None = None, timeout_ms: int = 0
    ) -> Deferred[int]:
        long_poll = previous_lac is not None and timeout_ms > 0
        extra = timeout_ms / 1000.0 if long_poll else 0.0
        rid, d = self._register(_LAC, ledger_id, -1, extra_timeout=extra, own_timer=long_poll)
        if not d.called:
            req = ReadLacRequest(rid, ledger_id, previous_lac, timeout_ms if long_poll else 0)
            self._send(req.encode())
        return d

    @override
    def fence(self, ledger_id: int) -> Deferred[FenceResult]:
        rid, d = self._register(_FENCE, ledger_id, -1)
        if not d.called:
            self._send(FenceRequest(rid, ledger_id).encode())
        return d

    @override
    def delete_ledger(self, ledger_id: int) -> Deferred[None]:
        rid, d = self._register(_DELETE, ledger_id, -1)
        if not d.called:
            self._send(DeleteLedgerRequest(rid, ledger_id).encode())
        return d

    def write_lac(self, ledger_id: int, lac: int) -> Deferred[None]:
        """Record an explicit LAC on the bookie (an idle writer telling readers how far it is)."""
        rid, d = self._register(_WRITE_LAC, ledger_id, lac)
        if not d.called:
            self._send(WriteLacRequest(rid, ledger_id, lac).encode())
        return d

    @override
    def instance_id(self) -> Deferred[str]:
        if self._state == _READY and self._identity is not None:
            return succeed(self._identity)
        rid, d = self._register(_HELLO, -1, -1)
        if not d.called:
            self._send(self._hello(rid))
        return d.addCallback(lambda resp: resp.instance_id)

    @override
    def close(self) -> Deferred[None]:
        self._closed = True
        self._fail_all(BookieUnavailableError(f"{self.address}: client closed"))
        if self._connector is not None and self._state == _CONNECTING:
            self._connector.stopConnecting()
        if self._proto is not None and self._proto.transport is not None:
            d: Deferred[None] = Deferred()
            self._close_waiters.append(d)
            self._proto.transport.loseConnection()
            return d
        return succeed(None)

    # -- requests ---------------------------------------------------------------------------

    def _register(
        self,
        kind: int,
        ledger_id: int,
        entry_id: int,
        *,
        extra_timeout: float = 0.0,
        own_timer: bool = False,
    ) -> tuple[int, Deferred[Any]]:
        d: Deferred[Any] = Deferred()
        if self._closed or self._identity_error is not None:
            d.errback(self._identity_error or BookieUnavailableError(f"{self.address}: closed"))
            return 0, d
        rid = self._next_id
        self._next_id = rid + 1
        timeout = self.timeout_s + extra_timeout
        p = _Pending(d, self._seconds() + timeout, kind, ledger_id, entry_id)
        if own_timer:
            p.timer = self._reactor.callLater(timeout, self._long_poll_timeout, rid)
            self._long_polls[rid] = p
        else:
            self._pending[rid] = p
            if self._sweep_call is None:
                self._sweep_call = self._reactor.callLater(self._sweep_interval, self._sweep)
        return rid, d

    def _send(self, frame: bytes, rid: int = 0, version: int = WIRE_VERSION) -> None:
        """Send request ``rid``'s frame, a type of wire ``version``: at once when connected,
        else after the handshake. A bookie that chose an older version never gets it: the
        request fails with ``BookieProtocolError`` instead (Rule 6)."""
        if self._write is not None:
            if version > self._version:
                self._unsupported(rid, version)
                return
            self._write(frame)
            return
        self._backlog.append((frame, rid, version))
        if self._state == _IDLE:
            self._connect()

    def _unsupported(self, rid: int, version: int) -> None:
        p = self._pending.pop(rid, None)
        if p is not None:
            self._reject(
                p,
                BookieProtocolError(
                    f"{self.address}: {p.describe()}: needs wire version {version}, the bookie "
                    f"chose {self._version}"
                ),
            )

    def _write_sequence(self, parts: list[Buffer]) -> None:
        """Send the frames of one group: gathered while a turn's groups are flushed, else to
        the kernel now (``write_now``): a transport writes only when the reactor next polls,
        and a frame sent early is worth nothing unless it leaves early (Rule 5)."""
        out = self._out
        if out is not None:
            out.extend(parts)
        else:
            write_now(self._proto.transport, b"".join(parts))  # type: ignore[union-attr]

    def _connect(self) -> None:
        self._state = _CONNECTING
        self._connector = self._reactor.connectTCP(
            self._host, self._port, _Factory(self), timeout=self.timeout_s
        )

    def _hello(self, rid: int) -> bytes:
        return HelloRequest(rid, WIRE_VERSION, LATEST_VERSION, self._client_name).encode()

    # -- batched adds (Rule 5) --------------------------------------------------------------

    def _flush(self) -> None:
        """Send the groups staged in the last turn, in one write."""
        self._flush_call = None
        staged, self._staged = self._staged, {}
        self._out = out = []
        try:
            for ledger_id, group in staged.items():
                self._flush_group(ledger_id, group)
        finally:
            self._out = None
        if out and self._proto is not None:
            write_now(self._proto.transport, b"".join(out))

    def _flush_group(self, ledger_id: int, group: _Group) -> None:
        if self._write is None:
            self._unsent.append((ledger_id, group))
            if self._state == _IDLE:
                self._connect()
            return
        deadline = self._seconds() + self.timeout_s
        pending = self._pending
        if self._sweep_call is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval, self._sweep)
        if self._version >= MULTI_ADD_VERSION:
            rid = self._next_id
            self._next_id = rid + 1
            pending[rid] = _Pending(
                None, deadline, _MULTI, ledger_id, -1, group.listener, group.entry_ids
            )
            self._write_sequence(
                encode_multi_add_parts(rid, ledger_id, group.records, group.nbytes)
            )
            return
        frames: list[Buffer] = []
        for entry_id, record in zip(group.entry_ids, group.records, strict=True):
            rid = self._next_id
            self._next_id = rid + 1
            pending[rid] = _Pending(
                None, deadline, _ADD, ledger_id, entry_id, group.listener, [entry_id]
            )
            frames.extend(encode_add_request_of_record(rid, b"".join(record)))
        self._write_sequence(frames)

    def _tell_acked(self, p: _Pending) -> None:
        try:
            p.listener.entries_acked(self.address, p.entry_ids)  # type: ignore[union-attr, arg-type]
        except Exception:
            log.exception("add listener failed", extra={"fields": {"address": self.address}})

    def _tell_failed(
        self, listener: AddListener, entry_ids: Sequence[int], error: BookieError
    ) -> None:
        try:
            listener.entries_failed(self.address, entry_ids, error)
        except Exception:
            log.exception("add listener failed", extra={"fields": {"address": self.address}})

    def _reject(self, p: _Pending, error: BookieError) -> None:
        """Fail a pending request, whoever waits for it."""
        if p.d is not None:
            p.d.errback(error)
        else:
            self._tell_failed(p.listener, p.entry_ids, error)  # type: ignore[arg-type]

    def _sweep(self) -> None:
        self._sweep_call = None
        now = self._reactor.seconds()
        expired = []
        # Requests share one timeout, so insertion order is deadline order.
        for rid, p in self._pending.items():
            if p.deadline > now:
                break
            expired.append(rid)
        for rid in expired:
            p = self._pending.pop(rid)
            self._expire(p)
        if self._pending and self._sweep_call is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval, self._sweep)

    def _long_poll_timeout(self, rid: int) -> None:
        p = self._long_polls.pop(rid, None)
        if p is not None:
            p.timer = None
            self._expire(p)

    def _expire(self, p: _Pending) -> None:
        self._reject(p, BookieUnavailableError(f"{self.address}: {p.describe()} timed out"))
        if p.kind == _HELLO and self._state == _HANDSHAKING and self._proto is not None:
            # A bookie that does not answer the handshake is not usable on this connection.
            assert self._proto.transport is not None
            self._proto.transport.abortConnection()  # type: ignore[attr-defined]

    # -- connection events ------------------------------------------------------------------

    def _connected(self, proto: _ClientProtocol) -> None:
        if self._closed:
            assert proto.transport is not None
            proto.transport.loseConnection()
            return
        self._proto = proto
        self._state = _HANDSHAKING
        rid, d = self._register(_HELLO, -1, -1)
        d.addCallbacks(self._handshake_done, self._handshake_failed, errbackArgs=(proto,))
        assert proto.transport is not None
        proto.transport.write(self._hello(rid))

    def _handshake_done(self, resp: HelloResponse) -> None:
        if self._proto is None:
            return
        if self._identity is None:
            self._identity = resp.instance_id
        elif resp.instance_id != self._identity:
            self._identity_error = BookieUnavailableError(
                f"{self.address} is now bookie {resp.instance_id}, not {self._identity} this "
                "client knew: its data may be gone; refusing to use it as the old bookie"
            )
            log.error(
                "bookie identity changed",
                extra={
                    "fields": {
                        "address": self.address,
                        "was": self._identity,
                        "now": resp.instance_id,
                    }
                },
            )
            self._fail_all(self._identity_error)
            assert self._proto.transport is not None
            self._proto.transport.loseConnection()
            return
        self._state = _READY
        self._version = resp.version
        assert self._proto.transport is not None
        self._write = self._proto.transport.write
        backlog, self._backlog = self._backlog, []
        frames = []
        for frame, rid, version in backlog:
            if version > self._version:
                self._unsupported(rid, version)
            else:
                frames.append(frame)
        if frames:
            self._proto.transport.writeSequence(frames)
        unsent, self._unsent = self._unsent, []
        for ledger_id, group in unsent:
            self._flush_group(ledger_id, group)

    def _handshake_failed(self, reason: Failure, proto: _ClientProtocol) -> None:
        if proto is not self._proto:
            return  # the connection is gone and its requests were failed with it
        self._fail_all(
            BookieUnavailableError(f"{self.address}: handshake failed: {reason.getErrorMessage()}")
        )
        assert proto.transport is not None
        proto.transport.abortConnection()  # type: ignore[attr-defined]

    def _connect_failed(self, reason: Failure) -> None:
        self._state = _IDLE
        self._connector = None
        self._fail_all(
            BookieUnavailableError(f"{self.address}: cannot connect: {reason.getErrorMessage()}")
        )

    def _disconnected(self, proto: _ClientProtocol, reason: Failure) -> None:
        if proto is self._proto:
            self._proto = None
            self._write = None
            self._state = _IDLE
            self._connector = None
            self._fail_all(
                BookieUnavailableError(
                    f"{self.address}: connection lost: {reason.getErrorMessage()}"
                )
            )
        waiters, self._close_waiters = self._close_waiters, []
        for d in waiters:
            d.callback(None)

    def _bad_input(self, proto: _ClientProtocol, why: str) -> None:
        log.error(
            "bad frame from bookie", extra={"fields": {"address": self.address, "error": why}}
        )
        assert proto.transport is not None
        proto.transport.abortConnection()  # type: ignore[attr-defined]

    def _fail_all(self, error: BookieError) -> None:
        self._backlog = []
        pending = list(self._pending.values()) + list(self._long_polls.values())
        self._pending.clear()
        self._long_polls.clear()
        if self._sweep_call is not None and self._sweep_call.active():
            self._sweep_call.cancel()
        self._sweep_call = None
        groups = self._unsent + list(self._staged.items())
        self._unsent = []
        self._staged = {}
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        for p in pending:
            if p.timer is not None and p.timer.active():
                p.timer.cancel()
            self._reject(p, error)
        for _, group in groups:
            self._tell_failed(group.listener, group.entry_ids, error)

    # -- answers ----------------------------------------------------------------------------

    def _answer(self, msg: Message) -> None:
        rid = msg.request_id
        p = self._pending.pop(rid, None)
        if p is None:
            p = self._long_polls.pop(rid, None)
            if p is None:
                return  # timed out already: its caller was told
            if p.timer is not None and p.timer.active():
                p.timer.cancel()
        t = type(msg)
        if t is MultiAddResponse and p.kind == _MULTI:
            if msg.status == Status.OK and msg.count == len(p.entry_ids):  # type: ignore[union-attr, arg-type]
                self._tell_acked(p)
                return
        elif t is AddResponse and p.kind == _ADD:
            if msg.status == Status.OK:  # type: ignore[union-attr]
                if p.d is not None:
                    p.d.callback(None)
                else:
                    self._tell_acked(p)
            else:
                self._reject(p, self._error(p, msg.status, msg.message))  # type: ignore[union-attr]
            return
        self._answer_other(p, msg)

    def _answer_other(self, p: _Pending, msg: Message) -> None:
        status: Status = msg.status  # type: ignore[union-attr]
        if type(msg) is ErrorResponse:
            self._reject(p, self._error(p, status, msg.message))
            return
        if type(msg) is not _EXPECT[p.kind]:
            self._reject(
                p,
                BookieProtocolError(
                    f"{self.address}: {p.describe()}: answered with {type(msg).__name__}"
                ),
            )
            return
        if status != Status.OK:
            self._reject(p, self._error(p, status, msg.message))  # type: ignore[union-attr]
            return
        if p.kind == _MULTI:
            # OK with a count other than what was sent: the bookie is not following the protocol.
            self._reject(
                p,
                BookieProtocolError(
                    f"{self.address}: {p.describe()}: answered for {msg.count} entries"  # type: ignore[union-attr]
                ),
            )
            return
        kind = p.kind
        result: Any
        if kind == _READ:
            result = bytes(msg.data)  # type: ignore[union-attr]
        elif kind == _RANGE:
            result = [ReadResult(e, bytes(data)) for e, data in msg.entries]  # type: ignore[union-attr]
        elif kind == _LAC:
            result = msg.lac  # type: ignore[union-attr]
        elif kind == _FENCE:
            result = FenceResult(msg.lac, msg.last_entry_id)  # type: ignore[union-attr]
        elif kind == _HELLO:
            result = msg
        else:
            result = None
        assert p.d is not None
        p.d.callback(result)

    def _error(self, p: _Pending, status: int, message: str) -> BookieError:
        cls = _ERRORS.get(status, BookieError)
        return cls(f"{self.address}: {p.describe()}: {message or Status(status).name}")
