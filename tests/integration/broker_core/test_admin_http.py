"""The broker's HTTP service over real loopback HTTP: health, metrics, lookup and admin v2."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, fail, succeed

from polybroker.broker_core import service as service_module
from polybroker.broker_core.errors import TopicNotFoundError
from polybroker.metadata.api import MetadataError

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "unit" / "broker_core"))

from fake_ledger import RecordingConsumer

from polybroker.broker_core.consumer import SubType
from polybroker.broker_core.messages import Message, decode_batch_payload, encode_entry
from polybroker.ledger.api import InitialPosition, Position

Admin = Any  # the fixture of this folder's conftest.py

T = "/admin/v2/persistent/public/default"


@pytest_twisted.ensureDeferred
async def test_health_answers_ok(admin: Admin) -> None:
    """GET /admin/v2/brokers/health answers 200 with the body ok."""
    reply = await admin.request("GET", "/admin/v2/brokers/health")
    assert (reply.status, reply.body) == (200, b"ok")


@pytest_twisted.ensureDeferred
async def test_health_says_why_the_broker_cannot_store(
    admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While storage would refuse a message (too few bookies take writes, or the metadata
    store fails), health answers 503 with the reason and ready stays 200; ok again after."""
    problem: list[str | None] = ["writable bookies: 0 of the 1 a new ledger needs []"]
    factory = admin.service.ledger_factory
    monkeypatch.setattr(factory, "storage_problem", lambda ensemble: succeed(problem[0]))
    reply = await admin.request("GET", "/admin/v2/brokers/health")
    assert (reply.status, reply.json()) == (503, {"reason": problem[0]})
    ready = await admin.request("GET", "/admin/v2/brokers/ready")
    assert (ready.status, ready.body) == (200, b"ok")
    problem[0] = None
    assert (await admin.request("GET", "/admin/v2/brokers/health")).body == b"ok"
    monkeypatch.setattr(admin.store, "exists", lambda path: fail(MetadataError("session lost")))
    reply = await admin.request("GET", "/admin/v2/brokers/health")
    assert (reply.status, reply.json()) == (503, {"reason": "metadata store: session lost"})
    monkeypatch.setattr(service_module, "HEALTH_TIMEOUT_S", 0.05)
    monkeypatch.setattr(admin.store, "exists", lambda path: Deferred())  # never answers
    reply = await admin.request("GET", "/admin/v2/brokers/health")
    assert (reply.status, reply.json()) == (
        503,
        {"reason": "metadata store: no answer within 0.05 s"},
    )


@pytest_twisted.ensureDeferred
async def test_unknown_path_and_method(admin: Admin) -> None:
    """An unknown path is 404 and a known path with another method 405, both with a reason."""
    missing = await admin.request("GET", "/admin/v2/nothing/here")
    assert missing.status == 404
    assert "reason" in missing.json()
    wrong = await admin.request("DELETE", "/admin/v2/brokers/health")
    assert wrong.status == 405


@pytest_twisted.ensureDeferred
async def test_defaults_exist(admin: Admin) -> None:
    """Cluster standalone, tenant public and namespace public/default are listed."""
    assert (await admin.request("GET", "/admin/v2/clusters")).json() == ["standalone"]
    assert (await admin.request("GET", "/admin/v2/tenants")).json() == ["public"]
    assert (await admin.request("GET", "/admin/v2/namespaces/public")).json() == ["public/default"]
    tenant = (await admin.request("GET", "/admin/v2/tenants/public")).json()
    assert tenant["allowedClusters"] == ["standalone"]


@pytest_twisted.ensureDeferred
async def test_tenant_lifecycle_and_status_codes(admin: Admin) -> None:
    """Create answers 204, a second create 409, a tenant with namespaces refuses delete (409)."""
    body = {"adminRoles": [], "allowedClusters": ["standalone"]}
    assert (await admin.request("PUT", "/admin/v2/tenants/acme", body)).status == 204
    again = await admin.request("PUT", "/admin/v2/tenants/acme", body)
    assert again.status == 409
    assert again.json()["reason"] == "Tenant already exists"
    bad = await admin.request("PUT", "/admin/v2/tenants/other", {"allowedClusters": ["nowhere"]})
    assert bad.status == 412
    assert (await admin.request("PUT", "/admin/v2/namespaces/acme/orders")).status == 204
    assert (await admin.request("PUT", "/admin/v2/namespaces/acme/orders")).status == 409
    busy = await admin.request("DELETE", "/admin/v2/tenants/acme")
    assert busy.status == 409
    assert (await admin.request("DELETE", "/admin/v2/namespaces/acme/orders")).status == 204
    assert (await admin.request("DELETE", "/admin/v2/tenants/acme")).status == 204
    assert (await admin.request("GET", "/admin/v2/tenants/acme")).status == 404


