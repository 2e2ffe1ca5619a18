"""Bundles, lookup, claims, unload, transfer, split and shedding over the in-memory store."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.ownership import (
    OWNERS_ROOT,
    BrokerInfo,
    BundleLoad,
    ClusterOwnership,
    LoadReport,
    NotOwnerError,
    bundle_names,
    bundle_of,
    bundle_to_shed,
    bundles_to_split,
    even_boundaries,
    least_loaded,
    parse_boundaries,
    split_boundaries,
)
from polybroker.metadata.memory import MemoryMetadataStore

NS = "public/default"


def result(d: Deferred[Any]) -> Any:
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred did not fire"
    if hasattr(out[0], "raiseException"):
        out[0].raiseException()
    return out[0]


def topic(i: int) -> str:
    return f"persistent://{NS}/t-partition-{i}"


# -- pure functions ---------------------------------------------------------------------------


def test_even_boundaries_cover_the_range_in_order() -> None:
    b = even_boundaries(4)
    assert b == ["0x00000000", "0x40000000", "0x80000000", "0xc0000000", "0xffffffff"]
    assert bundle_names(b)[0] == "0x00000000_0x40000000"
    assert len(bundle_names(b)) == 4
    with pytest.raises(ValueError, match="from 0x00000000"):
        parse_boundaries(["0x00000001", "0xffffffff"])
    with pytest.raises(ValueError, match="increase"):
        parse_boundaries(["0x00000000", "0x80000000", "0x40000000", "0xffffffff"])


def test_topics_spread_over_bundles_and_stay_put() -> None:
    b = even_boundaries(4)
    names = set(bundle_names(b))
    got = Counter(bundle_of(f"persistent://{NS}/t-partition-{i}", b) for i in range(400))
    assert set(got) == names
    assert min(got.values()) > 50
    assert bundle_of(topic(3), b) == bundle_of(topic(3), list(b))


def test_split_cuts_a_bundle_in_half_and_keeps_topics_inside_it() -> None:
    b = even_boundaries(2)
    first = bundle_names(b)[0]
    after = split_boundaries(b, first)
    assert after == ["0x00000000", "0x40000000", "0x80000000", "0xffffffff"]
    for i in range(50):
        old = bundle_of(topic(i), b)
        new = bundle_of(topic(i), after)
        if old != first:
            assert new == old
        else:
            assert new in bundle_names(after)[:2]
    with pytest.raises(ValueError, match="not a bundle"):
        split_boundaries(b, "0x00000000_0x40000000")


def test_least_loaded_counts_pending_assignments() -> None:
    reports = {"a": LoadReport({"ns/x": BundleLoad()}), "b": LoadReport()}
    assert least_loaded(["a", "b"], reports, {}) == "b"
    assert least_loaded(["a", "b"], reports, {"b": 2}) == "a"


def test_ties_spread_bundles_and_every_broker_agrees() -> None:
    """Equal load: the choice depends on the bundle (not always the same broker), and not on
    the order the candidates are listed in."""
    chosen = {least_loaded(["a", "b"], {}, {}, f"ns/{i}") for i in range(20)}
    assert chosen == {"a", "b"}
    for i in range(20):
        assert least_loaded(["a", "b"], {}, {}, f"ns/{i}") == least_loaded(
            ["b", "a"], {}, {}, f"ns/{i}"
        )


def test_shedding_evens_bundle_counts_and_hot_brokers() -> None:
    four = {f"ns/{i}": BundleLoad() for i in range(4)}
    reports = {"a": LoadReport(dict(four)), "b": LoadReport({"ns/9": BundleLoad()})}
    assert bundle_to_shed(reports, 10)[0] == "a"  # type: ignore[index]
    even = {
        "a": LoadReport({"ns/1": BundleLoad(1, 5000.0), "ns/2": BundleLoad(1, 100.0)}),
        "b": LoadReport({"ns/3": BundleLoad(1, 100.0)}),
    }
    assert bundle_to_shed(even, 10) == ("a", "ns/2")
    calm = {"a": LoadReport({"ns/1": BundleLoad()}), "b": LoadReport({"ns/2": BundleLoad()})}
    assert bundle_to_shed(calm, 10) is None


def test_shedding_never_just_moves_the_hot_spot() -> None:
    """A hot broker whose every bundle would make the other broker the hottest keeps them (it
    swapped them back and forth every interval); bundles shed lately stay put."""
    swap = {
        "a": LoadReport({"ns/1": BundleLoad(1, 300.0), "ns/2": BundleLoad(1, 300.0)}),
        "b": LoadReport({"ns/3": BundleLoad(1, 400.0)}),
    }
    assert bundle_to_shed(swap, 10) is None
    uneven = {f"ns/{i}": BundleLoad(1, float(i)) for i in range(4)}
    reports = {"a": LoadReport(dict(uneven)), "b": LoadReport({})}
    assert bundle_to_shed(reports, 10) == ("a", "ns/0")
    assert bundle_to_shed(reports, 10, recent={"ns/0"}) == ("a", "ns/1")
    assert bundle_to_shed(reports, 10, recent=set(uneven)) is None


def test_bundles_to_split_by_topics_or_rate() -> None:
    report = LoadReport({"ns/a": BundleLoad(5, 0.0), "ns/b": BundleLoad(1, 900.0, 200.0)})
    assert bundles_to_split(report, 4, 10_000) == ["ns/a"]
    assert bundles_to_split(report, 10, 1000) == ["ns/b"]


# -- cluster ownership over one shared tree -------------------------------------------------


class Broker:
    """One broker's ownership and the topics it has unloaded."""

    def __init__(self, store: MemoryMetadataStore, name: str, clock: Clock) -> None:
        self.store = store
        self.unloaded: list[str] = []
        info = BrokerInfo(name, f"http://{name}", f"pulsar://{name}", {"kafka": name})

        def unload(t: str) -> Deferred[None]:
            self.unloaded.append(t)
            return succeed(None)

        self.own = ClusterOwnership(
            store,
            info,
            clock,
            unload_topic=unload,
            topic_loads=dict,
            config={"loadBalancerSheddingEnabled": False},
        )
        result(self.own.start())


