"""The ZooKeeper MetadataStore: the contract of ``api.py`` over kazoo, for a cluster.

Threads. Operations complete in the order they were issued and each one sees every write
issued before it. An operation of one ZooKeeper request (a read, a versioned write) of a path
that nobody watches, issued while the worker thread below is idle, is sent from the reactor
thread and its outcome goes back straight from kazoo's connection thread (the hot path: cursor
and ledger metadata writes, lookups): ZooKeeper answers one session's requests in order, so
this keeps the order. Every other operation runs its kazoo calls on one worker thread that this
store owns, one operation after another, and while one (or a new watch's first read) is queued
or running the direct ones queue behind it. Everything that goes back to the reactor
(operation outcomes, watch notifications, session events) goes through ``_to_reactor``
(``reactor.callFromThread``), the only place where kazoo's threads meet the reactor. kazoo's
own callbacks (watch triggers, state changes, completions) never block: they hand work to the
worker thread or to the reactor.

Rules beyond the contract:

Rule Z1: the URL is ``zk://host:port[,host:port...][/chroot]``; the chroot is created if missing
        and every path of the store lives under it.
Rule Z2: watches are kept by the store, not by ZooKeeper: a path that has watchers is "armed"
        with one-shot ZooKeeper watches, and every trigger, every write of this session that may
        touch the path and every reconnect re-reads the node (version, child version, creation
        id) and reports the difference since the last read: one ``MODIFIED`` per data version,
        one ``CHILDREN_CHANGED`` per child version, ``DELETED``/``CREATED`` when the node went
        or came back. So a watch reports every change once, also changes that happened while the
        connection was down (a deleted-and-recreated node while down shows as deleted+created).
        A write's notifications are delivered before the write's own Deferred fires. A watch
        reports changes from its first successful read on, which happens before any operation
        issued after ``watch()`` runs (or, if the connection is down, once it is back).
Rule Z3: sequence suffixes come from one counter node under ``/__polybroker`` (its data
        version), bumped in the same ZooKeeper transaction that creates the node, so suffixes
        are unique and increasing across every parent, session and restart, and never reused,
        even after a parent is deleted (plain ZooKeeper restarts a recreated parent's counter).
Rule Z4: session events: a dropped connection is ``CONNECTION_LOST``; the same session back is
        ``RECONNECTED``; an expired session is ``SESSION_LOST`` (this session's ephemeral nodes are
        gone, ZooKeeper deleted them) and the new session that kazoo then opens is
        ``SESSION_REESTABLISHED``. The store never re-creates ephemeral nodes by itself: their
        owners do, on ``SESSION_REESTABLISHED``.
Rule Z5: an operation that cannot learn its outcome (connection lost while it was in flight, or
        no answer within the operation timeout) fails with ``ConnectionLossError``: it may or may
        not have been applied.
Rule Z6: ZooKeeper drops the connection of a client whose request exceeds its packet limit
        (``jute.maxbuffer``, 1 MiB - 1 by default): a write whose request would be larger (the
        value plus the paths it creates, plus headers) fails with ``ValueError`` instead, so
        values of up to about 1 MiB less a few KiB are stored, not quite ``MAX_VALUE_BYTES``.
Rule Z7: the names ``zookeeper`` and ``__polybroker`` at the root are the server's and the
        store's own: they are not listed by ``children("/")`` and paths under them are refused.
Rule Z8: a connection attempt (TCP connect, then the session handshake) waits at most
        ``handshake_timeout(session timeout)`` for the server, a tenth of the session timeout
        (at least 2 s), then the next attempt starts. kazoo's own bound is the whole session
        timeout, and a ZooKeeper server that is starting can accept a connection and never
        answer nor close it: the client sat on that one connection until the session it was
        trying to keep had expired on the server.
Rule Z9: kazoo's connection thread ends on an error it does not expect (a malformed frame from
        the server, a reply to no request): kazoo then never connects again by itself. The store
        notices, reports ``SESSION_LOST`` (if kazoo did not) and starts the client again after
        ``RESTART_DELAY_S``; the new session is ``SESSION_REESTABLISHED`` (Rule Z4). Meanwhile
        operations fail with ``ConnectionLossError``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import kazoo.exceptions as kz
from kazoo.client import KazooClient, KazooState
from kazoo.handlers.threading import AsyncResult as KazooAsyncResult
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.states import EventType as KazooEventType
from kazoo.protocol.states import WatchedEvent, ZnodeStat
from twisted.internet.defer import Deferred, fail
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.config import ConfigError
from polybroker.metadata.api import (
    BadVersionError,
    ConnectionLossError,
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
from polybroker.metadata.memory import (
    SEQUENCE_DIGITS,
    Watch,
    parent_of,
    validate_path,
    validate_value,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SESSION_TIMEOUT_MS = 30_000
RESERVED_ROOT_NAMES = frozenset({"zookeeper", "__polybroker"})
INTERNAL_ROOT = "/__polybroker"
SEQUENCE_NODE = f"{INTERNAL_ROOT}/sequence"
# ZooKeeper versions are 32-bit signed: the counter node can hand out this many suffixes.
MAX_SEQUENCE_VERSION = 2**31 - 2
TRANSACTION_RETRIES = 20
# ZooKeeper's default jute.maxbuffer, and a generous bound on what one operation adds to a
# request besides its value and path (headers, ACL, flags, lengths).
ZK_MAX_PACKET = 0xFFFFF
REQUEST_OVERHEAD = 256
# Rule Z8: a healthy server answers a session handshake in milliseconds.
HANDSHAKE_TIMEOUT_FLOOR_S = 2.0
HANDSHAKE_TIMEOUT_SHARE = 0.1
# Rule Z9: the pause before kazoo's client is started again after its connection thread died.
RESTART_DELAY_S = 1.0


@dataclass(frozen=True)
class ZooKeeperUrl:
    """A parsed ``zk://`` URL: kazoo's hosts string and the chroot ("" for none)."""

    hosts: str
    chroot: str


