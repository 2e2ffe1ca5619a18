"""The auditor: finds ledger fragments that name a lost bookie and re-replicates them (I22, I23).

Rule A1 (election): every auditor contends for the ephemeral node ``/ledgers/auditor`` through an
        ``EphemeralClaim``; only the holder acts. It stops acting as soon as the claim is not
        ``HELD`` (connection or session lost, released), and a run in progress stops at its next
        step without writing anything more.
Rule A2 (lost): a bookie named in a ledger's ensemble and absent from ``/bookies/available`` is
        lost once this auditor has seen it absent for ``lostBookieRecoveryDelay`` seconds; one
        that comes back is no longer lost.
Rule A3 (what): every fragment of a CLOSED ledger, and every fragment but the last of an OPEN or
        IN_RECOVERY ledger (the writer's ensemble change or the recovery own the last one), that
        names a lost bookie. Each lost member is replaced, at its position, by a registered
        bookie outside that fragment's ensemble (``placement.replace_bookies``).
Rule A4 (copy, then switch: I22): every entry of the fragment whose write set held a lost bookie
        is read from a surviving member of that write set (digest checked) and written to the
        replacement with a recovery add (it passes fencing, as recovery writes do); only when
        every copy was acknowledged is the fragment's ensemble changed in the ledger metadata,
        by compare-and-set on a fresh read that still shows the old ensemble (else nothing is
        written and the next audit plans again). A crash before the CAS leaves the metadata as
        it was; the next audit copies again (adding an entry a bookie holds is idempotent).
Rule A4a (how): the entries of a fragment with one residue modulo E share a write set, so their
        copies share sources and targets. Each such run is read in chunks of at most
        ``COPY_CHUNK_BYTES``, each by one strided read (wire version 3) from the first source
        that answers it, and a chunk's entries are written before the run's next chunk is
        read; the runs go side by side, with at most ``COPY_WINDOW`` copies being written at
        once. Where no source answers a strided read (an older bookie, a missing entry), that
        entry is read alone, source after source.
Rule A5 (visible): a ledger with a fragment naming a lost bookie has a marker
        ``/ledgers/underreplication/<ledger id>`` (JSON: the lost bookies, since when, and
        whether an open last fragment waits for its writer), written before the copy and deleted
        by the first audit that finds no fragment of it naming a lost bookie.
Rule A6 (when): an audit runs when this auditor starts leading, when ``/bookies/available``
        changes, when a lost bookie's delay ends, when a ledger whose open last fragment waits
        for its writer changes, and every ``auditorPeriodicCheckInterval`` seconds; audits never
        overlap (a request during one runs once more after it). A failed audit is retried after
        ``RETRY_S``, doubling while failures repeat (up to ``MAX_RETRY_S``): two lost bookies
        of one write set leave nothing to copy from until one comes back. Timers run on the
        injected reactor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredList,
    DeferredSemaphore,
    TimeoutError,
    gatherResults,
)
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.ledger.api import (
    BookieClient,
    BookieUnavailableError,
    DigestMismatchError,
    LedgerMetadata,
    LedgerState,
    NotEnoughBookiesError,
    StorageError,
)
from polybroker.ledger.bookie.cookie import AVAILABLE_PATH
from polybroker.ledger.client import LEDGERS_PATH, decode_metadata, decode_record, encode_metadata
from polybroker.ledger.placement import replace_bookies
from polybroker.metadata.api import BadVersionError, MetadataError, MetadataStore, NotFoundError
from polybroker.metadata.claim import ClaimState, EphemeralClaim

__all__ = [
    "AUDITOR_PATH",
    "UNDERREPLICATED_PATH",
    "AuditResult",
    "Auditor",
    "EntryCopy",
    "FragmentRepair",
    "LedgerPlan",
    "copy_plan",
    "current_auditor",
    "ledger_ids",
    "lost_bookies",
    "marker_value",
    "next_deadline",
    "plan_ledger",
    "with_fragment_replaced",
]

log = logging.getLogger(__name__)

AUDITOR_PATH = f"{LEDGERS_PATH}/auditor"
UNDERREPLICATED_PATH = f"{LEDGERS_PATH}/underreplication"
RETRY_S = 5.0
MAX_RETRY_S = 120.0
COPY_WINDOW = 128  # copies being written at once
COPY_CHUNK_BYTES = 1024 * 1024  # bytes one strided read of a copy run asks for
METADATA_BATCH = 64  # ledger metadata reads in flight at once
_CAS_ATTEMPTS = 5


# ---------------------------------------------------------------------------------------------
# Decisions (pure)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FragmentRepair:
    """One fragment to re-replicate: entries ``first..last`` (none when last < first) over
    ``ensemble``, whose members ``lost`` are gone."""

    first: int
    last: int
    ensemble: tuple[str, ...]
    lost: tuple[str, ...]


@dataclass(frozen=True)
class LedgerPlan:
    """What one ledger needs: the fragments to repair now, and whether lost bookies remain in
    an open last fragment that its writer (or a recovery) must replace (Rule A3)."""

    lost: tuple[str, ...]
    repairs: tuple[FragmentRepair, ...]
    waiting_for_writer: bool

    @property
    def under_replicated(self) -> bool:
        return bool(self.repairs) or self.waiting_for_writer


@dataclass(frozen=True)
class EntryCopy:
    """Copy entry ``entry_id`` from one of ``sources`` (in order) to every one of ``targets``."""

    entry_id: int
    sources: tuple[str, ...]
    targets: tuple[str, ...]


def ledger_ids(names: Iterable[str]) -> list[int]:
    """The ledger ids among the children of ``/ledgers`` (other names are the auditor's)."""
    return sorted(int(n) for n in names if n.isdigit())


def bookies_of(meta: LedgerMetadata) -> set[str]:
    """Every bookie any fragment of the ledger names."""
    return {a for _, ensemble in meta.fragments for a in ensemble}


def lost_bookies(gone_since: Mapping[str, float], now: float, delay: float) -> set[str]:
    """The bookies absent for at least ``delay`` seconds (Rule A2)."""
    return {a for a, since in gone_since.items() if now - since >= delay}


def next_deadline(gone_since: Mapping[str, float], now: float, delay: float) -> float | None:
    """When the next absent bookie becomes lost (None: none is waiting)."""
    waiting = [since + delay for since in gone_since.values() if now - since < delay]
    return min(waiting) if waiting else None


def plan_ledger(meta: LedgerMetadata, lost: Collection[str]) -> LedgerPlan:
    """Decide which fragments of a ledger to repair now (Rule A3)."""
    named_lost = tuple(sorted(bookies_of(meta) & set(lost)))
    repairs: list[FragmentRepair] = []
    waiting = False
    fragments = meta.fragments
    for i, (first, ensemble) in enumerate(fragments):
        gone = tuple(a for a in ensemble if a in lost)
        if not gone:
            continue
        is_last = i == len(fragments) - 1
        if is_last and meta.state is not LedgerState.CLOSED:
            waiting = True
            continue
        last = meta.last_entry_id if is_last else fragments[i + 1][0] - 1
        repairs.append(FragmentRepair(first, last, ensemble, gone))
    return LedgerPlan(named_lost, tuple(repairs), waiting)


def copy_plan(
    meta: LedgerMetadata, repair: FragmentRepair, replacements: Mapping[str, str]
) -> list[EntryCopy]:
    """The copies a repair makes: each entry whose write set held a replaced bookie goes from
    the surviving members of that write set to the replacements (Rule A4)."""
    ensemble, e, qw = repair.ensemble, meta.ensemble_size, meta.write_quorum
    lost = set(repair.lost)
    out: list[EntryCopy] = []
    for entry_id in range(repair.first, repair.last + 1):
        write_set = [ensemble[(entry_id + k) % e] for k in range(qw)]
        targets = tuple(replacements[a] for a in write_set if a in replacements)
        if targets:
            sources = tuple(a for a in write_set if a not in lost)
            out.append(EntryCopy(entry_id, sources, targets))
    return out


def with_fragment_replaced(
    meta: LedgerMetadata, first: int, old: Sequence[str], new: Sequence[str]
) -> LedgerMetadata | None:
    """The metadata with the fragment starting at ``first`` moved from ``old`` to ``new``, or
    None if that fragment no longer has ``old`` or is an open ledger's last one (Rule A4)."""
    fragments = list(meta.fragments)
    for i, (start, ensemble) in enumerate(fragments):
        if start != first:
            continue
        if tuple(ensemble) != tuple(old):
            return None
        if i == len(fragments) - 1 and meta.state is not LedgerState.CLOSED:
            return None
        fragments[i] = (start, tuple(new))
        return replace(meta, fragments=tuple(fragments))
    return None


def marker_value(plan: LedgerPlan, since_ms: int) -> bytes:
    """What ``/ledgers/underreplication/<id>`` holds (Rule A5)."""
    doc = {
        "lostBookies": list(plan.lost),
        "since": since_ms,
        "fragments": [r.first for r in plan.repairs],
        "waitingForWriter": plan.waiting_for_writer,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _ledger_path(ledger_id: int) -> str:
    return f"{LEDGERS_PATH}/{ledger_id}"


def _marker_path(ledger_id: int) -> str:
    return f"{UNDERREPLICATED_PATH}/{ledger_id}"


async def current_auditor(store: MetadataStore) -> str | None:
    """The address of the bookie whose auditor leads, or None."""
    got = await store.get(AUDITOR_PATH)
    if got is None:
        return None
    try:
        return str(json.loads(got.value)["address"])
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# The auditor
# ---------------------------------------------------------------------------------------------


class _Deposed(Exception):
    """This auditor stopped leading while it worked: it writes nothing more."""


@dataclass
class AuditResult:
    """What one audit found and did."""

    ledgers: int = 0
    repaired_fragments: int = 0
    copied_entries: int = 0
    under_replicated: list[int] = field(default_factory=list)  # still, after this audit
    lost: list[str] = field(default_factory=list)
    failed_repairs: int = 0  # copies or switches that did not succeed: retried after RETRY_S


class Auditor:
    """One contender for the auditor role (see the module rules).

    ``connect`` makes a ``BookieClient`` for an address (as the ledger client's); the clients
    are kept for one audit and closed after it (or when it stops leading)."""

    def __init__(
        self,
        store: MetadataStore,
        connect: Callable[[str], BookieClient],
        reactor: Any,
        *,
        address: str,
        lost_bookie_recovery_delay_s: float = 5.0,
        periodic_check_interval_s: float = 3600.0,
        op_timeout_s: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._connect = connect
        self._reactor = reactor
        self.address = address
        self._delay = max(0.0, lost_bookie_recovery_delay_s)
        self._interval = periodic_check_interval_s
        self._op_timeout = op_timeout_s
        self._rng = rng or random.Random()
        value = json.dumps({"address": address, "id": uuid.uuid4().hex}).encode()
        self._claim = EphemeralClaim(
            store, AUDITOR_PATH, value, contend=True, on_change=self._claim_changed
        )
        self._term = 0
        self._leading = False
        self._gone_since: dict[str, float] = {}
        self._unwatch_available: Callable[[], None] | None = None
        self._ledger_watches: dict[int, Callable[[], None]] = {}
        self._periodic: LoopingCall | None = None
        self._timer: Any = None
        self._running = False
        self._again = False
        self._failures = 0  # audits in a row that failed or left repairs undone
        self._bookies: dict[str, BookieClient] = {}
        self._stopped = False
        self.audits = 0  # audits completed while leading
        self.last_result: AuditResult | None = None

    @property
    def leading(self) -> bool:
        """Whether this auditor is the elected one and acts (Rule A1)."""
        return self._leading

    def start(self) -> Deferred[ClaimState]:
        """Contend for the role; fire with the claim's state after the first attempt."""
        return self._claim.start()

    def stop(self) -> Deferred[None]:
        """Stop for good: give the role up (another auditor takes over) and close connections."""
        self._stopped = True
        d = self._claim.release()
        self._step_down()
        return d

    def audit_now(self) -> None:
        """Ask for an audit (runs at once, or after the one in progress)."""
        self._request_audit()

    # -- leadership -----------------------------------------------------------------------

    def _claim_changed(self, state: ClaimState) -> None:
        if state is ClaimState.HELD and not self._stopped:
            if not self._leading:
                self._lead()
        elif self._leading:
            self._step_down()

    def _lead(self) -> None:
        self._term += 1
        self._leading = True
        log.info("auditor elected", extra=logs.kv(address=self.address))
        self._unwatch_available = self._store.watch(AVAILABLE_PATH, lambda _: self._request_audit())
        if self._interval > 0:
            loop = LoopingCall(self._request_audit)
            loop.clock = self._reactor
            loop.start(self._interval, now=False)
            self._periodic = loop
        self._request_audit()

    def _step_down(self) -> None:
        was_leading = self._leading
        self._term += 1
        self._leading = False
        if self._unwatch_available is not None:
            self._unwatch_available()
            self._unwatch_available = None
        for unwatch in self._ledger_watches.values():
            unwatch()
        self._ledger_watches.clear()
        if self._periodic is not None:
            if self._periodic.running:
                self._periodic.stop()
            self._periodic = None
        self._cancel_timer()
        self._close_bookies()
        if was_leading:
            log.info("auditor no longer leads", extra=logs.kv(address=self.address))

    def _close_bookies(self) -> None:
        # Connections live for one audit: a bookie restarted (or replaced) since is met afresh.
        bookies, self._bookies = list(self._bookies.values()), {}
        for b in bookies:
            b.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _check(self, term: int) -> None:
        if term != self._term or not self._leading:
            raise _Deposed()

    # -- scheduling -----------------------------------------------------------------------

    def _request_audit(self) -> None:
        if not self._leading:
            return
        if self._running:
            self._again = True
            return
        self._running = True
        self._again = False
        term = self._term
        d = Deferred.fromCoroutine(self._audit(term))
        d.addBoth(self._audit_done, term)

    def _audit_done(self, outcome: Any, term: int) -> None:
        self._running = False
        self._close_bookies()
        if isinstance(outcome, Failure):
            if not outcome.check(_Deposed) and term == self._term and self._leading:
                retry = self._retry_delay()
                log.warning(
                    "audit failed, retrying in %ss: %s",
                    retry,
                    outcome.getErrorMessage(),
                    exc_info=None
                    if outcome.check(StorageError, MetadataError)
                    else (outcome.type, outcome.value, outcome.getTracebackObject()),
                )
                self._schedule(self._reactor.seconds() + retry)
        else:
            self.audits += 1
            self.last_result = outcome
        if self._again and self._leading:
            self._request_audit()

    def _retry_delay(self) -> float:
        self._failures += 1
        return min(MAX_RETRY_S, RETRY_S * 2 ** (self._failures - 1))

    def _schedule(self, when: float) -> None:
        """Audit at ``when`` (or earlier, if already planned earlier)."""
        if self._timer is not None and self._timer.active():
            if self._timer.getTime() <= when:
                return
            self._timer.cancel()
        delay = max(0.0, when - self._reactor.seconds())
        self._timer = self._reactor.callLater(delay, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self._request_audit()

    # -- one audit ------------------------------------------------------------------------

    async def _audit(self, term: int) -> AuditResult:
        store = self._store
        available = await store.children(AVAILABLE_PATH)
        self._check(term)
        now = self._reactor.seconds()
        names = await store.children(LEDGERS_PATH)
        self._check(term)
        ids = ledger_ids(names)
        result = AuditResult(ledgers=len(ids))
        absent_named: set[str] = set()
        waiting: set[int] = set()
        for ledger_id, got in await self._metadata_of(term, ids):
            if got is None:
                continue  # deleted meanwhile
            try:
                meta = decode_metadata(got.value)
            except StorageError as e:
                log.error("ledger %d: unreadable metadata: %s", ledger_id, e)
                continue
            absent = bookies_of(meta) - set(available)
            for a in absent:
                self._gone_since.setdefault(a, now)
            absent_named |= absent
            lost = lost_bookies({a: self._gone_since[a] for a in absent}, now, self._delay)
            plan = plan_ledger(meta, lost)
            if not plan.under_replicated:
                continue
            if plan.repairs:
                await self._repair(term, meta, plan, available, now, result)
            else:
                await self._mark(ledger_id, plan, now)
                result.under_replicated.append(ledger_id)
            if ledger_id in result.under_replicated and plan.waiting_for_writer:
                waiting.add(ledger_id)
        # Forget bookies that came back or that no ledger names any more.
        self._gone_since = {a: s for a, s in self._gone_since.items() if a in absent_named}
        result.lost = sorted(lost_bookies(self._gone_since, now, self._delay))
        await self._clear_markers(term, set(result.under_replicated))
        self._watch_waiting(waiting)
        deadline = next_deadline(self._gone_since, now, self._delay)
        if deadline is not None:
            self._schedule(deadline)
        if result.failed_repairs:
            self._schedule(now + self._retry_delay())
        else:
            self._failures = 0
        if result.repaired_fragments or result.under_replicated:
            log.info(
                "audit done",
                extra=logs.kv(
                    ledgers=result.ledgers,
                    repaired_fragments=result.repaired_fragments,
                    copied_entries=result.copied_entries,
                    under_replicated=len(result.under_replicated),
                    lost=",".join(result.lost),
                ),
            )
        return result

    async def _metadata_of(self, term: int, ids: list[int]) -> list[tuple[int, Any]]:
        """Read the ledgers' metadata nodes, ``METADATA_BATCH`` requests in flight at a time."""
        out: list[tuple[int, Any]] = []
        for i in range(0, len(ids), METADATA_BATCH):
            batch = ids[i : i + METADATA_BATCH]
            gots = await gatherResults(
                [self._store.get(_ledger_path(lid)) for lid in batch], consumeErrors=True
            ).addErrback(lambda f: f.value.subFailure)
            self._check(term)
            out.extend(zip(batch, gots, strict=True))
        return out

    async def _repair(
        self,
        term: int,
        meta: LedgerMetadata,
        plan: LedgerPlan,
        available: list[str],
        now: float,
        result: AuditResult,
    ) -> None:
        ledger_id = meta.ledger_id
        await self._mark(ledger_id, plan, now)
        self._check(term)
        complete = not plan.waiting_for_writer
        for repair in plan.repairs:
            try:
                new_ensemble = replace_bookies(
                    repair.ensemble, set(repair.lost), available, self._rng
                )
            except NotEnoughBookiesError as e:
                log.warning(
                    "ledger %d: cannot re-replicate fragment %d: %s", ledger_id, repair.first, e
                )
                complete = False
                continue
            replacements = {
                old: new
                for old, new in zip(repair.ensemble, new_ensemble, strict=True)
                if old != new
            }
            copies = copy_plan(meta, repair, replacements)
            try:
                await self._copy(term, ledger_id, copies, meta.ensemble_size)
            except StorageError as e:
                log.warning("ledger %d: copying fragment %d failed: %s", ledger_id, repair.first, e)
                complete = False
                result.failed_repairs += 1
                continue
            outcome = await self._commit(term, ledger_id, repair, new_ensemble)
            if outcome is None:
                # The ledger was deleted meanwhile: the copies are garbage on the replacements.
                await self._forget(ledger_id, list(replacements.values()))
                return
            if not outcome:
                complete = False  # it changed under us: the next audit plans again
                result.failed_repairs += 1
                continue
            result.repaired_fragments += 1
            result.copied_entries += len(copies)
            log.info(
                "fragment re-replicated",
                extra=logs.kv(
                    ledger=ledger_id,
                    first_entry=repair.first,
                    replaced=",".join(f"{a}->{b}" for a, b in replacements.items()),
                    entries=len(copies),
                ),
            )
        self._check(term)
        if complete:
            await self._unmark(ledger_id)
        else:
            result.under_replicated.append(ledger_id)

    async def _mark(self, ledger_id: int, plan: LedgerPlan, now: float) -> None:
        path = _marker_path(ledger_id)
        got = await self._store.get(path)
        since_ms = int(now * 1000)
        if got is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                since_ms = int(json.loads(got.value)["since"])
        value = marker_value(plan, since_ms)
        if got is None or got.value != value:
            await self._store.put(path, value)

    async def _unmark(self, ledger_id: int) -> None:
        with contextlib.suppress(NotFoundError):
            await self._store.delete(_marker_path(ledger_id))

    async def _clear_markers(self, term: int, keep: set[int]) -> None:
        names = await self._store.children(UNDERREPLICATED_PATH)
        for ledger_id in ledger_ids(names):
            if ledger_id not in keep:
                self._check(term)
                await self._unmark(ledger_id)

    def _watch_waiting(self, waiting: set[int]) -> None:
        """Audit again when a ledger whose open last fragment waits for its writer changes."""
        for ledger_id in list(self._ledger_watches):
            if ledger_id not in waiting:
                self._ledger_watches.pop(ledger_id)()
        for ledger_id in waiting:
            if ledger_id not in self._ledger_watches:
                self._ledger_watches[ledger_id] = self._store.watch(
                    _ledger_path(ledger_id), lambda _: self._request_audit()
                )

    # -- copying and switching ------------------------------------------------------------

    def _bookie(self, address: str) -> BookieClient:
        client = self._bookies.get(address)
        if client is None:
            client = self._bookies[address] = self._connect(address)
        return client

    def _timed(self, d: Deferred[Any], what: str) -> Deferred[Any]:
        seconds = self._op_timeout

        def timed_out(f: Failure) -> Failure:
            if f.check(CancelledError, TimeoutError):
                return Failure(BookieUnavailableError(f"{what} timed out after {seconds}s"))
            return f

        d.addTimeout(seconds, self._reactor)
        return d.addErrback(timed_out)

    async def _copy(self, term: int, ledger_id: int, copies: list[EntryCopy], stride: int) -> None:
        """Make every copy (Rule A4a): the copies of one residue modulo ``stride`` (one write
        set: the same sources and targets) are read in strided chunks and written, the runs
        side by side; after a failure nothing more is started, and once what is in flight is
        done the first failure is raised."""
        runs: dict[int, list[EntryCopy]] = {}
        for c in copies:  # ascending: each run's entries are ``stride`` apart
            runs.setdefault(c.entry_id % stride, []).append(c)
        window = DeferredSemaphore(COPY_WINDOW)
        failures: list[Failure] = []
        await DeferredList(
            [
                Deferred.fromCoroutine(
                    self._copy_run(term, ledger_id, run, stride, window, failures)
                ).addErrback(failures.append)
                for run in runs.values()
            ]
        )
        if failures:
            failures[0].raiseException()

    async def _copy_run(
        self,
        term: int,
        ledger_id: int,
        run: list[EntryCopy],
        stride: int,
        window: DeferredSemaphore,
        failures: list[Failure],
    ) -> None:
        i = 0
        while i < len(run) and not failures:
            self._check(term)
            c = run[i]
            got = await self._read_strided(ledger_id, run[i:], stride)
            if not got:  # no source reads strided: this entry alone, from any source
                got = [await self._read_verified(ledger_id, c.entry_id, c.sources)]
            self._check(term)
            writes = [
                window.run(self._write_copy, ledger_id, copy, raw, lac).addErrback(failures.append)
                for copy, (raw, lac) in zip(run[i : i + len(got)], got, strict=True)
            ]
            await DeferredList(writes)
            i += len(got)

    async def _read_strided(
        self, ledger_id: int, run: list[EntryCopy], stride: int
    ) -> list[tuple[bytes, int]]:
        """The entries of ``run`` (``stride`` apart, one write set) with their LACs: a prefix of
        them, at most ``COPY_CHUNK_BYTES`` and up to the first that fails its digest, from the
        first of their sources that reads them strided; [] if none does."""
        first, last = run[0].entry_id, run[-1].entry_id
        for address in run[0].sources:
            try:
                results = await self._timed(
                    self._bookie(address).read_range(
                        ledger_id, first, last, COPY_CHUNK_BYTES, stride
                    ),
                    f"read {ledger_id}:{first}..{last}/{stride} on {address}",
                )
            except StorageError as e:
                log.debug("ledger %d: strided read on %s: %s", ledger_id, address, e)
                continue
            out: list[tuple[bytes, int]] = []
            for k, r in enumerate(results):
                try:
                    if k >= len(run) or r.entry_id != run[k].entry_id:
                        raise DigestMismatchError(f"{ledger_id}: entry {r.entry_id} out of place")
                    out.append((r.data, decode_record(ledger_id, r.entry_id, r.data)[1]))
                except DigestMismatchError as e:
                    log.warning("ledger %d: strided read on %s: %s", ledger_id, address, e)
                    break  # the good prefix is kept; the bad entry is looked for elsewhere
            if out:
                return out
        return []

    async def _write_copy(self, ledger_id: int, c: EntryCopy, raw: bytes, lac: int) -> None:
        await gatherResults(
            [
                self._timed(
                    self._bookie(t).add_entry(ledger_id, c.entry_id, lac, raw, recovery=True),
                    f"copy of {ledger_id}:{c.entry_id} to {t}",
                )
                for t in c.targets
            ],
            consumeErrors=True,
        ).addErrback(lambda f: f.value.subFailure)

    async def _read_verified(
        self, ledger_id: int, entry_id: int, sources: Sequence[str]
    ) -> tuple[bytes, int]:
        errors: list[str] = []
        for address in sources:
            try:
                raw = await self._timed(
                    self._bookie(address).read_entry(ledger_id, entry_id),
                    f"read {ledger_id}:{entry_id} on {address}",
                )
                _, lac, _ = decode_record(ledger_id, entry_id, raw)
                return raw, lac
            except (StorageError, DigestMismatchError) as e:
                errors.append(f"{address}: {e}")
        raise BookieUnavailableError(
            f"no surviving replica of {ledger_id}:{entry_id} could be read ({'; '.join(errors)})"
        )

    async def _commit(
        self, term: int, ledger_id: int, repair: FragmentRepair, new: tuple[str, ...]
    ) -> bool | None:
        """Switch the fragment's ensemble by CAS; True once done, False if the fragment changed
        under us, None if the ledger is gone."""
        path = _ledger_path(ledger_id)
        for _ in range(_CAS_ATTEMPTS):
            self._check(term)
            got = await self._store.get(path)
            if got is None:
                return None
            changed = with_fragment_replaced(
                decode_metadata(got.value), repair.first, repair.ensemble, new
            )
            if changed is None:
                return False
            self._check(term)
            try:
                await self._store.put(path, encode_metadata(changed), got.stat.version)
                return True
            except BadVersionError:
                continue  # someone else changed it: look again
            except NotFoundError:
                return None
        return False

    async def _forget(self, ledger_id: int, addresses: list[str]) -> None:
        for address in addresses:
            try:
                await self._timed(
                    self._bookie(address).delete_ledger(ledger_id), f"delete on {address}"
                )
            except StorageError as e:
                log.info("ledger %d: delete on %s: %s", ledger_id, address, e)
