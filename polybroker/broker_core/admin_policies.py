"""Clusters, tenants and namespaces (with their policies), kept in the metadata store.

Layout (Pulsar's): ``/admin/clusters/<cluster>`` holds ClusterData JSON,
``/admin/policies/<tenant>`` TenantInfo JSON and ``/admin/policies/<tenant>/<ns>`` the
namespace's Policies JSON. A tenant's namespaces are its node's children, so a tenant with
namespaces cannot be deleted by accident (the store refuses to delete a node with children).

The store is the truth; this class keeps a cache of namespace policies, filled by ``load`` and
updated by every write through it, because the Broker API asks synchronously whether a
topic's namespace deduplicates (``deduplication_of``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from twisted.internet.defer import Deferred

from polybroker.broker_core.schema_compat import STRATEGIES
from polybroker.metadata.api import BadVersionError, MetadataStore, NotEmptyError, NotFoundError

CLUSTERS_ROOT = "/admin/clusters"
POLICIES_ROOT = "/admin/policies"
TOPIC_POLICIES_ROOT = "/admin/topic-policies"
_PARTITION = re.compile(r"-partition-\d+$")
# Pulsar's policy keys of a topic's producer and consumer limits (``TopicLimits``' order).
LIMIT_POLICIES = (
    "max_producers_per_topic",
    "max_consumers_per_topic",
    "max_consumers_per_subscription",
)

_NAME_RE = re.compile(r"^[-=:.\w]+$")


class AdminError(Exception):
    """An admin operation refused, with Pulsar's HTTP status for it."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def not_found(reason: str) -> AdminError:
    return AdminError(404, reason)


def conflict(reason: str) -> AdminError:
    return AdminError(409, reason)


def precondition(reason: str) -> AdminError:
    return AdminError(412, reason)


def check_name(kind: str, name: str) -> None:
    """Raise a 412 ``AdminError`` for a name Pulsar would not accept."""
    if not name or not _NAME_RE.match(name):
        raise precondition(f"{kind} name is not valid: {name!r}")


def even_bundles(count: int) -> dict[str, Any]:
    """Policies' ``bundles`` for ``count`` equal hash ranges."""
    from polybroker.broker_core.ownership import even_boundaries

    return {"boundaries": even_boundaries(count), "numBundles": count}


def default_policies(cluster: str, bundles: int = 1) -> dict[str, Any]:
    """The Policies of a namespace created with no body."""
    return {
        "bundles": even_bundles(bundles),
        "replication_clusters": [cluster],
        "auth_policies": {
            "namespace_auth": {},
            "destination_auth": {},
            "subscription_auth_roles": {},
        },
        "deleted": False,
        "schema_compatibility_strategy": "UNDEFINED",
        "is_allow_auto_update_schema": True,
        "schema_validation_enforced": False,
    }


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _load(raw: bytes) -> Any:
    return json.loads(raw) if raw else {}


