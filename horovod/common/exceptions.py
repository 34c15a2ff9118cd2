"""The one error hierarchy of pyhorovod. Upstream's public names are kept.

Must not touch: any layer above it (messages are built by the code that raises).
"""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed (mismatch across ranks, a lost rank, shutdown). Elastic mode
    treats it as recoverable: it restores the last committed state and re-initialises."""


class CollectiveRejected(HorovodInternalError):
    """The ranks' submissions of a collective disagree (dtype, shape, op, root, ... differ
    between ranks), or it cannot run now (ranks have joined): a mistake in the program rather
    than a failure of the job. The frameworks' own error types are raised for it where
    upstream raised them (TensorFlow: ``tf.errors.FailedPreconditionError``)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in elastic mode when the set of hosts changed; ``skip_sync`` is True when hosts
    were only removed, so the state does not need to be re-broadcast."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """A framework's version differs from the one a component was prepared for."""


class ConfigError(ValueError):
    """A HOROVOD_* variable or launcher flag has a value that cannot be used."""


class TransportError(HorovodInternalError):
    """Moving bytes between ranks failed. ``peer`` is the global rank at fault, if known."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class RendezvousError(RuntimeError):
    """The rendezvous store could not be reached, refused us, or timed out."""


SHUTDOWN_MESSAGE = (
    "Horovod has been shut down{why}. Collectives cannot run after shutdown(); this happens "
    "when one rank finished (or called hvd.shutdown()) while others still submit collectives, "
    "or after an error on one of the ranks (see the first error in the log)."
)


def shutdown_message(why: str = "") -> str:
    return SHUTDOWN_MESSAGE.format(why=f" ({why})" if why else "")
