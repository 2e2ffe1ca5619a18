"""Managed cursors: read position, mark-delete and individually deleted ranges over one log.

State is kept in the log's entry sequence numbers (see ``managed``): the mark-delete ``md`` (every
entry numbered <= md is acknowledged), the read position, and the acknowledged entries above the
mark-delete as disjoint, non-adjacent closed ranges in two parallel sorted lists.

Rule 1: the mark-delete moves back only by ``reset``; ranges are always above it, and whenever a
        range starts right after it, it absorbs that range.
Rule 2: a durable cursor persists (mark-delete, ranges) as one snapshot at
        ``/managed-ledgers/<log>/cursors/<cursor>``, by compare-and-set, at most
        ``cursor_mark_delete_rate_per_s`` times per second: acknowledgements coalesce into the
        next write and each ``mark_delete``/``delete``/``reset`` Deferred fires once a write that
        holds its effect succeeded. A lost CAS fails them with ``ManagedLedgerFencedError``.
Rule 3: at most one read is outstanding per cursor.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from polybroker.ledger.api import (
    Cursor,
    Entry,
    ManagedLedgerClosedError,
    ManagedLedgerError,
    ManagedLedgerFencedError,
    Position,
)
from polybroker.metadata.api import BadVersionError

if TYPE_CHECKING:
    from polybroker.ledger.managed import ManagedLedgerImpl

CURSOR_FORMAT_VERSION = 1
WRITE_RETRY_S = 1.0  # after a failed state write
ROOT = "/managed-ledgers"


def cursor_path(ml_name: str, cursor: str) -> str:
    """The metadata path of a durable cursor of a log (cursor names may hold any character)."""
    return f"{ROOT}/{ml_name}/cursors/{quote(cursor, safe='')}"


class ManagedCursorImpl(Cursor):
    """A durable or non-durable cursor of a ``ManagedLedgerImpl`` (made by the log)."""

    def __init__(
        self, ml: ManagedLedgerImpl, name: str, *, durable: bool, mark_delete: int
    ) -> None:
        self.name = name
        self.durable = durable
        self._ml = ml
        self._md = mark_delete
        self._read = mark_delete + 1
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._deleted = 0  # entries inside the ranges
        self._closed = False
        self._reading = False
        self._waiting: Deferred[list[Entry]] | None = None
        self._waiting_max = 0
        self._generation = 0  # bumped by seek/reset so a read in flight does not undo them
        # persistence
        self._version = -1
        self._dirty = False
        self._writing = False
        self._last_write = float("-inf")
        self._timer: Any = None
        self._next_waiters: list[Deferred[None]] = []
        self._inflight_waiters: list[Deferred[None]] = []
        self._fenced: Exception | None = None
        self._persisted_md = mark_delete  # md of the last successful write
        self._writing_md = mark_delete

    # -- persistence -----------------------------------------------------------------------

    @classmethod
    def recover(cls, ml: ManagedLedgerImpl, value: bytes, version: int) -> ManagedCursorImpl:
        """Rebuild a durable cursor from its persisted snapshot; raise ``ManagedLedgerError``
        if it is not one."""
        try:
            doc = json.loads(value)
            if not isinstance(doc, dict) or "name" not in doc or "md" not in doc:
                raise ValueError("missing fields")
            md = ml._floor(Position(int(doc["md"][0]), int(doc["md"][1])))
            ranges = [
                (
                    ml._ceil(Position(int(item[0]), int(item[1]))),
                    ml._floor(Position(int(item[2]), int(item[3]))),
                )
                for item in doc.get("ranges", [])
            ]
            name = str(doc["name"])
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ManagedLedgerError(
                f"{ml.name}: unreadable cursor state {value[:80]!r}: {e}"
            ) from e
        cursor = cls(ml, name, durable=True, mark_delete=md)
        cursor._version = version
        for first, last in sorted(ranges):
            cursor._append_range(max(first, md + 1), last)
        cursor._advance()
        cursor._read = cursor._md + 1
        cursor._persisted_md = cursor._md
        return cursor

    def _snapshot(self) -> bytes:
        ml = self._ml
        md = ml._position(self._md)
        limit = ml.config.max_unacked_ranges_to_persist
        ranges = []
        for a, b in zip(self._starts[:limit], self._ends[:limit], strict=True):
            pa, pb = ml._position(a), ml._position(b)
            ranges.append([pa.ledger_id, pa.entry_id, pb.ledger_id, pb.entry_id])
        doc = {
            "version": CURSOR_FORMAT_VERSION,
            "name": self.name,
            "md": [md.ledger_id, md.entry_id],
            "ranges": ranges,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    async def _create(self) -> None:
        path = cursor_path(self._ml.name, self.name)
        stat = await self._ml._store.put(path, self._snapshot(), -1)
        self._version = stat.version
        self._last_write = self._ml._reactor.seconds()

    def _persist(self) -> Deferred[None]:
        """Fire once the current state is durable (Rule 2)."""
        if not self.durable:
            return succeed(None)
        if self._fenced is None and self._ml.fenced:
            # The log has another owner: its cursors are that owner's to write.
            self._fenced = ManagedLedgerFencedError(f"{self._ml.name} has another owner")
        if self._fenced is not None:
            return fail(self._fenced)
        self._dirty = True
        d: Deferred[None] = Deferred()
        self._next_waiters.append(d)
        self._schedule()
        return d

    def _durable_now(self) -> Deferred[None]:
        """Fire once the state as it is now is durable, writing nothing new if it already is."""
        if not self.durable:
            return succeed(None)
        if self._fenced is not None:
            return fail(self._fenced)
        d: Deferred[None] = Deferred()
        if self._dirty:
            self._next_waiters.append(d)
        elif self._writing:
            self._inflight_waiters.append(d)
        else:
            d.callback(None)
        return d

    def _schedule(self) -> None:
        if self._writing or self._timer is not None or not self._dirty or self._closed:
            return
        rate = self._ml.config.cursor_mark_delete_rate_per_s
        reactor = self._ml._reactor
        delay = 0.0 if rate <= 0 else self._last_write + 1.0 / rate - reactor.seconds()
        if delay <= 0:
            self._write()
        else:
            self._timer = reactor.callLater(delay, self._write)

    def _write(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._inflight_waiters.extend(self._next_waiters)
        self._next_waiters = []
        self._dirty = False
        self._writing = True
        self._writing_md = self._md
        self._last_write = self._ml._reactor.seconds()
        d = self._ml._store.put(
            cursor_path(self._ml.name, self.name), self._snapshot(), self._version
        )
        d.addCallbacks(self._written, self._write_failed)

    def _written(self, stat: Any) -> None:
        self._version = stat.version
        self._persisted_md = self._writing_md
        self._writing = False
        waiters, self._inflight_waiters = self._inflight_waiters, []
        for d in waiters:
            d.callback(None)
        self._schedule()

    def _write_failed(self, failure: Failure) -> None:
        self._writing = False
        error: Exception = failure.value  # type: ignore[assignment]
        if failure.check(BadVersionError):
            error = ManagedLedgerFencedError(
                f"{self._ml.name}: cursor {self.name} was changed by another owner"
            )
            self._fenced = error
            waiters = self._inflight_waiters + self._next_waiters
            self._inflight_waiters, self._next_waiters = [], []
        else:
            # The state is still to be written: the next write retries it.
            waiters, self._inflight_waiters = self._inflight_waiters, []
            self._dirty = True
        for d in waiters:
            d.errback(error)
        if self._fenced is None and not self._closed and self._timer is None:
            # Retry later, not at once: a store that fails at once would otherwise spin.
            self._timer = self._ml._reactor.callLater(WRITE_RETRY_S, self._write)

    async def _flush(self) -> None:
        """Write now, whatever the rate, and wait until the state is durable."""
        while self._writing:
            d: Deferred[None] = Deferred()
            self._inflight_waiters.append(d)
            try:
                await d
            except Exception:
                break
        if self._dirty and self._fenced is None:
            d = Deferred()
            self._next_waiters.append(d)
            self._write()
            await d

    # -- positions -------------------------------------------------------------------------

    @property
    def read_position(self) -> Position:
        ml = self._ml
        return ml._position(max(self._read, self._md + 1, ml._first_seq))

    @property
    def mark_delete_position(self) -> Position:
        ml = self._ml
        return ml._position(max(self._md, ml._first_seq - 1))

    @property
    def persisted_mark_delete_position(self) -> Position:
        if not self.durable:
            return self.mark_delete_position
        ml = self._ml
        return ml._position(max(self._persisted_md, ml._first_seq - 1))

    def individually_deleted(self) -> Sequence[tuple[Position, Position]]:
        pos = self._ml._position
        return [(pos(a), pos(b)) for a, b in zip(self._starts, self._ends, strict=True)]

    def is_deleted(self, position: Position) -> bool:
        s = self._ml._floor(position)
        if s <= self._md:
            return True
        i = bisect_right(self._starts, s) - 1
        return i >= 0 and self._ends[i] >= s

    # -- reading ---------------------------------------------------------------------------

    def _collect(self, max_entries: int) -> tuple[list[int], int]:
        """The next ``max_entries`` unacknowledged seqs and the read position after them."""
        ml = self._ml
        s = max(self._read, self._md + 1, ml._first_seq)
        limit = ml._next_seq
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, s) - 1
        if i >= 0 and ends[i] >= s:
            s = ends[i] + 1
        i += 1
        n = len(starts)
        out: list[int] = []
        while len(out) < max_entries and s < limit:
            if i < n and starts[i] == s:
                s = ends[i] + 1
                i += 1
                continue
            out.append(s)
            s += 1
        return out, s

    def read(self, max_entries: int, *, wait: bool = False) -> Deferred[list[Entry]]:
        if self._closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} is closed"))
        if self._reading or self._waiting is not None:
            return fail(ManagedLedgerError(f"cursor {self.name} already has a read pending"))
        if max_entries <= 0:
            return succeed([])
        seqs, after = self._collect(max_entries)
        if seqs:
            return self._fetch(seqs, after)
        self._read = max(self._read, after)
        if not wait:
            return succeed([])
        d: Deferred[list[Entry]] = Deferred()
        self._waiting = d
        self._waiting_max = max_entries
        self._ml._park(self)
        return d

    def _cached(self, seqs: list[int]) -> list[Entry] | None:
        """The entries numbered ``seqs`` if the log's cache holds every one of them (counted
        as read only then: otherwise ``_read_seqs`` reads and counts them)."""
        cache = self._ml._cache
        get = cache.get
        out: list[Entry] = []
        for s in seqs:
            e = get(s)
            if e is None:
                return None
            out.append(e)
        cache.count_reads(len(out), 0)
        return out

    def _fetch(self, seqs: list[int], after: int) -> Deferred[list[Entry]]:
        cached = self._cached(seqs)
        if cached is not None:
            # Read from the cache at once: no read in flight, nothing to chain.
            self._read = after
            self._ml._readers_moved()
            return succeed(cached)
        self._reading = True
        generation = self._generation

        def done(entries: list[Entry]) -> list[Entry]:
            self._reading = False
            if generation == self._generation:
                self._read = after
            self._ml._readers_moved()
            return entries

        def failed(f: Failure) -> Failure:
            self._reading = False
            return f

        return self._ml._read_seqs(seqs).addCallbacks(done, failed)

    def _wake(self) -> None:
        """New entries (or a move): answer a waiting read if there is something to read."""
        d = self._waiting
        if d is None or self._reading:
            return
        seqs, after = self._collect(self._waiting_max)
        if not seqs:
            self._ml._park(self)
            return
        self._waiting = None
        cached = self._cached(seqs)
        if cached is not None:
            # A tailing reader woken by an append takes the new entries from the cache
            # directly (the common case): no Deferred chain between the append and the read.
            self._read = after
            self._ml._readers_moved()
            d.callback(cached)
            return
        self._fetch(seqs, after).addCallbacks(d.callback, d.errback)

    def cancel_pending_read(self) -> None:
        d = self._waiting
        if d is not None:
            self._waiting = None
            self._ml._unpark(self)
            d.callback([])

    # -- acknowledging ---------------------------------------------------------------------

    def _insert(self, s: int) -> bool:
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, s) - 1
        if i >= 0 and ends[i] >= s:
            return False
        left = i >= 0 and ends[i] == s - 1
        right = i + 1 < len(starts) and starts[i + 1] == s + 1
        if left and right:
            ends[i] = ends[i + 1]
            del starts[i + 1]
            del ends[i + 1]
        elif left:
            ends[i] = s
        elif right:
            starts[i + 1] = s
        else:
            starts.insert(i + 1, s)
            ends.insert(i + 1, s)
        self._deleted += 1
        return True

    def _append_range(self, first: int, last: int) -> None:
        """Add ``first..last``, which lies at or above every range held (recovery)."""
        if first > last:
            return
        if self._starts and self._ends[-1] >= first - 1:
            if last > self._ends[-1]:
                self._deleted += last - self._ends[-1]
                self._ends[-1] = last
            return
        self._starts.append(first)
        self._ends.append(last)
        self._deleted += last - first + 1

    def _advance(self) -> None:
        """Drop ranges at or below the mark-delete; absorb a range that follows it (Rule 1)."""
        starts, ends = self._starts, self._ends
        md = self._md
        k = 0
        while k < len(starts) and ends[k] <= md:
            self._deleted -= ends[k] - starts[k] + 1
            k += 1
        if k:
            del starts[:k]
            del ends[:k]
        if starts and starts[0] <= md:
            self._deleted -= md - starts[0] + 1
            starts[0] = md + 1
        if starts and starts[0] == md + 1:
            self._md = ends[0]
            self._deleted -= ends[0] - starts[0] + 1
            del starts[0]
            del ends[0]
        if self._read <= self._md:
            # Acknowledged past what it read (a cursor that only acknowledges, as a Kafka
            # group's): the cache may drop what lies behind it now.
            self._read = self._md + 1
            self._ml._readers_moved()

    def mark_delete(self, position: Position) -> Deferred[None]:
        if self._closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} is closed"))
        s = self._ml._floor(position)
        if s <= self._md:
            return self._durable_now()
        self._md = s
        self._advance()
        return self._moved()

    def delete(self, positions: Sequence[Position]) -> Deferred[None]:
        if self._closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} is closed"))
        ml = self._ml
        changed = False
        md, limit = self._md, ml._next_seq
        for p in positions:
            s = ml._floor(p)
            if s <= md or s >= limit or ml._ceil(p) != s:
                continue  # acknowledged already, or not an entry of the log
            changed = self._insert(s) or changed
        if not changed:
            return self._durable_now()
        before = self._md
        self._advance()
        if self._md == before:
            return self._persist()
        return self._moved()

    def _moved(self) -> Deferred[None]:
        d = self._persist()
        if self.durable:
            self._ml._md_advanced(self._md)
        return d

    # -- moving ----------------------------------------------------------------------------

    def seek(self, position: Position) -> None:
        self._read = max(self._ml._ceil(position), self._md + 1)
        self._generation += 1
        self._ml._readers_moved()
        self._wake()

    def reset(self, position: Position) -> Deferred[None]:
        if self._closed:
            return fail(ManagedLedgerClosedError(f"cursor {self.name} is closed"))
        ml = self._ml
        s = max(ml._ceil(position), ml._first_seq)
        self._md = s - 1
        self._read = s
        self._starts.clear()
        self._ends.clear()
        self._deleted = 0
        self._generation += 1
        d = self._persist()
        self._wake()
        return d

    # -- backlog ---------------------------------------------------------------------------

    def backlog_entries(self) -> int:
        ml = self._ml
        md = max(self._md, ml._first_seq - 1)
        return max(0, ml._next_seq - 1 - md - self._deleted)

    def backlog(self) -> int:
        ml = self._ml
        hint = ml._index_hint
        md = max(self._md, ml._first_seq - 1)
        messages = ml._next_index - hint(md + 1)
        for a, b in zip(self._starts, self._ends, strict=True):
            messages -= hint(b + 1) - hint(a)
        return max(0, messages)

    # -- lifecycle -------------------------------------------------------------------------

    def _stop(self) -> None:
        """Stop without persisting (the cursor is being deleted)."""
        self._closed = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.cancel_pending_read()
        self._ml._cursor_closed(self)
        waiters = self._next_waiters
        self._next_waiters = []
        self._dirty = False
        for d in waiters:
            d.callback(None)

    def close(self) -> Deferred[None]:
        if self._closed:
            return succeed(None)
        self._closed = True
        self.cancel_pending_read()
        self._ml._cursor_closed(self)
        if not self.durable:
            return succeed(None)
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        return Deferred.fromCoroutine(self._flush())

    @property
    def closed(self) -> bool:
        """Whether the cursor was closed or deleted."""
        return self._closed
