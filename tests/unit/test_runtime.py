"""Unit tests of what every long-running process does once started: the heap trimmer."""

from __future__ import annotations

import os

from twisted.internet.task import Clock

from polybroker.runtime import HeapTrimmer, Malloc

MB = 1024 * 1024


class FakeMalloc(Malloc):
    """An allocator holding ``free`` bytes free; ``trim`` gives them all back."""

    def __init__(self, free: int = 0) -> None:
        self.usable = True
        self.free = free
        self.trimmed = 0

    def free_bytes(self) -> int:
        return self.free

    def trim(self) -> None:
        self.trimmed += 1
        self.free = 0


def test_trims_on_each_interval_only_when_more_than_min_free_is_held() -> None:
    clock = Clock()
    malloc = FakeMalloc(10 * MB)
    trimmer = HeapTrimmer(clock, interval_s=10, min_free=64 * MB, malloc=malloc)
    trimmer.start()
    clock.advance(10)
    assert malloc.trimmed == 0  # 10 MB free: left
    malloc.free = 65 * MB
    clock.advance(9)
    assert malloc.trimmed == 0  # not before the interval
    clock.advance(1)
    assert (malloc.trimmed, malloc.free, trimmer.trims) == (1, 0, 1)
    clock.advance(10)
    assert malloc.trimmed == 1  # nothing free since
    trimmer.stop()
    malloc.free = 100 * MB
    clock.advance(100)
    assert malloc.trimmed == 1


def test_nothing_runs_where_the_allocator_is_not_glibc() -> None:
    clock = Clock()
    malloc = FakeMalloc(100 * MB)
    malloc.usable = False
    HeapTrimmer(clock, malloc=malloc).start()
    assert clock.getDelayedCalls() == []


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def test_glibc_gives_back_what_a_burst_left_free_in_the_middle_of_the_heap() -> None:
    """Large objects freed between small ones that stay: glibc keeps their pages (the heap's
    top cannot shrink) until the trimmer's check returns them."""
    malloc = Malloc()
    assert malloc.usable  # Linux with glibc, as the broker's machines and CI run
    burst: list[bytes] = []
    pins: list[bytes] = []
    for i in range(20_000):
        burst.append(bytes(10_000) + i.to_bytes(4, "big"))  # 10 KB, touched: resident
        pins.append(bytes(600) + i.to_bytes(4, "big"))  # past pymalloc's 512: glibc's heap
    del burst
    assert malloc.free_bytes() > 150 * MB
    before = resident_mb()
    trimmer = HeapTrimmer(Clock(), min_free=64 * MB, malloc=malloc)
    trimmer.check()
    assert trimmer.trims == 1
    assert before - resident_mb() > 100
    assert malloc.free_bytes() > 150 * MB  # still free for reuse, just not resident
    assert len(pins) == 20_000
