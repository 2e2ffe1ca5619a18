"""The forwarding seam: serving a topic another broker of the cluster owns, on its behalf.

A Pulsar or Kafka client is redirected to a topic's owner (lookup, NOT_LEADER). Protocols that
cannot redirect their clients (MQTT, AMQP) opt in to forwarding instead: the Broker API's
``publish(..., forward=True)`` and ``subscribe(..., forward=True)`` serve the topic here when
this broker owns it, and otherwise hand the call to a ``Forwarder`` that reaches the owner.
broker_core knows no wire protocol: the implementation (a client of the owner's Pulsar port)
lives with the Pulsar protocol and is wired in by the broker process.

Contract of a ``Forwarder``:

Rule F1: ``publish`` fires once the owner acknowledged the durable write, with the stored
         entry's position (the owner's ledger and entry ids); the stored bytes are exactly
         ``data`` (a stored entry: metadata and payload), so key, properties and event time
         survive forwarding byte for byte. Publishes to one topic reach the owner in call
         order (the Broker API calls them in the order its callers did, and again in that
         order after a refusal: ``broker_core.publish_line``).
Rule F2: ``subscribe`` fires with a ``RemoteConsumer`` once the owner attached the
         subscription; from then on the handler's ``Consumer`` gets ``send_entries`` with the
         owner's positions, and ``disconnect()`` when the owner closed the consumer or the
         connection to it went away (the handler subscribes again, as after an unload).
Rule F3: every request is bounded in time. A failure that a new lookup may cure (the owner
         unreachable, gone, or no longer owning the topic) is a ``ForwardingError``, a
         ``ServiceNotReadyError``: the Broker API looks the topic up again and retries within
         its own bound. Other failures carry the broker_core error the owner answered.
Rule F4: the topic operations beyond publish and subscribe (``stats``, ``last_message_id``,
         ``delete_topic``, ``delete_subscription``) go to the owner's admin REST API through
         the forwarder's ``admin`` (an ``OwnerAdmin``), under F3's rules: a redirect (the topic
         moved), a 503 or no answer is a ``ForwardingError``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import quote

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime

from polybroker.broker_core.consumer import Consumer, LastMessageId, SubType
from polybroker.broker_core.errors import (
    BrokerError,
    ServiceNotReadyError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicBusyError,
    TopicNotFoundError,
)
from polybroker.broker_core.ownership import BrokerInfo
from polybroker.ledger.api import InitialPosition, Position

#: How long the Broker API keeps looking a forwarded topic up again before giving up.
FORWARD_RETRY_S = 30.0


class ForwardingError(ServiceNotReadyError):
    """The owner could not be reached or dropped the request: look up and retry (Rule F3)."""


class ConsumerHandle(Protocol):
    """What a handler calls on a subscription it holds, local (``ServerConsumer``) or forwarded
    (``RemoteConsumer``): the common part of both."""

    @property
    def closed(self) -> bool: ...

    def flow(self, permits: int) -> None: ...

    def ack(self, positions: Sequence[Position]) -> Deferred[None]: ...

    def ack_cumulative(
        self, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]: ...

    def redeliver(self, positions: Sequence[Position] | None = None) -> None: ...

    def close(self) -> Deferred[None]: ...

    def unsubscribe(self) -> Deferred[None]: ...


class RemoteConsumer(abc.ABC):
    """A consumer attached on the owner of its topic, driven like a ``ServerConsumer``."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the consumer is gone (closed here, by the owner, or with the connection)."""

    @abc.abstractmethod
    def flow(self, permits: int) -> None:
        """Grant ``permits`` more messages."""

    @abc.abstractmethod
    def ack(self, positions: Sequence[Position]) -> Deferred[None]:
        """Acknowledge whole entries (owner positions); fire once sent."""

    @abc.abstractmethod
    def ack_batch_index(
        self, position: Position, acked_indexes: int, batch_size: int
    ) -> Deferred[None]:
        """Acknowledge some messages of one entry (bit i = message i)."""

    @abc.abstractmethod
    def ack_cumulative(
        self, position: Position, acked_indexes: int | None = None
    ) -> Deferred[None]:
        """Acknowledge everything up to ``position``."""

    @abc.abstractmethod
    def redeliver(self, positions: Sequence[Position] | None = None) -> None:
        """Send these unacknowledged entries again (all when None)."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Detach; fires when the owner confirmed, or at once when the link is gone."""

    @abc.abstractmethod
    def unsubscribe(self) -> Deferred[None]:
        """Delete the subscription on the owner."""


