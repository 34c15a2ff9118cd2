"""The kernel timer the engine thread naps on (``horovod.common.alarm``): through ``os`` where
Python has ``timerfd`` (3.13+), through ctypes before."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest

from horovod.common import alarm as alarm_mod


def _readable(a: alarm_mod.Alarm, timeout: float) -> bool:
    return bool(select.select([a.fileno()], [], [], timeout)[0])


def _ctypes_alarm() -> alarm_mod.Alarm:
    create_fd, settime = alarm_mod._ctypes_calls()
    return alarm_mod.Alarm(create_fd(), settime)


MAKERS = {"default": alarm_mod.make_alarm, "ctypes": _ctypes_alarm}


@pytest.fixture(params=sorted(MAKERS))
def alarm(request):
    a = MAKERS[request.param]()
    assert a is not None, "this Linux machine has timerfd: make_alarm must find it"
    yield a
    a.close()


def test_an_alarm_fires_at_its_deadline_and_clear_forgets_the_expiry(alarm):
    assert not _readable(alarm, 0)  # nothing set: never fires
    t0 = time.monotonic()
    alarm.set_at(t0 + 0.05)
    assert alarm.at == t0 + 0.05
    assert not _readable(alarm, 0.02)
    assert _readable(alarm, 2.0)
    assert time.monotonic() - t0 >= 0.045
    assert _readable(alarm, 0)  # stays readable ...
    alarm.clear()
    assert not _readable(alarm, 0)  # ... until cleared
    alarm.clear()  # (clearing twice is harmless)


def test_a_deadline_moved_later_holds_a_sleeper_and_one_in_the_past_fires_at_once(alarm):
    t0 = time.monotonic()
    alarm.set_at(t0 + 0.05)
    woke: list[float] = []
    th = threading.Thread(target=lambda: (_readable(alarm, 5.0), woke.append(time.monotonic())))
    th.start()
    time.sleep(0.01)
    alarm.set_at(t0 + 0.3)  # the sleeper is not woken by the move
    th.join(5)
    assert woke and woke[0] - t0 >= 0.28
    alarm.clear()
    alarm.set_at(time.monotonic() - 5.0)
    assert _readable(alarm, 1.0)


def test_a_closed_alarm_releases_its_descriptor():
    a = alarm_mod.make_alarm()
    assert a is not None
    os.fstat(a.fileno())
    a.close()
    assert a.fileno() == -1
    a.close()  # (twice: nothing)


def test_no_alarm_where_the_system_has_no_timerfd(monkeypatch):
    monkeypatch.setattr(alarm_mod.sys, "platform", "darwin")
    assert alarm_mod.make_alarm() is None
