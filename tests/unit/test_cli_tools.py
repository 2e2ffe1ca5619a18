"""Unit tests of the pure parts of ``polybroker client`` and ``polybroker admin``."""

from __future__ import annotations

import io

import pytest

from polybroker import cli_admin, cli_client
from polybroker.cli import build_parser


class FakeClock:
    """A clock that moves only when told (or when ``sleep`` is called)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_topic_names_short_three_part_and_full() -> None:
    """Short names live in public/default; domains other than (non-)persistent are refused."""
    assert str(cli_admin.parse_topic("t")) == "persistent://public/default/t"
    assert str(cli_admin.parse_topic("a/b/c")) == "persistent://a/b/c"
    full = cli_admin.parse_topic("non-persistent://a/b/c d")
    assert full.path == "non-persistent/a/b/c%20d"
    for bad in ("a/b", "a/b/c/d", "kafka://a/b/c", "persistent://a/b", "a//c"):
        with pytest.raises(cli_admin.AdminCliError):
            cli_admin.parse_topic(bad)


def test_namespace_names() -> None:
    """A namespace is exactly tenant/namespace."""
    assert cli_admin.parse_namespace("public/default") == ("public", "default")
    for bad in ("public", "a/b/c", "/x", "x/"):
        with pytest.raises(cli_admin.AdminCliError):
            cli_admin.parse_namespace(bad)


def test_message_ids() -> None:
    """latest, earliest and ledger:entry[:partition] map to the REST MessageId body."""
    assert cli_admin.parse_message_id("earliest")["ledgerId"] == -1
    assert cli_admin.parse_message_id("Latest")["ledgerId"] == 2**63 - 1
    assert cli_admin.parse_message_id("3:7") == {"ledgerId": 3, "entryId": 7, "partitionIndex": -1}
    assert cli_admin.parse_message_id("3:7:1")["partitionIndex"] == 1
    with pytest.raises(cli_admin.AdminCliError):
        cli_admin.parse_message_id("3-7")


def test_relative_times() -> None:
    """pulsar-admin's reset-cursor times: bare seconds or s/m/h/d/w suffixes."""
    assert cli_admin.parse_relative_time("90") == 90
    assert cli_admin.parse_relative_time("10m") == 600
    assert cli_admin.parse_relative_time("3h") == 10800
    assert cli_admin.parse_relative_time("2d") == 172800
    assert cli_admin.parse_relative_time("1w") == 604800
    with pytest.raises(cli_admin.AdminCliError):
        cli_admin.parse_relative_time("5y")


def test_dates_and_times() -> None:
    """get-message-id takes ISO-8601; without a zone it is UTC."""
    assert cli_admin.parse_datetime("1970-01-01T00:00:01Z") == 1000
    assert cli_admin.parse_datetime("1970-01-01T00:00:01.5") == 1500
    assert cli_admin.parse_datetime("1970-01-01T01:00:00+01:00") == 0
    for bad in ("", "yesterday", "1970-13-01T00:00:00"):
        with pytest.raises(cli_admin.AdminCliError):
            cli_admin.parse_datetime(bad)


def test_hex_dump_rows() -> None:
    """16 bytes a row: offset, hex, and the printable bytes (others as dots)."""
    lines = cli_admin.hex_dump(b"hello\x00\x7f" + bytes(range(65, 75))).splitlines()
    rows = [line for line in lines if line.startswith("|0")]
    assert rows == [
        "|00000000| 68 65 6c 6c 6f 00 7f 41 42 43 44 45 46 47 48 49 |hello..ABCDEFGHI|",
        "|00000010| 4a                                              |J               |",
    ]
    assert cli_admin.hex_dump(b"").count("|0") == 0


def test_error_reasons_come_from_the_json_body() -> None:
    """The reason of a Pulsar error body is shown; other bodies are shown as they are."""
    assert cli_admin._reason(b'{"reason": "Tenant already exists"}', "x") == (
        "Tenant already exists"
    )
    assert cli_admin._reason(b"plain text", "x") == "plain text"
    assert cli_admin._reason(b"", "Not Found") == "Not Found"


