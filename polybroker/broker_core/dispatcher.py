"""Dispatchers: which consumer of a subscription gets which entry, and when.

One dispatcher per persistent subscription, of the subscription's type:

* ``ExclusiveDispatcher``: one consumer; a second one fails with ``ConsumerBusyError``.
* ``FailoverDispatcher``: many consumers, one active: the lowest priority level, then the consumer
  name (on a partitioned topic, the partition index modulo the number of candidates, so partitions
  spread over consumers). The others are told they stand by.
* ``SharedDispatcher``: round robin over consumers that have permits, lower priority levels first.
* ``KeySharedDispatcher``: each entry goes to the consumer owning the hash slot of its key
  (``murmur.key_hash``), AUTO_SPLIT or STICKY ranges, so one key is consumed in order.

Rules every dispatcher keeps:

Rule 1: the cursor is read only when an eligible consumer has permits, at most
        ``max_read_batch`` entries at a time, with ``wait=True`` so a caught-up subscription
        tails the log. There is at most one read in flight.
Rule 2: an entry read is held in memory (``_buffer``, sorted by position) until delivered; it is
        never read again for this subscription, except when the cursor is reset (seek).
Rule 3: a delivered entry is pending on its consumer until acknowledged. Redelivery (negative
        ack, consumer gone, Failover switch) puts it back in the buffer, ahead of newer entries
        by position, and increments its redelivery count.
Rule 4: entries are delivered in position order per consumer, except redeliveries on Shared.
Rule 5 (Key_Shared): a consumer that joins while entries are unacknowledged receives nothing
        read after it joined (its ``join_marker``, the last position read then) until the
        mark-delete position reaches that marker (Pulsar's "recently joined consumers"), unless
        its subscription allows out-of-order delivery.
Rule 6 (Shared, Key_Shared): an entry whose deliver-at time is in the future waits in a timer
        heap and joins the buffer when due.
Rule 7 (Key_Shared): an entry is not sent to a consumer while entries of the same hash slot
        are unacknowledged at another consumer (the slot's previous owner, before a join or a
        leave moved it). Rule 5 alone lets entries read before the join, but not yet sent,
        overtake older entries of their key still held by the previous owner.
"""

from __future__ import annotations

import heapq
import logging
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from polybroker.broker_core.consumer import (
    DeliverAt,
    Delivery,
    KeyOf,
    KeySharedMeta,
    KeySharedMode,
    ServerConsumer,
    SubType,
)
from polybroker.broker_core.errors import ConsumerAssignError, ConsumerBusyError
from polybroker.broker_core.murmur import HASH_RANGE_SIZE, key_hash
from polybroker.ledger.api import Cursor, Entry, ManagedLedgerClosedError, Position
from polybroker.logs import kv

log = logging.getLogger(__name__)

# The key Pulsar gives entries without one, so they all land on one consumer.
NONE_KEY = b"NONE_KEY"

_READ_RETRY_S = 1.0


def _pos(entry: Entry) -> Position:
    return entry.position


def safe_key(key_of: KeyOf | None, entry: Entry, where: str) -> bytes:
    """The entry's Key_Shared key; a hook that fails is logged and the entry has no key."""
    if key_of is None:
        return NONE_KEY
    try:
        key = key_of(entry)
    except Exception:
        log.exception("key hook failed; routing as keyless", extra=kv(where=where))
        return NONE_KEY
    return key or NONE_KEY


@dataclass(frozen=True)
class DispatchSettings:
    """Per-subscription dispatch limits (broker config)."""

    max_read_batch: int = 100  # dispatcherMaxReadBatchSize
    max_unacked_per_consumer: int = 50_000  # maxUnackedMessagesPerConsumer; 0 = unlimited
    max_buffered_entries: int = 1000  # read no further while this many wait for a consumer
    delayed_delivery_enabled: bool = True  # delayedDeliveryEnabled


# ---------------------------------------------------------------------------------------------
# Key_Shared selectors
# ---------------------------------------------------------------------------------------------