@pytest_twisted.ensureDeferred
async def test_namespace_in_unknown_tenant_is_404(admin: Admin) -> None:
    """A namespace cannot be created in a tenant that does not exist."""
    reply = await admin.request("PUT", "/admin/v2/namespaces/ghost/ns")
    assert reply.status == 404
    assert reply.json()["reason"] == "Tenant does not exist"


@pytest_twisted.ensureDeferred
async def test_namespace_policies_and_deduplication(admin: Admin) -> None:
    """Policies read back; deduplication set over HTTP reaches the Broker API's hook."""
    policies = (await admin.request("GET", "/admin/v2/namespaces/public/default")).json()
    assert policies["replication_clusters"] == ["standalone"]
    path = "/admin/v2/namespaces/public/default/deduplication"
    assert (await admin.request("POST", path, True)).status == 204
    assert (await admin.request("GET", path)).json() is True
    assert admin.service.deduplication_policy("persistent://public/default/t") is True
    strategy = "/admin/v2/namespaces/public/default/schemaCompatibilityStrategy"
    assert (await admin.request("PUT", strategy, "FORWARD")).status == 204
    assert (await admin.request("GET", strategy)).json() == "FORWARD"
    assert (await admin.request("POST", path, "maybe")).status == 412


@pytest_twisted.ensureDeferred
async def test_topics_only_in_existing_namespaces(admin: Admin) -> None:
    """The namespace-existence hook keeps the Broker API from creating topics elsewhere."""
    reply = await admin.request("PUT", "/admin/v2/persistent/nowhere/ns/t")
    assert reply.status == 404
    d = admin.service.get_topic("persistent://nowhere/ns/t")
    failures: list[Any] = []
    d.addErrback(failures.append)
    await d
    assert failures
    assert "does not exist" in failures[0].getErrorMessage()


@pytest_twisted.ensureDeferred
async def test_non_partitioned_topic_lifecycle(admin: Admin) -> None:
    """Create 204 then 409, list, stats, internal stats, delete 204 then 404."""
    assert (await admin.request("PUT", f"{T}/orders")).status == 204
    assert (await admin.request("PUT", f"{T}/orders")).status == 409
    listed = (await admin.request("GET", T)).json()
    assert listed == ["persistent://public/default/orders"]
    await admin.service.publish("persistent://public/default/orders", b"x" * 10)
    stats = (await admin.request("GET", f"{T}/orders/stats")).json()
    assert stats["msgInCounter"] == 1
    assert stats["storageSize"] > 0
    internal = (await admin.request("GET", f"{T}/orders/internalStats")).json()
    assert internal["entriesAddedCounter"] == 1
    await admin.request("PUT", f"{T}/orders/subscription/s")
    internal = (await admin.request("GET", f"{T}/orders/internalStats")).json()
    cursor = internal["cursors"]["s"]
    assert cursor["persistedMarkDeletePosition"] == cursor["markDeletePosition"]
    last = (await admin.request("GET", f"{T}/orders/lastMessageId")).json()
    assert last["entryId"] == 0
    assert last["partitionIndex"] == -1
    assert (await admin.request("DELETE", f"{T}/orders")).status == 204
    assert (await admin.request("DELETE", f"{T}/orders")).status == 404
    assert (await admin.request("GET", f"{T}/orders/stats")).status == 404


@pytest_twisted.ensureDeferred
async def test_partitioned_topic_lifecycle(admin: Admin) -> None:
    """PUT partitions with a bare number, read it, grow it, 409 on re-create, delete."""
    assert (await admin.request("PUT", f"{T}/p/partitions", 3)).status == 204
    assert (await admin.request("PUT", f"{T}/p/partitions", 3)).status == 409
    assert (await admin.request("GET", f"{T}/p/partitions")).json() == {"partitions": 3}
    assert (await admin.request("GET", f"{T}/partitioned")).json() == [
        "persistent://public/default/p"
    ]
    assert (await admin.request("POST", f"{T}/p/partitions", 4)).status == 204
    shrink = await admin.request("POST", f"{T}/p/partitions", 2)
    assert shrink.status == 412
    topics = (await admin.request("GET", "/admin/v2/namespaces/public/default/topics")).json()
    assert topics == [f"persistent://public/default/p-partition-{i}" for i in range(4)]
    await admin.service.publish("persistent://public/default/p-partition-1", b"one")
    stats = (await admin.request("GET", f"{T}/p/partitioned-stats")).json()
    assert stats["msgInCounter"] == 1
    assert stats["metadata"] == {"partitions": 4}
    internal = (await admin.request("GET", f"{T}/p/partitioned-internalStats")).json()
    assert internal["metadata"] == {"partitions": 4}
    assert [s["entriesAddedCounter"] for s in internal["partitions"].values()] == [0, 1, 0, 0]
    assert (await admin.request("GET", f"{T}/orders/partitioned-internalStats")).status == 404
    assert (await admin.request("DELETE", f"{T}/p/partitions")).status == 204
    assert (await admin.request("GET", f"{T}/p/partitions")).json() == {"partitions": 0}


