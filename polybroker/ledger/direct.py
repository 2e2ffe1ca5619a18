"""A small blocking reader of ledgers straight from bookies, for processes with no reactor.

Spark workers read the sealed part of a topic's backlog with it (as Pulsar SQL reads BookKeeper
directly). It speaks the bookie wire protocol (``ledger.wire``, sans-IO) over plain sockets.

Rule 1: only entries that can no longer change are read: those of a closed ledger, or at most up
        to a last-add-confirmed the caller learnt elsewhere. The reader never writes, fences or
        recovers anything.
Rule 2: every frame is bounded (``max_frame_size``), every socket call has a timeout, and every
        record is checked against its ledger id, entry id and checksum (the ledger client's
        record format, Rule 2 of ``ledger.client``) before its data is handed out.
Rule 3: ranges are read from one bookie of the fragment's write set with up to ``window`` range
        requests in flight; on any error (refused connection, timeout, missing entry, bad
        record, bad frame) the read goes on from the first entry not yet handed out with the next
        bookie of the write set. ``DirectReadError`` once every bookie failed for an entry.
Rule 4: entries come out in order, each exactly once.
Rule 5: a striped fragment (E > Qw) is read in chunks: the entries of one residue modulo E share
        a write set, so each residue of a chunk is one strided request (``READ_STRIDE``) to its
        first bookie, all sent before any answer is read, again from the first entry missing
        until the chunk is whole. A residue's request goes to the first bookie of its write set
        that connects and chose wire version 3 or later; one whose request failed or found no
        such bookie has its next entry read alone, replica after replica.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

#: Data asked for per range request (the bookie cuts an answer at this many bytes).
DEFAULT_RANGE_BYTES = 2 * 1024 * 1024
#: Entries asked for per range request.
DEFAULT_RANGE_ENTRIES = 256
#: Range requests in flight on one connection.
DEFAULT_WINDOW = 4

if TYPE_CHECKING:
    from polybroker.ledger.wire import FrameError


def _wire() -> Any:
    """The bookie wire codec, imported on first use: a process that only plans reads
    (``LedgerLayout``, ``layouts_from_stats``) starts without it and what it imports."""
    from polybroker.ledger import wire

    return wire


_CRC32C: Callable[..., int] | None = None


def _crc32c() -> Callable[..., int]:
    """crc32c, imported on first use like ``_wire``: its import (10-15 ms, half of it the
    package looking up its own metadata) is not paid by every Spark planning process."""
    global _CRC32C
    if _CRC32C is None:
        from crc32c import crc32c

        _CRC32C = crc32c
    return _CRC32C


def __getattr__(name: str) -> Any:
    if name == "FrameError":
        return _wire().FrameError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_RECORD = struct.Struct(">BqQI")  # version, lac, cumulative length, crc32c
_DIGEST = struct.Struct(">QqqQ")  # ledger id, entry id, lac, cumulative length
_RECORD_VERSION = 1


class DirectReadError(Exception):
    """Entries could not be read from any bookie that holds them."""


class Sock(Protocol):
    """The part of a socket the reader uses."""

    def sendall(self, data: bytes, /) -> Any: ...

    def recv(self, n: int, /) -> bytes: ...

    def close(self) -> None: ...


Connect = Callable[[str, float], Sock]


def tcp_connect(address: str, timeout: float) -> Sock:
    """Open a TCP connection to ``host:port`` whose every call times out after ``timeout``."""
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
    return s


@dataclass(frozen=True)
class LedgerLayout:
    """Where a ledger's entries live: E, Qw and its fragments (first entry id, ensemble)."""

    ledger_id: int
    ensemble_size: int
    write_quorum: int
    fragments: tuple[tuple[int, tuple[str, ...]], ...]

    def __post_init__(self) -> None:
        if not self.fragments or self.fragments[0][0] != 0:
            raise ValueError("the first fragment must start at entry 0")
        if not self.ensemble_size >= self.write_quorum >= 1:
            raise ValueError(f"E={self.ensemble_size} Qw={self.write_quorum}")
        for _, ensemble in self.fragments:
            if len(ensemble) != self.ensemble_size:
                raise ValueError(f"ensemble {ensemble!r} is not of size {self.ensemble_size}")

    def fragment_of(self, entry_id: int) -> tuple[int, int | None, tuple[str, ...]]:
        """``(first entry, first entry of the next fragment or None, ensemble)`` of an entry."""
        chosen = 0
        for i, (first, _) in enumerate(self.fragments):
            if first > entry_id:
                break
            chosen = i
        first, ensemble = self.fragments[chosen]
        nxt = self.fragments[chosen + 1][0] if chosen + 1 < len(self.fragments) else None
        return first, nxt, ensemble

    def write_set(self, entry_id: int) -> tuple[str, ...]:
        """The Qw bookies that hold ``entry_id``: ensemble[(e + i) mod E]."""
        _, _, ensemble = self.fragment_of(entry_id)
        e = self.ensemble_size
        return tuple(ensemble[(entry_id + i) % e] for i in range(self.write_quorum))


