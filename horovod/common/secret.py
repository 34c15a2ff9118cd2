"""The job secret: made by the launcher, handed to workers through the environment, proved by
every rendezvous request (HMAC) and every transport connection (HMAC challenge-response).

Must not touch: any layer above it; the secret never goes into logs or error messages.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

DIGEST = hashlib.sha256
MAC_SIZE = 32


def make_secret() -> str:
    return secrets.token_hex(32)


def mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=DIGEST)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def verify(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(key, *parts), tag)


def derive(key: bytes, label: str) -> bytes:
    """A sub-key bound to ``label`` (e.g. one init round), so a message of one round is
    worthless in another."""
    return mac(key, b"derive", label.encode())
