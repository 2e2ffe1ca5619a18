"""Where the ledger client finds writable bookies, and how it connects to one.

Rule 1: ``writable_bookies`` answers "host:port" addresses, each at most once, in a stable order.
Rule 2: ``MetadataBookieRegistry`` lists the children of ``/bookies/available`` (the ephemeral
        nodes bookies register) and keeps a cached copy current through a watch, so a bookie that
        dies (its session ends) stops being offered without a round trip per question.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from polybroker.ledger.api import BookieClient
from polybroker.ledger.bookie.cookie import AVAILABLE_PATH
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
    """A fixed list of bookies (a standalone broker, tests, benchmarks)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(dict.fromkeys(addresses))

    def writable_bookies(self) -> Deferred[list[str]]:
        return succeed(list(self._addresses))


class MetadataBookieRegistry(BookieRegistry):
    """The bookies announced under ``/bookies/available`` in the metadata store (Rule 2)."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store
        self._cached: list[str] | None = None
        self._generation = 0
        self._unwatch: Callable[[], None] | None = store.watch(AVAILABLE_PATH, self._changed)

    def writable_bookies(self) -> Deferred[list[str]]:
        if self._cached is not None:
            return succeed(list(self._cached))
        generation = self._generation

        def got(names: list[str]) -> list[str]:
            # A change seen while the read was in flight makes this answer stale: do not keep it.
            if generation == self._generation and self._unwatch is not None:
                self._cached = list(names)
            return list(names)

        return self._store.children(AVAILABLE_PATH).addCallback(got)

    def close(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
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
