"""Executor side of a write: rows published with batching, every one acknowledged before return."""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from polybroker.spark.offsets import full_topic


class PublishError(RuntimeError):
    """A message was refused or not acknowledged; the Spark task fails and is retried."""


def _bytes(value: Any, column: str) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise PublishError(f"column {column} must be binary or string, not {type(value).__name__}")


def _key(value: Any) -> str:
    # The Python client takes the key as str; keys that were bytes come back as their UTF-8.
    if isinstance(value, str):
        return value
    try:
        return _bytes(value, "key").decode("utf-8")
    except UnicodeDecodeError:
        raise PublishError("key must be UTF-8 (the Pulsar Python client sends str keys)") from None


def _millis(value: Any) -> int:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.astimezone()
        return int(value.timestamp() * 1000)
    if isinstance(value, int):
        return value
    raise PublishError(f"column __eventTime must be a timestamp, not {type(value).__name__}")


def publish_rows(
    service_url: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    topic: str | None,
    batching_max_messages: int = 1000,
    send_timeout_ms: int = 30_000,
) -> int:
    """Publish each row; return how many were acknowledged (all of them, or raise PublishError).

    Columns used: ``value`` (required), ``key``, ``__topic`` (when ``topic`` is None),
    ``__eventTime``, ``__messageProperties`` (or ``properties``); others are ignored.
    """
    index = {name: i for i, name in enumerate(columns)}
    if "value" not in index:
        raise PublishError("the DataFrame needs a value column")
    if topic is None and "__topic" not in index:
        raise PublishError("set the topic option or give a __topic column")
    i_value = index["value"]
    i_key = index.get("key")
    i_topic = index.get("__topic")
    i_event = index.get("__eventTime")
    i_props = index.get("__messageProperties", index.get("properties"))

    lock = threading.Lock()
    done = threading.Condition(lock)
    state = {"sent": 0, "acked": 0, "error": None}

    def callback(res: Any, _msg_id: Any) -> None:
        import pulsar

        with lock:
            if res == pulsar.Result.Ok:
                state["acked"] += 1
            elif state["error"] is None:
                state["error"] = str(res)
            done.notify_all()

    # Imported here: the driver's planning processes need none of the read path.
    from polybroker.spark.reading import client

    c = client(service_url)
    producers: dict[str, Any] = {}
    try:
        for row in rows:
            # As in Spark's Kafka sink, the topic option overrides the __topic column.
            name = topic or (row[i_topic] if i_topic is not None else None)
            if not name:
                raise PublishError("a row has no __topic and no topic option is set")
            name = full_topic(name)
            producer = producers.get(name)
            if producer is None:
                producer = c.create_producer(
                    name,
                    batching_enabled=True,
                    batching_max_messages=batching_max_messages,
                    batching_max_publish_delay_ms=10,
                    block_if_queue_full=True,
                    max_pending_messages=10_000,
                    send_timeout_millis=send_timeout_ms,
                )
                producers[name] = producer
            kwargs: dict[str, Any] = {}
            if i_key is not None and row[i_key] is not None:
                kwargs["partition_key"] = _key(row[i_key])
            if i_event is not None and row[i_event] is not None:
                kwargs["event_timestamp"] = _millis(row[i_event])
            if i_props is not None and row[i_props]:
                kwargs["properties"] = {str(k): str(v) for k, v in dict(row[i_props]).items()}
            value = row[i_value]
            if value is None:
                raise PublishError("value must not be null")
            producer.send_async(_bytes(value, "value"), callback, **kwargs)
            state["sent"] += 1
            if state["error"] is not None:
                break
        for producer in producers.values():
            producer.flush()
        with lock:
            # flush() returns once the batches are sent; wait (bounded) for their callbacks.
            done.wait_for(
                lambda: state["error"] is not None or state["acked"] >= state["sent"],
                timeout=send_timeout_ms / 1000,
            )
            if state["error"] is not None:
                raise PublishError(f"publish failed: {state['error']}")
            if state["acked"] != state["sent"]:
                raise PublishError(f"only {state['acked']} of {state['sent']} acknowledged")
            return int(state["acked"])
    finally:
        for producer in producers.values():
            # Closing after a failure must not hide the failure.
            with contextlib.suppress(Exception):
                producer.close()
        c.close()
