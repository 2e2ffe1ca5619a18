"""``polybroker standalone`` with MQTT as a real process: what was acknowledged survives kill -9
(QoS 1 messages for a persistent session, retained messages, the session itself), and a QoS 2
publish stored just before kill -9 is not stored again when the client resends it, and a QoS 2
message a subscriber PUBRECed before kill -9 reaches its application once."""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from mqtt_harness import WAIT_S, Client
from paho.mqtt.enums import CallbackAPIVersion
from standalone_process import start_standalone, stop_process


class Process:
    """A standalone process serving MQTT on free ports; stopped by PID at teardown."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        config = {"messagingProtocols": "mqtt", "statsUpdateFrequencyInSecs": 0}
        self.proc, ports = start_standalone(data_dir, log, config)
        self.mqtt_port = ports["mqttListenerPort"]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in started:
        p.stop()


def test_kill9_loses_no_acknowledged_message(processes: list[Process], tmp_path: Path) -> None:
    """QoS 1 publishes acknowledged before kill -9 reach the persistent session after a
    restart on the same data dir, which finds its session; the retained message survives."""
    data = tmp_path / "data"
    first = Process(data, tmp_path / "standalone.log")
    processes.append(first)
    dev = Client(first.mqtt_port, "dev", clean=False)
    dev.subscribe("k9/#", 1)
    dev.close()
    pub = Client(first.mqtt_port, "pub")
    n = 200
    for i in range(n):
        pub.publish(f"k9/{i % 4}", str(i).encode(), 1)
    pub.publish("k9/retained", b"kept", 1, retain=True)
    pub.drop()
    first.stop(signal.SIGKILL)

    second = Process(data, tmp_path / "standalone.log")
    processes.append(second)
    back = Client(second.mqtt_port, "dev", clean=False)
    assert back.session_present
    got = {m.payload for m in back.get_n(n + 1, timeout=30)}
    assert got == {str(i).encode() for i in range(n)} | {b"kept"}
    back.close()
    late = Client(second.mqtt_port, "late")
    late.subscribe("k9/retained", 0)
    m = late.get(timeout=10)
    assert (m.payload, m.retain) == (b"kept", True)
    late.close()


_PUBREC, _PUBREL, _PUBCOMP = 5, 6, 7


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def _packet_length(buf: bytes) -> int | None:
    """The whole length of the MQTT packet at the start of ``buf`` (None: not known yet)."""
    value, shift = 0, 0
    for i in range(1, min(len(buf), 5)):
        value |= (buf[i] & 0x7F) << shift
        shift += 7
        if not buf[i] & 0x80:
            return 1 + i + value
    return None


class PacketProxy:
    """A loopback TCP proxy to the broker's current MQTT port that records the type of every
    packet each way (``seen[direction]``, direction ``"up"`` to the broker or ``"down"``) and
    drops the packets of the types in ``drop[direction]`` (``dropped`` is set when it did)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.drop: dict[str, set[int]] = {"up": set(), "down": set()}
        self.dropped = threading.Event()
        self.seen: dict[str, list[int]] = {"up": [], "down": []}
        self.cond = threading.Condition()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=WAIT_S)
            up.settimeout(None)
            self._socks += [down, up]
            for args in ((down, up, "up"), (up, down, "down")):
                t = threading.Thread(target=self._pipe, args=args, daemon=True)
                self._threads.append(t)
                t.start()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                buf += data
                while (n := _packet_length(buf)) is not None and len(buf) >= n:
                    packet, buf = buf[:n], buf[n:]
                    ptype = packet[0] >> 4
                    with self.cond:
                        self.seen[direction].append(ptype)
                        self.cond.notify_all()
                    if ptype in self.drop[direction]:
                        self.dropped.set()
                        continue
                    dst.sendall(packet)
        _close(src, dst)

    def wait_for(self, direction: str, ptype: int, after: int = 0) -> bool:
        """Wait (bounded) until a packet of ``ptype`` went ``direction`` after the first
        ``after`` recorded that way."""
        with self.cond:
            return self.cond.wait_for(lambda: ptype in self.seen[direction][after:], WAIT_S)

    def close(self) -> None:
        _close(self.listener, *self._socks)
        for t in self._threads:
            t.join(WAIT_S)