class PolicyStore:
    """Clusters, tenants and namespaces in the metadata store (module docstring)."""

    def __init__(self, store: MetadataStore, cluster: str, *, default_bundles: int = 4) -> None:
        self.store = store
        self.cluster = cluster
        self.default_bundles = default_bundles
        self._watched: dict[str, Callable[[], None]] = {}
        self._namespaces: dict[str, dict[str, Any]] = {}
        # Topic-level policies by topic (a partition's are its partitioned topic's), of the
        # topics followed here (``follow_topic``: those loaded).
        self._topics: dict[str, dict[str, Any]] = {}
        self._topic_watches: dict[str, Callable[[], None]] = {}
        self._follows: dict[str, int] = {}

    def load(self) -> Deferred[None]:
        """Read every namespace's policies into the cache."""
        return Deferred.fromCoroutine(self._load_all())

    async def _load_all(self) -> None:
        cache: dict[str, dict[str, Any]] = {}
        for tenant in await self.store.children(POLICIES_ROOT):
            for ns in await self.store.children(f"{POLICIES_ROOT}/{tenant}"):
                found = await self.store.get(f"{POLICIES_ROOT}/{tenant}/{ns}")
                if found is not None:
                    cache[f"{tenant}/{ns}"] = _load(found.value)
        self._namespaces = {}
        for namespace, policies in cache.items():
            self._cache(namespace, policies)

    def _cache(self, namespace: str, policies: dict[str, Any]) -> None:
        """Keep ``policies`` and follow later changes made by any broker (a watch)."""
        self._namespaces[namespace] = policies
        if namespace in self._watched:
            return
        path = f"{POLICIES_ROOT}/{namespace}"
        _, changed = self._mirror(self._namespaces, namespace, path, self._watched)
        self._watched[namespace] = self.store.watch(path, changed)

    def _mirror(
        self,
        cache: dict[str, dict[str, Any]],
        key: str,
        path: str,
        followed: dict[str, Any],
    ) -> tuple[Callable[[Any], None], Callable[[object], None]]:
        """Keep ``cache[key]`` as the node at ``path`` says while ``key`` is in ``followed``:
        return the refresh that applies one read of the node, and the watch callback that
        reads it again."""

        def refresh(found: Any) -> None:
            if key not in followed:
                return  # no longer followed
            if found is None:
                cache.pop(key, None)
            else:
                with contextlib.suppress(ValueError):
                    cache[key] = _load(found.value)

        def changed(_: object) -> None:
            self.store.get(path).addCallbacks(refresh, lambda _f: None)

        return refresh, changed

    def close(self) -> None:
        """Stop following namespaces' and topics' changes."""
        for unwatch in [*self._watched.values(), *self._topic_watches.values()]:
            unwatch()
        self._watched.clear()
        self._topic_watches.clear()

    # -- topic-level policies (Pulsar's topic policies: they win over the namespace's) -------

    @staticmethod
    def _topic_key(topic: str) -> str:
        return _PARTITION.sub("", topic)

    def _topic_path(self, topic: str) -> str:
        domain, _, rest = self._topic_key(topic).partition("://")
        tenant, ns, local = rest.split("/", 2)
        return f"{TOPIC_POLICIES_ROOT}/{tenant}/{ns}/{domain}/{quote(local, safe='')}"

    def follow_topic(self, topic: str) -> Deferred[None]:
        """Read a topic's own policies into the cache and follow their changes by any broker
        until as many ``unfollow_topic`` calls (fires once read). A partition counts for its
        partitioned topic."""
        key = self._topic_key(topic)
        path = self._topic_path(key)
        refresh, changed = self._mirror(self._topics, key, path, self._topic_watches)
        self._follows[key] = self._follows.get(key, 0) + 1
        if key not in self._topic_watches:
            self._topic_watches[key] = self.store.watch(path, changed)
        return self.store.get(path).addCallback(refresh)

    def unfollow_topic(self, topic: str) -> None:
        """One ``follow_topic`` less: the last one stops following and drops the cache."""
        key = self._topic_key(topic)
        left = self._follows.get(key, 0) - 1
        if left > 0:
            self._follows[key] = left
            return
        self._follows.pop(key, None)
        self._topics.pop(key, None)
        unwatch = self._topic_watches.pop(key, None)
        if unwatch is not None:
            unwatch()

    async def topic_policies(self, topic: str) -> dict[str, Any]:
        """A topic's own policies as stored (empty when it has none)."""
        found = await self.store.get(self._topic_path(topic))
        return {} if found is None else dict(_load(found.value))

    async def update_topic_policies(self, topic: str, changes: dict[str, Any]) -> None:
        """Apply ``changes`` to a topic's own policies (None removes a key) by
        compare-and-set; the node goes when none is left."""
        path = self._topic_path(topic)
        while True:
            found = await self.store.get(path)
            policies = {} if found is None else dict(_load(found.value))
            for key, value in changes.items():
                if value is None:
                    policies.pop(key, None)
                else:
                    policies[key] = value
            version = -1 if found is None else found.stat.version
            try:
                if policies:
                    await self.store.put(path, _dump(policies), version)
                elif found is not None:
                    await self.store.delete(path, version)
            except (BadVersionError, NotFoundError):
                continue
            key = self._topic_key(topic)
            if key in self._topic_watches:  # followed here: in force at once
                if policies:
                    self._topics[key] = policies
                else:
                    self._topics.pop(key, None)
            return

    def forget_topic(self, topic: str) -> Deferred[None]:
        """Delete a deleted topic's own policies."""

        async def forget() -> None:
            found = await self.store.get(self._topic_path(topic))
            if found is not None:
                with contextlib.suppress(BadVersionError, NotFoundError):
                    await self.store.delete(self._topic_path(topic), found.stat.version)
            self._topics.pop(self._topic_key(topic), None)

        return Deferred.fromCoroutine(forget())

    # -- hooks for the Broker API ---------------------------------------------------------

    def namespace_exists(self, namespace: str) -> Deferred[bool]:
        """Whether ``tenant/ns`` exists (asks the store when the cache does not know it)."""
        return Deferred.fromCoroutine(self._namespace_exists(namespace))

    async def _namespace_exists(self, namespace: str) -> bool:
        if namespace in self._namespaces:
            return True
        found = await self.store.get(f"{POLICIES_ROOT}/{namespace}")
        if found is None or "/" not in namespace:
            return False
        self._cache(namespace, _load(found.value))
        return True

    def _policy(self, topic: str, key: str) -> Any:
        """The value of policy ``key`` for a full topic name: the topic's own, else its
        namespace's (None: neither sets it). The ``..._of`` hooks below answer so."""
        own = self._topics.get(self._topic_key(topic))
        if own is not None and key in own:
            return own[key]
        rest = topic.partition("://")[2]
        policies = self._namespaces.get("/".join(rest.split("/")[:2]))
        return None if policies is None else policies.get(key)

    def deduplication_of(self, topic: str) -> bool | None:
        """The deduplication setting for a full topic name (None: not set)."""
        value = self._policy(topic, "deduplicationEnabled")
        return None if value is None else bool(value)

    def auto_topic_creation_of(self, topic: str) -> tuple[bool, str, int] | None:
        """The ``autoTopicCreationOverride`` for a full topic name as (allowed,
        topic type, partitions), or None when it sets none."""
        value = self._policy(topic, "autoTopicCreationOverride")
        if not valid_auto_topic_creation(value):
            return None
        kind = value.get("topicType") or "non-partitioned"
        partitions = int(value.get("defaultNumPartitions") or 1)
        return bool(value["allowAutoTopicCreation"]), kind, partitions

    def schema_compatibility_of(self, topic: str) -> str | None:
        """The schema compatibility strategy for a full topic name (None: not set,
        or ``UNDEFINED``)."""
        value = self._policy(topic, "schema_compatibility_strategy")
        return value if value in STRATEGIES else None

    def schema_flags_of(self, topic: str) -> tuple[bool | None, bool | None]:
        """The ``is_allow_auto_update_schema`` and ``schema_validation_enforced``
        for a full topic name (None: not set)."""
        auto = self._policy(topic, "is_allow_auto_update_schema")
        enforced = self._policy(topic, "schema_validation_enforced")
        return (
            auto if isinstance(auto, bool) else None,
            enforced if isinstance(enforced, bool) else None,
        )

    def message_ttl_of(self, topic: str) -> int | None:
        """The message TTL in seconds for a full topic name (None: not set)."""
        value = self._policy(topic, "message_ttl_in_seconds")
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return value

    def limits_of(self, topic: str) -> tuple[int | None, int | None, int | None]:
        """The max producers per topic, max consumers per topic and max consumers
        per subscription for a full topic name (each None: not set)."""
        return tuple(  # type: ignore[return-value]
            value if isinstance(value, int) and not isinstance(value, bool) else None
            for value in (self._policy(topic, key) for key in LIMIT_POLICIES)
        )

    def backlog_quota_of(self, topic: str) -> dict[str, Any] | None:
        """The ``backlog_quota_map`` for a full topic name (None: not set)."""
        value = self._policy(topic, "backlog_quota_map")
        return value if isinstance(value, dict) else None

    def retention_of(self, topic: str) -> tuple[float, int] | None:
        """The retention (seconds, bytes; -1: unlimited) for a full topic name, as
        Pulsar's ``retention_policies`` set it (None: not set, the broker's defaults apply)."""
        value = self._policy(topic, "retention_policies")
        if not isinstance(value, dict):
            return None
        try:
            minutes = float(value.get("retentionTimeInMinutes", 0))
            megabytes = float(value.get("retentionSizeInMB", 0))
        except (TypeError, ValueError):
            return None
        seconds = -1.0 if minutes < 0 else minutes * 60.0
        size = -1 if megabytes < 0 else int(megabytes * 1024 * 1024)
        return seconds, size

    # -- clusters -------------------------------------------------------------------------

    async def clusters(self) -> list[str]:
        return await self.store.children(CLUSTERS_ROOT)

    async def get_cluster(self, name: str) -> dict[str, Any]:
        found = await self.store.get(f"{CLUSTERS_ROOT}/{name}")
        if found is None:
            raise not_found("Cluster does not exist")
        return dict(_load(found.value))

    async def create_cluster(self, name: str, data: dict[str, Any]) -> None:
        check_name("Cluster", name)
        try:
            await self.store.put(f"{CLUSTERS_ROOT}/{name}", _dump(data), -1)
        except BadVersionError:
            raise conflict("Cluster already exists") from None

    async def update_cluster(self, name: str, data: dict[str, Any]) -> None:
        found = await self.store.get(f"{CLUSTERS_ROOT}/{name}")
        if found is None:
            raise not_found("Cluster does not exist")
        await self.store.put(f"{CLUSTERS_ROOT}/{name}", _dump(data), found.stat.version)

    async def delete_cluster(self, name: str) -> None:
        for tenant in await self.tenants():
            info = await self.get_tenant(tenant)
            if name in info.get("allowedClusters", []):
                raise precondition(f"Cluster not empty: tenant {tenant} uses it")
        try:
            await self.store.delete(f"{CLUSTERS_ROOT}/{name}")
        except NotFoundError:
            raise not_found("Cluster does not exist") from None

    # -- tenants --------------------------------------------------------------------------

    async def tenants(self) -> list[str]:
        return await self.store.children(POLICIES_ROOT)

    async def get_tenant(self, name: str) -> dict[str, Any]:
        found = await self.store.get(f"{POLICIES_ROOT}/{name}")
        if found is None:
            raise not_found("Tenant does not exist")
        info = dict(_load(found.value))
        info.setdefault("adminRoles", [])
        info.setdefault("allowedClusters", [])
        return info

    async def _check_clusters(self, info: dict[str, Any]) -> None:
        known = set(await self.clusters())
        for cluster in info.get("allowedClusters", []) or []:
            if cluster not in known:
                raise precondition(f"Clusters do not exist: {cluster}")

    async def create_tenant(self, name: str, info: dict[str, Any]) -> None:
        check_name("Tenant", name)
        info = {
            "adminRoles": list(info.get("adminRoles") or []),
            "allowedClusters": list(info.get("allowedClusters") or []),
        }
        await self._check_clusters(info)
        try:
            await self.store.put(f"{POLICIES_ROOT}/{name}", _dump(info), -1)
        except BadVersionError:
            raise conflict("Tenant already exists") from None

    async def update_tenant(self, name: str, info: dict[str, Any]) -> None:
        found = await self.store.get(f"{POLICIES_ROOT}/{name}")
        if found is None:
            raise not_found("Tenant does not exist")
        await self._check_clusters(info)
        await self.store.put(f"{POLICIES_ROOT}/{name}", _dump(info), found.stat.version)

    async def delete_tenant(self, name: str) -> None:
        if await self.store.get(f"{POLICIES_ROOT}/{name}") is None:
            raise not_found("Tenant does not exist")
        try:
            await self.store.delete(f"{POLICIES_ROOT}/{name}")
        except NotEmptyError:
            raise conflict("The tenant still has active namespaces") from None
        except NotFoundError:
            raise not_found("Tenant does not exist") from None

    # -- namespaces -----------------------------------------------------------------------

    async def namespaces(self, tenant: str) -> list[str]:
        if await self.store.get(f"{POLICIES_ROOT}/{tenant}") is None:
            raise not_found("Tenant does not exist")
        return [f"{tenant}/{ns}" for ns in await self.store.children(f"{POLICIES_ROOT}/{tenant}")]

    async def get_policies(self, namespace: str) -> dict[str, Any]:
        found = await self.store.get(f"{POLICIES_ROOT}/{namespace}")
        if found is None:
            raise not_found("Namespace does not exist")
        policies = dict(_load(found.value))
        self._cache(namespace, policies)
        return policies

    async def create_namespace(self, namespace: str, policies: dict[str, Any] | None) -> None:
        tenant, _, ns = namespace.partition("/")
        check_name("Namespace", ns)
        if await self.store.get(f"{POLICIES_ROOT}/{tenant}") is None:
            raise not_found("Tenant does not exist")
        merged = default_policies(self.cluster, self.default_bundles)
        merged.update(policies or {})
        asked = merged.get("bundles")
        if isinstance(asked, dict) and "boundaries" not in asked:
            count = asked.get("numBundles")
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1024:
                raise AdminError(412, "numBundles must be an integer from 1 to 1024")
            merged["bundles"] = even_bundles(count)
        try:
            await self.store.put(f"{POLICIES_ROOT}/{namespace}", _dump(merged), -1)
        except BadVersionError:
            raise conflict("Namespace already exists") from None
        self._cache(namespace, merged)

    async def update_policies(self, namespace: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (None values remove a key) with compare-and-set; retry on races."""
        path = f"{POLICIES_ROOT}/{namespace}"
        while True:
            found = await self.store.get(path)
            if found is None:
                raise not_found("Namespace does not exist")
            policies = dict(_load(found.value))
            for key, value in changes.items():
                if value is None:
                    policies.pop(key, None)
                else:
                    policies[key] = value
            try:
                await self.store.put(path, _dump(policies), found.stat.version)
            except BadVersionError:
                continue
            self._cache(namespace, policies)
            return policies

    async def delete_namespace(self, namespace: str) -> None:
        try:
            await self.store.delete(f"{POLICIES_ROOT}/{namespace}")
        except NotFoundError:
            raise not_found("Namespace does not exist") from None
        finally:
            self._namespaces.pop(namespace, None)

    # -- first start ----------------------------------------------------------------------

    def ensure_defaults(
        self, cluster_data: dict[str, Any], tenant: str = "public", namespace: str = "default"
    ) -> Deferred[None]:
        """Create this cluster, the tenant and its namespace unless they exist (idempotent)."""
        return Deferred.fromCoroutine(self._ensure_defaults(cluster_data, tenant, namespace))

    async def _ensure_defaults(
        self, cluster_data: dict[str, Any], tenant: str, namespace: str
    ) -> None:
        for create in (
            lambda: self.create_cluster(self.cluster, cluster_data),
            lambda: self.create_tenant(tenant, {"allowedClusters": [self.cluster]}),
            lambda: self.create_namespace(f"{tenant}/{namespace}", None),
        ):
            try:
                await create()
            except AdminError as e:
                if e.status != 409:
                    raise
        await self._load_all()


def valid_auto_topic_creation(value: Any) -> bool:
    """Whether ``value`` is an ``autoTopicCreationOverride`` as Pulsar accepts it: a flag, and
    when it allows creation a topic type; partitioned ones with 1 or more partitions."""
    if not isinstance(value, dict) or not isinstance(value.get("allowAutoTopicCreation"), bool):
        return False
    if not value["allowAutoTopicCreation"]:
        return True
    kind = value.get("topicType")
    if kind == "non-partitioned":
        return True
    partitions = value.get("defaultNumPartitions")
    return (
        kind == "partitioned"
        and isinstance(partitions, int)
        and not isinstance(partitions, bool)
        and partitions >= 1
    )