@pytest_twisted.ensureDeferred
async def test_partitions_exist_by_declaration_and_only_up_to_the_count(admin: Admin) -> None:
    """Subscription calls on a partitioned topic no client used yet answer as on Pulsar
    (which creates the partitions with it); a partition past the count does not exist."""
    assert (await admin.request("PUT", f"{T}/fresh/partitions", 2)).status == 204
    assert (await admin.request("GET", f"{T}/fresh/subscriptions")).json() == []
    assert (await admin.request("PUT", f"{T}/fresh/subscription/s")).status == 204
    assert (await admin.request("GET", f"{T}/fresh/subscriptions")).json() == ["s"]
    with pytest.raises(TopicNotFoundError, match="has 2 partitions"):
        await admin.service.publish("persistent://public/default/fresh-partition-2", b"x")
    topics = (await admin.request("GET", "/admin/v2/namespaces/public/default/topics")).json()
    assert "persistent://public/default/fresh-partition-2" not in topics


@pytest_twisted.ensureDeferred
async def test_partitions_of_unknown_topic_and_metadata_body(admin: Admin) -> None:
    """An unknown topic has 0 partitions; the partitioned-metadata body form is accepted."""
    assert (await admin.request("GET", f"{T}/none/partitions")).json() == {"partitions": 0}
    body = {"partitions": 2, "properties": {}}
    assert (await admin.request("PUT", f"{T}/q/partitions", body)).status == 204
    assert (await admin.request("GET", f"{T}/q/partitions")).json() == {"partitions": 2}
    assert (await admin.request("PUT", f"{T}/r/partitions", "x")).status == 412
    assert (await admin.request("PUT", f"{T}/r/partitions", raw=b"{nope")).status == 400


@pytest_twisted.ensureDeferred
async def test_auto_created_partitioned_topic_through_lookup_metadata(
    admin_factory: Any,
) -> None:
    """checkAllowAutoCreation creates a partitioned topic when the broker is configured so."""
    fx = await admin_factory(
        {"allowAutoTopicCreationType": "partitioned", "defaultNumPartitions": 2}
    )
    reply = await fx.request("GET", f"{T}/auto/partitions?checkAllowAutoCreation=true")
    assert reply.json() == {"partitions": 2}


@pytest_twisted.ensureDeferred
async def test_partitions_exist_by_declaration_without_auto_creation(admin_factory: Any) -> None:
    """With auto-creation off, the partitions of a declared partitioned topic still take
    messages, and partitioned-stats lists every partition, also those never used."""
    fx = await admin_factory({"allowAutoTopicCreation": "false"})
    assert (await fx.request("PUT", f"{T}/declared/partitions", 3)).status == 204
    await fx.service.publish("persistent://public/default/declared-partition-2", b"two")
    with pytest.raises(TopicNotFoundError):
        await fx.service.publish("persistent://public/default/declared-partition-3", b"x")
    with pytest.raises(TopicNotFoundError):
        await fx.service.publish("persistent://public/default/undeclared", b"x")
    stats = (await fx.request("GET", f"{T}/declared/partitioned-stats")).json()
    assert sorted(stats["partitions"]) == [
        f"persistent://public/default/declared-partition-{i}" for i in range(3)
    ]
    assert stats["msgInCounter"] == 1
    assert (
        stats["partitions"]["persistent://public/default/declared-partition-0"]["msgInCounter"] == 0
    )


@pytest_twisted.ensureDeferred
async def test_namespace_retention_reaches_topics(admin: Admin) -> None:
    """retention set on a namespace configures the topics opened after it and those loaded."""
    ns = "/admin/v2/namespaces/public/default/retention"
    name = "persistent://public/default/kept"
    await admin.service.publish(name, b"x")
    ledger = admin.service.topics[name].ledger
    assert ledger.config.retention_time_s == 0
    body = {"retentionTimeInMinutes": 10, "retentionSizeInMB": -1}
    assert (await admin.request("POST", ns, body)).status == 204
    assert (await admin.request("GET", ns)).json() == body
    assert ledger.config.retention_time_s == 600
    assert ledger.config.retention_size_bytes == -1
    await admin.service.publish("persistent://public/default/later", b"y")
    factory = admin.service.ledger_factory
    assert factory.configs["public/default/persistent/later"].retention_time_s == 600
    assert (await admin.request("POST", ns, {"retentionTimeInMinutes": "x"})).status == 412
    assert (await admin.request("DELETE", ns)).status == 204
    assert ledger.config.retention_time_s == 0


