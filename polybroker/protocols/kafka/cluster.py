"""What the Kafka handler knows about the other brokers of a cluster.

Rule K1 (node ids): Kafka names brokers by an int32 node id. A broker's node id is registered
        once in the metadata store at ``/kafka/node-ids/<quoted broker id>`` and never changes:
        the first broker that needs it takes the next number of the sequential nodes under
        ``/kafka/node-id-seq`` (unique, never reused) and creates the mapping only if it does
        not exist yet (compare-and-set), so concurrent allocations agree on one number. A
        broker restarted at the same address keeps its id; ids are small and collision-free.
Rule K2 (brokers): Metadata lists every live broker that has a ``kafka`` listener; the
        controller is the one with the smallest node id.
Rule K3 (leaders): a partition's leader (and its only replica) is the broker ``lookup``
        names as the owner of the partition's topic (or the candidate that will claim it);
        lookups run concurrently, at most ``max_lookups`` at a time. A partition whose owner
        is not a listed broker has no leader (LEADER_NOT_AVAILABLE).
Rule K4 (settling): brokers may disagree on the candidate for an unowned bundle, and a Kafka
        client goes wherever the last metadata it read points. So when a lookup names another
        broker, that broker is asked to claim the topic now (``claim_at``: an authoritative
        lookup on it, as a Pulsar client's redirect does) and the lookup is repeated: every
        broker then names the same owner. A request for a topic this broker does not own is
        served here only when the broker the lookup names cannot be asked (then this broker
        claims the bundle if it is free); otherwise it is refused so the client looks again.
        A broker that answered is not asked again about the topic for ``SETTLED_S``.
Rule K5 (coordinators): group ``g`` is coordinated by the owner of the pseudo-topic
        ``persistent://public/default/__kafka_coordinator-<k>``, ``k`` the murmur3 hash of the
        group id modulo ``coordinator_slots``. A broker serves a group's requests only while it
        owns that slot (claiming it when unowned, as in Rule K4); a slot it (re)claims starts
        from what the metadata store holds, never from what it remembered before.
Rule K6 (bounds): no request waits on ownership longer than ``OWNERSHIP_TIMEOUT_S``; then it
        is answered with the retriable error of its kind (the client asks again), and what was
        under way is left to finish rather than cancelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from twisted.internet.defer import Deferred, DeferredList, DeferredSemaphore, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from polybroker.broker_core.errors import ServiceNotReadyError
from polybroker.broker_core.murmur import murmur3_32
from polybroker.broker_core.ownership import BrokerInfo, Ownership
from polybroker.metadata.api import BadVersionError, MetadataStore, NotFoundError

NODE_IDS_ROOT = "/kafka/node-ids"
NODE_ID_SEQUENCE = "/kafka/node-id-seq/id-"
COORDINATOR_PREFIX = "persistent://public/default/__kafka_coordinator-"
DEFAULT_COORDINATOR_SLOTS = 16
DEFAULT_MAX_LOOKUPS = 32
_MAX_NODE_ID = (1 << 31) - 1
#: How long (seconds) a broker that answered a claim request is not asked again (Rule K4).
SETTLED_S = 10.0
_MAX_SETTLED = 100_000
#: How long (seconds) a request waits for an ownership answer before it is refused as
#: retriable (LEADER_NOT_AVAILABLE, NOT_LEADER_OR_FOLLOWER, NOT_COORDINATOR).
OWNERSHIP_TIMEOUT_S = 10.0

#: Ask a broker to claim a full topic name; fires with whether it answered.
ClaimAt = Callable[[BrokerInfo, str], Deferred[bool]]


class OwnershipTimeoutError(ServiceNotReadyError):
    """Ownership did not answer in time (the request is refused as retriable)."""


@dataclass(frozen=True)
class KafkaNode:
    """A broker as Kafka clients see it."""

    node_id: int
    host: str
    port: int
    broker_id: str


def kafka_address(info: BrokerInfo) -> tuple[str, int] | None:
    """The (host, port) of a broker's Kafka listener, or None if it has none."""
    listener = info.listeners.get("kafka")
    if not listener:
        return None
    host, _, port = listener.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        return None
    if not host or not 0 < number < 65536:
        return None
    return host.strip("[]"), number


def coordinator_slot(group_id: str, slots: int) -> int:
    """The coordinator slot of a group (Rule K4)."""
    return murmur3_32(group_id.encode("utf-8", "surrogatepass")) % slots


