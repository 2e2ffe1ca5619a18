"""Fixtures of the Pulsar integration tests (see ``pulsar_harness`` for how threads meet)."""

from __future__ import annotations

import gc
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_twisted
from twisted.internet import threads

sys.path.insert(0, str(Path(__file__).parent))

from pulsar_harness import Broker, start_broker, stop_broker


@pytest_twisted.async_yield_fixture
async def broker() -> AsyncIterator[Broker]:
    """A running broker with the default config, stopped after the test."""
    b = await start_broker()
    try:
        yield b
    finally:
        # Destroy the test's client objects now, while the broker still answers them: the
        # C++ client aborts the process if its objects are only finalized at interpreter exit.
        await threads.deferToThread(gc.collect)
        await stop_broker(b)
