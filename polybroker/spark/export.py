"""Batch export example: a topic's messages (from a start to the current end) -> Parquet.

    python -m polybroker.spark.export --service-url pulsar://127.0.0.1:6650 \
        --admin-url http://127.0.0.1:8080 --topic orders --path /tmp/orders.parquet

Writes every column of the data source (``key``, ``value``, ``__topic``, ``__messageId``,
``__publishTime``, ``__eventTime``, ``__messageProperties``) partitioned by publish date, and
prints one JSON line with the number of rows written.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from polybroker.spark.session import local_session


def export(spark: Any, args: argparse.Namespace) -> int:
    """Write the topic's messages to ``args.path``; return how many."""
    from pyspark.sql import functions as F

    df = (
        spark.read.format("pulsar")
        .option("service.url", args.service_url)
        .option("admin.url", args.admin_url)
        .option("topic", args.topic)
        .option("startingOffsets", args.starting_offsets)
        .load()
        .withColumn("publish_date", F.to_date("__publishTime"))
        .cache()
    )
    df.write.mode(args.mode).partitionBy("publish_date").parquet(args.path)
    count = int(df.count())
    df.unpersist()
    return count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--service-url", required=True)
    p.add_argument("--admin-url", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--starting-offsets", default="earliest")
    p.add_argument("--mode", default="errorifexists", choices=["errorifexists", "append"])
    p.add_argument("--master", default="local[2]")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark = local_session("polybroker-export", args.master)
    try:
        print(json.dumps({"rows": export(spark, args), "path": args.path}))
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main())
