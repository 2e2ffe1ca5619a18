"""Bookie loss on a real cluster (ZooKeeper + bookie processes, a ledger client in the test):
kill -9 of a bookie under a steady write stream stops no writer and loses nothing; a bookie
whose data dir was wiped is refused at its old address, one that comes back with its data
rejoins (also before its crashed session expired)."""

from __future__ import annotations

import itertools
import shutil
import time

import pytest_twisted
from cluster_harness import BookieProcesses, LedgerClientRig, eventually, port_of, run_to_exit
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred, DeferredSemaphore
from twisted.internet.task import deferLater
from twisted.python.failure import Failure

from polybroker.ledger.api import LedgerConfig, LedgerState

SESSION_MS = 2000
CONFIG = {"metadataStoreSessionTimeoutMillis": SESSION_MS, "lostBookieRecoveryDelay": 0}
WRITES_RESUME_TARGET_S = 2.0


def payload(i: int) -> bytes:
    return f"entry-{i:06d}-".encode() + b"x" * 90


@pytest_twisted.ensureDeferred
async def test_kill_9_of_a_bookie_under_a_write_stream_stops_no_writer(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """E=3, Qw=2, Qa=2 over 4 bookie processes, adds pipelined 8 deep: kill -9 one bookie of the
    ensemble; every add still succeeds (ensemble change), writes resume quickly (time printed),
    and every acknowledged entry reads back after the ledger is closed."""
    for _ in range(4):
        await threads.deferToThread(bookies.start, zk_url, CONFIG)
    rig = await LedgerClientRig.open(zk_url)
    try:
        assert len(await rig.available()) == 4
        w = await rig.client.create(LedgerConfig(3, 2, 2))
        window = DeferredSemaphore(8)
        acked: dict[int, float] = {}
        submitted: dict[int, float] = {}
        failures: list[Failure] = []
        stop = [False]
        next_id = [0]

        def record(result: object, i: int) -> None:
            if isinstance(result, Failure):
                failures.append(result)
            else:
                acked[i] = time.monotonic()
            window.release()

        async def stream() -> None:
            while not stop[0] and not failures:
                await window.acquire()
                i = next_id[0]
                next_id[0] += 1
                submitted[i] = time.monotonic()
                w.append(payload(i)).addBoth(record, i)

        writer = Deferred.fromCoroutine(stream())
        await eventually(lambda: len(acked) >= 200, 30, "200 adds before the kill")
        victim_address = w.metadata.fragments[-1][1][0]
        (victim,) = [b for b in bookies.running if b.address == victim_address]
        killed_at = time.monotonic()
        acked_before = len(acked)
        bookies.kill(victim)
        await eventually(
            lambda: bool(failures) or sum(1 for t in acked.values() if t > killed_at) >= 300,
            30,
            "300 adds after the kill",
        )
        stop[0] = True
        await writer
        await eventually(lambda: len(acked) + len(failures) == next_id[0], 30, "adds answered")
        assert not failures, failures[0]
        await w.close_ledger()

        after_kill = [i for i, t in submitted.items() if t > killed_at]
        resumed = min(acked[i] for i in after_kill) - killed_at
        completions = sorted([killed_at, *acked.values()])
        stall = max(b - a for a, b in itertools.pairwise(completions))
        print(
            f"\nbookie kill -9 -> first add issued after the kill completes: {resumed:.3f}s; "
            f"longest gap between completions: {stall:.3f}s (target < {WRITES_RESUME_TARGET_S}s); "
            f"{acked_before} adds before, {len(acked) - acked_before} after"
        )
        assert resumed < 10 * WRITES_RESUME_TARGET_S, resumed

        meta = await rig.metadata(w.ledger_id)
        assert meta.state is LedgerState.CLOSED
        assert meta.last_entry_id == next_id[0] - 1
        assert len(meta.fragments) >= 2
        assert victim_address not in meta.fragments[-1][1]
        reader = await rig.client.open(w.ledger_id)
        got = await reader.read(0, meta.last_entry_id)
        assert got == [payload(i) for i in range(next_id[0])]
    finally:
        await rig.close()


@pytest_twisted.ensureDeferred
async def test_a_wiped_bookie_is_refused_and_one_with_its_data_rejoins(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """A bookie whose data dir was wiped cannot start at its old address (identity registered in
    ZooKeeper); one killed -9 and restarted at once with its data rejoins: it stays announced
    after its old session expires, and serves what it held."""
    wiped = await threads.deferToThread(bookies.start, zk_url, CONFIG)
    keeper = await threads.deferToThread(bookies.start, zk_url, CONFIG)
    rig = await LedgerClientRig.open(zk_url)
    try:
        assert bookies.stop(wiped) == 0
        shutil.rmtree(wiped.data_dir)
        code, err = await threads.deferToThread(
            run_to_exit, zk_url, wiped.data_dir, port_of(wiped), CONFIG
        )
        assert code == 1, err
        assert "must not rejoin under its old address" in err, err
        assert wiped.address not in await rig.available()

        # Only the keeper is available: a ledger on it alone.
        w = await rig.client.create(LedgerConfig(1, 1, 1))
        assert w.metadata.fragments[0][1] == (keeper.address,)
        for i in range(20):
            await w.append(payload(i))
        await w.close_ledger()

        bookies.kill(keeper)
        back = await threads.deferToThread(
            bookies.start, zk_url, CONFIG, 60.0, data_dir=keeper.data_dir, port=port_of(keeper)
        )
        assert back.address == keeper.address
        # Past the crashed run's session: the new run's announcement must still be there.
        deadline = time.monotonic() + SESSION_MS / 1000 + 4.0
        while time.monotonic() < deadline:
            assert keeper.address in await rig.available()
            await deferLater(reactor, 0.2, lambda: None)
        assert keeper.address in await rig.available()
        held = await rig.stored_on(keeper.address, w.ledger_id, list(range(20)))
        assert held == {i: payload(i) for i in range(20)}
        reader = await rig.client.open(w.ledger_id)
        assert await reader.read(0, 19) == [payload(i) for i in range(20)]
    finally:
        await rig.close()
