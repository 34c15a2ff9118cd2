"""Process sets: static and dynamic, membership, ids, errors."""

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.common.exceptions import HorovodInternalError
from horovod.testing import RankFailed, run_ranks


def test_static_process_sets():
    def body(rank):
        even = hvd.ProcessSet([0, 2, 4])
        odd = hvd.ProcessSet([3, 1])
        hvd.shutdown()
        hvd.init(process_sets=[even, odd])
        assert (even.process_set_id, odd.process_set_id) == (1, 2)
        assert odd.ranks == [1, 3]
        mine = even if rank % 2 == 0 else odd
        assert mine.included() and mine.size() == len(mine.ranks)
        assert mine.rank() == mine.ranks.index(rank)
        other = odd if mine is even else even
        assert other.included() is False
        with pytest.raises(ValueError, match="not part of provided process set"):
            other.rank()
        s = hvd.allreduce(np.array([rank]), op=hvd.Sum, process_set=mine, name="s")
        g = hvd.allgather(np.array([rank]), process_set=mine, name="g")
        b = hvd.broadcast(np.array([rank]), root_rank=mine.ranks[-1], process_set=mine)
        rs = hvd.reducescatter(np.arange(6.0), op=hvd.Sum, process_set=mine)
        a2a = hvd.alltoall(np.arange(len(mine.ranks)) + 10 * rank, process_set=mine)
        hvd.barrier(process_set=mine)
        with pytest.raises(ValueError, match=f"rank {rank} is not a member"):
            hvd.allreduce(np.ones(1), process_set=other)
        with pytest.raises(ValueError, match="root_rank"):
            hvd.broadcast(np.ones(1), root_rank=other.ranks[0], process_set=mine)
        whole = hvd.allreduce(np.array([1]), op=hvd.Sum)
        return int(s[0]), g.tolist(), int(b[0]), rs.tolist(), a2a.tolist(), int(whole[0])

    res = run_ranks(body, 5)
    assert res[0][:3] == (6, [0, 2, 4], 4)
    assert res[1][:3] == (4, [1, 3], 3)
    assert res[4][3] == [12.0, 15.0]  # rank 4 is set-rank 2 of 3: last block of 6 rows
    assert res[3][4] == [11, 31]  # alltoall within {1, 3}: element 1 of each
    assert all(r[5] == 5 for r in res)


def test_static_sets_must_match_on_every_rank():
    def body(rank):
        hvd.shutdown()
        hvd.init(process_sets=[hvd.ProcessSet([0, 1] if rank != 1 else [0, 2])])

    with pytest.raises(RankFailed, match="mismatching process sets"):
        run_ranks(body, 3)


def test_process_set_argument_errors():
    with pytest.raises(ValueError, match="list of process ranks"):
        hvd.ProcessSet(3)
    with pytest.raises(ValueError, match="distinct"):
        hvd.ProcessSet([1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        hvd.ProcessSet([-1])
    assert hvd.ProcessSet([2, 0]).size() is None  # not registered
    assert (
        str(hvd.ProcessSet([2, 0]))
        == "ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)"
    )

    def body(rank):
        hvd.shutdown()
        with pytest.raises(ValueError, match="is a duplicate"):
            hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([0])])
        with pytest.raises(ValueError, match="names ranks \\[4\\]"):
            hvd.init(process_sets=[hvd.ProcessSet([0, 4])])
        hvd.init()
        with pytest.raises(ValueError, match="is not registered"):
            hvd.allreduce(np.ones(1), process_set=hvd.ProcessSet([0, 1]))
        with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
            hvd.add_process_set([0, 1])
        with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
            hvd.remove_process_set(hvd.ProcessSet([0]))

    run_ranks(body, 2)


def test_dynamic_process_sets():
    def body(rank):
        a = hvd.add_process_set([0, 1])
        b = hvd.add_process_set(hvd.ProcessSet([1, 2]))
        assert (a.process_set_id, b.process_set_id) == (1, 2)
        with pytest.raises(ValueError, match="duplicate process set"):
            hvd.add_process_set([1, 0])
        with pytest.raises(ValueError, match="ranks \\[7\\] do not exist"):
            hvd.add_process_set([0, 7])
        out = []
        for ps in (a, b):
            if ps.included():
                out.append(int(hvd.allreduce(np.array([rank]), op=hvd.Sum, process_set=ps)[0]))
        assert hvd.remove_process_set(a) is True
        assert a.process_set_id is None
        assert hvd.remove_process_set(a) is False
        assert hvd.remove_process_set(hvd.global_process_set) is False
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(np.ones(1), process_set=a)
        c = hvd.add_process_set([0, 2])
        assert c.process_set_id == 1  # freed ids are reused
        if c.included():
            out.append(int(hvd.allreduce(np.array([rank]), op=hvd.Sum, process_set=c)[0]))
        return out

    res = run_ranks(body, 3, init_kwargs={"process_sets": "dynamic"})
    assert res == [[1, 2], [1, 3], [3, 2]]


def test_sets_run_concurrently_without_deadlock():
    """Overlapping sets with async ops issued in opposite orders on different ranks."""

    def body(rank):
        a = hvd.add_process_set([0, 1, 2])
        b = hvd.add_process_set([1, 2, 3])
        mine = [ps for ps in (a, b) if ps.included()]
        if rank == 2:
            mine = mine[::-1]
        hs = [
            hvd.allreduce_async(
                np.ones(50_000) * rank, op=hvd.Sum, process_set=ps, name=f"x{ps.process_set_id}"
            )
            for ps in mine
        ]
        return [float(hvd.synchronize(h)[0]) for h in hs]

    res = run_ranks(body, 4, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert res[0] == [3.0] and res[3] == [6.0]
    assert sorted(res[1]) == [3.0, 6.0] and sorted(res[2]) == [3.0, 6.0]


def test_mismatched_dynamic_set_arguments_error_on_every_rank():
    def body(rank):
        with pytest.raises(HorovodInternalError, match="argument"):
            hvd.add_process_set([0, 1] if rank == 0 else [0, 2])
        return "ok"

    assert run_ranks(body, 3, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}) == ["ok"] * 3
