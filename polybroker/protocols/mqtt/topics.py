"""MQTT topic names and filters, and how names map onto Pulsar topics. Sans-IO.

Mapping: the MQTT name ``a/b`` is the Pulsar topic ``persistent://public/default/a%2Fb``: the
whole name, percent-encoded (every byte but ``A-Z a-z 0-9 _ . - ~``), is the local name, so the
mapping is reversible and each MQTT topic is one Pulsar (and Kafka) topic. A Pulsar topic whose
local name is ``x`` is the MQTT topic ``unquote(x)``.

Partitioned topics (Kafka clients create them) are one MQTT topic each: a subscription covers
every partition, and a client's publishes go to one partition chosen by its client id (so each
publisher's messages stay in order). A local name ending ``-partition-<n>`` is read as such a
partition.

Filters: ``+`` matches one level, a trailing ``#`` the rest (including the parent level); a
filter starting with a wildcard never matches a name starting with ``$`` (MQTT-4.7.2-1).
``$share/<group>/<filter>`` is a shared subscription of ``group`` on ``filter``.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import quote, unquote

NAMESPACE = "public/default"
_PREFIX = f"persistent://{NAMESPACE}/"
SHARE_PREFIX = "$share/"
#: Longest topic name or filter accepted (UTF-8 bytes): each name is a managed ledger's name.
MAX_NAME_BYTES = 1024
#: ... and the longest that name may grow to in the metadata store's paths, percent-encoded
#: twice (as a Pulsar topic name, then as a managed ledger's): a name of characters that are
#: encoded (``/``, spaces, non-ASCII) is refused before its paths would pass the store's limit.
_MAX_ENCODED = 3072


def _fits(name: str) -> bool:
    size = len(name.encode("utf-8"))
    if size * 5 <= _MAX_ENCODED:  # each byte encodes to at most 5 characters
        return True
    return size <= MAX_NAME_BYTES and len(quote(quote(name, safe=""), safe="")) <= _MAX_ENCODED


_PARTITION = re.compile(r"^(.+)-partition-(\d+)$")


def to_pulsar(name: str) -> str:
    """The full Pulsar topic name of the MQTT topic ``name``."""
    if len(name) <= MAX_NAME_BYTES:
        return _to_pulsar_cached(name)
    return _PREFIX + quote(name, safe="")


@functools.lru_cache(maxsize=1024)
def _to_pulsar_cached(name: str) -> str:
    """``to_pulsar`` of a name of at most ``MAX_NAME_BYTES`` characters, cached: every publish
    maps its topic, and percent-encoding is a dozen Python calls (a few MB at most)."""
    return _PREFIX + quote(name, safe="")


def from_pulsar(full: str) -> str | None:
    """The MQTT topic name of a Pulsar topic of ``public/default``, or None for another one."""
    if not full.startswith(_PREFIX):
        return None
    return unquote(full[len(_PREFIX) :])


def valid_name(name: str) -> bool:
    """Whether ``name`` can be published to (non-empty, no wildcards, not too long)."""
    return bool(name) and "+" not in name and "#" not in name and _fits(name)


def valid_filter(topic_filter: str) -> bool:
    """Whether ``topic_filter`` is a well-formed filter (wildcards occupy whole levels)."""
    if not topic_filter or not _fits(topic_filter):
        return False
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


def split_shared(topic_filter: str) -> tuple[str | None, str]:
    """``(group, filter)`` of a ``$share/group/filter``; ``(None, topic_filter)`` otherwise.

    Raise ``ValueError`` for a malformed shared filter."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    group, sep, rest = topic_filter[len(SHARE_PREFIX) :].partition("/")
    if not sep or not group or "+" in group or "#" in group or not valid_filter(rest):
        raise ValueError(f"invalid shared subscription {topic_filter!r}")
    return group, rest


def matches(topic_filter: str, name: str) -> bool:
    """Whether the filter matches the topic name."""
    if name.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    n_levels = name.split("/")
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(n_levels):
            return False
        if level != "+" and level != n_levels[i]:
            return False
    return len(f_levels) == len(n_levels)


def has_wildcard(topic_filter: str) -> bool:
    """Whether the filter can match more than one name."""
    return "+" in topic_filter or "#" in topic_filter


def split_partition(full: str) -> tuple[str, int]:
    """``(base topic, index)`` of a partition's full name; ``(full, -1)`` for another name.

    A partitioned topic (as Kafka clients create them) is one MQTT topic: its base name."""
    m = _PARTITION.match(full)
    if m is None:
        return full, -1
    return m.group(1), int(m.group(2))


def partition_name(full: str, index: int) -> str:
    """The full name of partition ``index`` of the partitioned topic ``full``."""
    return f"{full}-partition-{index}"
