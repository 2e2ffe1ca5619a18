"""polybroker: a Pulsar-style message broker serving Pulsar, Kafka, MQTT and AMQP from one log."""

__version__ = "0.1.0"
