"""A flood of connections against a standalone with few file descriptors: the broker refuses
what its budget has no room for, and its bookie, which shares those descriptors, keeps
writing (it once failed for good, unable to open an index file, and every later send timed
out)."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pulsar
import pytest
from standalone_process import PORT_FLAGS, READY, stop_process, wait_for_line

FD_LIMIT = 256  # the budget is then 128 connections; the bookie keeps the rest
FLOOD = 400
SENDS = 40_000


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


@pytest.mark.timeout(180)
def test_a_connection_flood_leaves_storage_its_descriptors(tmp_path: Path) -> None:
    log = tmp_path / "standalone.log"
    cmd = [sys.executable, "-m", "polybroker", "standalone", "--data-dir", str(tmp_path / "d")]
    for flag in PORT_FLAGS:
        cmd += [flag, "0"]
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, preexec_fn=_limited)
    flood: list[socket.socket] = []
    try:
        line = wait_for_line(proc, READY, log, 60, "standalone")
        ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
        client = pulsar.Client(
            f"pulsar://127.0.0.1:{ports['brokerServicePort']}",
            operation_timeout_seconds=30,
            logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error),
        )
        try:
            producer = client.create_producer(
                "flooded", send_timeout_millis=30_000, block_if_queue_full=True
            )
            for _ in range(FLOOD):
                flood.append(socket.create_connection(("127.0.0.1", ports["kafkaListenerPort"])))
            # 40 MB while the flood is on: checkpoints open entry logs and index files.
            results: list[object] = []
            all_done = threading.Event()

            def done(res: object, _id: object) -> None:
                results.append(res)
                if len(results) == SENDS:
                    all_done.set()

            for i in range(SENDS):
                producer.send_async(b"%08d" % i + bytes(992), done)
            assert all_done.wait(60), f"{len(results)} of {SENDS} sends completed"
            assert set(results) == {pulsar.Result.Ok}
            for s in flood:
                s.close()
            flood.clear()
            consumer = client.subscribe(
                "flooded", "check", initial_position=pulsar.InitialPosition.Earliest
            )
            for i in range(SENDS):
                msg = consumer.receive(30_000)
                assert msg.data()[:8] == b"%08d" % i
            producer.send(b"after the flood")
            assert consumer.receive(30_000).data() == b"after the flood"
        finally:
            client.close()
    finally:
        for s in flood:
            s.close()
        stop_process(proc)
    written = log.read_text()
    assert "too many connections" in written
    assert not re.search(r"^\S+ (error|critical) |Traceback", written, re.MULTILINE), written[
        -3000:
    ]
