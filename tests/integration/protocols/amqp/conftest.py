"""Fixtures of the AMQP integration tests (see ``amqp_harness`` for how threads meet)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_twisted

sys.path.insert(0, str(Path(__file__).parent))

from amqp_harness import Broker, start_broker, stop_broker


@pytest_twisted.async_yield_fixture
async def broker() -> AsyncIterator[Broker]:
    """A running broker with the default config, stopped after the test."""
    b = await start_broker()
    try:
        yield b
    finally:
        await stop_broker(b)
