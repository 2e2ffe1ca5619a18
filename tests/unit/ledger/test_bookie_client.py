"""TcpBookieClient over a memory reactor: lazy connect, handshake first, pipelining, error
mapping, timeouts, reconnects and the pinned bookie identity."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet import tcp
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from polybroker.ledger.api import (
    BookieError,
    BookieProtocolError,
    BookieUnavailableError,
    FenceResult,
    LedgerFencedError,
    NoSuchEntryError,
    NoSuchLedgerError,
    ReadResult,
)
from polybroker.ledger.bookie_client import TcpBookieClient
from polybroker.ledger.wire import (
    LATEST_VERSION,
    AddRequest,
    AddResponse,
    ErrorResponse,
    FenceResponse,
    HelloRequest,
    HelloResponse,
    Message,
    MultiAddRequest,
    MultiAddResponse,
    ReadLacRequest,
    ReadLacResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
    decode_all,
    encode_add_record,
)


class Peer:
    """The bookie end of one client connection."""

    def __init__(self, reactor: MemoryReactorClock, index: int = -1) -> None:
        _, _, factory, _, _ = reactor.tcpClients[index]
        self.factory = factory
        self.proto = factory.buildProtocol(None)
        self.transport = StringTransport()
        self.proto.makeConnection(self.transport)

    def received(self) -> list[Message]:
        out = decode_all(self.transport.value())
        self.transport.clear()
        return out

    def answer(self, *messages: Message) -> None:
        self.proto.dataReceived(b"".join(m.encode() for m in messages))

    def handshake(self, instance_id: str = "bookie-A", version: int = 1) -> None:
        (hello,) = [m for m in self.received() if isinstance(m, HelloRequest)][:1]
        self.answer(HelloResponse(hello.request_id, Status.OK, "", version, instance_id))

    def drop(self) -> None:
        self.proto.connectionLost(Failure(ConnectionDone()))


def result_of(d: Deferred[Any]) -> Any:
    box: list[Any] = []
    d.addBoth(box.append)
    assert box, "the Deferred has not fired"
    if isinstance(box[0], Failure):
        box[0].raiseException()
    return box[0]


def failure_of(d: Deferred[Any]) -> BaseException:
    box: list[Any] = []
    d.addBoth(box.append)
    assert box, "the Deferred has not fired"
    assert isinstance(box[0], Failure), f"expected a failure, got {box[0]!r}"
    return box[0].value


@pytest.fixture
def reactor() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def client(reactor: MemoryReactorClock) -> TcpBookieClient:
    return TcpBookieClient("127.0.0.1:3181", reactor, timeout_s=5.0)


def test_connects_lazily_and_handshakes_before_any_request(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """Nothing connects until a request; the request leaves only after HELLO was answered."""
    assert reactor.tcpClients == []
    d = client.add_entry(1, 0, -1, b"data")
    assert [(h, p) for h, p, *_ in reactor.tcpClients] == [("127.0.0.1", 3181)]
    peer = Peer(reactor)
    sent = peer.received()
    assert [type(m) for m in sent] == [HelloRequest]
    peer.answer(HelloResponse(sent[0].request_id, Status.OK, "", 1, "bookie-A"))
    (add,) = peer.received()
    assert isinstance(add, AddRequest)
    assert (add.ledger_id, add.entry_id, add.lac, bytes(add.data)) == (1, 0, -1, b"data")
    assert not d.called
    peer.answer(AddResponse(add.request_id, Status.OK, "", 1, 0))
    assert result_of(d) is None


def test_pipelined_requests_match_answers_by_id(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """Answers in any order reach their own request."""
    d1 = client.read_entry(1, 0)
    d2 = client.read_entry(1, 1)
    peer = Peer(reactor)
    peer.handshake()
    r1, r2 = peer.received()
    assert isinstance(r1, ReadRequest)
    assert isinstance(r2, ReadRequest)
    peer.answer(
        ReadResponse(r2.request_id, Status.OK, "", 1, 1, b"one"),
        ReadResponse(r1.request_id, Status.OK, "", 1, 0, b"zero"),
    )
    assert (result_of(d1), result_of(d2)) == (b"zero", b"one")


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (Status.FENCED, LedgerFencedError),
        (Status.NO_SUCH_ENTRY, NoSuchEntryError),
        (Status.NO_SUCH_LEDGER, NoSuchLedgerError),
        (Status.BAD_REQUEST, BookieProtocolError),
        (Status.BAD_VERSION, BookieProtocolError),
        (Status.TOO_LARGE, BookieProtocolError),
        (Status.ERROR, BookieError),
    ],
)
def test_statuses_map_to_api_errors(
    reactor: MemoryReactorClock, client: TcpBookieClient, status: Status, error: type
) -> None:
    """Each error status becomes the api's exception, naming the bookie and the request."""
    d = client.add_entry(4, 2, 1, b"x")
    peer = Peer(reactor)
    peer.handshake()
    (add,) = peer.received()
    peer.answer(AddResponse(add.request_id, status, "why", 4, 2))
    exc = failure_of(d)
    assert type(exc) is error
    assert "127.0.0.1:3181" in str(exc)
    assert "4:2" in str(exc)


