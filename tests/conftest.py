"""Checks of the machine before the suite runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from polybroker.config import KEYS
from polybroker.ledger.bookie.server import used_fraction

#: Room the suite needs below the bookies' ``diskUsageThreshold`` (its floods write about 1 GB
#: each, and pytest keeps the last runs' directories).
MARGIN = 0.05


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop at once, saying why, when the disk the tests write to is nearly full: past
    ``diskUsageThreshold`` every bookie they start turns read-only, and test after test would
    wait out its producers' timeouts instead of failing."""
    tmp = Path(tempfile.gettempdir())
    threshold = KEYS["diskUsageThreshold"].default
    used = used_fraction(tmp)
    if used > threshold - MARGIN:
        pytest.exit(
            f"{tmp} is {used:.0%} full (space reserved for root counts as used): the bookies "
            f"the tests start refuse writes past {threshold:.0%}; make room below "
            f"{threshold - MARGIN:.0%} first",
            returncode=1,
        )
