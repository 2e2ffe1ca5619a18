"""The Kafka protocol handler.

``codec`` frames requests and responses (sans-IO, kafka-python's schema classes), ``records``
reads and writes record batches v2, ``apis`` answers each request over the Broker API,
``groups`` is the group coordinator, ``connection`` the Twisted glue and ``handler`` the plugin.
"""