class Forwarder(abc.ABC):
    """Reaches the owner of a topic on behalf of this broker (module docstring: F1-F4)."""

    #: Reaches owners' admin REST API (Rule F4); None: those operations are not forwarded.
    admin: OwnerAdmin | None = None

    def _admin(self) -> OwnerAdmin:
        if self.admin is None:
            raise BrokerError("this broker does not forward topic administration")
        return self.admin

    def stats(self, owner: BrokerInfo, topic: str) -> Deferred[dict[str, Any]]:
        """The topic's stats, as its owner reports them (Rule F4)."""
        try:
            return self._admin().stats(owner, topic)
        except BrokerError as e:
            return fail(e)

    def last_message_id(self, owner: BrokerInfo, topic: str) -> Deferred[LastMessageId]:
        """The topic's last message at its owner (Rule F4)."""
        try:
            return self._admin().last_message_id(owner, topic)
        except BrokerError as e:
            return fail(e)

    def delete_topic(self, owner: BrokerInfo, topic: str, force: bool = False) -> Deferred[None]:
        """Delete the topic at its owner (Rule F4)."""
        try:
            return self._admin().delete_topic(owner, topic, force)
        except BrokerError as e:
            return fail(e)

    def delete_subscription(
        self, owner: BrokerInfo, topic: str, subscription: str, force: bool = False
    ) -> Deferred[None]:
        """Delete one subscription of the topic at its owner (Rule F4)."""
        try:
            return self._admin().delete_subscription(owner, topic, subscription, force)
        except BrokerError as e:
            return fail(e)

    @abc.abstractmethod
    def publish(
        self, owner: BrokerInfo, topic: str, data: bytes, num_messages: int = 1
    ) -> Deferred[Position]:
        """Store the entry ``data`` on ``topic`` at ``owner``; fire with its position once
        durable there."""

    @abc.abstractmethod
    def subscribe(
        self,
        owner: BrokerInfo,
        topic: str,
        subscription: str,
        consumer: Consumer,
        sub_type: SubType = SubType.EXCLUSIVE,
        initial_position: InitialPosition = InitialPosition.LATEST,
        *,
        durable: bool = True,
        create_topic: bool = True,
    ) -> Deferred[RemoteConsumer]:
        """Attach ``consumer`` to ``subscription`` of ``topic`` at ``owner``."""

    @abc.abstractmethod
    def close(self) -> Deferred[None]:
        """Drop every connection; forwarded consumers get ``disconnect()``."""


#: ``(method, url) -> (status, body)``; fails when the broker cannot be reached.
AdminRequest = Callable[[bytes, str], Deferred[tuple[int, bytes]]]

#: How long one admin request to an owner may take.
ADMIN_TIMEOUT_S = 10.0


