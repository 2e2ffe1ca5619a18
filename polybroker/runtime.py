"""What every long-running polybroker process does once it has started, and what its parts
share about the machine they run on."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import resource
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

log = logging.getLogger(__name__)

#: File descriptors kept for storage (journal, entry logs, index files), logs and the metadata
#: store: client connections may take all the others (``broker_core.host.ConnectionBudget``).
RESERVED_FDS = 512


def settle_heap(clock: IReactorTime) -> HeapTrimmer:
    """Move what start-up allocated out of the collector's sight (``gc.freeze``), so full
    collections no longer walk it, and give freed heap back to the system from now on
    (``HeapTrimmer``, returned started). Measured on the storage path: the add-latency p99
    under load fell from 52-92 ms to 12-24 ms, full collections of the start-up heap having
    taken 10-20 ms each."""
    gc.collect()
    gc.freeze()
    trimmer = HeapTrimmer(clock)
    trimmer.start()
    return trimmer


class Malloc:
    """glibc's allocator: the bytes it holds free, and ``malloc_trim``. ``usable`` is false
    elsewhere (another C library), where the trimmer does nothing."""

    class _Info(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost",
            )
        ]  # fmt: skip

    def __init__(self) -> None:
        try:
            libc: Any = ctypes.CDLL("libc.so.6")
            self._info = libc.mallinfo2
            self._trim = libc.malloc_trim
        except (OSError, AttributeError):
            self.usable = False
            return
        self._info.restype = Malloc._Info
        self._info.argtypes = []
        self._trim.restype = ctypes.c_int
        self._trim.argtypes = [ctypes.c_size_t]
        self.usable = True

    def free_bytes(self) -> int:
        """Bytes the allocator holds free, in all its arenas (``mallinfo2().fordblks``)."""
        return int(self._info().fordblks)

    def trim(self) -> None:
        """Give every whole free page back to the system (``malloc_trim(0)``)."""
        self._trim(0)


class HeapTrimmer:
    """Gives the system back the heap a burst left free. glibc keeps memory freed in the
    middle of its heap: after a flood of large publishes the process stays at its peak RSS
    (hundreds of MB) however idle it is. Every ``interval_s`` (on ``clock``), once the
    allocator holds more than ``min_free`` bytes free, ``malloc_trim`` returns their pages;
    memory used again later costs a page fault per page, so small amounts stay. A trim runs on
    the reactor thread: 20 ms for 230 MB here. Under steady load the broker and the bookie hold
    30-60 MB free and are not trimmed; after a burst once."""

    def __init__(
        self,
        clock: IReactorTime,
        interval_s: float = 10.0,
        min_free: int = 64 * 1024 * 1024,
        malloc: Malloc | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.min_free = min_free
        self.malloc = malloc if malloc is not None else Malloc()
        self.trims = 0
        self._loop = LoopingCall(self.check)
        self._loop.clock = clock

    def start(self) -> None:
        """Check every ``interval_s`` from now on (nothing where the allocator is not glibc)."""
        if self.malloc.usable and not self._loop.running:
            self._loop.start(self.interval_s, now=False)

    def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()

    def check(self) -> None:
        """Trim if more than ``min_free`` bytes are held free."""
        try:
            if self.malloc.free_bytes() > self.min_free:
                self.malloc.trim()
                self.trims += 1
        except Exception:  # never worth stopping the loop (and the process's work) for
            log.exception("heap trim failed")


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the file system has no room (for now)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def out_of_room(error: BaseException) -> bool:
    """Whether ``error`` says the disk, or this process's or the system's file descriptors,
    ran out (for now): work that failed so may be tried again later."""
    return disk_full(error) or (
        isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE)
    )


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, as servers do (the
    soft default, often 1024, is far below what client connections need); return the soft
    limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
