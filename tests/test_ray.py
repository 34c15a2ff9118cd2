"""horovod.ray against a real local Ray cluster (one per module, kept on loopback): jobs on
actors, the rank layout, stateful executables, failures (a raising rank, a dying actor, an
unsatisfiable placement group, calls before start) and a shutdown that leaves nothing behind."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'pyhorovod[ray]')",
)


@pytest.fixture(scope="module")
def nodes():
    """The module's Ray cluster: a head node of 3 CPUs (nodes may be added and removed)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file in the home directory
    import ray
    from ray.cluster_utils import Cluster

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    path = os.pathsep.join(
        [here, root, os.path.join(root, "examples"), os.environ.get("PYTHONPATH", "")]
    )
    # the actors import this module for the functions it defines (a script's own functions
    # travel by value; a test module's by name)
    c = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 3, "include_dashboard": False},
    )
    try:
        ray.init(
            address=c.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def cluster(nodes):
    import ray

    return ray


def _nothing_left(ray, actors: list) -> None:
    """The actors are dead and every CPU is free again (placement group removed)."""
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.node_info.remote(), timeout=30)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 3, ray.available_resources()


def allreduce_job(scale):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    s = hvd.allreduce(np.full(4, hvd.rank() + 1.0) * scale, op=hvd.Sum, name="ray.sum")
    env = {k: os.environ[k] for k in ("HOROVOD_CONTROLLER", "HVD_TEST_EXTRA") if k in os.environ}
    return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), s.tolist(), env


def test_a_job_runs_on_actors_and_returns_results_by_rank(cluster):
    from horovod.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    ex.start(extra_env_vars={"HVD_TEST_EXTRA": "yes"})
    try:
        out = ex.run(allreduce_job, args=[2.0])
        assert [o[:5] for o in out] == [(0, 2, 0, 2, [6.0] * 4), (1, 2, 1, 2, [6.0] * 4)]
        assert out[0][5] == {"HOROVOD_CONTROLLER": "gloo", "HVD_TEST_EXTRA": "yes"}
        # again, with kwargs: the same ranks, Horovod still initialised in the actors
        assert [o[4] for o in ex.run(allreduce_job, kwargs={"scale": 1.0})] == [[3.0] * 4] * 2
        refs = ex.run_remote(allreduce_job, args=[0.5])
        assert [r[4] for r in cluster.get(refs)] == [[1.5] * 4] * 2
        actors = list(ex.workers)
    finally:
        ex.shutdown()
    _nothing_left(cluster, actors)
    ex.shutdown()  # twice: nothing to do


