"""The blocking direct ledger reader against in-memory bookies (no sockets, no threads)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from polybroker.ledger.client import encode_record
from polybroker.ledger.direct import (
    DirectLedgerReader,
    DirectReadError,
    LedgerLayout,
    decode_record,
    layouts_from_stats,
)
from polybroker.ledger.wire import (
    FrameDecoder,
    HelloRequest,
    HelloResponse,
    ReadRangeRequest,
    ReadRangeResponse,
    ReadRequest,
    ReadResponse,
    Status,
)


def _stored(ledger: int, n: int, size: int = 10) -> dict[int, bytes]:
    return {
        e: encode_record(ledger, e, e - 1, (e + 1) * size, bytes([e % 256]) * size)
        for e in range(n)
    }


class FakeBookie:
    """Answers HELLO, READ and READ_RANGE from ``entries`` the way the bookie server does."""

    def __init__(self, entries: dict[int, dict[int, bytes]]) -> None:
        self.entries = entries
        self.requests: list[object] = []
        self.fail_after: int | None = None  # answer NO_SUCH_ENTRY from this entry on
        self.recv_error: Exception | None = None  # raised by recv once set
        self.garbage = b""  # bytes sent instead of the next answer
        self.version = 1  # the wire version it chooses (3: it takes strided reads)

    def answer(self, req: object) -> bytes:
        self.requests.append(req)
        if self.garbage:
            out, self.garbage = self.garbage, b""
            return out
        if isinstance(req, HelloRequest):
            version = min(self.version, req.max_version)
            return HelloResponse(req.request_id, Status.OK, "", version, "fake").encode()
        if isinstance(req, ReadRequest):
            data = self.entries.get(req.ledger_id, {}).get(req.entry_id)
            if data is None or (self.fail_after is not None and req.entry_id >= self.fail_after):
                return ReadResponse(
                    req.request_id, Status.NO_SUCH_ENTRY, "no", req.ledger_id
                ).encode()
            return ReadResponse(
                req.request_id, Status.OK, "", req.ledger_id, req.entry_id, data
            ).encode()
        assert isinstance(req, ReadRangeRequest)
        assert req.stride == 1 or self.version >= 3
        stored = self.entries.get(req.ledger_id, {})
        out: list[tuple[int, bytes]] = []
        used = 0
        for e in range(req.first_entry_id, req.last_entry_id + 1, req.stride):
            data = stored.get(e)
            if data is None or (self.fail_after is not None and e >= self.fail_after):
                break
            if out and used + len(data) > req.max_bytes:
                break
            out.append((e, data))
            used += len(data)
        status = Status.OK if out else Status.NO_SUCH_ENTRY
        return ReadRangeResponse(req.request_id, status, "", req.ledger_id, out).encode()


class FakeSock:
    def __init__(self, bookie: FakeBookie) -> None:
        self.bookie = bookie
        self.decoder = FrameDecoder()
        self.out = b""
        self.closed = False

    def sendall(self, data: bytes) -> None:
        self.decoder.receive_data(data)
        for req in self.decoder.drain():
            self.out += self.bookie.answer(req)

    def recv(self, n: int) -> bytes:
        if self.bookie.recv_error is not None:
            raise self.bookie.recv_error
        chunk, self.out = self.out[: min(n, 1000)], self.out[min(n, 1000) :]
        return chunk

    def close(self) -> None:
        self.closed = True


def _connector(bookies: dict[str, FakeBookie]) -> Callable[[str, float], FakeSock]:
    def connect(address: str, timeout: float) -> FakeSock:
        if address not in bookies:
            raise ConnectionRefusedError(f"nothing at {address}")
        return FakeSock(bookies[address])

    return connect


def _layout(ledger: int, *ensemble: str, qw: int | None = None) -> LedgerLayout:
    return LedgerLayout(ledger, len(ensemble), qw or len(ensemble), ((0, tuple(ensemble)),))


def test_decode_record_reads_what_the_ledger_client_writes_and_refuses_misplaced_ones() -> None:
    raw = encode_record(7, 3, 2, 100, b"payload")
    assert decode_record(7, 3, raw) == b"payload"
    for ledger, entry, data in ((7, 4, raw), (8, 3, raw), (7, 3, raw[:-1] + b"X"), (7, 3, b"x")):
        with pytest.raises(DirectReadError):
            decode_record(ledger, entry, data)


def test_pipelined_ranges_cut_by_the_byte_budget_give_every_entry_once_in_order() -> None:
    stored = _stored(5, 200, size=300)
    bookie = FakeBookie({5: stored})
    reader = DirectLedgerReader(connect=_connector({"b1:1": bookie}), range_bytes=2000, window=3)
    got = list(reader.read(_layout(5, "b1:1"), 3, 180))
    assert [e for e, _ in got] == list(range(3, 181))
    assert all(data == bytes([e % 256]) * 300 for e, data in got)
    ranges = [r for r in bookie.requests if isinstance(r, ReadRangeRequest)]
    assert len(ranges) > 10  # pipelined requests sized to the budget
    assert reader.failures == []


def test_a_bookie_failing_mid_range_hands_over_to_the_next_replica_without_repeats() -> None:
    stored = _stored(9, 50)
    first, second = FakeBookie({9: stored}), FakeBookie({9: stored})
    first.fail_after = 20
    bookies = {"a:1": first, "b:1": second}
    # Ledger 9 with two replicas starts at index 9 % 2 = 1: put the failing one there.
    layout = _layout(9, "b:1", "a:1")
    reader = DirectLedgerReader(connect=_connector(bookies), range_entries=8)
    got = [e for e, _ in reader.read(layout, 0, 49)]
    assert got == list(range(50))
    assert len(reader.failures) == 1
    assert reader.failures[0].startswith("a:1")
    asked = [r.first_entry_id for r in second.requests if isinstance(r, ReadRangeRequest)]
    assert asked[0] == 20


@pytest.mark.parametrize("fault", ["refused", "timeout", "corrupt", "garbage"])
def test_each_kind_of_replica_fault_falls_back_to_the_other_replica(fault: str) -> None:
    stored = _stored(2, 30)
    good = FakeBookie({2: stored})
    bad = FakeBookie({2: dict(stored)})
    bookies = {"good:1": good, "bad:1": bad}
    if fault == "refused":
        del bookies["bad:1"]
    elif fault == "timeout":
        bad.recv_error = TimeoutError("timed out")
    elif fault == "corrupt":
        bad.entries[2][4] = bad.entries[2][4][:-1] + b"\xff"
    else:
        # A frame header claiming more than the frame limit: refused before it is buffered.
        bad.garbage = b"\x7f\xff\xff\xff" + b"\x01" * 14
    layout = _layout(2, "bad:1", "good:1")  # ledger 2: starts with replica 0, the bad one
    reader = DirectLedgerReader(connect=_connector(bookies), range_entries=4)
    got = list(reader.read(layout, 0, 29))
    assert [e for e, _ in got] == list(range(30))
    assert [d for _, d in got] == [decode_record(2, e, stored[e]) for e in range(30)]
    assert reader.failures
    assert reader.failures[0].startswith("bad:1")


def test_every_replica_failing_raises() -> None:
    bookie = FakeBookie({1: _stored(1, 5)})
    bookie.fail_after = 2
    reader = DirectLedgerReader(connect=_connector({"x:1": bookie}))
    it = reader.read(_layout(1, "x:1"), 0, 4)
    assert [next(it)[0], next(it)[0]] == [0, 1]
    with pytest.raises(DirectReadError, match="unreadable"):
        next(it)


@pytest.mark.parametrize("version", [1, 3])
def test_striped_ledger_reads_each_entry_from_its_write_set_across_fragments(version: int) -> None:
    """E=3, Qw=2: entry e lives on ensemble[e % 3] and ensemble[(e + 1) % 3]; from entry 12
    on, bookie c was replaced by d, and c is gone. Bookies of wire version 3 answer one
    strided read per residue and chunk; older ones one read per entry."""
    stored = _stored(4, 30, size=50)
    layout = LedgerLayout(4, 3, 2, ((0, ("a:1", "b:1", "c:1")), (12, ("a:1", "b:1", "d:1"))))
    holders: dict[str, FakeBookie] = {n: FakeBookie({4: {}}) for n in ("a:1", "b:1", "c:1", "d:1")}
    for e, data in stored.items():
        for address in layout.write_set(e):
            holders[address].entries[4][e] = data
    for bookie in holders.values():
        bookie.version = version
    del holders["c:1"]  # c is gone: its entries are read from the other replica
    # A chunk is 3 x 2 entries.
    reader = DirectLedgerReader(connect=_connector(holders), range_entries=2)
    got = list(reader.read(layout, 0, 29))
    assert got == [(e, decode_record(4, e, raw)) for e, raw in sorted(stored.items())]
    asked = [r for b in holders.values() for r in b.requests if not isinstance(r, HelloRequest)]
    if version == 1:
        assert all(isinstance(r, ReadRequest) for r in asked)
    else:
        assert all(isinstance(r, ReadRangeRequest) and r.stride == 3 for r in asked)
        # One request per residue of each 6-entry chunk; c's residue goes to its next replica.
        assert len(asked) == 15
        firsts = [r.first_entry_id for r in holders["a:1"].requests[1:]]  # type: ignore[attr-defined]
        assert firsts == [0, 2, 6, 8, 12, 18, 24]


def test_an_abandoned_read_drops_its_connection_and_the_next_read_starts_clean() -> None:
    bookie = FakeBookie({3: _stored(3, 100)})
    reader = DirectLedgerReader(connect=_connector({"z:1": bookie}), range_entries=4, window=4)
    it = reader.read(_layout(3, "z:1"), 0, 99)
    assert next(it)[0] == 0
    it.close()  # requests still in flight
    assert [e for e, _ in reader.read(_layout(3, "z:1"), 50, 60)] == list(range(50, 61))
    reader.close()


def test_layouts_from_stats_take_sealed_ledgers_only() -> None:
    stats = [
        {
            "ledgerId": 3,
            "entries": 5,
            "sealed": True,
            "ensembleSize": 2,
            "writeQuorumSize": 2,
            "fragments": [{"firstEntryId": 0, "bookies": ["a:1", "b:1"]}],
        },
        {"ledgerId": 4, "entries": 1, "sealed": False},
    ]
    layouts = layouts_from_stats(stats)
    assert list(layouts) == [3]
    assert layouts[3].write_set(1) == ("b:1", "a:1")
    with pytest.raises(ValueError, match="E=2 Qw=3"):
        LedgerLayout(1, 2, 3, ((0, ("a", "b")),))
