#!/usr/bin/env python3
"""MQTT end-to-end throughput/latency benchmark (paho-mqtt 2.x, MQTT 3.1.1).

One subscriber process and one publisher process (separate processes so they do
not share a GIL).  The publisher sends N messages of SIZE bytes to one topic at
the given QoS; the subscriber (same QoS) receives them.  Every payload carries a
sequence number and a CLOCK_MONOTONIC timestamp taken just before publish(), so
latency = receive time - publish() call time (same host, same clock).

Modes:
  burst (default): publish as fast as paho accepts -> throughput; latency then
                   includes client/broker queueing of the burst.
  --rate R:        pace publishes at R msg/s -> latency at a fixed offered load.

Everything is bounded: --timeout seconds for the whole run (default 50 s).
Usage: bench_mqtt.py --host 127.0.0.1 --port 1883 --qos 1 -n 50000 --size 100
Prints one JSON line with the results.
"""

import argparse
import json
import multiprocessing as mp
import struct
import sys
import time
import uuid

import paho.mqtt.client as mqtt

HDR = struct.Struct("!QQ")  # seq, t_pub_ns


def make_client(cid, proto):
    c = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=cid,
        protocol=proto,
        clean_session=True,
    )
    return c


def subscriber(args, topic, ready, result_q):
    n = args.n
    lat = [0] * n
    seen = bytearray(n)
    st = {"count": 0, "dups": 0, "first": None, "last": None}
    c = make_client("bsub-" + uuid.uuid4().hex[:8], mqtt.MQTTv311)
    if args.sub_inflight:
        c.max_inflight_messages_set(args.sub_inflight)

    def on_connect(client, userdata, flags, rc, props):
        client.subscribe(topic, qos=args.qos)

    def on_subscribe(client, userdata, mid, rcs, props):
        ready.set()

    def on_message(client, userdata, msg):
        now = time.monotonic_ns()
        seq, t0 = HDR.unpack_from(msg.payload)
        if seen[seq]:
            st["dups"] += 1
            return
        seen[seq] = 1
        lat[st["count"]] = now - t0
        st["count"] += 1
        if st["first"] is None:
            st["first"] = now
        st["last"] = now

    c.on_connect = on_connect
    c.on_subscribe = on_subscribe
    c.on_message = on_message
    c.connect(args.host, args.port, keepalive=60)
    c.loop_start()
    deadline = time.monotonic() + args.timeout
    idle_since = None
    last_count = -1
    while time.monotonic() < deadline and st["count"] < n:
        time.sleep(0.05)
        # stop early if nothing new arrived for --idle seconds after traffic started
        if st["count"] != last_count:
            last_count, idle_since = st["count"], time.monotonic()
        elif st["count"] > 0 and time.monotonic() - idle_since > args.idle:
            break
    c.disconnect()
    c.loop_stop()
    cnt = st["count"]
    ordered = sorted(lat[:cnt])

    def pct(p):
        return round(ordered[min(cnt - 1, int(p * cnt))] / 1e6, 3) if cnt else None

    result_q.put(
        {
            "received": cnt,
            "dups": st["dups"],
            "first_rx_ns": st["first"],
            "last_rx_ns": st["last"],
            "lat_ms_p50": pct(0.50),
            "lat_ms_p99": pct(0.99),
            "lat_ms_max": round(ordered[-1] / 1e6, 3) if cnt else None,
        }
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--qos", type=int, default=0, choices=[0, 1, 2])
    ap.add_argument("-n", type=int, default=50000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rate", type=float, default=0, help="msg/s pacing (0 = burst)")
    ap.add_argument(
        "--pub-inflight",
        type=int,
        default=0,
        help="paho max_inflight_messages for the publisher (0 = paho default 20)",
    )
    ap.add_argument("--sub-inflight", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=50)
    ap.add_argument("--idle", type=float, default=5, help="sub gives up after this many idle s")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    assert args.size >= HDR.size
    topic = "bench/" + uuid.uuid4().hex[:8]

    ctx = mp.get_context("fork")
    ready, result_q = ctx.Event(), ctx.Queue()
    sp = ctx.Process(target=subscriber, args=(args, topic, ready, result_q), daemon=True)
    sp.start()
    if not ready.wait(10):
        print(json.dumps({"error": "subscriber not ready"}))
        sp.kill()
        sys.exit(1)

    pad = b"x" * (args.size - HDR.size)
    done = {"acked": 0}
    pub = make_client("bpub-" + uuid.uuid4().hex[:8], mqtt.MQTTv311)
    if args.pub_inflight:
        pub.max_inflight_messages_set(args.pub_inflight)

    def on_publish(client, userdata, mid, rc, props):
        done["acked"] += 1

    pub.on_publish = on_publish
    pub.connect(args.host, args.port, keepalive=60)
    pub.loop_start()
    time.sleep(0.2)
    deadline = time.monotonic() + args.timeout
    t_start = time.monotonic_ns()
    interval = 1e9 / args.rate if args.rate else 0
    for i in range(args.n):
        if interval:
            target = t_start + i * interval
            while time.monotonic_ns() < target:
                time.sleep(max(0.0, (target - time.monotonic_ns()) / 1e9 - 0.0002))
        pub.publish(topic, HDR.pack(i, time.monotonic_ns()) + pad, qos=args.qos)
        if time.monotonic() > deadline:
            break
    t_called = time.monotonic_ns()
    while done["acked"] < args.n and time.monotonic() < deadline:
        time.sleep(0.005)
    t_pub_done = time.monotonic_ns()
    res = result_q.get(timeout=max(1.0, deadline - time.monotonic() + args.idle + 5))
    sp.join(5)
    pub.disconnect()
    pub.loop_stop()
    end = res["last_rx_ns"] or t_pub_done
    out = {
        "label": args.label,
        "host": args.host,
        "port": args.port,
        "qos": args.qos,
        "n": args.n,
        "size": args.size,
        "rate": args.rate or "burst",
        "pub_inflight": args.pub_inflight or 20,
        "published_acked": done["acked"],
        "received": res["received"],
        "dups": res["dups"],
        "pub_calls_s": round((t_called - t_start) / 1e9, 3),
        "pub_msgs_per_s": round(done["acked"] / ((t_pub_done - t_start) / 1e9), 1),
        "e2e_s": round((end - t_start) / 1e9, 3),
        "e2e_msgs_per_s": round(res["received"] / ((end - t_start) / 1e9), 1)
        if res["received"]
        else 0,
        "lat_ms_p50": res["lat_ms_p50"],
        "lat_ms_p99": res["lat_ms_p99"],
        "lat_ms_max": res["lat_ms_max"],
        "paho": __import__("paho.mqtt").mqtt.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
