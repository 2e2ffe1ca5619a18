"""Streaming ETL example: JSON readings -> per-sensor windowed aggregates -> another topic.

    python -m polybroker.spark.etl --service-url pulsar://127.0.0.1:6650 \
        --admin-url http://127.0.0.1:8080 --input readings --output aggregates \
        --checkpoint /tmp/etl-ckpt [--available-now] [--window "1 minute"]

Each input message is JSON ``{"sensor": str, "reading": float}``; its event time is the
message's event time, else its publish time. Each output message has the sensor as key and JSON
``{"sensor", "window_start", "window_end", "count", "avg", "max"}`` as value; a window is
republished (update mode) whenever a micro-batch changes it, so the newest message per
``(sensor, window_start)`` holds its current figures. Unparseable messages are dropped.
"""

from __future__ import annotations

import argparse
from typing import Any

from polybroker.spark.session import local_session


def build(spark: Any, args: argparse.Namespace) -> Any:
    """Start the streaming query and return it."""
    from pyspark.sql import functions as F

    source = {"service.url": args.service_url, "admin.url": args.admin_url}
    raw = (
        spark.readStream.format("pulsar")
        .options(**source, topic=args.input, startingOffsets=args.starting_offsets)
        .load()
    )
    parsed = raw.select(
        F.from_json(F.col("value").cast("string"), "sensor STRING, reading DOUBLE").alias("j"),
        F.coalesce(F.col("__eventTime"), F.col("__publishTime")).alias("ts"),
    ).where(F.col("j.sensor").isNotNull() & F.col("j.reading").isNotNull())
    aggregated = (
        parsed.withWatermark("ts", args.watermark)
        .groupBy(F.window("ts", args.window).alias("w"), F.col("j.sensor").alias("sensor"))
        .agg(
            F.count("*").alias("count"),
            F.avg("j.reading").alias("avg"),
            F.max("j.reading").alias("max"),
        )
    )
    out = aggregated.select(
        F.col("sensor").alias("key"),
        F.to_json(
            F.struct(
                "sensor",
                F.date_format("w.start", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_start"),
                F.date_format("w.end", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_end"),
                "count",
                "avg",
                "max",
            )
        ).alias("value"),
    )
    sink = {"service.url": args.service_url, "topic": args.output}

    def publish(batch: Any, _batch_id: int) -> None:
        # Python data source sinks take append mode only; update mode goes through
        # foreachBatch, which publishes each micro-batch's changed windows with the batch writer.
        batch.write.format("pulsar").mode("append").options(**sink).save()

    writer = (
        out.writeStream.outputMode("update")
        .foreachBatch(publish)
        .option("checkpointLocation", args.checkpoint)
    )
    if args.available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=args.interval)
    return writer.start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--service-url", required=True)
    p.add_argument("--admin-url", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--starting-offsets", default="earliest")
    p.add_argument("--window", default="1 minute")
    p.add_argument("--watermark", default="10 minutes")
    p.add_argument("--interval", default="5 seconds", help="processing-time trigger period")
    p.add_argument("--available-now", action="store_true", help="process the backlog and stop")
    p.add_argument("--master", default="local[2]")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark = local_session("polybroker-etl", args.master)
    try:
        query = build(spark, args)
        query.awaitTermination()
        return 0 if query.exception() is None else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main())
