"""The in-process bookie connection: the TCP client's rules over in-memory transports to a real
bookie (acks after the journal's sync, fencing, refusals, closes), and the transports' own
rules (no re-entry, order, pauses, receiver errors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.ledger.api import BookieUnavailableError, LedgerFencedError
from polybroker.ledger.bookie.journal import JournalConfig
from polybroker.ledger.bookie.server import Bookie, BookieFactory
from polybroker.ledger.bookie.storage import LedgerStorage
from polybroker.ledger.bookie_client import TcpBookieClient
from polybroker.ledger.local import LocalBookieClient, _Link, local_connector, serving

ADDRESS = "127.0.0.1:3181"


def run_now(fn: Callable[[], Any]) -> Deferred[Any]:
    try:
        return succeed(fn())
    except Exception:
        return fail(Failure())


class Rig:
    """A bookie with no threads (the journal is written when the test says) and a local client."""

    def __init__(self, root: Path) -> None:
        self.clock = Clock()
        (root / "journal").mkdir()
        self.storage = LedgerStorage(root / "ledgers", write_cache_max_bytes=1 << 20)
        self.bookie: Bookie | None = Bookie(
            self.storage,
            root / "journal",
            JournalConfig(prealloc_size=0, zero_ahead=0),
            self.clock,
            "instance-1",
            deliver=lambda fn, *args: fn(*args),
            run_blocking=run_now,
        )
        self.bookie.recover()
        self.client = LocalBookieClient(ADDRESS, self.clock, self.serve, timeout_s=5.0)

    def serve(self) -> Factory | None:
        if self.bookie is None or self.bookie.closing:
            return None
        return BookieFactory(self.bookie, 1 << 20)

    def turn(self) -> None:
        """Run what the reactor would run next (every call due now)."""
        self.clock.advance(0)

    def sync(self) -> None:
        """The journal writer writes and syncs what was handed to it."""
        assert self.bookie is not None
        assert self.bookie.journal is not None
        while self.bookie.journal.write_pending():
            pass


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def outcome(d: Deferred[Any]) -> list[Any]:
    seen: list[Any] = []
    d.addBoth(seen.append)
    return seen


def test_an_add_is_answered_only_after_its_journal_group_synced(rig: Rig) -> None:
    """The add reaches the bookie without a socket and its answer waits for the sync."""
    seen = outcome(rig.client.add_entry(7, 0, -1, b"hello"))
    rig.turn()  # connect, handshake, send, hand the turn's records to the journal
    assert seen == []
    rig.sync()
    assert seen == [None]
    assert rig.storage.read_entry(7, 0) == b"hello"


def test_the_answer_reaches_the_client_in_the_turn_of_the_completion(rig: Rig) -> None:
    """A journal completion is delivered to the client at once, not on a later turn."""
    rig.client.add_entry(7, 0, -1, b"a")
    rig.turn()
    seen = outcome(rig.client.add_entry(7, 1, 0, b"b"))
    rig.turn()
    rig.sync()
    assert seen == [None]  # no turn ran between the sync and this assertion
    assert not rig.clock.getDelayedCalls() or all(
        c.getTime() > rig.clock.seconds() for c in rig.clock.getDelayedCalls()
    )


def test_a_fenced_ledger_refuses_the_local_writer(rig: Rig) -> None:
    """Fencing holds over the in-memory connection: later adds answer FENCED."""
    rig.client.add_entry(7, 0, -1, b"a")
    rig.turn()
    rig.sync()
    fenced = outcome(rig.client.fence(7))
    rig.turn()
    rig.sync()
    assert fenced
    assert not isinstance(fenced[0], Failure)
    seen = outcome(rig.client.add_entry(7, 1, 0, b"b"))
    rig.turn()
    rig.turn()
    assert isinstance(seen[0], Failure)
    assert seen[0].check(LedgerFencedError)


def test_a_bookie_not_serving_refuses_the_connection(rig: Rig) -> None:
    """While the bookie is stopped the request fails as a refused connection would."""
    rig.bookie = None
    seen = outcome(rig.client.add_entry(7, 0, -1, b"a"))
    rig.turn()
    assert isinstance(seen[0], Failure)
    assert seen[0].check(BookieUnavailableError)


def test_a_bookie_closing_the_connection_fails_pending_adds_then_a_new_one_is_made(
    rig: Rig,
) -> None:
    """The bookie dropping its connections fails what is pending; the next add reconnects."""
    rig.client.add_entry(7, 0, -1, b"a")
    rig.turn()
    rig.sync()
    seen = outcome(rig.client.add_entry(7, 1, 0, b"b"))
    rig.turn()
    assert rig.bookie is not None
    for proto in list(rig.bookie.protocols):
        assert proto.transport is not None
        proto.transport.loseConnection()
    rig.turn()
    assert isinstance(seen[0], Failure)
    assert seen[0].check(BookieUnavailableError)
    again = outcome(rig.client.add_entry(7, 2, 0, b"c"))
    rig.turn()
    rig.sync()
    assert again == [None]


def test_close_waits_for_the_connection_to_end(rig: Rig) -> None:
    """``close`` fires once both sides saw the connection end."""
    rig.client.add_entry(7, 0, -1, b"a")
    rig.turn()
    rig.sync()
    closed = outcome(rig.client.close())
    assert closed == []
    rig.turn()
    assert closed == [None]
    assert rig.bookie is not None
    assert not rig.bookie.protocols


def test_local_connector_uses_tcp_for_other_addresses(rig: Rig) -> None:
    """Only the named in-process bookies are reached in memory."""
    connect = local_connector(rig.clock, {ADDRESS: rig.serve})
    assert type(connect(ADDRESS)) is LocalBookieClient
    assert type(connect("127.0.0.1:3182")) is TcpBookieClient


class Recorder(Protocol):
    """Records what it receives; ``reply`` is written back from inside ``dataReceived``."""

    def __init__(self, reply: bytes = b"", fail_with: Exception | None = None) -> None:
        self.received: list[bytes] = []
        self.lost: list[Failure] = []
        self.reply = reply
        self.fail_with = fail_with

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)
        if self.fail_with is not None:
            raise self.fail_with
        if self.reply:
            assert self.transport is not None
            self.transport.write(self.reply)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.lost.append(reason)


def linked(clock: Clock, client: Recorder, server: Recorder) -> tuple[_Link, Recorder, Recorder]:
    link = _Link(clock, "127.0.0.1:0", ADDRESS)
    link.client.protocol, link.server.protocol = client, server
    server.makeConnection(link.server)
    client.makeConnection(link.client)
    return link, client, server


def test_a_write_inside_a_delivery_waits_for_the_next_turn() -> None:
    """No side is re-entered: an answer written while receiving arrives a turn later."""
    clock = Clock()
    link, client, server = linked(clock, Recorder(), Recorder(reply=b"pong"))
    link.client.write(b"ping")
    assert server.received == [b"ping"]
    assert client.received == []
    clock.advance(0)
    assert client.received == [b"pong"]


def test_bytes_keep_their_order_while_earlier_ones_wait() -> None:
    """Bytes written while others wait for a turn go after them."""
    clock = Clock()
    link, _client, server = linked(clock, Recorder(), Recorder())
    link.server.pauseProducing()
    link.client.write(b"a")
    link.client.write(b"b")
    link.server.resumeProducing()
    link.client.write(b"c")
    assert server.received == []
    clock.advance(0)
    assert b"".join(server.received) == b"abc"


def test_a_failing_receiver_aborts_the_connection_not_the_writer() -> None:
    """An exception in a receiver is contained: the connection ends on both sides."""
    clock = Clock()
    link, client, server = linked(clock, Recorder(), Recorder(fail_with=ValueError("bug")))
    link.client.write(b"x")  # does not raise
    clock.advance(0)
    assert len(client.lost) == 1
    assert len(server.lost) == 1
    link.client.write(b"y")
    assert server.received == [b"x"]


def test_a_close_delivers_what_was_written_first() -> None:
    """``loseConnection`` delivers the closer's last bytes, then ends both sides."""
    clock = Clock()
    link, client, server = linked(clock, Recorder(), Recorder())
    link.server.pauseProducing()
    link.client.write(b"last")
    link.client.loseConnection()
    link.server.write(b"dropped")  # the closing side reads no more
    clock.advance(0)
    assert server.received == [b"last"]
    assert client.received == []
    assert len(client.lost) == 1
    assert len(server.lost) == 1


