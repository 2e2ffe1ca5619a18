"""The in-memory MetadataStore: one tree of nodes shared by any number of sessions.

``MemoryTree`` holds the nodes; each ``MemoryMetadataStore`` is one session attached to a tree
(``MemoryMetadataStore(clock)`` starts a new tree, ``store.new_session()`` attaches another
session to the same one), so a test can model several brokers over one ZooKeeper ensemble. The
embedded store builds on the same tree (``TreeSession``), adding a log and snapshots.

Beyond the contract in ``api.py``, these hold here:

Rule M1: operations complete synchronously: the returned Deferred has already fired.
Rule M2: watch callbacks run synchronously once the change is applied (so it is visible to
        ``get``), before the operation's Deferred is handed back. A change made from inside a
        callback is queued and delivered after the current one has reached every watcher, so
        all watchers see all changes in the order they happened. One operation notifies top
        down: each node it creates gives ``CREATED(node)`` then ``CHILDREN_CHANGED(parent)``; a
        delete gives ``DELETED(node)`` then ``CHILDREN_CHANGED(parent)``; an update ``MODIFIED``.
Rule M3: ``ephemeral`` applies when a node is created; updating a node keeps its kind and owner.
        Ephemeral nodes cannot have children (as in ZooKeeper): such a ``put`` fails with
        ``MetadataError`` and changes nothing.
Rule M4: a node's sequence counter starts at the highest counter any deleted node had (the
        floor), so a parent that is deleted and created again never reuses a suffix (Rule 6),
        while the tree keeps no state for nodes that are gone.
Rule M5: ``expire_session()`` models a ZooKeeper session expiry: the session's ephemeral nodes
        go (other sessions' watchers see it; the expired session's own do not, as its
        connection was down), its listeners get ``SESSION_LOST`` and then, unless told
        otherwise, ``SESSION_REESTABLISHED`` with a new session that keeps its watches.
Rule M6: paths hold at most ``MAX_PATH_BYTES`` bytes of UTF-8, without empty, ``.`` or ``..``
        names or NUL; values are bytes of at most ``MAX_VALUE_BYTES``. Anything else fails the
        operation's Deferred with ``ValueError`` (``TypeError`` for a wrong type).
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from polybroker.metadata.api import (
    BadVersionError,
    EventType,
    GetResult,
    MetadataError,
    MetadataStore,
    NotEmptyError,
    NotFoundError,
    Notification,
    SessionEvent,
    Stat,
    StoreClosedError,
)

log = logging.getLogger(__name__)

MAX_PATH_BYTES = 4096
# ZooKeeper refuses packets over jute.maxbuffer (about 1 MiB) by default: keep every store alike.
MAX_VALUE_BYTES = 1024 * 1024
SEQUENCE_DIGITS = 10
MAX_SEQUENCE = 10**SEQUENCE_DIGITS - 1


def validate_path(path: object) -> str:
    """Return ``path`` if it is a valid node path (Rule 1, Rule M6); raise otherwise."""
    if not isinstance(path, str):
        raise TypeError(f"a metadata path is a str, got {type(path).__name__}")
    if path == "/":
        return path
    if not path.startswith("/") or path.endswith("/"):
        raise ValueError(f"invalid metadata path {path!r}: absolute, no trailing '/'")
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise ValueError(f"invalid metadata path: longer than {MAX_PATH_BYTES} bytes")
    for name in path[1:].split("/"):
        if name in ("", ".", "..") or "\x00" in name:
            raise ValueError(f"invalid metadata path {path!r}: bad name {name!r}")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid metadata path {path!r}: not encodable as UTF-8") from e
    return path


def validate_value(value: object) -> bytes:
    """Return ``value`` as bytes if it is a valid node value (Rule M6); raise otherwise."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, bytearray | memoryview):
        data = bytes(value)
    else:
        raise TypeError(f"a metadata value is bytes, got {type(value).__name__}")
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(f"metadata value of {len(data)} bytes exceeds {MAX_VALUE_BYTES}")
    return data