class KafkaCluster:
    """Node ids, brokers, partition leaders and group coordinators in a cluster (module doc)."""

    def __init__(
        self,
        ownership: Ownership,
        store: MetadataStore,
        clock: IReactorTime,
        *,
        claim_at: ClaimAt | None = None,
        coordinator_slots: int = DEFAULT_COORDINATOR_SLOTS,
        max_lookups: int = DEFAULT_MAX_LOOKUPS,
    ) -> None:
        if coordinator_slots < 1:
            raise ValueError("at least one coordinator slot")
        self.ownership = ownership
        self.store = store
        self.clock = clock
        self._claim_at = claim_at
        self._settled: dict[str, tuple[str, float]] = {}  # topic -> (broker id, when)
        self.ownership_timeout_s = OWNERSHIP_TIMEOUT_S
        self.coordinator_slots = coordinator_slots
        self._lookups = DeferredSemaphore(max(1, max_lookups))
        self._node_ids: dict[str, int] = {}
        self._allocating: dict[str, list[Deferred[int]]] = {}

    def bounded(self, d: Deferred[Any]) -> Deferred[Any]:
        """``d``'s result, or ``OwnershipTimeoutError`` after ``ownership_timeout_s``."""
        return _bounded_by(d, self.ownership_timeout_s, self.clock)

    # -- node ids (Rule K1) -------------------------------------------------------------------

    def node_id(self, broker_id: str) -> Deferred[int]:
        """The broker's node id, registering one if it has none yet."""
        known = self._node_ids.get(broker_id)
        if known is not None:
            return succeed(known)
        waiters = self._allocating.get(broker_id)
        if waiters is not None:
            d: Deferred[int] = Deferred()
            waiters.append(d)
            return d
        self._allocating[broker_id] = []
        return Deferred.fromCoroutine(self._resolve(broker_id))

    async def _resolve(self, broker_id: str) -> int:
        try:
            found = await self._read_or_register(broker_id)
        except Exception as e:
            for waiter in self._allocating.pop(broker_id, []):
                waiter.errback(e)
            raise
        self._node_ids[broker_id] = found
        for waiter in self._allocating.pop(broker_id, []):
            waiter.callback(found)
        return found

    async def _read_or_register(self, broker_id: str) -> int:
        path = f"{NODE_IDS_ROOT}/{quote(broker_id, safe='')}"
        found = await self.store.get(path)
        if found is not None:
            return _parse_node_id(found.value, path)
        made = await self.store.create_sequential(NODE_ID_SEQUENCE, broker_id.encode())
        number = int(made[len(NODE_ID_SEQUENCE) :])
        try:
            if number > _MAX_NODE_ID:
                raise ServiceNotReadyError("Kafka node ids are exhausted")
            try:
                await self.store.put(path, str(number).encode(), -1)
                return number
            except BadVersionError:  # another broker registered it first: theirs holds
                again = await self.store.get(path)
                if again is None:
                    raise ServiceNotReadyError(f"node id of {broker_id} vanished") from None
                return _parse_node_id(again.value, path)
        finally:
            with contextlib.suppress(NotFoundError):
                await self.store.delete(made)

    # -- brokers (Rule K2) --------------------------------------------------------------------

    async def nodes(self) -> list[KafkaNode]:
        """Every live broker with a Kafka listener, by node id."""
        out = []
        for info in await self.bounded(self.ownership.brokers()):
            node = await self._node(info)
            if node is not None:
                out.append(node)
        return sorted(out, key=lambda n: n.node_id)

    async def _node(self, info: BrokerInfo) -> KafkaNode | None:
        address = kafka_address(info)
        if address is None:
            return None
        return KafkaNode(await self.node_id(info.broker_id), address[0], address[1], info.broker_id)

    # -- leaders (Rule K3) --------------------------------------------------------------------

    async def leaders(
        self, topics: Sequence[str], nodes: Sequence[KafkaNode]
    ) -> dict[str, KafkaNode | None]:
        """The leader of each full topic name among ``nodes`` (None: no leader now)."""
        by_id = {n.broker_id: n for n in nodes}
        unique = list(dict.fromkeys(topics))
        results = await DeferredList(
            [self._lookups.run(self._settled_lookup, t) for t in unique], consumeErrors=True
        )
        out: dict[str, KafkaNode | None] = {}
        for topic, (ok, info) in zip(unique, results, strict=True):
            out[topic] = by_id.get(info.broker_id) if ok else None
        return out

    def _settled_lookup(self, topic: str) -> Deferred[BrokerInfo]:
        return Deferred.fromCoroutine(self.settled_lookup(topic))

    async def settled_lookup(self, topic: str) -> BrokerInfo:
        """The broker that serves the topic, made its owner when it was only the candidate
        (Rule K4)."""
        info = await self.bounded(self.ownership.lookup(topic))
        if info.broker_id != self.ownership.local.broker_id and await self.settle(info, topic):
            info = await self.bounded(self.ownership.lookup(topic))
        return info

    async def settle(self, info: BrokerInfo, topic: str) -> bool:
        """Ask ``info``'s broker to claim the topic (Rule K4); whether it answered (a broker
        that answered recently is not asked again)."""
        if self._claim_at is None:
            return False
        now = self.clock.seconds()
        last = self._settled.get(topic)
        if last is not None and last[0] == info.broker_id and now - last[1] < SETTLED_S:
            return True
        try:
            answered = await self._claim_at(info, topic)
        except Exception:
            answered = False
        if answered:
            if len(self._settled) >= _MAX_SETTLED:
                self._settled.clear()
            self._settled[topic] = (info.broker_id, now)
        else:
            self._settled.pop(topic, None)
        return answered

    async def serves_here(self, topic: str) -> bool:
        """Whether a request for the topic should be served by this broker (Rule K4): it
        owns the topic, the lookup names it, or the broker named cannot be asked."""
        if self.owns(topic):
            return True
        try:
            info = await self.bounded(self.ownership.lookup(topic))
        except OwnershipTimeoutError:
            return False
        except ServiceNotReadyError:
            return True  # loading the topic decides (and says why not)
        if info.broker_id == self.ownership.local.broker_id:
            return True
        return not await self.settle(info, topic)

    # -- coordinators (Rule K5) ---------------------------------------------------------------

    def coordinator_topic(self, group_id: str) -> str:
        """The pseudo-topic whose owner coordinates the group."""
        return f"{COORDINATOR_PREFIX}{coordinator_slot(group_id, self.coordinator_slots)}"

    async def coordinator(self, group_id: str) -> KafkaNode | None:
        """The broker that coordinates the group (None: none now)."""
        try:
            info = await self.settled_lookup(self.coordinator_topic(group_id))
        except ServiceNotReadyError:
            return None
        return await self._node(info)

    def owns(self, topic: str) -> bool:
        """Whether this broker holds the topic's bundle now (no I/O)."""
        return self.ownership.owns(topic)

    async def claim(self, topic: str) -> bool:
        """Claim the topic's bundle for this broker; False when another broker owns it (or
        none can now)."""
        try:
            await self.bounded(self.ownership.acquire(topic))
        except ServiceNotReadyError:
            return False
        return True


