"""A kernel timer that one thread moves while another sleeps on it (Linux ``timerfd``).

The engine thread naps through a waiting thread's lease (see "The engine lease" in
docs/architecture.md). A nap with a timeout cannot be lengthened without waking the thread
(a kick), so a lease that ends in the middle of a long operation woke the engine thread on the
core that the operation runs on. ``Alarm`` is a file descriptor the nap waits on beside its
wake socket: the thread that runs the engine moves the deadline (``set_at``, one system call,
no wake-up), and the napping thread wakes only when the deadline it ends up with passes.

Python 3.13 has ``os.timerfd_create``; older versions reach the same system calls through
ctypes. ``make_alarm()`` returns None where neither works (not Linux): the engine then naps
with a timeout as before.

Must not touch: what a lease means (the engine's ``Driving`` layer decides when to move it).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

CLOCK_MONOTONIC = 1  # (time.monotonic's clock on Linux)
TFD_TIMER_ABSTIME = 1
TFD_NONBLOCK = 0o4000  # O_NONBLOCK
TFD_CLOEXEC = 0o2000000  # O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Alarm:
    """A one-shot timer on ``time.monotonic()``'s clock (``time.perf_counter()``'s too where
    ``make_alarm`` returns one), readable (``fileno``) once its deadline has passed until
    ``clear``. ``at`` is the deadline set last (0: none)."""

    def __init__(self, fd: int, settime) -> None:  # noqa: ANN001
        self._fd = fd
        self._settime = settime
        self._lock = threading.Lock()  # (the kernel's deadline and ``at`` move together)
        self.at = 0.0

    def fileno(self) -> int:
        return self._fd

    def set_at(self, deadline: float) -> None:
        """Fire at ``deadline`` (``time.monotonic()`` or ``time.perf_counter()`` seconds); a
        deadline already past fires at once. Replaces the deadline set before."""
        with self._lock:
            self._settime(self._fd, max(deadline, 1e-9))
            self.at = deadline

    def clear(self) -> None:
        """Forget an expiry that was not read yet (the descriptor is not readable after)."""
        try:
            os.read(self._fd, 8)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _os_settime(fd: int, deadline: float) -> None:
    os.timerfd_settime(fd, flags=os.TFD_TIMER_ABSTIME, initial=deadline)  # type: ignore[attr-defined]


def _ctypes_calls():  # noqa: ANN202
    """(create, settime) through libc, for one alarm (``make_alarm`` calls this per alarm)."""
    libc = ctypes.CDLL(None, use_errno=True)
    create = libc.timerfd_create
    create.argtypes = [ctypes.c_int, ctypes.c_int]
    create.restype = ctypes.c_int
    settime = libc.timerfd_settime
    settime.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Itimerspec),
        ctypes.POINTER(_Itimerspec),
    ]
    settime.restype = ctypes.c_int
    spec = _Itimerspec()  # (one per alarm: ``Alarm.set_at`` holds the alarm's lock)

    def settime_abs(fd: int, deadline: float) -> None:
        sec = int(deadline)
        spec.it_value.tv_sec = sec
        spec.it_value.tv_nsec = int((deadline - sec) * 1e9)
        if settime(fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def create_fd() -> int:
        fd = create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return int(fd)

    return create_fd, settime_abs


def make_alarm() -> Alarm | None:
    """A new ``Alarm``, or None where the system has no ``timerfd`` (or it fails)."""
    if not sys.platform.startswith("linux"):
        return None
    for clock in ("monotonic", "perf_counter"):  # (deadlines are on either: one clock)
        if time.get_clock_info(clock).implementation != "clock_gettime(CLOCK_MONOTONIC)":
            return None
    try:
        if hasattr(os, "timerfd_create"):
            flags = os.TFD_NONBLOCK | os.TFD_CLOEXEC  # type: ignore[attr-defined]
            fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=flags)  # type: ignore[attr-defined]
            return Alarm(fd, _os_settime)
        create_fd, settime = _ctypes_calls()
        return Alarm(create_fd(), settime)
    except (OSError, AttributeError, TypeError):
        return None
