"""The broker.conf loader validates keys and types and lets flags win."""

from pathlib import Path

import pytest

from polybroker.config import Config, ConfigError, load, parse_lines


def test_defaults_are_pulsars() -> None:
    """Unset keys take Pulsar's defaults."""
    config = Config()
    assert config["maxMessageSize"] == 5 * 1024 * 1024
    assert config["brokerServicePort"] == 6650
    assert config["journalSyncData"] is True


def test_file_values_are_typed_and_flags_override(tmp_path: Path) -> None:
    """Values from the file are converted to the key's type; CLI overrides win over the file."""
    conf = tmp_path / "broker.conf"
    conf.write_text(
        "# comment\nbrokerServicePort=7000\njournalSyncData=false\n\nwebServicePort=1\n"
    )
    config = load(conf, {"webServicePort": 8081, "bookiePort": None})
    assert config["brokerServicePort"] == 7000
    assert config["journalSyncData"] is False
    assert config["webServicePort"] == 8081
    assert config["bookiePort"] == 3181


def test_unknown_key_is_an_error() -> None:
    """A typo never silently falls back to a default."""
    with pytest.raises(ConfigError, match="brokerServicPort"):
        Config({"brokerServicPort": "1"})


def test_bad_value_names_the_key() -> None:
    """A value of the wrong type is reported with its key."""
    with pytest.raises(ConfigError, match="maxMessageSize"):
        Config({"maxMessageSize": "five"})


def test_line_without_equals_is_an_error() -> None:
    """A malformed line is reported with its line number."""
    with pytest.raises(ConfigError, match=r"f:2"):
        parse_lines(["a=1", "nonsense"], "f")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """A config path that does not exist is reported, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.conf")


def test_protocols_list() -> None:
    """messagingProtocols is split on commas, blanks dropped."""
    assert Config({"messagingProtocols": "pulsar, kafka,,mqtt"}).protocols == [
        "pulsar",
        "kafka",
        "mqtt",
    ]
