"""Positions in a topic partition, offset options and the split of a backlog into read ranges.

Pure Python, no Spark and no client: the planning the driver does, testable on its own.

A *boundary* ``(ledger, entry, batch)`` sits before the message with that id: a range
``[start, end)`` holds every message whose id ``(l, e, b)`` (``b`` is -1 for a message outside a
batch) satisfies ``start <= (l, e, b) < end``. Batch -1 is the start of the entry, so
``(l, e, -1)`` lies before every message of entry ``e``. ``EARLIEST`` lies before everything.
Offsets (streaming checkpoints, ``startingOffsets``/``endingOffsets`` JSON) hold boundaries, one per
topic partition, written ``"ledger:entry:batch"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

Boundary = tuple[int, int, int]

EARLIEST: Boundary = (-1, -1, -1)


class OffsetError(ValueError):
    """An offset option or checkpoint that cannot be understood."""


def format_boundary(b: Boundary) -> str:
    """``"ledger:entry:batch"``."""
    return f"{b[0]}:{b[1]}:{b[2]}"


def parse_boundary(text: str) -> Boundary:
    """Parse ``"ledger:entry[:batch]"``; raise OffsetError otherwise."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise OffsetError(f"not a message id 'ledger:entry[:batch]': {text!r}")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise OffsetError(f"not a message id 'ledger:entry[:batch]': {text!r}") from None
    if len(nums) == 2:
        nums.append(-1)
    return (nums[0], nums[1], nums[2])


def after_last(last: tuple[int, int] | None) -> Boundary:
    """The boundary just after the entry ``(ledger, entry)`` that holds the last message."""
    if last is None or last[0] < 0:
        return EARLIEST
    return (last[0], last[1] + 1, -1)


def message_boundary(value: Any, deserialize: Callable[[bytes], Boundary] | None) -> Boundary:
    """A boundary from one JSON offset value.

    Accepts ``"ledger:entry[:batch]"``, an admin ``{"ledgerId","entryId","batchIndex"}`` object,
    or (as the StreamNative connector writes them) a list of the bytes of a serialized message id,
    which ``deserialize`` decodes.
    """
    if isinstance(value, str):
        return parse_boundary(value)
    if isinstance(value, dict) and "ledgerId" in value and "entryId" in value:
        return (int(value["ledgerId"]), int(value["entryId"]), int(value.get("batchIndex", -1)))
    if isinstance(value, list) and all(isinstance(v, int) and 0 <= v < 256 for v in value):
        if deserialize is None:
            raise OffsetError("serialized message ids need the Pulsar client")
        return deserialize(bytes(value))
    raise OffsetError(f"not a message id: {value!r}")


@dataclass(frozen=True)
class OffsetSpec:
    """A parsed ``startingOffsets``/``endingOffsets`` option."""

    kind: str  # "earliest" | "latest" | "json"
    ids: dict[str, Any]

    def resolve(
        self,
        topic: str,
        latest: Callable[[str], Boundary],
        deserialize: Callable[[bytes], Boundary] | None,
        missing: str = "earliest",
    ) -> Boundary:
        """The boundary of one topic partition; one absent from the JSON gets ``missing``."""
        kind = self.kind
        value = self.ids.get(topic, self.ids.get(_base_topic(topic)))
        if kind == "json":
            if value is None:
                kind = missing
            elif value in ("earliest", -2):
                kind = "earliest"
            elif value in ("latest", -1):
                kind = "latest"
        if kind == "earliest":
            return EARLIEST
        if kind == "latest":
            return latest(topic)
        return message_boundary(value, deserialize)


def parse_offset_spec(text: str | None, default: str) -> OffsetSpec:
    """``earliest``, ``latest`` or a JSON object ``{topic partition: message id}``."""
    text = (text or default).strip()
    if text in ("earliest", "latest"):
        return OffsetSpec(text, {})
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as e:
        raise OffsetError(f"offsets must be earliest, latest or JSON: {e}") from None
    if not isinstance(ids, dict):
        raise OffsetError("offsets JSON must be an object of topic partition -> message id")
    return OffsetSpec("json", {_full_topic(k): v for k, v in ids.items()})


def _base_topic(topic: str) -> str:
    head, sep, tail = topic.rpartition("-partition-")
    return head if sep and tail.isdigit() else topic


def _full_topic(name: str) -> str:
    """``t`` -> ``persistent://public/default/t``; ``tn/ns/t`` -> ``persistent://tn/ns/t``."""
    if "://" in name:
        return name
    parts = name.split("/")
    if len(parts) == 1:
        return f"persistent://public/default/{name}"
    if len(parts) == 3:
        return f"persistent://{name}"
    raise OffsetError(f"invalid topic name {name!r}")


full_topic = _full_topic
base_topic = _base_topic