def test_kill9_after_a_qos2_store_does_not_store_the_resend_again(
    processes: list[Process], tmp_path: Path
) -> None:
    """A QoS 2 publish is stored, its PUBREC lost and the broker killed -9; the paho client
    resends it with DUP to the restarted broker, which answers without storing it again: the
    persistent subscriber gets exactly one copy, then the next message."""
    data = tmp_path / "data"
    first = Process(data, tmp_path / "standalone.log")
    processes.append(first)
    watcher = Client(first.mqtt_port, "watcher", clean=False)
    assert watcher.subscribe("q2/t", 2) == [2]
    watcher.close()
    proxy = PacketProxy(first.mqtt_port)
    connected, gone = threading.Event(), threading.Event()
    dev = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id="dev-q2",
        clean_session=False,
        reconnect_on_failure=False,
    )

    def on_connect(*_: Any) -> None:
        connected.set()

    def on_disconnect(*_: Any) -> None:
        gone.set()

    dev.on_connect = on_connect
    dev.on_disconnect = on_disconnect
    try:
        dev.connect("127.0.0.1", proxy.port, keepalive=60)
        dev.loop_start()
        assert connected.wait(WAIT_S)
        proxy.drop["down"].add(_PUBREC)
        info = dev.publish("q2/t", b"exactly-once", 2)
        assert proxy.dropped.wait(WAIT_S), "the broker never answered PUBREC"
        first.stop(signal.SIGKILL)
        assert gone.wait(WAIT_S)
        dev.loop_stop()
        assert not info.is_published()

        second = Process(data, tmp_path / "standalone.log")
        processes.append(second)
        proxy.upstream_port = second.mqtt_port
        proxy.drop["down"].clear()
        connected.clear()
        dev.reconnect()  # resends the PUBLISH with DUP
        dev.loop_start()
        assert connected.wait(WAIT_S)
        info.wait_for_publish(WAIT_S)
        assert info.is_published()
        after = dev.publish("q2/t", b"next", 1)
        after.wait_for_publish(WAIT_S)
        assert after.is_published()

        back = Client(second.mqtt_port, "watcher", clean=False)
        assert back.session_present
        got = back.get_n(2, timeout=30)
        # (paho hands a QoS 2 message over at PUBREL, so the two may come in either order)
        assert sorted(m.payload for m in got) == [b"exactly-once", b"next"]
        assert back.nothing_more()
        back.close()
    finally:
        dev.disconnect()
        dev.loop_stop()
        proxy.close()


def test_kill9_before_pubcomp_delivers_a_qos2_message_to_the_subscriber_once(
    processes: list[Process], tmp_path: Path
) -> None:
    """A persistent QoS 2 subscriber (paho) gets a message and PUBRECs it; the broker's PUBREL
    hands it to the application; the client's PUBCOMP is lost and the broker killed -9. After
    the restart the client resumes its session: the broker sends PUBREL again (answered with
    PUBCOMP), never the message, so the application has it exactly once, then the next one."""
    data = tmp_path / "data"
    first = Process(data, tmp_path / "standalone.log")
    processes.append(first)
    proxy = PacketProxy(first.mqtt_port)
    got: queue.Queue[bytes] = queue.Queue()
    connected, gone, subscribed = threading.Event(), threading.Event(), threading.Event()
    dev = paho.Client(
        CallbackAPIVersion.VERSION2,
        client_id="sub-q2",
        clean_session=False,
        reconnect_on_failure=False,
    )
    dev.on_connect = lambda *_: connected.set()
    dev.on_disconnect = lambda *_: gone.set()
    dev.on_subscribe = lambda *_: subscribed.set()
    dev.on_message = lambda _c, _u, msg: got.put(msg.payload)
    try:
        dev.connect("127.0.0.1", proxy.port, keepalive=60)
        dev.loop_start()
        assert connected.wait(WAIT_S)
        dev.subscribe("q2o/t", 2)
        assert subscribed.wait(WAIT_S)
        proxy.drop["up"].add(_PUBCOMP)
        pub = Client(first.mqtt_port, "pub-q2o")
        pub.publish("q2o/t", b"exactly-once", 2)
        pub.drop()
        assert proxy.dropped.wait(WAIT_S), "the client never sent PUBCOMP"
        assert got.get(timeout=WAIT_S) == b"exactly-once"  # handed over at PUBREL
        first.stop(signal.SIGKILL)
        assert gone.wait(WAIT_S)
        dev.loop_stop()

        second = Process(data, tmp_path / "standalone.log")
        processes.append(second)
        proxy.upstream_port = second.mqtt_port
        proxy.drop["up"].clear()
        with proxy.cond:
            down_before, up_before = len(proxy.seen["down"]), len(proxy.seen["up"])
        connected.clear()
        dev.reconnect()
        dev.loop_start()
        assert connected.wait(WAIT_S)
        assert proxy.wait_for("down", _PUBREL, down_before), "no PUBREL after the restart"
        assert proxy.wait_for("up", _PUBCOMP, up_before), "the flow did not complete"
        pub = Client(second.mqtt_port, "pub-q2o")
        pub.publish("q2o/t", b"next", 2)
        pub.close()
        # The next message arrives after anything of the first one the broker sent again.
        received = [got.get(timeout=30)]
        while received[-1] != b"next":
            received.append(got.get(timeout=WAIT_S))
        assert received == [b"next"]
    finally:
        dev.disconnect()
        dev.loop_stop()
        proxy.close()
