"""Autorecovery on a real cluster (ZooKeeper + 4 bookie processes, each running an auditor):
after kill -9 of a bookie, the elected auditor restores Qw copies of every closed ledger it
held; when the auditor's own host is killed, another bookie's auditor takes over and does it."""

from __future__ import annotations

import time
from typing import Any

import pytest_twisted
from cluster_harness import Bookie, BookieProcesses, LedgerClientRig
from twisted.internet import reactor, threads
from twisted.internet.task import deferLater

from polybroker.ledger.api import LedgerConfig, LedgerMetadata
from polybroker.ledger.auditor import UNDERREPLICATED_PATH, current_auditor

SESSION_MS = 2000
CONFIG = {"metadataStoreSessionTimeoutMillis": SESSION_MS, "lostBookieRecoveryDelay": 0}
ENTRIES = 60
RESTORE_BOUND_S = 30.0


def payload(ledger_id: int, i: int) -> bytes:
    return f"ledger-{ledger_id}-entry-{i}-".encode() + b"y" * 200


def names(meta: LedgerMetadata) -> set[str]:
    return {a for _, ensemble in meta.fragments for a in ensemble}


async def poll(check: Any, timeout: float, what: str) -> float:
    """Await ``check()`` (a coroutine function) until it is true; the seconds it took."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout}s"
        await deferLater(reactor, 0.05, lambda: None)
    return time.monotonic() - start


async def start_cluster(zk_url: str, bookies: BookieProcesses, n: int = 4) -> LedgerClientRig:
    for _ in range(n):
        await threads.deferToThread(bookies.start, zk_url, CONFIG)
    rig = await LedgerClientRig.open(zk_url)

    async def elected() -> bool:
        return await current_auditor(rig.store) is not None

    await poll(elected, 30, "an auditor elected")
    return rig


async def closed_ledger(rig: LedgerClientRig) -> int:
    w = await rig.client.create(LedgerConfig(3, 2, 2))
    for i in range(ENTRIES):
        await w.append(payload(w.ledger_id, i))
    await w.close_ledger()
    return int(w.ledger_id)


async def assert_fully_replicated(rig: LedgerClientRig, ledger_ids: list[int], dead: str) -> None:
    """Every entry is on every bookie of its write set (read from each bookie directly)."""
    for ledger_id in ledger_ids:
        meta = await rig.metadata(ledger_id)
        assert dead not in names(meta), meta
        by_bookie: dict[str, list[int]] = {}
        for e in range(meta.last_entry_id + 1):
            for address in meta.write_set(e):
                by_bookie.setdefault(address, []).append(e)
        for address, entry_ids in by_bookie.items():
            held = await rig.stored_on(address, ledger_id, entry_ids)
            assert held == {e: payload(ledger_id, e) for e in entry_ids}, (address, ledger_id)
    assert await rig.store.children(UNDERREPLICATED_PATH) == []


async def wait_restored(rig: LedgerClientRig, ledger_ids: list[int], dead: str) -> float:
    async def restored() -> bool:
        for ledger_id in ledger_ids:
            if dead in names(await rig.metadata(ledger_id)):
                return False
        return True

    return await poll(restored, RESTORE_BOUND_S, f"ledgers no longer naming {dead}")


def by_address(bookies: BookieProcesses, address: str) -> Bookie:
    (bookie,) = [b for b in bookies.running if b.address == address]
    return bookie


@pytest_twisted.ensureDeferred
async def test_the_auditor_restores_qw_copies_after_a_bookie_is_killed(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """Closed ledgers (E=3, Qw=2, Qa=2) over 4 bookies; kill -9 one that is not the auditor's
    host: within a bounded wait no ledger names it, every entry is on each bookie of its write
    set, and no ledger stays marked under-replicated."""
    rig = await start_cluster(zk_url, bookies)
    try:
        ledgers = [await closed_ledger(rig) for _ in range(4)]
        host = await current_auditor(rig.store)
        counts: dict[str, int] = {}
        for ledger_id in ledgers:
            for address in names(await rig.metadata(ledger_id)):
                counts[address] = counts.get(address, 0) + 1
        victim = max((a for a in counts if a != host), key=lambda a: counts[a])
        affected = [lid for lid in ledgers if victim in names(await rig.metadata(lid))]
        killed_at = time.monotonic()
        bookies.kill(by_address(bookies, victim))
        await wait_restored(rig, affected, victim)
        took = time.monotonic() - killed_at
        print(
            f"\nbookie kill -9 -> Qw restored for {len(affected)} ledgers: {took:.2f}s "
            f"(session timeout {SESSION_MS / 1000}s, lostBookieRecoveryDelay 0)"
        )
        await assert_fully_replicated(rig, ledgers, victim)
        for ledger_id in ledgers:
            reader = await rig.client.open(ledger_id)
            got = await reader.read(0, ENTRIES - 1)
            assert got == [payload(ledger_id, i) for i in range(ENTRIES)]
    finally:
        await rig.close()


@pytest_twisted.ensureDeferred
async def test_another_auditor_takes_over_when_the_auditors_host_is_killed(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """kill -9 of the bookie whose auditor leads: another bookie's auditor is elected once the
    dead session expires, and it re-replicates the dead host's ledgers."""
    rig = await start_cluster(zk_url, bookies)
    try:
        host = await current_auditor(rig.store)
        assert host is not None
        ledgers: list[int] = []
        while len(ledgers) < 3 or not any(
            [host in names(await rig.metadata(lid)) for lid in ledgers]
        ):
            assert len(ledgers) < 20, "no ledger placed on the auditor's host"
            ledgers.append(await closed_ledger(rig))
        affected = [lid for lid in ledgers if host in names(await rig.metadata(lid))]
        killed_at = time.monotonic()
        bookies.kill(by_address(bookies, host))

        async def taken_over() -> bool:
            now = await current_auditor(rig.store)
            return now is not None and now != host

        await poll(taken_over, SESSION_MS / 1000 + 10, "another auditor elected")
        successor = await current_auditor(rig.store)
        assert successor in {b.address for b in bookies.running}
        await wait_restored(rig, affected, host)
        print(
            f"\nauditor host kill -9 -> {successor} leads and Qw is restored: "
            f"{time.monotonic() - killed_at:.2f}s"
        )
        await assert_fully_replicated(rig, ledgers, host)
    finally:
        await rig.close()


