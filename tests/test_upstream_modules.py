"""Upstream's helper modules that user code imports directly answer truthfully for this
implementation: horovod.common.util, horovod.runner.common.util.{env,secret},
horovod.runner.util.threads, and the frameworks' ``mpi_ops._basics``."""

from __future__ import annotations

import os
import threading

import pytest

from horovod.common import util
from horovod.runner.common.util import env as runner_env
from horovod.runner.common.util import secret
from horovod.runner.util import threads
from horovod.testing import run_ranks


def test_env_sets_and_restores(monkeypatch):
    monkeypatch.setenv("HVD_TEST_KEPT", "old")
    monkeypatch.delenv("HVD_TEST_NEW", raising=False)
    with util.env(HVD_TEST_KEPT="new", HVD_TEST_NEW=3, HVD_TEST_SKIPPED=None):
        assert os.environ["HVD_TEST_KEPT"] == "new" and os.environ["HVD_TEST_NEW"] == "3"
        assert "HVD_TEST_SKIPPED" not in os.environ
    assert os.environ["HVD_TEST_KEPT"] == "old" and "HVD_TEST_NEW" not in os.environ


def test_build_answers_match_the_frontend():
    import horovod.numpy as hvd

    assert util.gloo_built() is hvd.gloo_built() is True
    have_mpi4py = __import__("importlib").util.find_spec("mpi4py") is not None
    assert util.mpi_built() is hvd.mpi_built() is have_mpi4py
    assert bool(util.nccl_built()) is bool(hvd.nccl_built()) is False
    assert util.gpu_available("horovod.torch") is False  # no CUDA build
    assert util.extension_available("horovod.numpy")
    assert util.extension_available("horovod.torch") is (
        __import__("importlib").util.find_spec("torch") is not None
    )
    assert util.extension_available("horovod.mxnet") is False  # no such frontend yet


def test_versions_and_split_list():
    assert util.is_version_greater_equal_than("2.13.0+cpu", "2.1.0")
    assert not util.is_version_greater_equal_than("1.9.1", "1.10.0")
    with pytest.raises(ValueError, match="major.minor.patch"):
        util.is_version_greater_equal_than("2.1", "2.1.0")
    with pytest.raises(ValueError, match="two strings"):
        util.is_version_greater_equal_than(2, "2.1.0")
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize(
    "variables, want",
    [
        ({}, (0, 1)),
        ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4"}, (2, 4)),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, (1, 3)),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2)),
    ],
)
def test_get_env_rank_and_size(monkeypatch, variables, want):
    for name in ("HOROVOD", "OMPI_COMM_WORLD", "PMI"):
        monkeypatch.delenv(f"{name}_RANK", raising=False)
        monkeypatch.delenv(f"{name}_SIZE", raising=False)
    for k, v in variables.items():
        monkeypatch.setenv(k, v)
    assert runner_env.get_env_rank_and_size() == want


def test_get_env_rank_and_size_refuses_half_a_pair(monkeypatch):
    monkeypatch.delenv("HOROVOD_SIZE", raising=False)
    monkeypatch.setenv("HOROVOD_RANK", "1")
    with pytest.raises(RuntimeError, match="HOROVOD_RANK is set but HOROVOD_SIZE is not"):
        runner_env.get_env_rank_and_size()


def test_secret_keys_and_digests():
    a, b = secret.make_secret_key(), secret.make_secret_key()
    assert len(a) == secret.SECRET_LENGTH == 32 and a != b
    d = secret.compute_digest(a, b"hello")
    assert secret.check_digest(a, b"hello", d)
    assert not secret.check_digest(b, b"hello", d) and not secret.check_digest(a, b"hullo", d)


def test_threads():
    got = []
    t = threads.in_thread(got.append, ("x",), name="helper")
    t.join(5)
    assert isinstance(t, threading.Thread) and t.daemon and got == ["x"]
    quiet = threads.in_thread(lambda: 1 / 0, silent=True)  # swallowed, not reported
    quiet.join(5)
    results = threads.execute_function_multithreaded(lambda a, b: a * b, [(1, 2), (3, 4), (5, 6)])
    assert results == {0: 2, 1: 12, 2: 30}


@pytest.mark.parametrize("frontend", ["horovod.torch", "horovod.tensorflow"])
def test_basics_lists_process_sets(frontend):
    mpi_ops = pytest.importorskip(f"{frontend}.mpi_ops")
    hvd = pytest.importorskip(frontend)

    def body(rank):
        ps = hvd.add_process_set([0, 2])
        got = mpi_ops._basics._get_process_set_ids_and_ranks()
        assert mpi_ops._basics.size() == 3 and mpi_ops._basics.rank() == rank
        hvd.remove_process_set(ps)
        return got

    for got in run_ranks(body, 3, init_kwargs={"process_sets": "dynamic"}):
        assert got[0] == [0, 1, 2] and [0, 2] in got.values() and len(got) == 2