class AutoSplitSelector:
    """AUTO_SPLIT: the first consumer owns 0..65535; each new one takes the lower half of the
    biggest range; a leaving consumer's range goes to its upper neighbour (or, for the top
    range, to its lower neighbour)."""

    def __init__(self) -> None:
        self._ends: list[int] = []  # inclusive upper bound of each range, ascending
        self._owners: list[ServerConsumer] = []

    def add(self, consumer: ServerConsumer) -> None:
        if not self._ends:
            self._ends.append(HASH_RANGE_SIZE - 1)
            self._owners.append(consumer)
            self._refresh()
            return
        best_i, best_start, best_size = 0, 0, -1
        start = 0
        for i, end in enumerate(self._ends):
            size = end - start + 1
            if size > best_size:
                best_i, best_start, best_size = i, start, size
            start = end + 1
        if best_size < 2:
            raise ConsumerAssignError("no hash range left to split for a new consumer")
        middle = best_start + (best_size - 1) // 2
        self._ends.insert(best_i, middle)
        self._owners.insert(best_i, consumer)
        self._refresh()

    def remove(self, consumer: ServerConsumer) -> None:
        try:
            i = self._owners.index(consumer)
        except ValueError:
            return
        last = i == len(self._ends) - 1
        del self._ends[i]
        del self._owners[i]
        if last and self._ends:
            self._ends[-1] = HASH_RANGE_SIZE - 1
        consumer.hash_ranges = []
        self._refresh()

    def select(self, slot: int) -> ServerConsumer | None:
        if not self._ends:
            return None
        return self._owners[bisect_left(self._ends, slot)]

    def _refresh(self) -> None:
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for end, owner in zip(self._ends, self._owners, strict=True):
            ranges.setdefault(id(owner), []).append((start, end))
            start = end + 1
        for owner in self._owners:
            owner.hash_ranges = ranges[id(owner)]


