"""``polybroker bookie``: run one bookie process until SIGTERM or SIGINT.

Prints ``bookie listening on HOST:PORT`` on stdout once it serves (tools wait for that line);
exits 0 after a clean stop, 1 when it cannot start (a cookie mismatch, a bad config, a port in
use), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.python.failure import Failure

from polybroker import logs
from polybroker.config import ConfigError, load
from polybroker.ledger.api import StorageError

log = logging.getLogger(__name__)


def _open_store(url: str, data_dir: Path, reactor: Any) -> Deferred[Any]:
    """Open the metadata store named by ``url`` (a Deferred of it)."""
    try:
        from polybroker.metadata import open_metadata_store  # type: ignore[attr-defined]
    except ImportError:
        return Deferred.fromCoroutine(_missing_store(url))
    return maybeDeferred(open_metadata_store, url, data_dir=data_dir, reactor=reactor)


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
        d: Deferred[Any] = _open_store(url, data_dir, reactor) if url else Deferred()
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
                print(f"bookie listening on {server.address}", flush=True)

            return d2.addCallback(listening)

        d.addCallback(serve)
        d.addErrback(fail_start)

    def shutdown() -> Deferred[None] | None:
        server = holder.pop("server", None)
        d: Deferred[Any] = server.stop() if server is not None else Deferred()
        if server is None:
            d.callback(None)
        store = holder.pop("store", None)
        if store is not None:
            d.addBoth(lambda _: store.close())
        d.addErrback(lambda f: log.error("unclean stop", extra=logs.kv(error=f.getErrorMessage())))
        return d

    reactor.callWhenRunning(start)  # type: ignore[attr-defined]
    reactor.addSystemEventTrigger("before", "shutdown", shutdown)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    return status["code"]
