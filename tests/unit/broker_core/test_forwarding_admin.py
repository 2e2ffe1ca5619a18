"""Unit tests of the forwarded topic operations (Rule F4 of ``broker_core.forwarding``):
``stats``, ``last_message_id``, ``delete_topic`` and ``delete_subscription`` with
``forward=True`` serve owned topics here and ask the owner's admin REST API for the others,
mapping its answers onto broker_core errors and retrying what a new lookup may cure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parent))

from fake_ledger import failure_of, result_of
from test_forwarding import MINE, OWNER, THEIRS, Broker, Sink

from polybroker.broker_core.errors import (
    BrokerError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicBusyError,
    TopicNotFoundError,
)
from polybroker.broker_core.forwarding import ForwardingError, OwnerAdmin
from polybroker.ledger.api import Position

BASE = "http://b:8080/admin/v2/persistent/public/default/theirs"


class FakeHttp:
    """Answers admin requests from ``answers`` (one per call; an exception fails the call)."""

    def __init__(self, *answers: tuple[int, bytes] | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[bytes, str]] = []

    def __call__(self, method: bytes, url: str) -> Deferred[tuple[int, bytes]]:
        self.calls.append((method, url))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            return fail(answer)
        return succeed(answer)


def broker_with(http: FakeHttp) -> Broker:
    b = Broker()
    b.forwarder.admin = OwnerAdmin(b.clock, request=http)
    return b


def test_owned_topics_are_served_here_without_asking_anyone() -> None:
    """forward=True on a topic this broker serves runs the local operation."""
    http = FakeHttp()
    b = broker_with(http)
    result_of(b.service.publish(MINE, b"x"))
    assert result_of(b.service.last_message_id(MINE, forward=True)).position.entry_id == 0
    assert "subscriptions" in result_of(b.service.stats(MINE, forward=True))
    result_of(b.service.subscribe(MINE, "s", Sink()))
    assert isinstance(
        failure_of(b.service.delete_subscription(MINE, "s", forward=True)),
        SubscriptionBusyError,
    )
    result_of(b.service.delete_subscription(MINE, "s", force=True, forward=True))
    result_of(b.service.delete_topic(MINE, force=True, forward=True))
    assert MINE not in b.service.topics
    assert http.calls == []


def test_foreign_topics_are_asked_of_the_owner_admin_api() -> None:
    """Each operation on a topic another broker owns is one request to its admin URL."""
    http = FakeHttp(
        (200, json.dumps({"ledgerId": 7, "entryId": 3, "batchIndex": 4}).encode()),
        (200, json.dumps({"subscriptions": {"s": {"backlogMessages": 5}}}).encode()),
        (204, b""),
        (204, b""),
    )
    b = broker_with(http)
    last = result_of(b.service.last_message_id(THEIRS, forward=True))
    assert (last.position, last.num_messages) == (Position(7, 3), 5)
    stats = result_of(b.service.stats(THEIRS, forward=True))
    assert stats["subscriptions"] == {"s": {"backlogMessages": 5}}
    result_of(b.service.delete_subscription(THEIRS, "amqp.q/x", force=True, forward=True))
    result_of(b.service.delete_topic(THEIRS, force=True, forward=True))
    assert http.calls == [
        (b"GET", f"{BASE}/lastMessageId"),
        (b"GET", f"{BASE}/stats"),
        (b"DELETE", f"{BASE}/subscription/amqp.q%2Fx?force=true"),
        (b"DELETE", f"{BASE}?force=true"),
    ]
    assert THEIRS not in b.service.topics


def test_an_empty_topic_has_no_last_message() -> None:
    """The owner's -1 entry id comes back as an empty topic's last message id."""
    b = broker_with(FakeHttp((200, b'{"ledgerId": 3, "entryId": -1, "partitionIndex": -1}')))
    last = result_of(b.service.last_message_id(THEIRS, forward=True))
    assert last.position.entry_id == -1
    assert last.num_messages == 0


def test_owner_answers_map_onto_broker_errors() -> None:
    """404 and 412 are the topic's (or subscription's) errors; other failures are BrokerError;
    none of them is retried."""
    http = FakeHttp(
        (404, b"no topic"),
        (404, b"no subscription"),
        (412, b"busy"),
        (412, b"busy"),
        (500, b"boom"),
    )
    b = broker_with(http)
    assert isinstance(failure_of(b.service.stats(THEIRS, forward=True)), TopicNotFoundError)
    err = failure_of(b.service.delete_subscription(THEIRS, "s", forward=True))
    assert isinstance(err, SubscriptionNotFoundError)
    err = failure_of(b.service.delete_subscription(THEIRS, "s", forward=True))
    assert isinstance(err, SubscriptionBusyError)
    assert isinstance(failure_of(b.service.delete_topic(THEIRS, forward=True)), TopicBusyError)
    err = failure_of(b.service.last_message_id(THEIRS, forward=True))
    assert type(err) is BrokerError
    assert len(http.calls) == 5


def test_a_moved_or_unreachable_owner_is_looked_up_again() -> None:
    """A redirect, a 503 or no connection is a ForwardingError: the call is retried after a
    new lookup, and is served here once this broker took the bundle over."""
    http = FakeHttp((307, b"moved"), (503, b"not ready"), ConnectionRefusedError("refused"))
    b = broker_with(http)
    result_of(b.service.publish(MINE, b"x"))
    d = b.service.last_message_id(THEIRS, forward=True)
    b.clock.advance(0.05)
    b.clock.advance(0.1)
    assert len(http.calls) == 3
    del b.ownership.remote[THEIRS]  # the owner died; this broker serves the topic now
    result_of(b.service.publish(THEIRS, b"y"))
    b.clock.advance(0.2)
    assert result_of(d).position.entry_id == 0


def test_retries_of_the_owner_admin_are_bounded() -> None:
    """An owner that never answers fails the call with ForwardingError after the bound."""
    b = broker_with(FakeHttp(*[ForwardingError("timeout")] * 50))
    b.service.forward_retry_s = 1.0
    d = b.service.stats(THEIRS, forward=True)
    b.clock.pump([0.2] * 10)
    assert isinstance(failure_of(d), ForwardingError)


def test_without_an_admin_forwarded_operations_fail_plainly() -> None:
    """A forwarder with no ``admin`` refuses the operation (not retried)."""
    b = Broker()
    assert type(failure_of(b.service.stats(THEIRS, forward=True))) is BrokerError


def test_an_owner_without_an_admin_url_cannot_be_asked() -> None:
    """A topic name or owner that gives no admin URL is a ForwardingError."""
    admin = OwnerAdmin(Clock(), request=FakeHttp())
    assert isinstance(failure_of(admin.stats(OWNER, "not-a-full-name")), ForwardingError)
    no_web = type(OWNER)("c:1", "", "pulsar://c:2")
    assert isinstance(failure_of(admin.delete_topic(no_web, THEIRS)), ForwardingError)
