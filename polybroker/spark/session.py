"""A SparkSession for the example pipelines: workers run this interpreter."""

from __future__ import annotations

import os
import sys
from typing import Any


def local_session(app: str, master: str = "local[2]") -> Any:
    """Get or create a session; ``PYSPARK_PYTHON`` defaults to the driver's interpreter.

    The data source's reader and writer run in Spark's Python workers, which must import
    ``polybroker`` and ``pyarrow``: the driver's interpreter has both.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
