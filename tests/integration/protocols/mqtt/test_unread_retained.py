"""An MQTT client that subscribes to the same filter again and again and does not read: every
SUBSCRIBE queues every retained match, so without a bound the broker's memory grows with each
one. Each SUBSCRIBE's copies replace those of the one before that have not left, and what was
asked for arrives, in order, once the client reads."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from standalone_process import rss_mb, start_standalone, stop_process, wait_until_idle

from polybroker.protocols.mqtt import codec as c

RETAINED = 200
BODY = 500
SUBSCRIBES = 3000  # 600,000 retained copies asked for: about 300 MB queued without a bound


def _publish_retained(port: int, prefix: str = "r") -> None:
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"retainer-{prefix}")
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    try:
        infos = [
            pub.publish(f"{prefix}/{i:03d}", b"%03d" % i + b"x" * (BODY - 3), qos=1, retain=True)
            for i in range(RETAINED)
        ]
        for info in infos:
            info.wait_for_publish(30)
            assert info.is_published()
    finally:
        pub.disconnect()
        pub.loop_stop()


def test_resubscribing_without_reading_holds_bounded_memory(tmp_path: Path) -> None:
    proc, ports = start_standalone(
        tmp_path / "data", tmp_path / "standalone.log", {"messagingProtocols": "mqtt"}
    )
    try:
        port = ports["mqttListenerPort"]
        _publish_retained(port)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            reader = c.PacketReader(level=c.LEVEL_311)
            s.sendall(c.encode(c.Connect("resubscriber", c.LEVEL_311), c.LEVEL_311))
            while not (got := reader.packets()):
                reader.feed(s.recv(65536))
            assert got == [c.ConnAck(False, 0)]
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            subscribe = b"".join(
                c.encode(c.Subscribe(i, [c.Subscription("r/#", 0)]), c.LEVEL_311)
                for i in range(1, SUBSCRIBES + 1)
            )
            s.setblocking(False)
            sent = 0
            deadline = time.monotonic() + 30
            while sent < len(subscribe) and time.monotonic() < deadline:
                try:
                    sent += s.send(subscribe[sent:])
                except BlockingIOError:
                    time.sleep(0.01)
            wait_until_idle(proc.pid)
            grown = rss_mb(proc.pid) - rss_before
            # 3 MB measured; 619 MB when every SUBSCRIBE queued its copies.
            assert grown < 50, f"the broker grew by {grown:.0f} MB"
            # Other clients are served meanwhile.
            _publish_retained(port, "other")
            # Reading, the SUBSCRIBEs are answered in order, and after the last SUBACK comes
            # every retained message.
            s.setblocking(True)
            subacks = 0
            after_last: list[str] = []
            while subacks < SUBSCRIBES or len(after_last) < RETAINED:
                if sent < len(subscribe):
                    sent += s.send(subscribe[sent:])
                data = s.recv(1 << 20)
                assert data, "connection closed"
                reader.feed(data)
                for packet in reader.packets():
                    if isinstance(packet, c.SubAck):
                        subacks += 1
                        assert packet.packet_id == subacks
                    else:
                        assert isinstance(packet, c.Publish)
                        assert packet.retain
                        if subacks == SUBSCRIBES:
                            after_last.append(packet.topic)
            assert after_last == [f"r/{i:03d}" for i in range(RETAINED)]
    finally:
        stop_process(proc)
