"""A third party adds a protocol with one entry point: the echo plugin under tests/plugins.

The plugin is made discoverable the way an installed package is: a ``.dist-info`` directory on
``sys.path`` (written by ``tests/plugins/echo_protocol/install.py`` from its pyproject), so the
host finds it through ``importlib.metadata`` exactly as it finds the built-in handlers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol

from polybroker.broker_core.host import ProtocolHost, installed_entry_points
from polybroker.broker_core.protocol_handler import BrokerContext
from polybroker.config import Config, ConfigError

_INSTALL = Path(__file__).parents[2] / "plugins" / "echo_protocol" / "install.py"


def _installer() -> Any:
    spec = importlib.util.spec_from_file_location("echo_plugin_install", _INSTALL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def echo_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The echo plugin, discoverable through importlib.metadata for this test only."""
    for path in reversed(_installer().install_into(tmp_path / "site")):
        monkeypatch.syspath_prepend(str(path))


class _Reader(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.waiting: tuple[bytes, Deferred[bytes]] | None = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        self._check()

    def until(self, expected: bytes) -> Deferred[bytes]:
        d: Deferred[bytes] = Deferred()
        d.addTimeout(10, reactor)
        self.waiting = (expected, d)
        self._check()
        return d

    def _check(self) -> None:
        if self.waiting is not None and self.waiting[0] in self.data:
            _, d = self.waiting
            self.waiting = None
            d.callback(self.data)


@pytest_twisted.ensureDeferred
async def test_an_installed_plugin_is_found_enabled_and_served(echo_installed: None) -> None:
    """With messagingProtocols=echo the host loads the plugin, binds it and it echoes."""
    assert "echo" in {ep.name for ep in installed_entry_points()}
    config = Config({"messagingProtocols": "echo", "clusterName": "here"})
    host = ProtocolHost(config, reactor)
    [handler] = host.load()
    assert type(handler).__module__ == "polybroker_echo"
    ports = await host.start(BrokerContext(None, config, reactor, "127.0.0.1"))
    try:
        assert ports["echoPort"] > 0
        assert handler.port == ports["echoPort"]  # type: ignore[attr-defined]
        reader = _Reader()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", ports["echoPort"]), reader)
        assert reader.transport is not None
        reader.transport.write(b"ping")
        assert await reader.until(b"ping") == b"echo from here\nping"
        reader.transport.loseConnection()
    finally:
        await host.stop()


def test_an_installed_plugin_is_listed_when_a_name_is_wrong(echo_installed: None) -> None:
    """The error for an unknown protocol lists the third-party plugin among the installed."""
    host = ProtocolHost(Config({"messagingProtocols": "ehco"}), reactor)
    with pytest.raises(ConfigError, match=r"installed: .*echo"):
        host.load()


def test_an_installed_plugin_stays_off_unless_enabled(echo_installed: None) -> None:
    """Installing a plugin does not enable it: only messagingProtocols does."""
    loaded: list[str] = []

    class Counting:
        def __init__(self, ep: Any) -> None:
            self.name = ep.name
            self.ep = ep

        def load(self) -> Any:
            loaded.append(self.name)
            return self.ep.load()

    def discover() -> list[Counting]:
        return [Counting(ep) for ep in installed_entry_points()]

    host = ProtocolHost(Config({"messagingProtocols": ""}), reactor, discover=discover)
    assert host.load() == []
    assert "echo" in host.available()
    assert loaded == []
