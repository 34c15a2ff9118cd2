"""Single-copy transfers between processes of one host: Linux cross-memory attach.

``process_vm_readv(2)`` copies straight from another process's memory into ours, so a large
message between two ranks of one host costs one copy (the receiver's) instead of two (sender
into a shared slot, receiver out of it): half the memory traffic, which is what bounds large
allgathers and broadcasts on a host whose ranks share the memory bus. Open MPI's shared-memory
transport does the same for large messages.

The kernel allows it like ``ptrace`` attach: same user, and where the Yama security module is
in mode 1 ("restricted": only a descendant may attach) the reader must be named by the target
with ``prctl(PR_SET_PTRACER)``. Modes 2 and 3, seccomp filters (some container runtimes), or
ranks in different PID namespaces forbid it: the transport probes every pair at start-up and
keeps the two-copy path unless every rank of the host can read every other one.
``process_vm_writev(2)`` is allowed on the same terms; a large broadcast between two ranks uses
both at once (the root writes one half into the receiver while the receiver reads the other).

Must not touch: memory other than the buffers named in a call; ptrace settings beyond the
readers it is told.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Sequence

import numpy as np

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_function(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


_readv = _libc_function("process_vm_readv")
_writev = _libc_function("process_vm_writev")
for _f in (_readv, _writev):
    if _f is not None:
        _f.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        _f.restype = ctypes.c_ssize_t
_prctl = _libc_function("prctl")
if _prctl is not None:
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int


def available() -> bool:
    """Does this platform have ``process_vm_readv`` at all (Linux with glibc or musl)?"""
    return _readv is not None


def address(mv: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(mv, np.uint8).ctypes.data)


def read(pid: int, remote: int, dst: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``remote`` of process ``pid`` to address ``dst`` here (the
    GIL is released meanwhile). Raises ``OSError`` (ESRCH: the process is gone; EFAULT: the
    range is not mapped there; EPERM: not allowed)."""
    assert _readv is not None
    _move(_readv, pid, dst, remote, nbytes)


def write(pid: int, src: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``src`` here to address ``remote`` of process ``pid``
    (``process_vm_writev(2)``, allowed as reading is); raises as ``read`` does."""
    if _writev is None:
        raise OSError(errno.ENOSYS, "no process_vm_writev on this platform")
    _move(_writev, pid, src, remote, nbytes)


def _move(call, pid: int, here: int, remote: int, nbytes: int) -> None:
    local, far = _Iovec(), _Iovec()
    done = 0
    while done < nbytes:
        local.base, local.len = here + done, nbytes - done
        far.base, far.len = remote + done, nbytes - done
        n = call(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if n == 0:  # a partial transfer stops at the first page it cannot reach
            raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
        done += n


def yama_scope() -> int | None:
    """The Yama ptrace mode (0-3), or None without Yama."""
    try:
        with open(YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_readers(pids: Sequence[int]) -> bool:
    """Let ``pids`` read this process's memory where Yama restricts it to descendants: name the
    one reader, or any process of this user when there are several (as Open MPI does). Returns
    whether a ptracer was set (undo with ``forbid_readers``)."""
    if yama_scope() != 1 or _prctl is None or not pids:
        return False
    who = pids[0] if len(pids) == 1 else PR_SET_PTRACER_ANY
    return _prctl(PR_SET_PTRACER, who, 0, 0, 0) == 0


def forbid_readers() -> None:
    if _prctl is not None:
        _prctl(PR_SET_PTRACER, 0, 0, 0, 0)
