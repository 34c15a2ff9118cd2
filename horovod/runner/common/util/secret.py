"""Upstream's ``horovod.runner.common.util.secret``: job secrets and message digests, on the
project's HMAC-SHA256 (``horovod.common.secret``, what horovodrun's rendezvous uses).

Must not touch: the secret of a running job (these only make and check values).
"""

from __future__ import annotations

import hmac
import secrets

from horovod.common.secret import DIGEST

SECRET_LENGTH = 32  # bytes


def make_secret_key() -> bytes:
    """A new random secret, ``SECRET_LENGTH`` bytes."""
    return secrets.token_bytes(SECRET_LENGTH)


def compute_digest(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, DIGEST).digest()


def check_digest(key: bytes, message: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is ``message``'s under ``key`` (compared in constant time)."""
    return hmac.compare_digest(compute_digest(key, message), digest)
