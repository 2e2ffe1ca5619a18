"""``BookKeeperClient``: ledgers replicated over bookies (the ``LedgerClient`` of ``ledger.api``).

Rule 1 (I11): entry e goes to ``write_set(e)``; its add completes once Qa bookies of that write set
        acknowledged it and every lower entry completed. The LAC is the highest completed entry and
        rides on every add sent after it (I12).
Rule 2 (I12): each entry is stored as a record ``version, lac, cumulative length, crc32c`` + data;
        the checksum covers the ledger id and entry id too, so a corrupt or misplaced entry is
        refused (``DigestMismatchError``) and read from another replica.
Rule 3 (I18, I20, I21): a failed (or timed out) bookie is replaced by one outside the ensemble in a
        new fragment starting at LAC+1, recorded by compare-and-set before anything is sent to the
        replacement; adds complete no further while the change runs, then the outstanding adds of
        the failed bookie are re-sent to its replacement. A bookie failing an add that already
        completed is replaced too. A bookie that failed the writer is not chosen again by it for
        ``failed_bookie_quarantine_s`` (a dead bookie stays listed until its registration
        expires; one that came back is taken again after that). A lost CAS is re-read: a
        ledger no longer OPEN means a recovery fenced it (``LedgerFencedError``). No spare
        bookie: ``NotEnoughBookiesError`` for the pending adds and every later one.
Rule 4 (I15, I16, I19): a recovery open moves the metadata to IN_RECOVERY, fences Qw-Qa+1 bookies
        of every write set of the last ensemble, reads forward with fencing reads from
        max(LAC seen, first entry of the last fragment - 1) until Qw-Qa+1 bookies lack an entry,
        re-writes each entry found to its whole write set (replacing, by CAS, bookies that cannot
        take them) and closes the ledger at the last one (CAS), so the end covers every entry any
        writer had acknowledged.
Rule 5: nothing waits forever: adds are checked against ``add_timeout_s`` by one sweep timer
        looking at the oldest pending add only, and every other bookie request has a timeout.
"""

from __future__ import annotations

import json
import logging
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import crc32c
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, fail, succeed
from twisted.python.failure import Failure
from typing_extensions import override

from polybroker.ledger.api import (
    BookieClient,
    BookieError,
    BookieProtocolError,
    BookieUnavailableError,
    DigestMismatchError,
    FenceResult,
    LedgerClient,
    LedgerClosedError,
    LedgerConfig,
    LedgerFencedError,
    LedgerMetadata,
    LedgerState,
    NoSuchEntryError,
    NoSuchLedgerError,
    ReadHandle,
    ReadResult,
    StorageError,
    WriteHandle,
    WriteListener,
)
from polybroker.ledger.placement import choose_ensemble, replace_bookies
from polybroker.ledger.registry import BookieRegistry, tcp_connector
from polybroker.ledger.wire import ADD_FIELDS_SIZE, RECORD_HEAD, RECORD_HEAD_SIZE, stride_starts
from polybroker.metadata.api import BadVersionError, MetadataStore

__all__ = ["BookKeeperClient", "decode_metadata", "encode_metadata", "tcp_connector"]

log = logging.getLogger(__name__)

LEDGERS_PATH = "/ledgers"
_ID_PREFIX = "/ledger-ids/id-"

_RECORD = struct.Struct(">BqQI")  # version, lac, cumulative length, crc32c
_DIGEST = struct.Struct(">QqqQ")  # ledger id, entry id, lac, cumulative length
_RECORD_VERSION = 1
# The bookie wire's ADD record around our record: record head, ADD fields, our record header.
_WIRE_HEAD = RECORD_HEAD
_WIRE_MID = struct.Struct(">QqqBBqQI")  # ledger, entry, lac, flags; version, lac, length, crc
_WIRE_PREFIX = RECORD_HEAD_SIZE + ADD_FIELDS_SIZE  # bytes of a wire record before our record
_WIRE_OVERHEAD = RECORD_HEAD_SIZE + _WIRE_MID.size  # a wire record's bytes besides prefix, data
_WIRE_HEAD_PACK, _WIRE_MID_PACK, _DIGEST_PACK = _WIRE_HEAD.pack, _WIRE_MID.pack, _DIGEST.pack
_crc32c = crc32c.crc32c
_READ_RANGE_BYTES = 4 * 1024 * 1024
_RECOVERY_WINDOW = 64  # recovery reads this many entries ahead of the one it decides on
_CAS_ATTEMPTS = 5
_MAX_METADATA_BYTES = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Entry records and metadata encoding
# ---------------------------------------------------------------------------------------------


def encode_record(ledger_id: int, entry_id: int, lac: int, length: int, data: bytes) -> bytes:
    """Wrap ``data`` in the digest-protected record stored on bookies (Rule 2)."""
    crc = crc32c.crc32c(data, crc32c.crc32c(_DIGEST.pack(ledger_id, entry_id, lac, length)))
    return _RECORD.pack(_RECORD_VERSION, lac, length, crc) + data


def encode_wire_parts(
    ledger_id: int, entry_id: int, lac: int, length: int, data: bytes, prefix: bytes = b""
) -> tuple[bytes, bytes, bytes]:
    """``encode_wire_record`` as its parts ``(record head, ADD fields + our record header +
    prefix, data)``, ``_WIRE_OVERHEAD + len(prefix) + len(data)`` bytes in all: the data is not
    copied here, only into the frame that carries it."""
    crc32 = crc32c.crc32c
    # The short fields and the prefix are summed joined: one call instead of two.
    digest = crc32(_DIGEST.pack(ledger_id, entry_id, lac, length) + prefix)
    body = (
        _WIRE_MID.pack(
            ledger_id, entry_id, lac, 0, _RECORD_VERSION, lac, length, crc32(data, digest)
        )
        + prefix
    )
    return _WIRE_HEAD.pack(len(body) + len(data), crc32(data, crc32(body))), body, data


def encode_wire_record(
    ledger_id: int, entry_id: int, lac: int, length: int, data: bytes, prefix: bytes = b""
) -> bytes:
    """``encode_record`` of ``prefix + data`` inside the bookie wire's ADD record
    (``wire.encode_add_record``)."""
    return b"".join(encode_wire_parts(ledger_id, entry_id, lac, length, data, prefix))


def decode_record(ledger_id: int, entry_id: int, raw: bytes) -> tuple[bytes, int, int]:
    """Return (data, lac, cumulative length) of a stored record; ``DigestMismatchError`` if the
    record is malformed or does not belong to ``ledger_id:entry_id``."""
    if len(raw) < _RECORD.size:
        raise DigestMismatchError(f"{ledger_id}:{entry_id}: record of {len(raw)} bytes is short")
    version, lac, length, crc = _RECORD.unpack_from(raw)
    if version != _RECORD_VERSION:
        raise DigestMismatchError(f"{ledger_id}:{entry_id}: unknown record version {version}")
    data = raw[_RECORD.size :]
    if lac < -1 or lac >= entry_id or length < len(data):
        raise DigestMismatchError(f"{ledger_id}:{entry_id}: impossible lac {lac}/length {length}")
    expected = crc32c.crc32c(data, crc32c.crc32c(_DIGEST.pack(ledger_id, entry_id, lac, length)))
    if expected != crc:
        raise DigestMismatchError(f"{ledger_id}:{entry_id}: checksum mismatch")
    return data, lac, length