def test_admin_url_before_or_after_the_verb() -> None:
    """--admin-url is accepted on `admin` and on the verb; the verb's one never resets it."""
    parser = build_parser()
    before = parser.parse_args(["admin", "--admin-url", "http://h:1", "tenants", "list"])
    assert before.admin_url == "http://h:1"
    after = parser.parse_args(["admin", "tenants", "list", "--admin-url", "http://h:2"])
    assert after.admin_url == "http://h:2"
    neither = parser.parse_args(["admin", "clusters", "list"])
    assert neither.admin_url is None


def test_client_flags_as_pulsar_client() -> None:
    """produce and consume take pulsar-client's flags and defaults."""
    parser = build_parser()
    p = parser.parse_args(["client", "produce", "t", "-m", "a,b", "-m", "c", "-n", "3", "-db"])
    assert (p.messages, p.num_produce, p.disable_batching) == (["a,b", "c"], 3, True)
    assert p.service_url == cli_client.DEFAULT_SERVICE_URL
    c = parser.parse_args(
        ["client", "--url", "pulsar://h:1", "consume", "t", "-s", "sub", "-n", "0", "-t", "Shared"]
    )
    assert (c.subscription_name, c.num_messages, c.subscription_type) == ("sub", 0, "Shared")
    assert c.subscription_position == "Latest"
    assert c.service_url == "pulsar://h:1"
    with pytest.raises(SystemExit):
        parser.parse_args(["client", "consume", "t"])  # -s is required


def test_messages_split_and_properties() -> None:
    """-m values split on the separator; properties are key=value."""
    assert cli_client.split_messages(["a,b", "c"], ",") == ["a", "b", "c"]
    assert cli_client.split_messages(["a,b"], "") == ["a,b"]
    assert cli_client.parse_properties(["k=v", "x=a=b"]) == {"k": "v", "x": "a=b"}
    with pytest.raises(ValueError, match="bad property"):
        cli_client.parse_properties(["novalue"])


def test_message_shape() -> None:
    """Received messages print as pulsar-client consume prints them."""
    assert cli_client.format_message(None, {}, b"hello-pulsar") == (
        "----- got message -----\nkey:[null], properties:[], content:hello-pulsar"
    )
    assert cli_client.format_message("k", {"a": "1"}, b"\x01", as_hex=True).endswith(
        "key:[k], properties:[a=1], content:01"
    )


def test_pacer_spaces_calls_and_does_not_burst_after_a_stall() -> None:
    """At 10/s calls are 0.1 s apart; after a long stall it does not catch up in a burst."""
    clock = FakeClock()
    pacer = cli_client.Pacer(10, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        pacer.wait()
    assert clock.slept == pytest.approx([0.1, 0.1])
    clock.now += 5.0
    clock.slept.clear()
    pacer.wait()
    pacer.wait()
    pacer.wait()
    assert sum(clock.slept) == pytest.approx(0.1)
    unbounded = cli_client.Pacer(0, clock=clock, sleep=clock.sleep)
    clock.slept.clear()
    unbounded.wait()
    assert clock.slept == []


def test_progress_reports_at_most_once_per_period() -> None:
    """Progress writes a line only when a period has passed, with the rate since the last one."""
    clock = FakeClock()
    out = io.StringIO()
    progress = cli_client.Progress("produced", out=out, clock=clock, period=1.0)
    progress.tick(50, 1000)
    assert out.getvalue() == ""
    clock.now += 1.0
    progress.tick(200, 1000)
    clock.now += 0.5
    progress.tick(300, 1000)
    clock.now += 0.5
    progress.tick(400)
    assert out.getvalue().splitlines() == [
        "produced 200/1000 messages (200 msg/s)",
        "produced 400 messages (200 msg/s)",
    ]