def parse_url(url: str) -> ZooKeeperUrl:
    """Parse ``zk://host:port[,host:port...][/chroot]``; raise ``ConfigError`` saying what is
    wrong with a malformed one."""
    if not url.startswith("zk://"):
        raise ConfigError(f"metadata store URL {url!r} is not a zk:// URL")
    rest = url[len("zk://") :]
    hosts_part, slash, chroot = rest.partition("/")
    chroot = slash + chroot if slash else ""
    if not hosts_part:
        raise ConfigError(f"metadata store URL {url!r} names no ZooKeeper host")
    hosts = []
    for item in hosts_part.split(","):
        host, colon, port_text = item.rpartition(":")
        if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(
                f"metadata store URL {url!r}: {item!r} is not host:port (port 1-65535)"
            )
        hosts.append(f"{host}:{int(port_text)}")
    if chroot in ("", "/"):
        chroot = ""
    else:
        try:
            validate_path(chroot)
        except ValueError as e:
            raise ConfigError(f"metadata store URL {url!r}: bad chroot ({e})") from None
    return ZooKeeperUrl(",".join(hosts), chroot)


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a watched node looked like at its last read: None fields mean "absent"."""

    czxid: int
    version: int
    cversion: int


_UNREAD = object()


def _diff(path: str, old: _Seen | None, new: _Seen | None) -> list[Notification]:
    """The notifications that turn ``old`` into ``new`` (Rule Z2)."""
    out: list[Notification] = []
    if old is None and new is None:
        return out
    if new is None:
        return [Notification(EventType.DELETED, path)]
    if old is not None and old.czxid != new.czxid:
        out.append(Notification(EventType.DELETED, path))
        old = None
    if old is None:
        out.append(Notification(EventType.CREATED, path))
        old = _Seen(new.czxid, 0, 0)
    out.extend(Notification(EventType.MODIFIED, path) for _ in range(new.version - old.version))
    out.extend(
        Notification(EventType.CHILDREN_CHANGED, path) for _ in range(new.cversion - old.cversion)
    )
    return out


class _AsyncResult(KazooAsyncResult):
    """kazoo's result of one request that can also call one function on the thread that
    completes it (kazoo's own callbacks go through its callback thread: one more hop)."""

    def __init__(self, handler: Any) -> None:
        super().__init__(handler)
        self._inline: Callable[[_AsyncResult], None] | None = None

    def set(self, value: Any = None) -> None:
        super().set(value)
        self._run_inline()

    def set_exception(self, exception: BaseException) -> None:
        super().set_exception(exception)
        self._run_inline()

    def link_inline(self, fn: Callable[[_AsyncResult], None]) -> None:
        """Call ``fn(self)`` once, on the completing thread, or now if already complete;
        ``fn`` must not block."""
        with self._condition:
            if not self.ready():
                self._inline = fn
                return
        fn(self)

    def _run_inline(self) -> None:
        with self._condition:
            fn, self._inline = self._inline, None
        if fn is not None:
            fn(self)


class _Handler(SequentialThreadingHandler):
    """kazoo's threading handler whose results can complete inline (``_AsyncResult``), whose
    ``select`` is one ``poll`` call (kazoo's own builds and closes an epoll selector for every
    call, and its connection thread makes about five calls per request), and whose TCP
    connects wait at most ``connect_timeout`` seconds if given (Rule Z8)."""

    def __init__(self, connect_timeout: float | None = None) -> None:
        super().__init__()
        self.connect_timeout = connect_timeout

    def async_result(self) -> _AsyncResult:
        return _AsyncResult(self)

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        if self.connect_timeout is not None and (timeout is None or timeout > self.connect_timeout):
            kwargs["timeout"] = self.connect_timeout
        return super().create_connection(*args, **kwargs)

    def select(
        self, rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any], timeout: Any = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """``select.select``'s contract for any fd number; ``ValueError`` for a bad fd (as
        kazoo's own); nothing is ever reported in the third list (as kazoo's own)."""
        if timeout is not None:
            if not isinstance(timeout, int | float):
                raise TypeError("timeout must be a number")
            if timeout < 0:
                raise ValueError("timeout must be non-negative")
        poller = select.poll()
        wanted: dict[int, list[tuple[int, Any]]] = {}
        for flag, objs in ((select.POLLIN, rlist), (select.POLLOUT, wlist)):
            for obj in objs:
                fd = obj if isinstance(obj, int) else obj.fileno()
                if fd < 0:
                    raise ValueError("Invalid event mask or fd")
                wanted.setdefault(fd, []).append((flag, obj))
        for fd, entries in wanted.items():
            mask = 0
            for flag, _ in entries:
                mask |= flag
            poller.register(fd, mask)
        ready = poller.poll(None if timeout is None else timeout * 1000)
        readable: list[Any] = []
        writable: list[Any] = []
        for fd, events in ready:
            if events & select.POLLNVAL:
                raise ValueError("Invalid event mask or fd")
            for flag, obj in wanted[fd]:
                if events & (flag | select.POLLERR | select.POLLHUP):
                    (readable if flag == select.POLLIN else writable).append(obj)
        return readable, writable, []


def handshake_timeout(session_timeout_s: float) -> float:
    """How long one connection attempt waits for the server (Rule Z8): a tenth of the session
    timeout, at least ``HANDSHAKE_TIMEOUT_FLOOR_S``, never more than the session timeout."""
    return min(
        session_timeout_s,
        max(HANDSHAKE_TIMEOUT_FLOOR_S, session_timeout_s * HANDSHAKE_TIMEOUT_SHARE),
    )


class _Connection(ConnectionHandler):
    """kazoo's connection handler whose connection attempts give up after ``bound`` seconds
    (Rule Z8). kazoo 2.x opens each attempt with ``handler.create_connection`` and sends the
    session handshake (and any auth) through ``_invoke``, both bounded by the session timeout
    divided by the number of hosts; both are bounded here. And ``on_ended`` is called, last
    thing on the connection thread, if kazoo's connection loop ends although the client was
    not stopped (Rule Z9)."""

    def __init__(
        self,
        client: KazooClient,
        original: ConnectionHandler,
        bound: float,
        on_ended: Callable[[], None],
    ) -> None:
        super().__init__(
            client,
            original.retry_sleeper,
            logger=original.logger,
            sasl_options=original.sasl_options,
        )
        self.bound = bound
        self.on_ended = on_ended

    def _invoke(self, timeout: float, request: Any, xid: int | None = None) -> Any:
        return super()._invoke(min(timeout, self.bound), request, xid)

    def zk_loop(self) -> None:
        try:
            super().zk_loop()
        except Exception:
            pass  # kazoo logged it ("Unhandled exception in connection loop")
        finally:
            if not self.client._stopped.is_set():
                self.on_ended()


def _stat(zstat: ZnodeStat) -> Stat:
    return Stat(zstat.version, zstat.ephemeralOwner != 0, zstat.ctime, zstat.mtime)


class ZooKeeperMetadataStore(MetadataStore):
    """A session with a ZooKeeper ensemble (see the module docstring); build with ``open``."""

    def __init__(
        self,
        url: str,
        reactor: Any,
        *,
        session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
        operation_timeout_s: float | None = None,
    ) -> None:
        parsed = parse_url(url)
        self.url = url
        self._reactor = reactor
        self._chroot = parsed.chroot
        self._op_timeout = (
            operation_timeout_s
            if operation_timeout_s is not None
            else max(5.0, session_timeout_ms / 1000)
        )
        attempt_bound = handshake_timeout(session_timeout_ms / 1000)
        self._zk = KazooClient(
            hosts=parsed.hosts,
            timeout=session_timeout_ms / 1000,
            # kazoo's default backs off up to an hour: come back soon after ZooKeeper does.
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2.0},
            handler=_Handler(connect_timeout=attempt_bound),
        )
        self._zk._connection = _Connection(
            self._zk, self._zk._connection, attempt_bound, self._on_connection_ended
        )
        # Held while kazoo's client is stopped (close) or started again (Rule Z9), which only
        # happens once open() has connected (``_opened``).
        self._lifecycle = threading.Lock()
        self._opened = False
        self._restart_call: Any = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zk-metadata"
        )
        self._closed = False
        self._closed_done = False
        self._close_waiters: list[Deferred[None]] = []
        # Reactor thread only:
        self._watches: dict[str, list[Watch]] = {}
        # Operations handed to the worker whose outcome has not reached the reactor yet.
        self._worker_ops = 0
        self._listeners: list[Callable[[SessionEvent], None]] = []
        # Worker thread only: the armed paths and what each looked like at its last read
        # (``_UNREAD`` until a first read succeeded).
        self._seen: dict[str, _Seen | object | None] = {}
        self._sequence_version: int | None = None
        # kazoo's connection thread only:
        self._session_id: int | None = None
        self._lost = False

    # -- opening and closing ----------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str,
        reactor: Any,
        *,
        session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
        connect_timeout_s: float = 15.0,
        operation_timeout_s: float | None = None,
    ) -> Deferred[ZooKeeperMetadataStore]:
        """Connect, create the chroot and the store's own nodes; fire with the store, or fail
        with ``MetadataError`` if ZooKeeper does not answer within ``connect_timeout_s``.
        Raises ``ConfigError`` at once for a malformed URL. Operations wait at most
        ``operation_timeout_s`` (default: the session timeout, at least 5 s; Rule Z5)."""
        store = cls(
            url,
            reactor,
            session_timeout_ms=session_timeout_ms,
            operation_timeout_s=operation_timeout_s,
        )

        def connect() -> ZooKeeperMetadataStore:
            try:
                store._zk.start(timeout=connect_timeout_s)
            except KazooTimeoutError:
                store._zk.stop()
                store._zk.close()
                raise MetadataError(
                    f"cannot connect to ZooKeeper at {url} within {connect_timeout_s}s"
                ) from None
            try:
                store._session_id = store._zk.client_id[0] if store._zk.client_id else None
                store._zk.add_listener(store._on_state)
                store._opened = True
                if store._chroot:
                    store._call(store._zk.ensure_path_async, store._chroot)
                store._call(store._zk.ensure_path_async, store._full(SEQUENCE_NODE))
            except BaseException:
                store._zk.stop()
                store._zk.close()
                raise
            return store

        d = store._submit(connect)

        def failed(f: Failure) -> Failure:
            store._closed = True
            store._closed_done = True
            store._worker.shutdown(wait=False)
            return f

        return d.addErrback(failed)

    def close(self) -> Deferred[None]:
        """End the session (ZooKeeper deletes its ephemeral nodes), stop the worker thread.
        Idempotent: every call fires once the session has ended."""
        d: Deferred[None] = Deferred()
        self._close_waiters.append(d)
        if self._closed_done:
            self._closed_finished()
            return d
        if self._closed:
            return d
        self._closed = True
        if self._restart_call is not None and self._restart_call.active():
            self._restart_call.cancel()
        zk, worker = self._zk, self._worker

        def stop() -> None:
            try:
                with self._lifecycle:
                    zk.stop()
                    zk.close()
            except Exception:
                log.exception("stopping the ZooKeeper client failed")
            worker.shutdown(wait=True)
            self._to_reactor(self._closed_finished)

        threading.Thread(target=stop, name="zk-metadata-close", daemon=True).start()
        return d

    def _closed_finished(self) -> None:
        self._closed_done = True
        waiters, self._close_waiters = self._close_waiters, []
        for d in waiters:
            d.callback(None)

    # -- the contract -----------------------------------------------------------------------

    def get(self, path: str) -> Deferred[GetResult | None]:
        def finish(result: _AsyncResult) -> GetResult | None:
            try:
                data, zstat = result.get_nowait()
            except kz.NoNodeError:
                return None
            return GetResult(data, _stat(zstat))

        return self._request(path, lambda: self._zk.get_async(self._full(path)), finish)

    def exists(self, path: str) -> Deferred[Stat | None]:
        def finish(result: _AsyncResult) -> Stat | None:
            zstat = result.get_nowait()
            return None if zstat is None else _stat(zstat)

        return self._request(path, lambda: self._zk.exists_async(self._full(path)), finish)

    def children(self, path: str) -> Deferred[list[str]]:
        def finish(result: _AsyncResult) -> list[str]:
            try:
                names = result.get_nowait()
            except kz.NoNodeError:
                return []
            if path == "/":
                names = [n for n in names if n not in RESERVED_ROOT_NAMES]
            return sorted(names)

        return self._request(path, lambda: self._zk.get_children_async(self._full(path)), finish)

    def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        ephemeral: bool = False,
    ) -> Deferred[Stat]:
        if (
            type(expected_version) is int
            and expected_version >= 0
            and path not in self._watches
            and (path == "/" or parent_of(path) not in self._watches)
        ):
            # A versioned write (cursors, ledger metadata): one request.
            version = expected_version

            def start() -> _AsyncResult:
                data = validate_value(value)
                full = self._full(path)
                _check_request_size(data, [full])
                return self._zk.set_async(full, data, version)

            def finish(result: _AsyncResult) -> Stat:
                try:
                    zstat = result.get_nowait()
                except (kz.NoNodeError, kz.BadVersionError):
                    raise BadVersionError(f"{path} is not at version {version}") from None
                return _stat(zstat)

            return self._request(path, start, finish)

        def run() -> Stat:
            data = validate_value(value)
            _check_expected(expected_version)
            full = self._full(path)
            _check_request_size(data, [full])
            if expected_version is not None and expected_version >= 0:
                try:
                    zstat = self._call(self._zk.set_async, full, data, expected_version)
                except (kz.NoNodeError, kz.BadVersionError):
                    raise BadVersionError(f"{path} is not at version {expected_version}") from None
                self._refresh_after_write([path])
                return _stat(zstat)
            if expected_version is None:
                try:
                    zstat = self._call(self._zk.set_async, full, data, -1)
                except kz.NoNodeError:
                    pass
                else:
                    self._refresh_after_write([path])
                    return _stat(zstat)
            try:
                created = self._create(path, data, ephemeral)
            except kz.NodeExistsError:
                if expected_version == -1:
                    raise BadVersionError(f"{path} exists, expected none") from None
                # Created by someone else since our set: replace it, as "any version" asks.
                zstat = self._call(self._zk.set_async, full, data, -1)
                self._refresh_after_write([path])
                return _stat(zstat)
            zstat = self._call(self._zk.exists_async, full)
            self._refresh_after_write(created)
            if zstat is None:
                raise ConnectionLossError(f"{path} was created but is gone already")
            return _stat(zstat)

        return self._op(run, path)

    def create_sequential(
        self, prefix: str, value: bytes, *, ephemeral: bool = False
    ) -> Deferred[str]:
        if not isinstance(prefix, str):
            return fail(TypeError(f"a metadata path prefix is a str, got {type(prefix)}"))

        def run() -> str:
            data = validate_value(value)
            for _ in range(TRANSACTION_RETRIES):
                version = self._sequence_version
                if version is None:
                    zstat = self._call(self._zk.exists_async, self._full(SEQUENCE_NODE))
                    if zstat is None:
                        raise MetadataError(f"the store's node {SEQUENCE_NODE} is missing")
                    version = zstat.version
                if version >= MAX_SEQUENCE_VERSION:
                    raise MetadataError("sequence numbers of this store are exhausted")
                path = f"{prefix}{version + 1:0{SEQUENCE_DIGITS}d}"
                try:
                    created = self._create(path, data, ephemeral, bump_sequence_from=version)
                except kz.BadVersionError:
                    self._sequence_version = None  # another session took it: re-read
                    continue
                except kz.NodeExistsError:
                    # Someone took this name with a plain put: skip the number.
                    try:
                        self._call(self._zk.set_async, self._full(SEQUENCE_NODE), b"", version)
                        self._sequence_version = version + 1
                    except kz.BadVersionError:
                        self._sequence_version = None
                    continue
                self._sequence_version = version + 1
                self._refresh_after_write(created)
                return path
            raise MetadataError(f"could not create a sequential node under {prefix!r}")

        return self._op(run, prefix + "0" * SEQUENCE_DIGITS)

    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        def run() -> None:
            _check_expected(expected_version)
            if path == "/":
                raise ValueError("the root node cannot be deleted")
            full = self._full(path)
            if expected_version == -1:
                if self._call(self._zk.exists_async, full) is None:
                    raise NotFoundError(path)
                raise BadVersionError(f"{path} exists, expected none")
            version = -1 if expected_version is None else expected_version
            try:
                self._call(self._zk.delete_async, full, version)
            except kz.NoNodeError:
                raise NotFoundError(path) from None
            except kz.BadVersionError:
                raise BadVersionError(f"{path} is not at version {expected_version}") from None
            except kz.NotEmptyError:
                raise NotEmptyError(f"{path} has children") from None
            self._refresh_after_write([path, parent_of(path)])

        return self._op(run, path)

    def watch(self, path: str, callback: Callable[[Notification], None]) -> Callable[[], None]:
        """Register a persistent watch (Rule Z2); raise ``StoreClosedError`` once closed."""
        if self._closed:
            raise StoreClosedError("the metadata store session is closed")
        self._check_user_path(path)
        w = Watch(callback)
        registered = self._watches.setdefault(path, [])
        registered.append(w)
        if len(registered) == 1:
            self._arm_soon(path)

        def unwatch() -> None:
            w.active = False
            current = self._watches.get(path)
            if current is not None and w in current:
                current.remove(w)
                if not current:
                    del self._watches[path]
                    self._submit_quietly(self._disarm, path)

        return unwatch

    def add_session_listener(self, callback: Callable[[SessionEvent], None]) -> Callable[[], None]:
        if self._closed:
            raise StoreClosedError("the metadata store session is closed")
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    # -- reactor side -----------------------------------------------------------------------

    def _to_reactor(self, fn: Callable[..., Any], *args: Any) -> None:
        """The one hand-over from kazoo's and the worker's threads to the reactor thread."""
        self._reactor.callFromThread(fn, *args)

    def _request(
        self,
        path: str,
        start: Callable[[], _AsyncResult],
        finish: Callable[[_AsyncResult], T],
    ) -> Deferred[T]:
        """An operation of one kazoo request (``start`` sends it, ``finish`` reads its
        outcome) that, if it is a write, leaves no watched node to re-read: sent from the
        reactor thread while the worker is idle and nobody watches ``path``, else on the
        worker (see the module docstring)."""
        if self._worker_ops or path in self._watches:
            return self._op(lambda: finish(self._wait(start())), path)
        refused = self._refused(path)
        if refused is not None:
            return refused
        d: Deferred[T] = Deferred()

        def expire() -> None:
            d.errback(ConnectionLossError(f"no answer from ZooKeeper within {self._op_timeout}s"))

        timer = self._reactor.callLater(self._op_timeout, expire)

        def complete(result: _AsyncResult) -> None:
            if not timer.active():
                return  # timed out: the caller was told (Rule Z5)
            timer.cancel()
            try:
                value = self._translate(lambda: finish(result))
            except BaseException:
                d.errback(Failure())
            else:
                d.callback(value)

        try:
            result = self._translate(start)
        except BaseException:
            timer.cancel()
            return fail(Failure())
        result.link_inline(lambda r: self._to_reactor(complete, r))
        return d

    def _op(self, run: Callable[[], T], path: str) -> Deferred[T]:
        """Validate ``path`` now, run ``run`` on the worker thread, fire on the reactor."""
        refused = self._refused(path)
        return refused if refused is not None else self._submit(run)

    def _refused(self, path: str) -> Deferred[Any] | None:
        """A failed Deferred if the store is closed or ``path`` is not a user path, else None."""
        if self._closed:
            return fail(StoreClosedError("the metadata store session is closed"))
        try:
            self._check_user_path(path)
        except (TypeError, ValueError):
            return fail(Failure())
        return None

    def _submit(self, run: Callable[[], T]) -> Deferred[T]:
        d: Deferred[T] = Deferred()

        def work() -> None:
            try:
                result = self._translate(run)
            except BaseException:
                self._to_reactor(self._worker_done, d.errback, Failure())
            else:
                self._to_reactor(self._worker_done, d.callback, result)

        try:
            self._worker.submit(work)
        except RuntimeError:
            return fail(StoreClosedError("the metadata store session is closed"))
        self._worker_ops += 1
        return d

    def _worker_done(self, fire: Callable[[Any], object], outcome: Any) -> None:
        self._worker_ops -= 1
        fire(outcome)

    def _arm_soon(self, path: str) -> None:
        """Arm ``path`` on the worker (reactor thread); direct operations issued meanwhile
        queue behind it, so the watch's first read comes before them (Rule Z2)."""

        def arm() -> None:
            try:
                self._logged(self._arm, path)
            finally:
                self._to_reactor(self._worker_done, lambda _: None, None)

        with contextlib.suppress(RuntimeError):  # the worker is shut down: the store is closed
            self._worker.submit(arm)
            self._worker_ops += 1

    def _submit_quietly(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the worker is shut down: the store is closed
            self._worker.submit(self._logged, fn, *args)

    def _logged(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            if not self._closed:
                log.exception("ZooKeeper metadata store: %s failed", fn.__name__)

    def _deliver(self, notifications: list[Notification]) -> None:
        """Call the watchers of each notification, in order (reactor thread)."""
        for n in notifications:
            for w in list(self._watches.get(n.path, ())):
                if not w.active:
                    continue
                try:
                    w.callback(n)
                except Exception:
                    log.exception("metadata watch callback failed for %s", n.path)

    def _emit(self, event: SessionEvent) -> None:
        """Call the session listeners (reactor thread)."""
        if self._closed:
            return
        log.info("ZooKeeper session event %s", event.value, extra=logs.kv(url=self.url))
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:
                log.exception("metadata session listener failed on %s", event.value)

    # -- kazoo's threads --------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        """kazoo's connection listener: never blocks (Rule Z4)."""
        if self._closed:
            return
        if state == KazooState.SUSPENDED:
            self._to_reactor(self._emit, SessionEvent.CONNECTION_LOST)
        elif state == KazooState.LOST:
            self._lost = True
            self._to_reactor(self._emit, SessionEvent.SESSION_LOST)
        elif state == KazooState.CONNECTED:
            client_id = self._zk.client_id
            sid = client_id[0] if client_id else None
            if self._lost or (self._session_id is not None and sid != self._session_id):
                if not self._lost:
                    self._to_reactor(self._emit, SessionEvent.SESSION_LOST)
                self._lost = False
                self._session_id = sid
                self._to_reactor(self._emit, SessionEvent.SESSION_REESTABLISHED)
            else:
                self._session_id = sid
                self._to_reactor(self._emit, SessionEvent.RECONNECTED)
            self._submit_quietly(self._rearm_all)

    def _on_connection_ended(self) -> None:
        """kazoo's connection thread, its last act: its loop ended though nobody stopped the
        client, so it will not connect again by itself (Rule Z9)."""
        if self._closed or not self._opened:
            return  # not opened yet: open() fails by its connect timeout
        log.warning(
            "ZooKeeper client's connection thread ended unexpectedly; starting it again",
            extra=logs.kv(url=self.url),
        )
        if not self._lost:
            self._lost = True  # its session is given up: the next one is a new session
            self._to_reactor(self._emit, SessionEvent.SESSION_LOST)
        self._to_reactor(self._restart_later)

    def _restart_later(self) -> None:
        """Start kazoo's client again after ``RESTART_DELAY_S``, unless already due (reactor
        thread)."""
        if self._closed or (self._restart_call is not None and self._restart_call.active()):
            return
        self._restart_call = self._reactor.callLater(RESTART_DELAY_S, self._restart)

    def _restart(self) -> None:
        self._restart_call = None
        if self._closed:
            return
        threading.Thread(
            target=self._restart_client, name="zk-metadata-restart", daemon=True
        ).start()

    def _restart_client(self) -> None:
        """Start kazoo's client again (its own thread: kazoo joins the ended one first)."""
        try:
            with self._lifecycle:
                if self._closed:
                    return
                self._zk.start_async()
        except Exception:
            log.exception("starting the ZooKeeper client again failed; trying again")
            self._to_reactor(self._restart_later)

    def _on_watch(self, event: WatchedEvent) -> None:
        """kazoo's one-shot watch trigger: re-read the node on the worker thread (Rule Z2)."""
        if self._closed or event.type == KazooEventType.NONE or event.path is None:
            return  # NONE: the connection dropped; every armed path is re-read on reconnect
        path = self._user_path(event.path)
        if path is not None:
            self._submit_quietly(self._refresh, [path])

    # -- worker thread ----------------------------------------------------------------------

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Run one kazoo async call and wait (bounded) for its result (Rule Z5)."""
        try:
            return method(*args).get(timeout=self._op_timeout)
        except KazooTimeoutError:
            raise ConnectionLossError(
                f"no answer from ZooKeeper within {self._op_timeout}s"
            ) from None

    def _wait(self, result: _AsyncResult) -> _AsyncResult:
        """Wait (bounded) for a kazoo request's outcome (Rule Z5)."""
        if not result.wait(self._op_timeout):
            raise ConnectionLossError(f"no answer from ZooKeeper within {self._op_timeout}s")
        return result

    def _translate(self, run: Callable[[], T]) -> T:
        """Run ``run``, turning kazoo's errors into the contract's."""
        try:
            return run()
        except (kz.ConnectionClosedError, kz.SessionExpiredError, kz.ConnectionLoss) as e:
            if self._closed:
                raise StoreClosedError("the metadata store session is closed") from None
            raise ConnectionLossError(f"ZooKeeper connection lost ({type(e).__name__})") from None
        except kz.BadArgumentsError as e:
            raise ValueError(f"ZooKeeper refused the arguments: {e}") from None
        except kz.NoChildrenForEphemeralsError:
            raise MetadataError("ephemeral nodes cannot have children") from None
        except (kz.ZookeeperError, kz.KazooException) as e:
            raise MetadataError(f"ZooKeeper error: {type(e).__name__} {e}") from None

    def _create(
        self,
        path: str,
        data: bytes,
        ephemeral: bool,
        *,
        bump_sequence_from: int | None = None,
    ) -> list[str]:
        """Create ``path`` with its missing ancestors in one transaction (and bump the
        sequence counter in it when asked); return the created paths, top down. Raises kazoo's
        ``kz.NodeExistsError`` if the node exists, ``BadVersionError`` if the counter moved."""
        missing: list[str] = []
        for _ in range(TRANSACTION_RETRIES):
            tx = self._zk.transaction()
            if bump_sequence_from is not None:
                tx.set_data(self._full(SEQUENCE_NODE), b"", bump_sequence_from)
            for p in missing:
                tx.create(self._full(p), b"")
            tx.create(self._full(path), data, ephemeral=ephemeral)
            _check_request_size(data, [self._full(p) for p in (*missing, path)])
            results = self._call(tx.commit_async)
            errors = [r for r in results if isinstance(r, Exception)]
            real = [e for e in errors if not isinstance(e, kz.RolledBackError)]
            if not errors:
                return [*missing, path]
            first = real[0] if real else errors[0]
            index = results.index(first)
            offset = 1 if bump_sequence_from is not None else 0
            if isinstance(first, kz.BadVersionError) and index == 0 and offset:
                raise first
            if isinstance(first, kz.NoNodeError):
                missing = self._missing_ancestors(path)
                continue
            if isinstance(first, kz.NodeExistsError) and index - offset < len(missing):
                missing = self._missing_ancestors(path)  # an ancestor appeared meanwhile
                continue
            raise first
        raise MetadataError(f"could not create {path}: its parents keep changing")

    def _missing_ancestors(self, path: str) -> list[str]:
        """The ancestors of ``path`` that do not exist, top down."""
        missing = []
        p = parent_of(path)
        while p != "/" and self._call(self._zk.exists_async, self._full(p)) is None:
            missing.append(p)
            p = parent_of(p)
        missing.reverse()
        return missing

    def _refresh_after_write(self, paths: Sequence[str]) -> None:
        """After this session changed ``paths``: re-read each armed one and its parent."""
        affected: list[str] = []
        for p in paths:
            for q in (p, parent_of(p)) if p != "/" else (p,):
                if q not in affected:
                    affected.append(q)
        self._refresh([p for p in affected if p in self._seen])

    def _arm(self, path: str) -> None:
        """Start watching ``path``: read it with one-shot watches, report nothing."""
        self._seen[path] = _UNREAD
        self._refresh([path])

    def _disarm(self, path: str) -> None:
        self._seen.pop(path, None)

    def _rearm_all(self) -> None:
        self._refresh(list(self._seen))

    def _refresh(self, paths: Sequence[str]) -> None:
        """Re-read armed ``paths`` and deliver what changed since the last read (Rule Z2)."""
        out: list[Notification] = []
        for path in paths:
            if path not in self._seen:
                continue
            try:
                now = self._read_armed(path)
            except (
                kz.ConnectionLoss,
                kz.ConnectionClosedError,
                kz.SessionExpiredError,
                ConnectionLossError,
            ):
                continue  # read again on reconnect
            old = self._seen[path]
            if old is not _UNREAD:
                assert old is None or isinstance(old, _Seen)
                out.extend(_diff(path, old, now))
            self._seen[path] = now
        if out:
            self._to_reactor(self._deliver, out)

    def _read_armed(self, path: str) -> _Seen | None:
        """Read ``path``'s versions, leaving one-shot data and child watches on it."""
        full = self._full(path)
        for _ in range(TRANSACTION_RETRIES):
            zstat = self._call(self._zk.exists_async, full, self._on_watch)
            if zstat is None:
                return None
            try:
                _, zstat = self._call(self._zk.get_children_async, full, self._on_watch, True)
            except kz.NoNodeError:
                continue  # deleted between the two reads: the exists watch is armed anew
            return _Seen(zstat.czxid, zstat.version, zstat.cversion)
        return None

    # -- paths --------------------------------------------------------------------------------

    def _check_user_path(self, path: str) -> None:
        validate_path(path)
        first = path[1:].split("/", 1)[0]
        if first in RESERVED_ROOT_NAMES:
            raise ValueError(f"invalid metadata path {path!r}: /{first} is reserved")

    def _full(self, path: str) -> str:
        if not self._chroot:
            return path
        return self._chroot if path == "/" else self._chroot + path

    def _user_path(self, full: str) -> str | None:
        if not self._chroot:
            return full
        if full == self._chroot:
            return "/"
        if full.startswith(self._chroot + "/"):
            return full[len(self._chroot) :]
        return None


def _check_request_size(data: bytes, full_paths: Sequence[str]) -> None:
    """Refuse a write ZooKeeper would answer by dropping the connection (Rule Z6)."""
    size = len(data) + REQUEST_OVERHEAD * (1 + len(full_paths))
    size += sum(len(p.encode()) for p in full_paths) + len(SEQUENCE_NODE)
    if size > ZK_MAX_PACKET:
        raise ValueError(
            f"a write of {len(data)} bytes to {full_paths[-1]!r} exceeds ZooKeeper's request "
            f"limit of {ZK_MAX_PACKET} bytes"
        )


def _check_expected(expected: int | None) -> None:
    if expected is None:
        return
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < -1:
        raise ValueError(f"expected_version must be None, -1 or >= 0, got {expected!r}")