class _Server:
    """What ``serving`` reads of a ``BookieServer``."""

    def __init__(self, bookie: Bookie | None) -> None:
        self.bookie = bookie
        self.max_frame_size = 1 << 20


def test_serving_follows_the_bookie_server_state(rig: Rig) -> None:
    """A stopped or closing bookie serves nothing; a running one gets its protocol factory."""
    server = _Server(None)
    serve = serving(server)
    assert serve() is None
    server.bookie = rig.bookie
    factory = serve()
    assert isinstance(factory, BookieFactory)
    assert factory.bookie is rig.bookie
    assert rig.bookie is not None
    rig.bookie.closing = True
    assert serve() is None


class PartsRecorder(Recorder):
    """A receiver that takes what waited as parts (as the bookie's and the client's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[list[bytes]] = []

    def data_received_parts(self, parts: list[bytes]) -> None:
        self.parts.append(parts)


def test_writes_that_waited_reach_a_parts_taker_uncopied_and_others_joined() -> None:
    """Writes that waited for a turn are one delivery: the very objects written, in order, to
    a protocol that takes parts (joining megabytes of entries would copy each byte once more),
    joined to any other."""
    clock = Clock()
    link, _client, server = linked(clock, Recorder(), PartsRecorder())
    plain_link, _c, plain = linked(clock, Recorder(), Recorder())
    big = b"B" * (256 * 1024)
    for lk in (link, plain_link):
        lk.server.pauseProducing()
        for piece in (b"a", big, b"c"):
            lk.client.write(piece)
        lk.server.resumeProducing()
    clock.advance(0)
    assert isinstance(server, PartsRecorder)
    assert server.parts == [[b"a", big, b"c"]]
    assert server.parts[0][1] is big
    assert server.received == []
    assert plain.received == [b"a" + big + b"c"]