@pytest_twisted.ensureDeferred
async def test_lookup_answers_like_pulsar(admin: Admin) -> None:
    """Lookup gives the broker's URLs; an unknown namespace is 404."""
    reply = await admin.request("GET", "/lookup/v2/topic/persistent/public/default/t")
    data = reply.json()
    assert data["brokerUrl"] == "pulsar://127.0.0.1:6650"
    assert data["nativeUrl"] == "pulsar://127.0.0.1:6650"
    assert data["httpUrl"] == f"http://127.0.0.1:{admin.port}"
    assert "brokerUrlTls" in data
    missing = await admin.request("GET", "/lookup/v2/topic/persistent/nope/default/t")
    assert missing.status == 404


@pytest_twisted.ensureDeferred
async def test_subscriptions_skip_reset_and_delete(admin: Admin) -> None:
    """Subscriptions list, clear their backlog, reset by time and id, delete (412 when busy)."""
    name = "persistent://public/default/subs"
    for i in range(3):
        await admin.service.publish(name, f"m{i}".encode())
    consumer = RecordingConsumer()
    server_consumer = await admin.service.subscribe(
        name, "s1", consumer, SubType.EXCLUSIVE, InitialPosition.EARLIEST
    )
    assert (await admin.request("GET", f"{T}/subs/subscriptions")).json() == ["s1"]

    def backlog(stats: dict[str, Any]) -> int:
        return int(stats["subscriptions"]["s1"]["msgBacklog"])

    assert backlog((await admin.request("GET", f"{T}/subs/stats")).json()) == 3
    busy = await admin.request("DELETE", f"{T}/subs/subscription/s1")
    assert busy.status == 412
    assert (await admin.request("POST", f"{T}/subs/subscription/s1/skip_all")).status == 204
    assert backlog((await admin.request("GET", f"{T}/subs/stats")).json()) == 0
    assert consumer.disconnects == 1
    await admin.service.topics[name].subscriptions["s1"].remove_consumer(server_consumer)
    reset = await admin.request("POST", f"{T}/subs/subscription/s1/resetcursor/0")
    assert reset.status == 204
    assert backlog((await admin.request("GET", f"{T}/subs/stats")).json()) == 3
    msg_id = {"ledgerId": 0, "entryId": 2}
    last = (await admin.request("GET", f"{T}/subs/lastMessageId")).json()
    msg_id["ledgerId"] = last["ledgerId"]
    by_id = await admin.request("POST", f"{T}/subs/subscription/s1/resetcursor", msg_id)
    assert by_id.status == 204
    assert backlog((await admin.request("GET", f"{T}/subs/stats")).json()) == 1
    assert (await admin.request("DELETE", f"{T}/subs/subscription/s1")).status == 204
    gone = await admin.request("DELETE", f"{T}/subs/subscription/s1")
    assert gone.status == 404
    assert (await admin.request("GET", f"{T}/subs/subscriptions")).json() == []


@pytest_twisted.ensureDeferred
async def test_skip_n_acknowledges_the_next_unacknowledged_entries(admin: Admin) -> None:
    """skip/N moves past N entries not yet acknowledged, stepping over acknowledged ones."""
    name = "persistent://public/default/skipn"
    for i in range(6):
        await admin.service.publish(name, f"m{i}".encode())
    consumer = RecordingConsumer()
    server_consumer = await admin.service.subscribe(
        name, "s", consumer, SubType.SHARED, InitialPosition.EARLIEST
    )
    sub = admin.service.topics[name].subscriptions["s"]
    await sub.remove_consumer(server_consumer)
    last = (await admin.request("GET", f"{T}/skipn/lastMessageId")).json()["ledgerId"]
    await sub.cursor.delete([Position(last, 1)])  # acknowledged out of order: m1

    async def backlog() -> int:
        stats = (await admin.request("GET", f"{T}/skipn/stats")).json()
        return int(stats["subscriptions"]["s"]["msgBacklog"])

    assert await backlog() == 5
    assert (await admin.request("POST", f"{T}/skipn/subscription/s/skip/2")).status == 204
    assert await backlog() == 3
    assert sub.cursor.mark_delete_position == Position(last, 2)
    assert (await admin.request("POST", f"{T}/skipn/subscription/s/skip/10")).status == 204
    assert await backlog() == 0
    missing = await admin.request("POST", f"{T}/skipn/subscription/nope/skip/1")
    assert missing.status == 404


@pytest_twisted.ensureDeferred
async def test_terminate_and_unload(admin: Admin) -> None:
    """Terminate returns the last message id and refuses later publishes; unload is 204."""
    name = "persistent://public/default/term"
    await admin.service.publish(name, b"a")
    reply = await admin.request("POST", f"{T}/term/terminate")
    assert reply.status == 200
    assert reply.json()["entryId"] == 0
    assert (await admin.request("GET", f"{T}/term/stats")).json()["isTerminated"] is True
    assert (await admin.request("PUT", f"{T}/term/unload")).status == 204
    assert name not in admin.service.topics


