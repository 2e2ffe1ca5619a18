"""The bookie: a storage node holding ledger entries in a journal, entry logs and an index.

Embed one with ``BookieServer`` (``polybroker.ledger.bookie.server``); run one as a process with
``polybroker bookie``."""
