"""``polybroker bookie``: run one bookie process until SIGTERM or SIGINT.

Prints ``bookie listening on HOST:PORT`` on stdout once it serves (tools wait for that line);
exits 0 after a clean stop, 1 when it cannot start (a cookie mismatch, a bad config, a port in
use, an address other than the one its data dir was registered under), with the reason on
stderr. ``--port 0`` means the data dir's recorded port (a free one on a first start); moving a
bookie to another address takes ``allowBookieAddressChange=true`` (the auditor then
re-replicates the ledgers that name the old address, since they cannot find it there).

With a metadata store (``--metadata``) the bookie is announced by an ephemeral node under
``/bookies/available``; when the store's session is lost (ZooKeeper expired it, so the node is
gone) the bookie announces itself again as soon as a new session is established, retrying every
``REREGISTER_RETRY_S`` while the store cannot be reached. Another identity registered at its
address meanwhile stops the bookie (exit 1). With ``autoRecoveryDaemonEnabled`` (the default) it
also runs an auditor (``ledger.auditor``): every bookie contends, the elected one re-replicates
the ledgers of lost bookies; a clean stop gives the role up first.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.config import ConfigError, load
from polybroker.ledger.api import StorageError
from polybroker.ledger.auditor import Auditor
from polybroker.ledger.bookie import cookie as cookies
from polybroker.ledger.registry import tcp_connector
from polybroker.metadata.api import MetadataStore, SessionEvent
from polybroker.runtime import settle_heap

log = logging.getLogger(__name__)

REREGISTER_RETRY_S = 1.0
#: How long a thread may hold the GIL while another waits for it (CPython's default is 5 ms).
#: A bookie process runs Python on four threads: the reactor, the journal writer, its zeroing
#: thread and the checkpoint worker, whose loop over the flushed entries would otherwise keep the
#: reactor from answering for up to 5 ms at each hand-over. Measured with the storage benchmark's
#: ml-1 case, alternating 0.5 and 5 ms: 6 pairs of 10 s runs, 87-104k against 72-94k entries/s
#: and a lower add-latency p99 in each pair. (The standalone, whose reactor does far more, went
#: the other way on the MQTT benchmark: it keeps the default.)
SWITCH_INTERVAL_S = 0.0005


def _open_store(
    url: str, data_dir: Path, reactor: Any, session_timeout_ms: int | None = None
) -> Deferred[Any]:
    """Open the metadata store named by ``url`` (a Deferred of it)."""
    try:
        from polybroker.metadata import open_metadata_store
    except ImportError:
        return Deferred.fromCoroutine(_missing_store(url))
    return maybeDeferred(
        open_metadata_store,
        url,
        data_dir=data_dir,
        reactor=reactor,
        session_timeout_ms=session_timeout_ms,
    )


class Reregistration:
    """Announces a bookie again after its metadata session was lost (see the module
    docstring). ``on_conflict`` is called once if another identity took the address."""

    def __init__(
        self,
        store: MetadataStore,
        address: str,
        cookie: cookies.Cookie,
        reactor: Any,
        on_conflict: Any,
    ) -> None:
        self._store = store
        self._address = address
        self._cookie = cookie
        self._reactor = reactor
        self._on_conflict = on_conflict
        self._stopped = False
        self._pending: Any = None
        self._generation = 0
        store.add_session_listener(self._session_event)

    def stop(self) -> None:
        """Stop re-announcing (the bookie is stopping)."""
        self._stopped = True
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None

    def _session_event(self, event: SessionEvent) -> None:
        if self._stopped:
            return
        if event is SessionEvent.SESSION_LOST:
            log.warning(
                "metadata session lost: bookie no longer announced",
                extra=logs.kv(address=self._address),
            )
            self._generation += 1
        elif event is SessionEvent.SESSION_REESTABLISHED:
            self._generation += 1
            self._attempt(self._generation)

    def _attempt(self, generation: int) -> None:
        self._pending = None
        if self._stopped or generation != self._generation:
            return
        # The address was checked when the bookie started: this is the same identity there.
        d = cookies.register(self._store, self._address, self._cookie, allow_address_change=True)

        def done(_: object) -> None:
            log.info("bookie announced again", extra=logs.kv(address=self._address))

        def failed(f: Failure) -> None:
            if self._stopped or generation != self._generation:
                return
            if f.check(cookies.CookieError):
                log.error("cannot announce the bookie again: %s", f.getErrorMessage())
                self._stopped = True
                self._on_conflict(f)
                return
            log.warning(
                "announcing the bookie again failed, retrying: %s",
                f.getErrorMessage(),
                extra=logs.kv(address=self._address),
            )
            self._pending = self._reactor.callLater(REREGISTER_RETRY_S, self._attempt, generation)

        d.addCallbacks(done, failed)


def start_auditor(store: MetadataStore, address: str, config: Any, reactor: Any) -> Auditor:
    """Start this bookie's auditor: it contends for the role, and only the elected one acts."""
    auditor = Auditor(
        store,
        tcp_connector(reactor),
        reactor,
        address=address,
        lost_bookie_recovery_delay_s=config["lostBookieRecoveryDelay"],
        periodic_check_interval_s=config["auditorPeriodicCheckInterval"],
    )
    auditor.start().addErrback(
        lambda f: log.error("auditor failed to start", extra=logs.kv(error=f.getErrorMessage()))
    )
    return auditor