def encode_metadata(meta: LedgerMetadata) -> bytes:
    """Serialise ledger metadata as JSON (what ``/ledgers/<id>`` holds)."""
    doc = {
        "ledger_id": meta.ledger_id,
        "ensemble_size": meta.ensemble_size,
        "write_quorum": meta.write_quorum,
        "ack_quorum": meta.ack_quorum,
        "state": meta.state.value,
        "last_entry_id": meta.last_entry_id,
        "length": meta.length,
        "fragments": [[first, list(ensemble)] for first, ensemble in meta.fragments],
        "ctime_ms": meta.ctime_ms,
        "custom": dict(meta.custom),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _int(doc: dict[str, Any], key: str, low: int) -> int:
    value = doc.get(key)
    if type(value) is not int or value < low:
        raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def decode_metadata(raw: bytes) -> LedgerMetadata:
    """Parse what ``encode_metadata`` wrote; ``StorageError`` on anything malformed."""
    try:
        if len(raw) > _MAX_METADATA_BYTES:
            raise ValueError(f"{len(raw)} bytes")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        e, qw, qa = (_int(doc, k, 1) for k in ("ensemble_size", "write_quorum", "ack_quorum"))
        if not e >= qw >= qa:
            raise ValueError(f"E={e} Qw={qw} Qa={qa}")
        fragments: list[tuple[int, tuple[str, ...]]] = []
        for item in doc.get("fragments", []):
            first, ensemble = item
            if type(first) is not int or first < 0 or (fragments and first <= fragments[-1][0]):
                raise ValueError(f"fragment start {first!r}")
            if (
                not isinstance(ensemble, list)
                or len(ensemble) != e
                or not all(isinstance(a, str) for a in ensemble)
                or len(set(ensemble)) != e
            ):
                raise ValueError(f"ensemble {ensemble!r}")
            fragments.append((first, tuple(ensemble)))
        if not fragments or fragments[0][0] != 0:
            raise ValueError("the first fragment must start at entry 0")
        custom = doc.get("custom", {})
        if not isinstance(custom, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in custom.items()
        ):
            raise ValueError("custom must map strings to strings")
        return LedgerMetadata(
            ledger_id=_int(doc, "ledger_id", 0),
            ensemble_size=e,
            write_quorum=qw,
            ack_quorum=qa,
            state=LedgerState(doc.get("state")),
            last_entry_id=_int(doc, "last_entry_id", -1),
            length=_int(doc, "length", 0),
            fragments=tuple(fragments),
            ctime_ms=_int(doc, "ctime_ms", 0),
            custom=custom,
        )
    except (ValueError, TypeError, KeyError) as e:
        raise StorageError(f"malformed ledger metadata: {e}") from None


def _path(ledger_id: int) -> str:
    return f"{LEDGERS_PATH}/{ledger_id}"


# ---------------------------------------------------------------------------------------------
# Small Deferred helpers
# ---------------------------------------------------------------------------------------------


def _timeout_error(failure: Failure, what: str, seconds: float) -> Failure:
    if failure.check(CancelledError, TimeoutError):
        return Failure(BookieUnavailableError(f"{what} timed out after {seconds}s"))
    return failure


def _gather_all(ds: Sequence[Deferred[Any]]) -> Deferred[list[tuple[bool, Any]]]:
    """Fire with (ok, result-or-Failure) of every Deferred once all fired; never errbacks."""
    out: Deferred[list[tuple[bool, Any]]] = Deferred()
    results: list[tuple[bool, Any]] = [(False, None)] * len(ds)
    left = [len(ds)]
    if not ds:
        out.callback(results)
        return out

    def done(value: Any, i: int, ok: bool) -> None:
        results[i] = (ok, value)
        left[0] -= 1
        if left[0] == 0:
            out.callback(results)

    for i, d in enumerate(ds):
        d.addCallbacks(done, done, callbackArgs=(i, True), errbackArgs=(i, False))
    return out


# ---------------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------------


class _ReadHandle(ReadHandle):
    """Reads of one ledger, up to the LAC (see ``ReadHandle``)."""

    def __init__(
        self, client: BookKeeperClient, metadata: LedgerMetadata, version: int, lac: int
    ) -> None:
        self._client = client
        self.ledger_id = metadata.ledger_id
        self._metadata = metadata
        self._version = version
        self._lac = lac

    @property
    @override
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    @override
    def last_add_confirmed(self) -> int:
        return self._lac

    @override
    def read(self, first_entry_id: int, last_entry_id: int) -> Deferred[list[bytes]]:
        if first_entry_id < 0 or first_entry_id > last_entry_id or last_entry_id > self._lac:
            return fail(
                NoSuchEntryError(
                    f"ledger {self.ledger_id}: entries {first_entry_id}..{last_entry_id} are "
                    f"not all confirmed (LAC {self._lac})"
                )
            )
        return self._client._read_entries(self._metadata, first_entry_id, last_entry_id)

    @override
    def read_last_add_confirmed(self) -> Deferred[int]:
        if self._metadata.state is LedgerState.CLOSED:
            return succeed(self._lac)
        return Deferred.fromCoroutine(self._refresh_lac())

    async def _refresh_lac(self) -> int:
        # The LAC is asked before the metadata is read again: a fragment is recorded before any
        # of its entries is sent, so the metadata read afterwards covers every entry <= LAC.
        client = self._client
        lac: int | None
        try:
            lac = await client._read_lac(self._metadata)
        except BookieError:
            lac = None  # the ensemble may have moved on: the metadata says where
        self._metadata, self._version = await client._get(self.ledger_id)
        if self._metadata.state is LedgerState.CLOSED:
            lac = self._metadata.last_entry_id
        elif lac is None:
            lac = await client._read_lac(self._metadata)
        self._lac = max(self._lac, lac)
        return self._lac

    @override
    def close(self) -> Deferred[None]:
        return succeed(None)


AddDone = Callable[[int, Any, "WriteHandle"], None]
AddFailed = Callable[[Exception, Any, "WriteHandle"], None]


def _fire(entry_id: int, d: Deferred[int], _: WriteHandle) -> None:
    d.callback(entry_id)


def _fire_error(error: Exception, d: Deferred[int], _: WriteHandle) -> None:
    d.errback(error)


# One add not yet completed, and whom to tell when it is: a list indexed by these (a list is
# made several times faster than an object, and there is one per entry).
_RECORD_PARTS = 0  # the record as the bookies take it (``encode_wire_parts``)
_SIZE = 1  # of the record
_LENGTH = 2  # cumulative bytes through this entry
_SENT_AT = 3  # when it was (last) sent
_ON_DONE = 4  # AddDone, or None: ``_TOKEN`` is a ``WriteListener`` told once per run
_ON_FAILED = 5
_TOKEN = 6
_ACKED = 7  # the bookies that acknowledged it: a tuple (a few at most), so an add makes no set
_WRITE_SET = 8  # where it was sent; None: not sent yet (an ensemble change runs)
_PendingAdd = list[Any]  # [record, size, length, sent at, on_done, on_failed, token, acked, ws]


class _WriteHandle(_ReadHandle, WriteHandle):
    """The single writer of a ledger (Rules 1, 3, 5)."""

    def __init__(self, client: BookKeeperClient, metadata: LedgerMetadata, version: int) -> None:
        super().__init__(client, metadata, version, -1)
        self._qa = metadata.ack_quorum
        self._reactor = client._reactor
        self._timeout = client._add_timeout_s
        self._next = 0
        self._sent_length = 0
        self._length = 0
        self._pending: dict[int, _PendingAdd] = {}
        self._error: Exception | None = None
        self._closing = False
        self._close_d: Deferred[None] | None = None
        self._sealing = False
        self._changing = False
        self._to_replace: set[str] = set()
        # Bookies that failed this writer, and when (Rule 3).
        self._failed_bookies: dict[str, float] = {}
        self._sweep_call: Any = None
        self._write_sets = self._last_write_sets(metadata)
        self._ensemble_size = metadata.ensemble_size
        # Every write set is the whole ensemble: each add goes to every bookie of it.
        self._whole_ensemble = metadata.ensemble_size == metadata.write_quorum
        self._seconds = self._reactor.seconds
        #: True while ``_complete`` runs the callbacks of a group of adds the bookies
        #: acknowledged together; ``after_completions`` (if set) is called once after the group,
        #: so a caller can act once per group instead of once per entry.
        self.completing = False
        self.after_completions: Callable[[], None] | None = None

    @staticmethod
    def _last_write_sets(meta: LedgerMetadata) -> tuple[tuple[str, ...], ...]:
        """The E write sets of the last fragment, where every pending add lives (by e mod E)."""
        first, e = meta.fragments[-1][0], meta.ensemble_size
        return tuple(meta.write_set(first + (i - first) % e) for i in range(e))

    @property
    @override
    def length(self) -> int:
        return self._length

    @override
    def read_last_add_confirmed(self) -> Deferred[int]:
        return succeed(self._lac)  # the writer is the authority on its own LAC

    # -- adds --------------------------------------------------------------------------------

    @override
    def append(self, data: bytes) -> Deferred[int]:
        d: Deferred[int] = Deferred()
        self.append_then(data, _fire, _fire_error, d)
        return d

    def append_then(self, data: bytes, on_done: AddDone, on_failed: AddFailed, token: Any) -> None:
        """``append`` without a Deferred: exactly one of ``on_done(entry_id, token, self)`` and
        ``on_failed(error, token, self)`` is called, completions in entry order (an add refused
        at once is failed before this returns)."""
        if self._error is not None:
            on_failed(self._error, token, self)
            return
        if self._closing:
            on_failed(LedgerClosedError(f"ledger {self.ledger_id} is closed"), token, self)
            return
        self._add(data, on_done, on_failed, token)

    @override
    def append_quiet(self, data: bytes, listener: WriteListener, prefix: bytes = b"") -> None:
        if self._error is not None:
            listener.adds_failed(self, self._error)
            return
        if self._closing:
            listener.adds_failed(self, LedgerClosedError(f"ledger {self.ledger_id} is closed"))
            return
        # ``_add``, ``encode_wire_parts`` and ``_send`` inlined (the hot path); on_done None:
        # the token is a listener told once per run of completions.
        entry_id = self._next
        self._next = entry_id + 1
        size = len(prefix) + len(data)
        length = self._sent_length = self._sent_length + size
        ledger_id, lac, crc32 = self.ledger_id, self._lac, _crc32c
        body = (
            _WIRE_MID_PACK(
                ledger_id,
                entry_id,
                lac,
                0,
                _RECORD_VERSION,
                lac,
                length,
                crc32(data, crc32(_DIGEST_PACK(ledger_id, entry_id, lac, length) + prefix)),
            )
            + prefix
        )
        record = (_WIRE_HEAD_PACK(len(body) + len(data), crc32(data, crc32(body))), body, data)
        size += _WIRE_OVERHEAD
        ws = None if self._changing else self._write_sets[entry_id % self._ensemble_size]
        p = [record, size, length, self._seconds(), None, None, listener, (), ws]
        self._pending[entry_id] = p
        if ws is not None:
            senders = self._client._batched
            for address in ws:
                batched = senders.get(address)
                if batched is not None:
                    batched(ledger_id, entry_id, record, size, self)
                else:
                    self._send_other(entry_id, p, address, lac)
        if self._sweep_call is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval(), self._sweep)

    @override
    def append_quiet_many(
        self,
        datas: Sequence[bytes],
        listener: WriteListener,
        prefixes: Sequence[bytes] | None = None,
    ) -> None:
        pending, encode, seconds = self._pending, encode_wire_parts, self._seconds
        if prefixes is None:
            prefixes = [b""] * len(datas)
        for data, prefix in zip(datas, prefixes, strict=True):
            # ``append_quiet``'s body; the state is read afresh for every entry, as a send
            # may fail at once and start an ensemble change or fail the ledger.
            if self._error is not None or self._closing:
                error = self._error or LedgerClosedError(f"ledger {self.ledger_id} is closed")
                listener.adds_failed(self, error)
                return
            entry_id = self._next
            self._next = entry_id + 1
            size = len(prefix) + len(data)
            length = self._sent_length = self._sent_length + size
            p = [
                encode(self.ledger_id, entry_id, self._lac, length, data, prefix),
                size + _WIRE_OVERHEAD,
                length,
                seconds(),
                None,
                None,
                listener,
                (),
                None,
            ]
            pending[entry_id] = p
            if not self._changing:
                p[_WRITE_SET] = ws = self._write_sets[entry_id % self._ensemble_size]
                self._send(entry_id, p, ws)
        if self._sweep_call is None and pending:
            self._sweep_call = self._reactor.callLater(self._sweep_interval(), self._sweep)

    def _add(
        self, data: bytes, on_done: AddDone | None, on_failed: AddFailed | None, token: Any
    ) -> None:
        entry_id = self._next
        self._next = entry_id + 1
        length = self._sent_length = self._sent_length + len(data)
        record = encode_wire_parts(self.ledger_id, entry_id, self._lac, length, data)
        size = len(data) + _WIRE_OVERHEAD
        p = [record, size, length, self._seconds(), on_done, on_failed, token, (), None]
        self._pending[entry_id] = p
        if not self._changing:
            p[_WRITE_SET] = ws = self._write_sets[entry_id % self._ensemble_size]
            self._send(entry_id, p, ws)
        if self._sweep_call is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval(), self._sweep)

    def _send(self, entry_id: int, p: _PendingAdd, targets: Sequence[str]) -> None:
        senders, lac = self._client._batched, self._lac
        for address in targets:
            batched = senders.get(address)
            if batched is not None:
                batched(self.ledger_id, entry_id, p[_RECORD_PARTS], p[_SIZE], self)
            else:
                self._send_other(entry_id, p, address, lac)

    def _send_other(self, entry_id: int, p: _PendingAdd, address: str, lac: int) -> None:
        """``_send`` to a bookie whose batched sender is not known yet, or that has none (``lac``
        as the send began: an add answered at once may move the handle's)."""
        ledger_id = self.ledger_id
        if address not in self._client._batched:
            batched = self._client._batched_sender(address)
            if batched is not None:
                batched(ledger_id, entry_id, p[_RECORD_PARTS], p[_SIZE], self)
                return
        data = b"".join(p[_RECORD_PARTS])[_WIRE_PREFIX:]
        self._client._bookie(address).add_entry(ledger_id, entry_id, lac, data).addCallbacks(
            self._acked,
            self._add_failed,
            callbackArgs=(entry_id, address),
            errbackArgs=(entry_id, address),
        )

    # The listener of batched adds (``TcpBookieClient.add_parts_batched``).

    def entries_acked(self, address: str, entry_ids: Sequence[int]) -> None:
        """A bookie journaled these entries."""
        if (
            self._qa == 1
            and not self._changing
            and self._error is None
            and self._whole_ensemble
            and entry_ids
            and entry_ids[0] <= self._lac + 1 <= entry_ids[-1]
            and entry_ids[-1] - entry_ids[0] == len(entry_ids) - 1
            and address in self._write_sets[0]
        ):
            # The common answer: Qa 1, every write set the whole ensemble (so every pending
            # add was sent to this bookie), and a run of entries holding the next to complete:
            # they complete as they are, without recording who acknowledged them first.
            self._complete(entry_ids[-1])
            return
        get = self._pending.get
        for entry_id in entry_ids:
            p = get(entry_id)
            if p is not None:
                ws = p[_WRITE_SET]
                if ws is not None and address in ws:
                    acked = p[_ACKED]
                    if not acked:
                        p[_ACKED] = (address,)
                    elif address not in acked:
                        p[_ACKED] = (*acked, address)
        if not self._changing:
            p = get(self._lac + 1)
            if p is not None and len(p[_ACKED]) >= self._qa:
                self._complete()

    def entries_failed(self, address: str, entry_ids: Sequence[int], error: BookieError) -> None:
        """A bookie failed these entries."""
        failure = Failure(error)
        for entry_id in entry_ids:
            self._add_failed(failure, entry_id, address)

    def _acked(self, _: object, entry_id: int, address: str) -> None:
        p = self._pending.get(entry_id)
        if p is None or p[_WRITE_SET] is None or address not in p[_WRITE_SET]:
            return  # completed or failed already, or an answer of a replaced bookie
        if address not in p[_ACKED]:
            p[_ACKED] = (*p[_ACKED], address)
        if entry_id == self._lac + 1 and len(p[_ACKED]) >= self._qa and not self._changing:
            self._complete()

    def _complete(self, acked_through: int = -1) -> None:
        """Complete the adds that can be, in order; those numbered up to ``acked_through``
        count as acknowledged by an ack quorum whatever their ``_ACKED`` says."""
        pending, qa = self._pending, self._qa
        # Listener-style adds (``append_quiet``) are reported once per run of completions.
        run: Any = None
        self.completing = True
        try:
            while True:
                lac = self._lac + 1
                p = pending.get(lac)
                if p is None or (lac > acked_through and len(p[_ACKED]) < qa):
                    break
                del pending[lac]
                self._lac = lac
                self._length = p[_LENGTH]
                if p[_ON_DONE] is None:
                    token = p[_TOKEN]
                    if run is not token:
                        if run is not None:
                            self._tell_done(run, lac - 1)
                        run = token
                    # The rest of this listener's run: nothing is told until it ends, so the
                    # handle's LAC and length are set once for it.
                    nxt = lac + 1
                    last = None
                    while True:
                        q = pending.get(nxt)
                        if q is None or q[_ON_DONE] is not None or q[_TOKEN] is not token:
                            break
                        if nxt > acked_through and len(q[_ACKED]) < qa:
                            break
                        del pending[nxt]
                        last = q
                        nxt += 1
                    if last is not None:
                        self._lac = nxt - 1
                        self._length = last[_LENGTH]
                    continue
                if run is not None:
                    self._tell_done(run, lac - 1)
                    run = None
                try:
                    p[_ON_DONE](lac, p[_TOKEN], self)
                except Exception:
                    # One caller's bug must not stop the completions of the others.
                    log.exception("ledger %d: add callback failed", self.ledger_id)
            if run is not None:
                self._tell_done(run, self._lac)
        finally:
            self.completing = False
        after = self.after_completions
        if after is not None:
            try:
                after()
            except Exception:
                log.exception("ledger %d: after-completions callback failed", self.ledger_id)
        if not pending and self._closing:
            self._seal()

    def _tell_done(self, listener: WriteListener, last_entry_id: int) -> None:
        try:
            listener.adds_done(self, last_entry_id)
        except Exception:
            log.exception("ledger %d: add listener failed", self.ledger_id)

    def _add_failed(self, failure: Failure, entry_id: int, address: str) -> None:
        if failure.check(LedgerFencedError):
            self._fail(LedgerFencedError(f"ledger {self.ledger_id} was fenced by a recovery"))
            return
        if failure.check(BookieProtocolError):
            # Every bookie would refuse this request: no ensemble change can help.
            self._fail(failure.value)  # type: ignore[arg-type]
            return
        p = self._pending.get(entry_id)
        if p is not None:
            if p[_WRITE_SET] is None or address not in p[_WRITE_SET]:
                return  # a replaced bookie's late answer
        elif self._error is not None or entry_id < self._metadata.fragments[-1][0]:
            return
        # A failure after the entry completed still replaces the bookie: it would otherwise
        # stay in the ensemble, silently holding fewer copies of every later entry.
        log.info(
            "ledger %d: bookie %s failed add %d: %s",
            self.ledger_id,
            address,
            entry_id,
            failure.getErrorMessage(),
        )
        self._replace(address)

    def _sweep_interval(self) -> float:
        return max(0.01, self._timeout / 4)

    def _sweep(self) -> None:
        """Replace the bookies that let the oldest pending add wait past the timeout."""
        self._sweep_call = None
        if not self._pending or self._error is not None:
            return
        p = self._pending.get(self._lac + 1)
        if (
            p is not None
            and p[_WRITE_SET] is not None
            and not self._changing
            and self._reactor.seconds() - p[_SENT_AT] >= self._timeout
        ):
            slow = [a for a in p[_WRITE_SET] if a not in p[_ACKED]]
            log.info("ledger %d: add %d timed out on %s", self.ledger_id, self._lac + 1, slow)
            for address in slow:
                self._replace(address)
        if self._pending and self._error is None:
            self._sweep_call = self._reactor.callLater(self._sweep_interval(), self._sweep)

    def _fail(self, error: Exception) -> None:
        """Fail every pending and later add with ``error`` (in entry order)."""
        if self._error is None:
            self._error = error
        pending = sorted(self._pending.items())
        self._pending.clear()
        told: Any = None  # the listener last told, so a run of its adds hears once
        for _, p in pending:
            try:
                if p[_ON_FAILED] is not None:
                    p[_ON_FAILED](self._error, p[_TOKEN], self)
                elif p[_TOKEN] is not told:
                    told = p[_TOKEN]
                    p[_TOKEN].adds_failed(self, self._error)
            except Exception:
                log.exception("ledger %d: add callback failed", self.ledger_id)
        if self._sweep_call is not None and self._sweep_call.active():
            self._sweep_call.cancel()
        self._sweep_call = None
        close_d, self._close_d = self._close_d, None
        if close_d is not None:
            close_d.errback(self._error)

    # -- ensemble change (Rule 3) ------------------------------------------------------------

    def _replace(self, address: str) -> None:
        self._to_replace.add(address)
        if not self._changing:
            self._change()

    def _change(self) -> None:
        if self._client._closed:
            self._to_replace.clear()
            self._fail(LedgerClosedError(f"ledger {self.ledger_id}: the ledger client is closed"))
            return
        ensemble = self._metadata.fragments[-1][1]
        failed = {a for a in self._to_replace if a in ensemble}
        self._to_replace.clear()
        if not failed or self._error is not None:
            return
        self._changing = True
        now = self._seconds()
        for address in failed:
            self._failed_bookies[address] = now
        self._client._registry.writable_bookies().addCallback(
            self._got_bookies, failed, 0
        ).addErrback(self._change_failed)

    def _got_bookies(self, available: list[str], failed: set[str], attempt: int) -> Any:
        if self._error is not None:
            return None
        meta = self._metadata
        first, ensemble = meta.fragments[-1]
        since = self._seconds() - self._client._quarantine_s
        shunned = [a for a, at in self._failed_bookies.items() if at > since]
        new_ensemble = replace_bookies(ensemble, failed, available, self._client._rng, shunned)
        start = self._lac + 1
        fragments = list(meta.fragments)
        if first >= start:
            fragments[-1] = (first, new_ensemble)  # no entry was completed in it: redo it
        else:
            fragments.append((start, new_ensemble))
        new_meta = replace(meta, fragments=tuple(fragments))
        log.info(
            "ledger %d: ensemble change at entry %d: %s -> %s",
            self.ledger_id,
            start,
            list(ensemble),
            list(new_ensemble),
        )

        def conflict(failure: Failure) -> Any:
            failure.trap(BadVersionError)
            return self._client._get(self.ledger_id).addCallback(reread)

        def reread(found: tuple[LedgerMetadata, int]) -> Any:
            current, version = found
            if current.state is not LedgerState.OPEN:
                raise LedgerFencedError(f"ledger {self.ledger_id} is {current.state.value}")
            if (
                [f for f, _ in current.fragments] != [f for f, _ in meta.fragments]
                or current.fragments[-1] != meta.fragments[-1]
                or attempt + 1 >= _CAS_ATTEMPTS
            ):
                raise LedgerFencedError(f"ledger {self.ledger_id}: another writer changed it")
            # Another field changed (custom metadata, or an earlier fragment the auditor
            # re-replicated): keep it, retry on its version.
            self._metadata, self._version = current, version
            return self._got_bookies(available, failed, attempt + 1)

        return (
            self._client._store.put(_path(self.ledger_id), encode_metadata(new_meta), self._version)
            .addCallback(lambda stat: self._changed(new_meta, stat.version))
            .addErrback(conflict)
        )

    def _changed(self, new_meta: LedgerMetadata, version: int) -> None:
        if self._error is not None:
            return
        self._metadata, self._version = new_meta, version
        self._write_sets = self._last_write_sets(new_meta)
        now = self._reactor.seconds()
        for entry_id in range(self._lac + 1, self._next):
            p = self._pending.get(entry_id)
            if p is None:
                continue
            new_ws = new_meta.write_set(entry_id)
            old_ws = p[_WRITE_SET]
            p[_SENT_AT] = now
            if old_ws is None:
                p[_WRITE_SET] = new_ws
                self._send(entry_id, p, new_ws)
                continue
            if old_ws == new_ws:
                continue
            p[_ACKED] = tuple(a for a in p[_ACKED] if a in new_ws)
            p[_WRITE_SET] = new_ws
            self._send(entry_id, p, [a for a in new_ws if a not in old_ws])
        self._changing = False
        if self._to_replace:
            self._change()
        if not self._changing:
            self._complete()

    def _change_failed(self, failure: Failure) -> None:
        self._changing = False
        error = failure.value
        if not isinstance(error, StorageError):
            error = BookieUnavailableError(f"ensemble change failed: {failure.getErrorMessage()}")
        log.warning("ledger %d: %s", self.ledger_id, error)
        self._fail(error)  # type: ignore[arg-type]

    # -- closing -----------------------------------------------------------------------------

    @override
    def close_ledger(self) -> Deferred[None]:
        if self._close_d is not None:
            return self._chain(self._close_d)
        if self._error is not None:
            if isinstance(self._error, LedgerClosedError):
                return succeed(None)
            return fail(self._error)
        self._closing = True
        self._close_d = Deferred()
        d = self._chain(self._close_d)
        if not self._pending:
            self._seal()
        return d

    @staticmethod
    def _chain(source: Deferred[None]) -> Deferred[None]:
        out: Deferred[None] = Deferred()

        def relay(result: Any) -> Any:
            if isinstance(result, Failure):
                out.errback(result)
            else:
                out.callback(result)
            return result

        source.addBoth(relay)
        source.addErrback(lambda _: None)  # consumed by ``out``
        return out

    def _seal(self) -> None:
        if self._close_d is None or self._error is not None or self._sealing or self._changing:
            return  # an ensemble change in flight seals when it is done
        self._sealing = True
        lac, length = self._lac, self._length

        def attempt(meta: LedgerMetadata, version: int, n: int) -> Deferred[None]:
            closed = replace(meta, state=LedgerState.CLOSED, last_entry_id=lac, length=length)
            return (
                self._client._store.put(_path(self.ledger_id), encode_metadata(closed), version)
                .addCallback(lambda stat: done(closed, stat.version))
                .addErrback(conflict, n)
            )

        def conflict(failure: Failure, n: int) -> Any:
            failure.trap(BadVersionError)
            return self._client._get(self.ledger_id).addCallback(reread, n)

        def reread(found: tuple[LedgerMetadata, int], n: int) -> Any:
            current, version = found
            if current.state is LedgerState.CLOSED and current.last_entry_id == lac:
                return done(current, version)  # a recovery closed it where we stand
            if current.state is not LedgerState.OPEN:
                raise LedgerFencedError(f"ledger {self.ledger_id} is {current.state.value}")
            if n + 1 >= _CAS_ATTEMPTS:
                raise LedgerFencedError(f"ledger {self.ledger_id}: metadata keeps changing")
            return attempt(current, version, n + 1)

        def done(meta: LedgerMetadata, version: int) -> None:
            self._metadata, self._version = meta, version
            self._error = LedgerClosedError(f"ledger {self.ledger_id} is closed")
            close_d, self._close_d = self._close_d, None
            if close_d is not None:
                close_d.callback(None)

        def failed(failure: Failure) -> None:
            self._fail(failure.value)  # type: ignore[arg-type]

        attempt(self._metadata, self._version, 0).addErrback(failed)


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