class StickySelector:
    """STICKY: each consumer brings its own inclusive ranges; they may not overlap. Slots no
    consumer owns are not delivered until one does."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._owners: list[ServerConsumer] = []

    def add(self, consumer: ServerConsumer, ranges: Sequence[tuple[int, int]]) -> None:
        if not ranges:
            raise ConsumerAssignError("a STICKY Key_Shared consumer must give hash ranges")
        wanted = sorted((int(s), int(e)) for s, e in ranges)
        for i, (s, e) in enumerate(wanted):
            if not 0 <= s <= e < HASH_RANGE_SIZE:
                raise ConsumerAssignError(f"hash range [{s}, {e}] is not within 0..65535")
            if i and s <= wanted[i - 1][1]:
                raise ConsumerAssignError(f"hash range [{s}, {e}] overlaps another one given")
            j = bisect_right(self._starts, e) - 1
            if j >= 0 and self._ends[j] >= s:
                other = self._owners[j]
                raise ConsumerAssignError(
                    f"hash range [{s}, {e}] overlaps [{self._starts[j]}, {self._ends[j]}] "
                    f"of consumer {other.consumer_name!r}"
                )
        for s, e in wanted:
            j = bisect_left(self._starts, s)
            self._starts.insert(j, s)
            self._ends.insert(j, e)
            self._owners.insert(j, consumer)
        consumer.hash_ranges = wanted

    def remove(self, consumer: ServerConsumer) -> None:
        keep = [
            (s, e, o)
            for s, e, o in zip(self._starts, self._ends, self._owners, strict=True)
            if o is not consumer
        ]
        self._starts = [k[0] for k in keep]
        self._ends = [k[1] for k in keep]
        self._owners = [k[2] for k in keep]
        consumer.hash_ranges = []

    def select(self, slot: int) -> ServerConsumer | None:
        j = bisect_right(self._starts, slot) - 1
        if j >= 0 and slot <= self._ends[j]:
            return self._owners[j]
        return None


def pick_failover_active(
    consumers: Sequence[ServerConsumer], partition_index: int
) -> ServerConsumer | None:
    """The active Failover consumer: among the lowest priority level, sorted by name (join
    order breaks ties), the first one, or ``partition_index`` modulo their number."""
    if not consumers:
        return None
    level = min(c.priority_level for c in consumers)
    candidates = sorted(
        (c for c in consumers if c.priority_level == level), key=lambda c: c.consumer_name
    )
    index = partition_index % len(candidates) if partition_index >= 0 else 0
    return candidates[index]


# ---------------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------------


class Dispatcher:
    """The machinery every type shares: read loop, buffer, pending bookkeeping, redelivery
    counts, batch-index acks and delayed delivery. Subclasses decide who gets what."""

    sub_type: ClassVar[SubType]
    # Whether negative acks may redeliver single positions (else always all, for order).
    individual_redelivery: ClassVar[bool] = False
    uses_delays: ClassVar[bool] = False
    limits_unacked: ClassVar[bool] = False

    def __init__(
        self,
        cursor: Cursor,
        clock: IReactorTime,
        settings: DispatchSettings,
        *,
        at_end: Callable[[], bool],
        key_of: KeyOf | None = None,
        deliver_at: DeliverAt | None = None,
        partition_index: int = -1,
        name: str = "",
    ) -> None:
        self.cursor = cursor
        self.clock = clock
        self.settings = settings
        self._at_end = at_end
        self.key_of = key_of
        self.deliver_at = deliver_at if settings.delayed_delivery_enabled else None
        self.partition_index = partition_index
        self.name = name
        # maxUnackedMessagesPerConsumer holds for Shared and Key_Shared only, as in Pulsar.
        self._unacked_limit = settings.max_unacked_per_consumer if self.limits_unacked else 0
        self.consumers: list[ServerConsumer] = []
        self._buffer: list[Entry] = []
        self._stale: set[Position] = set()  # acked while waiting in the buffer
        self._owner: dict[Position, ServerConsumer] = {}
        # Whether ``_owner``'s keys were inserted in position order (so a cumulative ack can
        # stop at the first position past it), and the last one inserted.
        self._owner_in_order = True
        self._owner_last: Position | None = None
        self.redeliveries: dict[Position, int] = {}
        self.batch_acks: dict[Position, int] = {}
        self._delayed: list[tuple[int, Position, Entry]] = []
        self._delayed_call: IDelayedCall | None = None
        self._retry_call: IDelayedCall | None = None
        self._reading = False
        self._read_gen = 0
        self._paused = False
        self._closed = False
        self._in_pass = False
        self._again = False
        self._blocked_any = False
        self._successor: Dispatcher | None = None
        self.last_read: Position | None = None
        # Running totals for the messages-per-entry estimate that sizes reads.
        self._entries_sent = 0
        self._messages_sent = 0
        self.msg_out = 0
        self.bytes_out = 0
        self.msg_redelivered = 0
        self._init_type_state()

    def _init_type_state(self) -> None:
        """Hook: set up what the subclass keeps."""

    # -- consumers ------------------------------------------------------------------------

    def add_consumer(self, consumer: ServerConsumer, key_shared: KeySharedMeta | None) -> None:
        """Attach a consumer (raises ``ConsumerBusyError`` / ``ConsumerAssignError``)."""
        self.consumers.append(consumer)
        self.schedule()

    def remove_consumer(self, consumer: ServerConsumer, *, redeliver: bool = True) -> None:
        """Detach a consumer; its pending entries are redelivered to the others."""
        if consumer not in self.consumers:
            return
        self.consumers.remove(consumer)
        consumer.closed = True
        self._detached(consumer)
        entries = self._take_pending(consumer, None)
        if redeliver and entries:
            self._requeue(entries)
        if not self.consumers and self._reading:
            # Hold no read-ahead for nobody; the next consumer starts a fresh read.
            self.cursor.cancel_pending_read()
        self.schedule()

    def _detached(self, consumer: ServerConsumer) -> None:
        """Hook: a consumer left (selectors, active consumer)."""

    def flow(self, consumer: ServerConsumer, permits: int) -> None:
        consumer.permits += permits
        self.schedule()

    # -- acknowledgements -----------------------------------------------------------------

    def acked(self, positions: Sequence[Position]) -> None:
        """Forget acknowledged positions (the cursor has been told)."""
        owner = self._owner
        buffer = self._buffer
        low = buffer[0].position if buffer else None
        high = buffer[-1].position if buffer else None
        for p in positions:
            sc = owner.pop(p, None)
            if sc is not None:
                entry = sc.pending.pop(p, None)
                if entry is not None:
                    sc.pending_messages -= entry.num_messages
            elif low is not None and low <= p <= high:  # type: ignore[operator]
                # Acked while waiting in the buffer (e.g. by a client that got it earlier):
                # dropped when the dispatcher comes to it.
                self._stale.add(p)
        if self.redeliveries:
            for p in positions:
                self.redeliveries.pop(p, None)
        if self.batch_acks:
            for p in positions:
                self.batch_acks.pop(p, None)
        self._after_ack()

    def acked_up_to(self, position: Position) -> None:
        """Forget everything at or below ``position`` (cumulative ack)."""
        # Compared field by field: Position's generated ordering costs several calls per test,
        # and this runs over every delivered, unacknowledged entry.
        owner = self._owner
        lid, eid = position.ledger_id, position.entry_id
        if self._owner_in_order:
            # Only what is acknowledged is visited: the rest comes after it.
            done = []
            for p in owner:
                if p.ledger_id > lid or (p.ledger_id == lid and p.entry_id > eid):
                    break
                done.append(p)
        else:
            done = [
                p for p in owner if p.ledger_id < lid or (p.ledger_id == lid and p.entry_id <= eid)
            ]
        for p in done:
            sc = owner.pop(p)
            entry = sc.pending.pop(p, None)
            if entry is not None:
                sc.pending_messages -= entry.num_messages
        if not owner:
            self._owner_in_order = True
            self._owner_last = None
        if self._buffer:
            cut = bisect_right(self._buffer, position, key=_pos)
            del self._buffer[:cut]
        if self.redeliveries:
            self.redeliveries = {p: n for p, n in self.redeliveries.items() if p > position}
        if self.batch_acks:
            self.batch_acks = {p: b for p, b in self.batch_acks.items() if p > position}
        self._after_ack()

    def _after_ack(self) -> None:
        unblocked = False
        if self._blocked_any:
            limit = self._unacked_limit
            still = False
            for c in self.consumers:
                if c.blocked:
                    if c.pending_messages < limit:
                        c.blocked = False
                        unblocked = True
                    else:
                        still = True
            self._blocked_any = still
        if unblocked or self._needs_ack_kick() or self._at_end():
            self.schedule()

    def _needs_ack_kick(self) -> bool:
        return False

    # -- redelivery -----------------------------------------------------------------------

    def redeliver(self, consumer: ServerConsumer, positions: Sequence[Position] | None) -> None:
        """Put a consumer's pending entries (or some of them) back for delivery."""
        if not self.individual_redelivery:
            positions = None
        entries = self._take_pending(consumer, positions)
        if entries:
            self._requeue(entries)
            self.schedule()

    def _take_pending(
        self, consumer: ServerConsumer, positions: Sequence[Position] | None
    ) -> list[Entry]:
        if positions is None:
            entries = list(consumer.pending.values())
            consumer.pending.clear()
            consumer.pending_messages = 0
            for e in entries:
                self._owner.pop(e.position, None)
        else:
            entries = []
            for p in positions:
                if self._owner.get(p) is consumer:
                    del self._owner[p]
                    entry = consumer.pending.pop(p)
                    consumer.pending_messages -= entry.num_messages
                    entries.append(entry)
        if consumer.blocked and consumer.pending_messages < self._unacked_limit:
            consumer.blocked = False
        return entries

    def _requeue(self, entries: list[Entry]) -> None:
        counts = self.redeliveries
        for e in entries:
            counts[e.position] = counts.get(e.position, 0) + 1
            self.msg_redelivered += e.num_messages
        self._buffer.extend(entries)
        self._buffer.sort(key=_pos)

    # -- the dispatch loop ----------------------------------------------------------------

    def schedule(self) -> None:
        """Deliver what can be delivered and read more if consumers want it. Re-entrant calls
        (a read that completes synchronously) run as further passes of the outer call."""
        if self._in_pass:
            self._again = True
            return
        self._in_pass = True
        try:
            while True:
                self._again = False
                self._pass()
                if not self._again:
                    break
        finally:
            self._in_pass = False

    def _pass(self) -> None:
        if self._closed or self._paused:
            return
        if self._buffer:
            out: dict[ServerConsumer, list[Delivery]] = {}
            self._dispatch_buffer(out)
            if self._stale and not self._buffer:
                self._stale.clear()
            self._flush(out)
        self._read_more()
        if self._at_end():
            self._notify_end_of_topic()

    def _dispatch_buffer(self, out: dict[ServerConsumer, list[Delivery]]) -> None:
        raise NotImplementedError

    def _available_permits(self) -> int:
        raise NotImplementedError

    def _assign(
        self, consumer: ServerConsumer, entry: Entry, out: dict[ServerConsumer, list[Delivery]]
    ) -> None:
        p = entry.position
        n = entry.num_messages
        size = len(entry.data)
        consumer.permits -= n
        consumer.pending[p] = entry
        consumer.pending_messages += n
        if self._unacked_limit and consumer.pending_messages >= self._unacked_limit:
            consumer.blocked = True
            self._blocked_any = True
        consumer.msg_out += n
        consumer.bytes_out += size
        self._entries_sent += 1
        self._messages_sent += n
        self.msg_out += n
        self.bytes_out += size
        last = self._owner_last
        if last is not None and p <= last:
            self._owner_in_order = False
        self._owner_last = p
        self._owner[p] = consumer
        delivery = Delivery(
            entry,
            self.redeliveries.get(p, 0) if self.redeliveries else 0,
            self.batch_acks.get(p, 0) if self.batch_acks else 0,
        )
        batch = out.get(consumer)
        if batch is None:
            out[consumer] = [delivery]
        else:
            batch.append(delivery)

    def _assign_run(
        self,
        consumer: ServerConsumer,
        entries: list[Entry],
        out: dict[ServerConsumer, list[Delivery]],
    ) -> None:
        """``_assign`` of each of ``entries`` to ``consumer``, in order, with the counters
        updated once for the run."""
        pending = consumer.pending
        owner = self._owner
        redeliveries = self.redeliveries
        batch_acks = self.batch_acks
        last = self._owner_last
        if last is not None and entries[0].position <= last:  # a run is in position order
            self._owner_in_order = False
        self._owner_last = entries[-1].position
        batch = out.get(consumer)
        if batch is None:
            batch = out[consumer] = []
        append = batch.append
        new = tuple.__new__
        messages = 0
        size = 0
        for entry in entries:
            p = entry.position
            messages += entry.num_messages
            size += len(entry.data)
            pending[p] = entry
            owner[p] = consumer
            # ``tuple.__new__`` builds the named tuple without its Python-level ``__new__``.
            if redeliveries or batch_acks:
                append(new(Delivery, (entry, redeliveries.get(p, 0), batch_acks.get(p, 0))))
            else:
                append(new(Delivery, (entry, 0, 0)))
        consumer.permits -= messages
        consumer.pending_messages += messages
        if self._unacked_limit and consumer.pending_messages >= self._unacked_limit:
            consumer.blocked = True
            self._blocked_any = True
        consumer.msg_out += messages
        consumer.bytes_out += size
        self._entries_sent += len(entries)
        self._messages_sent += messages
        self.msg_out += messages
        self.bytes_out += size

    def _flush(self, out: dict[ServerConsumer, list[Delivery]]) -> None:
        # The counters were updated as the entries were assigned.
        for consumer, deliveries in out.items():
            try:
                consumer.consumer.send_entries(deliveries)
            except Exception:
                log.exception(
                    "consumer failed to take entries",
                    extra=kv(subscription=self.name, consumer=consumer.consumer_name),
                )

    def _is_stale(self, entry: Entry) -> bool:
        stale = self._stale
        if stale and entry.position in stale:
            stale.discard(entry.position)
            return True
        return False

    def _read_more(self) -> None:
        if self._reading or not self.consumers or self._retry_call is not None:
            return
        if len(self._buffer) >= self.settings.max_buffered_entries:
            return
        permits = self._available_permits()
        if permits <= 0 or self._at_end():
            return
        per_entry = max(1, self._messages_sent // self._entries_sent) if self._entries_sent else 1
        count = max(1, min(self.settings.max_read_batch, permits // per_entry))
        self._reading = True
        gen = self._read_gen
        d = self.cursor.read(count, wait=True)
        d.addCallbacks(self._read_done, self._read_failed, callbackArgs=(gen,), errbackArgs=(gen,))

    def _read_done(self, entries: list[Entry], gen: int) -> None:
        self._reading = False
        if self._successor is not None:
            self._successor._adopt_read(entries, gen)
            return
        if self._closed:
            return
        if gen != self._read_gen:
            # Read before a seek: the cursor was reset since, so drop it and read afresh.
            self.schedule()
            return
        if entries:
            self.last_read = entries[-1].position
            self._buffer.extend(entries)
            self.schedule()

    def _adopt_read(self, entries: list[Entry], gen: int) -> None:
        self._read_done(entries, gen)

    def _read_failed(self, failure: Failure, gen: int) -> None:
        self._reading = False
        if self._successor is not None:
            self._successor._read_failed(failure, gen)
            return
        if self._closed or failure.check(ManagedLedgerClosedError):
            return
        log.warning(
            "subscription read failed; retrying",
            extra=kv(subscription=self.name, error=str(failure.value)),
        )
        if self._retry_call is None:
            self._retry_call = self.clock.callLater(_READ_RETRY_S, self._retry)

    def _retry(self) -> None:
        self._retry_call = None
        self.schedule()

    def wake(self) -> None:
        """Re-check after a state change outside the dispatcher (termination): a read waiting
        at the end of a terminated log would wait forever, so it is cancelled."""
        if self._reading and self._at_end():
            self.cursor.cancel_pending_read()
        self.schedule()

    def _notify_end_of_topic(self) -> None:
        if self._buffer or self._delayed or self._owner:
            return
        waiting = [c for c in self.consumers if not c.ended_notified]
        if not waiting or self.cursor.backlog_entries() > 0:
            return
        for consumer in waiting:
            consumer.ended_notified = True
            try:
                consumer.consumer.reached_end_of_topic()
            except Exception:
                log.exception("consumer failed on end of topic", extra=kv(subscription=self.name))

    # -- delayed delivery -----------------------------------------------------------------

    def _hold_if_delayed(self, entry: Entry, now_ms: int) -> bool:
        """Park an entry whose deliver-at time is in the future; True if parked."""
        deliver_at = self.deliver_at
        if deliver_at is None:
            return False
        try:
            at = deliver_at(entry)
        except Exception:
            log.exception("deliver-at hook failed; delivering now", extra=kv(sub=self.name))
            return False
        if at is None or at <= now_ms:
            return False
        heapq.heappush(self._delayed, (at, entry.position, entry))
        self._arm_delayed(now_ms)
        return True

    def _arm_delayed(self, now_ms: int) -> None:
        if not self._delayed:
            return
        due = self._delayed[0][0]
        call = self._delayed_call
        delay_s = max(0.0, (due - now_ms) / 1000.0)
        if call is not None and call.active():
            if call.getTime() <= self.clock.seconds() + delay_s:
                return
            call.cancel()
        self._delayed_call = self.clock.callLater(delay_s, self._delayed_due)

    def _delayed_due(self) -> None:
        self._delayed_call = None
        now_ms = self._now_ms()
        due: list[Entry] = []
        while self._delayed and self._delayed[0][0] <= now_ms:
            _, position, entry = heapq.heappop(self._delayed)
            if not self.cursor.is_deleted(position):
                due.append(entry)
        if due:
            self._buffer.extend(due)
            self._buffer.sort(key=_pos)
        self._arm_delayed(now_ms)
        self.schedule()

    def _now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    @property
    def delayed_count(self) -> int:
        return len(self._delayed)

    @property
    def buffered_count(self) -> int:
        return len(self._buffer)

    @property
    def has_pending_read(self) -> bool:
        return self._reading

    # -- seek, type change, close ---------------------------------------------------------

    def reset(self) -> None:
        """Forget everything read (before a cursor reset) and pause until ``resume``."""
        gone = self.consumers
        self.consumers = []
        for consumer in gone:
            consumer.closed = True
            self._detached(consumer)
            consumer.pending.clear()
            consumer.pending_messages = 0
        self._buffer.clear()
        self._stale.clear()
        self._owner.clear()
        self._owner_in_order = True
        self._owner_last = None
        self.redeliveries.clear()
        self.batch_acks.clear()
        self._delayed.clear()
        if self._delayed_call is not None and self._delayed_call.active():
            self._delayed_call.cancel()
        self._delayed_call = None
        self.last_read = None
        self._read_gen += 1
        self._paused = True
        if self._reading:
            self.cursor.cancel_pending_read()

    def resume(self) -> None:
        self._paused = False
        self.schedule()

    def take_over(self, previous: Dispatcher) -> None:
        """Continue from a dispatcher of another type whose consumers have all left."""
        self._buffer = previous._buffer
        self._stale = previous._stale
        self.redeliveries = previous.redeliveries
        self.batch_acks = previous.batch_acks
        self.last_read = previous.last_read
        self._reading = previous._reading
        self._read_gen = previous._read_gen
        self._paused = previous._paused
        self.msg_out = previous.msg_out
        self.bytes_out = previous.bytes_out
        self.msg_redelivered = previous.msg_redelivered
        self._entries_sent = previous._entries_sent
        self._messages_sent = previous._messages_sent
        held = previous._delayed
        previous._close_timers()
        previous._closed = True
        previous._successor = self
        for _, _, entry in held:
            self._buffer.append(entry)
        if held:
            # Parked entries are re-examined: a type without delays delivers them now.
            self._buffer.sort(key=_pos)

    def _close_timers(self) -> None:
        for call in (self._delayed_call, self._retry_call):
            if call is not None and call.active():
                call.cancel()
        self._delayed_call = None
        self._retry_call = None

    def close(self) -> None:
        """Stop dispatching; consumers are not told (the subscription does that)."""
        self._closed = True
        self._close_timers()
        if self._reading:
            self.cursor.cancel_pending_read()


class _SingleActiveDispatcher(Dispatcher):
    """Exclusive and Failover: everything goes, in order, to one active consumer."""

    active: ServerConsumer | None

    def _init_type_state(self) -> None:
        self.active = None

    def _dispatch_buffer(self, out: dict[ServerConsumer, list[Delivery]]) -> None:
        consumer = self.active
        if consumer is None or consumer.permits <= 0 or consumer.paused:
            return
        buffer = self._buffer
        stale = self._stale
        permits = consumer.permits
        run: list[Entry] = []
        i = 0
        n = len(buffer)
        while i < n and permits > 0:
            entry = buffer[i]
            i += 1
            if stale and entry.position in stale:
                stale.discard(entry.position)
                continue
            run.append(entry)
            permits -= entry.num_messages
        del buffer[:i]
        if run:
            self._assign_run(consumer, run, out)

    def _available_permits(self) -> int:
        active = self.active
        return active.permits if active is not None and not active.paused else 0


class ExclusiveDispatcher(_SingleActiveDispatcher):
    sub_type = SubType.EXCLUSIVE

    def add_consumer(self, consumer: ServerConsumer, key_shared: KeySharedMeta | None) -> None:
        if self.consumers:
            raise ConsumerBusyError("Exclusive subscription already has a consumer")
        self.active = consumer
        consumer.active = True
        super().add_consumer(consumer, key_shared)

    def _detached(self, consumer: ServerConsumer) -> None:
        if self.active is consumer:
            self.active = None
            consumer.active = False


class FailoverDispatcher(_SingleActiveDispatcher):
    sub_type = SubType.FAILOVER

    def add_consumer(self, consumer: ServerConsumer, key_shared: KeySharedMeta | None) -> None:
        self.consumers.append(consumer)
        self._elect(joined=consumer)
        self.schedule()

    def _detached(self, consumer: ServerConsumer) -> None:
        consumer.active = False
        if self.active is consumer:
            self.active = None
        self._elect(joined=None)

    def _elect(self, joined: ServerConsumer | None) -> None:
        chosen = pick_failover_active(self.consumers, self.partition_index)
        previous = self.active
        if chosen is not previous:
            self.active = chosen
            # The new active consumer starts from the first unacknowledged entry: what the
            # others hold is redelivered to it, in order.
            for other in self.consumers:
                if other is not chosen and other.pending:
                    self._requeue(self._take_pending(other, None))
        for consumer in self.consumers:
            is_active = consumer is chosen
            if consumer.active != is_active or consumer is joined:
                consumer.active = is_active
                try:
                    consumer.consumer.active_changed(is_active)
                except Exception:
                    log.exception("consumer failed on active change", extra=kv(sub=self.name))


class SharedDispatcher(Dispatcher):
    """Round robin over consumers with permits; lower priority levels are filled first."""

    sub_type = SubType.SHARED
    individual_redelivery = True
    uses_delays = True
    limits_unacked = True

    _levels: list[tuple[int, list[ServerConsumer]]]
    _next: dict[int, int]

    def _init_type_state(self) -> None:
        self._levels = []
        self._next = {}

    def add_consumer(self, consumer: ServerConsumer, key_shared: KeySharedMeta | None) -> None:
        self.consumers.append(consumer)
        self._regroup()
        self.schedule()

    def _detached(self, consumer: ServerConsumer) -> None:
        self._regroup()

    def _regroup(self) -> None:
        groups: dict[int, list[ServerConsumer]] = {}
        for c in self.consumers:
            groups.setdefault(c.priority_level, []).append(c)
        self._levels = sorted(groups.items())
        self._next = {level: self._next.get(level, 0) for level in groups}

    def _next_consumer(self) -> ServerConsumer | None:
        for level, group in self._levels:
            size = len(group)
            start = self._next[level]
            for step in range(size):
                index = (start + step) % size
                consumer = group[index]
                if consumer.permits > 0 and not (consumer.blocked or consumer.paused):
                    self._next[level] = index + 1
                    return consumer
        return None

    def _dispatch_buffer(self, out: dict[ServerConsumer, list[Delivery]]) -> None:
        buffer = self._buffer
        now_ms = self._now_ms() if self.deliver_at is not None else 0
        i = 0
        n = len(buffer)
        while i < n:
            entry = buffer[i]
            if self._is_stale(entry) or self._hold_if_delayed(entry, now_ms):
                i += 1
                continue
            consumer = self._next_consumer()
            if consumer is None:
                break
            self._assign(consumer, entry, out)
            i += 1
        del buffer[:i]

    def _available_permits(self) -> int:
        total = 0
        for c in self.consumers:
            if c.permits > 0 and not (c.blocked or c.paused):
                total += c.permits
        return total


class KeySharedDispatcher(Dispatcher):
    """Entries go to the owner of their key's hash slot; see Rule 5 for joining consumers."""

    sub_type = SubType.KEY_SHARED
    individual_redelivery = True
    uses_delays = True
    limits_unacked = True

    meta: KeySharedMeta | None
    _auto: AutoSplitSelector | None
    _sticky: StickySelector | None
    _recent: list[ServerConsumer]
    _slots: dict[Position, int]
    _pending_slots: dict[Position, int]
    _holders: dict[int, list[object]]
    _drained: bool

    def _init_type_state(self) -> None:
        self.meta = None
        self._auto = None
        self._sticky = None
        self._recent = []
        self._slots = {}  # slot of entries kept in the buffer
        self._pending_slots = {}  # slot of each delivered, unacknowledged entry
        # Per slot with unacknowledged entries: [consumer holding them, how many] (Rule 7).
        self._holders = {}
        self._drained = False

    def _release(self, positions: Sequence[Position]) -> None:
        pending_slots = self._pending_slots
        holders = self._holders
        for p in positions:
            slot = pending_slots.pop(p, None)
            if slot is None:
                continue
            holder = holders[slot]
            count = holder[1] - 1  # type: ignore[operator]
            if count:
                holder[1] = count
            else:
                del holders[slot]
                self._drained = True

    def acked(self, positions: Sequence[Position]) -> None:
        if self._pending_slots:
            self._release(positions)
        super().acked(positions)

    def acked_up_to(self, position: Position) -> None:
        self._release([p for p in self._pending_slots if p <= position])
        super().acked_up_to(position)

    def _take_pending(
        self, consumer: ServerConsumer, positions: Sequence[Position] | None
    ) -> list[Entry]:
        entries = super()._take_pending(consumer, positions)
        self._release([e.position for e in entries])
        return entries

    def add_consumer(self, consumer: ServerConsumer, key_shared: KeySharedMeta | None) -> None:
        meta = key_shared or KeySharedMeta()
        if self.consumers and self.meta is not None and meta.mode is not self.meta.mode:
            raise ConsumerBusyError(
                f"Key_Shared subscription is in {self.meta.mode.value} mode, not {meta.mode.value}"
            )
        if not self.consumers:
            self.meta = meta
            self._auto = AutoSplitSelector() if meta.mode is KeySharedMode.AUTO_SPLIT else None
            self._sticky = StickySelector() if meta.mode is KeySharedMode.STICKY else None
        if self._sticky is not None:
            self._sticky.add(consumer, meta.ranges)
        else:
            assert self._auto is not None
            self._auto.add(consumer)
        allow_out_of_order = self.meta is not None and self.meta.allow_out_of_order
        if (
            self.consumers
            and not allow_out_of_order
            and self.last_read is not None
            and self.cursor.mark_delete_position < self.last_read
        ):
            consumer.join_marker = self.last_read
            self._recent.append(consumer)
        self.consumers.append(consumer)
        self.schedule()

    def _detached(self, consumer: ServerConsumer) -> None:
        if self._auto is not None:
            self._auto.remove(consumer)
        if self._sticky is not None:
            self._sticky.remove(consumer)
        if consumer in self._recent:
            self._recent.remove(consumer)
        consumer.join_marker = None

    def _select(self, slot: int) -> ServerConsumer | None:
        if self._auto is not None:
            return self._auto.select(slot)
        if self._sticky is not None:
            return self._sticky.select(slot)
        return None

    def _slot_of(self, entry: Entry) -> int:
        return key_hash(safe_key(self.key_of, entry, self.name))

    def _lift_recent(self) -> bool:
        if not self._recent:
            return False
        mark_delete = self.cursor.mark_delete_position
        lifted = False
        for consumer in list(self._recent):
            marker = consumer.join_marker
            if marker is None or mark_delete >= marker:
                consumer.join_marker = None
                self._recent.remove(consumer)
                lifted = True
        return lifted

    def _needs_ack_kick(self) -> bool:
        drained = self._drained and bool(self._buffer)
        self._drained = False
        return self._lift_recent() or drained

    def _dispatch_buffer(self, out: dict[ServerConsumer, list[Delivery]]) -> None:
        self._lift_recent()
        now_ms = self._now_ms() if self.deliver_at is not None else 0
        slots = self._slots
        holders = self._holders
        out_of_order = self.meta is not None and self.meta.allow_out_of_order
        keep: list[Entry] = []
        for entry in self._buffer:
            if self._is_stale(entry):
                slots.pop(entry.position, None)
                continue
            slot = slots.pop(entry.position, None)
            if slot is None:
                if self._hold_if_delayed(entry, now_ms):
                    continue
                slot = self._slot_of(entry)
            consumer = self._select(slot)
            if consumer is None or consumer.permits <= 0 or consumer.blocked or consumer.paused:
                slots[entry.position] = slot
                keep.append(entry)
                continue
            marker = consumer.join_marker
            if marker is not None and entry.position > marker:
                slots[entry.position] = slot
                keep.append(entry)
                continue
            if not out_of_order:
                holder = holders.get(slot)
                if holder is None:
                    holders[slot] = [consumer, 1]
                elif holder[0] is consumer:
                    holder[1] += 1  # type: ignore[operator]
                else:
                    # The key's earlier entries are still unacknowledged at its previous owner.
                    slots[entry.position] = slot
                    keep.append(entry)
                    continue
                self._pending_slots[entry.position] = slot
            self._assign(consumer, entry, out)
        self._buffer = keep

    def _available_permits(self) -> int:
        total = 0
        for c in self.consumers:
            if c.permits > 0 and not (c.blocked or c.paused):
                total += c.permits
        return total

    def reset(self) -> None:
        super().reset()
        self._recent.clear()
        self._slots.clear()
        self._pending_slots.clear()
        self._holders.clear()

    def take_over(self, previous: Dispatcher) -> None:
        super().take_over(previous)
        self._slots = {}


DISPATCHERS: dict[SubType, type[Dispatcher]] = {
    SubType.EXCLUSIVE: ExclusiveDispatcher,
    SubType.FAILOVER: FailoverDispatcher,
    SubType.SHARED: SharedDispatcher,
    SubType.KEY_SHARED: KeySharedDispatcher,
}


def ignore_failure(d: Deferred[object]) -> None:
    """Attach a logging errback to a fire-and-forget Deferred."""

    def _log(failure: Failure) -> None:
        log.warning("background operation failed", extra=kv(error=str(failure.value)))

    d.addErrback(_log)
