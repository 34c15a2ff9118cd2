"""horovod.run: a Python function on every rank, results by rank, the first failure re-raised."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

import horovod
from horovod.runner import RemoteTraceback
from tests import mpi_impls

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    """Workers must import this checkout (and this test module, for by-reference pickles)."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    path = os.pathsep.join([repo, here, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)


def _allreduce_rank(scale):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() * scale]), op=hvd.Sum, name="t")
    return (hvd.rank(), hvd.size(), float(total[0]))


def test_returns_every_ranks_value_in_rank_order():
    out = horovod.run(_allreduce_rank, args=(10,), num_proc=3)
    assert out == [(0, 3, 30.0), (1, 3, 30.0), (2, 3, 30.0)]


def test_kwargs_closures_and_hosts():
    base = 5
    out = horovod.run(
        lambda k: base + k + int(os.environ["HOROVOD_RANK"]),
        kwargs={"k": 1},
        num_proc=2,
        hosts="localhost:2",
    )
    assert out == [6, 7]


class Boom(ValueError):
    pass


def _fail_on_rank_1():
    import time

    if int(os.environ["HOROVOD_RANK"]) == 1:
        raise Boom("bad input on rank 1")
    time.sleep(30)  # stopped by horovodrun when rank 1 fails
    return "never"


def test_first_failure_is_reraised_with_the_ranks_traceback(capfd):
    with pytest.raises(Boom, match="bad input on rank 1") as info:
        horovod.run(_fail_on_rank_1, num_proc=2)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.rank == 1
    assert "_fail_on_rank_1" in cause.text and "raise Boom" in cause.text


def test_a_rank_that_dies_without_an_exception_is_reported():
    def die():
        if int(os.environ["HOROVOD_RANK"]) == 0:
            os._exit(3)
        return 1

    with pytest.raises(RuntimeError, match=r"exit status 3\); ranks \[0.*\] returned nothing"):
        horovod.run(die, num_proc=2)


def _in_a_thread(fn, timeout=120):
    """fn() on a thread other than the main one: its value, or what it raised."""
    out: list = []

    def go():
        try:
            out.append(fn())
        except BaseException as e:  # (handed to the test)
            out.append(e)

    th = threading.Thread(target=go)
    th.start()
    th.join(timeout)
    assert not th.is_alive() and len(out) == 1, "the run did not finish"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("launcher", ["own", "elastic", "mpirun"])
def test_runs_from_a_thread_other_than_the_main_one(launcher):
    """``horovod.run`` called off the main thread (a worker thread, a thread pool, a server's
    request handler): Python allows signal handlers on the main thread only, so the launchers
    install theirs only there (it raised "signal only works in main thread"). The main
    thread's handlers are left as they were."""
    extra: dict = {"min_num_proc": 2, "hosts": "localhost:2"} if launcher == "elastic" else {}
    if launcher == "mpirun":
        why = mpi_impls.missing("openmpi")
        if why is not None:
            pytest.skip(why)
        extra = {"mpi_args": "--oversubscribe"}
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = _in_a_thread(lambda: horovod.run(_allreduce_rank, args=(10,), num_proc=2, **extra))
    assert out == [(0, 2, 10.0), (1, 2, 10.0)]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("impl", mpi_impls.IMPLS)
def test_use_mpi_runs_the_function_under_mpirun(impl, monkeypatch):
    """``use_mpi=True``: the installed mpirun starts the ranks (Open MPI, MPICH, Intel MPI),
    the data moves through MPI, and the function and its values travel through the launcher's
    store as on its own launcher."""

    def under_mpi(scale):  # (nested: pickled by value, for a venv without these tests)
        import numpy as np

        import horovod.numpy as hvd
        from horovod.core.context import current

        hvd.init()
        total = hvd.allreduce(np.array([hvd.rank() * scale]), op=hvd.Sum, name="t")
        native = type(current().engine.transport.native).__name__
        return hvd.rank(), hvd.size(), float(total[0]), hvd.mpi_enabled(), native

    monkeypatch.setenv("PATH", mpi_impls.path(impl, os.environ.get("PATH", "")))
    extra = {"mpi_args": "--oversubscribe"} if impl == "openmpi" else {"use_mpi": True}
    out = horovod.run(under_mpi, args=(10,), num_proc=2, executable=mpi_impls.python(impl), **extra)
    assert out == [(r, 2, 10.0, True, "MpiCollectives") for r in range(2)]


def test_argument_errors():
    with pytest.raises(ValueError, match="hosts and hostfile"):
        horovod.run(print, hosts="localhost:1", hostfile="h")
    with pytest.raises(ValueError, match="use_gloo and use_mpi"):
        horovod.run(print, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="elastic jobs run on horovodrun's own launcher"):
        horovod.run(print, use_mpi=True, min_num_proc=1)
    with pytest.raises(TypeError, match="unexpected arguments no_such_flag"):
        horovod.run(print, no_such_flag=1)
    with pytest.raises(TypeError, match="callable"):
        horovod.run(42)
    with pytest.warns(DeprecationWarning, match="num_proc"):
        assert horovod.run(lambda: sys.version_info[0], np=1) == [3]


def _elastic_train(marker: str):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 20:
            hvd.allreduce(np.ones(2), name="x")
            if state.step == 5 and hvd.rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # a worker dies mid-training, once
            state.step += 1
            state.commit()
        return state.step

    steps = loop(state)
    return hvd.rank(), hvd.size(), steps


def test_elastic_run_survives_a_lost_worker_and_returns_the_last_rounds_values(tmp_path):
    """horovod.run with min_num_proc: the function (using hvd.elastic.run) survives losing
    a worker; the values are those of the last round's ranks, in rank order."""
    results = horovod.run(
        _elastic_train,
        args=(str(tmp_path / "killed"),),
        num_proc=2,
        min_num_proc=1,
        max_num_proc=2,
        hosts="localhost:2",
    )
    assert (tmp_path / "killed").exists()
    assert results, results
    size = results[0][1]
    assert [r[0] for r in results] == list(range(size)) and all(r[1] == size for r in results)
    assert all(r[2] == 20 for r in results), results  # every rank finished the 20 steps
