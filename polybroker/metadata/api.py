"""The MetadataStore seam: a small hierarchical key-value store with versions.

Contract, shared by every implementation (the contract tests in ``tests/contract/`` hold them
to it):

Rule 1: paths are absolute, ``/``-separated, with no trailing slash (except the root ``/``).
Rule 2: ``put`` creates missing parents (as empty, persistent nodes). A node's version starts at 0
        and grows by one on each successful ``put``.
Rule 3: ``expected_version`` is compare-and-set: ``None`` means "any", ``-1`` means "must not
        exist", ``n >= 0`` means "must exist with version n". A mismatch fails with
        ``BadVersionError`` (and nothing changes).
Rule 4: ``delete`` of a node that has children fails with ``NotEmptyError``; of a missing node with
        ``NotFoundError``.
Rule 5: ephemeral nodes belong to the store's session: they vanish when the session ends (``close``,
        expiry, or a process that dies) and are never persisted across a restart.
Rule 6: sequential nodes get a zero-padded, strictly increasing 10-digit suffix, unique per parent,
        never reused (also across restarts of a persistent store).
Rule 7: watches fire once per change of the node they watch (data changed, created, deleted, or its
        children changed), on the reactor thread, after the change is visible to ``get``.
Rule 8: every operation returns a Deferred; callbacks run on the reactor thread.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.defer import Deferred


class MetadataError(Exception):
    """Base of every metadata store failure."""


class BadVersionError(MetadataError):
    """A compare-and-set found another version (or existence) than expected."""


class NotFoundError(MetadataError):
    """The node does not exist."""


class NotEmptyError(MetadataError):
    """The node has children and cannot be deleted."""


class StoreClosedError(MetadataError):
    """The store (or its session) is closed."""


class ConnectionLossError(MetadataError):
    """The connection to the store was lost while the operation was in flight, or it got no
    answer in time: the operation may or may not have been applied."""


@dataclass(frozen=True)
class Stat:
    """What the store knows about one node besides its value."""

    version: int
    ephemeral: bool
    created_ms: int
    modified_ms: int


@dataclass(frozen=True)
class GetResult:
    """A node's value and stat."""

    value: bytes
    stat: Stat


class EventType(enum.Enum):
    CREATED = "created"
    MODIFIED = "modified"
    DELETED = "deleted"
    CHILDREN_CHANGED = "children_changed"


@dataclass(frozen=True)
class Notification:
    """A change of one node, delivered to watchers and listeners."""

    type: EventType
    path: str


class SessionEvent(enum.Enum):
    """Session state changes (ZooKeeper semantics); the embedded store only ever closes."""

    CONNECTION_LOST = "connection_lost"
    RECONNECTED = "reconnected"
    SESSION_LOST = "session_lost"  # ephemeral nodes are gone
    SESSION_REESTABLISHED = "session_reestablished"


class MetadataStore(abc.ABC):
    """Versioned hierarchical metadata; see the module docstring for the contract."""

    @abc.abstractmethod
    def get(self, path: str) -> Deferred[GetResult | None]:
        """Return the node's value and stat, or None if it does not exist."""

    @abc.abstractmethod
    def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        ephemeral: bool = False,
    ) -> Deferred[Stat]:
        """Create or replace a node, honouring ``expected_version`` (Rule 3)."""

    @abc.abstractmethod
    def create_sequential(
        self, prefix: str, value: bytes, *, ephemeral: bool = False
    ) -> Deferred[str]:
        """Create ``prefix + <10 digits>`` (Rule 6) and return its full path."""

    @abc.abstractmethod
    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        """Delete a leaf node, honouring ``expected_version``."""

    @abc.abstractmethod
    def children(self, path: str) -> Deferred[list[str]]:
        """Return the sorted names (not paths) of a node's children; [] if it does not exist."""

    @abc.abstractmethod
    def exists(self, path: str) -> Deferred[Stat | None]:
        """Return the node's stat, or None."""

    @abc.abstractmethod
    def watch(self, path: str, callback: Callable[[Notification], None]) -> Callable[[], None]:
        """Call ``callback`` on every change of ``path`` or its children until the returned
        function is called (persistent watch, Rule 7)."""

    @abc.abstractmethod
    def add_session_listener(self, callback: Callable[[SessionEvent], None]) -> Callable[[], None]:
        """Call ``callback`` on session state changes until the returned function is called."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """End the session (ephemeral nodes go) and release resources. Idempotent."""

    def delete_recursive(self, path: str) -> Deferred[None]:
        """Delete a node and everything under it; missing nodes are fine."""
        from twisted.internet.defer import inlineCallbacks

        @inlineCallbacks
        def run(p: str):  # type: ignore[no-untyped-def]
            for child in (yield self.children(p)):
                yield run(f"{p.rstrip('/')}/{child}")
            with contextlib.suppress(NotFoundError):
                yield self.delete(p)

        return run(path)