class Counter:
    """A stateful executable: built once per actor by start(executable_cls=...)."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        import numpy as np

        import horovod.numpy as hvd

        hvd.init()
        self.value += 1
        return int(hvd.allreduce(np.array([self.value]), op=hvd.Sum, name="bump")[0])


def test_executables_keep_state_and_hosts_layout_is_given_by_num_hosts(cluster):
    from horovod.ray import RayExecutor

    ex = RayExecutor(num_hosts=1, num_workers_per_host=2)
    ex.start(executable_cls=Counter, executable_args=[10])
    try:
        assert ex.execute(lambda c: c.bump()) == [22, 22]
        assert ex.execute(lambda c: c.bump()) == [24, 24]
        assert ex.execute_single(lambda c: c.value) == 12
        layout = ex.run(
            lambda: (os.environ["HOROVOD_LOCAL_SIZE"], os.environ["HOROVOD_CROSS_SIZE"])
        )
        assert layout == [("2", "1"), ("2", "1")]
    finally:
        ex.shutdown()


def failing_job(how):
    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        if how == "raise":
            raise KeyError("bad batch 42")
        os._exit(7)
    hvd.allreduce(np.ones(3), name="waits.for.rank1")  # rank 0 waits for the failed rank
    return "rank 0 finished"


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_failing_rank_fails_the_call_at_once_and_names_it(cluster, how):
    from horovod.ray import RayExecutor

    ex = RayExecutor(num_workers=2)
    ex.start()
    actors = list(ex.workers)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 failed") as err:
            ex.run(failing_job, args=[how])
        assert time.monotonic() - t0 < 30
        assert ("KeyError: 'bad batch 42'" if how == "raise" else "actor died") in str(err.value)
        with pytest.raises(RuntimeError, match="an earlier call failed"):
            ex.run(failing_job, args=[how])
    finally:
        ex.shutdown()
    _nothing_left(cluster, actors)
    # the executor starts again after shutdown()
    ex.start()
    try:
        assert [o[4] for o in ex.run(allreduce_job, args=[1.0])] == [[3.0] * 4] * 2
    finally:
        ex.shutdown()


def test_resources_the_cluster_cannot_give_are_refused_with_what_it_has(cluster):
    from horovod.ray import RayExecutor

    settings = RayExecutor.create_settings(placement_group_timeout_s=2)
    for kwargs in ({"num_workers": 5}, {"num_workers": 1, "use_gpu": True}):
        ex = RayExecutor(settings, **kwargs)
        with pytest.raises(RuntimeError, match="could not reserve") as err:
            ex.start()
        assert "available" in str(err.value)
        ex.shutdown()
    _nothing_left(cluster, [])


def test_bad_arguments_and_calls_before_start_are_explained(cluster):
    from horovod.ray import RayExecutor

    with pytest.raises(ValueError, match="exactly one of num_workers"):
        RayExecutor(num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="exactly one of num_workers"):
        RayExecutor()
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        RayExecutor(num_workers=0)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(num_workers=2, min_workers=1)
    ex = RayExecutor(num_workers=1)
    with pytest.raises(RuntimeError, match=r"run\(\) before start\(\)"):
        ex.run(print)
    ex.shutdown()  # nothing started: nothing to do


def test_importing_horovod_ray_imports_no_training_framework():
    code = (
        "import sys, horovod.ray\n"
        "bad = [m for m in ('torch', 'tensorflow', 'jax', 'mxnet', 'horovod.core') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_ray_example_trains_the_digits_model(cluster):
    """examples/ray_torch_digits.py's training function on this module's cluster."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    try:
        import ray_torch_digits
    finally:
        sys.path.pop(0)
    from horovod.ray import RayExecutor

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    ex.start()
    try:
        out = ex.run(ray_torch_digits.train, args=[8, 32, 0.02])
    finally:
        ex.shutdown()
    assert [r["rank"] for r in out] == [0, 1] and out[0]["accuracy"] >= 0.9
    assert out[0]["checksum"] == out[1]["checksum"]  # the replicas stayed identical


def test_the_root_cause_is_the_rank_whose_own_error_it_was(cluster):
    """A rank waiting for a dead peer fails too (Horovod's error, a consequence), and may be
    reported by Ray first: the executor names the other rank."""
    from horovod.common.exceptions import HorovodInternalError
    from horovod.ray.runner import root_cause

    @cluster.remote
    def consequence():
        raise HorovodInternalError("rank 1 exited or lost its connection")

    @cluster.remote
    def own():
        raise KeyError("bad batch 42")

    refs = [consequence.remote(), own.remote()]
    cluster.wait(refs, num_returns=2)
    rank, why, _ = root_cause(refs)
    assert rank == 1 and why == "KeyError: 'bad batch 42'"
    refs = [consequence.remote()]
    cluster.wait(refs)
    assert root_cause(refs)[0] == 0  # only consequences: the first of them


# ---------------------------------------------------------------------------- elastic jobs
def _faults_env(tmp_path, faults):
    return {"HVD_TEST_FAULTS": json.dumps(faults), "HVD_TEST_FAULT_DIR": str(tmp_path)}


def _log(path):
    if not path.exists():
        return []
    return [tuple(int(x) for x in line.split()[1:]) for line in path.read_text().splitlines()]