@pytest_twisted.ensureDeferred
async def test_delete_namespace_with_topics(admin: Admin) -> None:
    """A namespace with topics refuses delete (409) unless forced."""
    assert (await admin.request("PUT", "/admin/v2/namespaces/public/tmp")).status == 204
    await admin.service.publish("persistent://public/tmp/t", b"a")
    assert (await admin.request("DELETE", "/admin/v2/namespaces/public/tmp")).status == 409
    forced = await admin.request("DELETE", "/admin/v2/namespaces/public/tmp?force=true")
    assert forced.status == 204
    assert (await admin.request("GET", "/admin/v2/namespaces/public")).json() == ["public/default"]


@pytest_twisted.ensureDeferred
async def test_metrics_in_prometheus_format(admin: Admin) -> None:
    """/metrics lists per-topic counters and broker totals in Prometheus text format."""
    await admin.service.publish("persistent://public/default/m", b"12345")
    await admin.service.publish("persistent://public/default/m", b"12345")
    reply = await admin.request("GET", "/metrics")
    assert reply.status == 200
    assert reply.content_type.startswith("text/plain; version=0.0.4")
    lines = reply.body.decode().splitlines()
    labels = 'cluster="standalone",namespace="public/default",topic="persistent://public/default/m"'
    assert f"pulsar_in_messages_total{{{labels}}} 2" in lines
    assert f"pulsar_in_bytes_total{{{labels}}} 10" in lines
    assert 'pulsar_broker_topics_count{cluster="standalone"} 1' in lines
    assert "# TYPE pulsar_in_messages_total counter" in lines
    for line in lines:
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


@pytest_twisted.ensureDeferred
async def test_oversize_body_is_refused(admin: Admin) -> None:
    """A body over the limit gets 413 and the server keeps serving."""
    reply = await admin.request("PUT", "/admin/v2/tenants/big", raw=b"x" * (2 * 1024 * 1024))
    assert reply.status == 413
    assert (await admin.request("GET", "/admin/v2/brokers/health")).status == 200


@pytest_twisted.ensureDeferred
async def test_create_subscription_at_latest_earliest_or_an_id(admin: Admin) -> None:
    """PUT subscription creates a durable one (latest by default); twice is 409."""
    name = "persistent://public/default/created"
    for i in range(3):
        await admin.service.publish(name, f"m{i}".encode())

    async def backlog(sub: str) -> int:
        stats = (await admin.request("GET", f"{T}/created/stats")).json()
        return int(stats["subscriptions"][sub]["msgBacklog"])

    assert (await admin.request("PUT", f"{T}/created/subscription/late")).status == 204
    assert await backlog("late") == 0
    earliest = {"ledgerId": -1, "entryId": -1, "partitionIndex": -1}
    reply = await admin.request("PUT", f"{T}/created/subscription/early", earliest)
    assert reply.status == 204
    assert await backlog("early") == 3
    last = (await admin.request("GET", f"{T}/created/lastMessageId")).json()
    at = {"ledgerId": last["ledgerId"], "entryId": 1}
    assert (await admin.request("PUT", f"{T}/created/subscription/mid", at)).status == 204
    assert await backlog("mid") == 2
    assert (await admin.request("PUT", f"{T}/created/subscription/late")).status == 409
    missing = await admin.request("PUT", f"{T}/nosuchtopic/subscription/s")
    assert missing.status == 404


@pytest_twisted.ensureDeferred
async def test_garbage_on_the_http_port_does_not_hurt_others(admin: Admin) -> None:
    """Random bytes and an endless header get an error or a close; the server keeps serving."""
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
    from twisted.internet.protocol import Protocol

    class Raw(Protocol):
        def __init__(self) -> None:
            self.data = b""
            self.closed: Deferred[bytes] = Deferred()

        def dataReceived(self, data: bytes) -> None:
            self.data += data

        def connectionLost(self, reason: object = None) -> None:
            self.closed.callback(self.data)

    for junk in (b"\x00\xff garbage \r\n\r\n", b"GET / HTTP/1.1\r\nX: " + b"a" * 100_000):
        raw = Raw()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", admin.port), raw)
        assert raw.transport is not None
        raw.transport.write(junk)
        raw.closed.addTimeout(10, reactor)
        answer = await raw.closed
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4")
    assert (await admin.request("GET", "/admin/v2/brokers/health")).status == 200


