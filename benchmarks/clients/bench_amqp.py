#!/usr/bin/env python3
"""AMQP 0-9-1 publish/consume benchmark with pika (1.4.x) against any broker.

Publisher modes (--mode):
  noconfirm      BlockingConnection, basic_publish in a loop, no confirms.
  confirm        BlockingConnection + confirm_delivery(): every basic_publish waits
                 for its broker ack (one confirm round trip per message).
  confirm-async  SelectConnection + confirm_delivery(callback): up to --window
                 unconfirmed messages outstanding (pipelined/batched confirms; the
                 broker may ack with multiple=True).
Consumer: BlockingConnection, basic_qos(prefetch_count=--prefetch),
  basic_consume(auto_ack=False), basic_ack per message (or multiple=True every
  --ack-every messages).
--consume concurrent: consumer process runs while the publisher publishes
                      (end-to-end rate and latency from a timestamp in the body);
--consume after:      publish everything first, then drain the queue (consume-only rate);
--consume none:       publish only.
The queue is a fresh server-named-like queue "bench-<id>" on the default exchange,
deleted at the end.  --persistent uses a durable queue and delivery_mode=2.
--fanout N: publish to a fresh fanout exchange with N queues bound to it instead; the
  consumer reads all N (one channel) and rates count deliveries (N per message).
Every run is bounded by --timeout seconds.  Prints one JSON line.
Usage: bench_amqp.py --host 127.0.0.1 --port 5672 --mode confirm-async -n 50000
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import struct
import sys
import time
import uuid

import pika

HDR = struct.Struct("!QQ")  # seq, t_pub_ns (CLOCK_MONOTONIC, same host)


def params(a):
    return pika.ConnectionParameters(
        host=a.host,
        port=a.port,
        virtual_host=a.vhost,
        credentials=pika.PlainCredentials(a.user, a.password),
        heartbeat=60,
        blocked_connection_timeout=30,
    )


def fanout_queues(a, q):
    return [f"{q}-{i}" for i in range(a.fanout)]


def declare(ch, a, q):
    if not a.fanout:
        ch.queue_declare(q, durable=a.persistent, auto_delete=False)
        return
    ch.exchange_declare(a.exchange, "fanout", durable=a.persistent)
    for name in fanout_queues(a, q):
        ch.queue_declare(name, durable=a.persistent, auto_delete=False)
        ch.queue_bind(name, a.exchange)


def consumer(a, q, ready, result_q, expect):
    conn = pika.BlockingConnection(params(a))
    ch = conn.channel()
    declare(ch, a, q)
    ch.basic_qos(prefetch_count=a.prefetch)
    n = expect
    lat = [0] * n
    st = {"count": 0, "first": None, "last": None, "last_change": time.monotonic(), "unacked": 0}

    def on_msg(chan, method, props, body):
        now = time.monotonic_ns()
        _seq, t0 = HDR.unpack_from(body)
        if st["count"] < n:
            lat[st["count"]] = now - t0
        st["count"] += 1
        st["last_change"] = time.monotonic()
        if st["first"] is None:
            st["first"] = now
        st["last"] = now
        st["unacked"] += 1
        if st["unacked"] >= a.ack_every or st["count"] >= n:
            chan.basic_ack(method.delivery_tag, multiple=a.ack_every > 1)
            st["unacked"] = 0
        if st["count"] >= n:
            chan.stop_consuming()

    deadline = time.monotonic() + a.timeout

    def watchdog():
        if time.monotonic() > deadline or (
            st["count"] and time.monotonic() - st["last_change"] > a.idle
        ):
            ch.stop_consuming()
        else:
            conn.call_later(0.2, watchdog)

    conn.call_later(0.2, watchdog)
    for name in fanout_queues(a, q) if a.fanout else [q]:
        ch.basic_consume(name, on_msg, auto_ack=False)
    t_start_consume = time.monotonic_ns()
    ready.set()
    ch.start_consuming()
    cnt = min(st["count"], n)
    ordered = sorted(lat[:cnt])

    def pct(p):
        return round(ordered[min(cnt - 1, int(p * cnt))] / 1e6, 3) if cnt else None

    with contextlib.suppress(Exception):
        conn.close()
    result_q.put(
        {
            "received": st["count"],
            "first_rx_ns": st["first"],
            "last_rx_ns": st["last"],
            "t_start_consume_ns": t_start_consume,
            "lat_ms_p50": pct(0.5),
            "lat_ms_p99": pct(0.99),
            "lat_ms_max": round(ordered[-1] / 1e6, 3) if cnt else None,
        }
    )


def publish_blocking(a, q, confirm):
    conn = pika.BlockingConnection(params(a))
    ch = conn.channel()
    declare(ch, a, q)
    if confirm:
        ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2 if a.persistent else 1)
    pad = b"x" * (a.size - HDR.size)
    deadline = time.monotonic() + a.timeout
    t0 = time.monotonic_ns()
    sent = 0
    interval = 1e9 / a.rate if a.rate else 0
    for i in range(a.n):
        if interval:
            target = t0 + i * interval
            while time.monotonic_ns() < target:
                time.sleep(max(0.0, (target - time.monotonic_ns()) / 1e9 - 0.0002))
        # with confirm_delivery() this raises on nack/return and blocks until acked
        ch.basic_publish(a.exchange, a.key, HDR.pack(i, time.monotonic_ns()) + pad, props)
        sent += 1
        if time.monotonic() > deadline:
            break
    t1 = time.monotonic_ns()
    # round trip so the broker has processed all publishes on this channel
    ch.queue_declare(fanout_queues(a, q)[0] if a.fanout else q, passive=True)
    t2 = time.monotonic_ns()
    conn.close()
    return {
        "sent": sent,
        "confirmed": sent if confirm else None,
        "pub_s": (t1 - t0) / 1e9,
        "pub_sync_s": (t2 - t0) / 1e9,
        "t0": t0,
    }


def publish_async(a, q):
    """SelectConnection with a window of unconfirmed publishes."""
    props = pika.BasicProperties(delivery_mode=2 if a.persistent else 1)
    pad = b"x" * (a.size - HDR.size)
    st = {
        "sent": 0,
        "acked": 0,
        "nacked": 0,
        "t0": None,
        "t1": None,
        "ch": None,
        "outstanding": set(),
    }
    deadline = time.monotonic() + a.timeout

    def pump():
        ch = st["ch"]
        while st["sent"] < a.n and len(st["outstanding"]) < a.window:
            ch.basic_publish(
                a.exchange, a.key, HDR.pack(st["sent"], time.monotonic_ns()) + pad, props
            )
            st["sent"] += 1
            st["outstanding"].add(st["sent"])  # delivery tags are 1, 2, 3, ... per channel

    def on_confirm(frame):
        m = frame.method
        if m.multiple:
            done = [t for t in st["outstanding"] if t <= m.delivery_tag]
        else:
            done = [m.delivery_tag] if m.delivery_tag in st["outstanding"] else []
        st["outstanding"].difference_update(done)
        key = "acked" if isinstance(m, pika.spec.Basic.Ack) else "nacked"
        st[key] += len(done)
        if st["acked"] + st["nacked"] >= a.n or time.monotonic() > deadline:
            st["t1"] = time.monotonic_ns()
            conn.close()
        else:
            pump()

    def on_declared(_frame):
        st["ch"].confirm_delivery(on_confirm, callback=lambda _f: start())

    def start():
        st["t0"] = time.monotonic_ns()
        pump()

    def on_channel(ch):
        st["ch"] = ch
        if a.fanout:  # declared (blocking) before the run
            on_declared(None)
            return
        ch.queue_declare(q, durable=a.persistent, auto_delete=False, callback=on_declared)

    def on_open(c):
        c.channel(on_open_callback=on_channel)

    def on_timeout():
        if st["t1"] is None:
            st["t1"] = time.monotonic_ns()
            conn.close()

    conn = pika.SelectConnection(
        params(a),
        on_open_callback=on_open,
        on_open_error_callback=lambda c, e: c.ioloop.stop(),
        on_close_callback=lambda c, r: c.ioloop.stop(),
    )
    conn.ioloop.call_later(a.timeout, on_timeout)
    conn.ioloop.start()
    return {
        "sent": st["sent"],
        "confirmed": st["acked"],
        "nacked": st["nacked"],
        "pub_s": (st["t1"] - st["t0"]) / 1e9,
        "pub_sync_s": (st["t1"] - st["t0"]) / 1e9,
        "t0": st["t0"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5672)
    ap.add_argument("--vhost", default="/")
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument(
        "--mode", default="noconfirm", choices=["noconfirm", "confirm", "confirm-async"]
    )
    ap.add_argument("--consume", default="concurrent", choices=["concurrent", "after", "none"])
    ap.add_argument("-n", type=int, default=50000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--window", type=int, default=1000, help="confirm-async: max unconfirmed")
    ap.add_argument("--prefetch", type=int, default=1000)
    ap.add_argument("--ack-every", type=int, default=1)
    ap.add_argument("--persistent", action="store_true")
    ap.add_argument(
        "--rate", type=float, default=0, help="noconfirm/confirm: msg/s pacing (0 = burst)"
    )
    ap.add_argument("--timeout", type=float, default=50)
    ap.add_argument("--idle", type=float, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--fanout", type=int, default=0, help="N queues on a fanout exchange")
    a = ap.parse_args()
    q = "bench-" + uuid.uuid4().hex[:8]
    a.exchange, a.key = ("bench-fx-" + q[6:], "") if a.fanout else ("", q)
    per_message = max(a.fanout, 1)  # deliveries per published message
    if a.fanout:
        setup = pika.BlockingConnection(params(a))
        declare(setup.channel(), a, q)
        setup.close()
    ctx = mp.get_context("fork")
    ready, result_q = ctx.Event(), ctx.Queue()
    cons = None
    if a.consume == "concurrent":
        expect = a.n * per_message
        cons = ctx.Process(target=consumer, args=(a, q, ready, result_q, expect), daemon=True)
        cons.start()
        if not ready.wait(15):
            print(json.dumps({"error": "consumer not ready"}))
            sys.exit(1)
    if a.mode == "confirm-async":
        pr = publish_async(a, q)
    else:
        pr = publish_blocking(a, q, a.mode == "confirm")
    out = {
        "label": a.label,
        "host": a.host,
        "port": a.port,
        "mode": a.mode,
        "consume": a.consume,
        "n": a.n,
        "size": a.size,
        "rate": a.rate or "burst",
        "persistent": a.persistent,
        "prefetch": a.prefetch,
        "ack_every": a.ack_every,
        "window": a.window if a.mode == "confirm-async" else None,
        "fanout": a.fanout,
        "sent": pr["sent"],
        "confirmed": pr["confirmed"],
        "pub_msgs_per_s": round(pr["sent"] / pr["pub_sync_s"], 1),
    }
    if a.consume == "after":
        expect = pr["sent"] * per_message
        cons = ctx.Process(target=consumer, args=(a, q, ready, result_q, expect), daemon=True)
        cons.start()
    if cons is not None:
        res = result_q.get(timeout=a.timeout + a.idle + 10)
        cons.join(5)
        out["received"] = res["received"]
        if a.consume == "concurrent":
            e2e = (res["last_rx_ns"] - pr["t0"]) / 1e9 if res["last_rx_ns"] else None
            out["e2e_s"] = round(e2e, 3) if e2e else None
            out["e2e_msgs_per_s"] = round(res["received"] / e2e, 1) if e2e else 0
            out["lat_ms_p50"], out["lat_ms_p99"], out["lat_ms_max"] = (
                res["lat_ms_p50"],
                res["lat_ms_p99"],
                res["lat_ms_max"],
            )
        else:
            dur = (
                (res["last_rx_ns"] - res["t_start_consume_ns"]) / 1e9 if res["last_rx_ns"] else None
            )
            out["consume_s"] = round(dur, 3) if dur else None
            out["consume_msgs_per_s"] = round(res["received"] / dur, 1) if dur else 0
    # clean up the queue
    try:
        c = pika.BlockingConnection(params(a))
        cch = c.channel()
        for name in fanout_queues(a, q) if a.fanout else [q]:
            cch.queue_delete(name)
        if a.fanout:
            cch.exchange_delete(a.exchange)
        c.close()
    except Exception as e:
        out["cleanup_error"] = repr(e)
    out["pika"] = pika.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
