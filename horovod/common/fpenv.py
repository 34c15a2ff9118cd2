"""The floating-point environment of Horovod's reductions: the one of the thread that called
``hvd.init()``, on whichever thread they run.

A thread may flush subnormal floats to zero: after ``torch.set_flush_denormal(True)``, on
TensorFlow's and XLA's own threads, in a library built with ``-ffast-math``. Its additions and
multiplications then give other bits wherever a subnormal is involved. In a data round every
rank computes the whole result itself, on the thread that happens to run the engine (the
caller's, or the engine's own), so two ranks could compute the same round in different
environments and train on different gradients from then on, without any error (measured:
with ``torch.set_flush_denormal(True)`` on every rank's main thread after ``hvd.init()``, an
allreduce of subnormal gradients gave zeros on one rank and their sums on the other). So every
reduction computes in one environment, the init thread's (``Mode``, captured by the engine):
upstream's, whose reductions all run on a background thread started by ``hvd.init()``, which
inherits its starter's. A thread that runs the engine in another mode is switched to it for the
span of the call and back after (``flushes``, the check, costs two float operations; the
switch, on such a thread only, three calls into libm), and the engine's own thread adopts it at
its start.

Must not touch: anything but the calling thread's floating-point control state, which
``Mode.run`` restores.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

from horovod.common.log import logger

# Operands the compiler cannot fold (module globals): a subnormal times one is zero only where
# subnormal inputs are read as zero (DAZ); the least normal double over three is a subnormal,
# inexact result, zero only where such results are flushed (FTZ).
_TINY = 5e-324
_ONE = 1.0
_LEAST = 2.2250738585072014e-308
_THIRD = 1.0 / 3.0
_ENV_BYTES = 64  # room for a ``fenv_t`` (32 bytes on x86-64 glibc, 8 on aarch64)


def flushes() -> bool:
    """Does the calling thread flush subnormal floats to zero (inputs or results)?"""
    return _TINY * _ONE == 0.0 or _LEAST * _THIRD == 0.0


def _libm_calls() -> tuple[Any, Any] | None:
    """libm's ``fegetenv`` and ``fesetenv`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    get = put = None
    for name in (ctypes.util.find_library("m") or "libm.so.6", None):  # (None: musl's libc)
        try:
            lib = ctypes.CDLL(name)
            get, put = lib.fegetenv, lib.fesetenv
            break
        except (OSError, AttributeError):
            continue
    if get is None or put is None:
        return None
    for fn in (get, put):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return get, put


_CALLS = _libm_calls()
_warned = False


def _cannot_switch() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "a thread that calls Horovod flushes subnormal floats to zero where the thread that "
            "called hvd.init() does not (or the other way round), and Horovod cannot switch its "
            "floating-point environment on this system (no fesetenv): its reductions may give "
            "other bits than the same reductions on other ranks. Set flushing "
            "(torch.set_flush_denormal) the same way on every thread that calls Horovod, "
            "before hvd.init()."
        )


class Mode:
    """The floating-point environment of the thread that made it: whether it flushes
    subnormals (``flushes``) and the whole environment, to switch other threads to (``run``:
    for one call, several threads at once; ``adopt``: for good)."""

    __slots__ = ("flushes", "_env")

    def __init__(self) -> None:
        self.flushes = flushes()
        self._env: Any = None
        if _CALLS is not None:
            env = ctypes.create_string_buffer(_ENV_BYTES)
            if _CALLS[0](env) == 0:
                self._env = env

    def differs(self) -> bool:
        """Must a call on the calling thread switch to this environment (``run``): does the
        thread flush where this one does not, or the other way round, and can it switch?"""
        if flushes() == self.flushes:
            return False
        if self._env is None:
            _cannot_switch()
            return False
        return True

    def adopt(self) -> None:
        """Switch the calling thread to this environment for good (a thread of Horovod's own
        that computes reductions: it inherited its starter's)."""
        if self.differs():
            _CALLS[1](self._env)  # type: ignore[index]

    def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in this environment, the calling thread's restored after (where
        ``differs()``). Where the switch fails, ``fn`` runs in the thread's own, warned once,
        and ``differs()`` says False from then on (``fn`` may ask it again)."""
        if self._env is not None:
            get, put = _CALLS  # type: ignore[misc]
            saved = ctypes.create_string_buffer(_ENV_BYTES)
            if get(saved) == 0 and put(self._env) == 0:
                try:
                    return fn(*args)
                finally:
                    put(saved)
            self._env = None
        _cannot_switch()
        return fn(*args)
