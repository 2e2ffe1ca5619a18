"""``polybroker client produce|consume``: Pulsar's ``pulsar-client`` tool over the native protocol.

Same flags as ``pulsar-client`` where it has them. The commands use the official ``pulsar-client``
library (imported only when a command runs), so what they exercise is what applications use.
Messages are written to stdout in ``pulsar-client``'s shape; progress of long runs (one line a
second) and notices go to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

DEFAULT_SERVICE_URL = "pulsar://127.0.0.1:6650"
SUBSCRIPTION_TYPES = ("Exclusive", "Shared", "Failover", "Key_Shared")
POSITIONS = ("Latest", "Earliest")
_PROGRESS_SECONDS = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``produce`` and ``consume`` subcommands to the ``client`` parser."""
    _url_flag(parser, DEFAULT_SERVICE_URL)
    sub = parser.add_subparsers(dest="client_command", required=True)

    p = sub.add_parser("produce", help="publish messages to a topic")
    _url_flag(p, argparse.SUPPRESS)
    p.add_argument("topic", help="topic name (short names live in public/default)")
    p.add_argument(
        "-m",
        "--messages",
        action="append",
        default=[],
        help="messages to send, split by the separator; repeatable",
    )
    p.add_argument(
        "-f", "--files", action="append", default=[], help="send each file's content as a message"
    )
    p.add_argument("-s", "--separator", default=",", help="separator of -m messages (,)")
    p.add_argument(
        "-n", "--num-produce", type=int, default=1, help="times to send the messages (1)"
    )
    p.add_argument("-r", "--rate", type=float, default=0.0, help="msgs/s; 0 = unbounded (0)")
    p.add_argument("-k", "--key", default=None, help="partitioning key of every message")
    p.add_argument(
        "-p", "--properties", action="append", default=[], help="a key=value property; repeatable"
    )
    p.add_argument(
        "-db", "--disable-batching", action="store_true", help="send each message on its own"
    )
    p.set_defaults(client_run=_produce)

    c = sub.add_parser("consume", help="receive and acknowledge messages of a subscription")
    _url_flag(c, argparse.SUPPRESS)
    c.add_argument("topic", help="topic name, or a regular expression with --regex")
    c.add_argument("-s", "--subscription-name", required=True, help="subscription name")
    c.add_argument(
        "-t",
        "--subscription-type",
        choices=SUBSCRIPTION_TYPES,
        default="Exclusive",
        help="subscription type (Exclusive)",
    )
    c.add_argument(
        "-p",
        "--subscription-position",
        choices=POSITIONS,
        default="Latest",
        help="where a new subscription starts (Latest)",
    )
    c.add_argument(
        "-n", "--num-messages", type=int, default=1, help="messages to take; 0 = forever (1)"
    )
    c.add_argument("-r", "--rate", type=float, default=0.0, help="msgs/s; 0 = unbounded (0)")
    c.add_argument("--hex", action="store_true", help="print payloads as hex")
    c.add_argument("--regex", action="store_true", help="the topic is a regular expression")
    c.set_defaults(client_run=_consume)


