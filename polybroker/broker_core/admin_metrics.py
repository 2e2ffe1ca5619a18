"""Prometheus text exposition (format 0.0.4) of the broker's topic stats.

Names follow Pulsar's broker metrics: per topic ``pulsar_rate_in``, ``pulsar_storage_size``,
``pulsar_in_messages_total`` ... labelled ``cluster``, ``namespace``, ``topic``; broker-wide
totals as ``pulsar_broker_*``. Only loaded topics are counted: a topic nobody used since the
broker started has no rates to report. The entry cache as Pulsar's ``pulsar_ml_cache_used_size``
and ``pulsar_ml_count``, with counters where Pulsar reports per-second rates
(``pulsar_ml_cache_hits_total`` is what ``pulsar_ml_cache_hits_rate`` is the rate of).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: (metric, Prometheus type, help, how to read it from a topic's stats)
_TOPIC_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("pulsar_rate_in", "gauge", "Messages per second published to the topic", "msgRateIn"),
    ("pulsar_rate_out", "gauge", "Messages per second delivered from the topic", "msgRateOut"),
    ("pulsar_throughput_in", "gauge", "Bytes per second published", "msgThroughputIn"),
    ("pulsar_throughput_out", "gauge", "Bytes per second delivered", "msgThroughputOut"),
    ("pulsar_storage_size", "gauge", "Bytes stored for the topic", "storageSize"),
    ("pulsar_msg_backlog", "gauge", "Entries not yet acknowledged, summed over subscriptions", ""),
    ("pulsar_subscriptions_count", "gauge", "Subscriptions of the topic", ""),
    ("pulsar_producers_count", "gauge", "Connected producers", ""),
    ("pulsar_consumers_count", "gauge", "Connected consumers", ""),
    ("pulsar_in_messages_total", "counter", "Messages published since load", "msgInCounter"),
    ("pulsar_in_bytes_total", "counter", "Bytes published since load", "bytesInCounter"),
    ("pulsar_out_messages_total", "counter", "Messages delivered since load", "msgOutCounter"),
    ("pulsar_out_bytes_total", "counter", "Bytes delivered since load", "bytesOutCounter"),
)


#: (metric, Prometheus type, help, key of ``ManagedLedgerFactory.cache_stats``)
_CACHE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("pulsar_ml_cache_used_size", "gauge", "Bytes held by the entry cache", "used_bytes"),
    ("pulsar_ml_cache_max_size", "gauge", "The entry cache's byte budget", "max_bytes"),
    ("pulsar_ml_count", "gauge", "Managed ledgers open on this broker", "logs"),
    ("pulsar_ml_cache_hits_total", "counter", "Entries read from the entry cache", "hits"),
    ("pulsar_ml_cache_misses_total", "counter", "Entries read from the bookies", "misses"),
    (
        "pulsar_ml_cache_evictions_total",
        "counter",
        "Times the cache's byte budget made it drop entries",
        "evictions",
    ),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return "0"


def _value(stats: dict[str, Any], metric: str, key: str) -> Any:
    subs: dict[str, Any] = stats.get("subscriptions") or {}
    if metric == "pulsar_msg_backlog":
        return sum(int(s.get("msgBacklog", 0)) for s in subs.values())
    if metric == "pulsar_subscriptions_count":
        return len(subs)
    if metric == "pulsar_producers_count":
        return len(stats.get("publishers") or [])
    if metric == "pulsar_consumers_count":
        return sum(len(s.get("consumers") or []) for s in subs.values())
    return stats.get(key, 0)


def topic_stats(service: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    """``(full topic name, stats)`` of every loaded topic; a topic failing stats is skipped."""
    for name, topic in sorted(service.topics.items()):
        try:
            yield name, topic.stats()
        except Exception:
            continue


def render_metrics(service: Any, cluster: str) -> str:
    """The metrics page of ``service`` (a ``BrokerService``)."""
    rows = list(topic_stats(service))
    lines: list[str] = []
    totals: dict[str, float] = {}
    base = {"cluster": cluster}
    lines += [
        "# HELP pulsar_broker_topics_count Topics loaded on this broker",
        "# TYPE pulsar_broker_topics_count gauge",
        f"pulsar_broker_topics_count{_labels(base)} {len(rows)}",
    ]
    for metric, kind, help_text, key in _TOPIC_METRICS:
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} {kind}")
        for name, stats in rows:
            rest = name.partition("://")[2]
            namespace = "/".join(rest.split("/")[:2])
            labels = {"cluster": cluster, "namespace": namespace, "topic": name}
            value = _value(stats, metric, key)
            totals[metric] = totals.get(metric, 0) + float(value or 0)
            lines.append(f"{metric}{_labels(labels)} {_number(value)}")
    for metric, kind, help_text, _ in _TOPIC_METRICS:
        broker_metric = metric.replace("pulsar_", "pulsar_broker_", 1)
        lines.append(f"# HELP {broker_metric} {help_text} (all topics)")
        lines.append(f"# TYPE {broker_metric} {kind}")
        lines.append(f"{broker_metric}{_labels(base)} {_number(totals.get(metric, 0))}")
    cache = service.ledger_factory.cache_stats()
    for metric, kind, help_text, key in _CACHE_METRICS:
        if key in cache:
            lines.append(f"# HELP {metric} {help_text}")
            lines.append(f"# TYPE {metric} {kind}")
            lines.append(f"{metric}{_labels(base)} {_number(cache[key])}")
    return "\n".join(lines) + "\n"
