"""An MQTT client sending QoS 0 PUBLISHes as fast as its socket takes them, faster than
storage writes: the broker stops reading it while its stores under way pass their bound, so
what waits stays in the client's socket, not in the broker's memory; all of it is stored."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

from standalone_process import (
    SMALL_CACHES,
    rss_mb,
    start_standalone,
    stop_and_remove,
    wait_until_idle,
)

from polybroker.protocols.mqtt import codec as c

BODY = 10_000
ROUNDS = 100  # of 1000 PUBLISHes: 1 GB in all


def _stored(http_port: int) -> int:
    url = f"http://127.0.0.1:{http_port}/admin/v2/persistent/public/default/flood/stats"
    return int(json.loads(urllib.request.urlopen(url, timeout=30).read())["msgInCounter"])


def test_a_qos0_publisher_faster_than_storage_is_slowed_not_buffered(tmp_path: Path) -> None:
    config = {"messagingProtocols": "mqtt", **SMALL_CACHES}
    proc, ports = start_standalone(tmp_path / "data", tmp_path / "standalone.log", config)
    try:
        with socket.create_connection(("127.0.0.1", ports["mqttListenerPort"]), timeout=60) as s:
            s.sendall(c.encode(c.Connect("flood", c.LEVEL_311), c.LEVEL_311))
            reader = c.PacketReader(level=c.LEVEL_311)
            while not (got := reader.packets()):
                reader.feed(s.recv(100))
            assert got == [c.ConnAck(False, 0)]
            wait_until_idle(proc.pid)
            rss_before = rss_mb(proc.pid)
            peak = 0.0
            body = b"x" * BODY
            burst = c.encode(c.Publish("flood", body, 0), c.LEVEL_311) * 1000
            for _ in range(ROUNDS):
                s.sendall(burst)
                peak = max(peak, rss_mb(proc.pid) - rss_before)
            deadline = time.monotonic() + 120
            while _stored(ports["webServicePort"]) < ROUNDS * 1000:
                assert time.monotonic() < deadline, "not everything was stored"
                peak = max(peak, rss_mb(proc.pid) - rss_before)
                time.sleep(0.1)
            assert _stored(ports["webServicePort"]) == ROUNDS * 1000
            # 175 MB measured (32 MiB of stores under way, their copies on the way to the
            # bookie, 32 MB of caches); 674 MB without the bound, and growing with the flood.
            assert peak < 300, f"the broker grew by {peak:.0f} MB"
    finally:
        stop_and_remove(proc, tmp_path / "data")
