"""Ownership through an ephemeral node, kept honestly across sessions: the building block for
bundle ownership (a broker owns a bundle while it holds the bundle's node) and for elections (an
auditor leads while it holds the election node).

Rule C1: ``start()`` tries to create ``path`` as an ephemeral node holding ``value`` (compare-and-
        set on "must not exist"). The claimant's ``value`` must be unique to it (e.g. its address
        and an instance id): after an operation whose outcome was unknown, a node holding exactly
        that value is taken as this claimant's own.
Rule C2: ``HELD`` means the node exists, belongs to this session, and the connection is up. A lost
        connection makes it ``SUSPENDED`` (the session may expire meanwhile: do not act as owner);
        the same session back makes it ``HELD`` again. A lost session makes it ``PENDING`` and,
        once a new session exists, the claim is tried again: it may come back ``HELD``, or be
        held by someone else by then. Ownership is never assumed kept across a session loss.
Rule C3: when someone else holds the node, a contending claim (``contend=True``) stays
        ``PENDING`` and tries again each time the node is deleted; a non-contending one becomes
        ``RELEASED``. A held node deleted by someone else (an admin unloading it) is lost the
        same way.
Rule C4: ``release()`` deletes the node if this claimant holds it and stops the claim for good
        (``RELEASED``); it is idempotent. ``on_change`` is called with each new state, on the
        reactor thread.
Rule C5: a node whose value ``supersedes`` says was left by an earlier run of this claimant (a
        process now dead whose session has not expired yet) is deleted, by compare-and-set on
        its version, and the claim tried again: a restarted claimant does not wait out the
        session of the process it replaces. Once per claim: an earlier run that claims the
        node again is alive after all, and is contended with as anyone else (no deleting war).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from polybroker.metadata.api import (
    BadVersionError,
    EventType,
    MetadataStore,
    Notification,
    SessionEvent,
)

log = logging.getLogger(__name__)


class ClaimState(enum.Enum):
    PENDING = "pending"
    HELD = "held"
    SUSPENDED = "suspended"
    RELEASED = "released"


class EphemeralClaim:
    """One claimant's claim on one path (see the module docstring)."""

    def __init__(
        self,
        store: MetadataStore,
        path: str,
        value: bytes,
        *,
        contend: bool = False,
        on_change: Callable[[ClaimState], None] | None = None,
        supersedes: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.store = store
        self.supersedes = supersedes
        self._took_over = False  # Rule C5 was used
        self.path = path
        self.value = value
        self.contend = contend
        self._on_change = on_change
        self._state = ClaimState.PENDING
        self._started = False
        self._stopped = False
        self._in_flight = False
        self._again = False
        self._connected = True
        self._first: Deferred[ClaimState] | None = None
        self._unwatch: Callable[[], None] | None = None
        self._unlisten: Callable[[], None] | None = None

    @property
    def state(self) -> ClaimState:
        return self._state

    @property
    def held(self) -> bool:
        """Whether the claimant may act as owner now (``HELD``)."""
        return self._state is ClaimState.HELD

    def start(self) -> Deferred[ClaimState]:
        """Begin claiming; fire with the state after the first attempt (``HELD``, ``PENDING``
        when contending or when the store could not be reached, ``RELEASED`` when someone else
        holds it and this claim does not contend)."""
        if self._started:
            raise RuntimeError("a claim starts once")
        self._started = True
        first: Deferred[ClaimState] = Deferred()
        self._first = first
        self._unwatch = self.store.watch(self.path, self._changed)
        self._unlisten = self.store.add_session_listener(self._session_event)
        self._attempt()
        return first

    def release(self) -> Deferred[None]:
        """Give the claim up (Rule C4)."""
        was_held = self._state in (ClaimState.HELD, ClaimState.SUSPENDED)
        self._finish()
        if not was_held:
            return succeed(None)

        def delete_ours(got: Any) -> Deferred[None] | None:
            if got is None or got.value != self.value:
                return None  # not ours (any more): nothing to delete
            return self.store.delete(self.path, got.stat.version)

        d = self.store.get(self.path).addCallback(delete_ours)
        return d.addErrback(self._log_release_failure)

    # -- internals ------------------------------------------------------------------------------

    def _set(self, state: ClaimState) -> None:
        if state is self._state:
            return
        self._state = state
        if self._on_change is not None:
            try:
                self._on_change(state)
            except Exception:
                log.exception("claim listener failed for %s", self.path)

    def _finish(self) -> None:
        self._stopped = True
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self._set(ClaimState.RELEASED)
        self._fire_first()

    def _fire_first(self) -> None:
        if self._first is not None:
            first, self._first = self._first, None
            first.callback(self._state)

    def _attempt(self) -> None:
        if self._stopped:
            return
        if self._in_flight:
            self._again = True
            return
        self._in_flight = True
        self._again = False
        d = self.store.put(self.path, self.value, expected_version=-1, ephemeral=True)
        d.addCallbacks(self._created, self._refused)

    def _created(self, _: object) -> None:
        self._in_flight = False
        if self._stopped:
            return
        self._set(ClaimState.HELD if self._connected else ClaimState.SUSPENDED)
        self._fire_first()

    def _refused(self, failure: Failure) -> None:
        if failure.check(BadVersionError) is None:
            # Unknown outcome (connection lost) or another error: try again when the store
            # reports the session back; the node may turn out to be ours (Rule C1).
            self._in_flight = False
            log.warning("claiming %s failed: %s", self.path, failure.getErrorMessage())
            self._fire_first()
            return
        self.store.get(self.path).addCallbacks(self._holder, self._holder_unknown)

    def _holder(self, got: Any) -> None:
        self._in_flight = False
        if self._stopped:
            return
        if got is not None and got.value == self.value and got.stat.ephemeral:
            self._created(None)
            return
        if got is None or self._again:
            self._attempt()  # the holder went meanwhile
            return
        if self.supersedes is not None and not self._took_over and self.supersedes(got.value):
            log.info("claim %s: taking it over from an earlier run", self.path)
            self._took_over = True
            self._in_flight = True
            d = self.store.delete(self.path, got.stat.version)
            d.addBoth(self._cleared)
            return
        if self.contend:
            self._set(ClaimState.PENDING)
            self._fire_first()
        else:
            self._finish()

    def _cleared(self, result: object) -> None:
        """An earlier run's node was deleted (or changed meanwhile): claim again (Rule C5)."""
        self._in_flight = False
        if isinstance(result, Failure) and result.check(BadVersionError) is None:
            log.warning("taking %s over failed: %s", self.path, result.getErrorMessage())
            self._fire_first()
            return
        self._attempt()

    def _holder_unknown(self, failure: Failure) -> None:
        self._in_flight = False
        log.warning("reading the holder of %s failed: %s", self.path, failure.getErrorMessage())
        self._fire_first()

    def _changed(self, n: Notification) -> None:
        if self._stopped or n.type is not EventType.DELETED:
            return
        if self._state in (ClaimState.HELD, ClaimState.SUSPENDED):
            if self.contend:
                self._set(ClaimState.PENDING)
            else:
                self._finish()
                return
        if self._in_flight:
            self._again = True
        elif self._state is ClaimState.PENDING and self.contend:
            self._attempt()

    def _session_event(self, event: SessionEvent) -> None:
        if self._stopped:
            return
        if event is SessionEvent.CONNECTION_LOST:
            self._connected = False
            if self._state is ClaimState.HELD:
                self._set(ClaimState.SUSPENDED)
        elif event is SessionEvent.RECONNECTED:
            self._connected = True
            if self._state is ClaimState.SUSPENDED:
                self._set(ClaimState.HELD)
            elif self._state is ClaimState.PENDING:
                self._attempt()
        elif event is SessionEvent.SESSION_LOST:
            self._connected = False
            self._set(ClaimState.PENDING)
        elif event is SessionEvent.SESSION_REESTABLISHED:
            self._connected = True
            self._attempt()

    def _log_release_failure(self, failure: Failure) -> None:
        log.warning("releasing %s failed: %s", self.path, failure.getErrorMessage())
