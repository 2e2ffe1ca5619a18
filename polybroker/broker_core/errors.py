"""Typed failures of the Broker API.

Protocol handlers map these onto their own error codes (a Pulsar handler onto ``ServerError``,
Kafka onto its error codes, ...). Every class names the Pulsar ``ServerError`` it corresponds to
in ``pulsar_error`` so that mapping is a lookup, not a guess; broker_core itself never uses it.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of every Broker API failure."""

    pulsar_error = "UnknownError"


class ServiceNotReadyError(BrokerError):
    """The topic is closing, unloading or fenced; the client should retry (look up again)."""

    pulsar_error = "ServiceNotReady"


class TopicClosedError(ServiceNotReadyError):
    """The topic was closed (unloaded or deleted) while the operation ran."""


class TopicFencedError(ServiceNotReadyError):
    """Another owner took over the topic's log; this broker may write no more."""


class TopicNotFoundError(BrokerError):
    """The topic does not exist and may not be created here."""

    pulsar_error = "TopicNotFound"


class TopicAlreadyExistsError(BrokerError):
    """A topic (or partitioned topic) of that name already exists."""

    pulsar_error = "NotAllowedError"


class TopicBusyError(BrokerError):
    """The topic has connected producers or consumers and the operation was not forced."""

    pulsar_error = "NotAllowedError"


class InvalidTopicNameError(BrokerError):
    """The topic name cannot be parsed."""

    pulsar_error = "InvalidTopicName"


class TopicTerminatedError(BrokerError):
    """The topic was terminated: it takes no more messages."""

    pulsar_error = "TopicTerminatedError"


class PersistenceError(BrokerError):
    """Storage failed to persist a message."""

    pulsar_error = "PersistenceError"


class ProducerBusyError(BrokerError):
    """A producer of that name is already connected, or the access mode conflicts."""

    pulsar_error = "ProducerBusy"


class ProducerFencedError(BrokerError):
    """An exclusive producer holds (or took) the topic; this producer may not write."""

    pulsar_error = "ProducerFenced"


class ProducerClosedError(BrokerError):
    """The producer was closed (by its client, by fencing or by an unload)."""

    pulsar_error = "ServiceNotReady"


class ConsumerBusyError(BrokerError):
    """The subscription's type or exclusivity does not admit another consumer."""

    pulsar_error = "ConsumerBusy"


class ConsumerAssignError(BrokerError):
    """Key_Shared could not give the consumer a hash range (overlap, out of range, no room)."""

    pulsar_error = "ConsumerAssignError"


class SubscriptionNotFoundError(BrokerError):
    """No subscription of that name."""

    pulsar_error = "SubscriptionNotFound"


class SubscriptionBusyError(BrokerError):
    """Other consumers are connected to the subscription (unsubscribe, delete)."""

    pulsar_error = "NotAllowedError"


class NotAllowedError(BrokerError):
    """The operation is not allowed here (e.g. cumulative ack on a Shared subscription)."""

    pulsar_error = "NotAllowedError"


class ConsumerClosedError(BrokerError):
    """The consumer was closed."""

    pulsar_error = "ConsumerNotFound"
