"""Where the ledger client finds writable bookies, and how it connects to one.

Rule 1: ``writable_bookies`` answers "host:port" addresses, each at most once, in a stable order.
Rule 2: ``MetadataBookieRegistry`` lists the children of ``/bookies/available`` (the ephemeral
        nodes bookies register) less those of ``/bookies/readonly`` (bookies refusing adds, as
        their disk is full), and keeps a cached copy current through watches of both, so a
        bookie that dies (its session ends) or turns read-only stops being offered without a
        round trip per question.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from polybroker.ledger.api import BookieClient
from polybroker.ledger.bookie.cookie import AVAILABLE_PATH, READONLY_PATH
from polybroker.metadata.api import MetadataStore, Notification

log = logging.getLogger(__name__)


class BookieRegistry(abc.ABC):
    """The bookies new ensembles may be chosen from."""

    @abc.abstractmethod
    def writable_bookies(self) -> Deferred[list[str]]:
        """Return the addresses ("host:port") of the bookies that take writes now."""

    def close(self) -> None:  # noqa: B027 - optional hook, most registries hold nothing
        """Release what the registry holds (watches); idempotent."""


class StaticBookieRegistry(BookieRegistry):
    """A fixed list of bookies (a standalone broker, tests, benchmarks), less those that
    ``writable`` (when given) says refuse adds now."""

    def __init__(
        self, addresses: Sequence[str], writable: Callable[[str], bool] | None = None
    ) -> None:
        self._addresses = list(dict.fromkeys(addresses))
        self._writable = writable

    def writable_bookies(self) -> Deferred[list[str]]:
        if self._writable is None:
            return succeed(list(self._addresses))
        return succeed([a for a in self._addresses if self._writable(a)])


class MetadataBookieRegistry(BookieRegistry):
    """The writable bookies announced in the metadata store (Rule 2)."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store
        self._cached: list[str] | None = None
        self._generation = 0
        self._unwatch: list[Callable[[], None]] | None = [
            store.watch(AVAILABLE_PATH, self._changed),
            store.watch(READONLY_PATH, self._changed),
        ]

    def writable_bookies(self) -> Deferred[list[str]]:
        if self._cached is not None:
            return succeed(list(self._cached))
        generation = self._generation

        def got(read_only: list[str], available: list[str]) -> list[str]:
            refusing = set(read_only)
            names = [n for n in available if n not in refusing]
            # A change seen while the reads were in flight makes this answer stale: do not keep it.
            if generation == self._generation and self._unwatch is not None:
                self._cached = list(names)
            return names

        d = self._store.children(AVAILABLE_PATH)
        return d.addCallback(
            lambda available: self._store.children(READONLY_PATH).addCallback(got, available)
        )

    def close(self) -> None:
        if self._unwatch is not None:
            for unwatch in self._unwatch:
                unwatch()
            self._unwatch = None
        self._cached = None

    def _changed(self, _: Notification) -> None:
        self._generation += 1
        self._cached = None
        if self._unwatch is not None:
            self.writable_bookies().addErrback(self._refresh_failed)

    def _refresh_failed(self, failure: Failure) -> None:
        log.warning("cannot list available bookies: %s", failure.getErrorMessage())


def tcp_connector(reactor: Any) -> Callable[[str], BookieClient]:
    """Return a connect function making one ``TcpBookieClient`` per address on ``reactor``."""
    from polybroker.ledger.bookie_client import TcpBookieClient

    def connect(address: str) -> BookieClient:
        return TcpBookieClient(address, reactor)

    return connect