def _url_flag(parser: argparse.ArgumentParser, default: str) -> None:
    # Accepted before and after the subcommand; the inner one must not reset the outer one.
    parser.add_argument(
        "--service-url",
        "--url",
        dest="service_url",
        default=default,
        help=f"broker URL, pulsar:// or http:// ({DEFAULT_SERVICE_URL})",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``client produce`` or ``client consume``; return the exit status."""
    import pulsar

    runner: Callable[[Any, argparse.Namespace], int] = args.client_run
    try:
        client = pulsar.Client(
            args.service_url,
            operation_timeout_seconds=30,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        )
    except Exception as e:
        print(f"error: cannot create a client for {args.service_url}: {e}", file=sys.stderr)
        return 1
    try:
        return runner(client, args)
    except KeyboardInterrupt:
        return 130
    except pulsar.PulsarException as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an unreadable -f file
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()


def split_messages(messages: list[str], separator: str) -> list[str]:
    """Return the -m messages split by the separator, as ``pulsar-client`` does."""
    out: list[str] = []
    for m in messages:
        out.extend(m.split(separator) if separator else [m])
    return out


def parse_properties(items: list[str]) -> dict[str, str]:
    """Return the ``key=value`` properties as a dict; raise ValueError naming a bad one."""
    props: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad property {item!r}: expected key=value")
        props[key] = value
    return props


class Pacer:
    """Spaces calls to at most ``rate`` a second (0 = unbounded) on an injected clock."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.clock = clock
        self.sleep = sleep
        self.next_at: float | None = None

    def wait(self) -> None:
        """Return when the next call is due."""
        if not self.interval:
            return
        now = self.clock()
        if self.next_at is None:
            self.next_at = now
        if self.next_at > now:
            self.sleep(self.next_at - now)
        self.next_at = max(self.next_at, now - self.interval) + self.interval


class Progress:
    """Writes ``<verb> N messages (R msg/s)`` to ``out`` at most once per period."""

    def __init__(
        self,
        verb: str,
        out: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
        period: float = _PROGRESS_SECONDS,
    ) -> None:
        self.verb = verb
        self.out = out
        self.clock = clock
        self.period = period
        self.started = clock()
        self.last_at = self.started
        self.last_count = 0

    def tick(self, count: int, total: int | None = None) -> None:
        """Report ``count`` if a period has passed since the last report."""
        now = self.clock()
        if now - self.last_at < self.period:
            return
        rate = (count - self.last_count) / (now - self.last_at)
        of = f"/{total}" if total else ""
        print(f"{self.verb} {count}{of} messages ({rate:.0f} msg/s)", file=self.out, flush=True)
        self.last_at, self.last_count = now, count


def _payloads(args: argparse.Namespace) -> list[bytes]:
    payloads = [m.encode() for m in split_messages(args.messages, args.separator)]
    for path in args.files:
        with open(path, "rb") as f:
            payloads.append(f.read())
    return payloads


def _produce(client: Any, args: argparse.Namespace) -> int:
    import pulsar

    payloads = _payloads(args)
    if not payloads:
        print("error: give messages with -m or files with -f", file=sys.stderr)
        return 2
    if args.num_produce < 1:
        print("error: -n/--num-produce must be at least 1", file=sys.stderr)
        return 2
    try:
        properties = parse_properties(args.properties)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    producer = client.create_producer(
        args.topic,
        batching_enabled=not args.disable_batching,
        block_if_queue_full=True,
    )
    total = args.num_produce * len(payloads)
    failures: list[str] = []
    acked = [0]
    ok = pulsar.Result.Ok

    def done(result: Any, _msg_id: Any) -> None:
        # Runs on the client's callback thread, the only writer of ``acked``.
        if result == ok:
            acked[0] += 1
        elif len(failures) < 10:
            failures.append(str(result))

    pacer = Pacer(args.rate)
    progress = Progress("produced")
    extra: dict[str, Any] = {}
    if args.key is not None:
        extra["partition_key"] = args.key
    if properties:
        extra["properties"] = properties
    for _ in range(args.num_produce):
        for payload in payloads:
            pacer.wait()
            producer.send_async(payload, done, **extra)
            progress.tick(acked[0], total)
    producer.flush()
    producer.close()
    if failures or acked[0] != total:
        print(
            f"error: {total - acked[0]} of {total} messages failed: {', '.join(failures)}",
            file=sys.stderr,
        )
        print(f"{acked[0]} messages successfully produced")
        return 1
    print(f"{total} messages successfully produced")
    return 0


def format_message(
    key: str | None, properties: dict[str, str], data: bytes, as_hex: bool = False
) -> str:
    """Return a received message in ``pulsar-client consume``'s two-line shape."""
    content = data.hex() if as_hex else data.decode("utf-8", errors="replace")
    props = ", ".join(f"{k}={v}" for k, v in properties.items())
    shown_key = "null" if key is None else key
    return f"----- got message -----\nkey:[{shown_key}], properties:[{props}], content:{content}"


def _consume(client: Any, args: argparse.Namespace) -> int:
    import pulsar

    kinds = {
        "Exclusive": pulsar.ConsumerType.Exclusive,
        "Shared": pulsar.ConsumerType.Shared,
        "Failover": pulsar.ConsumerType.Failover,
        "Key_Shared": pulsar.ConsumerType.KeyShared,
    }
    position = (
        pulsar.InitialPosition.Earliest
        if args.subscription_position == "Earliest"
        else pulsar.InitialPosition.Latest
    )
    topic: Any = re.compile(args.topic) if args.regex else args.topic
    consumer = client.subscribe(
        topic,
        args.subscription_name,
        consumer_type=kinds[args.subscription_type],
        initial_position=position,
    )
    print(
        f"subscribed to {args.topic} as {args.subscription_name} ({args.subscription_type})",
        file=sys.stderr,
        flush=True,
    )
    limit = args.num_messages
    pacer = Pacer(args.rate)
    progress = Progress("consumed")
    count = 0
    # Ctrl+C or SIGTERM ends the loop between receives (a flag, not KeyboardInterrupt, so
    # the signal never lands inside the client library's calls).
    stopping: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while not stopping and (limit <= 0 or count < limit):
            pacer.wait()
            try:
                msg = consumer.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            key = msg.partition_key() or None
            print(format_message(key, msg.properties(), msg.data(), args.hex), flush=True)
            consumer.acknowledge(msg)
            count += 1
            progress.tick(count, limit if limit > 0 else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    consumer.close()
    print(f"{count} messages successfully consumed")
    # Stopped by a signal: fine for a "forever" consumer, short of the count otherwise.
    return 130 if stopping and limit > 0 and count < limit else 0
