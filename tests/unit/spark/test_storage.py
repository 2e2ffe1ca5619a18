"""Rows of stored entries read from storage, without bookies: ids, batches, formats, stops."""

from __future__ import annotations

from collections.abc import Iterator

import pulsar
import pytest

from polybroker.broker_core.messages import Message, encode_entry, encode_native_entry
from polybroker.ledger import entry_format
from polybroker.ledger.direct import DirectReadError, LedgerLayout
from polybroker.spark.offsets import EARLIEST, ReadRange
from polybroker.spark.storage import Stop, entry_rows, message_id_bytes, read_rows

END = (1 << 62, 0, -1)


def _stored(entry: bytes, index: int = 0, n: int = 1) -> bytes:
    return entry_format.encode(entry, index, 1234, n)


def test_message_ids_are_the_clients_serialized_ids() -> None:
    """Byte for byte what the client serializes (lone messages), and parseable by it (batches)."""
    for partition in (-1, 0, 3):
        for ledger, entry in ((0, 0), (300, 7), (1 << 40, 1 << 33)):
            assert (
                message_id_bytes(ledger, entry, partition, -1, 1)
                == pulsar.MessageId(partition, ledger, entry, -1).serialize()
            )
    mid = pulsar.MessageId.deserialize(message_id_bytes(9, 4, 2, 5, 10))
    assert (mid.ledger_id(), mid.entry_id(), mid.partition(), mid.batch_index()) == (9, 4, 2, 5)
    # As the client writes a received batch message's id: with the batch size (field 6).
    assert message_id_bytes(0, 1, -1, 1, 2) == bytes.fromhex("0800100120013002")


@pytest.mark.parametrize("compression", ["none", "lz4", "zlib", "zstd"])
def test_batched_entry_rows_in_range_with_times_keys_and_sorted_properties(
    compression: str,
) -> None:
    msgs = [
        Message(b"a", key=b"k", properties=[("z", "1"), ("a", "2")], event_time_ms=5),
        Message(b"b"),
        Message(b"c", key=b"q"),
    ]
    entry = encode_entry(
        msgs, producer_name="p", sequence_id=0, publish_time_ms=777, compression=compression
    )
    rows = entry_rows(4, 2, 1, _stored(entry, n=3), EARLIEST, END)
    assert [r[:2] for r in rows] == [(b"k", b"a"), (None, b"b"), (b"q", b"c")]
    assert [r[3] for r in rows] == [777_000] * 3
    assert [r[4] for r in rows] == [5000, None, None]
    assert rows[0][5] == [("a", "2"), ("z", "1")]
    mid = pulsar.MessageId.deserialize(rows[2][2])
    assert (mid.ledger_id(), mid.entry_id(), mid.partition(), mid.batch_index()) == (4, 2, 1, 2)
    # A boundary inside the batch: [(4, 2, 1), (4, 2, 2)).
    cut = entry_rows(4, 2, 1, _stored(entry, n=3), (4, 2, 1), (4, 2, 2))
    assert [r[1] for r in cut] == [b"b"]


def test_lone_message_and_foreign_format_entries() -> None:
    lone = encode_entry(
        [Message(b"only", key=b"k")], producer_name="p", sequence_id=0, publish_time_ms=1
    )
    [row] = entry_rows(1, 0, -1, _stored(lone), EARLIEST, END)
    assert pulsar.MessageId.deserialize(row[2]).batch_index() == -1
    assert row[2] == pulsar.MessageId(-1, 1, 0, -1).serialize()
    # A Kafka-format entry: its decoder is registered by the Kafka handler module, loaded on
    # demand; the broker hands one record as a lone message, several as a batch.
    from polybroker.protocols.kafka import records

    def native(n: int) -> bytes:
        recs = [records.Record(i, 10 + i, b"k", b"v%d" % i) for i in range(n)]
        return records.build_batch(0, recs)

    for n in (1, 3):
        entry = encode_native_entry(
            "kafka", native(n), num_messages=n, producer_name="k", sequence_id=0, publish_time_ms=9
        )
        rows = entry_rows(2, 5, 0, _stored(entry, n=n), EARLIEST, END)
        assert [r[1] for r in rows] == [b"v%d" % i for i in range(n)]
        assert [pulsar.MessageId.deserialize(r[2]).batch_index() for r in rows] == (
            [-1] if n == 1 else list(range(n))
        )