async def _publish_messages(admin: Admin, name: str) -> list[Position]:
    """Two lone messages (a key, properties, an event time) and a compressed batch of three;
    return the positions of the three entries."""
    lone = [
        Message(b"m0", key=b"k0", properties=[("p", "0")], event_time_ms=1_000),
        Message(b"m1", properties=[("p", "1")]),
    ]
    positions = []
    for i, m in enumerate(lone):
        data = encode_entry([m], producer_name="prod", sequence_id=i, publish_time_ms=10_000 + i)
        entry = await admin.service.publish(name, data, publish_time_ms=10_000 + i)
        positions.append(entry.position)
    batch = [Message(f"b{i}".encode() * 20, properties=[("i", str(i))]) for i in range(3)]
    data = encode_entry(
        batch, producer_name="prod", sequence_id=2, publish_time_ms=20_000, compression="zstd"
    )
    entry = await admin.service.publish(name, data, num_messages=3, publish_time_ms=20_000)
    positions.append(entry.position)
    return positions


@pytest_twisted.ensureDeferred
async def test_peek_shows_a_subscriptions_next_messages_without_consuming(admin: Admin) -> None:
    """position/N answers the N-th unacknowledged entry after the mark-delete: its payload
    (a batch's decompressed, its messages framed) and its metadata in X-Pulsar-* headers, as
    Pulsar's peek-messages; acknowledged entries are stepped over and nothing is consumed."""
    name = "persistent://public/default/peek"
    first, second, third = await _publish_messages(admin, name)
    consumer = RecordingConsumer()
    server_consumer = await admin.service.subscribe(
        name, "s", consumer, SubType.SHARED, InitialPosition.EARLIEST
    )
    sub = admin.service.topics[name].subscriptions["s"]
    await sub.remove_consumer(server_consumer)

    one = await admin.request("GET", f"{T}/peek/subscription/s/position/1")
    assert (one.status, one.body, one.content_type) == (200, b"m0", "application/octet-stream")
    h = one.headers
    assert h["x-pulsar-message-id"] == f"{first.ledger_id}:{first.entry_id}"
    assert h["x-pulsar-publish-time"] == "1970-01-01T00:00:10.000Z"
    assert h["x-pulsar-event-time"] == "1970-01-01T00:00:01.000Z"
    assert (h["x-pulsar-producer-name"], h["x-pulsar-sequence-id"]) == ("prod", "0")
    assert (h["x-pulsar-partition-key"], h["x-pulsar-property"]) == ("k0", '{"p": "0"}')
    assert h["x-pulsar-broker-entry-metadata-index"] == "0"
    assert "x-pulsar-num-batch-message" not in h

    await sub.cursor.delete([second])  # acknowledged out of order
    batch = await admin.request("GET", f"{T}/peek/subscription/s/position/2")
    assert batch.status == 200
    h = batch.headers
    assert h["x-pulsar-message-id"] == f"{third.ledger_id}:{third.entry_id}"
    assert (h["x-pulsar-num-batch-message"], h["x-pulsar-compression"]) == ("3", "ZSTD")
    assert h["x-pulsar-broker-entry-metadata-index"] == "4"  # its last message's index
    shown = decode_batch_payload(batch.body, 3)
    assert [m.payload for m in shown] == [f"b{i}".encode() * 20 for i in range(3)]
    assert [m.properties for m in shown] == [[("i", str(i))] for i in range(3)]

    past = await admin.request("GET", f"{T}/peek/subscription/s/position/3")
    assert (past.status, past.json()) == (404, {"reason": "Message not found"})
    missing = await admin.request("GET", f"{T}/peek/subscription/nope/position/1")
    assert (missing.status, missing.json()) == (404, {"reason": "Subscription not found"})
    # Nothing was acknowledged.
    assert not sub.cursor.is_deleted(first)
    assert not sub.cursor.is_deleted(third)


@pytest_twisted.ensureDeferred
async def test_message_by_id_and_message_id_by_time(admin: Admin) -> None:
    """ledger/L/entry/E answers the message of an id (404 if there is none); messageid/T the
    id of the first entry published at or after T (404 after the last)."""
    name = "persistent://public/default/byid"
    first, second, third = await _publish_messages(admin, name)
    got = await admin.request("GET", f"{T}/byid/ledger/{second.ledger_id}/entry/{second.entry_id}")
    assert (got.status, got.body) == (200, b"m1")
    assert got.headers["x-pulsar-message-id"] == f"{second.ledger_id}:{second.entry_id}"
    none = await admin.request("GET", f"{T}/byid/ledger/{third.ledger_id}/entry/99")
    assert (none.status, none.json()) == (404, {"reason": "Message not found"})

    async def id_at(ms: int) -> Any:
        reply = await admin.request("GET", f"{T}/byid/messageid/{ms}")
        return reply.json() if reply.status == 200 else reply.status

    def as_id(p: Position) -> dict[str, int]:
        return {"ledgerId": p.ledger_id, "entryId": p.entry_id, "partitionIndex": -1}

    assert await id_at(0) == as_id(first)
    assert await id_at(10_001) == as_id(second)
    assert await id_at(10_002) == as_id(third)
    assert await id_at(20_001) == 404


