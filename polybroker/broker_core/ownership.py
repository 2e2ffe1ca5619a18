"""Which broker serves a topic: namespace bundles, ownership claims, lookup and load.

Rule O1 (bundles): a namespace's hash space [0, 2**32) is cut at the boundaries of its policies
        (``bundles.boundaries``: hex strings, first ``0x00000000``, last ``0xffffffff``). A topic (a
        partition is a topic of its own) belongs to the bundle ``[lo, hi)`` that holds the
        murmur3_32 hash of its full name, as in Pulsar; the last bundle also holds 0xffffffff. A
        bundle is named ``0x%08x_0x%08x``.
Rule O2 (owner): a broker owns a bundle while it holds the ephemeral node
        ``/namespace/<tenant>/<ns>/<bundle>`` (an ``EphemeralClaim`` whose value names the broker
        and its process instance). The Broker API loads a topic only through ``acquire``: an
        unowned bundle is claimed then, one owned by another broker refuses with
        ``NotOwnerError``. A claim lost with the session, or whose node an unload deleted,
        unloads every topic of the bundle at once: ownership is never kept silently. A broker
        restarted under the same address takes over the nodes of its dead predecessor at
        once (``EphemeralClaim`` Rule C5): its bundles, registration and leadership do not wait
        for that process's session to expire. While only the connection is down (the session
        may live on) the bundle is still served; a new owner fences each topic's ledger before
        writing, so two brokers never both append.
Rule O3 (lookup): the owner when there is one; otherwise a candidate, which claims the bundle
        when the lookup reaches it (an authoritative lookup, or a topic's first use). The candidate
        is the bundle's transfer hint if that broker is live, else the least-loaded live broker:
        its last load report plus the bundles this broker sent its way since.
Rule O4 (brokers): each broker holds ``/loadbalance/brokers/<id>`` (its ``BrokerInfo``) and
        rewrites ``/loadbalance/load/<id>`` with its load every
        ``loadBalancerReportUpdateMinIntervalMillis``; only brokers holding their node are live.
Rule O5 (unload, transfer, split): unloading a bundle deletes its node (after a transfer hint
        naming the destination, when given); the owner sees the deletion and unloads its topics
        (Rule O2). On the owner itself the topics are closed first and the node released after.
        A split rewrites the namespace's boundaries by compare-and-set, then unloads the bundle.
Rule O6 (load manager): one broker leads (claim on ``/loadbalance/leader``). Every
        ``loadBalancerSheddingIntervalMinutes`` the leader unloads one bundle from a broker that
        owns at least two more bundles than the least-loaded one, or whose message rate exceeds
        the average by ``loadBalancerBrokerThresholdShedderPercentage`` (a bundle whose move
        would make its new broker the hottest stays: none moves then); a bundle it shed stays
        put for ``loadBalancerSheddingGracePeriodMinutes``. And every broker splits
        its own bundles holding more than ``loadBalancerNamespaceBundleMaxTopics`` topics or
        ``loadBalancerNamespaceBundleMaxMsgRate`` msgs/s (``loadBalancerAutoBundleSplitEnabled``).

``LocalOwnership`` is the single-broker case (standalone): this broker owns everything.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import itertools
import json
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.murmur import murmur3_32
from polybroker.logs import kv
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError
from polybroker.metadata.claim import ClaimState, EphemeralClaim

log = logging.getLogger(__name__)

BROKERS_PATH = "/loadbalance/brokers"
LOAD_PATH = "/loadbalance/load"
LEADER_PATH = "/loadbalance/leader"
HINTS_PATH = "/loadbalance/bundle-hints"
OWNERS_ROOT = "/namespace"
POLICIES_ROOT = "/admin/policies"
FULL_RANGE = 1 << 32


class NotOwnerError(ServiceNotReadyError):
    """Another broker owns the topic's bundle: look the topic up again."""

    def __init__(self, message: str, owner: BrokerInfo | None = None) -> None:
        super().__init__(message)
        self.owner = owner


# -- bundles (Rule O1): pure functions ---------------------------------------------------------


def even_boundaries(count: int) -> list[str]:
    """The boundaries of ``count`` equal bundles."""
    if count < 1:
        raise ValueError("a namespace has at least one bundle")
    cuts = [i * FULL_RANGE // count for i in range(count)] + [FULL_RANGE - 1]
    return [f"0x{c:08x}" for c in cuts]


def parse_boundaries(boundaries: Sequence[str]) -> list[int]:
    """Boundaries as integers; raise ``ValueError`` unless they cover the range in order."""
    values = [int(b, 16) for b in boundaries]
    if len(values) < 2 or values[0] != 0 or values[-1] != FULL_RANGE - 1:
        raise ValueError(f"bundle boundaries must run from 0x00000000 to 0xffffffff: {boundaries}")
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"bundle boundaries must increase: {boundaries}")
    return values


