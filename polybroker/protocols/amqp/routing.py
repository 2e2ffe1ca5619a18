"""Exchange routing, sans-IO: exchange types, bindings and which destinations a message reaches.

Rule 1: ``route`` follows exchange-to-exchange bindings (each exchange visited once, so cycles
end) and returns every destination queue once, however many bindings lead to it.
Rule 2: topic patterns split on ``.``; ``*`` matches one word, ``#`` zero or more words.
Rule 3: headers bindings match on ``x-match`` ``all`` (the default) or ``any``; ``x-`` keys of
the binding are not compared (``all-with-x``/``any-with-x`` compare them too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

DIRECT = "direct"
FANOUT = "fanout"
TOPIC = "topic"
HEADERS = "headers"
EXCHANGE_TYPES = frozenset({DIRECT, FANOUT, TOPIC, HEADERS})

#: The exchanges every vhost has: name -> type.
PREDECLARED = {
    "": DIRECT,
    "amq.direct": DIRECT,
    "amq.fanout": FANOUT,
    "amq.topic": TOPIC,
    "amq.headers": HEADERS,
    "amq.match": HEADERS,
}

QUEUE = "queue"
EXCHANGE = "exchange"


@dataclass(frozen=True)
class Binding:
    """``source`` exchange -> ``destination`` (a queue or an exchange, per ``kind``)."""

    source: str
    destination: str
    kind: str
    routing_key: str
    arguments: tuple[tuple[str, Any], ...] = ()

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.arguments)


@dataclass
class Exchange:
    """An exchange and the bindings that leave it."""

    name: str
    type: str
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    bindings: list[Binding] = field(default_factory=list)

    def matches(self, binding: Binding, routing_key: str, headers: dict[str, Any] | None) -> bool:
        """Whether a message with this key and headers goes through ``binding``."""
        if self.type == FANOUT:
            return True
        if self.type == DIRECT:
            return binding.routing_key == routing_key
        if self.type == TOPIC:
            return topic_matches(binding.routing_key, routing_key)
        return headers_match(binding.args, headers or {})


def freeze_args(arguments: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """Binding arguments as a hashable, ordered tuple."""
    if not arguments:
        return ()
    return tuple(sorted((k, _freeze(v)) for k, v in arguments.items()))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return freeze_args(value)
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


@lru_cache(maxsize=4096)
def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split(".")) if text else ()


def topic_matches(pattern: str, key: str) -> bool:
    """Whether routing key ``key`` matches topic pattern ``pattern``."""
    if pattern == key or pattern == "#":
        return True
    return _match(_words(pattern), 0, _words(key), 0)


def _match(p: tuple[str, ...], i: int, k: tuple[str, ...], j: int) -> bool:
    while i < len(p):
        word = p[i]
        if word == "#":
            if i == len(p) - 1:
                return True
            return any(_match(p, i + 1, k, jj) for jj in range(j, len(k) + 1))
        if j >= len(k):
            return False
        if word != "*" and word != k[j]:
            return False
        i += 1
        j += 1
    return j == len(k)


def is_pattern(pattern: str) -> bool:
    """Whether a topic binding key has wildcards."""
    return any(w in ("*", "#") for w in _words(pattern))


def headers_match(binding_args: dict[str, Any], headers: dict[str, Any]) -> bool:
    """Headers-exchange matching (see Rule 3)."""
    mode = str(binding_args.get("x-match", "all"))
    with_x = mode.endswith("-with-x")
    wanted = {
        k: v
        for k, v in binding_args.items()
        if k != "x-match" and (with_x or not k.startswith("x-"))
    }
    if not wanted:
        return mode.startswith("all")

    def one(k: str, v: Any) -> bool:
        if k not in headers:
            return False
        return v is None or _freeze(headers[k]) == v or headers[k] == v

    if mode.startswith("any"):
        return any(one(k, v) for k, v in wanted.items())
    return all(one(k, v) for k, v in wanted.items())


def route(
    exchanges: dict[str, Exchange],
    exchange: str,
    routing_key: str,
    headers: dict[str, Any] | None,
    extra_keys: tuple[str, ...] = (),
) -> list[str]:
    """The queues a message published to ``exchange`` reaches (Rule 1).

    ``extra_keys`` are more routing keys (the ``CC``/``BCC`` headers) matched like the first."""
    keys = (routing_key, *extra_keys)
    out: dict[str, None] = {}
    seen: set[str] = set()
    todo = [exchange]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        ex = exchanges.get(name)
        if ex is None:
            continue
        for b in ex.bindings:
            if any(ex.matches(b, key, headers) for key in keys):
                if b.kind == QUEUE:
                    out[b.destination] = None
                else:
                    todo.append(b.destination)
    return list(out)