@pytest_twisted.ensureDeferred
async def test_a_stopped_auditor_host_hands_the_role_over_at_once(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """SIGTERM of the auditor's host gives the role up as it stops: another auditor leads well
    before the stopped bookie's session (10 s here) could have expired."""
    config = {"metadataStoreSessionTimeoutMillis": 10_000}
    for _ in range(2):
        await threads.deferToThread(bookies.start, zk_url, config)
    rig = await LedgerClientRig.open(zk_url)
    try:

        async def elected() -> bool:
            return await current_auditor(rig.store) is not None

        await poll(elected, 30, "an auditor elected")
        host = await current_auditor(rig.store)
        assert host is not None
        stopped_at = time.monotonic()
        assert await threads.deferToThread(bookies.stop, by_address(bookies, host)) == 0

        async def handed_over() -> bool:
            now = await current_auditor(rig.store)
            return now is not None and now != host

        await poll(handed_over, 5, "the role handed over")
        print(f"\nauditor host stopped -> successor leads: {time.monotonic() - stopped_at:.2f}s")
        assert await current_auditor(rig.store) == bookies.running[0].address
    finally:
        await rig.close()


@pytest_twisted.ensureDeferred
async def test_a_bookie_with_autorecovery_disabled_never_audits(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """autoRecoveryDaemonEnabled=false: that bookie never contends; the role goes to one that
    runs an auditor, even one started later."""
    quiet = await threads.deferToThread(
        bookies.start, zk_url, {**CONFIG, "autoRecoveryDaemonEnabled": "false"}
    )
    rig = await LedgerClientRig.open(zk_url)
    try:
        assert quiet.address in await rig.available()
        assert await current_auditor(rig.store) is None
        auditing = await threads.deferToThread(bookies.start, zk_url, CONFIG)

        async def elected() -> bool:
            return await current_auditor(rig.store) is not None

        await poll(elected, 30, "an auditor elected")
        assert await current_auditor(rig.store) == auditing.address
    finally:
        await rig.close()


@pytest_twisted.ensureDeferred
async def test_an_auditor_killed_mid_repair_is_finished_by_its_successor(
    zk_url: str, bookies: BookieProcesses
) -> None:
    """kill -9 of the auditor's host as soon as it marked a ledger under-replicated (its copies
    under way): whatever it had switched or not, the successor completes the repair; no ledger
    names either dead bookie and every entry has its Qw copies."""
    from twisted.internet.defer import gatherResults

    from polybroker.ledger.client import BookKeeperClient
    from polybroker.ledger.registry import StaticBookieRegistry, tcp_connector

    rig = await start_cluster(zk_url, bookies, n=5)
    host = await current_auditor(rig.store)
    assert host is not None
    # Ledgers only on the four other bookies: losing the host too loses no write set.
    others = [b.address for b in bookies.running if b.address != host]
    writer = BookKeeperClient(
        rig.store, StaticBookieRegistry(others), tcp_connector(reactor), reactor
    )
    try:
        ledgers = []
        for _ in range(4):
            w = await writer.create(LedgerConfig(3, 2, 2))
            await gatherResults([w.append(payload(w.ledger_id, i)) for i in range(ENTRIES * 20)])
            await w.close_ledger()
            ledgers.append(int(w.ledger_id))
        counts = {a: 0 for a in others}
        for ledger_id in ledgers:
            for address in names(await rig.metadata(ledger_id)):
                counts[address] += 1
        victim = max(others, key=lambda a: counts[a])
        affected = [lid for lid in ledgers if victim in names(await rig.metadata(lid))]
        bookies.kill(by_address(bookies, victim))

        async def marked() -> bool:
            return bool(await rig.store.children(UNDERREPLICATED_PATH))

        await poll(marked, SESSION_MS / 1000 + 15, "a ledger marked under-replicated")
        bookies.kill(by_address(bookies, host))
        switched = [lid for lid in affected if victim not in names(await rig.metadata(lid))]
        print(f"\nauditor killed with {len(switched)}/{len(affected)} ledgers switched")
        await wait_restored(rig, affected, victim)
        await wait_restored(rig, ledgers, host)
        for dead in (victim, host):
            await assert_fully_replicated(rig, ledgers, dead)
    finally:
        await writer.close()
        await rig.close()