def bundle_name(lo: int, hi: int) -> str:
    return f"0x{lo:08x}_0x{hi:08x}"


def bundle_names(boundaries: Sequence[str]) -> list[str]:
    values = parse_boundaries(boundaries)
    return [bundle_name(a, b) for a, b in itertools.pairwise(values)]


def topic_hash(topic: str) -> int:
    return murmur3_32(topic.encode())


def bundle_of(topic: str, boundaries: Sequence[str]) -> str:
    """The bundle of a full topic name (Rule O1)."""
    values = parse_boundaries(boundaries)
    h = topic_hash(topic)
    i = min(bisect.bisect_right(values, h) - 1, len(values) - 2)
    return bundle_name(values[i], values[i + 1])


def split_boundaries(boundaries: Sequence[str], bundle: str) -> list[str]:
    """The boundaries with ``bundle`` cut in half; ``ValueError`` if it is not one of them or
    is too small to cut."""
    values = parse_boundaries(boundaries)
    lo_s, _, hi_s = bundle.partition("_")
    try:
        lo, hi = int(lo_s, 16), int(hi_s, 16)
    except ValueError:
        raise ValueError(f"invalid bundle {bundle!r}") from None
    if lo not in values or hi not in values or values.index(hi) != values.index(lo) + 1:
        raise ValueError(f"{bundle} is not a bundle of this namespace")
    if hi - lo < 2:
        raise ValueError(f"{bundle} is too small to split")
    values.insert(values.index(hi), lo + (hi - lo) // 2)
    return [f"0x{v:08x}" for v in values]


# -- brokers and their load ------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerInfo:
    """How clients reach one broker. ``broker_id`` is ``host:webServicePort``, unique among live
    brokers; ``listeners`` maps a protocol (``kafka``, ``mqtt``, ``amqp``) to ``host:port``."""

    broker_id: str
    web_url: str
    pulsar_url: str = ""
    listeners: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "brokerId": self.broker_id,
            "webServiceUrl": self.web_url,
            "pulsarServiceUrl": self.pulsar_url,
            "listeners": dict(self.listeners),
        }

    @classmethod
    def from_json(cls, doc: Any) -> BrokerInfo:
        """Parse ``to_json``'s shape; ``ValueError`` when it is not one."""
        if not isinstance(doc, dict) or not isinstance(doc.get("brokerId"), str):
            raise ValueError("not a broker record")
        listeners = doc.get("listeners") or {}
        if not isinstance(listeners, dict):
            raise ValueError("broker listeners must be an object")
        return cls(
            broker_id=doc["brokerId"],
            web_url=str(doc.get("webServiceUrl", "")),
            pulsar_url=str(doc.get("pulsarServiceUrl", "")),
            listeners={str(k): str(v) for k, v in listeners.items()},
        )


