"""Key-value stores used to bootstrap the transports: an HTTP server hosted by horovodrun,
its client, and an in-memory store for single-process runs and thread-based tests.

Must not touch: transports or the engine (it only stores bytes under keys).
"""

from horovod.rendezvous.store import HTTPStoreClient, MemoryStore, Store

__all__ = ["HTTPStoreClient", "MemoryStore", "Store"]