def _bounded_by(d: Deferred[Any], seconds: float, clock: IReactorTime) -> Deferred[Any]:
    """``d``'s result, or ``ServiceNotReadyError`` after ``seconds``; ``d`` itself is left
    to finish (cancelling it could leave ownership's own bookkeeping half done)."""
    out: Deferred[Any] = Deferred()

    def expire() -> None:
        if not out.called:
            out.errback(OwnershipTimeoutError(f"ownership did not answer within {seconds}s"))

    timer = clock.callLater(seconds, expire)

    def done(result: Any) -> None:
        if timer.active():
            timer.cancel()
        if not out.called:
            if isinstance(result, Failure):
                out.errback(result)
            else:
                out.callback(result)

    d.addBoth(done)
    return out


def lookup_url(web_url: str, topic: str) -> str | None:
    """The authoritative HTTP lookup of a full topic name on a broker (None: no such URL)."""
    domain, sep, rest = topic.partition("://")
    parts = rest.split("/", 2)
    if not web_url or not sep or len(parts) != 3 or not all(parts):
        return None
    tenant, namespace, local = parts
    path = "/".join(quote(p, safe="") for p in (domain, tenant, namespace, local))
    return f"{web_url.rstrip('/')}/lookup/v2/topic/{path}?authoritative=true"


def http_claim_at(reactor: Any, timeout_s: float = 3.0) -> ClaimAt:
    """Ask brokers to claim topics through their HTTP lookup (Rule K4), bounded by
    ``timeout_s``; a broker that does not answer with a success counts as not asked."""
    from twisted.web.client import Agent, readBody

    agent = Agent(reactor, connectTimeout=timeout_s)

    async def ask(info: BrokerInfo, topic: str) -> bool:
        url = lookup_url(info.web_url, topic)
        if url is None:
            return False
        request = agent.request(b"GET", url.encode())
        request.addTimeout(timeout_s, reactor)
        response = await request
        body = readBody(response)
        body.addTimeout(timeout_s, reactor)
        await body
        return 200 <= int(response.code) < 300

    return lambda info, topic: Deferred.fromCoroutine(ask(info, topic))


def clustered(ownership: Any) -> bool:
    """Whether ``ownership`` (None in some setups: standalone) spans several brokers."""
    return ownership is not None and bool(getattr(ownership, "clustered", False))


def _parse_node_id(raw: bytes, path: str) -> int:
    try:
        number = int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise ServiceNotReadyError(f"{path} does not hold a node id") from None
    if not 0 <= number <= _MAX_NODE_ID:
        raise ServiceNotReadyError(f"{path} does not hold a node id")
    return number