def _decode_info(raw: bytes) -> BrokerInfo | None:
    try:
        return BrokerInfo.from_json(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass
class BundleLoad:
    """What one bundle carries on its owner."""

    topics: int = 0
    msg_rate_in: float = 0.0
    msg_rate_out: float = 0.0

    @property
    def msg_rate(self) -> float:
        return self.msg_rate_in + self.msg_rate_out


@dataclass
class LoadReport:
    """A broker's load: its bundles (``namespace/bundle`` -> load)."""

    bundles: dict[str, BundleLoad] = field(default_factory=dict)

    @property
    def msg_rate(self) -> float:
        return sum(b.msg_rate for b in self.bundles.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "bundles": {
                name: {"topics": b.topics, "msgRateIn": b.msg_rate_in, "msgRateOut": b.msg_rate_out}
                for name, b in self.bundles.items()
            }
        }

    @classmethod
    def from_json(cls, doc: Any) -> LoadReport:
        report = cls()
        bundles = doc.get("bundles") if isinstance(doc, dict) else None
        if isinstance(bundles, dict):
            for name, b in bundles.items():
                if isinstance(b, dict):
                    report.bundles[str(name)] = BundleLoad(
                        int(b.get("topics", 0)),
                        float(b.get("msgRateIn", 0.0)),
                        float(b.get("msgRateOut", 0.0)),
                    )
        return report


def least_loaded(
    candidates: Iterable[str],
    reports: Mapping[str, LoadReport],
    pending: Mapping[str, int],
    bundle: str = "",
) -> str:
    """The broker to give ``bundle``: fewest bundles (reported plus ``pending``), then the
    lowest message rate, then a hash of bundle and broker (Rule O3): brokers that see the same
    load agree, and ties spread bundles instead of sending them all to one broker."""

    def score(broker: str) -> tuple[int, float, int, str]:
        report = reports.get(broker) or LoadReport()
        tie = murmur3_32(f"{bundle}|{broker}".encode())
        return (len(report.bundles) + pending.get(broker, 0), report.msg_rate, tie, broker)

    ranked = sorted(candidates, key=score)
    if not ranked:
        raise ServiceNotReadyError("no broker is available")
    return ranked[0]


def bundle_to_shed(
    reports: Mapping[str, LoadReport],
    threshold_percent: float,
    min_rate: float = 100.0,
    recent: Collection[str] = (),
) -> tuple[str, str] | None:
    """(broker, ``namespace/bundle``) the leader should unload, or None (Rule O6). Bundles in
    ``recent`` (shed within the grace period) stay where they are."""
    if len(reports) < 2:
        return None
    counts = {b: len(r.bundles) for b, r in reports.items()}
    busiest = max(counts, key=lambda b: (counts[b], b))
    if counts[busiest] >= min(counts.values()) + 2:
        bundles = reports[busiest].bundles
        movable = [n for n in bundles if n not in recent]
        if movable:
            return busiest, min(movable, key=lambda n: (bundles[n].msg_rate, n))
    rates = {b: r.msg_rate for b, r in reports.items()}
    average = sum(rates.values()) / len(rates)
    hottest = max(rates, key=lambda b: (rates[b], b))
    if (
        average >= min_rate
        and rates[hottest] > average * (1 + threshold_percent / 100)
        and len(reports[hottest].bundles) >= 2
    ):
        bundles = reports[hottest].bundles
        # The busiest bundle that alone would not make another broker the hottest one. When
        # every bundle would, none moves: the hot spot would only change brokers, and come
        # back at the next check (a bundle shed to and fro every interval).
        room = rates[hottest] - average
        fitting = [n for n in bundles if bundles[n].msg_rate <= room and n not in recent]
        if fitting:
            return hottest, max(fitting, key=lambda n: (bundles[n].msg_rate, n))
    return None


def bundles_to_split(report: LoadReport, max_topics: int, max_msg_rate: float) -> list[str]:
    """The bundles (``namespace/bundle``) of one broker that should be split."""
    return sorted(
        name
        for name, b in report.bundles.items()
        if (max_topics > 0 and b.topics > max_topics)
        or (max_msg_rate > 0 and b.msg_rate > max_msg_rate)
    )


# -- the ownership seam ----------------------------------------------------------------------


def namespace_of(topic: str) -> str:
    """``tenant/ns`` of a full topic name (``domain://tenant/ns/local``)."""
    rest = topic.partition("://")[2] or topic
    return "/".join(rest.split("/")[:2])


class Ownership(abc.ABC):
    """What the Broker API and the handlers ask about topic ownership."""

    #: This broker.
    local: BrokerInfo

    @property
    def clustered(self) -> bool:
        """Whether other brokers may own topics."""
        return False

    @abc.abstractmethod
    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        """The broker that serves the full topic name (Rule O3)."""

    @abc.abstractmethod
    def acquire(self, topic: str) -> Deferred[None]:
        """Make sure this broker owns the topic's bundle, claiming it if unowned; fail with
        ``NotOwnerError`` when another broker owns it (Rule O2)."""

    @abc.abstractmethod
    def owns(self, topic: str) -> bool:
        """Whether this broker holds the topic's bundle now (no I/O)."""

    @abc.abstractmethod
    def brokers(self) -> Deferred[list[BrokerInfo]]:
        """The live brokers, this one included, sorted by id."""

    def start(self) -> Deferred[None]:
        return succeed(None)

    def stop(self) -> Deferred[None]:
        return succeed(None)


class LocalOwnership(Ownership):
    """One broker owns every topic (standalone)."""

    def __init__(self, local: BrokerInfo) -> None:
        self.local = local

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        return succeed(self.local)

    def acquire(self, topic: str) -> Deferred[None]:
        return succeed(None)

    def owns(self, topic: str) -> bool:
        return True

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        return succeed([self.local])


@dataclass
class _Bundle:
    """A bundle this broker claims, and the topics it loaded in it."""

    namespace: str
    name: str
    claim: EphemeralClaim
    topics: set[str] = field(default_factory=set)
    ready: Deferred[ClaimState] | None = None


class ClusterOwnership(Ownership):
    """Ownership through the metadata store shared by the brokers of a cluster (module doc).

    ``unload_topic(name) -> Deferred`` closes one loaded topic (the Broker API's unload);
    ``topic_loads() -> {topic: (msg_rate_in, msg_rate_out)}`` reports the loaded topics."""

    def __init__(
        self,
        store: MetadataStore,
        local: BrokerInfo,
        reactor: IReactorTime,
        *,
        unload_topic: Callable[[str], Deferred[None]],
        topic_loads: Callable[[], Mapping[str, tuple[float, float]]],
        config: Mapping[str, Any] | None = None,
    ) -> None:
        def cfg_get(key: str, default: Any) -> Any:
            try:
                return default if config is None else config[key]
            except KeyError:
                return default

        self.store = store
        self.local = local
        self.reactor = reactor
        self._unload_topic = unload_topic
        self._topic_loads = topic_loads
        self._instance = secrets.token_hex(8)
        # When this instance began: of two instances under one broker id, the later one
        # supersedes the earlier (``_left_by_earlier_run``).
        self._since = int(reactor.seconds() * 1000)
        self._value = self._claim_value()
        self._bundles: dict[str, _Bundle] = {}  # "ns/bundle" -> claim
        self._boundaries: dict[str, list[str]] = {}
        self._unwatch_policies: dict[str, Callable[[], None]] = {}
        self._live: dict[str, BrokerInfo] | None = None
        self._unwatch_brokers: Callable[[], None] | None = None
        self._reports: dict[str, LoadReport] = {}
        self._pending: dict[str, int] = {}  # bundles given to each broker since its report
        self._assigned: dict[str, str] = {}  # bundle -> broker it was given to (not yet claimed)
        self._registration: EphemeralClaim | None = None
        self._leader: EphemeralClaim | None = None
        self._loops: list[LoopingCall] = []
        self._started = False
        self._stopped = False
        self.report_interval_s = (
            float(cfg_get("loadBalancerReportUpdateMinIntervalMillis", 5000)) / 1000
        )
        self.shed_interval_s = 60.0 * float(cfg_get("loadBalancerSheddingIntervalMinutes", 1))
        self.shed_threshold = float(cfg_get("loadBalancerBrokerThresholdShedderPercentage", 10))
        self.shed_grace_s = 60.0 * float(cfg_get("loadBalancerSheddingGracePeriodMinutes", 30))
        self._shed_at: dict[str, float] = {}  # bundle -> when the leader last shed it
        self.shedding = bool(cfg_get("loadBalancerSheddingEnabled", True))
        self.auto_split = bool(cfg_get("loadBalancerAutoBundleSplitEnabled", True))
        self.split_max_topics = int(cfg_get("loadBalancerNamespaceBundleMaxTopics", 1000))
        self.split_max_rate = float(cfg_get("loadBalancerNamespaceBundleMaxMsgRate", 30000))
        self.max_bundles = int(cfg_get("loadBalancerNamespaceMaximumBundles", 128))

    @property
    def clustered(self) -> bool:
        return True

    def set_local(self, local: BrokerInfo) -> None:
        """Name this broker once its listeners are bound (before ``start``)."""
        if self._started:
            raise RuntimeError("the broker's identity is fixed once started")
        self.local = local
        self._value = self._claim_value()

    def _claim_value(self) -> bytes:
        """What this broker's claims hold: its ``BrokerInfo``, instance and start time."""
        doc = {**self.local.to_json(), "instance": self._instance, "since": self._since}
        return json.dumps(doc).encode()

    def _check_started(self) -> None:
        if not self._started or self._stopped:
            raise ServiceNotReadyError("this broker is not serving topics now")

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Register this broker (Rule O4), start reporting and the leader election."""
        return Deferred.fromCoroutine(self._start())

    async def _start(self) -> None:
        self._unwatch_brokers = self.store.watch(BROKERS_PATH, self._brokers_changed)
        self._registration = EphemeralClaim(
            self.store,
            f"{BROKERS_PATH}/{self.local.broker_id}",
            self._value,
            contend=True,
            on_change=self._registration_changed,
            supersedes=self._left_by_earlier_run,
        )
        await self._registration.start()
        await self.report_load()
        self._leader = EphemeralClaim(
            self.store,
            LEADER_PATH,
            self._value,
            contend=True,
            supersedes=self._left_by_earlier_run,
        )
        await self._leader.start()
        self._every(self.report_interval_s, self._report_and_split)
        if self.shedding:
            self._every(self.shed_interval_s, self._shed)
        self._started = True

    def _every(self, seconds: float, f: Callable[[], Any]) -> None:
        if seconds <= 0:
            return
        loop = LoopingCall(lambda: Deferred.fromCoroutine(self._guard(f)))
        loop.clock = self.reactor
        loop.start(seconds, now=False)
        self._loops.append(loop)

    async def _guard(self, f: Callable[[], Any]) -> None:
        try:
            await f()
        except Exception as e:
            log.warning("load manager task failed", extra=kv(error=str(e)))

    def stop(self) -> Deferred[None]:
        """Give every bundle and the registration up (topics are the service's to close)."""
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for loop in self._loops:
            if loop.running:
                loop.stop()
        for unwatch in self._unwatch_policies.values():
            unwatch()
        if self._unwatch_brokers is not None:
            self._unwatch_brokers()
        for b in list(self._bundles.values()):
            await b.claim.release()
        self._bundles.clear()
        for claim in (self._leader, self._registration):
            if claim is not None:
                await claim.release()

    def _left_by_earlier_run(self, value: bytes) -> bool:
        """Whether a claim's value names this broker's id with an instance that began before
        this one: a process before this one, dead (this one bound its addresses) but with its
        session not expired yet (Rule O2). Never the other way round, so two live instances
        under one id (a misconfiguration) do not take claims from each other in turn."""
        try:
            doc = json.loads(value)
        except ValueError:
            return False
        if not isinstance(doc, dict) or doc.get("brokerId") != self.local.broker_id:
            return False
        since, instance = doc.get("since", 0), doc.get("instance")
        if not isinstance(since, int) or not isinstance(instance, str):
            return False
        return (since, instance) < (self._since, self._instance)

    def _registration_changed(self, state: ClaimState) -> None:
        if state is not ClaimState.HELD and not self._stopped:
            log.warning("broker registration not held", extra=kv(state=state.value))

    @property
    def is_leader(self) -> bool:
        return self._leader is not None and self._leader.held

    # -- bundles ------------------------------------------------------------------------------

    async def boundaries(self, namespace: str) -> list[str]:
        """The namespace's bundle boundaries (cached, kept current by a watch)."""
        cached = self._boundaries.get(namespace)
        if cached is not None:
            return cached
        path = f"{POLICIES_ROOT}/{namespace}"
        if namespace not in self._unwatch_policies:

            def changed(_: object) -> None:
                self._boundaries.pop(namespace, None)

            self._unwatch_policies[namespace] = self.store.watch(path, changed)
        boundaries = await self._read_boundaries(namespace)
        if boundaries is None:
            raise NotFoundError(f"namespace {namespace} does not exist")
        return boundaries

    async def _read_boundaries(self, namespace: str) -> list[str] | None:
        """The namespace's boundaries read from the store (None: no such namespace), cached."""
        found = await self.store.get(f"{POLICIES_ROOT}/{namespace}")
        if found is None:
            return None
        try:
            boundaries = list(json.loads(found.value)["bundles"]["boundaries"])
            parse_boundaries(boundaries)
        except (ValueError, KeyError, TypeError):
            boundaries = even_boundaries(1)
        self._boundaries[namespace] = boundaries
        return boundaries

    async def bundle_key(self, topic: str) -> str:
        """``namespace/bundle`` of a full topic name."""
        namespace = namespace_of(topic)
        return f"{namespace}/{bundle_of(topic, await self.boundaries(namespace))}"

    def owned_bundles(self) -> list[str]:
        return sorted(k for k, b in self._bundles.items() if _serving(b))

    def owns(self, topic: str) -> bool:
        return any(topic in b.topics and _serving(b) for b in self._bundles.values())

    def acquire(self, topic: str) -> Deferred[None]:
        return Deferred.fromCoroutine(self._acquire(topic))

    async def _current_bundle(self, namespace: str, bundle: str) -> bool:
        """Whether ``bundle`` is one of the namespace's bundles now, read from the store (not
        the cache, which a watch refreshes a moment after a split); the cache is updated."""
        boundaries = await self._read_boundaries(namespace)
        return boundaries is not None and bundle in bundle_names(boundaries)

    async def _acquire(self, topic: str) -> None:
        self._check_started()
        key = await self.bundle_key(topic)
        held = self._bundles.get(key)
        if held is None or not _serving(held):
            # A bundle being transferred goes to its destination only (Rule O5).
            hint = await self.store.get(f"{HINTS_PATH}/{key}")
            wanted = None if hint is None else hint.value.decode(errors="replace")
            if wanted is not None and wanted != self.local.broker_id:
                live = await self._live_brokers()
                if wanted in live:
                    raise NotOwnerError(f"{topic} is moving to {wanted}", live[wanted])
        state = await self._claim(key)
        if state is ClaimState.RELEASED and await self.bundle_key(topic) != key:
            # The bundle was split under a stale view: claim the topic's bundle now.
            key = await self.bundle_key(topic)
            state = await self._claim(key)
        bundle = self._bundles.get(key)
        if state is ClaimState.HELD and bundle is not None:
            bundle.topics.add(topic)
            return
        owner = await self._owner(key)
        if owner is not None and owner.broker_id != self.local.broker_id:
            raise NotOwnerError(f"{topic} is served by {owner.broker_id}", owner)
        raise ServiceNotReadyError(f"bundle {key} of {topic} is not available here now")

    async def _claim(self, key: str) -> ClaimState:
        bundle = self._bundles.get(key)
        if bundle is not None:
            if bundle.ready is not None:
                return await _wait(bundle.ready)
            if _serving(bundle):
                return ClaimState.HELD
        namespace, _, name = key.rpartition("/")
        claim = EphemeralClaim(
            self.store,
            f"{OWNERS_ROOT}/{key}",
            self._value,
            on_change=lambda state: self._claim_changed(key, claim, state),
            supersedes=self._left_by_earlier_run,
        )
        bundle = _Bundle(namespace, name, claim)
        self._bundles[key] = bundle
        first = claim.start()
        bundle.ready = first
        try:
            state = await _wait(first)
        finally:
            bundle.ready = None
        if state is ClaimState.HELD and not await self._current_bundle(namespace, name):
            # Split meanwhile (the boundaries this broker had were stale): not a bundle any
            # more, so serving it would let two brokers serve one topic. Give it up.
            log.info("claimed bundle no longer exists", extra=kv(bundle=key))
            if self._bundles.get(key) is bundle:
                del self._bundles[key]
            await claim.release()
            return ClaimState.RELEASED
        if state is ClaimState.HELD:
            if self._assigned.pop(key, None) == self.local.broker_id:
                mine = self._pending.get(self.local.broker_id, 0)
                self._pending[self.local.broker_id] = max(0, mine - 1)
            log.info("bundle acquired", extra=kv(bundle=key))
            await self._clear_hint(key)
        else:
            if self._bundles.get(key) is bundle:
                del self._bundles[key]
            if state is not ClaimState.RELEASED:
                await claim.release()
        return state

    def _claim_changed(self, key: str, claim: EphemeralClaim, state: ClaimState) -> None:
        bundle = self._bundles.get(key)
        if bundle is None or bundle.claim is not claim or bundle.ready is not None:
            return
        if state is ClaimState.HELD or self._stopped:
            return  # held, or given up by ``stop``: nothing lost
        if state is ClaimState.SUSPENDED:
            # The connection is down, the session may live on: keep serving (a new owner
            # would fence our ledgers first) until the store says the session is gone.
            log.warning("bundle suspended", extra=kv(bundle=key))
            return
        # Lost with the session, or deleted by an unload: serve nothing of it any more.
        if state is ClaimState.RELEASED:  # an operator or the load manager unloaded it
            log.info("bundle unloaded elsewhere", extra=kv(bundle=key))
        else:
            log.warning("bundle lost", extra=kv(bundle=key, state=state.value))
        del self._bundles[key]
        Deferred.fromCoroutine(self._drop(bundle))

    async def _drop(self, bundle: _Bundle) -> None:
        for topic in sorted(bundle.topics):
            try:
                await self._unload_topic(topic)
            except Exception as e:
                log.warning("unloading topic failed", extra=kv(topic=topic, error=str(e)))
        await bundle.claim.release()

    async def _owner(self, key: str) -> BrokerInfo | None:
        found = await self.store.get(f"{OWNERS_ROOT}/{key}")
        return None if found is None else _decode_info(found.value)

    def owner(self, topic: str) -> Deferred[BrokerInfo | None]:
        """The broker serving ``topic``'s bundle now, or None when nobody does. Unlike
        ``lookup`` this never assigns the bundle (for calls that only concern a loaded topic)."""
        return Deferred.fromCoroutine(self._owner_of(topic))

    async def _owner_of(self, topic: str) -> BrokerInfo | None:
        self._check_started()
        key = await self.bundle_key(topic)
        bundle = self._bundles.get(key)
        if bundle is not None and _serving(bundle):
            return self.local
        return await self._owner(key)

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, topic: str, *, authoritative: bool = False) -> Deferred[BrokerInfo]:
        return Deferred.fromCoroutine(self._lookup(topic, authoritative))

    async def _lookup(self, topic: str, authoritative: bool) -> BrokerInfo:
        self._check_started()
        key = await self.bundle_key(topic)
        bundle = self._bundles.get(key)
        if bundle is not None and _serving(bundle):
            return self.local
        owner = await self._owner(key)
        if owner is not None:
            return owner
        live = await self._live_brokers()
        target = self.local.broker_id
        if not authoritative:
            target = await self._candidate(key, live)
        if target == self.local.broker_id:
            await self._acquire(topic)
            return self.local
        return live[target]

    async def _candidate(self, key: str, live: Mapping[str, BrokerInfo]) -> str:
        hint = await self.store.get(f"{HINTS_PATH}/{key}")
        if hint is not None:
            wanted = hint.value.decode(errors="replace")
            if wanted in live:
                return wanted
        if any(b not in self._reports for b in live):
            await self._read_reports(live)
        # No await from here on: concurrent lookups of one bundle agree, and each new
        # assignment counts for the next decision.
        chosen = self._assigned.get(key)
        if chosen is not None and chosen in live:
            return chosen
        reports = {**self._reports, self.local.broker_id: self.local_report()}
        chosen = least_loaded(live, reports, self._pending, key)
        self._assigned[key] = chosen
        self._pending[chosen] = self._pending.get(chosen, 0) + 1
        return chosen

    async def _clear_hint(self, key: str) -> None:
        try:
            await self.store.delete(f"{HINTS_PATH}/{key}")
        except NotFoundError:
            pass
        except Exception as e:
            log.warning("cannot clear bundle hint", extra=kv(bundle=key, error=str(e)))

    # -- brokers and load (Rule O4) -----------------------------------------------------------

    def brokers(self) -> Deferred[list[BrokerInfo]]:
        d = Deferred.fromCoroutine(self._live_brokers())
        return d.addCallback(lambda live: [live[k] for k in sorted(live)])

    def leader(self) -> Deferred[BrokerInfo | None]:
        """The broker that holds the load manager's leadership now (None between two)."""

        async def read() -> BrokerInfo | None:
            found = await self.store.get(LEADER_PATH)
            return None if found is None else _decode_info(found.value)

        return Deferred.fromCoroutine(read())

    async def _live_brokers(self) -> dict[str, BrokerInfo]:
        if self._live is not None:
            return self._live
        live: dict[str, BrokerInfo] = {}
        for name in await self.store.children(BROKERS_PATH):
            found = await self.store.get(f"{BROKERS_PATH}/{name}")
            info = None if found is None else _decode_info(found.value)
            if info is not None:
                live[info.broker_id] = info
        self._live = live
        return live

    def _brokers_changed(self, _: object) -> None:
        self._live = None

    def local_report(self) -> LoadReport:
        report = LoadReport({k: BundleLoad() for k, b in self._bundles.items() if _serving(b)})
        by_topic: dict[str, str] = {}
        for key, b in self._bundles.items():
            for t in b.topics:
                by_topic[t] = key
        for topic, (rate_in, rate_out) in self._topic_loads().items():
            key = by_topic.get(topic)
            load = report.bundles.get(key) if key is not None else None
            if load is not None:
                load.topics += 1
                load.msg_rate_in += rate_in
                load.msg_rate_out += rate_out
        return report

    async def report_load(self) -> None:
        report = self.local_report()
        raw = json.dumps(report.to_json()).encode()
        await self.store.put(f"{LOAD_PATH}/{self.local.broker_id}", raw)
        self._reports[self.local.broker_id] = report

    async def _read_reports(self, live: Mapping[str, BrokerInfo]) -> None:
        reports: dict[str, LoadReport] = {}
        for broker in live:
            found = await self.store.get(f"{LOAD_PATH}/{broker}")
            if found is None:
                reports[broker] = LoadReport()
                continue
            try:
                reports[broker] = LoadReport.from_json(json.loads(found.value))
            except (ValueError, TypeError):
                reports[broker] = LoadReport()
        self._reports = reports

    async def _report_and_split(self) -> None:
        await self.report_load()
        await self._read_reports(await self._live_brokers())
        # Fresh reports count what was assigned before them.
        self._pending = {}
        self._assigned = {}
        if self.auto_split:
            report = self._reports.get(self.local.broker_id, LoadReport())
            for key in bundles_to_split(report, self.split_max_topics, self.split_max_rate):
                namespace, _, bundle = key.rpartition("/")
                if len(await self.boundaries(namespace)) - 1 < self.max_bundles:
                    await self.split(namespace, bundle)

    async def _shed(self) -> None:
        if not self.is_leader:
            return
        live = await self._live_brokers()
        await self._read_reports(live)
        now = self.reactor.seconds()
        self._shed_at = {k: t for k, t in self._shed_at.items() if now - t < self.shed_grace_s}
        chosen = bundle_to_shed(
            {b: r for b, r in self._reports.items() if b in live},
            self.shed_threshold,
            recent=self._shed_at,
        )
        if chosen is None:
            return
        broker, key = chosen
        namespace, _, bundle = key.rpartition("/")
        log.info("shedding bundle", extra=kv(broker=broker, bundle=key))
        self._shed_at[key] = now
        await self.unload(namespace, bundle)

    # -- unload, transfer, split (Rule O5) ----------------------------------------------------

    async def unload(self, namespace: str, bundle: str, destination: str | None = None) -> bool:
        """Unload one bundle wherever it is owned; return whether it was owned."""
        key = f"{namespace}/{bundle}"
        if destination:
            live = await self._live_brokers()
            if destination not in live:
                raise ValueError(f"broker {destination} is not live")
            await self.store.put(f"{HINTS_PATH}/{key}", destination.encode())
        mine = self._bundles.pop(key, None)
        if mine is not None and _serving(mine):
            await self._drop(mine)
            return True
        found = await self.store.get(f"{OWNERS_ROOT}/{key}")
        if found is None:
            return False
        with contextlib.suppress(NotFoundError, BadVersionError):
            await self.store.delete(f"{OWNERS_ROOT}/{key}", found.stat.version)
        return True

    async def split(self, namespace: str, bundle: str) -> list[str]:
        """Cut ``bundle`` in two (compare-and-set on the policies), then unload it; return the
        namespace's new bundle names."""
        path = f"{POLICIES_ROOT}/{namespace}"
        while True:
            found = await self.store.get(path)
            if found is None:
                raise NotFoundError(f"namespace {namespace} does not exist")
            policies = json.loads(found.value)
            bundles = policies.get("bundles") or {}
            boundaries = split_boundaries(bundles.get("boundaries") or even_boundaries(1), bundle)
            policies["bundles"] = {"boundaries": boundaries, "numBundles": len(boundaries) - 1}
            try:
                await self.store.put(path, json.dumps(policies).encode(), found.stat.version)
                break
            except BadVersionError:
                continue
        self._boundaries[namespace] = boundaries
        log.info("bundle split", extra=kv(namespace=namespace, bundle=bundle))
        await self.unload(namespace, bundle)
        return bundle_names(boundaries)

    async def bundle_owner(self, namespace: str, bundle: str) -> BrokerInfo | None:
        """The broker serving one bundle now (this one when it does), or None."""
        mine = self._bundles.get(f"{namespace}/{bundle}")
        if mine is not None and _serving(mine):
            return self.local
        return await self._owner(f"{namespace}/{bundle}")

    async def bundle_owners(self, namespace: str) -> dict[str, BrokerInfo | None]:
        """Each bundle of the namespace and its owner (None: unowned)."""
        return {
            b: await self._owner(f"{namespace}/{b}")
            for b in bundle_names(await self.boundaries(namespace))
        }


def _serving(bundle: _Bundle) -> bool:
    """Whether this broker serves the bundle: held, or held with the connection down."""
    return bundle.claim.state in (ClaimState.HELD, ClaimState.SUSPENDED)


async def _wait(d: Deferred[ClaimState]) -> ClaimState:
    """Wait for a claim's first state without consuming it for other waiters."""
    out: Deferred[ClaimState] = Deferred()

    def relay(state: ClaimState) -> ClaimState:
        out.callback(state)
        return state

    d.addCallback(relay)
    return await out
