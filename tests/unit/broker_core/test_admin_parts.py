"""The HTTP service's parts without sockets: routing, metrics text, the policy store."""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from polybroker.broker_core.admin import Call, Response, Router
from polybroker.broker_core.admin_metrics import render_metrics
from polybroker.broker_core.admin_policies import AdminError, PolicyStore
from polybroker.metadata.memory import MemoryMetadataStore

T = TypeVar("T")


def result_of(d: Deferred[T]) -> T:
    """Return what an already-fired Deferred fired with; raise its failure."""
    out: list[object] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]  # type: ignore[return-value]


async def _ok(call: Call) -> Response:
    return Response.text("ok")


def test_router_matches_segments_constraints_and_methods() -> None:
    """Placeholders match one decoded segment, constraints restrict them, method mismatch 405."""
    router = Router()
    router.add("GET", "/admin/v2/{domain:persistent|non-persistent}/{t}/{ns}/{topic}/stats", _ok)
    found = router.find("GET", "/admin/v2/persistent/public/default/a%2Fb/stats")
    assert not isinstance(found, int)
    assert found[1] == {"domain": "persistent", "t": "public", "ns": "default", "topic": "a/b"}
    assert router.find("GET", "/admin/v2/namespaces/public/default/x/stats") == 404
    assert router.find("POST", "/admin/v2/persistent/public/default/x/stats") == 405
    assert router.find("GET", "/admin/v2/persistent/public/default/x/stats/") != 404


class _Topic:
    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, Any]:
        return self._stats


class _Broken:
    def stats(self) -> dict[str, Any]:
        raise RuntimeError("closing")


class _Factory:
    def __init__(self, cache: dict[str, int]) -> None:
        self.cache = cache

    def cache_stats(self) -> dict[str, int]:
        return self.cache


class _Service:
    def __init__(self, topics: dict[str, Any], cache: dict[str, int] | None = None) -> None:
        self.topics = topics
        self.ledger_factory = _Factory(cache or {})


def test_metrics_text_sums_and_escapes() -> None:
    """Per-topic samples carry escaped labels; broker totals add them; failing topics skip."""
    stats = {
        "msgRateIn": 2.5,
        "msgInCounter": 7,
        "bytesInCounter": 70,
        "storageSize": 100,
        "publishers": [{}],
        "subscriptions": {"s": {"msgBacklog": 4, "consumers": [{}, {}]}},
    }
    service = _Service(
        {
            'persistent://t/ns/a"b': _Topic(stats),
            "persistent://t/ns/c": _Topic(stats),
            "persistent://t/ns/broken": _Broken(),
        }
    )
    lines = render_metrics(service, "c1").splitlines()
    assert (
        'pulsar_in_messages_total{cluster="c1",namespace="t/ns",topic="persistent://t/ns/a\\"b"} 7'
        in lines
    )
    assert 'pulsar_broker_in_messages_total{cluster="c1"} 14.0' in lines
    assert 'pulsar_broker_msg_backlog{cluster="c1"} 8.0' in lines
    assert 'pulsar_broker_consumers_count{cluster="c1"} 4.0' in lines
    assert 'pulsar_broker_topics_count{cluster="c1"} 2' in lines
    assert not any("broken" in line for line in lines)
    assert not any(line.startswith("pulsar_ml_") for line in lines)  # a factory with no cache


def test_metrics_text_has_the_entry_cache() -> None:
    """The factory's cache figures appear under Pulsar's names, counters as counters."""
    cache = {"used_bytes": 4096, "max_bytes": 1 << 20, "logs": 3, "hits": 90, "misses": 10}
    lines = render_metrics(_Service({}, cache | {"evictions": 2}), "c1").splitlines()
    assert 'pulsar_ml_cache_used_size{cluster="c1"} 4096' in lines
    assert 'pulsar_ml_cache_max_size{cluster="c1"} 1048576' in lines
    assert 'pulsar_ml_count{cluster="c1"} 3' in lines
    assert 'pulsar_ml_cache_hits_total{cluster="c1"} 90' in lines
    assert 'pulsar_ml_cache_misses_total{cluster="c1"} 10' in lines
    assert 'pulsar_ml_cache_evictions_total{cluster="c1"} 2' in lines
    assert "# TYPE pulsar_ml_cache_hits_total counter" in lines
    assert "# TYPE pulsar_ml_cache_used_size gauge" in lines


def _policies() -> PolicyStore:
    return PolicyStore(MemoryMetadataStore(Clock()), "standalone")


def _status(d: Deferred[Any]) -> int:
    with pytest.raises(AdminError) as info:
        result_of(d)
    return info.value.status