def test_elastic_job_survives_a_dying_actor_and_a_leaving_node_and_grows_back(nodes, tmp_path):
    """Round 0 takes every slot: 3 on the head node, 1 on a second node. Rank 1's actor dies
    (``os._exit``): its host is blacklisted for 1 s, the others go on, then the host's free
    slot is used again. The second node then leaves the cluster: its worker is lost and the
    job finishes on the head node. The weights are those of training without faults."""
    import numpy as np
    import ray

    from horovod.ray import RayExecutor
    from horovod.testing.elastic_train import reference_weights, train_job

    second = nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    log = tmp_path / "log"
    removed = threading.Event()

    def remove_when_grown_back():
        # once a round after the actor's death has 4 workers again, the node leaves
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(size == 4 and rnd >= 2 for _, _, size, rnd in _log(log)):
                nodes.remove_node(second)  # graceful: as when a node is drained
                removed.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=remove_when_grown_back, daemon=True)
    watcher.start()
    settings = RayExecutor.create_settings(timeout_s=30)
    ex = RayExecutor(
        settings, min_workers=2, max_workers=4, cooldown_range=(1, 1), elastic_timeout=60
    )
    faults = [{"id": "die", "epoch": 0, "batch": 2, "rank": 1, "how": "exit"}]
    ex.start(extra_env_vars=_faults_env(tmp_path, faults))
    try:
        out = ex.run(
            train_job,
            kwargs={"epochs": 4, "batches": 8, "step_seconds": 0.2, "log": str(log)},
        )
    finally:
        ex.shutdown()
        watcher.join(5)
        if not removed.is_set():
            nodes.remove_node(second)
    assert removed.is_set(), _log(log)
    sizes = [size for _, _, size, _ in _log(log)]
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 3, sizes
    assert [o["rank"] for o in out] == [0, 1, 2] and {o["size"] for o in out} == {3}
    want = reference_weights(4, 8)
    for o in out:
        np.testing.assert_array_equal(o["w"], out[0]["w"])  # the replicas agree bitwise
        np.testing.assert_allclose(o["w"], want, rtol=1e-9, atol=1e-12)
    failures = ex._elastic.driver.failures
    assert [f.rank for f in failures][:1] == [1] and "lost its actor" in failures[0].what
    assert any(f.slot.startswith(second.node_id) for f in failures), failures
    _nothing_left(ray, [])


def always_fails():
    import horovod.numpy as hvd

    hvd.init()
    raise ValueError(f"rank {hvd.rank()} cannot read its shard")


def test_elastic_failures_and_bad_calls_are_explained(cluster, tmp_path):
    from horovod.ray import ElasticRayExecutor, RayExecutor

    # every worker fails: no one is left to carry the training state, and the job says so
    ex = RayExecutor(min_workers=1, max_workers=2)
    ex.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no worker of round 0 is left") as err:
        ex.run(always_fails)
    assert time.monotonic() - t0 < 60
    assert "ValueError: rank" in str(err.value) and "cannot read its shard" in str(err.value)
    assert "\x1b" not in str(err.value)  # Ray's colours are taken out of the tail
    ex.shutdown()
    # more workers than the cluster has slots, within elastic_timeout: a clear timeout
    settings = ElasticRayExecutor.create_settings(min_num_proc=8, elastic_timeout=2)
    ex2 = ElasticRayExecutor(settings)
    with pytest.raises(RuntimeError, match=r"before start\(\)"):
        ex2.run(always_fails)
    ex2.start()
    with pytest.raises(RuntimeError, match="3 usable, 8 needed .min_workers.") as err:
        ex2.run(always_fails)
    assert "Add nodes to the Ray cluster" in str(err.value)
    # only run() in elastic mode; sizes are checked up front
    ex3 = RayExecutor(min_workers=1)
    ex3.start()
    with pytest.raises(NotImplementedError, match="support run.. only"):
        ex3.execute(lambda w: w)
    with pytest.raises(NotImplementedError, match="executable_cls"):
        ex3.start(executable_cls=Counter)
    with pytest.raises(ValueError, match="max_num_proc must be an int >= min_num_proc"):
        ElasticRayExecutor.create_settings(min_num_proc=3, max_num_proc=2)
    # slots per node: its CPUs per worker, and no more than its GPUs when workers need one
    from horovod.ray import RayHostDiscovery

    assert [h.slots for h in RayHostDiscovery(cpus_per_slot=2).find()] == [1]
    assert [h.slots for h in RayHostDiscovery(cpus_per_slot=1).find()] == [3]
    assert RayHostDiscovery(use_gpu=True).find() == []  # the head node has no GPU
    _nothing_left(cluster, [])
