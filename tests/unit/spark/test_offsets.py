"""Planning of Spark reads: boundaries, offset options, backlog splits and entry budgets."""

from __future__ import annotations

import pytest

from polybroker.spark import offsets as off

T = "persistent://public/default/t"


def test_boundary_text_round_trip_and_errors() -> None:
    """Boundaries print as ledger:entry:batch, a missing batch is -1, junk is an OffsetError."""
    assert off.parse_boundary("3:7:2") == (3, 7, 2)
    assert off.parse_boundary("3:7") == (3, 7, -1)
    assert off.format_boundary((3, 7, -1)) == "3:7:-1"
    for bad in ("", "1", "a:b", "1:2:3:4"):
        with pytest.raises(off.OffsetError):
            off.parse_boundary(bad)


def test_after_last_is_the_next_entry() -> None:
    """The end of the backlog is the start of the entry after the last one; none is EARLIEST."""
    assert off.after_last((4, 9)) == (4, 10, -1)
    assert off.after_last(None) == off.EARLIEST
    assert off.after_last((-1, -1)) == off.EARLIEST


def test_message_order_within_batches() -> None:
    """A batch message lies after its entry's start and before the next entry."""
    assert off.in_range((1, 2, 0), (1, 2, -1), (1, 3, -1))
    assert off.in_range((1, 2, -1), (1, 2, -1), (1, 3, -1))
    assert not off.in_range((1, 2, 3), (1, 2, 4), (1, 3, -1))
    assert off.in_range((2, 0, -1), (1, 2, -1), (2, 1, -1))
    assert off.in_range((0, 0, -1), off.EARLIEST, (0, 1, -1))


def test_offset_spec_kinds_and_json_forms() -> None:
    """earliest, latest, and JSON with text ids, admin objects, serialized bytes and keywords."""

    def latest(_topic: str) -> off.Boundary:
        return (9, 9, -1)

    assert off.parse_offset_spec(None, "earliest").resolve(T, latest, None) == off.EARLIEST
    assert off.parse_offset_spec("latest", "earliest").resolve(T, latest, None) == (9, 9, -1)
    spec = off.parse_offset_spec(
        '{"t": "1:2", "persistent://public/default/u": {"ledgerId": 3, "entryId": 4},'
        ' "v": -1, "w": [1, 2]}',
        "earliest",
    )
    assert spec.resolve(T, latest, None) == (1, 2, -1)
    assert spec.resolve("persistent://public/default/u", latest, None) == (3, 4, -1)
    assert spec.resolve("persistent://public/default/v", latest, None) == (9, 9, -1)
    assert spec.resolve("persistent://public/default/w", latest, lambda b: (len(b), 0, 0)) == (
        2,
        0,
        0,
    )
    assert spec.resolve("persistent://public/default/x", latest, None) == off.EARLIEST
    assert spec.resolve("persistent://public/default/x", latest, None, missing="latest") == (
        9,
        9,
        -1,
    )
    # A partition inherits the id given for its partitioned topic.
    assert spec.resolve(T + "-partition-1", latest, None) == (1, 2, -1)
    for bad in ("[1]", "{oops", '{"t": true}'):
        with pytest.raises(off.OffsetError):
            off.parse_offset_spec(bad, "earliest").resolve(T, latest, None)


def test_full_topic_names() -> None:
    """Short names get the default tenant and namespace; others are refused or kept."""
    assert off.full_topic("t") == T
    assert off.full_topic("a/b/t") == "persistent://a/b/t"
    assert off.full_topic("non-persistent://a/b/t") == "non-persistent://a/b/t"
    with pytest.raises(off.OffsetError):
        off.full_topic("a/t")


def test_split_covers_the_range_once_in_chunks() -> None:
    """Ranges tile [start, end) with at most max entries each, across ledgers."""
    ledgers = [(1, 5), (2, 0), (3, 4)]
    ranges = off.split_range(T, ledgers, off.EARLIEST, (3, 4, -1), 3)
    assert [(r.start, r.end, r.last_entry, r.entries) for r in ranges] == [
        (off.EARLIEST, (1, 3, -1), (1, 2), 3),
        ((1, 3, -1), (3, 1, -1), (3, 0), 3),
        ((3, 1, -1), (3, 4, -1), (3, 3), 3),
    ]


def test_split_keeps_a_start_inside_a_batch_and_an_early_end() -> None:
    """A start inside a batch entry keeps its batch index; the end cuts the last ledger."""
    ranges = off.split_range(T, [(1, 10)], (1, 2, 5), (1, 4, -1), 100)
    assert [(r.start, r.end, r.last_entry, r.entries) for r in ranges] == [
        ((1, 2, 5), (1, 4, -1), (1, 3), 2)
    ]
    # An end inside a batch includes that entry.
    assert off.split_range(T, [(1, 10)], (1, 2, -1), (1, 4, 3), 100)[0].last_entry == (1, 4)


def test_split_of_an_empty_range_is_empty() -> None:
    """No entries between the boundaries, or boundaries equal: no range at all."""
    assert off.split_range(T, [(1, 5)], (1, 5, -1), (1, 5, -1), 10) == []
    assert off.split_range(T, [], off.EARLIEST, (1, 5, -1), 10) == []
    with pytest.raises(ValueError, match="positive"):
        off.split_range(T, [(1, 5)], off.EARLIEST, (1, 5, -1), 0)


def test_advance_by_an_entry_budget() -> None:
    """advance moves max entries past start, across ledgers, never past end."""
    ledgers = [(1, 3), (2, 3)]
    assert off.advance(ledgers, off.EARLIEST, (2, 3, -1), 2) == (1, 2, -1)
    assert off.advance(ledgers, (1, 2, -1), (2, 3, -1), 2) == (2, 1, -1)
    assert off.advance(ledgers, (1, 2, -1), (2, 3, -1), 50) == (2, 3, -1)
    # A start inside a batch counts its entry and moves past it.
    assert off.advance(ledgers, (1, 1, 4), (2, 3, -1), 1) == (1, 2, -1)


def test_lost_ledgers_are_detected() -> None:
    """A start in a ledger older than every stored one has lost data; EARLIEST never has."""
    assert off.first_lost([(5, 3)], (4, 0, -1))
    assert not off.first_lost([(5, 3)], (5, 0, -1))
    assert not off.first_lost([(5, 3)], off.EARLIEST)


def test_checkpoint_offsets_round_trip() -> None:
    """A streaming offset survives its JSON form; a non-object is refused."""
    offsets = {T: (1, 2, -1), T + "-partition-0": off.EARLIEST}
    assert off.loads_offsets(off.dumps_offsets(offsets)) == offsets
    with pytest.raises(off.OffsetError):
        off.loads_offsets([1])  # type: ignore[arg-type]
