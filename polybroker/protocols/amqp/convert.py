"""AMQP messages to and from the one-log ``Message`` (sans-IO).

Stored form of an AMQP publish: payload = body; key = routing key; properties = every header
whose value is a string (so Pulsar, Kafka and MQTT readers see them as plain properties), plus
``amqp.*`` entries for the exchange, routing key, each basic property and the whole headers table
(base64 of its wire encoding, so typed header values come back exactly); event time = the
``timestamp`` property in ms. A message stored by another protocol reads back with its
properties as string headers, its key as routing key and its event time as timestamp.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from polybroker.broker_core.messages import Message
from polybroker.protocols.amqp.codec import AmqpError, BasicProperties, decode_table, encode_table

P_EXCHANGE = "amqp.exchange"
P_ROUTING_KEY = "amqp.routing_key"
P_HEADERS = "amqp.headers"
P_INCARNATION = "amqp.incarnation"
#: On a message stored once for several queues: the queues it was routed to (``encode_to``).
P_TO = "amqp.to"
_PREFIX = "amqp."
_STR_PROPS = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
_INT_PROPS = ("delivery_mode", "priority", "timestamp")


@dataclass(slots=True)
class AmqpMessage:
    """A message as a queue holds it."""

    exchange: str
    routing_key: str
    properties: BasicProperties
    body: bytes
    publish_time_ms: int = 0
    #: The broker incarnation that stored a transient message ("" for persistent ones).
    incarnation: str = ""
    #: ``properties`` in wire form, when known (as received, or encoded once).
    raw_properties: bytes = b""
    #: The alternate exchange that routed it, when its own routed it nowhere (not stored:
    #: it is delivered as published to ``exchange``).
    via: str = ""

    def wire_properties(self) -> bytes:
        """The properties in wire form, encoded at most once."""
        if not self.raw_properties:
            self.raw_properties = self.properties.encode()
        return self.raw_properties

    @property
    def persistent(self) -> bool:
        return self.properties.delivery_mode == 2


def to_stored(msg: AmqpMessage) -> Message:
    """The neutral message for an AMQP publish."""
    props: list[tuple[str, str]] = [
        (P_EXCHANGE, msg.exchange),
        (P_ROUTING_KEY, msg.routing_key),
    ]
    p = msg.properties
    for name in _STR_PROPS:
        value = getattr(p, name)
        if value is not None:
            props.append((_PREFIX + name, value))
    for name in _INT_PROPS:
        value = getattr(p, name)
        if value is not None:
            props.append((_PREFIX + name, str(value)))
    if p.headers is not None:
        props.append((P_HEADERS, base64.b64encode(encode_table(p.headers)).decode("ascii")))
        props.extend((k, v) for k, v in p.headers.items() if isinstance(v, str))
    if msg.incarnation:
        props.append((P_INCARNATION, msg.incarnation))
    event_ms = p.timestamp * 1000 if p.timestamp is not None else 0
    return Message(
        payload=msg.body,
        key=msg.routing_key.encode("utf-8") if msg.routing_key else None,
        properties=props,
        event_time_ms=event_ms if 0 <= event_ms < 2**63 else 0,
    )


#: Basic properties (and their wire form) of stored AMQP publishes without headers, by their
#: stored ``amqp.*`` entries and event time: a queue reading its log builds and encodes each
#: distinct set once. The properties object is shared: it is never changed in place.
_VIEWS: dict[tuple[Any, ...], tuple[BasicProperties, bytes]] = {}
_VIEWS_MAX = 4096
_NOT_PROPERTIES = (P_TO, P_INCARNATION)


def from_stored(m: Message, default_exchange: str = "", default_key: str = "") -> AmqpMessage:
    """The AMQP view of any stored message (see the module docstring)."""
    props = m.properties
    if len(props) < 2 or props[0][0] != P_EXCHANGE or props[1][0] != P_ROUTING_KEY:
        return _from_stored(m, default_exchange, default_key)
    incarnation = ""
    parts: list[tuple[str, str]] = []
    for kv in props[2:]:
        k = kv[0]
        if not k.startswith(_PREFIX) or k == P_HEADERS:
            return _from_stored(m, default_exchange, default_key)
        if k == P_INCARNATION:
            incarnation = kv[1]
        elif k != P_TO:
            parts.append(kv)
    view_key = (*parts, m.event_time_ms)
    view = _VIEWS.get(view_key)
    if view is None:
        am = _from_stored(m, default_exchange, default_key)
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        _VIEWS[view_key] = (am.properties, am.wire_properties())
        return am
    exchange = props[0][1]
    routing_key = props[1][1]
    if len(exchange) > 63:
        exchange = _short(exchange)
    if len(routing_key) > 63:
        routing_key = _short(routing_key)
    return AmqpMessage(
        exchange, routing_key, view[0], m.payload, m.publish_time_ms, incarnation, view[1]
    )


def _from_stored(m: Message, default_exchange: str, default_key: str) -> AmqpMessage:
    p = BasicProperties()
    exchange = default_exchange
    routing_key = m.key.decode("utf-8", "replace") if m.key else default_key
    incarnation = ""
    amqp_headers: dict[str, Any] | None = None
    plain: dict[str, Any] = {}
    for k, v in m.properties:
        if not k.startswith(_PREFIX):
            plain[k] = v
            continue
        if k == P_EXCHANGE:
            exchange = v
        elif k == P_ROUTING_KEY:
            routing_key = v
        elif k == P_INCARNATION:
            incarnation = v
        elif k == P_HEADERS:
            try:
                amqp_headers = decode_table(base64.b64decode(v))
            except (AmqpError, ValueError):
                amqp_headers = None
        else:
            name = k[len(_PREFIX) :]
            if name in _STR_PROPS:
                setattr(p, name, v)
            elif name in _INT_PROPS:
                number = int(v) if v.isdigit() else -1
                limit = 2**64 if name == "timestamp" else 256
                if 0 <= number < limit:
                    setattr(p, name, number)
    if amqp_headers is not None:
        p.headers = amqp_headers
    elif plain:
        p.headers = plain
    if p.timestamp is None and m.event_time_ms:
        p.timestamp = m.event_time_ms // 1000
    # A key another protocol wrote may exceed what an AMQP short string holds.
    routing_key = _short(routing_key)
    exchange = _short(exchange)
    for name in _STR_PROPS:
        value = getattr(p, name)
        if value is not None:
            setattr(p, name, _short(value))
    return AmqpMessage(exchange, routing_key, p, m.payload, m.publish_time_ms, incarnation)


def _short(text: str) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= 255:
        return text
    return raw[:255].decode("utf-8", "ignore")


def encode_to(queues: list[str]) -> str:
    """The value of ``P_TO`` for a message routed to ``queues``."""
    return json.dumps(queues, ensure_ascii=False, separators=(",", ":"))


@lru_cache(maxsize=1024)
def decode_to(value: str) -> frozenset[str]:
    """The queues a ``P_TO`` value names (none when it is malformed)."""
    try:
        names = json.loads(value)
    except ValueError:
        return frozenset()
    if not isinstance(names, list):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str))
