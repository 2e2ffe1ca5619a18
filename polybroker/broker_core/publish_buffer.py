"""The broker-wide bound on publishes on their way to storage.

Each protocol bounds what one connection has on its way to storage (about 1000 publishes or
32 MiB); many fast publishers together could still hold far more. ``PublishBuffer`` counts the
bytes of every connection's publishes from the moment they are taken until storage answered
(Pulsar's ``maxMessagePublishBufferSizeInMB``). A connection's first publish makes it a
watcher. Past the limit every connection that publishes stops being read (told ``True``), as
Pulsar turns off auto-read on them, until the bytes fell to half the limit (told ``False``).
A limit of 0 means no bound. ``PendingPublishes`` is one connection's own bound, counted in the
broker-wide buffer too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class BufferWatcher(Protocol):
    """A connection that publishes: told when reading it must stop, and when it may go on."""

    def publish_buffer_full(self, full: bool) -> None: ...


class PublishBuffer:
    """Bytes of publishes under way, broker-wide (see the module docstring)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self.full = False
        self._watchers: dict[int, BufferWatcher] = {}

    def watch(self, watcher: BufferWatcher) -> None:
        """Tell ``watcher`` of every change from now on (once, however often it is added);
        told at once if the buffer is full now."""
        if id(watcher) not in self._watchers:
            self._watchers[id(watcher)] = watcher
            if self.full:
                watcher.publish_buffer_full(True)

    def unwatch(self, watcher: BufferWatcher) -> None:
        """Tell ``watcher`` nothing more (a closed connection; whether it watched or not)."""
        self._watchers.pop(id(watcher), None)

    def take(self, size: int, watcher: BufferWatcher) -> None:
        """``size`` bytes of a publish of ``watcher`` are on their way to storage (it watches
        from now on)."""
        if id(watcher) not in self._watchers:
            self.watch(watcher)
        self.used += size
        if not self.full and self.limit and self.used > self.limit:
            self._tell(True)

    def give(self, size: int) -> None:
        """Storage answered a publish of ``size`` bytes taken before."""
        self.used -= size
        if self.full and self.used <= self.limit // 2:
            self._tell(False)

    def _tell(self, full: bool) -> None:
        self.full = full
        for watcher in list(self._watchers.values()):
            watcher.publish_buffer_full(full)


class PendingPublishes:
    """What one connection has on its way to storage: ``count`` publishes (SENDs, stores,
    basic.publishes) of ``size`` bytes in all, taken from the broker-wide ``buffer`` too. Past
    ``max_count`` or ``max_bytes`` the connection is told to stop reading (``hold(True)``),
    and told it may go on (``hold(False)``) once both fell to half."""

    __slots__ = (
        "_buffer",
        "_hold",
        "_max_bytes",
        "_max_count",
        "_watcher",
        "count",
        "held",
        "size",
    )

    def __init__(
        self,
        buffer: PublishBuffer,
        watcher: BufferWatcher,
        hold: Callable[[bool], None],
        max_count: int,
        max_bytes: int,
    ) -> None:
        self.count = 0
        self.size = 0
        self.held = False
        self._buffer = buffer
        self._watcher = watcher
        self._hold = hold
        self._max_count = max_count
        self._max_bytes = max_bytes

    def take(self, size: int) -> None:
        """A publish of ``size`` bytes is on its way to storage."""
        self.count += 1
        self.size += size
        self._buffer.take(size, self._watcher)
        if not self.held and (self.count > self._max_count or self.size > self._max_bytes):
            self.held = True
            self._hold(True)

    def give(self, size: int, count: int = 1) -> bool:
        """Storage answered ``count`` publishes of ``size`` bytes in all; whether that lifted
        the hold."""
        self.count -= count
        self.size -= size
        self._buffer.give(size)
        if self.held and self.count <= self._max_count // 2 and self.size <= self._max_bytes // 2:
            self.held = False
            self._hold(False)
            return True
        return False

    def close(self) -> None:
        """The connection closed: the broker-wide buffer tells it nothing more (its
        publishes under way still give back their bytes)."""
        self._buffer.unwatch(self._watcher)
