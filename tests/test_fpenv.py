"""Horovod's reductions compute in the floating-point environment of the thread that called
``hvd.init()`` (``fpenv``), so every rank computes the same bits whichever thread runs its
engine and whatever that thread's mode."""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
from conftest import run_script

from horovod.common import fpenv

torch = pytest.importorskip("torch")

SUBNORMAL = np.full(3, 1e-39, np.float32)  # (made here, on a thread that keeps subnormals)


def _in_thread(fn) -> Any:  # noqa: ANN001
    """``fn()`` on a new thread (a thread's floating-point mode is its own: no test leaks
    flushing into the next)."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _flush() -> None:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")


def _both_ranks(stdout: str, word: str) -> None:
    """Both ranks printed ``word`` with True."""
    assert sorted(re.findall(word + r" (\d) (\w+)", stdout)) == [("0", "True"), ("1", "True")], (
        stdout
    )


def _halves() -> list[int]:
    return (SUBNORMAL * np.float32(0.5)).view(np.int32).tolist()


def test_a_mode_runs_a_call_in_the_environment_of_the_thread_that_made_it():
    ieee = _halves()
    assert not fpenv.flushes() and ieee != [0, 0, 0]
    ieee_mode = fpenv.Mode()

    def inside() -> tuple:
        return fpenv.flushes(), _halves()

    def body() -> tuple:
        _flush()
        flushing_mode = fpenv.Mode()
        here = inside()
        switched = ieee_mode.run(inside)  # an IEEE job's call on a flushing thread
        return flushing_mode, here, switched, inside()

    flushing_mode, here, switched, after = _in_thread(body)
    assert here == (True, [0, 0, 0]) and after == here  # the thread's own mode is back
    assert switched == (False, ieee)
    assert flushing_mode.flushes and not ieee_mode.flushes
    assert flushing_mode.run(inside) == (True, [0, 0, 0])  # and the other way round
    assert inside() == (False, ieee)
    with pytest.raises(ZeroDivisionError):  # restored when the call raises too
        flushing_mode.run(lambda: 1 / 0)
    assert inside() == (False, ieee)


def test_a_thread_started_by_a_flushing_one_inherits_it_until_it_adopts_the_jobs_mode():
    job = fpenv.Mode()  # (IEEE: made on this thread)

    def body() -> tuple:
        _flush()

        def child() -> tuple:
            inherited = fpenv.flushes()
            job.adopt()
            return inherited, fpenv.flushes(), _halves()

        return _in_thread(child), fpenv.flushes()

    (inherited, after, halves), parent = _in_thread(body)
    assert inherited and not after and halves == _halves()
    assert parent  # (the parent's mode is its own)


def test_without_fesetenv_a_thread_in_another_mode_is_warned_once_and_keeps_its_own(
    monkeypatch, caplog
):
    monkeypatch.setattr(fpenv, "_CALLS", None)  # (as where libm has no fesetenv)
    monkeypatch.setattr(fpenv, "_warned", False)
    job = fpenv.Mode()  # IEEE, with no environment to switch a thread to

    def body() -> tuple:
        _flush()
        with caplog.at_level("WARNING", logger="horovod"):
            differs = job.differs()  # (no switch possible: the call goes on as it is)
            first = job.run(lambda: (fpenv.flushes(), _halves()))
            job.run(lambda: None)
            job.adopt()
        return differs, first, fpenv.flushes()

    assert _in_thread(body) == (False, (True, [0, 0, 0]), True)
    msgs = [r.getMessage() for r in caplog.records if "hvd.init()" in r.getMessage()]
    assert len(msgs) == 1 and "torch.set_flush_denormal" in msgs[0], msgs


def test_a_switch_that_fails_runs_the_call_once_in_the_threads_own_mode(monkeypatch, caplog):
    """The engine's calls ask ``differs()`` again inside ``run``: where the switch fails, the
    call must go on in the thread's mode, not ask for the switch again and again."""
    job = fpenv.Mode()  # (IEEE, with an environment to switch to)
    monkeypatch.setattr(fpenv, "_CALLS", (lambda env: -1, lambda env: -1))  # (both fail)
    monkeypatch.setattr(fpenv, "_warned", False)
    asked: list[bool] = []

    def call() -> bool:
        asked.append(job.differs())
        return fpenv.flushes()

    def body() -> tuple:
        _flush()
        with caplog.at_level("WARNING", logger="horovod"):
            return job.differs(), job.run(call)

    assert _in_thread(body) == (True, True)
    assert asked == [False]
    assert [r for r in caplog.records if "hvd.init()" in r.getMessage()]


