"""Transports move bytes between ranks: ``loopback`` (ranks as threads of one process) and
``tcp`` (full mesh between processes). See ``base.Transport`` for the contract.

Must not touch: the engine, negotiation, framework tensors: transports move bytes.
"""

from horovod.transport.base import SubTransport, Transport, as_bytes

__all__ = ["SubTransport", "Transport", "as_bytes"]