async def _missing_store(url: str) -> None:
    raise ConfigError(f"--metadata {url}: this build has no metadata store to open it with")


def run_bookie(args: argparse.Namespace) -> int:
    """Run a bookie with the CLI's arguments; return the process exit status."""
    try:
        config = load(
            args.config,
            {
                "bookiePort": args.port,
                "bindAddress": args.bind,
                "metadataStoreUrl": args.metadata,
                "allowBookieAddressChange": getattr(args, "allow_address_change", None),
            },
        )
        logs.setup(config["logLevel"], config["logFormat"])
    except (ConfigError, ValueError) as e:
        print(f"polybroker bookie: {e}", file=sys.stderr, flush=True)
        return 1

    from twisted.internet import reactor

    from polybroker.ledger.bookie.server import BookieServer

    data_dir = Path(args.data_dir)
    status = {"code": 0}
    holder: dict[str, Any] = {}

    def fail_start(f: Failure) -> None:
        status["code"] = 1
        print(
            f"polybroker bookie: cannot start: {f.getErrorMessage()}", file=sys.stderr, flush=True
        )
        if f.check(ConfigError, StorageError, CannotListenError) is None:
            # Not one of the refusals we explain: keep the traceback for whoever debugs it.
            log.error("bookie failed to start", exc_info=(f.type, f.value, f.tb))
        reactor.stop()  # type: ignore[attr-defined]

    def start() -> None:
        url = config["metadataStoreUrl"]
        timeout_ms = config["metadataStoreSessionTimeoutMillis"]
        d: Deferred[Any] = _open_store(url, data_dir, reactor, timeout_ms) if url else Deferred()
        if not url:
            d.callback(None)

        def serve(store: Any) -> Deferred[int]:
            holder["store"] = store
            server = BookieServer(
                config,
                data_dir,
                reactor,
                port=config["bookiePort"],
                bind=config["bindAddress"],
                metadata_store=store,
            )
            d2 = server.start()

            def listening(port: int) -> None:
                holder["server"] = server
                if store is not None:
                    assert server.cookie is not None
                    holder["reregistration"] = Reregistration(
                        store, server.address, server.cookie, reactor, conflict
                    )
                    if config["autoRecoveryDaemonEnabled"]:
                        holder["auditor"] = start_auditor(store, server.address, config, reactor)
                print(f"bookie listening on {server.address}", flush=True)
                settle_heap(reactor)
                sys.setswitchinterval(SWITCH_INTERVAL_S)

            return d2.addCallback(listening)

        d.addCallback(serve)
        d.addErrback(fail_start)

    def conflict(f: Failure) -> None:
        status["code"] = 1
        print(f"polybroker bookie: stopping: {f.getErrorMessage()}", file=sys.stderr, flush=True)
        reactor.stop()  # type: ignore[attr-defined]

    def shutdown() -> Deferred[None] | None:
        reregistration = holder.pop("reregistration", None)
        if reregistration is not None:
            reregistration.stop()
        auditor = holder.pop("auditor", None)
        # Give the auditor role up first, so another bookie's auditor takes over at once.
        stopped: Deferred[Any] = auditor.stop() if auditor is not None else succeed(None)
        server = holder.pop("server", None)
        d: Deferred[Any] = Deferred()
        if server is not None:
            stopped.addBoth(lambda _: server.stop()).chainDeferred(d)
        else:
            stopped.addBoth(lambda _: None).chainDeferred(d)
        store = holder.pop("store", None)
        if store is not None:
            d.addBoth(lambda _: store.close())
        d.addErrback(lambda f: log.error("unclean stop", extra=logs.kv(error=f.getErrorMessage())))
        return d

    reactor.callWhenRunning(start)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", shutdown)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    return status["code"]
