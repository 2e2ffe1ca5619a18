"""A bookie's announcement across restarts, as the auditor relies on it: a bookie restarted
after a crash is announced by its new session, not by the dying one's node."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest
from fake_bookie import result_of
from twisted.internet.task import Clock

from polybroker.ledger.bookie.cookie import (
    AVAILABLE_PATH,
    CookieError,
    check_or_create,
    register,
)
from polybroker.metadata.memory import MemoryMetadataStore

ADDRESS = "127.0.0.1:3181"


def test_a_restart_before_the_old_session_expired_stays_announced(tmp_path: Path) -> None:
    """The crashed run's ephemeral node is replaced by the new run's, so the bookie is still
    announced once the old session expires."""
    clock = Clock()
    tree = MemoryMetadataStore(clock)
    cookie = check_or_create(tmp_path)
    old_run = tree.new_session()
    result_of(register(old_run, ADDRESS, cookie))
    new_run = tree.new_session()
    result_of(register(new_run, ADDRESS, cookie))
    old_run.expire_session(reestablish=False)
    node = result_of(tree.get(f"{AVAILABLE_PATH}/{ADDRESS}"))
    assert node is not None
    assert node.stat.ephemeral
    # And it is the new run's node: it goes with the new session.
    result_of(new_run.close())
    assert result_of(tree.get(f"{AVAILABLE_PATH}/{ADDRESS}")) is None


def test_a_wiped_bookie_is_refused_and_its_old_announcement_is_untouched(tmp_path: Path) -> None:
    """A data dir wiped (a new identity) at a registered address is refused before it
    announces anything."""
    clock = Clock()
    tree = MemoryMetadataStore(clock)
    first = tree.new_session()
    result_of(register(first, ADDRESS, check_or_create(tmp_path / "a")))
    wiped = check_or_create(tmp_path / "b")
    second = tree.new_session()
    with pytest.raises(CookieError, match="must not rejoin"):
        result_of(register(second, ADDRESS, wiped))
    result_of(second.close())
    assert result_of(tree.get(f"{AVAILABLE_PATH}/{ADDRESS}")) is not None
