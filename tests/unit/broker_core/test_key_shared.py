"""Key_Shared: Murmur3 slots, AUTO_SPLIT and STICKY ranges, per-key order, joining consumers."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import RecordingConsumer, make_topic, message, payload_of, result_of

from polybroker.broker_core.consumer import (
    Delivery,
    KeySharedMeta,
    KeySharedMode,
    ServerConsumer,
    SubType,
)
from polybroker.broker_core.errors import ConsumerAssignError, ConsumerBusyError
from polybroker.broker_core.murmur import key_hash, murmur3_32
from polybroker.ledger.api import Position

STICKY = KeySharedMode.STICKY


def keys_in(low: int, high: int, count: int) -> list[str]:
    """``count`` keys whose slot lies in low..high."""
    found = []
    i = 0
    while len(found) < count:
        key = f"key-{i}"
        if low <= key_hash(key.encode()) <= high:
            found.append(key)
        i += 1
    return found


def delivered(consumer: RecordingConsumer) -> list[str]:
    return [payload_of(d.entry) for d in consumer.deliveries]


def test_murmur3_matches_the_reference_vectors() -> None:
    """murmur3_32 (seed 0) gives the published x86_32 values, so keys land as in Pulsar."""
    assert murmur3_32(b"") == 0
    assert murmur3_32(b"hello") == 0x248BFA47
    assert murmur3_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723
    assert key_hash(b"hello") == (0x248BFA47 & 0x7FFFFFFF) % 65536


def test_auto_split_halves_the_biggest_range_and_merges_on_leave() -> None:
    """Each joining consumer takes the lower half of the biggest range; a leaver's range goes
    to its upper neighbour."""
    bench = make_topic()
    first = bench.subscribe("s", RecordingConsumer("a"), SubType.KEY_SHARED)
    assert first.hash_ranges == [(0, 65535)]
    second = bench.subscribe("s", RecordingConsumer("b"), SubType.KEY_SHARED)
    assert second.hash_ranges == [(0, 32767)]
    assert first.hash_ranges == [(32768, 65535)]
    third = bench.subscribe("s", RecordingConsumer("c"), SubType.KEY_SHARED)
    assert third.hash_ranges == [(0, 16383)]
    assert second.hash_ranges == [(16384, 32767)]
    result_of(second.close())
    assert first.hash_ranges == [(16384, 65535)]
    result_of(first.close())
    assert third.hash_ranges == [(0, 65535)]
    ranges = bench.topic.stats()["subscriptions"]["s"]["consumers"][0]["keyHashRanges"]
    assert ranges == ["[0, 65535]"]


def test_each_key_goes_to_the_owner_of_its_slot_in_order() -> None:
    """Every entry reaches the consumer whose range holds its key's slot, in publish order."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED)
    sb = bench.subscribe("s", b, SubType.KEY_SHARED)
    sa.flow(1000)
    sb.flow(1000)
    keys = [f"k{i}" for i in range(20)]
    for n in range(3):
        for key in keys:
            bench.publish(f"{key}/{n}", key=key)
    assert a.deliveries
    assert b.deliveries
    for consumer, server in ((a, sa), (b, sb)):
        (low, high) = server.hash_ranges[0]
        seen: dict[str, int] = {}
        for payload in delivered(consumer):
            key, n = payload.split("/")
            assert low <= key_hash(key.encode()) <= high
            assert int(n) == seen.get(key, -1) + 1
            seen[key] = int(n)


def test_keyless_entries_all_go_to_one_consumer() -> None:
    """Entries without a key share the fixed NONE_KEY slot."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    bench.subscribe("s", a, SubType.KEY_SHARED).flow(100)
    bench.subscribe("s", b, SubType.KEY_SHARED).flow(100)
    bench.publish(*[f"m{i}" for i in range(6)])
    assert sorted([len(a.deliveries), len(b.deliveries)]) == [0, 6]


def test_a_key_waits_for_its_consumer_without_blocking_other_keys() -> None:
    """A consumer out of permits holds back its keys only; they come in order later."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED)
    sb = bench.subscribe("s", b, SubType.KEY_SHARED)
    (a_key,) = keys_in(*sa.hash_ranges[0], 1)
    (b_key,) = keys_in(*sb.hash_ranges[0], 1)
    sb.flow(100)
    for n in range(3):
        bench.publish(f"a{n}", key=a_key)
        bench.publish(f"b{n}", key=b_key)
    assert delivered(b) == ["b0", "b1", "b2"]
    assert a.deliveries == []
    sa.flow(100)
    assert delivered(a) == ["a0", "a1", "a2"]