class BookKeeperClient(LedgerClient):
    """Creates, opens, recovers and deletes ledgers over bookies (see the module rules).

    ``connect`` is called lazily, once per bookie address; the clients it returns are cached and
    closed by ``close``."""

    def __init__(
        self,
        store: MetadataStore,
        registry: BookieRegistry,
        connect: Callable[[str], BookieClient],
        reactor: Any,
        *,
        add_timeout_s: float = 30.0,
        failed_bookie_quarantine_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        """``failed_bookie_quarantine_s``: how long a writer leaves out a bookie that failed it
        (Rule 3); at least the registry's session timeout, so that a dead bookie has left the
        registry by the time it would be a candidate again."""
        self._store = store
        self._registry = registry
        self._connect = connect
        self._reactor = reactor
        self._add_timeout_s = add_timeout_s
        self._quarantine_s = failed_bookie_quarantine_s
        self._rng = rng or random.Random()
        self._bookies: dict[str, BookieClient] = {}
        # Per bookie address: its ``add_parts_batched`` (None: it has only ``add_entry``).
        self._batched: dict[str, Any] = {}
        self._closed = False

    # -- plumbing ----------------------------------------------------------------------------

    def _bookie(self, address: str) -> BookieClient:
        client = self._bookies.get(address)
        if client is None:
            if self._closed:
                # Requests after close fail fast instead of opening new connections.
                return _ClosedBookie(address)
            client = self._bookies[address] = self._connect(address)
        return client

    def _batched_sender(self, address: str) -> Any:
        """The ``add_parts_batched`` of a bookie, or an adapter to its ``add_record_batched``
        (None if it has neither), kept until close."""
        bookie = self._bookie(address)
        sender = getattr(bookie, "add_parts_batched", None)
        if sender is None:
            by_record = getattr(bookie, "add_record_batched", None)
            if by_record is not None:

                def sender(
                    ledger_id: int, entry_id: int, parts: Any, _: int, listener: Any
                ) -> None:
                    by_record(ledger_id, entry_id, b"".join(parts), listener)

        if not self._closed:
            self._batched[address] = sender
        return sender

    def _timed(self, d: Deferred[Any], what: str) -> Deferred[Any]:
        seconds = self._add_timeout_s
        d.addTimeout(seconds, self._reactor)
        return d.addErrback(_timeout_error, what, seconds)

    def _get(self, ledger_id: int) -> Deferred[tuple[LedgerMetadata, int]]:
        def got(found: Any) -> tuple[LedgerMetadata, int]:
            if found is None:
                raise NoSuchLedgerError(f"no ledger {ledger_id}")
            return decode_metadata(found.value), found.stat.version

        return self._store.get(_path(ledger_id)).addCallback(got)

    # -- LedgerClient ------------------------------------------------------------------------

    @override
    def create(self, config: LedgerConfig) -> Deferred[WriteHandle]:
        return Deferred.fromCoroutine(self._create(config))

    async def _create(self, config: LedgerConfig) -> WriteHandle:
        if self._closed:
            raise LedgerClosedError("the ledger client is closed")
        available = await self._registry.writable_bookies()
        ensemble = choose_ensemble(available, config.ensemble_size, self._rng)
        path = await self._store.create_sequential(_ID_PREFIX, b"")
        ledger_id = int(path[len(_ID_PREFIX) :])
        # The sequence node only hands out the id: the store never reuses a suffix, even after
        # the node is deleted (the metadata contract's Rule 6).
        await self._store.delete(path)
        meta = LedgerMetadata(
            ledger_id=ledger_id,
            ensemble_size=config.ensemble_size,
            write_quorum=config.write_quorum,
            ack_quorum=config.ack_quorum,
            state=LedgerState.OPEN,
            last_entry_id=-1,
            length=0,
            fragments=((0, ensemble),),
            ctime_ms=int(self._reactor.seconds() * 1000),
            custom=dict(config.custom),
        )
        stat = await self._store.put(_path(ledger_id), encode_metadata(meta), expected_version=-1)
        return _WriteHandle(self, meta, stat.version)

    @override
    def open(self, ledger_id: int, *, recovery: bool = True) -> Deferred[ReadHandle]:
        return Deferred.fromCoroutine(self._open(ledger_id, recovery))

    async def _open(self, ledger_id: int, recovery: bool) -> ReadHandle:
        meta, version = await self._get(ledger_id)
        if meta.state is LedgerState.CLOSED:
            return _ReadHandle(self, meta, version, meta.last_entry_id)
        if not recovery:
            handle = _ReadHandle(self, meta, version, -1)
            try:
                await handle.read_last_add_confirmed()
            except BookieError as e:
                log.info("ledger %d: no LAC from its bookies yet: %s", ledger_id, e)
            return handle
        return await self._recover(meta, version)

    @override
    def delete(self, ledger_id: int) -> Deferred[None]:
        return Deferred.fromCoroutine(self._delete(ledger_id))

    async def _delete(self, ledger_id: int) -> None:
        meta, version = await self._get(ledger_id)
        # Metadata first (I24): a bookie may forget the data only once no metadata points at it.
        await self._store.delete(_path(ledger_id), version)
        bookies = dict.fromkeys(a for _, ensemble in meta.fragments for a in ensemble)
        results = await _gather_all(
            [
                self._timed(self._bookie(a).delete_ledger(ledger_id), f"delete on {a}")
                for a in bookies
            ]
        )
        for address, (ok, value) in zip(bookies, results, strict=True):
            if not ok and not value.check(NoSuchLedgerError):
                # The bookie's garbage collection reclaims it, as the metadata is gone.
                log.info("ledger %d: delete on %s: %s", ledger_id, address, value.getErrorMessage())

    @override
    def get_metadata(self, ledger_id: int) -> Deferred[LedgerMetadata]:
        return self._get(ledger_id).addCallback(lambda found: found[0])

    @override
    def storage_problem(self, ensemble_size: int) -> Deferred[str | None]:
        def judge(writable: list[str]) -> str | None:
            if len(writable) >= ensemble_size:
                return None
            n = len(writable)
            return f"writable bookies: {n} of the {ensemble_size} a new ledger needs {writable}"

        return self._registry.writable_bookies().addCallback(judge)

    @override
    def close(self) -> Deferred[None]:
        self._closed = True
        self._batched.clear()
        bookies, self._bookies = list(self._bookies.values()), {}
        return _gather_all([b.close() for b in bookies]).addCallback(lambda _: None)

    # -- reads -------------------------------------------------------------------------------

    def _read_one(
        self, meta: LedgerMetadata, entry_id: int, *, fence: bool = False
    ) -> Deferred[tuple[bytes, int, int]]:
        """Read one entry from its write set, replica after replica; (data, lac, length)."""
        ledger_id = meta.ledger_id
        write_set = meta.write_set(entry_id)
        out: Deferred[tuple[bytes, int, int]] = Deferred()
        errors: list[Failure] = []

        def attempt(i: int) -> None:
            if i == len(write_set):
                out.errback(_best_error(errors))
                return
            address = write_set[i]
            d = self._timed(
                self._bookie(address).read_entry(ledger_id, entry_id, fence=fence),
                f"read {ledger_id}:{entry_id} on {address}",
            )
            d.addCallback(lambda raw: decode_record(ledger_id, entry_id, raw))
            d.addCallbacks(out.callback, failed, errbackArgs=(i,))

        def failed(failure: Failure, i: int) -> None:
            errors.append(failure)
            attempt(i + 1)

        attempt(0)
        return out

    def _read_entries(self, meta: LedgerMetadata, first: int, last: int) -> Deferred[list[bytes]]:
        """Read first..last by range reads: of consecutive entries where every bookie of a
        fragment holds them all (E == Qw), strided where the ensemble stripes them (E > Qw)."""
        return Deferred.fromCoroutine(self._read_entries_async(meta, first, last))

    async def _read_entries_async(self, meta: LedgerMetadata, first: int, last: int) -> list[bytes]:
        # Within a fragment the entries of one residue modulo the stride share a write set, so
        # each residue is one read (the residues in parallel), not one read per entry; what a
        # read left out (its byte budget, a replica lacking it) is asked for again.
        stride = 1 if meta.ensemble_size == meta.write_quorum else meta.ensemble_size
        got: dict[int, bytes] = {}
        entry_id = first
        while entry_id <= last:
            end = _fragment_end(meta, entry_id, last)
            starts = stride_starts(entry_id, end, stride, got)
            # Each read gives at least its first entry, or raises: every round makes progress.
            for ok, value in await _gather_all(
                [Deferred.fromCoroutine(self._read_residue(meta, s, end, stride)) for s in starts]
            ):
                if not ok:
                    value.raiseException()
                got.update(value)
            while entry_id <= end and entry_id in got:
                entry_id += 1
        return [got[e] for e in range(first, last + 1)]

    async def _read_residue(
        self, meta: LedgerMetadata, start: int, end: int, stride: int
    ) -> dict[int, bytes]:
        """Entries start, start + stride, ... up to ``end`` (within one fragment): a verified
        prefix from the first replica that gives one, else read one by one (at least
        ``start``, or raise its error)."""
        ledger_id = meta.ledger_id
        for address in meta.write_set(start):
            try:
                results: list[ReadResult] = await self._timed(
                    self._bookie(address).read_range(
                        ledger_id, start, end, _READ_RANGE_BYTES // stride, stride
                    ),
                    f"read {ledger_id}:{start}..{end} by {stride} on {address}",
                )
            except BookieError as e:
                log.debug("ledger %d: range read on %s: %s", ledger_id, address, e)
                continue
            out: dict[int, bytes] = {}
            for expected, result in zip(range(start, end + 1, stride), results, strict=False):
                if result.entry_id != expected:
                    break
                try:
                    out[expected] = decode_record(ledger_id, expected, result.data)[0]
                except DigestMismatchError as e:
                    log.warning("ledger %d on %s: %s", ledger_id, address, e)
                    break
            if out:
                return out
        # No replica gave one (none answering, or too old for strided reads): the entries one
        # by one, in parallel, each replica after replica.
        ids = range(start, end + 1, stride)
        out = {}
        for entry_id, (ok, value) in zip(
            ids, await _gather_all([self._read_one(meta, e) for e in ids]), strict=True
        ):
            if not ok:
                if entry_id == start:
                    value.raiseException()
                break
            out[entry_id] = value[0]
        return out

    def _read_lac(self, meta: LedgerMetadata) -> Deferred[int]:
        """Return the highest LAC the bookies of the last ensemble report."""
        ensemble = meta.fragments[-1][1]
        ds = [
            self._timed(self._bookie(a).read_lac(meta.ledger_id), f"read LAC on {a}")
            for a in ensemble
        ]

        def best(results: list[tuple[bool, Any]]) -> int:
            lacs = [value for ok, value in results if ok]
            if not lacs:
                raise _best_error([value for _, value in results]).value
            # Entries below the last fragment completed before it was made.
            return max(*lacs, meta.fragments[-1][0] - 1)

        return _gather_all(ds).addCallback(best)

    # -- recovery (Rule 4) -------------------------------------------------------------------

    async def _recover(self, meta: LedgerMetadata, version: int) -> ReadHandle:
        ledger_id = meta.ledger_id
        if meta.state is LedgerState.OPEN:
            in_recovery = replace(meta, state=LedgerState.IN_RECOVERY)
            try:
                stat = await self._store.put(
                    _path(ledger_id), encode_metadata(in_recovery), version
                )
                meta, version = in_recovery, stat.version
            except BadVersionError:
                return await self._open(ledger_id, True)  # it changed under us: look again
        lac = await self._fence(meta)
        start = max(lac, meta.fragments[-1][0] - 1)
        length = 0
        if start >= 0:
            _, _, length = await self._read_one(meta, start)
        last, length, found = await self._recover_forward(meta, start, length)
        if found:
            meta, version = await self._replicate(meta, version, found)
        closed = replace(meta, state=LedgerState.CLOSED, last_entry_id=last, length=length)
        for _ in range(_CAS_ATTEMPTS):
            try:
                stat = await self._store.put(_path(ledger_id), encode_metadata(closed), version)
                return _ReadHandle(self, closed, stat.version, last)
            except BadVersionError:
                current, version = await self._get(ledger_id)
                if current.state is LedgerState.CLOSED:
                    # Another recovery won; its end is as good as ours (both cover every ack).
                    return _ReadHandle(self, current, version, current.last_entry_id)
                closed = replace(current, state=LedgerState.CLOSED, last_entry_id=last)
                closed = replace(closed, length=length)
        raise StorageError(f"ledger {ledger_id}: cannot close after recovery, metadata churns")

    async def _fence(self, meta: LedgerMetadata) -> int:
        """Fence the last ensemble until no write set can reach Qa acks; return the max LAC."""
        ensemble = meta.fragments[-1][1]
        e, qw, qa = meta.ensemble_size, meta.write_quorum, meta.ack_quorum
        need = qw - qa + 1
        write_sets = [[ensemble[(i + k) % e] for k in range(qw)] for i in range(e)]
        fenced: set[str] = set()
        lacs = [-1]
        errors: list[Failure] = []
        left = [len(ensemble)]
        done: Deferred[None] = Deferred()

        def enough() -> bool:
            return all(sum(1 for a in ws if a in fenced) >= need for ws in write_sets)

        def ok(result: FenceResult, address: str) -> None:
            fenced.add(address)
            lacs.append(result.lac)
            answered()

        def bad(failure: Failure, address: str) -> None:
            errors.append(failure)
            log.info("ledger %d: fence on %s: %s", meta.ledger_id, address, failure.value)
            answered()

        def answered() -> None:
            left[0] -= 1
            if done.called:
                return
            if enough():
                done.callback(None)
            elif left[0] == 0:
                done.errback(
                    BookieUnavailableError(
                        f"ledger {meta.ledger_id}: could fence only {sorted(fenced)} of "
                        f"{list(ensemble)}: {_best_error(errors).getErrorMessage()}"
                    )
                )

        for address in ensemble:
            d = self._timed(self._bookie(address).fence(meta.ledger_id), f"fence on {address}")
            d.addCallbacks(ok, bad, callbackArgs=(address,), errbackArgs=(address,))
        await done
        return max(lacs)

    async def _recover_forward(
        self, meta: LedgerMetadata, start: int, length: int
    ) -> tuple[int, int, list[tuple[int, int, bytes]]]:
        """Read past ``start`` with fencing reads until an entry is absent; return (last entry,
        its length, the (entry, lac, record) found)."""
        found: list[tuple[int, int, bytes]] = []
        last = start
        done = False
        while not done:
            window = [
                self._recovery_read(meta, e) for e in range(last + 1, last + 1 + _RECOVERY_WINDOW)
            ]
            results = await _gather_all(window)
            for ok, value in results:
                if not ok:
                    value.raiseException()
                if value is None:
                    done = True
                    break
                raw, entry_lac, entry_length = value
                last += 1
                length = entry_length
                found.append((last, entry_lac, raw))
        return last, length, found

    async def _replicate(
        self, meta: LedgerMetadata, version: int, found: list[tuple[int, int, bytes]]
    ) -> tuple[LedgerMetadata, int]:
        """Write the recovered entries to their whole write sets (Qa acks each). Bookies that
        cannot take them are replaced in a fragment starting at the first recovered entry,
        recorded by CAS while the ledger is IN_RECOVERY; return the metadata written."""
        for _ in range(_CAS_ATTEMPTS):
            results = await _gather_all([self._rewrite(meta, e, lac, raw) for e, lac, raw in found])
            failed: set[str] = set()
            for ok, value in results:
                if not ok:
                    value.raiseException()
                failed |= value
            if not failed:
                return meta, version
            first, ensemble = meta.fragments[-1]
            available = await self._registry.writable_bookies()
            new_ensemble = replace_bookies(ensemble, failed, available, self._rng)
            start = found[0][0]
            fragments = list(meta.fragments)
            if first >= start:
                fragments[-1] = (first, new_ensemble)
            else:
                fragments.append((start, new_ensemble))
            changed = replace(meta, fragments=tuple(fragments))
            log.info("ledger %d: recovery replaces %s", meta.ledger_id, sorted(failed))
            stat = await self._store.put(_path(meta.ledger_id), encode_metadata(changed), version)
            meta, version = changed, stat.version
        raise BookieUnavailableError(f"ledger {meta.ledger_id}: recovery writes keep failing")

    def _recovery_read(self, meta: LedgerMetadata, entry_id: int) -> Deferred[Any]:
        """Fire with (record, lac, length) if some replica holds the entry, None if Qw-Qa+1 say
        it has none; fail if neither can be decided."""
        ledger_id = meta.ledger_id
        write_set = meta.write_set(entry_id)
        absent_needed = meta.write_quorum - meta.ack_quorum + 1
        out: Deferred[Any] = Deferred()
        absent = [0]
        left = [len(write_set)]
        errors: list[Failure] = []

        def found(raw: bytes) -> None:
            try:
                _, lac, length = decode_record(ledger_id, entry_id, raw)
            except DigestMismatchError:
                missed(Failure())
                return
            left[0] -= 1
            if not out.called:
                out.callback((raw, lac, length))

        def missed(failure: Failure) -> None:
            left[0] -= 1
            if failure.check(NoSuchEntryError, NoSuchLedgerError):
                absent[0] += 1
            else:
                errors.append(failure)
            if out.called:
                return
            if absent[0] >= absent_needed:
                out.callback(None)
            elif left[0] == 0:
                out.errback(_best_error(errors))

        for address in write_set:
            d = self._timed(
                self._bookie(address).read_entry(ledger_id, entry_id, fence=True),
                f"recovery read {ledger_id}:{entry_id} on {address}",
            )
            d.addCallbacks(found, missed)
        return out

    def _rewrite(
        self, meta: LedgerMetadata, entry_id: int, lac: int, raw: bytes
    ) -> Deferred[set[str]]:
        """Write a recovered record to its whole write set. Fire with an empty set once Qa
        bookies took it, else with the bookies that failed (all answered by then)."""
        write_set = meta.write_set(entry_id)
        out: Deferred[set[str]] = Deferred()
        acks = [0]
        left = [len(write_set)]
        failed: set[str] = set()

        def ok(_: object) -> None:
            acks[0] += 1
            settle()

        def bad(failure: Failure, address: str) -> None:
            log.info("ledger %d: recovery write on %s: %s", meta.ledger_id, address, failure.value)
            failed.add(address)
            settle()

        def settle() -> None:
            left[0] -= 1
            if out.called:
                return
            if acks[0] >= meta.ack_quorum:
                out.callback(set())
            elif left[0] == 0:
                out.callback(failed)

        for address in write_set:
            d = self._timed(
                self._bookie(address).add_entry(meta.ledger_id, entry_id, lac, raw, recovery=True),
                f"recovery write {meta.ledger_id}:{entry_id} on {address}",
            )
            d.addCallbacks(ok, bad, errbackArgs=(address,))
        return out


class _ClosedBookie(BookieClient):
    """What a closed client hands out: every request fails with ``BookieUnavailableError``."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _closed(self) -> Deferred[Any]:
        return fail(BookieUnavailableError(f"{self.address}: the ledger client is closed"))

    def add_entry(
        self, ledger_id: int, entry_id: int, lac: int, data: bytes, *, recovery: bool = False
    ) -> Deferred[None]:
        return self._closed()

    def read_entry(self, ledger_id: int, entry_id: int, *, fence: bool = False) -> Deferred[bytes]:
        return self._closed()

    def read_range(
        self,
        ledger_id: int,
        first_entry_id: int,
        last_entry_id: int,
        max_bytes: int,
        stride: int = 1,
    ) -> Deferred[list[ReadResult]]:
        return self._closed()

    def read_lac(
        self, ledger_id: int, *, previous_lac: int | None = None, timeout_ms: int = 0
    ) -> Deferred[int]:
        return self._closed()

    def fence(self, ledger_id: int) -> Deferred[FenceResult]:
        return self._closed()

    def delete_ledger(self, ledger_id: int) -> Deferred[None]:
        return self._closed()

    def instance_id(self) -> Deferred[str]:
        return self._closed()

    def close(self) -> Deferred[None]:
        return succeed(None)


def _fragment_end(meta: LedgerMetadata, first: int, last: int) -> int:
    """The last entry up to ``last`` in the fragment holding ``first``."""
    for start, _ in meta.fragments:
        if start > first:
            return min(last, start - 1)
    return last


def _best_error(errors: Sequence[Failure]) -> Failure:
    """The most telling of several replicas' failures (corruption first, then absence)."""
    if not errors:
        return Failure(BookieUnavailableError("no replica answered"))
    for kind in (DigestMismatchError, LedgerFencedError, NoSuchEntryError, NoSuchLedgerError):
        for f in errors:
            if f.check(kind):
                return f
    return errors[-1]
