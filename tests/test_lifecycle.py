"""The runtime's lifecycle: ``hvd.init()`` builds everything a job needs and ``hvd.shutdown()``
releases all of it, so a process can initialise again at another size and rank (what an elastic
reset does). Real processes under horovodrun, each going through several worlds in turn."""

from __future__ import annotations

import os

import pytest
from conftest import run_script

from horovod.common.shm_names import PREFIX, shm_dir

pytestmark = pytest.mark.e2e

# Every process goes through these worlds in order. A world maps the process's launch rank to
# its rank in that world (None: not a member; it runs a job of one meanwhile, so that every
# process initialises the same number of times and all agree on the rendezvous round).
WORLDS_3 = [
    {0: 0, 1: 1, 2: 2},  # three ranks
    {0: 1, 1: 0, 2: None},  # two ranks, numbered the other way round; launch rank 2 alone
    {0: 2, 1: 0, 2: 1},  # three again, each at another rank than the first time
]
WORLDS_2 = [
    {0: 0, 1: 1},
    {0: None, 1: None},  # both alone: jobs of one process (no transport to a peer at all)
    {0: 1, 1: 0},
]

SCRIPT = """
    import os, sys, threading
    import numpy as np
    import psutil
    import horovod.numpy as hvd
    from horovod.common.shm_names import PREFIX

    WORLDS = {worlds}
    me = int(os.environ["HOROVOD_RANK"])
    proc = psutil.Process()

    def leftovers():
        # Shared-memory segments this process still maps (unlinked ones too; another
        # world's segments may exist in /dev/shm for a moment while its ranks map them).
        with open("/proc/self/maps") as f:
            segs = sorted({{line.split()[-2 if line.endswith("(deleted)\\n") else -1]
                           for line in f if PREFIX in line}})
        return (
            sorted(t.name for t in threading.enumerate()),
            proc.num_fds(),
            len(proc.net_connections(kind="all")),
            segs,
        )

    def enter(world):
        rank = world[me]
        size = sum(r is not None for r in world.values()) if rank is not None else 1
        for k, v in dict(
            HOROVOD_RANK=rank or 0, HOROVOD_SIZE=size, HOROVOD_LOCAL_RANK=rank or 0,
            HOROVOD_LOCAL_SIZE=size, HOROVOD_CROSS_RANK=0, HOROVOD_CROSS_SIZE=1,
        ).items():
            os.environ[k] = str(v)
        return rank or 0, size

    def collectives(rank, size, step):
        # Results from formulas: sums of rank-dependent data, rows per rank, roots.
        x = np.arange(1000, dtype=np.float32) + 1000 * rank + step
        want = size * (np.arange(1000, dtype=np.float32) + step) + 1000 * size * (size - 1) / 2
        assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, name="x"), want)
        for _ in range(20):  # the response cache, peer rounds and the express way warm up
            assert hvd.allreduce(np.float64([rank]), op=hvd.Sum, name="s")[0] == size * (size - 1) / 2
        g = hvd.allgather(np.full((rank + 1, 3), rank, np.int32), name="g")
        assert g.shape == (size * (size + 1) // 2, 3)
        assert g[:, 0].tolist() == [r for r in range(size) for _ in range(r + 1)]
        b = hvd.broadcast(np.full(70_000, rank, np.int64), root_rank=size - 1, name="b")
        assert (b == size - 1).all()
        a = hvd.alltoall(np.full(size, rank, np.int16), name="a")
        assert a.tolist() == list(range(size))
        rs = hvd.reducescatter(np.ones((size * 2, 4), np.float32) * (rank + 1), op=hvd.Sum)
        assert rs.shape == (2, 4) and (rs == size * (size + 1) / 2).all()
        assert hvd.broadcast_object({{"step": step, "from": rank}}, root_rank=0)["from"] == 0
        hvd.barrier()

    before = leftovers()
    for step, world in enumerate(WORLDS):
        rank, size = enter(world)
        hvd.init()
        assert (hvd.rank(), hvd.size(), hvd.is_initialized()) == (rank, size, True)
        collectives(rank, size, step)
        hvd.shutdown()
        assert not hvd.is_initialized()
        after = leftovers()
        assert after == before, f"world {{step}} left behind: {{after}} (before: {{before}})"
        print(f"world {{step}}: rank {{rank}} of {{size}} clean", flush=True)
    print("done", flush=True)
"""


@pytest.mark.parametrize("worlds", [WORLDS_3, WORLDS_2], ids=["3-2-3", "2-1-2"])
def test_init_shutdown_and_init_at_another_size_leave_nothing_behind(worlds):
    np_ = len(worlds[0])
    ours = {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}
    out = run_script(SCRIPT.format(worlds=repr(worlds)), np_=np_, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("done") == np_, out.stdout
    assert {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)} <= ours
    for step, world in enumerate(worlds):
        members = [r for r in world.values() if r is not None]
        size = len(members)
        for launch, rank in world.items():
            if rank is None:
                line = f"[{launch}]<stdout>:world {step}: rank 0 of 1 clean"
            else:
                line = f"[{launch}]<stdout>:world {step}: rank {rank} of {size} clean"
            assert line in out.stdout, (line, out.stdout)


def test_a_job_scope_lets_workers_with_different_pasts_meet():
    """Workers that outlive one job (Spark's reused Python workers) have each called
    hvd.init() a different number of times; HOROVOD_RENDEZVOUS_SCOPE (set per job by
    horovod.spark.run and horovod.ray) makes them meet anyway. Here rank 0 first runs a job of
    its own, then both ranks start the shared one."""
    script = """
        import os
        import numpy as np
        import horovod.numpy as hvd

        shared = dict(os.environ)
        if shared["HOROVOD_RANK"] == "0":  # an earlier one-rank job in this process
            os.environ.update(HOROVOD_SIZE="1", HOROVOD_LOCAL_SIZE="1", HOROVOD_CROSS_SIZE="1")
            if "HOROVOD_RENDEZVOUS_SCOPE" in shared:  # that job had its own scope
                os.environ["HOROVOD_RENDEZVOUS_SCOPE"] = "job-earlier"
            hvd.init()
            hvd.shutdown()
            os.environ.clear()
            os.environ.update(shared)
        hvd.init()
        print("sum", hvd.allreduce(np.ones(2), op=hvd.Sum).tolist(), flush=True)
    """
    env = {"HOROVOD_START_TIMEOUT": "10", "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}
    r = run_script(script, 2, env={**env, "HOROVOD_RENDEZVOUS_SCOPE": "job-a"}, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("sum [2.0, 2.0]") == 2
    # without a job scope the processes count their own inits and miss each other
    r = run_script(script, 2, env=env, timeout=90)
    assert r.returncode != 0
