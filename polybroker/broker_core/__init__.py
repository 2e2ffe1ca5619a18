"""The broker: topics, subscriptions, dispatchers, admin API, protocol-handler host."""
