"""Structured log lines carry their fields in both formats."""

import io
import json
import logging

from polybroker.logs import Repeats, StructuredFormatter, kv


def _record(text: str, **fields: object) -> logging.LogRecord:
    logger = logging.getLogger("polybroker.test")
    return logger.makeRecord(
        "polybroker.test", logging.INFO, __file__, 1, text, (), None, extra=kv(**fields)
    )


def test_text_format_quotes_values_with_spaces() -> None:
    """Text lines are `ts level logger msg k=v` with values quoted only when needed."""
    line = StructuredFormatter().format(_record("bookie started", port=3181, dir="a b"))
    assert ' info polybroker.test bookie started port=3181 dir="a b"' in line


def test_json_format_is_one_object_per_line() -> None:
    """JSON lines parse back to the message and every field."""
    line = StructuredFormatter(json_lines=True).format(_record("x", ledger=7))
    doc = json.loads(line)
    assert doc["msg"] == "x"
    assert doc["ledger"] == 7
    assert doc["level"] == "info"


def test_fields_cannot_overwrite_the_message() -> None:
    """A field named like a reserved key does not replace the message."""
    doc = json.loads(StructuredFormatter(json_lines=True).format(_record("real", msg="fake")))
    assert doc["msg"] == "real"


def test_formatter_handles_no_fields() -> None:
    """A plain log call with no extra fields still formats."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(StructuredFormatter())
    logger = logging.getLogger("polybroker.plain")
    logger.addHandler(handler)
    logger.propagate = False
    logger.warning("hello %s", "world")
    assert "warning polybroker.plain hello world" in stream.getvalue()


def test_repeats_let_news_through_and_count_what_they_held_back() -> None:
    """A new text passes at once; the same text again only after the interval, saying how
    often it was held back; after ``reset`` the same text is news again."""
    now = [100.0]
    r = Repeats(lambda: now[0], interval_s=30)
    assert r.news("disk full") == ""
    assert r.news("disk full") is None
    now[0] += 29.9
    assert r.news("disk full") is None
    assert r.news("bookie gone") == " (the previous warning 2 times more)"
    assert r.news("bookie gone") is None
    now[0] += 30
    assert r.news("bookie gone") == " (and 1 times more)"
    r.reset()
    assert r.news("bookie gone") == ""