def test_joining_consumer_gets_moved_keys_only_after_earlier_messages_are_acked() -> None:
    """Keys moving to a new consumer are held back until what was sent before it joined is
    acknowledged (Pulsar's recently-joined rule), so each key stays in order."""
    bench = make_topic()
    a = RecordingConsumer("a")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED)
    sa.flow(100)
    moved, stays = keys_in(0, 32767, 1)[0], keys_in(32768, 65535, 1)[0]
    bench.publish("moved-0", key=moved)
    bench.publish("stays-0", key=stays)
    b = RecordingConsumer("b")
    sb = bench.subscribe("s", b, SubType.KEY_SHARED)
    assert sb.hash_ranges == [(0, 32767)]
    sb.flow(100)
    assert sb.stats()["readPositionWhenJoining"] == "1:1"
    bench.publish("moved-1", key=moved)
    bench.publish("stays-1", key=stays)
    assert b.deliveries == []
    assert delivered(a) == ["moved-0", "stays-0", "stays-1"]
    sa.ack(a.positions[:1])
    assert b.deliveries == []  # stays-0 is still unacknowledged
    sa.ack(a.positions[1:2])
    assert delivered(b) == ["moved-1"]
    bench.publish("moved-2", key=moved)
    assert delivered(b) == ["moved-1", "moved-2"]


def test_joining_consumer_may_take_older_entries_redelivered_to_it() -> None:
    """Entries before the join marker (e.g. of a consumer that left) are not held back."""
    bench = make_topic()
    a = RecordingConsumer("a")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED)
    sa.flow(100)
    moved = keys_in(0, 32767, 2)
    bench.publish("m0", key=moved[0])
    bench.publish("m1", key=moved[1])
    b = RecordingConsumer("b")
    sb = bench.subscribe("s", b, SubType.KEY_SHARED)
    sb.flow(100)
    result_of(sa.close())
    assert delivered(b) == ["m0", "m1"]
    assert [d.redelivery_count for d in b.deliveries] == [1, 1]


def test_allow_out_of_order_delivery_skips_the_joining_rule() -> None:
    """With allow_out_of_order, a new consumer gets its keys at once."""
    bench = make_topic()
    meta = KeySharedMeta(allow_out_of_order=True)
    a = RecordingConsumer("a")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED, key_shared=meta)
    sa.flow(100)
    moved = keys_in(0, 32767, 1)[0]
    bench.publish("moved-0", key=moved)
    b = RecordingConsumer("b")
    bench.subscribe("s", b, SubType.KEY_SHARED, key_shared=meta).flow(100)
    bench.publish("moved-1", key=moved)
    assert delivered(b) == ["moved-1"]


def test_sticky_consumers_own_the_ranges_they_give() -> None:
    """STICKY consumers receive only their ranges; uncovered slots wait for an owner."""
    bench = make_topic()
    low = RecordingConsumer("low")
    bench.subscribe(
        "s", low, SubType.KEY_SHARED, key_shared=KeySharedMeta(STICKY, ((0, 32767),))
    ).flow(100)
    low_key, high_key = keys_in(0, 32767, 1)[0], keys_in(32768, 65535, 1)[0]
    bench.publish("low", key=low_key)
    bench.publish("high", key=high_key)
    assert delivered(low) == ["low"]
    high = RecordingConsumer("high")
    server = bench.subscribe(
        "s", high, SubType.KEY_SHARED, key_shared=KeySharedMeta(STICKY, ((32768, 65535),))
    )
    server.flow(100)
    assert delivered(high) == ["high"]


def test_sticky_ranges_may_not_overlap_or_leave_the_slot_space() -> None:
    """Overlapping, reversed or out-of-range STICKY ranges fail with ConsumerAssignError."""
    bench = make_topic()
    bench.subscribe(
        "s", RecordingConsumer(), SubType.KEY_SHARED, key_shared=KeySharedMeta(STICKY, ((0, 100),))
    )
    for ranges in (((50, 200),), ((300, 200),), ((65000, 65536),), ()):
        with pytest.raises(ConsumerAssignError):
            bench.subscribe(
                "s",
                RecordingConsumer(),
                SubType.KEY_SHARED,
                key_shared=KeySharedMeta(STICKY, ranges),
            )
    assert len(bench.topic.subscriptions["s"].consumers) == 1


