"""Names of shared-memory segments: shared by the transport that creates them and horovodrun,
which removes a job's leftovers (segments of ranks killed during set-up) when the job ends.

Must not touch: segments themselves (the transport creates them, horovodrun removes leftovers).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

PREFIX = "pyhvd-"


def shm_dir() -> str:
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else (tempfile.gettempdir())
    )


def job_id(secret: bytes) -> str:
    """A public id of the job, the same on every rank and in horovodrun."""
    return hashlib.sha256(b"pyhorovod-shm" + secret).hexdigest()[:12]


def cleanup_job(secret: bytes, rank: int | None = None) -> list[str]:
    """Remove segments of this job (of one ``rank`` only, if given) that a rank created but did
    not unlink (it died during set-up). Returns the paths removed."""
    d, prefix = shm_dir(), f"{PREFIX}{job_id(secret)}-"
    if rank is not None:
        prefix += f"{rank}-"
    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(d, name))
                removed.append(os.path.join(d, name))
            except OSError:
                pass
    return removed


__all__ = ["PREFIX", "cleanup_job", "job_id", "shm_dir"]
