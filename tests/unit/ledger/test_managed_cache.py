"""The entry cache behind tailing reads: hits, bounds, eviction behind the slowest reader."""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger_client import Rig, failure_of, result_of

from polybroker.ledger.api import BookieError, Entry, InitialPosition, Position
from polybroker.ledger.cache import ENTRY_OVERHEAD, FIELDS, EntryCache, EntryCacheManager


def test_tailing_reads_are_served_from_memory() -> None:
    """A cursor that keeps up reads what was just appended without asking the ledgers."""
    rig = Rig()
    ml = rig.open()
    c = result_of(ml.open_cursor("sub"))
    for i in range(50):
        result_of(ml.append(b"x%d" % i))
        assert [e.data for e in result_of(c.read(10))] == [b"x%d" % i]
    assert rig.client.reads == 0
    stats = rig.factory.cache_stats()
    assert (stats["hits"], stats["misses"]) == (50, 0)


def test_a_read_just_after_an_append_is_served_from_the_cache_with_no_cursor() -> None:
    """A reader by position (a Kafka fetch) with no cursor open reads the tail from memory."""
    rig = Rig()
    ml = rig.open()
    assert not ml._cursors
    for i in range(20):
        entry = result_of(ml.append(b"m%d" % i))
        assert result_of(ml.read(entry.position, 10)) == [entry]
    assert rig.client.reads == 0


def test_without_cursors_entries_older_than_the_tail_window_are_evicted() -> None:
    """An append drops entries published more than ``tail_cache_ms`` ago (here with no
    cursor); an evicted entry is read back from the ledger."""
    rig = Rig()
    ml = rig.open()
    old = rig.append(ml, b"a", b"b")
    rig.clock.advance(rig.factory.tail_cache_ms / 1000.0 + 0.001)
    new = rig.append(ml, b"c")
    assert len(ml._cache) == 1
    assert ml._cache.get(ml._cache.first_seq() or 0) == new[0]
    assert result_of(ml.read(old[0].position, 3)) == [*old, *new]
    assert rig.client.reads == 1


def test_a_subscription_that_fell_behind_does_not_pin_old_entries() -> None:
    """Entries appended longer ago than the tail window leave the cache although a cursor has
    not read them (Pulsar evicts by age, so a backlog does not hold memory for hours): the
    cursor reads them back from the ledger, in order."""
    rig = Rig()
    ml = rig.open()
    c = result_of(ml.open_cursor("sub"))
    rig.append(ml, b"a", b"b")
    rig.clock.advance(rig.factory.tail_cache_ms / 1000.0 + 0.001)
    rig.append(ml, b"c")
    assert len(ml._cache) == 1
    assert [e.data for e in result_of(c.read(10))] == [b"a", b"b", b"c"]
    assert rig.client.reads == 1


def test_without_cursors_the_cache_stays_within_its_budget() -> None:
    """A burst of appends to logs without cursors never takes the shared cache over budget."""
    budget = 10 * (100 + 24 + ENTRY_OVERHEAD)
    rig = Rig(cache_size_bytes=budget)
    a = rig.open("a/ns/persistent/x")
    b = rig.open("b/ns/persistent/y")
    manager = rig.factory.cache_manager
    for i in range(200):
        result_of(a.append(bytes([i % 256]) * 100))
        result_of(b.append(bytes([i % 256]) * 100))
        assert manager.size == a._cache.size + b._cache.size <= budget
    assert manager.evictions > 0
    last = result_of(b.append(b"z" * 100))
    assert result_of(b.read(last.position, 1)) == [last]


def test_a_cursor_still_evicts_behind_itself_once_opened() -> None:
    """Entries cached with no cursor leave the cache once a cursor opened later reads them."""
    rig = Rig()
    ml = rig.open()
    rig.append(ml, b"a", b"b", b"c")
    c = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    assert [e.data for e in result_of(c.read(10))] == [b"a", b"b", b"c"]
    assert len(ml._cache) == 0
    assert rig.client.reads == 0


def test_cache_stays_within_its_budget_and_misses_go_to_the_ledger() -> None:
    """The shared budget is never exceeded; evicted entries are read back from the ledger."""
    budget = 10 * (100 + 24 + ENTRY_OVERHEAD)
    rig = Rig(cache_size_bytes=budget)
    ml = rig.open()
    c = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    entries = [result_of(ml.append(bytes([i]) * 100)) for i in range(40)]
    assert 0 < rig.factory.cache_manager.size <= budget
    got = result_of(c.read(40))
    assert got == entries
    assert rig.client.reads > 0


