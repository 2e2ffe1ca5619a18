"""PySpark integration: read and write topics from Spark."""