# Every rank flushes subnormals on its training thread, as a user following docs/pytorch.md
# would, after ``hvd.init()`` or before it (argv[1]); one rank at a time leaves each round to its
# engine thread. Data rounds have every rank compute the whole result itself: before ``fpenv``,
# with flushing set after init, the rank whose main thread computed got zeros and the other the
# sums (the replicas then trained on different gradients). Now both compute in the init
# thread's mode: IEEE sums after, flushed (zeros: subnormal inputs read as zero) before.
MIXED_THREADS = """
    import sys, time, torch, horovod.torch as hvd
    before = sys.argv[1] == "before"
    g = (torch.full((1000,), 1e-39) * (1 + torch.arange(1000) / 1000)).float()  # subnormal
    zeros = torch.zeros(1000, dtype=torch.int32)
    if before:
        torch.set_flush_denormal(True)
    hvd.init()
    r = hvd.rank()
    torch.set_flush_denormal(True)
    got = []
    for step in range(4):
        for op in (hvd.Sum, hvd.Average):
            name = f"g.{int(op)}"
            if r == step % 2:  # this rank's engine thread finishes the round
                h = hvd.allreduce_async(g, op=op, name=name)
                time.sleep(0.05)
                out = hvd.synchronize(h)
            else:
                out = hvd.allreduce(g, op=op, name=name)
            got.append(out.view(torch.int32).clone())
    torch.set_flush_denormal(False)
    ieee = [(g + g).view(torch.int32), g.view(torch.int32)] * 4  # Sum, then Average (= g)
    want = [zeros] * 8 if before else ieee
    print("expected", r, all(torch.equal(a, b) for a, b in zip(got, want)), flush=True)
    both = hvd.allgather(torch.stack(got).unsqueeze(0), name="check")
    print("agree", r, bool(torch.equal(both[0], both[1])), flush=True)
    hvd.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("plane", "flushing"), [("shm", "after"), ("tcp", "after"), ("shm", "before")]
)
def test_ranks_reduce_alike_whichever_thread_runs_the_engine_and_its_mode(plane, flushing):
    if not _in_thread(lambda: torch.set_flush_denormal(True)):  # (that thread's mode only)
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")
    env = {"HOROVOD_SHARED_MEMORY": "0"} if plane == "tcp" else {}
    out = run_script(MIXED_THREADS, np_=2, env=env, timeout=120, args=[flushing])
    assert out.returncode == 0, out.stdout + out.stderr
    _both_ranks(out.stdout, "expected")
    _both_ranks(out.stdout, "agree")


# A collective inside ``tf.function`` runs on a thread of TensorFlow's (a ``numpy_function``),
# one inside ``jax.jit`` on one of XLA's (an ``io_callback``): both flush subnormals (measured
# with ``fpenv.flushes()``), where the thread that called ``hvd.init()`` does not. Before
# ``fpenv`` their data rounds were computed flushed there (zeros) and IEEE on an engine thread.
IN_GRAPH = """
    import sys, numpy as np
    fw = sys.argv[1]
    g = (np.full(1000, 1e-39) * (1 + np.arange(1000) / 1000)).astype(np.float32)  # subnormal
    want = (g + g).view(np.int32)
    if fw == "tensorflow":
        import tensorflow as tf, horovod.tensorflow as hvd
        hvd.init()
        step = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum, name="g"))
        outs = [step(tf.constant(g)).numpy() for _ in range(3)]
    else:
        import jax, jax.numpy as jnp, horovod.jax as hvd
        hvd.init()
        step = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, name="g"))
        outs = [np.asarray(step(jnp.asarray(g))) for _ in range(3)]
    ok = all(np.array_equal(o.view(np.int32), want) for o in outs)
    print("expected", hvd.rank(), ok, flush=True)
    hvd.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("framework", ["tensorflow", "jax"])
def test_collectives_in_graphs_compute_in_the_init_threads_mode(framework):
    pytest.importorskip(framework)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"}
    out = run_script(IN_GRAPH, np_=2, env=env, timeout=180, args=[framework])
    assert out.returncode == 0, out.stdout + out.stderr
    _both_ranks(out.stdout, "expected")
