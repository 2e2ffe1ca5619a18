"""What every long-running polybroker process does once it has started, and what its parts
share about the machine they run on."""

from __future__ import annotations

import errno
import gc


def settle_heap() -> None:
    """Move what start-up allocated out of the collector's sight (``gc.freeze``), so full
    collections no longer walk it. Measured on the storage path: the add-latency p99 under
    load fell from 52-92 ms to 12-24 ms, full collections of the start-up heap having taken
    10-20 ms each."""
    gc.collect()
    gc.freeze()


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the file system has no room (for now)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