def test_reads_are_counted_as_hits_and_misses_for_metrics() -> None:
    """Every entry read counts once: a hit when the cache held it, a miss when the ledger had
    to be asked; the factory's figures are the manager's."""
    budget = 10 * (100 + 24 + ENTRY_OVERHEAD)
    rig = Rig(cache_size_bytes=budget)
    ml = rig.open()
    c = result_of(ml.open_cursor("sub", InitialPosition.EARLIEST))
    for i in range(40):
        result_of(ml.append(bytes([i]) * 100))
    cached = len(ml._cache)
    assert 0 < cached < 40
    assert len(result_of(c.read(40))) == 40
    stats = rig.factory.cache_stats()
    assert (stats["hits"], stats["misses"]) == (cached, 40 - cached)
    assert stats["logs"] == 1
    assert stats["evictions"] > 0
    assert stats["used_bytes"] == rig.factory.cache_manager.size
    assert stats["max_bytes"] == budget


def test_budget_is_shared_between_logs() -> None:
    """Two logs' caches together stay within one budget; the bigger one gives back first."""
    rig = Rig(cache_size_bytes=20_000)
    a = rig.open("a/ns/persistent/x")
    b = rig.open("b/ns/persistent/y")
    result_of(a.open_cursor("s"))
    result_of(b.open_cursor("s"))
    for _ in range(30):
        result_of(a.append(b"a" * 500))
    for _ in range(10):
        result_of(b.append(b"b" * 500))
    manager = rig.factory.cache_manager
    assert manager.size <= 20_000
    assert manager.evictions > 0
    assert b._cache.size > 0


def test_entries_behind_the_slowest_cursor_are_evicted() -> None:
    """Once every cursor read past an entry it leaves the cache; entries the slowest cursor
    has yet to read stay."""
    rig = Rig()
    ml = rig.open()
    fast = result_of(ml.open_cursor("fast"))
    slow = result_of(ml.open_cursor("slow"))
    rig.append(ml, *[b"%d" % i for i in range(10)])
    result_of(fast.read(10))
    assert len(ml._cache) == 10
    result_of(slow.read(4))
    assert len(ml._cache) == 6
    result_of(slow.read(10))
    assert len(ml._cache) == 0
    assert rig.client.reads == 0


def test_a_cursor_moved_only_by_acknowledgements_evicts_behind_itself() -> None:
    """A cursor that never reads (a Kafka group's, moved by its commits) releases the cached
    entries its mark-delete passed: without it they stayed until the whole budget filled."""
    rig = Rig()
    ml = rig.open()
    group = result_of(ml.open_cursor("group", InitialPosition.EARLIEST))
    e = rig.append(ml, *[b"%d" % i for i in range(6)])
    assert len(ml._cache) == 6
    group.mark_delete(e[2].position)  # durable later: the state is written at most once a second
    assert len(ml._cache) == 3
    group.delete([e[3].position])
    assert len(ml._cache) == 2
    group.seek(e[5].position)
    assert len(ml._cache) == 1
    assert result_of(ml.read(e[5].position, 1)) == [e[5]]
    assert rig.client.reads == 0


def test_a_failed_read_leaves_the_cursor_where_it_was() -> None:
    """A read that misses the cache and fails is reported and can be retried."""
    rig = Rig(cache_size_bytes=0)
    ml = rig.open()
    c = result_of(ml.open_cursor("sub"))
    entry = result_of(ml.append(b"x"))
    rig.client.fail_reads = 1
    assert isinstance(failure_of(c.read(5)), BookieError)
    assert c.read_position == entry.position
    assert result_of(c.read(5)) == [entry]


def test_misses_are_read_in_batches() -> None:
    """A cold read of many entries of one ledger asks the ledger a few times, not per entry."""
    rig = Rig(cache_size_bytes=0)
    ml = rig.open()
    c = result_of(ml.open_cursor("sub"))
    rig.append(ml, *[b"%d" % i for i in range(250)])
    got = result_of(c.read(250))
    assert len(got) == 250
    assert rig.client.reads == 3


def test_manager_accounts_every_put_and_eviction() -> None:
    """The manager's size is the sum of its caches' sizes through puts, evictions, clears."""
    manager = EntryCacheManager(10_000)
    one, two = manager.new_cache("one"), manager.new_cache("two")
    for i in range(30):
        one.put(i, Entry(Position(1, i), i, 1, 0, b"x" * 300))
        two.put(i, Entry(Position(1, i), i, 1, 0, b"y" * 100))
        assert manager.size == one.size + two.size <= 10_000
    one.evict_before(25)
    assert one.first_seq() is not None
    assert one.first_seq() >= 25  # type: ignore[operator]
    assert manager.size == one.size + two.size
    two.close()
    assert manager.size == one.size
    assert two.get(29) is None


def test_cached_entries_are_nothing_the_garbage_collector_walks() -> None:
    """Caching entries adds no tracked object per entry to the collector's youngest
    generation (Rule 5): a collection there never walks the cache. ``get`` gives back an
    ``Entry`` equal to the one put."""
    cache = EntryCacheManager(1 << 30).new_cache("t")
    entries = [Entry(Position(1, i), 2 * i, 1, 1000 + i, b"x%d" % i) for i in range(5000)]
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects(0))
        for i, e in enumerate(entries):
            cache.put(i, e)
        grown = len(gc.get_objects(0)) - before
    finally:
        gc.enable()
    assert grown < 50
    got = [cache.get(i) for i in range(5000)]
    assert got == entries
    assert all(type(e) is Entry and type(e.position) is Position for e in got)