class _Reader:
    """Serves entries of one ledger, failing at ``fail_at``."""

    def __init__(self, entries: dict[int, bytes], fail_at: int | None = None) -> None:
        self.entries = entries
        self.fail_at = fail_at

    def read(self, layout: LedgerLayout, first: int, last: int) -> Iterator[tuple[int, bytes]]:
        for e in range(first, last + 1):
            if e == self.fail_at:
                raise DirectReadError("bookie gone")
            yield e, self.entries[e]


def test_read_rows_stops_where_storage_fails_so_the_broker_reads_on() -> None:
    def lone(i: int) -> bytes:
        return _stored(
            encode_entry([Message(b"%d" % i)], producer_name="p", sequence_id=i, publish_time_ms=1)
        )

    entries = {e: lone(e) for e in range(6)}
    layout = LedgerLayout(3, 1, 1, ((0, ("b:1",)),))
    rng = ReadRange("t", (3, 1, -1), (3, 6, -1), (3, 5), 5)
    stops: list[Stop] = []
    got = list(read_rows(rng, [layout], [(3, 6)], _Reader(entries), stops))  # type: ignore[arg-type]
    assert [c.rows()[0][1] for c in got] == [b"1", b"2", b"3", b"4", b"5"]
    assert stops == []
    got = list(read_rows(rng, [layout], [(3, 6)], _Reader(entries, 4), stops))  # type: ignore[arg-type]
    assert [c.rows()[0][1] for c in got] == [b"1", b"2", b"3"]
    assert stops[0].resume == (3, 4, -1)
    # A corrupt entry stops there too.
    entries[2] = b"junk"
    stops.clear()
    got = list(read_rows(rng, [layout], [(3, 6)], _Reader(entries), stops))  # type: ignore[arg-type]
    assert [c.rows()[0][1] for c in got] == [b"1"]
    assert stops[0].resume == (3, 2, -1)


@pytest.mark.parametrize("odd", [None, "key", "size", "seq"])
def test_uniform_batches_are_taken_whole_and_any_odd_message_is_decoded_one_by_one(
    odd: str | None,
) -> None:
    """Equal-shaped messages (sequence ids of one width) take the fast path; a message of
    another key of the same length, another payload size or another sequence id width does
    not, and the rows are the same as ``decode_entry`` gives either way."""
    from polybroker.broker_core.messages import decode_entry
    from polybroker.spark.storage import Columns, entry_columns

    msgs = [Message(b"%03d" % i, key=b"a") for i in range(300)]
    seq = 1000  # 1000..1299: two-byte varints
    if odd == "key":
        msgs[150] = Message(b"150", key=b"b")
    elif odd == "size":
        msgs[150] = Message(b"1500", key=b"a")
    elif odd == "seq":
        seq = 16384 - 100  # crosses into three-byte varints
    entry = encode_entry(msgs, producer_name="p", sequence_id=seq, publish_time_ms=3)
    out = Columns()
    entry_columns(7, 1, _stored(entry, n=300), EARLIEST, END, out)
    # The fast path: one run of rows and one payload matrix; else a list of payloads.
    assert (not isinstance(out.chunks[0], list)) == (odd is None)
    assert len(out.runs) == (1 if odd is None else 3 if odd == "key" else len(out.runs))
    expected = decode_entry(entry)
    assert [(r[0], r[1]) for r in out.rows()] == [(m.key, m.payload) for m in expected]
    ids = [pulsar.MessageId.deserialize(r[2]) for r in out.rows()]
    assert [m.batch_index() for m in ids] == list(range(300))