def parent_of(path: str) -> str:
    """Return the parent path of a non-root path."""
    head = path.rpartition("/")[0]
    return head or "/"


def child_path(parent: str, name: str) -> str:
    """Return the path of child ``name`` of ``parent``."""
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


# ---------------------------------------------------------------------------------------------
# Mutations: what changed in the persistent part of a tree, replayable by ``MemoryTree.apply``
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetNode:
    """A persistent node now has exactly this state (created if missing; its parent exists)."""

    path: str
    value: bytes
    version: int
    created_ms: int
    modified_ms: int
    next_seq: int


@dataclass(frozen=True, slots=True)
class DeleteNode:
    """A persistent leaf node was deleted."""

    path: str


@dataclass(frozen=True, slots=True)
class SetSequence:
    """A persistent node's sequence counter moved on."""

    path: str
    next_seq: int


Mutation = SetNode | DeleteNode | SetSequence


@dataclass(slots=True)
class Changes:
    """What one operation changed: notifications to deliver and persistent mutations to log."""

    notifications: list[Notification] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)


@dataclass(slots=True)
class Node:
    """One node of a tree; ``owner`` is the session id of an ephemeral node, else None."""

    value: bytes
    version: int
    owner: int | None
    created_ms: int
    modified_ms: int
    next_seq: int
    children: set[str] = field(default_factory=set)

    def stat(self) -> Stat:
        return Stat(self.version, self.owner is not None, self.created_ms, self.modified_ms)


