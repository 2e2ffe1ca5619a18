"""The HTTP service of a broker: admin REST v2, HTTP lookup, health and Prometheus metrics.

Paths, JSON shapes and status codes are Pulsar's: GET answers 200 with JSON, a successful
PUT/POST/DELETE answers 204, failures answer ``{"reason": "..."}`` with 404 (unknown), 409
(already exists), 412 (precondition: busy, invalid name, not allowed), 405 (no such method on a
known path), 413 (body too large), 503 (not ready) or 500.

Every handler is a coroutine over the Broker API (``BrokerService``) and the ``PolicyStore``;
``AdminServer.site()`` is the ``twisted.web`` factory the broker binds on ``webServicePort``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.error import ConnectionRefusedError as ConnectionRefused
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from polybroker.broker_core.admin_messages import message_id, render_message
from polybroker.broker_core.admin_metrics import render_metrics
from polybroker.broker_core.admin_policies import (
    AdminError,
    PolicyStore,
    not_found,
    precondition,
    valid_auto_topic_creation,
)
from polybroker.broker_core.backlog_quota import POLICIES, QUOTA_TYPES, SIZE, valid_quota
from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.errors import (
    BrokerError,
    ConsumerBusyError,
    InvalidTopicNameError,
    NotAllowedError,
    ServiceNotReadyError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicAlreadyExistsError,
    TopicBusyError,
    TopicNotFoundError,
    TopicTerminatedError,
)
from polybroker.broker_core.messages import MessageFormatError
from polybroker.broker_core.ownership import (
    ClusterOwnership,
    NotOwnerError,
    bundle_names,
    bundle_of,
    even_boundaries,
)
from polybroker.broker_core.schema_compat import STRATEGIES
from polybroker.broker_core.schemas import (
    IncompatibleSchemaError,
    SchemaNotFoundError,
    SchemaRegistry,
    StoredSchema,
)
from polybroker.broker_core.service import (
    PARTITIONED_ROOT,
    BrokerService,
    TopicListMode,
    TopicRef,
)
from polybroker.ledger.api import Entry, InitialPosition, Position
from polybroker.logs import kv

log = logging.getLogger(__name__)

#: Bound of an unload or split forwarded to the bundle's owner.
FORWARD_TIMEOUT_S = 30.0

#: Largest request body read (admin bodies are small JSON documents).
MAX_BODY_BYTES = 1024 * 1024

_STATUS_OF: tuple[tuple[type[Exception], int], ...] = (
    (TopicNotFoundError, 404),
    (SubscriptionNotFoundError, 404),
    (TopicAlreadyExistsError, 409),
    (TopicBusyError, 412),
    (SubscriptionBusyError, 412),
    (ConsumerBusyError, 412),
    (InvalidTopicNameError, 412),
    (NotAllowedError, 412),
    (TopicTerminatedError, 412),
    (ServiceNotReadyError, 503),
)

#: Namespace policies stored as given: ``{path name: Policies key}``. Deduplication,
#: retention, the message TTL, auto topic creation and the schema ones change what the broker
#: does.
NAMESPACE_POLICY_FIELDS: dict[str, str] = {
    "deduplication": "deduplicationEnabled",
    "schemaCompatibilityStrategy": "schema_compatibility_strategy",
    "isAllowAutoUpdateSchema": "is_allow_auto_update_schema",
    "schemaValidationEnforced": "schema_validation_enforced",
    "retention": "retention_policies",
    "messageTTL": "message_ttl_in_seconds",
    "autoTopicCreation": "autoTopicCreationOverride",
    "maxProducersPerTopic": "max_producers_per_topic",
    "maxConsumersPerTopic": "max_consumers_per_topic",
    "maxConsumersPerSubscription": "max_consumers_per_subscription",
}
_COUNT_POLICIES = frozenset(
    {"messageTTL", "maxProducersPerTopic", "maxConsumersPerTopic", "maxConsumersPerSubscription"}
)
#: Topic-level policies (a topic's path suffix) and the namespace policy each overrides.
TOPIC_POLICY_FIELDS: dict[str, str] = {
    "retention": "retention",
    "messageTTL": "messageTTL",
    "maxProducers": "maxProducersPerTopic",
    "maxConsumers": "maxConsumersPerTopic",
    "maxConsumersPerSubscription": "maxConsumersPerSubscription",
    "deduplicationEnabled": "deduplication",
}


@dataclass
class Response:
    """What a route answers: status, body and its content type."""

    status: int = 204
    body: bytes = b""
    content_type: str = "application/json"
    location: str = ""  # a redirect's target
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(value).encode())

    @classmethod
    def text(cls, value: str, content_type: str = "text/plain; charset=utf-8") -> Response:
        return cls(200, value.encode(), content_type)


@dataclass
class Call:
    """One request as routes see it."""

    method: str
    path: str
    params: dict[str, str]
    query: dict[str, list[str]]
    body: bytes
    raw_query: str = ""

    def flag(self, name: str, default: bool = False) -> bool:
        values = self.query.get(name)
        if not values:
            return default
        return values[-1].lower() in ("true", "1", "yes", "")

    def json_body(self, default: Any = None) -> Any:
        if not self.body.strip():
            return default
        try:
            return json.loads(self.body)
        except ValueError:
            raise AdminError(400, "request body is not valid JSON") from None


Handler = Callable[[Call], Awaitable[Response]]


@dataclass
class _Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler


@dataclass
class Router:
    """Maps ``METHOD /path/{name}`` patterns to handlers; first match wins."""

    routes: list[_Route] = field(default_factory=list)

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        """``{name}`` matches one path segment; ``{name:a|b}`` one of the listed values."""
        regex = ""
        for segment in pattern.strip("/").split("/"):
            m = re.fullmatch(r"\{(\w+)(?::([^}]+))?\}", segment)
            if m is None:
                regex += "/" + re.escape(segment)
            elif m.group(2):
                regex += f"/(?P<{m.group(1)}>{m.group(2)})"
            else:
                regex += f"/(?P<{m.group(1)}>[^/]+)"
        self.routes.append(_Route(method, re.compile(regex + "/?"), handler))

    def find(self, method: str, path: str) -> tuple[Handler, dict[str, str]] | int:
        """The handler and decoded path parameters, or 404 / 405."""
        known_path = False
        for route in self.routes:
            m = route.pattern.fullmatch(path)
            if m is None:
                continue
            known_path = True
            if route.method == method:
                return route.handler, {k: unquote(v) for k, v in m.groupdict().items()}
        return 405 if known_path else 404


def _position_json(position: Position, partition: int) -> dict[str, int]:
    return {
        "ledgerId": position.ledger_id,
        "entryId": position.entry_id,
        "partitionIndex": partition,
    }


def _int_body(call: Call) -> int:
    body = call.json_body()
    if isinstance(body, dict):
        body = body.get("partitions")
    if isinstance(body, bool) or not isinstance(body, int):
        raise precondition("expected the number of partitions")
    return body


def _sum_stats(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-partition topic stats as Pulsar's partitioned-stats does."""
    out: dict[str, Any] = {"metadata": {"partitions": len(parts)}}
    subs: dict[str, dict[str, Any]] = {}
    publishers: list[Any] = []
    for stats in parts.values():
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
        publishers.extend(stats.get("publishers", []))
        for name, sub in stats.get("subscriptions", {}).items():
            merged = subs.setdefault(name, {"consumers": [], "type": sub.get("type")})
            for key, value in sub.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
            merged["consumers"].extend(sub.get("consumers", []))
    if "msgInCounter" in out and out.get("msgInCounter"):
        out["averageMsgSize"] = out.get("bytesInCounter", 0) / out["msgInCounter"]
    out["publishers"] = publishers
    out["subscriptions"] = subs
    out["replication"] = {}
    return out