def die(broker: Broker) -> None:
    """The broker's process is gone (kill -9) while its session lives on until it expires:
    no watch or session event reaches it any more."""
    broker.store._watches.clear()
    broker.store._listeners.clear()


def cluster(n: int = 2, bundles: int = 4) -> tuple[Clock, list[Broker]]:
    clock = Clock()
    first = MemoryMetadataStore(clock)
    policies = {"bundles": {"boundaries": even_boundaries(bundles), "numBundles": bundles}}
    result(first.put(f"/admin/policies/{NS}", json.dumps(policies).encode()))
    stores = [first] + [first.new_session() for _ in range(n - 1)]
    return clock, [Broker(s, f"b{i}:8080", clock) for i, s in enumerate(stores)]


def test_brokers_see_each_other() -> None:
    _, (a, b) = cluster()
    ids = [info.broker_id for info in result(a.own.brokers())]
    assert ids == ["b0:8080", "b1:8080"]
    assert result(b.own.brokers())[0].listeners == {"kafka": "b0:8080"}


def test_lookups_spread_bundles_and_agree_on_owners() -> None:
    _, (a, b) = cluster()
    owners = {}
    for i in range(16):
        info = result(a.own.lookup(topic(i)))
        if info.broker_id == "b1:8080":
            result(b.own.lookup(topic(i), authoritative=True))  # the client's second lookup
        owners[i] = info.broker_id
    assert set(owners.values()) == {"b0:8080", "b1:8080"}
    for i in range(16):
        assert result(b.own.lookup(topic(i))).broker_id == owners[i]
        assert result(a.own.lookup(topic(i))).broker_id == owners[i]
    held = a.own.owned_bundles() + b.own.owned_bundles()
    assert sorted(held) == sorted(f"{NS}/{x}" for x in bundle_names(even_boundaries(4)))


def test_acquire_refuses_a_bundle_owned_elsewhere() -> None:
    _, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    assert a.own.owns(topic(1))
    with pytest.raises(NotOwnerError) as e:
        result(b.own.acquire(topic(1)))
    assert e.value.owner is not None
    assert e.value.owner.broker_id == "b0:8080"


def test_owner_names_the_serving_broker_and_never_assigns() -> None:
    _, (a, b) = cluster()
    assert result(b.own.owner(topic(1))) is None
    assert a.own.owned_bundles() == b.own.owned_bundles() == []  # asking assigned nothing
    result(a.own.acquire(topic(1)))
    assert result(a.own.owner(topic(1))) == a.own.local
    found = result(b.own.owner(topic(1)))
    assert found is not None
    assert found.broker_id == "b0:8080"


def test_a_dead_brokers_bundles_are_taken_over() -> None:
    _, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    a.store.expire_session(reestablish=False)
    assert result(b.own.lookup(topic(1))).broker_id == "b1:8080"
    assert b.own.owns(topic(1))
    assert topic(1) in a.unloaded  # the old owner stopped serving it
    assert [i.broker_id for i in result(b.own.brokers())] == ["b1:8080"]


def test_session_loss_unloads_and_the_bundle_can_come_back() -> None:
    _, (a, _b) = cluster()
    result(a.own.acquire(topic(1)))
    a.store.expire_session()  # lost, then a new session
    assert topic(1) in a.unloaded
    assert not a.own.owns(topic(1))
    result(a.own.acquire(topic(1)))
    assert a.own.owns(topic(1))


def test_a_restarted_broker_takes_its_bundles_back_before_the_old_session_expires() -> None:
    """A broker killed and started again under the same id (a new instance, on a new
    session) takes over the claims its dead predecessor's live session still holds, its
    registration included; the other broker's claims are left alone."""
    clock, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    result(b.own.acquire(topic(2)))
    assert result(a.own.lookup(topic(1))).broker_id == "b0:8080"
    die(a)
    clock.advance(5)
    restarted = Broker(a.store.new_session(), "b0:8080", clock)  # the old session lives on
    result(restarted.own.acquire(topic(1)))
    assert restarted.own.owns(topic(1))
    assert result(restarted.own.lookup(topic(1))).broker_id == "b0:8080"
    with pytest.raises(NotOwnerError):
        result(restarted.own.acquire(topic(2)))
    assert b.own.owns(topic(2))
    registered = result(a.store.get("/loadbalance/brokers/b0:8080"))
    assert json.loads(registered.value)["instance"] == restarted.own._instance


