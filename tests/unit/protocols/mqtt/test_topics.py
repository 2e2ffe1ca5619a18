"""Unit tests of MQTT topic matching and the reversible mapping onto Pulsar names."""

from __future__ import annotations

import pytest

from polybroker.protocols.mqtt import topics as t


@pytest.mark.parametrize(
    "name", ["a/b", "/a", "a//b", "$SYS/x", "sensors/temp 1", "100%", "ü/ß", "a%2Fb"]
)
def test_mapping_is_reversible(name: str) -> None:
    """Every MQTT name maps to one Pulsar name of public/default and back."""
    full = t.to_pulsar(name)
    assert full.startswith("persistent://public/default/")
    assert "/" not in full[len("persistent://public/default/") :]
    assert t.from_pulsar(full) == name


def test_mapping_of_plain_names_and_other_namespaces() -> None:
    """A slash-free name maps to itself; topics of other namespaces have no MQTT name."""
    assert t.to_pulsar("orders") == "persistent://public/default/orders"
    assert t.to_pulsar("a/b") == "persistent://public/default/a%2Fb"
    assert t.from_pulsar("persistent://other/ns/x") is None


@pytest.mark.parametrize(
    ("topic_filter", "name", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/+", "/b", True),
        ("+", "/b", False),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("a/+/c", "a/b/c", True),
        ("a/b", "a/b/c", False),
    ],
)
def test_matches(topic_filter: str, name: str, expected: bool) -> None:
    """Wildcards match whole levels and never a leading-$ level."""
    assert t.matches(topic_filter, name) is expected


def test_filter_validity_and_shared() -> None:
    """Wildcards must fill a level; $share filters split into group and filter."""
    assert t.valid_filter("a/+/#")
    assert not t.valid_filter("a/b#")
    assert not t.valid_filter("a/#/b")
    assert not t.valid_filter("a+")
    assert not t.valid_filter("")
    assert t.split_shared("$share/g/a/+") == ("g", "a/+")
    assert t.split_shared("a/b") == (None, "a/b")
    with pytest.raises(ValueError, match="shared"):
        t.split_shared("$share/g")
    assert not t.valid_name("a/+")
    assert t.valid_name("a/b")
    assert not t.valid_name("x" * (t.MAX_NAME_BYTES + 1))
    assert not t.valid_filter("x" * (t.MAX_NAME_BYTES + 1))
    assert t.valid_name("x" * t.MAX_NAME_BYTES)


def test_a_name_is_refused_before_its_encoded_paths_outgrow_the_metadata_store() -> None:
    """Characters that are percent-encoded (twice: topic name, managed ledger name) count
    up to five times; such a name is refused as invalid rather than failing in the store."""
    from polybroker.broker_core.service import TopicRef
    from polybroker.metadata.memory import MAX_PATH_BYTES

    for name in ("€" * 335, " " * 900, "a" + "/" * 700):
        assert len(name.encode()) <= t.MAX_NAME_BYTES
        assert not t.valid_name(name)
        assert not t.valid_filter(name)
    for name in ("€" * 200, " " * 600, "a/" * 250 + "b"):
        assert t.valid_name(name)
        ml = TopicRef.parse(t.to_pulsar(name)).managed_ledger_name
        path = f"/managed-ledgers/{ml}/{'c' * 512}"  # with a long cursor name under it
        assert len(path.encode()) <= MAX_PATH_BYTES


def test_mapping_is_the_same_for_cached_short_and_uncached_long_names() -> None:
    """Short names (cached) and names longer than a topic may be (a will's, uncached) map
    alike and back."""
    for name in ("a/b c", "é/" * 600):
        full = t.to_pulsar(name)
        assert full == t.to_pulsar(name)
        assert full.startswith("persistent://public/default/")
        assert "/" not in full[len("persistent://public/default/") :]
        assert t.from_pulsar(full) == name
