"""The Pulsar binary protocol (the handler named ``pulsar``).

Modules: ``PulsarApi.proto`` / ``PulsarApi_pb2`` (the wire messages; ``regen.sh`` rebuilds the
generated module), ``codec`` (sans-IO framing, checksums, metadata and batches), ``connection``
(one client connection over the Broker API), ``handler`` (``PulsarProtocolHandler``),
``inspector`` (keys, delays and sequence ids of stored entries) and ``schemas`` (per-topic
schema versions).
"""