class MemoryTree:
    """The nodes, sequence floor and sessions of one in-memory namespace.

    Write methods validate everything before they change anything, so a failed operation
    changes nothing; they record what they did in the ``Changes`` they are given."""

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        now = self.now_ms()
        self._nodes: dict[str, Node] = {"/": Node(b"", 0, None, now, now, 0)}
        self._ephemerals: dict[int, set[str]] = {}
        self.seq_floor = 0
        self._sessions: dict[int, TreeSession] = {}
        self._next_session_id = 1
        self._queue: deque[tuple[Notification, TreeSession | None]] = deque()
        self._dispatching = False

    def now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    def __len__(self) -> int:
        return len(self._nodes)

    # -- reads --------------------------------------------------------------------------------

    def get(self, path: str) -> GetResult | None:
        node = self._nodes.get(validate_path(path))
        return None if node is None else GetResult(node.value, node.stat())

    def exists(self, path: str) -> Stat | None:
        node = self._nodes.get(validate_path(path))
        return None if node is None else node.stat()

    def children(self, path: str) -> list[str]:
        node = self._nodes.get(validate_path(path))
        return [] if node is None else sorted(node.children)

    # -- writes -------------------------------------------------------------------------------

    def put(
        self,
        owner: int,
        path: str,
        value: object,
        expected_version: int | None,
        ephemeral: bool,
        changes: Changes,
    ) -> Stat:
        """Create or update ``path`` (Rules 2, 3, M3); ``owner`` is the calling session."""
        validate_path(path)
        data = validate_value(value)
        node = self._nodes.get(path)
        _check_version(path, node, expected_version)
        now = self.now_ms()
        if node is not None:
            node.value = data
            node.version += 1
            node.modified_ms = now
            changes.notifications.append(Notification(EventType.MODIFIED, path))
            if node.owner is None:
                changes.mutations.append(self._set_mutation(path, node))
            return node.stat()
        missing = self._missing_ancestors(path)
        for p in missing:
            self._create(p, b"", None, now, changes)
        return self._create(path, data, owner if ephemeral else None, now, changes).stat()

    def create_sequential(
        self, owner: int, prefix: str, value: object, ephemeral: bool, changes: Changes
    ) -> str:
        """Create ``prefix`` + the parent's next 10-digit suffix (Rules 6, M4); return its path."""
        if not isinstance(prefix, str):
            raise TypeError(f"a metadata path prefix is a str, got {type(prefix).__name__}")
        validate_path(prefix + "0" * SEQUENCE_DIGITS)
        data = validate_value(value)
        parent_path = parent_of(prefix + "0")
        parent = self._nodes.get(parent_path)
        missing = self._missing_ancestors(prefix + "0")
        seq = self.seq_floor if parent is None else parent.next_seq
        while True:
            # Skip suffixes someone took by hand with a plain put: unique beats dense.
            if seq > MAX_SEQUENCE:
                raise MetadataError(f"sequence numbers under {parent_path} are exhausted")
            path = f"{prefix}{seq:0{SEQUENCE_DIGITS}d}"
            if path not in self._nodes:
                break
            seq += 1
        now = self.now_ms()
        for p in missing:
            self._create(p, b"", None, now, changes)
        parent = self._nodes[parent_path]
        parent.next_seq = seq + 1
        if parent.owner is None:
            changes.mutations.append(SetSequence(parent_path, parent.next_seq))
        self._create(path, data, owner if ephemeral else None, now, changes)
        return path

    def delete(self, path: str, expected_version: int | None, changes: Changes) -> None:
        """Delete a leaf node (Rules 3, 4)."""
        validate_path(path)
        if path == "/":
            raise ValueError("the root node cannot be deleted")
        node = self._nodes.get(path)
        if node is None:
            raise NotFoundError(path)
        _check_version(path, node, expected_version)
        if node.children:
            raise NotEmptyError(f"{path} has {len(node.children)} children")
        self._remove(path, node, changes)

    def remove_ephemerals(self, owner: int, changes: Changes) -> None:
        """Delete every ephemeral node of session ``owner`` (they have no children)."""
        for path in sorted(self._ephemerals.pop(owner, ())):
            node = self._nodes.get(path)
            if node is not None:
                self._remove(path, node, changes)

    # -- persistence support ------------------------------------------------------------------

    def apply(self, mutation: Mutation) -> None:
        """Replay one persistent mutation; raise ``MetadataError`` if it does not fit."""
        if isinstance(mutation, SetNode):
            node = self._nodes.get(mutation.path)
            if node is None:
                parent = self._nodes.get(parent_of(mutation.path))
                if parent is None or parent.owner is not None:
                    raise MetadataError(f"replayed node {mutation.path} has no parent")
                node = Node(b"", 0, None, 0, 0, 0)
                self._nodes[mutation.path] = node
                parent.children.add(mutation.path.rpartition("/")[2])
            node.value = mutation.value
            node.version = mutation.version
            node.created_ms = mutation.created_ms
            node.modified_ms = mutation.modified_ms
            node.next_seq = mutation.next_seq
        elif isinstance(mutation, DeleteNode):
            node = self._nodes.get(mutation.path)
            if node is None or node.children or mutation.path == "/":
                raise MetadataError(f"replayed delete of {mutation.path} does not fit")
            self._remove(mutation.path, node, Changes())
        else:
            node = self._nodes.get(mutation.path)
            if node is None:
                raise MetadataError(f"replayed sequence of missing node {mutation.path}")
            node.next_seq = mutation.next_seq

    def persistent_nodes(self) -> Iterator[tuple[str, Node]]:
        """Yield every persistent node, parents before children (the root first)."""
        stack = ["/"]
        while stack:
            path = stack.pop()
            node = self._nodes[path]
            if node.owner is not None:
                continue
            yield path, node
            stack.extend(child_path(path, name) for name in sorted(node.children, reverse=True))

    # -- sessions and notifications -----------------------------------------------------------

    def attach(self, session: TreeSession) -> int:
        """Register a session (it receives notifications); return its new session id."""
        sid = self._next_session_id
        self._next_session_id += 1
        self._sessions[sid] = session
        return sid

    def detach(self, session_id: int) -> None:
        self._sessions.pop(session_id, None)

    def notify(self, notifications: list[Notification], exclude: TreeSession | None = None) -> None:
        """Deliver notifications to every attached session's watchers, in order (Rule M2)."""
        if not notifications:
            return
        self._queue.extend((n, exclude) for n in notifications)
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._queue:
                notification, skip = self._queue.popleft()
                for session in list(self._sessions.values()):
                    if session is not skip:
                        session.deliver_notification(notification)
        finally:
            self._dispatching = False

    # -- internals ----------------------------------------------------------------------------

    def _missing_ancestors(self, path: str) -> list[str]:
        """Return the missing ancestors of ``path``, top down; refuse an ephemeral parent."""
        missing = []
        p = parent_of(path)
        while p not in self._nodes:
            missing.append(p)
            p = parent_of(p)
        if self._nodes[p].owner is not None:
            raise MetadataError(f"{p} is ephemeral: ephemeral nodes cannot have children")
        missing.reverse()
        return missing

    def _create(
        self, path: str, value: bytes, owner: int | None, now: int, changes: Changes
    ) -> Node:
        parent_path = parent_of(path)
        node = Node(value, 0, owner, now, now, self.seq_floor)
        self._nodes[path] = node
        self._nodes[parent_path].children.add(path.rpartition("/")[2])
        if owner is not None:
            self._ephemerals.setdefault(owner, set()).add(path)
        else:
            changes.mutations.append(self._set_mutation(path, node))
        changes.notifications.append(Notification(EventType.CREATED, path))
        changes.notifications.append(Notification(EventType.CHILDREN_CHANGED, parent_path))
        return node

    def _remove(self, path: str, node: Node, changes: Changes) -> None:
        parent_path = parent_of(path)
        del self._nodes[path]
        self._nodes[parent_path].children.discard(path.rpartition("/")[2])
        self.seq_floor = max(self.seq_floor, node.next_seq)
        if node.owner is not None:
            owned = self._ephemerals.get(node.owner)
            if owned is not None:
                owned.discard(path)
        else:
            changes.mutations.append(DeleteNode(path))
        changes.notifications.append(Notification(EventType.DELETED, path))
        changes.notifications.append(Notification(EventType.CHILDREN_CHANGED, parent_path))

    @staticmethod
    def _set_mutation(path: str, node: Node) -> SetNode:
        return SetNode(
            path, node.value, node.version, node.created_ms, node.modified_ms, node.next_seq
        )