def _valid_retention(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    return all(
        isinstance(value.get(k, 0), int) and not isinstance(value.get(k, 0), bool)
        for k in ("retentionTimeInMinutes", "retentionSizeInMB")
    )


def _check_policy(field_name: str, value: Any) -> None:
    """Raise 412 unless ``value`` suits namespace policy ``field_name``."""
    if value is None:
        raise precondition(f"{field_name}: a value is required")
    if field_name in _FLAG_POLICIES and not isinstance(value, bool):
        raise precondition(f"{field_name}: expected true or false")
    if field_name in _COUNT_POLICIES and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31
    ):  # Pulsar's fields are 32-bit integers
        if field_name == "messageTTL":
            raise precondition("Invalid value for message TTL: expected seconds, 0 or more")
        raise precondition(f"{field_name} must be 0 or more")
    if field_name == "schemaCompatibilityStrategy" and value not in (STRATEGIES | {"UNDEFINED"}):
        raise precondition(
            "schemaCompatibilityStrategy: expected UNDEFINED or one of "
            + ", ".join(sorted(STRATEGIES))
        )
    if field_name == "autoTopicCreation" and not valid_auto_topic_creation(value):
        raise precondition(
            "autoTopicCreation: expected {allowAutoTopicCreation: bool, topicType: "
            "partitioned|non-partitioned, defaultNumPartitions: int >= 1 if partitioned}"
        )
    if field_name == "retention" and not _valid_retention(value):
        raise precondition(
            "retention: expected {retentionTimeInMinutes: int, retentionSizeInMB: int}"
        )


def _check_quota_against(quota: dict[str, Any], retention: dict[str, Any]) -> None:
    """Pulsar's rule: a backlog quota may not exceed the retention that applies."""
    for key, kept in [
        ("limitSize", retention.get("retentionSizeInMB", 0) * 1024 * 1024),
        ("limitTime", retention.get("retentionTimeInMinutes", 0) * 60),
    ]:
        if kept > 0 and quota[key] >= kept:
            raise precondition(
                "Backlog Quota exceeds configured retention quota for namespace. "
                "Please increase retention quota and retry"
            )


def _boundaries(policies: dict[str, Any]) -> list[str]:
    bundles = policies.get("bundles")
    if isinstance(bundles, dict) and isinstance(bundles.get("boundaries"), list):
        return [str(b) for b in bundles["boundaries"]]
    return even_boundaries(1)