@pytest_twisted.ensureDeferred
async def test_expire_acknowledges_only_messages_older_than_the_age(
    admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """expireMessages/S acknowledges the entries published more than S seconds ago and never
    moves a subscription back; all_subscription does it for every subscription."""
    name = "persistent://public/default/expire"
    _, second, third = await _publish_messages(admin, name)
    for sub_name in ("a", "b"):
        await admin.request("PUT", f"{T}/expire/subscription/{sub_name}", {"ledgerId": -1})
    topic = admin.service.topics[name]
    monkeypatch.setattr(topic, "clock", _Clock(30.0))  # 30 s after the epoch

    async def backlogs() -> list[int]:  # in entries here (this service's ledger counts them)
        stats = (await admin.request("GET", f"{T}/expire/stats")).json()
        return [stats["subscriptions"][s]["msgBacklog"] for s in ("a", "b")]

    assert await backlogs() == [3, 3]
    # Older than 15 s: the two entries published at 10 s.
    expire_a = f"{T}/expire/subscription/a/expireMessages"
    assert (await admin.request("POST", f"{expire_a}/15")).status == 204
    assert await backlogs() == [1, 3]
    assert topic.subscriptions["a"].cursor.mark_delete_position == second
    # Older than 25 s is less: a does not move back.
    assert (await admin.request("POST", f"{expire_a}/25")).status == 204
    assert topic.subscriptions["a"].cursor.mark_delete_position == second
    everything = f"{T}/expire/all_subscription/expireMessages/5"
    assert (await admin.request("POST", everything)).status == 204
    assert await backlogs() == [0, 0]
    assert topic.subscriptions["b"].cursor.mark_delete_position == third
    missing = await admin.request("POST", f"{T}/expire/subscription/nope/expireMessages/1")
    assert missing.status == 404


@pytest_twisted.ensureDeferred
async def test_message_inspection_of_a_partitioned_topic_is_refused(admin: Admin) -> None:
    """As Pulsar: peek, get by id and id by time name a partition, not a partitioned topic
    (405 with a reason); expire goes to every partition."""
    assert (await admin.request("PUT", f"{T}/parts/partitions", 2)).status == 204
    for path in ("subscription/s/position/1", "ledger/0/entry/0", "messageid/0"):
        reply = await admin.request("GET", f"{T}/parts/{path}")
        assert reply.status == 405, path
        assert "partitioned topic is not allowed" in reply.json()["reason"]
    for i in range(2):
        await admin.service.publish(f"persistent://public/default/parts-partition-{i}", b"x")
    assert (await admin.request("PUT", f"{T}/parts/subscription/s", {"ledgerId": -1})).status == 204
    assert (await admin.request("POST", f"{T}/parts/subscription/s/expireMessages/0")).status == 204
    stats = (await admin.request("GET", f"{T}/parts/partitioned-stats")).json()
    assert stats["subscriptions"]["s"]["msgBacklog"] == 0


class _Clock:
    """A clock standing at ``now`` (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def seconds(self) -> float:
        return self.now


@pytest_twisted.ensureDeferred
async def test_no_setting_changes_at_run_time(admin: Admin) -> None:
    """No configuration is dynamic: updating one is refused (412), as Pulsar refuses a
    setting that is not dynamic."""
    path = "/admin/v2/brokers/configuration/brokerDeduplicationEnabled/true"
    refused = await admin.request("POST", path)
    assert refused.status == 412
    assert "not a dynamic configuration" in refused.json()["reason"]
    values = await admin.request("GET", "/admin/v2/brokers/configuration/values")
    assert values.json() == {}


@pytest_twisted.ensureDeferred
async def test_namespace_clear_backlog_and_unsubscribe(admin: Admin) -> None:
    """clearBacklog[/sub] skips the backlog of one subscription (or all) of every loaded
    topic of the namespace, unsubscribe/sub deletes it from each; other namespaces keep
    theirs; an unknown namespace is 404."""
    assert (await admin.request("PUT", "/admin/v2/namespaces/public/other")).status == 204
    names = [f"persistent://public/default/nsb-{i}" for i in range(2)]
    names.append("persistent://public/other/nsb")
    for name in names:
        for i in range(3):
            await admin.service.publish(name, f"m{i}".encode())
        for sub in ("s1", "s2"):
            server = await admin.service.subscribe(
                name, sub, RecordingConsumer(), SubType.EXCLUSIVE, InitialPosition.EARLIEST
            )
            await admin.service.topics[name].subscriptions[sub].remove_consumer(server)

    def backlogs(sub: str) -> list[int]:
        return [admin.service.topics[n].subscriptions[sub].cursor.backlog() for n in names]

    ns = "/admin/v2/namespaces/public/default"
    assert (await admin.request("POST", f"{ns}/clearBacklog/s1")).status == 204
    assert (backlogs("s1"), backlogs("s2")) == ([0, 0, 3], [3, 3, 3])
    assert (await admin.request("POST", f"{ns}/clearBacklog")).status == 204
    assert backlogs("s2") == [0, 0, 3]
    assert (await admin.request("POST", f"{ns}/unsubscribe/s2")).status == 204
    assert [sorted(admin.service.topics[n].subscriptions) for n in names] == [
        ["s1"],
        ["s1"],
        ["s1", "s2"],
    ]
    missing = await admin.request("POST", "/admin/v2/namespaces/public/nope/clearBacklog")
    assert missing.status == 404


@pytest_twisted.ensureDeferred
async def test_message_ttl_policy_is_seconds(admin: Admin) -> None:
    """A namespace's messageTTL is a number of seconds, 0 or more (412 otherwise); it is what
    the broker's expiry reads for the namespace's topics."""
    path = "/admin/v2/namespaces/public/default/messageTTL"
    for bad in (-1, "1h", True):
        assert (await admin.request("POST", path, bad)).status == 412, bad
    assert (await admin.request("POST", path, 30)).status == 204
    assert (await admin.request("GET", path)).json() == 30
    assert admin.policies.message_ttl_of("persistent://public/default/t") == 30
    assert admin.policies.message_ttl_of("persistent://public/other/t") is None


@pytest_twisted.ensureDeferred
async def test_a_namespace_auto_topic_creation_override_decides(admin: Admin) -> None:
    """A namespace's autoTopicCreation override wins over the broker's settings: creation on
    first use refused, or partitioned with its partition count; removed, the broker's apply.
    A malformed override is refused (412)."""
    path = "/admin/v2/namespaces/public/default/autoTopicCreation"
    for bad in (
        {"allowAutoTopicCreation": "yes"},
        {"allowAutoTopicCreation": True},
        {"allowAutoTopicCreation": True, "topicType": "partitioned"},
        {"allowAutoTopicCreation": True, "topicType": "partitioned", "defaultNumPartitions": 0},
    ):
        assert (await admin.request("POST", path, bad)).status == 412, bad
    off = {"allowAutoTopicCreation": False}
    assert (await admin.request("POST", path, off)).status == 204
    with pytest.raises(TopicNotFoundError):
        await admin.service.publish("persistent://public/default/not-made", b"x")
    partitioned = {
        "allowAutoTopicCreation": True,
        "topicType": "partitioned",
        "defaultNumPartitions": 3,
    }
    assert (await admin.request("POST", path, partitioned)).status == 204
    made = "persistent://public/default/made-partitioned"
    assert await admin.service.partitioned_topic_metadata(made, create=True) == 3
    assert (await admin.request("DELETE", path)).status == 204
    plain = "persistent://public/default/made-plain"
    assert await admin.service.partitioned_topic_metadata(plain, create=True) == 0
    await admin.service.publish(plain, b"x")  # the broker's default: created on first use


@pytest_twisted.ensureDeferred
async def test_schemas_upload_list_and_delete(admin: Admin) -> None:
    """POST registers a schema version under the namespace's strategy (FULL: a field without
    a default is refused with 409), GET shows one or all, DELETE removes them all."""
    path = "/admin/v2/schemas/public/default/typed/schema"

    def definition(*fields: dict[str, Any]) -> dict[str, Any]:
        record = {"type": "record", "name": "R", "fields": list(fields)}
        return {"type": "JSON", "schema": json.dumps(record), "properties": {"k": "v"}}

    title = {"name": "title", "type": "string"}
    first = await admin.request("POST", path, definition(title))
    assert (first.status, first.json()) == (200, {"version": 0})
    bare = {"name": "isbn", "type": "string"}
    refused = await admin.request("POST", path, definition(title, bare))
    assert refused.status == 409
    with_default = {"name": "isbn", "type": "string", "default": ""}
    assert (await admin.request("POST", path, definition(title, with_default))).json() == {
        "version": 1
    }
    latest = (await admin.request("GET", path)).json()
    assert (latest["version"], latest["type"], latest["properties"]) == (1, "JSON", {"k": "v"})
    now_ms = admin.service.reactor.seconds() * 1000
    assert now_ms - 60_000 < latest["timestamp"] <= now_ms  # when it was registered
    assert (await admin.request("GET", f"{path}/0")).json()["version"] == 0
    every = (await admin.request("GET", path + "s")).json()["getSchemaResponses"]
    assert [v["version"] for v in every] == [0, 1]
    assert (await admin.request("POST", path, {"type": "SOMETHING"})).status == 412
    assert (await admin.request("DELETE", path)).json() == {"version": 1}
    assert (await admin.request("GET", path)).status == 404
    assert (await admin.request("DELETE", path)).status == 404
