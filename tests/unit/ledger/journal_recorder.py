"""A journal under test with what it delivers recorded, as a reactor would receive it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from polybroker.ledger.bookie import journal as journal_mod
from polybroker.ledger.bookie.journal import Journal, JournalConfig, JournalPosition


class Recorder:
    """Collects the journal's group completions and failures (delivered at once)."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[Any], JournalPosition]] = []
        self.failures: list[tuple[BaseException, list[Any]]] = []

    def deliver(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def done(self, tokens: list[Any], position: JournalPosition) -> None:
        self.groups.append((tokens, position))

    def failed(self, error: BaseException, tokens: list[Any]) -> None:
        self.failures.append((error, tokens))


def open_journal(path: Path, config: JournalConfig, first: int = 1) -> tuple[Journal, Recorder]:
    """A journal in ``path`` (its first file ``first``) delivering to a new ``Recorder``."""
    rec = Recorder()
    j = Journal(
        path,
        config,
        deliver=rec.deliver,
        on_group_done=rec.done,
        on_failure=rec.failed,
        first_file_id=first,
    )
    return j, rec


def record_syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The file descriptors the journal module fdatasyncs from now on, in order (each sync still
    runs)."""
    synced: list[int] = []
    real_sync = os.fdatasync

    def sync(fd: int) -> None:
        synced.append(fd)
        real_sync(fd)

    monkeypatch.setattr(journal_mod.os, "fdatasync", sync)
    return synced
