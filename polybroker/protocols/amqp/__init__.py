"""AMQP 0-9-1 protocol handler: pika applications served over the broker's topics.

``codec`` (sans-IO frames and methods), ``model`` (exchanges, queues, bindings and routing),
``connection`` (Twisted glue: one client connection and its channels), ``handler`` (the plugin).
"""