def test_error_frame_fails_its_request(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A generic error frame for a request fails that request with the mapped error."""
    d = client.fence(3)
    peer = Peer(reactor)
    peer.handshake()
    (fence,) = peer.received()
    peer.answer(ErrorResponse(fence.request_id, Status.BAD_REQUEST, "checksum"))
    assert isinstance(failure_of(d), BookieProtocolError)


def test_results_are_converted(reactor: MemoryReactorClock, client: TcpBookieClient) -> None:
    """Fence, range and LAC answers become the api's result types."""
    df = client.fence(3)
    dr = client.read_range(3, 0, 5, 1000)
    dl = client.read_lac(3)
    peer = Peer(reactor)
    peer.handshake()
    f, r, lac = peer.received()
    peer.answer(
        FenceResponse(f.request_id, Status.OK, "", 3, 4, 5),
        ReadRangeResponse(r.request_id, Status.OK, "", 3, [(0, b"a"), (1, b"b")]),
        ReadLacResponse(lac.request_id, Status.OK, "", 3, 4),
    )
    assert result_of(df) == FenceResult(4, 5)
    assert result_of(dr) == [ReadResult(0, b"a"), ReadResult(1, b"b")]
    assert result_of(dl) == 4


def test_unanswered_request_times_out_and_a_late_answer_is_ignored(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """After its timeout a request fails as unavailable; its answer arriving later is dropped."""
    d = client.read_entry(1, 0)
    peer = Peer(reactor)
    peer.handshake()
    (read,) = peer.received()
    reactor.advance(4.0)
    assert not d.called
    reactor.advance(2.0)
    assert isinstance(failure_of(d), BookieUnavailableError)
    peer.answer(ReadResponse(read.request_id, Status.OK, "", 1, 0, b"late"))
    d2 = client.read_entry(1, 1)
    (read2,) = peer.received()
    peer.answer(ReadResponse(read2.request_id, Status.OK, "", 1, 1, b"fine"))
    assert result_of(d2) == b"fine"


def test_long_poll_gets_its_own_longer_timeout(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A long poll may wait its poll time plus the request timeout."""
    d = client.read_lac(2, previous_lac=3, timeout_ms=10_000)
    peer = Peer(reactor)
    peer.handshake()
    (req,) = peer.received()
    assert isinstance(req, ReadLacRequest)
    assert (req.previous_lac, req.timeout_ms) == (3, 10_000)
    reactor.advance(12.0)
    assert not d.called
    peer.answer(ReadLacResponse(req.request_id, Status.OK, "", 2, 4))
    assert result_of(d) == 4
    d2 = client.read_lac(2, previous_lac=4, timeout_ms=1000)
    reactor.advance(6.5)
    assert isinstance(failure_of(d2), BookieUnavailableError)


def test_connection_loss_fails_pending_and_the_next_request_reconnects(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A drop fails everything pending as unavailable; the next request opens a new connection."""
    d1 = client.add_entry(1, 0, -1, b"a")
    d2 = client.read_lac(1, previous_lac=0, timeout_ms=5000)
    peer = Peer(reactor)
    peer.handshake()
    peer.drop()
    assert isinstance(failure_of(d1), BookieUnavailableError)
    assert isinstance(failure_of(d2), BookieUnavailableError)
    assert reactor.getDelayedCalls() == []
    d3 = client.read_entry(1, 0)
    assert len(reactor.tcpClients) == 2
    peer2 = Peer(reactor)
    peer2.handshake("bookie-A")
    (read,) = peer2.received()
    peer2.answer(ReadResponse(read.request_id, Status.OK, "", 1, 0, b"a"))
    assert result_of(d3) == b"a"


def test_a_different_identity_after_reconnect_is_refused_for_good(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A bookie answering another instance id at the same address is not used, then or later."""
    d0 = client.instance_id()
    peer = Peer(reactor)
    peer.handshake("bookie-A")
    (hello,) = peer.received()
    peer.answer(HelloResponse(hello.request_id, Status.OK, "", 1, "bookie-A"))
    assert result_of(d0) == "bookie-A"
    peer.drop()
    d1 = client.read_entry(1, 0)
    peer2 = Peer(reactor)
    peer2.handshake("bookie-B")
    assert peer2.received() == []  # the read never reached the impostor
    exc = failure_of(d1)
    assert isinstance(exc, BookieUnavailableError)
    assert "bookie-B" in str(exc)
    assert isinstance(failure_of(client.add_entry(1, 1, 0, b"x")), BookieUnavailableError)


def test_connect_failure_fails_waiting_requests(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A refused connection fails what waited for it; a later request tries again."""
    d = client.read_entry(1, 0)
    _, _, factory, _, _ = reactor.tcpClients[0]
    factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
    assert isinstance(failure_of(d), BookieUnavailableError)
    client.read_entry(1, 0)
    assert len(reactor.tcpClients) == 2


def test_unanswered_handshake_drops_the_connection(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A bookie that never answers HELLO is disconnected when the handshake times out."""
    d = client.read_entry(1, 0)
    peer = Peer(reactor)
    reactor.advance(6.0)
    assert isinstance(failure_of(d), BookieUnavailableError)
    assert peer.transport.disconnecting or peer.transport.disconnected


def test_refused_version_fails_requests(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A bookie that speaks none of our versions fails the requests waiting on the handshake."""
    d = client.read_entry(1, 0)
    peer = Peer(reactor)
    (hello,) = peer.received()
    peer.answer(HelloResponse(hello.request_id, Status.BAD_VERSION, "speaks 7", 7, "x"))
    assert isinstance(failure_of(d), BookieUnavailableError)
    assert peer.transport.disconnecting or peer.transport.disconnected


def test_garbage_from_the_bookie_drops_the_connection(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """An undecodable frame from the bookie aborts the connection; pending requests fail."""
    d = client.read_entry(1, 0)
    peer = Peer(reactor)
    peer.handshake()
    peer.proto.dataReceived(b"\x00\x00\x00\x01garbage-garbage-garbage")
    assert peer.transport.disconnecting or peer.transport.disconnected
    peer.drop()
    assert isinstance(failure_of(d), BookieUnavailableError)


def test_oversize_add_fails_locally(reactor: MemoryReactorClock) -> None:
    """An entry that cannot fit a frame fails before anything is sent."""
    client = TcpBookieClient("127.0.0.1:1", reactor, max_frame_size=1000)
    assert isinstance(failure_of(client.add_entry(1, 0, -1, b"x" * 2000)), BookieProtocolError)
    assert reactor.tcpClients == []


def test_close_fails_pending_and_later_requests(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """After close every pending and later request fails as unavailable."""
    d = client.read_entry(1, 0)
    peer = Peer(reactor)
    peer.handshake()
    closed = client.close()
    assert isinstance(failure_of(d), BookieUnavailableError)
    assert peer.transport.disconnecting
    assert not closed.called
    peer.drop()
    assert closed.called
    assert isinstance(failure_of(client.fence(1)), BookieUnavailableError)


def test_instance_id_is_cached_once_known(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """Asking the identity of a connected bookie needs no round trip."""
    d = client.instance_id()
    peer = Peer(reactor)
    peer.handshake("bookie-Z")
    (hello,) = peer.received()
    peer.answer(HelloResponse(hello.request_id, Status.OK, "", 1, "bookie-Z"))
    assert result_of(d) == "bookie-Z"
    assert result_of(client.instance_id()) == "bookie-Z"
    assert peer.received() == []


def test_bad_address_is_refused() -> None:
    """An address without a port is a programming error."""
    with pytest.raises(ValueError, match="host:port"):
        TcpBookieClient("localhost", MemoryReactorClock())


def test_many_requests_time_out_in_one_sweep(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """One timer handles the timeouts of many requests (no timer per request)."""
    ds = [client.add_entry(1, e, e - 1, b"x") for e in range(100)]
    assert len(reactor.getDelayedCalls()) == 1
    reactor.advance(5.0)
    reactor.advance(2.0)
    assert all(isinstance(failure_of(d), BookieUnavailableError) for d in ds)


# -- batched adds (Rule 5) ------------------------------------------------------------------


class Listener:
    """Records what a batched add's listener is told."""

    def __init__(self) -> None:
        self.acked: list[tuple[str, list[int]]] = []
        self.failed: list[tuple[str, list[int], BookieError]] = []

    def entries_acked(self, address: str, entry_ids: Any) -> None:
        self.acked.append((address, list(entry_ids)))

    def entries_failed(self, address: str, entry_ids: Any, error: BookieError) -> None:
        self.failed.append((address, list(entry_ids), error))


def test_batched_adds_of_one_turn_go_as_one_multi_add_per_ledger(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """Adds staged in one turn leave as one ADD_MULTI per ledger once the bookie chose wire
    version 2, and each frame's answer acknowledges its entries at once."""
    listener = Listener()
    for e in range(3):
        client.add_entry_batched(1, e, e - 1, f"d{e}".encode(), listener)
    client.add_entry_batched(2, 0, -1, b"other", listener)
    assert reactor.tcpClients == []  # nothing happens before the turn ends
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=2)
    first, second = peer.received()
    assert isinstance(first, MultiAddRequest)
    assert isinstance(second, MultiAddRequest)
    assert (first.ledger_id, second.ledger_id) == (1, 2)
    assert [(e, lac, bytes(d)) for e, lac, d in first.entries] == [
        (0, -1, b"d0"),
        (1, 0, b"d1"),
        (2, 1, b"d2"),
    ]
    assert listener.acked == []
    peer.answer(MultiAddResponse(second.request_id, Status.OK, "", 2, 1))
    peer.answer(MultiAddResponse(first.request_id, Status.OK, "", 1, 3))
    assert listener.acked == [("127.0.0.1:3181", [0]), ("127.0.0.1:3181", [0, 1, 2])]
    assert listener.failed == []
    client.add_entry_batched(1, 3, 2, b"d3", listener)
    reactor.advance(0)
    (later,) = peer.received()
    assert isinstance(later, MultiAddRequest)
    assert [e for e, _, _ in later.entries] == [3]


def test_batched_adds_to_a_version_1_bookie_go_as_single_adds(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A bookie that speaks only version 1 gets ADD frames and acknowledges them one by one."""
    listener = Listener()
    client.add_entry_batched(1, 0, -1, b"a", listener)
    client.add_entry_batched(1, 1, 0, b"b", listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=1)
    a, b = peer.received()
    assert isinstance(a, AddRequest)
    assert isinstance(b, AddRequest)
    assert [(a.entry_id, bytes(a.data)), (b.entry_id, bytes(b.data))] == [(0, b"a"), (1, b"b")]
    peer.answer(AddResponse(b.request_id, Status.OK, "", 1, 1))
    peer.answer(AddResponse(a.request_id, Status.FENCED, "", 1, 0))
    assert listener.acked == [("127.0.0.1:3181", [1])]
    ((_, ids, error),) = listener.failed
    assert ids == [0]
    assert isinstance(error, LedgerFencedError)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (MultiAddResponse(0, Status.FENCED, "", 1, 2), LedgerFencedError),
        (MultiAddResponse(0, Status.ERROR, "disk", 1, 2), BookieError),
        (MultiAddResponse(0, Status.OK, "", 1, 1), BookieProtocolError),
        (ErrorResponse(0, Status.BAD_REQUEST, "bad"), BookieProtocolError),
        (AddResponse(0, Status.OK, "", 1, 0), BookieProtocolError),
    ],
    ids=["fenced", "error", "wrong-count", "error-frame", "wrong-answer-type"],
)
def test_a_multi_add_answer_that_is_not_ok_fails_every_entry(
    reactor: MemoryReactorClock, client: TcpBookieClient, answer: Any, error: type
) -> None:
    """Every entry of the frame fails with the mapped error; none is acknowledged."""
    listener = Listener()
    client.add_entry_batched(1, 0, -1, b"a", listener)
    client.add_entry_batched(1, 1, 0, b"b", listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=2)
    (frame,) = peer.received()
    answer.request_id = frame.request_id
    peer.answer(answer)
    assert listener.acked == []
    ((_, ids, got),) = listener.failed
    assert ids == [0, 1]
    assert type(got) is error


def test_batched_adds_fail_on_timeout_and_on_a_dropped_connection(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """Sent adds time out; a drop fails what was sent and what was still staged."""
    listener = Listener()
    client.add_entry_batched(1, 0, -1, b"a", listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=2)
    peer.received()
    reactor.advance(6.0)
    ((_, ids, error),) = listener.failed
    assert ids == [0]
    assert isinstance(error, BookieUnavailableError)
    client.add_entry_batched(1, 1, -1, b"b", listener)
    reactor.advance(0)  # sent
    client.add_entry_batched(1, 2, -1, b"c", listener)  # staged
    peer.drop()
    assert sorted(ids for _, ids, _ in listener.failed[1:]) == [[1], [2]]
    assert all(isinstance(e, BookieUnavailableError) for _, _, e in listener.failed)
    reactor.advance(0)
    assert len(listener.failed) == 3  # the cancelled flush sends nothing more
    assert listener.acked == []


def test_batched_adds_split_at_the_frame_limit(reactor: MemoryReactorClock) -> None:
    """No ADD_MULTI exceeds the frame limit: a turn's adds are cut into several frames."""
    client = TcpBookieClient("127.0.0.1:3181", reactor, timeout_s=5.0, max_frame_size=1000)
    listener = Listener()
    for e in range(10):
        client.add_entry_batched(1, e, e - 1, b"x" * 200, listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=2)
    raw = peer.transport.value()
    frames = peer.received()
    assert len(frames) > 2
    assert all(isinstance(f, MultiAddRequest) for f in frames)
    assert [e for f in frames for e, _, _ in f.entries] == list(range(10))  # type: ignore[union-attr]
    assert len(raw) <= 1000 * len(frames)
    for f in frames:
        peer.answer(MultiAddResponse(f.request_id, Status.OK, "", 1, len(f.entries)))  # type: ignore[union-attr]
    assert sorted(e for _, ids in listener.acked for e in ids) == list(range(10))


def test_batched_adds_refused_at_once_are_failed_before_the_call_returns(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """An oversize add, or any add after close, fails synchronously and sends nothing."""
    small = TcpBookieClient("127.0.0.1:3181", reactor, max_frame_size=1000)
    listener = Listener()
    small.add_entry_batched(1, 0, -1, b"x" * 2000, listener)
    ((_, ids, error),) = listener.failed
    assert (ids, type(error)) == ([0], BookieProtocolError)
    client.close()
    client.add_entry_batched(1, 1, -1, b"y", listener)
    assert [ids for _, ids, _ in listener.failed] == [[0], [1]]
    assert isinstance(listener.failed[1][2], BookieUnavailableError)
    reactor.advance(0)
    assert reactor.tcpClients == []


def test_the_handshake_offers_every_version_the_client_speaks(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """HELLO asks for versions 1..latest, so old bookies can still pick version 1."""
    client.read_entry(1, 0)
    (hello,) = Peer(reactor).received()
    assert isinstance(hello, HelloRequest)
    assert (hello.min_version, hello.max_version) == (1, LATEST_VERSION)


def test_ready_records_join_the_adds_of_their_turn_and_oversize_ones_are_refused(
    reactor: MemoryReactorClock, client: TcpBookieClient
) -> None:
    """A record made once by the writer (``encode_add_record``) goes out in the same ADD_MULTI
    as the adds staged around it, byte for byte; one above the frame limit fails at once."""
    listener = Listener()
    client.add_entry_batched(1, 0, -1, b"a", listener)
    client.add_record_batched(1, 1, encode_add_record(1, 1, 0, b"b"), listener)
    client.add_entry_batched(1, 2, 1, b"c", listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=2)
    (frame,) = peer.received()
    assert isinstance(frame, MultiAddRequest)
    assert [(e, lac, bytes(d)) for e, lac, d in frame.entries] == [
        (0, -1, b"a"),
        (1, 0, b"b"),
        (2, 1, b"c"),
    ]
    small = TcpBookieClient("127.0.0.1:3181", reactor, max_frame_size=1000)
    small.add_record_batched(1, 3, encode_add_record(1, 3, 2, b"x" * 1000), listener)
    ((_, ids, error),) = listener.failed
    assert (ids, type(error)) == ([3], BookieProtocolError)


@pytest.mark.parametrize("version", [1, 2])
def test_records_in_parts_go_out_as_the_joined_records(
    reactor: MemoryReactorClock, client: TcpBookieClient, version: int
) -> None:
    """A record staged as its parts (``add_parts_batched``) leaves as the same frame(s) as the
    joined record, to a bookie of either wire version; one above the frame limit fails."""
    listener = Listener()
    record = encode_add_record(1, 0, -1, b"a" * 100)
    client.add_parts_batched(1, 0, (record[:8], record[8:40], record[40:]), len(record), listener)
    client.add_record_batched(1, 1, encode_add_record(1, 1, 0, b"b"), listener)
    reactor.advance(0)
    peer = Peer(reactor)
    peer.handshake(version=version)
    frames = peer.received()
    if version == 2:
        (frame,) = frames
        assert isinstance(frame, MultiAddRequest)
        got = [(e, lac, bytes(d)) for e, lac, d in frame.entries]
    else:
        assert all(isinstance(f, AddRequest) for f in frames)
        got = [(f.entry_id, f.lac, bytes(f.data)) for f in frames if isinstance(f, AddRequest)]
    assert got == [(0, -1, b"a" * 100), (1, 0, b"b")]
    small = TcpBookieClient("127.0.0.1:3181", reactor, max_frame_size=1000)
    big = encode_add_record(1, 3, 2, b"x" * 1000)
    small.add_parts_batched(1, 3, (big[:8], big[8:]), len(big), listener)
    ((_, ids, error),) = listener.failed
    assert (ids, type(error)) == ([3], BookieProtocolError)


class _Socket:
    """The socket of a ``tcp.Client`` that takes every send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def setsockopt(self, *args: Any) -> None:
        pass


def _tcp_client(sock: _Socket) -> tuple[Any, list[bytes]]:
    """A ``tcp.Client`` in the state of an open connection; what goes through Twisted's own
    ``write`` (sent when the reactor next polls) is recorded apart from what is sent now."""
    conn: Any = tcp.Client.__new__(tcp.Client)
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
    conn.writeSequence = lambda seq: queued.append(b"".join(seq))
    return conn, queued


def test_a_frame_sent_early_leaves_at_once_and_the_rest_at_the_end_of_the_turn(
    reactor: MemoryReactorClock,
) -> None:
    """Once staged adds reach ``batch_bytes`` their frame goes to the kernel during the turn
    (the bookie journals it meanwhile); what stays staged goes, in one send, when the turn
    ends; nothing waits for the reactor's next poll."""
    client = TcpBookieClient("127.0.0.1:3181", reactor, timeout_s=5.0, batch_bytes=300)
    listener = Listener()
    client.add_entry_batched(1, 0, -1, b"warm-up", listener)
    reactor.advance(0)
    _, _, factory, _, _ = reactor.tcpClients[-1]
    proto = factory.buildProtocol(None)
    sock = _Socket()
    conn, queued = _tcp_client(sock)
    proto.makeConnection(conn)
    (hello,) = decode_all(b"".join(queued))
    proto.dataReceived(HelloResponse(hello.request_id, Status.OK, "", 2, "bookie-A").encode())
    (warm,) = decode_all(b"".join(sock.sent))
    assert isinstance(warm, MultiAddRequest)
    sock.sent.clear()
    for e in range(1, 4):
        client.add_entry_batched(1, e, e - 1, b"x" * 100, listener)
    (early,) = decode_all(b"".join(sock.sent))  # 3 records of 133 bytes passed 300
    assert isinstance(early, MultiAddRequest)
    assert [e for e, _, _ in early.entries] == [1, 2, 3]
    sock.sent.clear()
    client.add_entry_batched(1, 4, 3, b"y", listener)
    client.add_entry_batched(2, 0, -1, b"z", listener)
    assert sock.sent == []
    reactor.advance(0)
    assert len(sock.sent) == 1  # both ledgers' frames of the turn in one send
    rest = decode_all(sock.sent[0])
    assert [(m.ledger_id, [e for e, _, _ in m.entries]) for m in rest] == [(1, [4]), (2, [0])]
    assert queued == [queued[0]]  # only the handshake went through Twisted's write


@pytest.mark.parametrize("early", [True, False], ids=["before-handshake", "after-handshake"])
def test_strided_reads_go_only_to_a_bookie_that_chose_version_3(
    reactor: MemoryReactorClock, early: bool
) -> None:
    """A bookie of wire version 2 never receives a READ_STRIDE (it would drop the connection):
    the read fails locally with ``BookieProtocolError``, and the requests around it go on. One
    of version 3 gets it and its answer comes back as the entries."""
    for version in (2, 3):
        client = TcpBookieClient("127.0.0.1:3181", reactor, timeout_s=5.0)
        before = client.read_entry(3, 0)
        peer = Peer(reactor)
        strided = client.read_range(3, 1, 9, 1000, 4) if early else None
        peer.handshake(version=version)
        if strided is None:
            strided = client.read_range(3, 1, 9, 1000, 4)
        after = client.read_range(3, 1, 9, 1000)
        sent = peer.received()
        kinds = [(type(m), getattr(m, "stride", None)) for m in sent]
        if version == 2:
            assert kinds == [(ReadRequest, None), (ReadRangeRequest, 1)]
            error = failure_of(strided)
            assert isinstance(error, BookieProtocolError)
            assert "version 3" in str(error)
        else:
            assert kinds == [(ReadRequest, None), (ReadRangeRequest, 4), (ReadRangeRequest, 1)]
            peer.answer(ReadRangeResponse(sent[1].request_id, Status.OK, "", 3, [(1, b"a")]))
            assert result_of(strided) == [ReadResult(1, b"a")]
        peer.answer(
            ReadResponse(sent[0].request_id, Status.OK, "", 3, 0, b"z"),
            ReadRangeResponse(sent[-1].request_id, Status.OK, "", 3, [(1, b"a"), (2, b"b")]),
        )
        assert result_of(before) == b"z"
        assert result_of(after) == [ReadResult(1, b"a"), ReadResult(2, b"b")]
        assert not peer.transport.disconnecting
        client.close()