def test_message_ids_built_in_bulk_are_the_one_by_one_ids() -> None:
    """Runs of ids (lone messages, whole and cut batches, large ids) give the same bytes as
    ``message_id_bytes`` one by one, for a partition and for a topic that is not one."""
    from polybroker.spark.storage import message_ids

    runs = [
        (0, 0, -1, 1, 1),
        (5, 7, 0, 3, 3),
        (300, 1 << 33, 126, 4, 200),
        (1 << 40, 2, 16380, 6, 20000),
        (9, 128, -1, 1, 1),
    ]
    for partition in (-1, 0, 3, 200):
        expected = [
            message_id_bytes(ledger, entry, partition, -1 if b < 0 else b + i, size)
            for ledger, entry, b, count, size in runs
            for i in range(count)
        ]
        assert message_ids(runs, partition).to_pylist() == expected
    assert message_ids([], 0).to_pylist() == []


def test_message_ids_of_long_runs_from_kept_templates_are_the_one_by_one_ids() -> None:
    """Runs of many rows (built from a kept layout per batch shape) between short ones, the
    same batch shape again under other ids and prefix lengths, give ``message_id_bytes``."""
    from polybroker.spark.storage import message_ids

    runs = [
        (5, 7, 0, 1000, 1000),
        (5, 8, -1, 1, 1),
        (5, 9, 0, 1000, 1000),
        (300, 1 << 33, 100, 200, 300),
        (1 << 40, 127, 0, 1000, 1000),
        (1 << 40, 128, 16350, 40, 20000),
        (9, 0, 0, 3, 3),
        (9, 1, 0, 1000, 1000),
    ]
    for partition in (-1, 0, 200):
        expected = [
            message_id_bytes(ledger, entry, partition, -1 if b < 0 else b + i, size)
            for ledger, entry, b, count, size in runs
            for i in range(count)
        ]
        for _ in range(2):  # the second time from the kept layouts
            assert message_ids(runs, partition).to_pylist() == expected


def test_columns_become_arrow_arrays_row_for_row() -> None:
    """Runs of keys, times and properties, and value lists and matrices, come out per row."""
    import numpy as np
    import pyarrow as pa

    from polybroker.spark.storage import Columns

    ts = pa.timestamp("us", tz="UTC")
    props_type = pa.map_(pa.string(), pa.string())
    c = Columns()
    c.n = 5
    c.runs += [2, 1, 2]
    c.keys += [None, b"k", None]
    c.pubs += [10, 20, 30]
    c.events += [None, 7, None]
    c.props += [[], [("a", "1")], []]
    c.id_runs += [(1, 2, 0, 2, 2), (1, 3, -1, 1, 1), (1, 4, 0, 2, 2)]
    c.chunks += [[b"x", b"yy"], np.frombuffer(b"abcdef", np.uint8).reshape(3, 2)]
    key, value, mid, pub, event, props = c.arrays(1, ts, props_type)
    assert key.to_pylist() == [None, None, b"k", None, None]
    assert value.to_pylist() == [b"x", b"yy", b"ab", b"cd", b"ef"]
    assert mid.to_pylist() == [
        message_id_bytes(1, 2, 1, 0, 2),
        message_id_bytes(1, 2, 1, 1, 2),
        message_id_bytes(1, 3, 1, -1, 1),
        message_id_bytes(1, 4, 1, 0, 2),
        message_id_bytes(1, 4, 1, 1, 2),
    ]
    assert pub.cast(pa.int64()).to_pylist() == [10, 10, 20, 30, 30]
    assert event.cast(pa.int64()).to_pylist() == [None, None, 7, None, None]
    assert props.to_pylist() == [[], [], [("a", "1")], [], []]
    assert [r[:2] for r in c.rows(1)] == list(zip(key.to_pylist(), value.to_pylist(), strict=True))