def test_key_shared_modes_may_not_be_mixed() -> None:
    """A STICKY consumer cannot join an AUTO_SPLIT subscription."""
    bench = make_topic()
    bench.subscribe("s", RecordingConsumer(), SubType.KEY_SHARED)
    with pytest.raises(ConsumerBusyError):
        bench.subscribe(
            "s",
            RecordingConsumer(),
            SubType.KEY_SHARED,
            key_shared=KeySharedMeta(STICKY, ((0, 9),)),
        )


def test_key_can_come_from_a_subscribe_time_callback() -> None:
    """A key_of callback given at subscribe overrides the topic's inspector."""
    bench = make_topic()
    a, b = RecordingConsumer("a"), RecordingConsumer("b")
    by_payload = lambda e: payload_of(e).encode()  # noqa: E731
    sa = bench.subscribe("s", a, SubType.KEY_SHARED, key_of=by_payload)
    sb = bench.subscribe("s", b, SubType.KEY_SHARED, key_of=by_payload)
    sa.flow(100)
    sb.flow(100)
    payloads = keys_in(*sb.hash_ranges[0], 3)
    for p in payloads:
        result_of(bench.topic.publish(message(p, key="ignored")))
    assert delivered(b) == payloads


def test_entry_read_before_a_join_waits_for_its_key_at_the_previous_owner() -> None:
    """An entry read but not yet sent when a consumer joined does not overtake an older
    entry of its key that the previous owner still holds."""
    bench = make_topic()
    a, b, c = RecordingConsumer("a"), RecordingConsumer("b"), RecordingConsumer("c")
    sa = bench.subscribe("s", a, SubType.KEY_SHARED)
    sb = bench.subscribe("s", b, SubType.KEY_SHARED)
    (key,) = keys_in(0, 16383, 1)  # b's now, c's once c joins
    sa.flow(100)  # keeps the dispatcher reading ahead
    sb.flow(1)
    bench.publish("k/0", key=key)
    bench.publish("k/1", key=key)  # read, but b has no permit left
    assert delivered(b) == ["k/0"]
    sc = bench.subscribe("s", c, SubType.KEY_SHARED)
    assert sc.hash_ranges == [(0, 16383)]
    sc.flow(100)
    assert c.deliveries == []
    sb.ack(b.positions)
    assert delivered(c) == ["k/1"]


@pytest.mark.parametrize("seed", range(12))
def test_per_key_order_holds_under_random_joins_leaves_and_acks(seed: int) -> None:
    """Seeded random runs: no entry reaches a consumer while an older entry of its key is
    unacknowledged elsewhere, and every entry is eventually acknowledged."""
    rnd = random.Random(seed)
    bench = make_topic()
    counters = dict.fromkeys(("k0", "k1", "k2", "k3"), 0)
    positions: dict[tuple[str, int], object] = {}
    acked: set[object] = set()
    live: list[tuple[RecordingConsumer, ServerConsumer]] = []
    broken: list[str] = []

    def join() -> None:
        consumer = RecordingConsumer(f"c{rnd.randrange(10**6)}")
        holder: list[ServerConsumer] = []

        def check(deliveries: list[Delivery]) -> None:
            for d in deliveries:
                key, n = payload_of(d.entry).split("/")
                for m in range(int(n)):
                    earlier = positions[(key, m)]
                    if earlier not in acked and earlier not in holder[0].pending:
                        broken.append(f"{key}/{n} overtook {key}/{m}")
            RecordingConsumer.send_entries(consumer, deliveries)

        consumer.send_entries = check  # type: ignore[method-assign]
        holder.append(bench.subscribe("s", consumer, SubType.KEY_SHARED))
        live.append((consumer, holder[0]))

    def ack(server: ServerConsumer, chosen: list[Position]) -> None:
        acked.update(chosen)
        server.ack(chosen)

    join()
    for _ in range(150):
        op = rnd.random()
        if op < 0.4:
            key = rnd.choice(list(counters))
            (entry,) = bench.publish(f"{key}/{counters[key]}", key=key)
            positions[(key, counters[key])] = entry.position
            counters[key] += 1
        elif op < 0.6:
            rnd.choice(live)[1].flow(rnd.randint(1, 4))
        elif op < 0.82:
            server = rnd.choice(live)[1]
            if server.pending:
                pending = list(server.pending)
                ack(server, rnd.sample(pending, rnd.randint(1, len(pending))))
        elif op < 0.9:
            join()
        elif len(live) > 1:
            result_of(live.pop(rnd.randrange(len(live)))[1].close())
    for _ in range(20):
        for _, server in live:
            server.flow(100)
            ack(server, list(server.pending))
    assert broken == []
    assert set(positions.values()) <= acked