def test_a_log_caches_its_appends_as_appended() -> None:
    """What a log caches as its adds complete reads back equal to what the appends returned."""
    rig = Rig()
    ml = rig.open()
    appended = rig.append(ml, b"a", b"b", b"c")
    seq = ml._cache.first_seq()
    assert seq is not None
    assert [ml._cache.get(seq + i) for i in range(3)] == appended
    assert ml._cache.get(seq + 3) is None


def test_entry_cache_agrees_with_a_plain_model() -> None:
    """Puts (with an occasional gap), evictions by number and by bytes, and clears, checked
    against a dict after every step: same entries, same bytes, the manager's total in step,
    across many compactions of the slot list."""
    rng = random.Random(7)
    manager = EntryCacheManager(1 << 40)
    cache = manager.new_cache("t")
    model: dict[int, Entry] = {}
    seq = 0

    def cost(e: Entry) -> int:
        return len(e.data) + ENTRY_OVERHEAD

    for _ in range(30_000):
        op = rng.random()
        if op < 0.7:
            if rng.random() < 0.002:
                seq += rng.randint(1, 5)  # a gap: the cache starts afresh
                model.clear()
            e = Entry(Position(3, seq), seq * 2, 2, 1000 + seq, bytes(rng.randint(0, 40)))
            cache.put(seq, e)
            model[seq] = e
            seq += 1
        elif op < 0.9:
            cut = seq - rng.randint(0, 3000)
            cache.evict_before(cut)
            for k in [k for k in model if k < cut]:
                del model[k]
        elif op < 0.999:
            wanted = rng.randint(0, 3000)
            cache.evict_bytes(wanted)
            freed = 0
            for k in sorted(model):
                if freed >= wanted:
                    break
                freed += cost(model.pop(k))
        else:
            cache.clear()
            model.clear()
        assert len(cache) == len(model)
        assert cache.size == manager.size == sum(cost(e) for e in model.values())
        assert cache.first_seq() == (min(model) if model else None)
        if model:
            for k in (min(model), max(model), rng.choice(list(model))):
                assert cache.get(k) == model[k]
            assert cache.get(min(model) - 1) is None
            assert cache.get(max(model) + 1) is None
    assert len(cache._data) < 20_000  # evicted entries were compacted away
    assert len(cache._ints) == FIELDS * len(cache._data)


def _put_run(cache: EntryCache, seq: int, rows: list[tuple[int, int, int, int, bytes]]) -> None:
    """``put_run`` of rows (entry id, index, num messages, publish time, data) of ledger 4,
    the columns built as a log builds them."""
    before = cache.put_bytes
    ints: list[int] = []
    data: list[bytes] = []
    for row in rows:
        ints.extend((4, *row[:4], before))
        data.append(row[4])
        before += len(row[4]) + ENTRY_OVERHEAD
    cache.put_run(seq, ints, data, before)


def test_a_run_put_at_once_is_cached_as_its_entries_put_one_by_one() -> None:
    """``put_run`` leaves a cache as ``put`` of each entry would (the same entries and bytes;
    a gap before a run starts afresh), and under a budget keeps the newest entries, intact,
    within it."""
    rng = random.Random(11)
    singles = EntryCacheManager(1 << 40).new_cache("singles")
    slotted = EntryCacheManager(1 << 40).new_cache("slotted")
    budget = 40 * (20 + ENTRY_OVERHEAD)
    bounded_manager = EntryCacheManager(budget)
    bounded = bounded_manager.new_cache("bounded")
    seq = 0
    for _ in range(300):
        if rng.random() < 0.05:
            seq += rng.randint(1, 3)  # a gap: every cache starts afresh
        entries = [
            Entry(
                Position(4, seq + i), 10 * (seq + i), 1 + i % 3, 500 + i, bytes(rng.randint(0, 20))
            )
            for i in range(rng.randint(0, 12))
        ]
        rows = [
            (e.position.entry_id, e.index, e.num_messages, e.publish_time_ms, e.data)
            for e in entries
        ]
        for i, e in enumerate(entries):
            singles.put(seq + i, e)
        _put_run(slotted, seq, rows)
        _put_run(bounded, seq, rows)
        seq += len(entries)
        assert (slotted._ints, slotted._data) == (singles._ints, singles._data)
        assert [slotted.get(s) for s in range(seq - len(entries), seq)] == entries
        assert (slotted.size, slotted.first_seq(), len(slotted)) == (
            singles.size,
            singles.first_seq(),
            len(singles),
        )
        assert bounded_manager.size == bounded.size <= budget
        first = bounded.first_seq()
        if first is not None:
            assert [bounded.get(s) for s in range(first, seq)] == [
                singles.get(s) for s in range(first, seq)
            ]