@dataclass(frozen=True)
class ReadRange:
    """Messages of one topic partition in ``[start, end)``; ``last_entry`` holds the last one."""

    topic: str
    start: Boundary
    end: Boundary
    last_entry: tuple[int, int]
    entries: int


def entries_between(
    ledgers: Sequence[tuple[int, int]], start: Boundary, end: Boundary
) -> list[tuple[int, int, int]]:
    """The stored entries in ``[start, end)`` as ``(ledger, first, stop)`` segments, in order.

    ``ledgers`` is the ``(ledgerId, entries)`` list of the topic's internal stats. An entry that a
    boundary cuts inside its batch belongs to both sides.
    """
    segments = []
    for ledger, count in ledgers:
        if count <= 0 or ledger < start[0] or ledger > end[0]:
            continue
        first = start[1] if ledger == start[0] else 0
        stop = count
        if ledger == end[0]:
            stop = min(count, end[1] + (1 if end[2] >= 0 else 0))
        first = max(first, 0)
        if first < stop:
            segments.append((ledger, first, stop))
    return segments


def split_range(
    topic: str,
    ledgers: Sequence[tuple[int, int]],
    start: Boundary,
    end: Boundary,
    max_entries: int,
) -> list[ReadRange]:
    """Split ``[start, end)`` into ranges of at most ``max_entries`` entries each."""
    if max_entries <= 0:
        raise ValueError("max_entries must be positive")
    segments = entries_between(ledgers, start, end)
    out: list[ReadRange] = []
    cur_start = start
    count = 0
    last: tuple[int, int] | None = None
    for ledger, first, stop in segments:
        e = first
        while e < stop:
            take = min(stop - e, max_entries - count)
            count += take
            e += take
            last = (ledger, e - 1)
            if count == max_entries:
                cut: Boundary = (ledger, e, -1)
                if cut >= end:
                    cut = end
                out.append(ReadRange(topic, cur_start, cut, last, count))
                cur_start, count = cut, 0
    if count and last is not None:
        out.append(ReadRange(topic, cur_start, end, last, count))
    return [r for r in out if r.start < r.end]


def advance(
    ledgers: Sequence[tuple[int, int]], start: Boundary, end: Boundary, max_entries: int
) -> Boundary:
    """The boundary ``max_entries`` entries after ``start``, at most ``end``."""
    budget = max_entries
    for ledger, first, stop in entries_between(ledgers, start, end):
        if stop - first >= budget:
            cut: Boundary = (ledger, first + budget, -1)
            return min(cut, end)
        budget -= stop - first
    return end


def sealed_end(ledgers: Sequence[tuple[int, int]], sealed: Collection[int]) -> Boundary:
    """The boundary before the first ledger not in ``sealed``: every stored entry before it
    lies in a sealed ledger (``EARLIEST`` when the first ledger is open or there is none)."""
    ids = sorted(ledger for ledger, _ in ledgers)
    if not ids:
        return EARLIEST
    for ledger in ids:
        if ledger not in sealed:
            return (ledger, 0, -1) if ledger != ids[0] else EARLIEST
    return (ids[-1] + 1, 0, -1)


def readable_end(
    ledgers: Sequence[tuple[int, int]],
    sealed: Collection[int],
    confirmed: tuple[int, int] | None,
) -> Boundary:
    """The boundary before which every stored entry can be read from storage: the sealed
    ledgers' (``sealed_end``), then those of the first open ledger up to ``confirmed``, its
    last add confirmed ``(ledger, entry)``, when known."""
    cut = sealed_end(ledgers, sealed)
    ids = sorted(ledger for ledger, _ in ledgers)
    if confirmed is None or not ids or confirmed[1] < 0:
        return cut
    first_open = ids[0] if cut == EARLIEST else cut[0]
    if confirmed[0] != first_open or first_open not in ids:
        return cut
    return (first_open, confirmed[1] + 1, -1)


def first_lost(ledgers: Sequence[tuple[int, int]], start: Boundary) -> bool:
    """Whether entries at ``start`` are gone: its ledger precedes every stored ledger."""
    if start == EARLIEST or not ledgers:
        return False
    return start[0] < min(ledger for ledger, _ in ledgers)


def in_range(msg: Boundary, start: Boundary, end: Boundary) -> bool:
    """Whether the message id ``msg`` lies in ``[start, end)``."""
    return start <= msg < end


def dumps_offsets(offsets: dict[str, Boundary]) -> dict[str, str]:
    """The JSON form of a streaming offset: ``{topic partition: "ledger:entry:batch"}``."""
    return {t: format_boundary(b) for t, b in sorted(offsets.items())}


def loads_offsets(offsets: dict[str, Any]) -> dict[str, Boundary]:
    """Parse a checkpointed streaming offset."""
    if not isinstance(offsets, dict):
        raise OffsetError(f"offset must be a JSON object: {offsets!r}")
    return {str(t): parse_boundary(str(v)) for t, v in offsets.items()}
