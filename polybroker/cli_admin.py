"""``polybroker admin ...``: Pulsar's ``pulsar-admin`` over the admin REST API v2.

Resources and verbs are ``pulsar-admin``'s (``tenants``, ``namespaces``, ``topics``, ``clusters``,
``schemas``). Speaks HTTP with the standard library. Contract: lists print one name a line, stats
and ids print indented JSON, verbs that change state print nothing; an HTTP error prints
``error: HTTP <status>: <reason>`` on stderr and exits 1; an unreachable broker exits 1 as well.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import Message
from typing import Any

from polybroker.broker_core.messages import MessageFormatError, decode_batch_payload

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"
_TIMEOUT = 30.0


class AdminCliError(Exception):
    """A request failed; ``str()`` is the message for the user, ``status`` the HTTP status
    the broker answered (None when it did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TopicName:
    """A fully qualified topic: ``domain://tenant/namespace/local``."""

    domain: str
    tenant: str
    namespace: str
    local: str

    @property
    def path(self) -> str:
        """The ``{domain}/{tenant}/{ns}/{topic}`` segment of admin URLs, each part quoted."""
        parts = (self.domain, self.tenant, self.namespace, self.local)
        return "/".join(urllib.parse.quote(p, safe="") for p in parts)

    def __str__(self) -> str:
        return f"{self.domain}://{self.tenant}/{self.namespace}/{self.local}"


def parse_topic(name: str) -> TopicName:
    """Parse ``local``, ``tenant/ns/local`` or ``domain://tenant/ns/local`` as Pulsar does."""
    domain = "persistent"
    rest = name
    if "://" in name:
        domain, rest = name.split("://", 1)
        if domain not in ("persistent", "non-persistent"):
            raise AdminCliError(f"invalid topic domain {domain!r} in {name!r}")
    parts = rest.split("/")
    if len(parts) == 1 and "://" not in name:
        parts = ["public", "default", parts[0]]
    if len(parts) != 3 or not all(parts):
        raise AdminCliError(
            f"invalid topic name {name!r}: expected topic, tenant/namespace/topic "
            "or persistent://tenant/namespace/topic"
        )
    return TopicName(domain, parts[0], parts[1], parts[2])


def parse_namespace(name: str) -> tuple[str, str]:
    """Parse ``tenant/namespace``."""
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise AdminCliError(f"invalid namespace name {name!r}: expected tenant/namespace")
    return parts[0], parts[1]


def parse_message_id(text: str) -> dict[str, int]:
    """Parse ``latest``, ``earliest`` or ``ledgerId:entryId[:partition]`` into a MessageId body."""
    low = text.lower()
    if low == "latest":
        return {"ledgerId": 2**63 - 1, "entryId": 2**63 - 1, "partitionIndex": -1}
    if low == "earliest":
        return {"ledgerId": -1, "entryId": -1, "partitionIndex": -1}
    m = re.fullmatch(r"(-?\d+):(-?\d+)(?::(-?\d+))?", text)
    if not m:
        raise AdminCliError(
            f"invalid message id {text!r}: expected latest, earliest or ledgerId:entryId"
        )
    partition = int(m.group(3)) if m.group(3) is not None else -1
    return {"ledgerId": int(m.group(1)), "entryId": int(m.group(2)), "partitionIndex": partition}


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_relative_time(text: str) -> int:
    """Parse ``30s``, ``10m``, ``3h``, ``2d``, ``1w`` (or bare seconds) into seconds."""
    m = re.fullmatch(r"(\d+)([smhdw]?)", text.strip().lower())
    if not m:
        raise AdminCliError(f"invalid time {text!r}: expected e.g. 30s, 10m, 3h, 2d, 1w")
    return int(m.group(1)) * _UNITS[m.group(2) or "s"]


_SIZES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``512``, ``10k``, ``100M``, ``2G``, ``1T`` (bytes, binary units) into bytes."""
    m = re.fullmatch(r"(\d+)([kmgt]?)", text.strip().lower())
    if not m:
        raise AdminCliError(f"invalid size {text!r}: expected e.g. 512, 10k, 100M, 2G")
    return int(m.group(1)) * _SIZES[m.group(2)]


class AdminClient:
    """A blocking client of the admin REST API."""

    def __init__(self, base_url: str, timeout: float = _TIMEOUT) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON (or text, or None); raise AdminCliError."""
        headers, raw = self.exchange(method, path, body)
        if not raw:
            return None
        if "json" in headers.get("Content-Type", ""):
            return json.loads(raw)
        return raw.decode(errors="replace")

    def exchange(self, method: str, path: str, body: Any = None) -> tuple[Message, bytes]:
        """Send one request; return the response's headers and raw body; raise
        AdminCliError."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            raise AdminCliError(f"HTTP {e.code}: {_reason(e.read(), e.reason)}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise AdminCliError(f"cannot reach {self.base}: {reason}") from None


class _FollowRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a 307 or 308 whatever the method, body and all, as pulsar-admin does: a broker
    answers a call about a topic another broker serves with a 307 to that broker (urllib
    follows it for GET and HEAD only)."""

    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        if code in (307, 308):
            return urllib.request.Request(
                newurl,
                data=req.data,
                headers=dict(req.header_items()),
                method=req.get_method(),
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_FollowRedirects)


def _reason(raw: bytes, fallback: str) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()
        return text or fallback
    if isinstance(body, dict) and "reason" in body:
        return str(body["reason"])
    return json.dumps(body)


# -- output ------------------------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def _print_list(value: Any) -> None:
    for item in value or []:
        print(item)


# -- commands ----------------------------------------------------------------------------------

Handler = Callable[[AdminClient, argparse.Namespace], None]


def _tenants_list(c: AdminClient, a: argparse.Namespace) -> None:
    _print_list(c.request("GET", "/admin/v2/tenants"))


def _tenants_create(c: AdminClient, a: argparse.Namespace) -> None:
    clusters = _csv(a.allowed_clusters) or c.request("GET", "/admin/v2/clusters")
    info = {"adminRoles": _csv(a.admin_roles), "allowedClusters": clusters}
    c.request("PUT", f"/admin/v2/tenants/{_q(a.tenant)}", info)


def _tenants_delete(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("DELETE", f"/admin/v2/tenants/{_q(a.tenant)}")


def _namespaces_list(c: AdminClient, a: argparse.Namespace) -> None:
    _print_list(c.request("GET", f"/admin/v2/namespaces/{_q(a.tenant)}"))


def _ns_path(name: str) -> str:
    tenant, ns = parse_namespace(name)
    return f"/admin/v2/namespaces/{_q(tenant)}/{_q(ns)}"


def _namespaces_create(c: AdminClient, a: argparse.Namespace) -> None:
    body = {"replication_clusters": _csv(a.clusters)} if a.clusters else None
    c.request("PUT", _ns_path(a.namespace), body)


def _namespaces_delete(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = "?force=true" if a.force else ""
    c.request("DELETE", _ns_path(a.namespace) + suffix)


def _namespaces_set_dedup(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("POST", _ns_path(a.namespace) + "/deduplication", bool(a.enable))


def _namespaces_get_dedup(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _ns_path(a.namespace) + "/deduplication"))


# pulsar-admin's namespace verbs for one number each: verb suffix, policy path, value flags.
_COUNT_POLICY_VERBS = (
    ("message-ttl", "messageTTL", ("-t", "--ttl", "--messageTTL")),
    ("max-producers-per-topic", "maxProducersPerTopic", ("-p", "--max-producers-per-topic")),
    ("max-consumers-per-topic", "maxConsumersPerTopic", ("-c", "--max-consumers-per-topic")),
    (
        "max-consumers-per-subscription",
        "maxConsumersPerSubscription",
        ("-c", "--max-consumers-per-subscription"),
    ),
)


# The same verbs of ``topics``, for a topic's own policies.
_TOPIC_COUNT_POLICY_VERBS = (
    ("message-ttl", "messageTTL", ("-t", "--ttl", "--messageTTL")),
    ("max-producers", "maxProducers", ("-p", "--max-producers")),
    ("max-consumers", "maxConsumers", ("-c", "--max-consumers")),
)


def _count_policy(field: str, action: str, of_topic: bool = False) -> Handler:
    """A handler that sets (from ``a.value``), prints or removes one policy of a namespace
    (or, ``of_topic``, of a topic)."""

    def run(c: AdminClient, a: argparse.Namespace) -> None:
        where = _topic_path(a.topic) if of_topic else _ns_path(a.namespace)
        path = where + f"/{field}"
        if action == "set":
            c.request("POST", path, a.value)
        elif action == "get":
            _print_json(c.request("GET", path))
        else:
            c.request("DELETE", path)

    return run


def _namespaces_set_backlog_quota(c: AdminClient, a: argparse.Namespace) -> None:
    limit_size = parse_size(a.limit) if a.limit else -1
    limit_time = parse_relative_time(a.limit_time) if a.limit_time else -1
    body = {"limitSize": limit_size, "limitTime": limit_time, "policy": a.policy}
    c.request("POST", _ns_path(a.namespace) + f"/backlogQuota?backlogQuotaType={a.type}", body)


def _namespaces_get_backlog_quotas(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _ns_path(a.namespace) + "/backlogQuotaMap"))


def _namespaces_remove_backlog_quota(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("DELETE", _ns_path(a.namespace) + f"/backlogQuota?backlogQuotaType={a.type}")


def _namespaces_policies(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _ns_path(a.namespace)))


def _namespaces_clear_backlog(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = f"/{_q(a.subscription)}" if a.subscription else ""
    c.request("POST", _ns_path(a.namespace) + "/clearBacklog" + suffix)


def _namespaces_unsubscribe(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("POST", _ns_path(a.namespace) + f"/unsubscribe/{_q(a.subscription)}")


def _topic_path(name: str) -> str:
    return f"/admin/v2/{parse_topic(name).path}"


def _topics_list(c: AdminClient, a: argparse.Namespace) -> None:
    tenant, ns = parse_namespace(a.namespace)
    domain = "non-persistent" if a.non_persistent else "persistent"
    _print_list(c.request("GET", f"/admin/v2/{domain}/{_q(tenant)}/{_q(ns)}"))


def _topics_list_partitioned(c: AdminClient, a: argparse.Namespace) -> None:
    tenant, ns = parse_namespace(a.namespace)
    _print_list(c.request("GET", f"/admin/v2/persistent/{_q(tenant)}/{_q(ns)}/partitioned"))


def _topics_create(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("PUT", _topic_path(a.topic))


def _topics_delete(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = "?force=true" if a.force else ""
    c.request("DELETE", _topic_path(a.topic) + suffix)


def _topics_create_partitioned(c: AdminClient, a: argparse.Namespace) -> None:
    if a.partitions < 1:
        raise AdminCliError("-p/--partitions must be at least 1")
    c.request("PUT", _topic_path(a.topic) + "/partitions", a.partitions)


def _topics_delete_partitioned(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = "?force=true" if a.force else ""
    c.request("DELETE", _topic_path(a.topic) + "/partitions" + suffix)


def _topics_get_partitioned_metadata(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + "/partitions"))


def _topics_stats(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + "/stats"))


def _topics_partitioned_stats(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = "?perPartition=true" if a.per_partition else "?perPartition=false"
    _print_json(c.request("GET", _topic_path(a.topic) + "/partitioned-stats" + suffix))


def _topics_stats_internal(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + "/internalStats"))


def _topics_partitioned_stats_internal(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + "/partitioned-internalStats"))


def _topics_last_message_id(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + "/lastMessageId"))


def _topics_terminate(c: AdminClient, a: argparse.Namespace) -> None:
    last = c.request("POST", _topic_path(a.topic) + "/terminate")
    if isinstance(last, dict) and "ledgerId" in last:
        print(f"Topic successfully terminated at {last['ledgerId']}:{last.get('entryId')}")
    else:
        print("Topic successfully terminated")


def _topics_unload(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("PUT", _topic_path(a.topic) + "/unload")


def _topics_subscriptions(c: AdminClient, a: argparse.Namespace) -> None:
    _print_list(c.request("GET", _topic_path(a.topic) + "/subscriptions"))


def _sub_path(a: argparse.Namespace) -> str:
    return _topic_path(a.topic) + f"/subscription/{_q(a.subscription)}"


def _topics_create_subscription(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("PUT", _sub_path(a), parse_message_id(a.message_id))


def _topics_unsubscribe(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = "?force=true" if a.force else ""
    c.request("DELETE", _sub_path(a) + suffix)


def _topics_skip(c: AdminClient, a: argparse.Namespace) -> None:
    if a.all:
        c.request("POST", _sub_path(a) + "/skip_all")
        return
    if a.count is None or a.count < 0:
        raise AdminCliError("give -n/--count N (N >= 0) or --all")
    c.request("POST", _sub_path(a) + f"/skip/{a.count}")


def _topics_clear_backlog(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("POST", _sub_path(a) + "/skip_all")


def _topics_reset_cursor(c: AdminClient, a: argparse.Namespace) -> None:
    if (a.time is None) == (a.message_id is None):
        raise AdminCliError("give exactly one of -t/--time or -m/--messageId")
    if a.time is not None:
        at_ms = int(time.time() * 1000) - parse_relative_time(a.time) * 1000
        c.request("POST", _sub_path(a) + f"/resetcursor/{at_ms}")
    else:
        c.request("POST", _sub_path(a) + "/resetcursor", parse_message_id(a.message_id))


def _topics_peek_messages(c: AdminClient, a: argparse.Namespace) -> None:
    if a.count < 1:
        raise AdminCliError("-n/--count must be at least 1")
    shown = 0
    for n in range(1, a.count + 1):
        try:
            headers, body = c.exchange("GET", _sub_path(a) + f"/position/{n}")
        except AdminCliError as e:
            if e.status == 404 and n > 1:
                break  # the backlog holds fewer messages: show those, as pulsar-admin does
            raise
        shown = _print_entry(headers, body, shown)


def _topics_get_message_by_id(c: AdminClient, a: argparse.Namespace) -> None:
    headers, body = c.exchange("GET", _topic_path(a.topic) + f"/ledger/{a.ledger}/entry/{a.entry}")
    _print_entry(headers, body, 0)


def _topics_get_message_id(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", _topic_path(a.topic) + f"/messageid/{parse_datetime(a.datetime)}"))


def _topics_expire_messages(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("POST", _sub_path(a) + f"/expireMessages/{parse_relative_time(a.expire_time)}")


def _topics_expire_all(c: AdminClient, a: argparse.Namespace) -> None:
    age = parse_relative_time(a.expire_time)
    c.request("POST", _topic_path(a.topic) + f"/all_subscription/expireMessages/{age}")


def parse_datetime(text: str) -> int:
    """Parse an ISO-8601 date and time (``2026-11-29T12:00:00Z``; no zone: UTC) into ms since
    the epoch."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise AdminCliError(
            f"invalid date and time {text!r}: expected e.g. 2026-11-29T12:00:00Z"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _print_entry(headers: Message, body: bytes, shown: int) -> int:
    """Print a message the admin API sent (each message of a batch in turn) as pulsar-admin
    does; return how many messages have been printed in all."""
    message_id = headers.get("X-Pulsar-Message-ID", "?")
    publish = _epoch_ms(headers.get("X-Pulsar-publish-time"))
    event = _epoch_ms(headers.get("X-Pulsar-event-time"))
    count = headers.get("X-Pulsar-num-batch-message")
    if count is None:
        props = json.loads(headers.get("X-Pulsar-PROPERTY") or "{}")
        _print_one(f"Message ID: {message_id}", publish, event, props, body, shown)
        return shown + 1
    try:
        messages = decode_batch_payload(body, int(count))
    except (MessageFormatError, ValueError) as e:
        raise AdminCliError(f"message {message_id}: malformed batch: {e}") from None
    for i, m in enumerate(messages):
        props = dict(m.properties)
        header = f"Batch Message ID: {message_id}:{i}"
        _print_one(header, publish, m.event_time_ms or event, props, m.payload, shown + i)
    return shown + len(messages)


def _print_one(
    header: str, publish: int, event: int, props: dict[str, str], payload: bytes, shown: int
) -> None:
    if shown:
        print("-" * 73)
    print(header)
    print(f"Publish time: {publish}")
    print(f"Event time: {event}")
    if props:
        print("Properties:")
        _print_json(props)
    print(hex_dump(payload))


def _epoch_ms(text: str | None) -> int:
    if not text:
        return 0
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1000)
    except ValueError:
        return 0


def hex_dump(data: bytes) -> str:
    """``data`` as a table of 16 bytes a row, hex and printable ASCII (netty's layout, which
    pulsar-admin prints)."""
    rule = "+--------+-------------------------------------------------+----------------+"
    lines = [
        "         +-------------------------------------------------+",
        "         |  0  1  2  3  4  5  6  7  8  9  a  b  c  d  e  f |",
        rule,
    ]
    for at in range(0, len(data), 16):
        row = data[at : at + 16]
        hexes = " ".join(f"{b:02x}" for b in row)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in row)
        lines.append(f"|{at:08x}| {hexes:<47} |{text:<16}|")
    lines.append(rule)
    return "\n".join(lines)


def _brokers_list(c: AdminClient, a: argparse.Namespace) -> None:
    cluster = a.cluster or _only_cluster(c)
    _print_list(c.request("GET", f"/admin/v2/brokers/{_q(cluster)}"))


def _only_cluster(c: AdminClient) -> str:
    clusters = c.request("GET", "/admin/v2/clusters") or []
    if len(clusters) != 1:
        raise AdminCliError(f"name the cluster: one of {', '.join(clusters)}")
    return str(clusters[0])


def _brokers_leader(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", "/admin/v2/brokers/leaderBroker"))


def _brokers_runtime_config(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", "/admin/v2/brokers/configuration/runtime"))


def _brokers_dynamic_config(c: AdminClient, a: argparse.Namespace) -> None:
    _print_list(c.request("GET", "/admin/v2/brokers/configuration"))


def _brokers_internal_config(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", "/admin/v2/brokers/internal-configuration"))


def _brokers_healthcheck(c: AdminClient, a: argparse.Namespace) -> None:
    print(c.request("GET", "/admin/v2/brokers/health"))


def _clusters_list(c: AdminClient, a: argparse.Namespace) -> None:
    _print_list(c.request("GET", "/admin/v2/clusters"))


def _clusters_get(c: AdminClient, a: argparse.Namespace) -> None:
    _print_json(c.request("GET", f"/admin/v2/clusters/{_q(a.cluster)}"))


def _schemas_get(c: AdminClient, a: argparse.Namespace) -> None:
    suffix = f"/{a.version}" if a.version is not None else ""
    _print_json(c.request("GET", _schema_path(a.topic) + "/schema" + suffix))


def _schema_path(topic: str) -> str:
    t = parse_topic(topic)
    return "/admin/v2/schemas/" + "/".join(_q(p) for p in (t.tenant, t.namespace, t.local))


def _schemas_upload(c: AdminClient, a: argparse.Namespace) -> None:
    try:
        with open(a.filename, encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, ValueError) as e:
        raise AdminCliError(f"cannot read a schema from {a.filename}: {e}") from None
    _print_json(c.request("POST", _schema_path(a.topic) + "/schema", payload))


def _schemas_delete(c: AdminClient, a: argparse.Namespace) -> None:
    c.request("DELETE", _schema_path(a.topic) + "/schema")


def _q(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _csv(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


# -- parser ------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the resources and verbs of ``polybroker admin`` to its parser."""
    _url_flag(parser, None)
    resources = parser.add_subparsers(dest="resource", required=True)

    def verbs(name: str, help_text: str) -> argparse._SubParsersAction:  # type: ignore[type-arg]
        r = resources.add_parser(name, help=help_text)
        return r.add_subparsers(dest="verb", required=True)

    def verb(
        group: argparse._SubParsersAction,  # type: ignore[type-arg]
        name: str,
        handler: Handler,
        help_text: str,
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = group.add_parser(name, help=help_text)
        _url_flag(p, argparse.SUPPRESS)
        p.set_defaults(admin_run=handler)
        return p

    g = verbs("tenants", "tenants")
    verb(g, "list", _tenants_list, "list tenants")
    p = verb(g, "create", _tenants_create, "create a tenant")
    p.add_argument("tenant")
    p.add_argument("-c", "--allowed-clusters", default=None, help="comma-separated (all)")
    p.add_argument("-r", "--admin-roles", default=None, help="comma-separated")
    p = verb(g, "delete", _tenants_delete, "delete a tenant (it must have no namespaces)")
    p.add_argument("tenant")

    g = verbs("namespaces", "namespaces")
    p = verb(g, "list", _namespaces_list, "list the namespaces of a tenant")
    p.add_argument("tenant")
    p = verb(g, "create", _namespaces_create, "create a namespace tenant/namespace")
    p.add_argument("namespace")
    p.add_argument("-c", "--clusters", default=None, help="replication clusters, comma-separated")
    p = verb(g, "delete", _namespaces_delete, "delete a namespace")
    p.add_argument("namespace")
    p.add_argument("-f", "--force", action="store_true", help="delete its topics too")
    p = verb(g, "policies", _namespaces_policies, "print a namespace's policies")
    p.add_argument("namespace")
    p = verb(g, "set-deduplication", _namespaces_set_dedup, "enable or disable deduplication")
    p.add_argument("namespace")
    onoff = p.add_mutually_exclusive_group(required=True)
    onoff.add_argument("-e", "--enable", action="store_true")
    onoff.add_argument("-d", "--disable", action="store_true")
    p = verb(g, "get-deduplication", _namespaces_get_dedup, "print the deduplication setting")
    p.add_argument("namespace")

    def count_policy_verbs(group: Any, table: tuple[Any, ...], of_topic: bool) -> None:
        """``set-``, ``get-`` and ``remove-`` verbs of each number policy of ``table``."""
        for suffix, field, flags in table:
            for action in ("set", "get", "remove"):
                handler = _count_policy(field, action, of_topic=of_topic)
                p = verb(group, f"{action}-{suffix}", handler, f"{action} {field}")
                p.add_argument("topic" if of_topic else "namespace")
                if action == "set":
                    p.add_argument(*flags, dest="value", type=int, required=True)

    count_policy_verbs(g, _COUNT_POLICY_VERBS, of_topic=False)

    quota_types = ("destination_storage", "message_age")
    p = verb(g, "set-backlog-quota", _namespaces_set_backlog_quota, "limit backlogs")
    p.add_argument("namespace")
    p.add_argument("-l", "--limit", default=None, help="size: 10M, 2G (destination_storage)")
    p.add_argument("-lt", "--limitTime", dest="limit_time", default=None, help="age: 30m, 1d")
    p.add_argument(
        "-p",
        "--policy",
        required=True,
        choices=("producer_request_hold", "producer_exception", "consumer_backlog_eviction"),
    )
    p.add_argument("-t", "--type", default=quota_types[0], choices=quota_types)
    p = verb(g, "get-backlog-quotas", _namespaces_get_backlog_quotas, "print backlog quotas")
    p.add_argument("namespace")
    p = verb(g, "remove-backlog-quota", _namespaces_remove_backlog_quota, "remove a quota")
    p.add_argument("namespace")
    p.add_argument("-t", "--type", default=quota_types[0], choices=quota_types)

    p = verb(g, "clear-backlog", _namespaces_clear_backlog, "skip backlogs of loaded topics")
    p.add_argument("namespace")
    p.add_argument("-s", "--sub", dest="subscription", default=None, help="one (all)")
    p = verb(g, "unsubscribe", _namespaces_unsubscribe, "delete a subscription everywhere")
    p.add_argument("namespace")
    p.add_argument("-s", "--sub", dest="subscription", required=True)

    g = verbs("topics", "topics")
    count_policy_verbs(g, _TOPIC_COUNT_POLICY_VERBS, of_topic=True)
    p = verb(g, "list", _topics_list, "list the topics (and partitions) of a namespace")
    p.add_argument("namespace")
    p.add_argument("--non-persistent", action="store_true", help="list non-persistent topics")
    p = verb(g, "list-partitioned-topics", _topics_list_partitioned, "list partitioned topics")
    p.add_argument("namespace")
    p = verb(g, "create", _topics_create, "create a non-partitioned topic")
    p.add_argument("topic")
    p = verb(g, "delete", _topics_delete, "delete a non-partitioned topic")
    p.add_argument("topic")
    p.add_argument("-f", "--force", action="store_true", help="even with clients connected")
    p = verb(g, "create-partitioned-topic", _topics_create_partitioned, "create a partitioned one")
    p.add_argument("topic")
    p.add_argument("-p", "--partitions", type=int, required=True, help="number of partitions")
    p = verb(g, "delete-partitioned-topic", _topics_delete_partitioned, "delete a partitioned one")
    p.add_argument("topic")
    p.add_argument("-f", "--force", action="store_true", help="even with clients connected")
    p = verb(
        g, "get-partitioned-topic-metadata", _topics_get_partitioned_metadata, "partition count"
    )
    p.add_argument("topic")
    p = verb(g, "stats", _topics_stats, "print a topic's stats")
    p.add_argument("topic")
    p = verb(g, "partitioned-stats", _topics_partitioned_stats, "stats of a partitioned topic")
    p.add_argument("topic")
    p.add_argument("--per-partition", action="store_true", help="include each partition")
    p = verb(g, "stats-internal", _topics_stats_internal, "print a topic's internal stats")
    p.add_argument("topic")
    p = verb(
        g,
        "partitioned-stats-internal",
        _topics_partitioned_stats_internal,
        "print each partition's internal stats",
    )
    p.add_argument("topic")
    p = verb(g, "last-message-id", _topics_last_message_id, "print the last message id")
    p.add_argument("topic")
    p = verb(g, "terminate", _topics_terminate, "refuse further messages on a topic")
    p.add_argument("topic")
    p = verb(g, "unload", _topics_unload, "unload a topic from the broker")
    p.add_argument("topic")
    p = verb(g, "subscriptions", _topics_subscriptions, "list a topic's subscriptions")
    p.add_argument("topic")
    p = verb(g, "create-subscription", _topics_create_subscription, "create a subscription")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p.add_argument(
        "-m",
        "--messageId",
        dest="message_id",
        default="latest",
        help="latest, earliest or ledgerId:entryId (latest)",
    )
    p = verb(g, "unsubscribe", _topics_unsubscribe, "delete a subscription")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p.add_argument("-f", "--force", action="store_true", help="even with consumers connected")
    p = verb(g, "skip", _topics_skip, "skip messages of a subscription's backlog")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p.add_argument("-n", "--count", type=int, default=None, help="messages to skip")
    p.add_argument("--all", action="store_true", help="skip the whole backlog")
    p = verb(g, "clear-backlog", _topics_clear_backlog, "skip a subscription's whole backlog")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p = verb(g, "reset-cursor", _topics_reset_cursor, "move a subscription by time or id")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p.add_argument("-t", "--time", default=None, help="go back this long: 100m, 3h, 2d, 5w")
    p.add_argument("-m", "--messageId", dest="message_id", default=None, help="ledgerId:entryId")

    p = verb(g, "peek-messages", _topics_peek_messages, "show a subscription's next messages")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    p.add_argument("-n", "--count", type=int, default=1, help="messages to show (1)")
    p = verb(g, "get-message-by-id", _topics_get_message_by_id, "show the message of an id")
    p.add_argument("topic")
    p.add_argument("-l", "--ledger", "--ledgerId", dest="ledger", type=int, required=True)
    p.add_argument("-e", "--entry", "--entryId", dest="entry", type=int, required=True)
    p = verb(g, "get-message-id", _topics_get_message_id, "the id of a message by its time")
    p.add_argument("topic")
    p.add_argument(
        "-d", "--datetime", required=True, help="first message published at or after this"
    )
    p = verb(g, "expire-messages", _topics_expire_messages, "acknowledge old messages")
    p.add_argument("topic")
    p.add_argument("-s", "--subscription", required=True)
    _expire_time_flag(p)
    p = verb(
        g, "expire-messages-all-subscriptions", _topics_expire_all, "expire on every subscription"
    )
    p.add_argument("topic")
    _expire_time_flag(p)

    g = verbs("brokers", "brokers")
    p = verb(g, "list", _brokers_list, "list the brokers of a cluster")
    p.add_argument("cluster", nargs="?", default=None, help="(the only one)")
    verb(g, "leader-broker", _brokers_leader, "the broker leading the load manager")
    verb(g, "get-runtime-config", _brokers_runtime_config, "every setting in force")
    verb(g, "list-dynamic-config", _brokers_dynamic_config, "settings changeable at run time")
    verb(g, "get-internal-config", _brokers_internal_config, "where the metadata is")
    verb(g, "healthcheck", _brokers_healthcheck, "ok while the broker can store messages")

    g = verbs("clusters", "clusters")
    verb(g, "list", _clusters_list, "list clusters")
    p = verb(g, "get", _clusters_get, "print a cluster's data")
    p.add_argument("cluster")

    g = verbs("schemas", "schemas")
    p = verb(g, "get", _schemas_get, "print a topic's schema")
    p.add_argument("topic")
    p.add_argument("-v", "--version", type=int, default=None, help="a version (the latest)")
    p = verb(g, "upload", _schemas_upload, "register a schema version from a file")
    p.add_argument("topic")
    p.add_argument(
        "-f", "--filename", required=True, help='JSON: {"type": "JSON", "schema": "...", ...}'
    )
    p = verb(g, "delete", _schemas_delete, "delete every version of a topic's schema")
    p.add_argument("topic")


def _expire_time_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-t", "--expireTime", dest="expire_time", required=True, help="older than: 1h, 2d, 30s"
    )


def _url_flag(parser: argparse.ArgumentParser, default: str | None) -> None:
    # Accepted before and after the verb; the inner one must not reset the outer one.
    parser.add_argument(
        "--admin-url",
        "--url",
        dest="admin_url",
        default=default,
        help=f"admin REST base URL ({DEFAULT_ADMIN_URL})",
    )


def run(args: argparse.Namespace) -> int:
    """Run one admin verb; return 0, or 1 after printing the error on stderr."""
    handler: Handler = args.admin_run
    client = AdminClient(args.admin_url or DEFAULT_ADMIN_URL)
    try:
        handler(client, args)
    except AdminCliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
