"""The embedded store's crash safety: torn tails, corruption, the lock, compaction, kill -9.

These use the real reactor and the real file system (the store syncs on a thread); each test
opens its own directory under ``tmp_path``.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from twisted.internet import reactor, task

from polybroker.metadata import embedded
from polybroker.metadata.api import MetadataError
from polybroker.metadata.embedded import (
    CorruptStoreError,
    EmbeddedMetadataStore,
    StoreLockedError,
    frame,
)


def _logs(directory: Path) -> list[Path]:
    return sorted(directory.glob("log.*"))


async def _open(directory: Path, **kw: int) -> EmbeddedMetadataStore:
    return await EmbeddedMetadataStore.open(directory, reactor, **kw)


async def test_a_torn_tail_is_truncated_and_acknowledged_data_kept(tmp_path: Path) -> None:
    """Half a record at the log's end (a crash mid-write) is cut off; earlier puts survive."""
    store = await _open(tmp_path)
    for i in range(5):
        await store.put(f"/k/{i}", f"v{i}".encode())
    await store.close()
    (log,) = _logs(tmp_path)
    good_size = log.stat().st_size
    with log.open("ab") as f:
        f.write(frame(b"\x01" * 40)[:20])  # a record cut short

    store = await _open(tmp_path)
    try:
        assert [(await store.get(f"/k/{i}")).value for i in range(5)] == [  # type: ignore[union-attr]
            f"v{i}".encode() for i in range(5)
        ]
        assert log.stat().st_size == good_size
        await store.put("/k/after", b"x")
    finally:
        await store.close()
    store = await _open(tmp_path)
    try:
        got = await store.get("/k/after")
        assert got is not None
        assert got.value == b"x"
    finally:
        await store.close()


async def test_a_record_with_a_bad_checksum_ends_the_replay(tmp_path: Path) -> None:
    """A flipped byte in the last record makes it a torn tail: it and nothing before is dropped."""
    store = await _open(tmp_path)
    await store.put("/a", b"1")
    await store.put("/b", b"2")
    await store.close()
    (log,) = _logs(tmp_path)
    raw = bytearray(log.read_bytes())
    raw[-1] ^= 0xFF
    log.write_bytes(bytes(raw))

    store = await _open(tmp_path)
    try:
        a = await store.get("/a")
        assert a is not None
        assert a.value == b"1"
        assert await store.get("/b") is None
    finally:
        await store.close()


async def test_a_checksummed_record_that_does_not_decode_fails_the_open(tmp_path: Path) -> None:
    """Corruption passing the checksum is no torn tail: the open fails and changes nothing."""
    store = await _open(tmp_path)
    await store.put("/a", b"1")
    await store.close()
    (log,) = _logs(tmp_path)
    with log.open("ab") as f:
        f.write(frame(b"\xee garbage that is no mutation"))
    before = log.read_bytes()

    with pytest.raises(CorruptStoreError):
        await _open(tmp_path)
    assert log.read_bytes() == before


async def test_a_second_opener_is_refused_while_the_store_is_open(tmp_path: Path) -> None:
    """Two stores on one directory would corrupt it: the second open fails with the lock error."""
    store = await _open(tmp_path)
    try:
        with pytest.raises(StoreLockedError):
            await _open(tmp_path)
    finally:
        await store.close()
    again = await _open(tmp_path)
    await again.close()


async def test_compaction_bounds_the_log_and_keeps_the_latest_state(tmp_path: Path) -> None:
    """Many updates of few keys roll the log into a snapshot; a reopen sees the latest values."""
    store = await _open(tmp_path, compact_min_bytes=4096)
    for i in range(400):
        await store.put(f"/c/{i % 4}", f"value-{i}".encode() * 4)
    assert store.generation > 0
    await store.close()
    total = sum(p.stat().st_size for p in tmp_path.iterdir() if p.is_file())
    assert total < 64 * 1024

    store = await _open(tmp_path)
    try:
        for k in range(4):
            got = await store.get(f"/c/{k}")
            assert got is not None
            assert got.value == f"value-{396 + k}".encode() * 4
            assert got.stat.version == 99
    finally:
        await store.close()


_WRITER = textwrap.dedent(
    """
    import sys
    from twisted.internet import reactor, defer
    from polybroker.metadata.embedded import EmbeddedMetadataStore

    @defer.inlineCallbacks
    def main():
        store = yield EmbeddedMetadataStore.open(sys.argv[1], reactor)
        i = 0
        while True:
            yield store.put(f"/seq/{i}", str(i).encode())
            sys.stdout.write(f"{i}\\n")
            sys.stdout.flush()
            i += 1

    reactor.callWhenRunning(main)
    reactor.run()
    """
)


async def test_kill_9_loses_no_acknowledged_put(tmp_path: Path) -> None:
    """A writer killed mid-stream: every put it saw acknowledged is there after a reopen."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    acked = -1
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while acked < 200 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert acked >= 200, "the writer did not get going"

    store = await _open(tmp_path)
    try:
        for i in range(acked + 1):
            got = await store.get(f"/seq/{i}")
            assert got is not None
            assert got.value == str(i).encode()
    finally:
        await store.close()


class _Disk:
    """Stands in for the log writes of ``embedded``: while ``full``, a write puts half of its
    bytes in the file, then fails as a full disk does."""

    def __init__(self) -> None:
        self.full = False
        self.refused = 0
        self._real = embedded._write_all

    def write_all(self, fd: int, data: bytes) -> None:
        if self.full:
            os.write(fd, data[: len(data) // 2])
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        self._real(fd, data)


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await task.deferLater(reactor, 0.01, lambda: None)


async def test_a_full_disk_holds_operations_until_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log write that finds the disk full is cut off and tried again: operations wait
    rather than fail (reads too, Rule E2), and complete once there is room, with no reopen;
    the log holds whole records only, and a reopen finds every acknowledged put."""
    disk = _Disk()
    monkeypatch.setattr(embedded, "_write_all", disk.write_all)
    store = await _open(tmp_path)
    await store.put("/k/before", b"1")
    (log,) = _logs(tmp_path)
    size = log.stat().st_size
    disk.full = True
    put = store.put("/k/during", b"2")
    read = store.get("/k/before")
    await _until(lambda: disk.refused >= 2)  # tried again, and again
    assert not put.called
    assert not read.called
    assert log.stat().st_size == size  # what each failed write left was cut off
    disk.full = False
    await put
    assert (await read).value == b"1"  # type: ignore[union-attr]
    await store.put("/k/after", b"3")
    await store.close()
    store = await _open(tmp_path)
    try:
        for key, value in (("before", b"1"), ("during", b"2"), ("after", b"3")):
            got = await store.get(f"/k/{key}")
            assert got is not None
            assert got.value == value
    finally:
        await store.close()


async def test_closing_a_store_waiting_for_room_fails_what_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store closed while its disk is full fails the operations that wait (they were never
    acknowledged) and releases its lock: it opens again, without them."""
    disk = _Disk()
    monkeypatch.setattr(embedded, "_write_all", disk.write_all)
    store = await _open(tmp_path)
    await store.put("/k/kept", b"1")
    disk.full = True
    put = store.put("/k/lost", b"2")
    await _until(lambda: disk.refused >= 1)
    await store.close()
    with pytest.raises(MetadataError):
        await put
    disk.full = False
    store = await _open(tmp_path)
    try:
        assert (await store.get("/k/kept")).value == b"1"  # type: ignore[union-attr]
        assert await store.get("/k/lost") is None
    finally:
        await store.close()
