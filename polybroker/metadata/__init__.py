"""The metadata store seam and its implementations."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed

from polybroker.config import ConfigError
from polybroker.metadata.api import MetadataStore

URL_FORMS = (
    '"" or "embedded" (persisted under <dataDir>/metadata)',
    '"memory:" (in this process only, lost at exit)',
    '"zk://host:port[,host:port...][/chroot]" (ZooKeeper)',
)


def open_metadata_store(
    url: str,
    *,
    data_dir: str | os.PathLike[str],
    reactor: Any,
    session_timeout_ms: int | None = None,
) -> Deferred[MetadataStore]:
    """Open the metadata store that ``url`` names; raise ``ConfigError`` (a ``ValueError``)
    for a URL of no known form or a malformed ``zk://`` URL (the message says which forms are
    known). The Deferred fails if the store cannot be opened (e.g. ``StoreLockedError`` when
    another process holds the embedded store, ``MetadataError`` when ZooKeeper does not
    answer). ``session_timeout_ms`` applies to ZooKeeper only."""
    url = url.strip()
    if url in ("", "embedded"):
        from polybroker.metadata.embedded import EmbeddedMetadataStore

        d: Deferred[Any] = EmbeddedMetadataStore.open(Path(data_dir) / "metadata", reactor)
        return d
    if url == "memory:":
        from polybroker.metadata.memory import MemoryMetadataStore

        return succeed(MemoryMetadataStore(reactor))
    if url.startswith("zk://"):
        from polybroker.metadata.zookeeper import DEFAULT_SESSION_TIMEOUT_MS, ZooKeeperMetadataStore

        zk: Deferred[Any] = ZooKeeperMetadataStore.open(
            url, reactor, session_timeout_ms=session_timeout_ms or DEFAULT_SESSION_TIMEOUT_MS
        )
        return zk
    raise ConfigError(
        f"unknown metadata store URL {url!r}; expected one of: " + "; ".join(URL_FORMS)
    )
