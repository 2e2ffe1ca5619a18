"""Structured logging: one line per event, as ``key=value`` text or as JSON.

Code logs through the standard library (``logging.getLogger(__name__)``) and passes fields with
``extra={"fields": {...}}`` or the ``kv`` helper; Twisted's own log events are routed into the
same handler, so one process writes one format.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

_RESERVED = frozenset(("ts", "level", "logger", "msg"))


class Repeats:
    """Keeps a warning that repeats from flooding the log: ``news(text)`` lets it through when
    its text changed or ``interval_s`` passed since the last one let through (``clock``
    seconds), and answers the suffix to log with it (how many were held back meanwhile, of
    this text or of the one before); otherwise it counts one more held back and answers None.
    ``reset`` makes the next repeat news again (the condition ended)."""

    def __init__(self, clock: Callable[[], float], interval_s: float = 30.0) -> None:
        self._clock = clock
        self.interval_s = interval_s
        self._said: str | None = None
        self._at = 0.0
        self._held = 0

    def news(self, text: str) -> str | None:
        now = self._clock()
        if text == self._said and now - self._at < self.interval_s:
            self._held += 1
            return None
        if not self._held:
            suffix = ""
        elif text == self._said:
            suffix = f" (and {self._held} times more)"
        else:
            suffix = f" (the previous warning {self._held} times more)"
        self._said, self._at, self._held = text, now, 0
        return suffix

    def reset(self) -> None:
        self._said, self._held = None, 0


def kv(**fields: Any) -> dict[str, Any]:
    """Return ``extra`` for a log call carrying structured fields."""
    return {"fields": fields}


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return json.dumps(text)
    return text


class StructuredFormatter(logging.Formatter):
    """Format records as ``ts level logger msg k=v ...`` or as one JSON object."""

    def __init__(self, json_lines: bool = False) -> None:
        super().__init__()
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = dict(getattr(record, "fields", None) or {})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        ts = f"{ts}.{int(record.msecs):03d}Z"
        if self.json_lines:
            doc = {"ts": ts, "level": record.levelname.lower(), "logger": record.name}
            doc["msg"] = record.getMessage()
            doc.update({k: v for k, v in fields.items() if k not in _RESERVED})
            return json.dumps(doc, default=str)
        parts = [ts, record.levelname.lower(), record.name, record.getMessage()]
        parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        return " ".join(parts)


def setup(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger once for a process and route Twisted's log into it."""
    if fmt not in ("text", "json"):
        raise ValueError(f"logFormat must be 'text' or 'json', got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"logLevel must be debug, info, warning or error, got {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(StructuredFormatter(json_lines=fmt == "json"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)

    from twisted.logger import STDLibLogObserver, globalLogBeginner

    globalLogBeginner.beginLoggingTo([STDLibLogObserver(name="twisted")], redirectStandardIO=False)
