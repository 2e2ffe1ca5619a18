"""The broker-wide bound on publishes on their way to storage.

Each protocol bounds what one connection has on its way to storage (about 1000 publishes or
32 MiB); many fast publishers together could still hold far more. ``PublishBuffer`` counts the
bytes of every connection's publishes from the moment they are taken until storage answered
(Pulsar's ``maxMessagePublishBufferSizeInMB``). A connection's first publish makes it a
watcher. Past the limit every connection that publishes stops being read (told ``True``), as
Pulsar turns off auto-read on them, until the bytes fell to half the limit (told ``False``).
A limit of 0 means no bound.
"""

from __future__ import annotations

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