def test_defaults_are_created_once() -> None:
    """ensure_defaults creates cluster, tenant and namespace, and is idempotent."""
    policies = _policies()
    result_of(policies.ensure_defaults({"serviceUrl": "http://h:8080"}))
    result_of(policies.ensure_defaults({"serviceUrl": "http://h:8080"}))
    assert result_of(Deferred.fromCoroutine(policies.clusters())) == ["standalone"]
    assert result_of(Deferred.fromCoroutine(policies.namespaces("public"))) == ["public/default"]
    assert result_of(policies.namespace_exists("public/default")) is True
    assert result_of(policies.namespace_exists("public/other")) is False


def test_status_codes_of_refusals() -> None:
    """Unknown is 404, existing is 409, bad names and unknown clusters are 412."""
    policies = _policies()
    result_of(policies.ensure_defaults({}))
    assert _status(Deferred.fromCoroutine(policies.get_tenant("nope"))) == 404
    assert _status(Deferred.fromCoroutine(policies.create_tenant("public", {}))) == 409
    assert _status(Deferred.fromCoroutine(policies.create_tenant("bad/name", {}))) == 412
    unknown_cluster = policies.create_tenant("t", {"allowedClusters": ["x"]})
    assert _status(Deferred.fromCoroutine(unknown_cluster)) == 412
    assert _status(Deferred.fromCoroutine(policies.delete_tenant("public"))) == 409
    assert _status(Deferred.fromCoroutine(policies.delete_cluster("standalone"))) == 412


def test_deduplication_policy_is_answered_from_the_cache() -> None:
    """A namespace's deduplication setting reaches the synchronous hook; unset is None."""
    policies = _policies()
    result_of(policies.ensure_defaults({}))
    assert policies.deduplication_of("persistent://public/default/t") is None
    change = policies.update_policies("public/default", {"deduplicationEnabled": True})
    result_of(Deferred.fromCoroutine(change))
    assert policies.deduplication_of("persistent://public/default/t") is True
    assert policies.deduplication_of("persistent://other/ns/t") is None
    reloaded = PolicyStore(policies.store, "standalone")
    result_of(reloaded.load())
    assert reloaded.deduplication_of("persistent://public/default/t") is True


def test_policies_changed_by_another_broker_reach_the_cache() -> None:
    """Two brokers share the configuration store: a change made through one is seen by the
    other's synchronous hook, and a deleted namespace leaves its cache."""
    first = _policies()
    result_of(first.ensure_defaults({}))
    second = PolicyStore(first.store.new_session(), "standalone")  # type: ignore[attr-defined]
    result_of(second.load())
    assert second.deduplication_of("persistent://public/default/t") is None
    change = first.update_policies("public/default", {"deduplicationEnabled": True})
    result_of(Deferred.fromCoroutine(change))
    assert second.deduplication_of("persistent://public/default/t") is True
    result_of(Deferred.fromCoroutine(first.delete_namespace("public/default")))
    assert second.deduplication_of("persistent://public/default/t") is None
    second.close()


def test_topic_policies_win_while_followed_and_reach_the_owner_from_another_broker() -> None:
    """A topic's own policies, set through one broker, are in force on the broker that
    follows the topic (it loaded it; partitions count for their partitioned topic) and
    over the namespace's; the last unfollow drops them from that broker's cache."""
    admin = _policies()
    result_of(admin.ensure_defaults({}))
    owner = PolicyStore(admin.store.new_session(), "standalone")  # type: ignore[attr-defined]
    result_of(owner.load())
    ns_ttl = admin.update_policies("public/default", {"message_ttl_in_seconds": 60})
    result_of(Deferred.fromCoroutine(ns_ttl))
    part0, part1 = (f"persistent://public/default/p-partition-{i}" for i in (0, 1))
    result_of(owner.follow_topic(part0))
    result_of(owner.follow_topic(part1))
    base = "persistent://public/default/p"
    own = admin.update_topic_policies(base, {"message_ttl_in_seconds": 5})
    result_of(Deferred.fromCoroutine(own))
    assert owner.message_ttl_of(part1) == 5
    assert owner.message_ttl_of("persistent://public/default/other") == 60
    owner.unfollow_topic(part0)
    assert owner.message_ttl_of(part1) == 5  # partition 1 still loaded
    owner.unfollow_topic(part1)
    assert owner.message_ttl_of(part1) == 60
    result_of(owner.follow_topic(part1))
    assert owner.message_ttl_of(part1) == 5  # read again when loaded again
    result_of(admin.forget_topic(base))
    assert owner.message_ttl_of(part1) == 60
    owner.close()