def _check_version(path: str, node: Node | None, expected: int | None) -> None:
    """Apply Rule 3's compare-and-set to ``node`` (None when missing)."""
    if expected is None:
        return
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < -1:
        raise ValueError(f"expected_version must be None, -1 or >= 0, got {expected!r}")
    if expected == -1:
        if node is not None:
            raise BadVersionError(f"{path} exists (version {node.version}), expected none")
    elif node is None:
        raise BadVersionError(f"{path} does not exist, expected version {expected}")
    elif node.version != expected:
        raise BadVersionError(f"{path} is at version {node.version}, expected {expected}")


class Watch:
    """One registered watch; identity matters (the same callback may be registered twice).
    Shared by the stores that keep their own watch lists."""

    __slots__ = ("active", "callback")

    def __init__(self, callback: Callable[[Notification], None]) -> None:
        self.callback = callback
        self.active = True


class TreeSession(MetadataStore):
    """One session over a ``MemoryTree``: the contract's operations, watches and listeners.

    Subclasses decide when an operation's outcome is delivered (``_complete``) and how the
    session ends (``close``)."""

    def __init__(self, tree: MemoryTree) -> None:
        self._tree = tree
        self._session_id = tree.attach(self)
        self._watches: dict[str, list[Watch]] = {}
        self._listeners: list[Callable[[SessionEvent], None]] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the contract -------------------------------------------------------------------------

    def get(self, path: str) -> Deferred[GetResult | None]:
        return self._run(lambda changes: self._tree.get(path))

    def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        ephemeral: bool = False,
    ) -> Deferred[Stat]:
        sid = self._session_id
        return self._run(
            lambda changes: self._tree.put(sid, path, value, expected_version, ephemeral, changes)
        )

    def create_sequential(
        self, prefix: str, value: bytes, *, ephemeral: bool = False
    ) -> Deferred[str]:
        sid = self._session_id
        return self._run(
            lambda changes: self._tree.create_sequential(sid, prefix, value, ephemeral, changes)
        )

    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        return self._run(lambda changes: self._tree.delete(path, expected_version, changes))

    def children(self, path: str) -> Deferred[list[str]]:
        return self._run(lambda changes: self._tree.children(path))

    def exists(self, path: str) -> Deferred[Stat | None]:
        return self._run(lambda changes: self._tree.exists(path))

    def watch(self, path: str, callback: Callable[[Notification], None]) -> Callable[[], None]:
        """Register a persistent watch; raise ``StoreClosedError`` once closed."""
        self._check_open()
        validate_path(path)
        w = Watch(callback)
        self._watches.setdefault(path, []).append(w)

        def unwatch() -> None:
            w.active = False
            registered = self._watches.get(path)
            if registered is not None and w in registered:
                registered.remove(w)
                if not registered:
                    del self._watches[path]

        return unwatch

    def add_session_listener(self, callback: Callable[[SessionEvent], None]) -> Callable[[], None]:
        self._check_open()
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    # -- for the tree and subclasses ----------------------------------------------------------

    def deliver_notification(self, notification: Notification) -> None:
        """Call this session's watchers of ``notification.path`` (the tree calls this)."""
        for w in list(self._watches.get(notification.path, ())):
            if not w.active:
                continue
            try:
                w.callback(notification)
            except Exception:
                # A failing watcher must not stop delivery to the others, nor the store.
                log.exception("metadata watch callback failed for %s", notification.path)

    def _emit(self, event: SessionEvent) -> None:
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:
                log.exception("metadata session listener failed on %s", event.value)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the metadata store session is closed")

    def _run(self, op: Callable[[Changes], Any]) -> Deferred[Any]:
        if self._closed:
            return fail(StoreClosedError("the metadata store session is closed"))
        changes = Changes()
        try:
            result = op(changes)
        except Exception:
            return self._complete(Failure(), changes)
        return self._complete(result, changes)

    @abc.abstractmethod
    def _complete(self, outcome: Any, changes: Changes) -> Deferred[Any]:
        """Deliver ``changes.notifications`` and ``outcome`` (a value or a Failure)."""