def decode_record(ledger_id: int, entry_id: int, raw: bytes | memoryview) -> bytes:
    """The data of a stored record; ``DirectReadError`` unless it is ``ledger_id:entry_id``'s."""
    if len(raw) < _RECORD.size:
        raise DirectReadError(f"{ledger_id}:{entry_id}: record of {len(raw)} bytes is short")
    version, lac, length, crc = _RECORD.unpack_from(raw)
    if version != _RECORD_VERSION:
        raise DirectReadError(f"{ledger_id}:{entry_id}: unknown record version {version}")
    data = raw[_RECORD.size :]
    if lac < -1 or lac >= entry_id or length < len(data):
        raise DirectReadError(f"{ledger_id}:{entry_id}: impossible lac {lac}/length {length}")
    crc32c = _CRC32C or _crc32c()
    if crc32c(data, crc32c(_DIGEST.pack(ledger_id, entry_id, lac, length))) != crc:
        raise DirectReadError(f"{ledger_id}:{entry_id}: checksum mismatch")
    return bytes(data)


class BookieConnection:
    """One blocking connection to a bookie: send frames, receive decoded answers in order."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        connect: Connect = tcp_connect,
        max_frame_size: int | None = None,
    ) -> None:
        wire = _wire()
        self.address = address
        self._decoder = wire.FrameDecoder(max_frame_size or wire.DEFAULT_MAX_FRAME_SIZE)
        self._ready: deque[Any] = deque()
        self._next_id = 1
        try:
            self._sock = connect(address, timeout)
        except OSError as e:
            raise DirectReadError(f"bookie {address}: {e}") from None
        self.version = wire.WIRE_VERSION  # what the bookie chose at the handshake
        try:
            rid = self.request_id()
            hello_req = wire.HelloRequest(
                rid, wire.WIRE_VERSION, wire.STRIDE_READ_VERSION, "direct-reader"
            )
            self.send(hello_req.encode())
            hello = self.receive(rid)
            if not isinstance(hello, wire.HelloResponse) or hello.status != wire.Status.OK:
                raise DirectReadError(f"bookie {address} refused the session: {hello!r}")
            self.version = hello.version
        except BaseException:
            self.close()
            raise

    def request_id(self) -> int:
        """A fresh request id."""
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(self, frames: bytes) -> None:
        """Send encoded frames."""
        try:
            self._sock.sendall(frames)
        except OSError as e:
            raise DirectReadError(f"bookie {self.address}: send failed: {e}") from None

    def receive(self, request_id: int) -> Any:
        """The next answer, which must answer ``request_id`` (answers come in order)."""
        while not self._ready:
            try:
                chunk = self._sock.recv(1 << 20)
            except OSError as e:  # socket.timeout is an OSError
                raise DirectReadError(f"bookie {self.address}: receive failed: {e}") from None
            if not chunk:
                raise DirectReadError(f"bookie {self.address} closed the connection")
            self._decoder.receive_data(chunk)
            self._ready.extend(self._decoder.drain())
            if not self._ready and self._decoder.error is not None:
                raise DirectReadError(f"bookie {self.address}: {self._decoder.error}")
        answer = self._ready.popleft()
        if answer.request_id != request_id:
            raise DirectReadError(
                f"bookie {self.address} answered request {answer.request_id}, expected {request_id}"
            )
        return answer

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self._sock.close()


class DirectLedgerReader:
    """Reads entry ranges of ledgers from bookies (module rules); one connection per bookie."""

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        connect: Connect = tcp_connect,
        window: int = DEFAULT_WINDOW,
        range_entries: int = DEFAULT_RANGE_ENTRIES,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        max_frame_size: int | None = None,
    ) -> None:
        if window < 1 or range_entries < 1 or range_bytes < 1:
            raise ValueError("window, range_entries and range_bytes must be positive")
        self.timeout = timeout
        self._connect = connect
        self.window = window
        self.range_entries = range_entries
        wire = _wire()
        max_frame_size = max_frame_size or wire.DEFAULT_MAX_FRAME_SIZE
        # An answer must fit in a frame the decoder accepts.
        self.range_bytes = min(range_bytes, max_frame_size - wire.FRAME_OVERHEAD)
        self.max_frame_size = max_frame_size
        self._conns: dict[str, BookieConnection] = {}
        self.failures: list[str] = []  # why bookies were given up on, in order

    def __enter__(self) -> DirectLedgerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection."""
        conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()

    def _conn(self, address: str) -> BookieConnection:
        c = self._conns.get(address)
        if c is None:
            c = BookieConnection(
                address,
                timeout=self.timeout,
                connect=self._connect,
                max_frame_size=self.max_frame_size,
            )
            self._conns[address] = c
        return c

    def _drop(self, address: str, why: str) -> None:
        self.failures.append(f"{address}: {why}")
        c = self._conns.pop(address, None)
        if c is not None:
            c.close()

    def read(self, layout: LedgerLayout, first: int, last: int) -> Iterator[tuple[int, bytes]]:
        """Yield ``(entry id, data)`` for entries ``first..last`` inclusive, in order.

        The caller guarantees these entries exist and can no longer change (Rule 1)."""
        if first < 0 or last < first:
            return
        entry = first
        while entry <= last:
            _, nxt, _ = layout.fragment_of(entry)
            stop = last if nxt is None else min(last, nxt - 1)
            if layout.ensemble_size == layout.write_quorum:
                yield from self._read_fragment(layout, entry, stop)
            else:
                yield from self._read_striped(layout, entry, stop)
            entry = stop + 1

    def _read_fragment(
        self, layout: LedgerLayout, first: int, last: int
    ) -> Iterator[tuple[int, bytes]]:
        """Entries of one fragment whose every bookie holds them all (E == Qw)."""
        bookies = list(layout.write_set(first))
        # Spread readers of different ledgers over the replicas.
        k = layout.ledger_id % len(bookies)
        bookies = bookies[k:] + bookies[:k]
        entry = first
        for address in bookies:
            try:
                for e, data in self._ranges(address, layout.ledger_id, entry, last):
                    yield e, data
                    entry = e + 1
                return
            except DirectReadError as e:
                self._drop(address, str(e))
        raise DirectReadError(
            f"ledger {layout.ledger_id}: entries {entry}..{last} unreadable on {bookies}: "
            + "; ".join(self.failures[-len(bookies) :])
        )

    def _ranges(
        self, address: str, ledger_id: int, first: int, last: int
    ) -> Iterator[tuple[int, bytes]]:
        """Pipelined range reads of ``first..last`` on one bookie (raises DirectReadError)."""
        wire = _wire()
        request, response, ok = wire.ReadRangeRequest, wire.ReadRangeResponse, wire.Status.OK
        conn = self._conn(address)
        pending: deque[tuple[int, int, int]] = deque()  # (request id, first, last) in flight
        asked = first  # the first entry not asked for yet
        expected = first  # the next entry to hand out
        # Entries per request: a few at first, then as many as fit the byte budget (a request
        # the bookie cuts short costs the answers asked for after it).
        per_request = min(self.range_entries, 8)
        try:
            while expected <= last:
                while len(pending) < self.window and asked <= last:
                    stop = min(last, asked + per_request - 1)
                    rid = conn.request_id()
                    conn.send(request(rid, ledger_id, asked, stop, self.range_bytes).encode())
                    pending.append((rid, asked, stop))
                    asked = stop + 1
                rid, lo, hi = pending.popleft()
                answer = conn.receive(rid)
                if not isinstance(answer, response):
                    raise DirectReadError(f"bookie {address}: unexpected answer {type(answer)}")
                if answer.status != ok:
                    raise DirectReadError(
                        f"ledger {ledger_id} {lo}..{hi}: {answer.status.name} {answer.message}"
                    )
                got = size = 0
                for e, raw in answer.entries:
                    if e != expected or e > hi:
                        raise DirectReadError(f"ledger {ledger_id}: entry {e} where {expected} due")
                    size += len(raw)
                    yield e, decode_record(ledger_id, e, raw)
                    expected += 1
                    got += 1
                if got == 0:
                    raise DirectReadError(f"ledger {ledger_id}: empty answer for {lo}..{hi}")
                fit = int(self.range_bytes * 0.75 * got / max(size, 1))
                per_request = max(1, min(self.range_entries, fit))
                if expected <= hi:
                    # Cut at the byte budget: drop the answers asked for beyond it and ask again
                    # from the first entry missing, in order.
                    for p_rid, _, _ in pending:
                        stale = conn.receive(p_rid)
                        del stale
                    pending.clear()
                    asked = expected
        finally:
            if pending:
                # Abandoned (or failed) with answers in flight: the connection is out of step.
                c = self._conns.pop(address, None)
                if c is not None:
                    c.close()

    def _read_striped(
        self, layout: LedgerLayout, first: int, last: int
    ) -> Iterator[tuple[int, bytes]]:
        """Entries of one fragment of a striped ledger (E > Qw), by chunks of strided reads
        (Rule 5)."""
        size = layout.ensemble_size
        entry = first
        while entry <= last:
            stop = min(last, entry + size * self.range_entries - 1)
            got: dict[int, bytes] = {}
            while entry <= stop:
                starts = _wire().stride_starts(entry, stop, size, got)
                for start in self._strided_round(layout, starts, stop, got):
                    got[start] = self._read_one(layout, start)
                while entry <= stop and entry in got:
                    yield entry, got.pop(entry)
                    entry += 1

    def _strided_round(
        self, layout: LedgerLayout, starts: list[int], stop: int, got: dict[int, bytes]
    ) -> list[int]:
        """One strided request per residue start (up to ``stop``), each to the first bookie
        of the residue's write set that connects and speaks version 3; verified entries go to
        ``got``. Return the starts no answer gave."""
        wire = _wire()
        size, ledger_id = layout.ensemble_size, layout.ledger_id
        budget = max(1, self.range_bytes // size)
        asked: list[tuple[BookieConnection, int, int]] = []
        missed: list[int] = []
        for start in starts:
            for address in layout.write_set(start):
                try:
                    conn = self._conn(address)
                    if conn.version < wire.STRIDE_READ_VERSION:
                        continue
                    rid = conn.request_id()
                    req = wire.ReadRangeRequest(rid, ledger_id, start, stop, budget, size)
                    conn.send(req.encode())
                    asked.append((conn, rid, start))
                    break
                except DirectReadError as e:
                    self._drop(address, str(e))
            else:
                missed.append(start)
        for conn, rid, start in asked:
            try:
                answer = conn.receive(rid)
                if (
                    not isinstance(answer, wire.ReadRangeResponse)
                    or answer.status != wire.Status.OK
                ):
                    raise DirectReadError(f"ledger {ledger_id} {start}..{stop}: {answer!r}"[:300])
                for expected, (e, raw) in zip(
                    range(start, stop + 1, size), answer.entries, strict=False
                ):
                    if e != expected:
                        break
                    got[e] = decode_record(ledger_id, e, raw)
            except DirectReadError as e:
                self._drop(conn.address, str(e))
            if start not in got:
                missed.append(start)
        return missed

    def _read_one(self, layout: LedgerLayout, entry_id: int) -> bytes:
        """One entry of a striped ledger (E > Qw), replica after replica."""
        wire = _wire()
        errors = []
        for address in layout.write_set(entry_id):
            try:
                conn = self._conn(address)
                rid = conn.request_id()
                conn.send(wire.ReadRequest(rid, layout.ledger_id, entry_id).encode())
                answer = conn.receive(rid)
                if not isinstance(answer, wire.ReadResponse) or answer.status != wire.Status.OK:
                    raise DirectReadError(f"entry {layout.ledger_id}:{entry_id}: {answer!r}"[:300])
                return decode_record(layout.ledger_id, entry_id, answer.data)
            except DirectReadError as e:
                errors.append(str(e))
                self._drop(address, str(e))
        raise DirectReadError(
            f"entry {layout.ledger_id}:{entry_id} unreadable: " + "; ".join(errors)
        )


def layouts_from_stats(
    ledgers: Sequence[dict[str, Any]], *, open_ledgers: bool = False
) -> dict[int, LedgerLayout]:
    """The layouts of the sealed ledgers in an ``internalStats?metadata=true`` ledger list, and
    with ``open_ledgers`` those of open ledgers that name their fragments too (whose entries up
    to the last add confirmed can no longer change either: Rule 1)."""
    out: dict[int, LedgerLayout] = {}
    for info in ledgers:
        if not info.get("sealed") and not (open_ledgers and info.get("fragments")):
            continue
        fragments = tuple(
            (int(f["firstEntryId"]), tuple(str(b) for b in f["bookies"]))
            for f in info.get("fragments", ())
        )
        out[int(info["ledgerId"])] = LedgerLayout(
            int(info["ledgerId"]),
            int(info["ensembleSize"]),
            int(info["writeQuorumSize"]),
            fragments,
        )
    return out


__all__ = [
    "BookieConnection",
    "DirectLedgerReader",
    "DirectReadError",
    "FrameError",
    "LedgerLayout",
    "decode_record",
    "layouts_from_stats",
    "tcp_connect",
]
