"""The storage layer: bookies, replicated ledgers, managed ledgers and cursors.

Import the public API from ``polybroker.ledger.api``."""