class MemoryMetadataStore(TreeSession):
    """An in-memory session (see the module docstring); ``clock`` stamps nodes' times."""

    def __init__(self, clock: IReactorTime, *, tree: MemoryTree | None = None) -> None:
        super().__init__(tree if tree is not None else MemoryTree(clock))

    @property
    def tree(self) -> MemoryTree:
        return self._tree

    @property
    def session_id(self) -> int:
        return self._session_id

    def new_session(self) -> MemoryMetadataStore:
        """Return another session over the same tree (another broker, for tests)."""
        return MemoryMetadataStore(self._tree.clock, tree=self._tree)

    def expire_session(self, *, reestablish: bool = True) -> None:
        """Model a ZooKeeper session expiry (Rule M5); with ``reestablish=False`` the store
        stays closed afterwards, as a client that gave up."""
        self._check_open()
        changes = Changes()
        self._tree.remove_ephemerals(self._session_id, changes)
        self._tree.notify(changes.notifications, exclude=self)
        self._tree.detach(self._session_id)
        self._emit(SessionEvent.SESSION_LOST)
        if reestablish:
            self._session_id = self._tree.attach(self)
            self._emit(SessionEvent.SESSION_REESTABLISHED)
        else:
            self._closed = True

    def close(self) -> Deferred[None]:
        if not self._closed:
            self._closed = True
            self._tree.detach(self._session_id)
            changes = Changes()
            self._tree.remove_ephemerals(self._session_id, changes)
            self._tree.notify(changes.notifications)
        return succeed(None)

    def _complete(self, outcome: Any, changes: Changes) -> Deferred[Any]:
        self._tree.notify(changes.notifications)
        if isinstance(outcome, Failure):
            return fail(outcome)
        return succeed(outcome)