class AdminServer:
    """The broker's HTTP service (module docstring)."""

    def __init__(
        self,
        service: BrokerService,
        policies: PolicyStore,
        *,
        urls: Callable[[], dict[str, str]],
    ) -> None:
        """``urls`` returns the lookup answer's URLs (``brokerUrl``, ``httpUrl``, ...) once the
        listeners are bound; it is asked on every lookup."""
        self.service = service
        self.policies = policies
        self.urls = urls
        self.router = Router()
        self.schemas = SchemaRegistry(service.metadata_store, service.reactor.seconds)
        self._register()

    # -- twisted.web glue -----------------------------------------------------------------

    def site(self) -> Site:
        """The HTTP factory to bind."""
        site = Site(_Root(self))
        site.displayTracebacks = False
        return site

    def handle(self, request: Request) -> Deferred[Response]:
        """Route a request; fire with its response (never fails)."""
        return Deferred.fromCoroutine(self._handle(request))

    async def _handle(self, request: Request) -> Response:
        method = request.method.decode("ascii", "replace")
        path = request.path.decode("utf-8", "replace")
        try:
            length = int(request.getHeader("content-length") or 0)
        except ValueError:
            length = 0
        if length > MAX_BODY_BYTES:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        body = request.content.read(MAX_BODY_BYTES + 1) if request.content is not None else b""
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        found = self.router.find(method, path)
        if isinstance(found, int):
            return _error(found, "Method Not Allowed" if found == 405 else "Not Found")
        handler, params = found
        raw_query = request.uri.partition(b"?")[2].decode("utf-8", "replace")
        query = parse_qs(raw_query, keep_blank_values=True)
        call = Call(method, path, params, query, body, raw_query)
        try:
            return await handler(call)
        except AdminError as e:
            return _error(e.status, e.reason)
        except NotOwnerError as e:
            if e.owner is None or not e.owner.web_url:
                return _error(503, str(e))
            # As Pulsar does: the owner of the topic's bundle answers (307 keeps the method).
            target = e.owner.web_url.rstrip("/") + request.uri.decode("utf-8", "replace")
            return Response(307, json.dumps({"reason": str(e)}).encode(), location=target)
        except BrokerError as e:
            for kind, status in _STATUS_OF:
                if isinstance(e, kind):
                    return _error(status, str(e))
            return _error(500, str(e))
        except Exception as e:
            log.error(
                "admin request failed",
                exc_info=True,
                extra=kv(method=method, path=path, error=str(e)),
            )
            return _error(500, f"{type(e).__name__}: {e}")

    # -- routes ---------------------------------------------------------------------------

    def _register(self) -> None:
        r = self.router.add
        dom = "{domain:persistent|non-persistent}"
        topic = f"/admin/v2/{dom}/{{tenant}}/{{ns}}/{{topic}}"
        r("GET", "/admin/v2/brokers/health", self._health)
        r("GET", "/admin/v2/brokers/ready", self._ready)
        r("GET", "/admin/v2/brokers/leaderBroker", self._leader_broker)
        r("GET", "/admin/v2/brokers/configuration", self._dynamic_config_names)
        r("GET", "/admin/v2/brokers/configuration/values", self._dynamic_config_values)
        r("GET", "/admin/v2/brokers/configuration/runtime", self._runtime_config)
        r("POST", "/admin/v2/brokers/configuration/{name}/{value}", self._update_config)
        r("GET", "/admin/v2/brokers/internal-configuration", self._internal_config)
        r("GET", "/admin/v2/brokers/{cluster}", self._brokers)
        r("GET", "/metrics", self._metrics)
        r("GET", f"/lookup/v2/topic/{dom}/{{tenant}}/{{ns}}/{{topic}}", self._lookup)
        r("GET", f"/lookup/v2/topic/{dom}/{{tenant}}/{{ns}}/{{topic}}/bundle", self._bundle)
        # bundles (cluster mode moves them between brokers)
        bundle = "/admin/v2/namespaces/{tenant}/{ns}/{bundle:0x[0-9a-fA-F]+_0x[0-9a-fA-F]+}"
        r("GET", "/admin/v2/namespaces/{tenant}/{ns}/bundles", self._bundles)
        r("PUT", "/admin/v2/namespaces/{tenant}/{ns}/unload", self._unload_namespace)
        r("PUT", f"{bundle}/unload", self._unload_bundle)
        r("PUT", f"{bundle}/split", self._split_bundle)
        r("GET", "/admin/v2/namespaces/{tenant}/{ns}/owners", self._bundle_owners)
        r("POST", "/admin/v2/namespaces/{tenant}/{ns}/clearBacklog", self._clear_backlog)
        r("POST", "/admin/v2/namespaces/{tenant}/{ns}/clearBacklog/{sub}", self._clear_backlog)
        r("POST", "/admin/v2/namespaces/{tenant}/{ns}/unsubscribe/{sub}", self._unsubscribe_ns)
        # clusters
        r("GET", "/admin/v2/clusters", self._clusters)
        r("GET", "/admin/v2/clusters/{cluster}", self._get_cluster)
        r("PUT", "/admin/v2/clusters/{cluster}", self._create_cluster)
        r("POST", "/admin/v2/clusters/{cluster}", self._update_cluster)
        r("DELETE", "/admin/v2/clusters/{cluster}", self._delete_cluster)
        # tenants
        r("GET", "/admin/v2/tenants", self._tenants)
        r("GET", "/admin/v2/tenants/{tenant}", self._get_tenant)
        r("PUT", "/admin/v2/tenants/{tenant}", self._create_tenant)
        r("POST", "/admin/v2/tenants/{tenant}", self._update_tenant)
        r("DELETE", "/admin/v2/tenants/{tenant}", self._delete_tenant)
        # namespaces
        r("GET", "/admin/v2/namespaces/{tenant}", self._namespaces)
        r("GET", "/admin/v2/namespaces/{tenant}/{ns}", self._get_namespace)
        r("PUT", "/admin/v2/namespaces/{tenant}/{ns}", self._create_namespace)
        r("DELETE", "/admin/v2/namespaces/{tenant}/{ns}", self._delete_namespace)
        r("GET", "/admin/v2/namespaces/{tenant}/{ns}/topics", self._namespace_topics)
        fields = "|".join(NAMESPACE_POLICY_FIELDS)
        policy = f"/admin/v2/namespaces/{{tenant}}/{{ns}}/{{field:{fields}}}"
        r("GET", policy, self._get_policy)
        r("POST", policy, self._set_policy)
        r("PUT", policy, self._set_policy)
        r("DELETE", policy, self._remove_policy)
        quota = "/admin/v2/namespaces/{tenant}/{ns}/backlogQuota"
        r("GET", quota + "Map", self._backlog_quotas)
        r("POST", quota, self._set_backlog_quota)
        r("DELETE", quota, self._remove_backlog_quota)
        # topics
        r("GET", f"/admin/v2/{dom}/{{tenant}}/{{ns}}", self._list_topics)
        r("GET", f"/admin/v2/{dom}/{{tenant}}/{{ns}}/partitioned", self._list_partitioned)
        r("PUT", topic, self._create_topic)
        r("DELETE", topic, self._delete_topic)
        r("GET", f"{topic}/partitions", self._get_partitions)
        r("PUT", f"{topic}/partitions", self._create_partitioned)
        r("POST", f"{topic}/partitions", self._update_partitions)
        r("DELETE", f"{topic}/partitions", self._delete_partitioned)
        r("GET", f"{topic}/stats", self._stats)
        r("GET", f"{topic}/partitioned-stats", self._partitioned_stats)
        r("GET", f"{topic}/internalStats", self._internal_stats)
        r("GET", f"{topic}/partitioned-internalStats", self._partitioned_internal_stats)
        r("GET", f"{topic}/lastMessageId", self._last_message_id)
        r("POST", f"{topic}/terminate", self._terminate)
        r("PUT", f"{topic}/unload", self._unload)
        r("GET", f"{topic}/subscriptions", self._subscriptions)
        r("PUT", f"{topic}/subscription/{{sub}}", self._create_subscription)
        r("DELETE", f"{topic}/subscription/{{sub}}", self._delete_subscription)
        r("POST", f"{topic}/subscription/{{sub}}/skip_all", self._skip_all)
        r("POST", f"{topic}/subscription/{{sub}}/skip/{{count:\\d+}}", self._skip)
        r("POST", f"{topic}/subscription/{{sub}}/resetcursor/{{time:\\d+}}", self._reset_time)
        r("POST", f"{topic}/subscription/{{sub}}/resetcursor", self._reset_position)
        r("GET", f"{topic}/subscription/{{sub}}/position/{{n:\\d+}}", self._peek)
        r("POST", f"{topic}/subscription/{{sub}}/expireMessages/{{age:\\d+}}", self._expire)
        r("POST", f"{topic}/all_subscription/expireMessages/{{age:\\d+}}", self._expire_all)
        r("GET", f"{topic}/ledger/{{ledger:\\d+}}/entry/{{entry:\\d+}}", self._message_by_id)
        r("GET", f"{topic}/messageid/{{time:\\d+}}", self._message_id_by_time)
        tfields = "|".join(TOPIC_POLICY_FIELDS)
        r("GET", f"{topic}/{{tfield:{tfields}}}", self._get_topic_policy)
        r("POST", f"{topic}/{{tfield:{tfields}}}", self._set_topic_policy)
        r("DELETE", f"{topic}/{{tfield:{tfields}}}", self._remove_topic_policy)
        r("GET", f"{topic}/backlogQuotaMap", self._topic_backlog_quotas)
        r("POST", f"{topic}/backlogQuota", self._set_topic_backlog_quota)
        r("DELETE", f"{topic}/backlogQuota", self._remove_topic_backlog_quota)
        # schemas
        schema = "/admin/v2/schemas/{tenant}/{ns}/{topic}/schema"
        r("GET", schema, self._get_schema)
        r("POST", schema, self._post_schema)
        r("DELETE", schema, self._delete_schema)
        r("GET", schema + "/{version:\\d+}", self._get_schema)
        r("GET", "/admin/v2/schemas/{tenant}/{ns}/{topic}/schemas", self._get_schemas)

    # -- broker ---------------------------------------------------------------------------

    async def _health(self, call: Call) -> Response:
        """As Pulsar's: ok only while the broker could store a message; 503 saying why."""
        problem = await self.service.storage_problem()
        if problem is not None:
            return _error(503, problem)
        return Response.text("ok")

    async def _ready(self, call: Call) -> Response:
        """Up and serving (storage may still refuse writes: see ``_health``)."""
        return Response.text("ok")

    async def _brokers(self, call: Call) -> Response:
        if call.params["cluster"] != self.policies.cluster:
            raise not_found("Cluster does not exist")
        ownership = self.service.ownership
        if ownership is not None and ownership.clustered:
            return Response.json([b.broker_id for b in await ownership.brokers()])
        http = self.urls().get("httpUrl", "")
        return Response.json([http.removeprefix("http://")] if http else [])

    async def _leader_broker(self, call: Call) -> Response:
        """The broker that leads the load manager (in a standalone, itself)."""
        ownership = self.service.ownership
        if ownership is not None and ownership.clustered:
            leader = await ownership.leader()
            if leader is None:
                raise not_found("No leader broker is elected now")
            return Response.json({"brokerId": leader.broker_id, "serviceUrl": leader.web_url})
        http = self.urls().get("httpUrl", "")
        return Response.json({"brokerId": http.removeprefix("http://"), "serviceUrl": http})

    async def _dynamic_config_names(self, call: Call) -> Response:
        """No setting changes while the broker runs (restart with a new value instead)."""
        return Response.json([])

    async def _dynamic_config_values(self, call: Call) -> Response:
        return Response.json({})

    async def _update_config(self, call: Call) -> Response:
        raise precondition(f"{call.params['name']} is not a dynamic configuration")

    async def _runtime_config(self, call: Call) -> Response:
        """Every setting in force, as strings (Pulsar's ``get-runtime-config``)."""
        config = self.service.config
        values = config.as_dict() if config is not None else {}
        return Response.json({k: _config_text(v) for k, v in sorted(values.items())})

    async def _internal_config(self, call: Call) -> Response:
        config = self.service.config
        store = str(config["metadataStoreUrl"]) if config is not None else ""
        return Response.json(
            {
                "metadataStoreUrl": store,
                "configurationMetadataStoreUrl": store,
                "bookkeeperMetadataServiceUri": store,
                "stateStorageServiceUrl": None,
            }
        )

    async def _metrics(self, call: Call) -> Response:
        text = render_metrics(self.service, self.policies.cluster)
        return Response.text(text, "text/plain; version=0.0.4; charset=utf-8")

    async def _lookup(self, call: Call) -> Response:
        ref = self._topic(call)
        await self._require_namespace(ref.namespace_name)
        ownership = self.service.ownership
        if ownership is not None and ownership.clustered:
            owner = await ownership.lookup(ref.full, authoritative=call.flag("authoritative"))
            if owner.broker_id != ownership.local.broker_id:
                http = owner.web_url
                return Response.json(
                    {
                        "brokerUrl": owner.pulsar_url,
                        "brokerUrlTls": "",
                        "httpUrl": http,
                        "httpUrlTls": "",
                        "nativeUrl": owner.pulsar_url,
                    }
                )
        urls = self.urls()
        answer = {
            "brokerUrl": urls.get("brokerUrl", ""),
            "brokerUrlTls": urls.get("brokerUrlTls", ""),
            "httpUrl": urls.get("httpUrl", ""),
            "httpUrlTls": urls.get("httpUrlTls", ""),
            "nativeUrl": urls.get("brokerUrl", ""),
        }
        return Response.json(answer)

    async def _bundle(self, call: Call) -> Response:
        ref = self._topic(call)
        await self._require_namespace(ref.namespace_name)
        policies = await self.policies.get_policies(ref.namespace_name)
        return Response.text(bundle_of(ref.full, _boundaries(policies)))

    def _cluster_ownership(self) -> ClusterOwnership:
        ownership = self.service.ownership
        if not isinstance(ownership, ClusterOwnership):
            raise AdminError(412, "bundles move between brokers in cluster mode only")
        return ownership

    async def _bundles(self, call: Call) -> Response:
        namespace = f"{call.params['tenant']}/{call.params['ns']}"
        boundaries = _boundaries(await self.policies.get_policies(namespace))
        return Response.json({"boundaries": boundaries, "numBundles": len(boundaries) - 1})

    async def _bundle_owners(self, call: Call) -> Response:
        namespace = f"{call.params['tenant']}/{call.params['ns']}"
        await self.policies.get_policies(namespace)
        owners = await self._cluster_ownership().bundle_owners(namespace)
        return Response.json({b: (o.broker_id if o else None) for b, o in owners.items()})

    async def _unload_namespace(self, call: Call) -> Response:
        namespace = f"{call.params['tenant']}/{call.params['ns']}"
        policies = await self.policies.get_policies(namespace)
        if isinstance(self.service.ownership, ClusterOwnership):
            for bundle in bundle_names(_boundaries(policies)):
                await self._at_owner(namespace, bundle, "unload", call, None)
        else:
            for name in list(self.service.topics):
                if self.service.topic_ref(name).namespace_name == namespace:
                    await self.service.unload_topic(name)
        return Response()

    async def _unload_bundle(self, call: Call) -> Response:
        namespace = f"{call.params['tenant']}/{call.params['ns']}"
        bundle = call.params["bundle"].lower()
        if bundle not in bundle_names(_boundaries(await self.policies.get_policies(namespace))):
            raise not_found(f"bundle {bundle} does not exist in {namespace}")
        destination = (call.query.get("destinationBroker") or [""])[-1] or None
        await self._at_owner(namespace, bundle, "unload", call, destination)
        return Response()

    async def _split_bundle(self, call: Call) -> Response:
        namespace = f"{call.params['tenant']}/{call.params['ns']}"
        await self.policies.get_policies(namespace)
        await self._at_owner(namespace, call.params["bundle"].lower(), "split", call, None)
        return Response()

    async def _at_owner(
        self, namespace: str, bundle: str, action: str, call: Call, destination: str | None
    ) -> None:
        """Unload or split a bundle on the broker that serves it, as Pulsar redirects these
        calls to the owner: the answer comes once the owner has let the bundle go, so no client
        is served by the old owner after it. A call already forwarded, an unowned bundle or an
        owner that does not answer (its claim not yet expired) is done here: the claim's node
        is deleted and the old owner gives the bundle up when it sees that."""
        ownership = self._cluster_ownership()
        owner = await ownership.bundle_owner(namespace, bundle)
        remote = owner is not None and owner.broker_id != ownership.local.broker_id
        if remote and owner is not None and owner.web_url and not call.flag("forwarded"):
            url = f"{owner.web_url.rstrip('/')}/admin/v2/namespaces/{namespace}/{bundle}/{action}"
            url += "?forwarded=true"
            if destination:
                url += "&destinationBroker=" + quote(destination, safe="")
            try:
                await self._remote_call(b"PUT", url, timeout=FORWARD_TIMEOUT_S)
                return
            except (AdminError, TopicNotFoundError):
                raise
            except Exception as e:
                log.warning(
                    "bundle owner did not answer; releasing its claim here",
                    extra=kv(bundle=f"{namespace}/{bundle}", owner=owner.broker_id, error=str(e)),
                )
        try:
            if action == "split":
                await ownership.split(namespace, bundle)
            else:
                await ownership.unload(namespace, bundle, destination)
        except ValueError as e:
            raise AdminError(412, str(e)) from None

    # -- clusters, tenants, namespaces ----------------------------------------------------

    async def _clusters(self, call: Call) -> Response:
        return Response.json(await self.policies.clusters())

    async def _get_cluster(self, call: Call) -> Response:
        return Response.json(await self.policies.get_cluster(call.params["cluster"]))

    async def _create_cluster(self, call: Call) -> Response:
        await self.policies.create_cluster(call.params["cluster"], _dict_body(call))
        return Response()

    async def _update_cluster(self, call: Call) -> Response:
        await self.policies.update_cluster(call.params["cluster"], _dict_body(call))
        return Response()

    async def _delete_cluster(self, call: Call) -> Response:
        await self.policies.delete_cluster(call.params["cluster"])
        return Response()

    async def _tenants(self, call: Call) -> Response:
        return Response.json(await self.policies.tenants())

    async def _get_tenant(self, call: Call) -> Response:
        return Response.json(await self.policies.get_tenant(call.params["tenant"]))

    async def _create_tenant(self, call: Call) -> Response:
        await self.policies.create_tenant(call.params["tenant"], _dict_body(call))
        return Response()

    async def _update_tenant(self, call: Call) -> Response:
        await self.policies.update_tenant(call.params["tenant"], _dict_body(call))
        return Response()

    async def _delete_tenant(self, call: Call) -> Response:
        await self.policies.delete_tenant(call.params["tenant"])
        return Response()

    async def _namespaces(self, call: Call) -> Response:
        return Response.json(await self.policies.namespaces(call.params["tenant"]))

    @staticmethod
    def _namespace(call: Call) -> str:
        return f"{call.params['tenant']}/{call.params['ns']}"

    async def _require_namespace(self, namespace: str) -> None:
        if not await self.policies.namespace_exists(namespace):
            raise not_found("Namespace does not exist")

    async def _get_namespace(self, call: Call) -> Response:
        return Response.json(await self.policies.get_policies(self._namespace(call)))

    async def _create_namespace(self, call: Call) -> Response:
        await self.policies.create_namespace(self._namespace(call), _dict_body(call))
        return Response()

    async def _delete_namespace(self, call: Call) -> Response:
        namespace = self._namespace(call)
        await self.policies.get_policies(namespace)
        topics = await self.service.topics_of_namespace(namespace, TopicListMode.ALL)
        partitioned = await self._partitioned_names(namespace, "persistent")
        partitioned += await self._partitioned_names(namespace, "non-persistent")
        if (topics or partitioned) and not call.flag("force"):
            raise AdminError(409, "Cannot delete non empty namespace")
        for name in partitioned:
            await self.service.delete_partitioned_topic(
                name, force=True, delete_partition=self._delete_anywhere
            )
        for name in topics:
            with contextlib.suppress(TopicNotFoundError):
                await self._delete_anywhere(name, True)
        await self.policies.delete_namespace(namespace)
        return Response()

    async def _clear_backlog(self, call: Call) -> Response:
        """Skip the whole backlog of one subscription (or of all) on every topic of the
        namespace that a broker has loaded, as Pulsar's clear-backlog does per bundle."""
        name = call.params.get("sub")

        async def clear(topic: Any) -> None:
            for sub_name, sub in list(topic.subscriptions.items()):
                if (name is None or sub_name == name) and hasattr(sub, "cursor"):
                    await sub.seek(InitialPosition.LATEST)

        await self._on_loaded_topics(call, clear)
        return Response()

    async def _unsubscribe_ns(self, call: Call) -> Response:
        """Delete a subscription from every topic of the namespace a broker has loaded; a
        subscription with consumers is refused (412)."""
        name = call.params["sub"]

        async def unsubscribe(topic: Any) -> None:
            sub = topic.subscriptions.get(name)
            if sub is not None:
                await sub.delete(False)

        await self._on_loaded_topics(call, unsubscribe)
        return Response()

    async def _on_loaded_topics(self, call: Call, act: Callable[[Any], Awaitable[Any]]) -> None:
        """``act(topic)`` on each topic of the namespace loaded here, then (unless this call
        was forwarded) the same call at every other live broker of the cluster, for theirs. A
        broker that refuses the connection is skipped: it died (and is listed until its
        session expires), so it has no topic loaded."""
        namespace = self._namespace(call)
        await self._require_namespace(namespace)
        for full, topic in list(self.service.topics.items()):
            ref = self.service.topic_ref(full)
            if f"{ref.tenant}/{ref.namespace}" == namespace:
                await act(topic)
        ownership = self.service.ownership
        if ownership is None or not ownership.clustered or call.flag("forwarded"):
            return
        for broker in await ownership.brokers():
            if broker.broker_id != ownership.local.broker_id and broker.web_url:
                url = f"{broker.web_url.rstrip('/')}{call.path}?forwarded=true"
                try:
                    await self._remote_call(b"POST", url, timeout=FORWARD_TIMEOUT_S)
                except ConnectionRefused:
                    log.warning("broker gone: not asked", extra=kv(broker=broker.broker_id))

    async def _namespace_topics(self, call: Call) -> Response:
        namespace = self._namespace(call)
        await self._require_namespace(namespace)
        raw = (call.query.get("mode") or ["PERSISTENT"])[-1].upper()
        try:
            mode = TopicListMode(raw)
        except ValueError:
            raise precondition(f"invalid mode {raw!r}") from None
        return Response.json(await self.service.topics_of_namespace(namespace, mode))

    async def _get_policy(self, call: Call) -> Response:
        policies = await self.policies.get_policies(self._namespace(call))
        value = policies.get(NAMESPACE_POLICY_FIELDS[call.params["field"]])
        if value is None:
            # Pulsar answers 204 with no body for a policy that was never set.
            return Response()
        return Response.json(value)

    async def _set_policy(self, call: Call) -> Response:
        field_name = call.params["field"]
        value = call.json_body()
        _check_policy(field_name, value)
        namespace = self._namespace(call)
        await self.policies.update_policies(namespace, {NAMESPACE_POLICY_FIELDS[field_name]: value})
        await self._policy_changed(field_name, namespace)
        return Response()

    async def _remove_policy(self, call: Call) -> Response:
        namespace = self._namespace(call)
        key = NAMESPACE_POLICY_FIELDS[call.params["field"]]
        await self.policies.update_policies(namespace, {key: None})
        await self._policy_changed(call.params["field"], namespace)
        return Response()

    async def _policy_changed(self, field_name: str, scope: str) -> None:
        """Apply a changed policy to the loaded topics of ``scope`` (a namespace, or a
        topic's full name): those settings a topic takes when it opens."""
        if field_name == "deduplication":
            namespace = self.service.topic_ref(scope).namespace_name if "://" in scope else scope
            await self._apply_deduplication(namespace)
        if field_name == "retention":
            self.service.apply_retention(scope)

    # -- topic-level policies (Pulsar's topic policies) -------------------------------------

    async def _policy_topic(self, call: Call) -> TopicRef:
        """The topic ``call`` names, as its policies are kept (a partition's are its
        partitioned topic's); 404 when it does not exist."""
        ref = self._topic(call)
        if not ref.persistent:
            raise precondition("topic policies are for persistent topics")
        if not await self._partitions_of(ref) and not (
            ref.full in self.service.topics
            or await self.service.ledger_factory.exists(ref.managed_ledger_name)
        ):
            raise not_found("Topic not found")
        return ref

    async def _get_topic_policy(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        field_name = TOPIC_POLICY_FIELDS[call.params["tfield"]]
        own = await self.policies.topic_policies(ref.full)
        value = own.get(NAMESPACE_POLICY_FIELDS[field_name])
        return Response() if value is None else Response.json(value)

    async def _set_topic_policy(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        field_name = TOPIC_POLICY_FIELDS[call.params["tfield"]]
        value = call.json_body()
        raw = (call.query.get(call.params["tfield"]) or [None])[-1]
        if value is None and raw is not None:  # as pulsar-admin sends it: ?messageTTL=N
            value = int(raw) if raw.lstrip("-").isdigit() else raw
        _check_policy(field_name, value)
        changes = {NAMESPACE_POLICY_FIELDS[field_name]: value}
        await self.policies.update_topic_policies(ref.full, changes)
        await self._policy_changed(field_name, ref.full)
        return Response()

    async def _remove_topic_policy(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        field_name = TOPIC_POLICY_FIELDS[call.params["tfield"]]
        await self.policies.update_topic_policies(
            ref.full, {NAMESPACE_POLICY_FIELDS[field_name]: None}
        )
        await self._policy_changed(field_name, ref.full)
        return Response()

    async def _topic_backlog_quotas(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        own = await self.policies.topic_policies(ref.full)
        return Response.json(own.get("backlog_quota_map") or {})

    async def _set_topic_backlog_quota(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        kind, quota = self._quota_of_call(call)
        own = await self.policies.topic_policies(ref.full)
        retention = own.get("retention_policies") or (
            await self.policies.get_policies(ref.namespace_name)
        ).get("retention_policies")
        _check_quota_against(quota, retention or {})
        quotas = {**(own.get("backlog_quota_map") or {}), kind: quota}
        await self.policies.update_topic_policies(ref.full, {"backlog_quota_map": quotas})
        return Response()

    async def _remove_topic_backlog_quota(self, call: Call) -> Response:
        ref = await self._policy_topic(call)
        kind = self._quota_type(call)
        own = await self.policies.topic_policies(ref.full)
        quotas = dict(own.get("backlog_quota_map") or {})
        quotas.pop(kind, None)
        await self.policies.update_topic_policies(ref.full, {"backlog_quota_map": quotas or None})
        return Response()

    async def _backlog_quotas(self, call: Call) -> Response:
        policies = await self.policies.get_policies(self._namespace(call))
        return Response.json(policies.get("backlog_quota_map") or {})

    @staticmethod
    def _quota_type(call: Call) -> str:
        kind = (call.query.get("backlogQuotaType") or [SIZE])[-1]
        if kind not in QUOTA_TYPES:
            raise precondition(f"backlogQuotaType: expected {' or '.join(QUOTA_TYPES)}")
        return kind

    def _quota_of_call(self, call: Call) -> tuple[str, dict[str, Any]]:
        """The quota type and the BacklogQuota JSON a set-backlog-quota call gives."""
        kind = self._quota_type(call)
        body = call.json_body()
        if isinstance(body, dict) and "limitSize" not in body and "limit" in body:
            body = {**body, "limitSize": body["limit"]}  # the field's older name
        if not valid_quota(body):
            raise precondition(
                "backlog quota: expected {limitSize: bytes, limitTime: seconds, policy: "
                + " | ".join(POLICIES)
                + "}"
            )
        quota = {k: body.get(k, -1) for k in ("limitSize", "limitTime")}
        quota["policy"] = body["policy"]
        return kind, quota

    async def _set_backlog_quota(self, call: Call) -> Response:
        """Pulsar's set-backlog-quota: a limit no larger than the namespace's retention."""
        namespace = self._namespace(call)
        kind, quota = self._quota_of_call(call)
        policies = await self.policies.get_policies(namespace)
        _check_quota_against(quota, policies.get("retention_policies") or {})
        quotas = dict(policies.get("backlog_quota_map") or {})
        quotas[kind] = quota
        await self.policies.update_policies(namespace, {"backlog_quota_map": quotas})
        return Response()

    async def _remove_backlog_quota(self, call: Call) -> Response:
        namespace = self._namespace(call)
        kind = self._quota_type(call)
        policies = await self.policies.get_policies(namespace)
        quotas = dict(policies.get("backlog_quota_map") or {})
        quotas.pop(kind, None)
        await self.policies.update_policies(namespace, {"backlog_quota_map": quotas or None})
        return Response()

    async def _apply_deduplication(self, namespace: str) -> None:
        """Switch the loaded topics of ``namespace`` to its (new) deduplication setting."""
        prefix = f"persistent://{namespace}/"
        for name, topic in list(self.service.topics.items()):
            setter = getattr(topic, "set_deduplication", None)
            if not name.startswith(prefix) or setter is None:
                continue
            chosen = self.policies.deduplication_of(name)
            if chosen is None:
                chosen = bool(
                    self.service.config and self.service.config["brokerDeduplicationEnabled"]
                )
            await setter(chosen)

    # -- topics ---------------------------------------------------------------------------

    def _topic(self, call: Call) -> TopicRef:
        p = call.params
        try:
            return TopicRef.parse(f"{p['domain']}://{p['tenant']}/{p['ns']}/{p['topic']}")
        except InvalidTopicNameError as e:
            raise precondition(str(e)) from None

    async def _partitioned_names(self, namespace: str, domain: str) -> list[str]:
        root = f"{PARTITIONED_ROOT}/{namespace}/{domain}"
        return [
            f"{domain}://{namespace}/{unquote(child)}"
            for child in await self.service.metadata_store.children(root)
        ]

    async def _partitions_of(self, ref: TopicRef) -> int:
        return await self.service.partitioned_topic_metadata(ref.full)

    async def _targets(self, ref: TopicRef) -> list[str]:
        """The topics an operation on ``ref`` touches: its partitions, or itself."""
        partitions = await self._partitions_of(ref)
        if partitions:
            return [ref.partition(i).full for i in range(partitions)]
        return [ref.full]

    async def _list_topics(self, call: Call) -> Response:
        namespace = self._namespace(call)
        await self._require_namespace(namespace)
        mode = (
            TopicListMode.PERSISTENT
            if call.params["domain"] == "persistent"
            else TopicListMode.NON_PERSISTENT
        )
        return Response.json(await self.service.topics_of_namespace(namespace, mode))

    async def _list_partitioned(self, call: Call) -> Response:
        namespace = self._namespace(call)
        await self._require_namespace(namespace)
        return Response.json(
            sorted(await self._partitioned_names(namespace, call.params["domain"]))
        )

    async def _create_topic(self, call: Call) -> Response:
        ref = self._topic(call)
        await self._require_namespace(ref.namespace_name)
        if await self._partitions_of(ref):
            raise AdminError(409, "This topic already exists (as a partitioned topic)")
        if ref.full in self.service.topics or (
            ref.persistent and await self.service.ledger_factory.exists(ref.managed_ledger_name)
        ):
            raise AdminError(409, "This topic already exists")
        await self.service.get_topic(ref.full, create=True)
        return Response()

    async def _delete_topic(self, call: Call) -> Response:
        ref = self._topic(call)
        if await self._partitions_of(ref):
            raise precondition(f"{ref.full} is a partitioned topic: delete .../partitions")
        await self.service.delete_topic(ref.full, force=call.flag("force"))
        if ref.partition_index < 0:  # a partition's policies are its partitioned topic's
            await self.policies.forget_topic(ref.full)
        return Response()

    async def _get_partitions(self, call: Call) -> Response:
        ref = self._topic(call)
        create = call.flag("checkAllowAutoCreation")
        if create:
            await self._require_namespace(ref.namespace_name)
        n = await self.service.partitioned_topic_metadata(ref.full, create=create)
        return Response.json({"partitions": n})

    async def _create_partitioned(self, call: Call) -> Response:
        ref = self._topic(call)
        partitions = _int_body(call)
        await self._require_namespace(ref.namespace_name)
        await self.service.create_partitioned_topic(ref.full, partitions)
        return Response()

    async def _update_partitions(self, call: Call) -> Response:
        ref = self._topic(call)
        await self.service.update_partitioned_topic(ref.full, _int_body(call))
        return Response()

    async def _delete_partitioned(self, call: Call) -> Response:
        ref = self._topic(call)
        await self.service.delete_partitioned_topic(
            ref.full, force=call.flag("force"), delete_partition=self._delete_anywhere
        )
        await self.policies.forget_topic(ref.full)
        return Response()

    async def _delete_anywhere(self, name: str, force: bool) -> None:
        """Delete a (non-partitioned) topic here, or at the broker of the cluster that serves
        it (a namespace's or a partitioned topic's deletion reaches every owner so)."""
        try:
            await self.service.delete_topic(name, force)
        except NotOwnerError as e:
            if e.owner is None:
                raise
            part = self.service.topic_ref(name)
            url = (
                f"{e.owner.web_url}/admin/v2/{part.domain}/{part.tenant}/{part.namespace}/"
                f"{quote(part.local, safe='')}" + ("?force=true" if force else "")
            )
            await self._remote_call(b"DELETE", url)

    async def _stats(self, call: Call) -> Response:
        ref = self._topic(call)
        return Response.json(await self.service.stats(ref.full))

    async def _partitioned_stats(self, call: Call) -> Response:
        ref = self._topic(call)
        partitions = await self._partitions_of(ref)
        if not partitions:
            raise not_found(f"partitioned topic {ref.full} does not exist")
        parts: dict[str, dict[str, Any]] = {}
        for i in range(partitions):
            name = ref.partition(i).full
            try:
                parts[name] = await self._partition_stats(name)
            except NotOwnerError as e:
                if e.owner is None:
                    raise
                # Served by another broker of the cluster: ask it.
                path = f"/admin/v2/{ref.domain}/{ref.tenant}/{ref.namespace}/"
                parts[name] = await self._remote_json(
                    e.owner.web_url + path + quote(ref.partition(i).local, safe="") + "/stats"
                )
        out = _sum_stats(parts)
        out["metadata"] = {"partitions": partitions}
        if call.flag("perPartition", True):
            out["partitions"] = parts
        return Response.json(out)

    async def _partitioned_internal_stats(self, call: Call) -> Response:
        """Pulsar's partitioned-internalStats: each partition's internalStats, by name."""
        ref = self._topic(call)
        partitions = await self._partitions_of(ref)
        if not partitions:
            raise not_found(f"partitioned topic {ref.full} does not exist")
        parts: dict[str, Any] = {}
        for i in range(partitions):
            part = ref.partition(i)
            try:
                await self.service.get_topic(part.full, create=True)  # declared: it exists
                parts[part.full] = await self.service.internal_stats(part.full)
            except NotOwnerError as e:
                if e.owner is None:
                    raise
                path = f"/admin/v2/{ref.domain}/{ref.tenant}/{ref.namespace}/"
                parts[part.full] = await self._remote_json(
                    e.owner.web_url + path + quote(part.local, safe="") + "/internalStats"
                )
        return Response.json({"metadata": {"partitions": partitions}, "partitions": parts})

    async def _partition_stats(self, name: str) -> dict[str, Any]:
        try:
            return await self.service.stats(name)
        except TopicNotFoundError:
            # A partition nobody used yet: it exists by declaration, as in Pulsar.
            await self.service.get_topic(name, create=True)
            return await self.service.stats(name)

    async def _remote_json(self, url: str) -> Any:
        return json.loads(await self._remote_call(b"GET", url))

    async def _remote_call(
        self, method: bytes, url: str, timeout: float | None = None, body: bytes = b""
    ) -> bytes:
        """Ask another broker's admin API (``body``: a JSON document to send); its refusal is
        ours (a missing topic is 404). With ``timeout`` the call fails with a TimeoutError
        after that many seconds."""
        from twisted.web.client import Agent, FileBodyProducer, readBody
        from twisted.web.http_headers import Headers

        async def ask() -> tuple[Any, bytes]:
            headers = Headers({b"content-type": [b"application/json"]}) if body else None
            producer = FileBodyProducer(io.BytesIO(body)) if body else None
            agent = Agent(self.service.reactor)
            response = await agent.request(method, url.encode(), headers, producer)
            return response, await readBody(response)

        d = Deferred.fromCoroutine(ask())
        if timeout is not None:
            d.addTimeout(timeout, self.service.reactor)
        response, body = await d
        if response.code == 404:
            raise TopicNotFoundError(body.decode(errors="replace")[:200])
        if response.code >= 300:
            raise AdminError(response.code, body.decode(errors="replace")[:200])
        return body

    async def _internal_stats(self, call: Call) -> Response:
        ref = self._topic(call)
        stats = await self.service.internal_stats(ref.full)
        # Beyond Pulsar's fields: where each cursor resumes after a crash, so operators (and
        # tests) can tell an acknowledgement in memory from one made durable.
        ledger = getattr(self.service.loaded_topic(ref.full), "ledger", None)
        cursors = stats.get("cursors")
        if ledger is not None and isinstance(cursors, dict):
            for name, cursor in ledger.cursors.items():
                entry = cursors.get(name)
                if isinstance(entry, dict):
                    entry["persistedMarkDeletePosition"] = str(
                        cursor.persisted_mark_delete_position
                    )
        if call.flag("metadata"):
            await self._add_ledger_metadata(stats)
        return Response.json(stats)

    async def _add_ledger_metadata(self, stats: dict[str, Any]) -> None:
        """``internalStats?metadata=true``: each ledger's storage layout, for readers that go to
        the bookies themselves (Spark): ``sealed``, ``lastEntryId``, ``ensembleSize``,
        ``writeQuorumSize``, ``ackQuorumSize`` and ``fragments`` (``firstEntryId``,
        ``bookies``). A ledger whose metadata cannot be read gets ``sealed: false`` only."""
        client = getattr(self.service.ledger_factory, "client", None)
        ledgers = [info for info in stats.get("ledgers", []) if isinstance(info, dict)]
        for info in ledgers:
            info["sealed"] = False
        if client is None:
            return
        # All reads at once: one round trip of the metadata store, not one per ledger.
        metas = await DeferredList(
            [client.get_metadata(int(info["ledgerId"])) for info in ledgers], consumeErrors=True
        )
        for info, (ok, meta) in zip(ledgers, metas, strict=True):
            if not ok:
                log.warning("ledger metadata unreadable", extra=kv(error=str(meta.value)))
                continue
            info.update(
                sealed=meta.state.value == "closed",
                lastEntryId=meta.last_entry_id,
                ensembleSize=meta.ensemble_size,
                writeQuorumSize=meta.write_quorum,
                ackQuorumSize=meta.ack_quorum,
                fragments=[
                    {"firstEntryId": first, "bookies": list(ensemble)}
                    for first, ensemble in meta.fragments
                ],
            )

    async def _last_message_id(self, call: Call) -> Response:
        ref = self._topic(call)
        if ref.partition_index < 0 and await self._partitions_of(ref):
            raise AdminError(405, "Get the last message id of a partitioned topic is not allowed")
        last = await self.service.last_message_id(ref.full)
        out = _position_json(last.position, ref.partition_index)
        if last.num_messages > 1:
            out["batchIndex"] = last.batch_index
        return Response.json(out)

    def _schema_topic(self, call: Call) -> str:
        p = call.params
        return f"persistent://{p['tenant']}/{p['ns']}/{p['topic']}"

    async def _get_schema(self, call: Call) -> Response:
        """A schema version of a topic (the latest unless one is named), as Pulsar's admin API
        shows it."""
        version = int(call.params["version"]) if "version" in call.params else None
        try:
            found = await self.schemas.get(self._schema_topic(call), version)
        except SchemaNotFoundError as e:
            raise not_found(str(e)) from None
        return Response.json(_schema_json(found))

    async def _get_schemas(self, call: Call) -> Response:
        found = await self.schemas.versions(self._schema_topic(call))
        if not found:
            raise not_found(f"topic {self._schema_topic(call)} has no schema")
        return Response.json({"getSchemaResponses": [_schema_json(v) for v in found]})

    async def _post_schema(self, call: Call) -> Response:
        """Register a schema version (``pulsar-admin schemas upload``), checked against the
        topic's versions under its compatibility strategy (409 when it does not fit); an admin
        may add one where producers may not (``isAllowAutoUpdateSchema``)."""
        body = _dict_body(call)
        kind = _SCHEMA_TYPES.get(str(body.get("type", "")).upper())
        definition = body.get("schema", "")
        properties = body.get("properties") or {}
        if kind is None or not isinstance(definition, str) or not isinstance(properties, dict):
            raise precondition(
                "expected {type: " + "|".join(sorted(_SCHEMA_TYPES)) + ", schema, properties}"
            )
        topic = self._schema_topic(call)
        given = StoredSchema(
            -1, kind, "", definition.encode(), {str(k): str(v) for k, v in properties.items()}
        )
        try:
            version = await self.schemas.get_or_create(
                topic, given, self.service.schema_compatibility(topic)
            )
        except IncompatibleSchemaError as e:
            raise AdminError(409, str(e)) from None
        return Response.json({"version": version})

    async def _delete_schema(self, call: Call) -> Response:
        deleted = await self.schemas.delete(self._schema_topic(call))
        if not deleted:
            raise not_found(f"topic {self._schema_topic(call)} has no schema")
        return Response.json({"version": deleted - 1})

    async def _terminate(self, call: Call) -> Response:
        ref = self._topic(call)
        if ref.partition_index < 0 and await self._partitions_of(ref):
            raise AdminError(405, "Termination of a partitioned topic is not allowed")
        position = await self.service.terminate_topic(ref.full)
        return Response.json(_position_json(position, ref.partition_index))

    async def _unload(self, call: Call) -> Response:
        ref = self._topic(call)
        ownership = self.service.ownership
        for name in await self._targets(ref):
            if ownership is not None and ownership.clustered and not ownership.owns(name):
                owner = await self._cluster_ownership().owner(name)
                if owner is None:
                    continue  # nobody serves it: nothing is loaded to unload
                if owner.broker_id != ownership.local.broker_id:
                    part = self.service.topic_ref(name)
                    await self._remote_call(
                        b"PUT",
                        f"{owner.web_url}/admin/v2/{part.domain}/{part.tenant}/"
                        f"{part.namespace}/{quote(part.local, safe='')}/unload",
                    )
                    continue
            await self.service.unload_topic(name)
        return Response()

    async def _per_partition(self, call: Call, here: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        """Run ``here(topic)`` on the topic ``call`` names, or on each of its partitions; return
        what each returned. A partition another broker of the cluster serves gets the same
        request at that broker's admin API under the partition's name, as Pulsar's admin fans
        a partitioned topic out; its JSON answer (None if empty, ``_MISSING`` for a 404)
        stands in the list. (Redirecting the whole call sent it back and forth between the
        owners of different partitions.)"""
        ref = self._topic(call)
        out: list[Any] = []
        for name in await self._targets(ref):
            try:
                # A partition exists once declared (Pulsar creates them with the partitioned
                # topic): one no client has used yet is loaded here, not a 404.
                topic = await self.service.get_topic(name, create=name != ref.full)
            except NotOwnerError as e:
                if name == ref.full or e.owner is None or not e.owner.web_url:
                    raise  # the topic itself: the client is redirected to its owner
                out.append(await self._at_partition_owner(call, name, e.owner.web_url))
                continue
            out.append(await here(topic))
        return out

    async def _at_partition_owner(self, call: Call, partition: str, web_url: str) -> Any:
        """Send ``call`` to the broker at ``web_url`` for ``partition`` instead of the topic."""
        part = self.service.topic_ref(partition)
        rest = call.path.split("/", 7)[7:]  # what follows /admin/v2/domain/tenant/ns/topic
        url = (
            f"{web_url.rstrip('/')}/admin/v2/{part.domain}/{quote(part.tenant, safe='')}/"
            f"{quote(part.namespace, safe='')}/{quote(part.local, safe='')}"
        )
        if rest:
            url += "/" + rest[0]
        if call.raw_query:
            url += "?" + call.raw_query
        try:
            raw = await self._remote_call(call.method.encode(), url, body=call.body)
        except TopicNotFoundError:
            return _MISSING
        return json.loads(raw) if raw.strip() else None

    async def _on_subscription(self, call: Call, act: Callable[[Any], Awaitable[Any]]) -> None:
        """``act(subscription)`` on the named subscription of the topic, or of each partition
        that has it; 404 when none has."""
        sub_name = call.params["sub"]

        async def here(topic: Any) -> Any:
            sub = topic.subscriptions.get(sub_name)
            if sub is None:
                return _MISSING
            await act(sub)
            return None

        if all(r is _MISSING for r in await self._per_partition(call, here)):
            raise not_found("Subscription not found")

    async def _subscriptions(self, call: Call) -> Response:
        async def here(topic: Any) -> list[str]:
            return list(topic.subscriptions)

        parts = await self._per_partition(call, here)
        names = {n for part in parts if isinstance(part, list) for n in part}
        return Response.json(sorted(names))

    async def _create_subscription(self, call: Call) -> Response:
        sub_name = call.params["sub"]
        body = call.json_body()
        start: Position | None = None
        initial = InitialPosition.LATEST
        if isinstance(body, dict) and isinstance(body.get("ledgerId"), int):
            ledger_id, entry_id = body["ledgerId"], int(body.get("entryId", -1))
            if ledger_id < 0:
                initial = InitialPosition.EARLIEST
            elif ledger_id < 2**63 - 1:
                start = Position(ledger_id, entry_id)

        async def here(topic: Any) -> None:
            if sub_name in topic.subscriptions:
                raise AdminError(409, "Subscription already exists for topic")
            # A durable subscription outlives its consumers: attach a placeholder that
            # takes no messages (no permits), then detach it.
            placeholder = _AdminConsumer()
            server = await self.service.subscribe(
                topic.name, sub_name, placeholder, SubType.EXCLUSIVE, initial, create_topic=False
            )
            await server.close()
            if start is not None:
                await topic.subscriptions[sub_name].seek(start)

        await self._per_partition(call, here)
        return Response()

    async def _delete_subscription(self, call: Call) -> Response:
        force = call.flag("force")
        await self._on_subscription(call, lambda sub: sub.delete(force))
        return Response()

    async def _skip_all(self, call: Call) -> Response:
        await self._on_subscription(call, lambda sub: sub.seek(InitialPosition.LATEST))
        return Response()

    async def _skip(self, call: Call) -> Response:
        count = int(call.params["count"])

        async def skip(sub: Any) -> None:
            if not hasattr(sub, "skip"):
                raise precondition("skip needs a persistent topic")
            await sub.skip(count)

        await self._on_subscription(call, skip)
        return Response()

    async def _reset_time(self, call: Call) -> Response:
        timestamp = int(call.params["time"])
        await self._on_subscription(call, lambda sub: sub.seek_time(timestamp))
        return Response()

    async def _reset_position(self, call: Call) -> Response:
        body = call.json_body()
        if not isinstance(body, dict) or not all(
            isinstance(body.get(k), int) for k in ("ledgerId", "entryId")
        ):
            raise precondition("expected a MessageId body {ledgerId, entryId}")
        position = Position(body["ledgerId"], body["entryId"])
        ref = self._topic(call)
        if ref.partition_index < 0 and await self._partitions_of(ref):
            raise precondition("reset by message id needs a partition, not a partitioned topic")
        await self._on_subscription(call, lambda sub: sub.seek(position))
        return Response()

    # -- messages ---------------------------------------------------------------------------

    async def _persistent_topic(self, call: Call, what: str) -> tuple[TopicRef, Any]:
        """The loaded topic ``call`` names, refused as Pulsar does (405) when it is a
        partitioned topic's name or non-persistent."""
        ref = self._topic(call)
        if ref.partition_index < 0 and await self._partitions_of(ref):
            raise AdminError(405, f"{what} on a partitioned topic is not allowed")
        topic = await self.service.get_topic(ref.full, create=False)
        if not hasattr(topic, "entry_at"):
            raise AdminError(405, f"{what} on a non-persistent topic is not allowed")
        return ref, topic

    async def _peek(self, call: Call) -> Response:
        """The n-th unacknowledged message of a subscription (``pulsar-admin topics
        peek-messages``); nothing is acknowledged or delivered."""
        _, topic = await self._persistent_topic(call, "Peek messages")
        sub = topic.subscriptions.get(call.params["sub"])
        if sub is None:
            raise not_found("Subscription not found")
        n = int(call.params["n"])
        if n < 1:
            raise precondition("the message position starts at 1")
        return _message_response(await sub.peek(n))

    async def _message_by_id(self, call: Call) -> Response:
        _, topic = await self._persistent_topic(call, "Get message by id")
        position = Position(int(call.params["ledger"]), int(call.params["entry"]))
        return _message_response(await topic.entry_at(position))

    async def _message_id_by_time(self, call: Call) -> Response:
        """The id of the first message published at or after the time (ms since the epoch)."""
        ref, topic = await self._persistent_topic(call, "Get message ID by timestamp")
        position = await topic.position_of_time(int(call.params["time"]))
        if position is None:
            raise not_found("Message ID not found")
        return Response.json(_position_json(position, ref.partition_index))

    async def _expire(self, call: Call) -> Response:
        """Acknowledge a subscription's messages older than the given seconds (on every
        partition of a partitioned topic)."""
        age = int(call.params["age"])
        await self._on_subscription(call, lambda sub: _expire_sub(sub, age))
        return Response()

    async def _expire_all(self, call: Call) -> Response:
        age = int(call.params["age"])

        async def here(topic: Any) -> None:
            for sub in list(topic.subscriptions.values()):
                await _expire_sub(sub, age)

        await self._per_partition(call, here)
        return Response()


async def _expire_sub(sub: Any, age_s: int) -> None:
    if not hasattr(sub, "expire_before"):
        raise AdminError(405, "Expire messages on a non-persistent topic is not allowed")
    now_ms = int(sub.topic.clock.seconds() * 1000)
    await sub.expire_before(now_ms - age_s * 1000)


def _config_text(value: Any) -> str:
    """A setting as Pulsar's runtime configuration shows it (booleans lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(str(v) for v in value)
    return str(value)


#: Namespace policies that are a flag (true or false).
_FLAG_POLICIES = frozenset({"deduplication", "isAllowAutoUpdateSchema", "schemaValidationEnforced"})

#: A partition that answered 404 (``AdminServer._per_partition``).
_MISSING = object()


def _message_response(entry: Entry | None) -> Response:
    if entry is None:
        raise not_found("Message not found")
    try:
        headers, body = render_message(entry)
    except MessageFormatError as e:
        return _error(500, f"cannot decode the message at {message_id(entry)}: {e}")
    return Response(200, body, "application/octet-stream", headers=headers)


class _AdminConsumer:
    """A consumer with no client behind it, used to create a subscription."""

    consumer_id = 0
    consumer_name = "admin"
    priority_level = 0

    def send_entries(self, deliveries: list[Any]) -> None:
        """Never called: this consumer grants no permits."""

    def active_changed(self, is_active: bool) -> None:
        """Nothing to tell."""

    def reached_end_of_topic(self) -> None:
        """Nothing to tell."""

    def disconnect(self) -> None:
        """Nothing to close."""


def _dict_body(call: Call) -> dict[str, Any]:
    body = call.json_body({})
    if not isinstance(body, dict):
        raise AdminError(400, "expected a JSON object")
    return body


def _error(status: int, reason: str) -> Response:
    return Response.json({"reason": reason}, status)


#: Pulsar's wire ``Schema.Type`` values by the names the admin API shows.
_SCHEMA_TYPE_NAMES = {
    0: "NONE", 1: "STRING", 2: "JSON", 3: "PROTOBUF", 4: "AVRO", 5: "BOOLEAN", 6: "INT8",
    7: "INT16", 8: "INT32", 9: "INT64", 10: "FLOAT", 11: "DOUBLE", 12: "DATE", 13: "TIME",
    14: "TIMESTAMP", 15: "KEY_VALUE", 16: "INSTANT", 17: "LOCAL_DATE", 18: "LOCAL_TIME",
    19: "LOCAL_DATE_TIME", 20: "PROTOBUF_NATIVE",
}  # fmt: skip


#: Schema type names the admin API takes, by their wire numbers.
_SCHEMA_TYPES = {name: number for number, name in _SCHEMA_TYPE_NAMES.items()}


def _schema_json(found: StoredSchema) -> dict[str, Any]:
    return {
        "version": found.version,
        "type": _SCHEMA_TYPE_NAMES.get(found.type, str(found.type)),
        "timestamp": found.timestamp_ms,
        "data": found.data.decode("utf-8", "replace"),
        "properties": dict(found.properties),
    }


class _Root(Resource):
    """Hands every request to the router (one leaf resource, no resource tree)."""

    isLeaf = True

    def __init__(self, server: AdminServer) -> None:
        super().__init__()
        self.server = server

    def render(self, request: Request) -> int:
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        d = self.server.handle(request)

        def send(response: Response) -> None:
            if gone or request.finished:
                # The client went away while the answer was being prepared.
                return
            request.setResponseCode(response.status)
            if response.location:
                request.setHeader(b"location", response.location.encode())
            for name, value in response.headers.items():
                request.setHeader(name.encode(), value.encode())
            if response.body or response.status != 204:
                request.setHeader(b"content-type", response.content_type.encode())
            request.write(response.body)
            request.finish()

        def broken(f: Failure) -> None:
            log.error("admin response failed", extra=kv(error=f.getErrorMessage()))

        d.addCallback(send).addErrback(broken)
        return NOT_DONE_YET
