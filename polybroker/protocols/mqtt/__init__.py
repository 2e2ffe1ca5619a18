"""MQTT 3.1.1 and 5.0 (the handler named ``mqtt``).

Modules: ``codec`` (sans-IO packets, properties and reason codes), ``topics`` (filters and the
reversible mapping of MQTT names onto ``public/default`` topics), ``session`` (sessions,
subscriptions, in-flight messages and retained messages over the Broker API), ``connection``
(one client connection) and ``handler`` (``MqttProtocolHandler``).
"""
