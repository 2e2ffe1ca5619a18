"""The metadata store seam and its implementations."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed

from polybroker.metadata.api import MetadataStore

URL_FORMS = (
    '"" or "embedded" (persisted under <dataDir>/metadata)',
    '"memory:" (in this process only, lost at exit)',
    '"zk://host:port[,host:port...][/chroot]" (ZooKeeper)',
)


def open_metadata_store(
    url: str, *, data_dir: str | os.PathLike[str], reactor: Any
) -> Deferred[MetadataStore]:
    """Open the metadata store that ``url`` names; raise ``ValueError`` for a URL of no known
    form (the message lists the forms). The Deferred fails if the store cannot be opened
    (e.g. ``StoreLockedError`` when another process holds the embedded store)."""
    url = url.strip()
    if url in ("", "embedded"):
        from polybroker.metadata.embedded import EmbeddedMetadataStore

        d: Deferred[Any] = EmbeddedMetadataStore.open(Path(data_dir) / "metadata", reactor)
        return d
    if url == "memory:":
        from polybroker.metadata.memory import MemoryMetadataStore

        return succeed(MemoryMetadataStore(reactor))
    if url.startswith("zk://"):
        raise ValueError("ZooKeeper metadata store is not available yet")
    raise ValueError(
        f"unknown metadata store URL {url!r}; expected one of: " + "; ".join(URL_FORMS)
    )