class OwnerAdmin:
    """The owner's admin REST API for forwarded topic operations (Rule F4).

    Answers map onto broker_core errors: 2xx is success; 404 ``TopicNotFoundError`` (or
    ``SubscriptionNotFoundError`` for a subscription); 412 ``TopicBusyError`` (or
    ``SubscriptionBusyError``); a redirect (the topic moved), a 503, a timeout or no connection
    ``ForwardingError``; anything else ``BrokerError``."""

    def __init__(
        self,
        reactor: IReactorTime,
        *,
        request: AdminRequest | None = None,
        timeout_s: float = ADMIN_TIMEOUT_S,
    ) -> None:
        self.reactor = reactor
        self.timeout_s = timeout_s
        self._request = request or self._http

    def _http(self, method: bytes, url: str) -> Deferred[tuple[int, bytes]]:
        from twisted.web.client import Agent, readBody

        async def call() -> tuple[int, bytes]:
            agent = Agent(self.reactor, connectTimeout=self.timeout_s)  # type: ignore[arg-type]
            response = agent.request(method, url.encode())
            response.addTimeout(self.timeout_s, self.reactor)  # type: ignore[arg-type]
            got = await response
            body = readBody(got)
            body.addTimeout(self.timeout_s, self.reactor)  # type: ignore[arg-type]
            return int(got.code), await body

        return Deferred.fromCoroutine(call())

    @staticmethod
    def topic_url(owner: BrokerInfo, topic: str) -> str:
        """The admin URL of a full topic name at ``owner``."""
        domain, sep, rest = topic.partition("://")
        parts = rest.split("/", 2)
        if not sep or len(parts) != 3 or not all(parts) or not owner.web_url:
            raise ForwardingError(f"cannot address {topic} at {owner.broker_id}")
        path = "/".join(quote(p, safe="") for p in (domain, *parts))
        return f"{owner.web_url.rstrip('/')}/admin/v2/{path}"

    def call(self, method: bytes, url: str, *, subscription: bool = False) -> Deferred[bytes]:
        """Run one request; fire with the body of a success (errors: class docstring)."""

        async def run() -> bytes:
            try:
                status, body = await self._request(method, url)
            except BrokerError:
                raise
            except Exception as e:
                raise ForwardingError(f"admin request to {url} failed: {e}") from None
            reason = body.decode(errors="replace")[:200]
            if 200 <= status < 300:
                return body
            if 300 <= status < 400 or status == 503:
                raise ForwardingError(f"{url}: {status} {reason}")
            if status == 404:
                raise (SubscriptionNotFoundError if subscription else TopicNotFoundError)(reason)
            if status == 412:
                raise (SubscriptionBusyError if subscription else TopicBusyError)(reason)
            raise BrokerError(f"{url}: {status} {reason}")

        return Deferred.fromCoroutine(run())

    def stats(self, owner: BrokerInfo, topic: str) -> Deferred[dict[str, Any]]:
        try:
            url = self.topic_url(owner, topic) + "/stats"
        except ForwardingError as e:
            return fail(e)
        return self.call(b"GET", url).addCallback(json.loads)  # type: ignore[no-any-return]

    def last_message_id(self, owner: BrokerInfo, topic: str) -> Deferred[LastMessageId]:
        try:
            url = self.topic_url(owner, topic) + "/lastMessageId"
        except ForwardingError as e:
            return fail(e)

        def parse(body: bytes) -> LastMessageId:
            doc = json.loads(body)
            position = Position(int(doc["ledgerId"]), int(doc["entryId"]))
            if position.entry_id < 0:
                return LastMessageId(position, 0)
            return LastMessageId(position, int(doc.get("batchIndex", 0)) + 1)

        return self.call(b"GET", url).addCallback(parse)  # type: ignore[no-any-return]

    def delete_topic(self, owner: BrokerInfo, topic: str, force: bool = False) -> Deferred[None]:
        try:
            url = self.topic_url(owner, topic) + ("?force=true" if force else "")
        except ForwardingError as e:
            return fail(e)
        return self.call(b"DELETE", url).addCallback(lambda _: None)  # type: ignore[no-any-return]

    def delete_subscription(
        self, owner: BrokerInfo, topic: str, subscription: str, force: bool = False
    ) -> Deferred[None]:
        try:
            url = f"{self.topic_url(owner, topic)}/subscription/{quote(subscription, safe='')}"
        except ForwardingError as e:
            return fail(e)
        if force:
            url += "?force=true"
        d = self.call(b"DELETE", url, subscription=True)
        return d.addCallback(lambda _: None)  # type: ignore[no-any-return]
