"""``format("pulsar")`` for PySpark: found by pyspark's lookup of ``pyspark_*`` modules.

A thin face over ``polybroker.spark``; see ``polybroker/spark/source.py`` for the options.
"""

from polybroker.spark.source import PulsarDataSource as DefaultSource

__all__ = ["DefaultSource"]