def test_two_live_instances_under_one_broker_id_do_not_take_claims_in_turn() -> None:
    """A second broker started under the id of one still alive (a misconfiguration) takes
    its claims over once; the first claims its registration back and the second then waits,
    instead of the two deleting each other's nodes without end."""
    clock, (a, _b) = cluster()
    result(a.own.acquire(topic(1)))
    clock.advance(5)
    second = Broker(a.store.new_session(), "b0:8080", clock)
    registered = result(a.store.get("/loadbalance/brokers/b0:8080"))
    assert json.loads(registered.value)["instance"] == a.own._instance
    result(second.own.acquire(topic(1)))  # taken over once; the first stops serving it
    assert topic(1) in a.unloaded
    with pytest.raises(ServiceNotReadyError):  # held by the other instance of its id
        result(a.own.acquire(topic(1)))
    assert second.own.owns(topic(1))


def test_unload_from_another_broker_and_transfer_to_a_destination(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    bundle = result(Deferred.fromCoroutine(a.own.bundle_key(topic(1)))).rpartition("/")[2]
    with caplog.at_level(logging.INFO, logger="polybroker.broker_core.ownership"):
        assert result(Deferred.fromCoroutine(b.own.unload(NS, bundle, destination="b1:8080")))
    assert topic(1) in a.unloaded
    # An unload is an operation, not a fault: the old owner says so without a warning.
    assert [r.levelname for r in caplog.records if "bundle" in r.getMessage()] == ["INFO"]
    assert not a.own.owns(topic(1))
    # The old owner may not take it back while it is moving; the destination gets it.
    with pytest.raises(NotOwnerError):
        result(a.own.acquire(topic(1)))
    assert result(a.own.lookup(topic(1))).broker_id == "b1:8080"
    result(b.own.acquire(topic(1)))
    assert b.own.owns(topic(1))
    # Once there, the hint is gone: an unload lets anyone claim it.
    assert result(Deferred.fromCoroutine(a.own.unload(NS, bundle)))
    result(a.own.acquire(topic(1)))
    assert a.own.owns(topic(1))


def test_split_rewrites_boundaries_and_unloads_the_bundle() -> None:
    _, (a, b) = cluster(bundles=1)
    result(a.own.acquire(topic(1)))
    whole = bundle_names(even_boundaries(1))[0]
    new = result(Deferred.fromCoroutine(b.own.split(NS, whole)))
    assert len(new) == 2
    assert topic(1) in a.unloaded
    stored = json.loads(result(a.store.get(f"/admin/policies/{NS}")).value)
    assert stored["bundles"]["numBundles"] == 2
    assert result(Deferred.fromCoroutine(a.own.bundle_key(topic(1)))).rpartition("/")[2] in new


def test_a_stale_view_of_a_split_never_claims_the_old_bundle() -> None:
    """A broker whose cached boundaries predate a split (its watch has not fired yet) gives
    back the old bundle it claimed and serves the topic from its new bundle instead."""
    _, (a, b) = cluster(bundles=1)
    whole = bundle_names(even_boundaries(1))[0]
    new = result(Deferred.fromCoroutine(a.own.split(NS, whole)))
    b.own._boundaries[NS] = even_boundaries(1)  # what b knew before the split
    result(b.own.acquire(topic(1)))
    held = b.own.owned_bundles()
    assert held == [result(Deferred.fromCoroutine(a.own.bundle_key(topic(1))))]
    assert held[0].rpartition("/")[2] in new
    assert result(b.store.get(f"{OWNERS_ROOT}/{NS}/{whole}")) is None


def test_stop_gives_everything_up(caplog: pytest.LogCaptureFixture) -> None:
    """Bundles given up by stop are not reported lost; another broker may take them."""
    _, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    with caplog.at_level(logging.WARNING, logger="polybroker.broker_core.ownership"):
        result(a.own.stop())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [i.broker_id for i in result(b.own.brokers())] == ["b1:8080"]
    result(b.own.acquire(topic(1)))
    assert b.own.owns(topic(1))


def test_a_lost_connection_keeps_serving_until_the_session_is_gone() -> None:
    from polybroker.metadata.api import SessionEvent

    _, (a, b) = cluster()
    result(a.own.acquire(topic(1)))
    a.store._emit(SessionEvent.CONNECTION_LOST)
    assert a.own.owns(topic(1))
    assert not a.unloaded
    a.store._emit(SessionEvent.RECONNECTED)
    assert a.own.owns(topic(1))
    a.store._emit(SessionEvent.CONNECTION_LOST)
    a.store.expire_session(reestablish=False)
    assert topic(1) in a.unloaded
    assert not a.own.owns(topic(1))
    assert result(b.own.lookup(topic(1))).broker_id == "b1:8080"
