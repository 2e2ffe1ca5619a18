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
         survive forwarding byte for byte.
Rule F2: ``subscribe`` fires with a ``RemoteConsumer`` once the owner attached the
         subscription; from then on the handler's ``Consumer`` gets ``send_entries`` with the
         owner's positions, and ``disconnect()`` when the owner closed the consumer or the
         connection to it went away (the handler subscribes again, as after an unload).
Rule F3: every request is bounded in time. A failure that a new lookup may cure (the owner
         unreachable, gone, or no longer owning the topic) is a ``ForwardingError``, a
         ``ServiceNotReadyError``: the Broker API looks the topic up again and retries within
         its own bound. Other failures carry the broker_core error the owner answered.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol

from twisted.internet.defer import Deferred

from polybroker.broker_core.consumer import Consumer, SubType
from polybroker.broker_core.errors import ServiceNotReadyError
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
    """Reaches the owner of a topic on behalf of this broker (module docstring: F1-F3)."""

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
