"""The hang doctor end to end, under the real horovodrun: a stalled job is reported with the
missing rank, the tensor and where that rank is (file, line, function), a collective called by a
subset of ranks is named as such, and past the shutdown limit the job ends with that report as
its root cause. Nothing hangs: every job here is bounded by the stall settings."""

import re
import time

import psutil
import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

STALL_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3",
}


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_sleeping_rank_is_named_with_its_file_line_and_function(plane):
    """(Over TCP alone the control messages are read by the polling thread, not by reader
    threads: the hang doctor's question must still be answered by the sleeping rank.)"""
    out = run_script(
        """
        import time
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()

        def load_batch():
            time.sleep(60)  # line 9: rank 1 is stuck here

        if hvd.rank() == 1:
            load_batch()
        hvd.allreduce(np.ones(4), name="fc2.weight")
        """,
        env={**STALL_ENV, **({"HOROVOD_SHARED_MEMORY": "0"} if plane == "tcp" else {})},
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    # The warning while it is still running, and the final report: both name rank 1, the
    # tensor and the line in load_batch; the stack shows the sleeping line.
    assert re.search(
        r"allreduce 'fc2\.weight': submitted by rank 0 at script\.py:13 in <module>", text
    ), text
    assert "rank 1 never submitted allreduce 'fc2.weight'; it is in script.py:9 in load_batch" in (
        text
    ), text
    assert "time.sleep(60)  # line 9: rank 1 is stuck here" in text
    # horovodrun prints the diagnosis last, as the root cause.
    tail = out.stderr[out.stderr.index("horovodrun: the job failed.") :]
    assert "Root cause, as diagnosed by rank 0" in tail
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3 was exceeded" in tail
    assert tail.rstrip().endswith("was exceeded."), tail


def test_collective_called_by_rank_0_only_is_diagnosed_as_such():
    out = run_script(
        """
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()
        x = np.ones(4)
        if hvd.rank() == 0:
            hvd.allreduce(x, name="only_on_rank_0")
        hvd.allreduce(x, name="everyone")
        """,
        np_=3,
        env=STALL_ENV,
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert re.search(
        r"Deadlock: rank 0 waits in allreduce 'only_on_rank_0' at script\.py:8 in <module> "
        r"for ranks \[1, 2\], while ranks \[1, 2\] wait in allreduce 'everyone' at "
        r"script\.py:9 in <module> for rank 0",
        text,
    ), text
    assert (
        "Most likely allreduce 'only_on_rank_0' is called by only rank 0 (for example inside "
        "`if hvd.rank() == 0:`)" in text
    )


def test_rank_stuck_in_c_code_holding_the_gil_gets_its_stack_dumped():
    """ctypes.PyDLL keeps the GIL during the call: rank 1 cannot answer over the control
    channel, so rank 0 has faulthandler dump its stack (same host) and says so. (libc's
    system() retries its wait after the signal, so the rank stays stuck as real C code would.)"""
    out = run_script(
        """
        import ctypes
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()

        def stuck_in_c():
            ctypes.PyDLL(None).system(b"sleep 15")  # line 9: C code holding the GIL

        if hvd.rank() == 1:
            stuck_in_c()
        hvd.allreduce(np.ones(2), name="w")
        """,
        env=STALL_ENV,
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "rank 1 never submitted allreduce 'w', and did not answer within 2 s" in text, text
    assert "dumped to its stderr by faulthandler" in text
    assert re.search(r"\[1\]<stderr>:\s+File \".*script\.py\", line 9 in stuck_in_c", text), text


def test_rank_that_exits_without_the_collective_is_named():
    out = run_script(
        """
        import time
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()
        if hvd.rank() == 0:
            hvd.allreduce(np.ones(2), name="last_one")
        else:
            time.sleep(1)  # exit after rank 0 submitted (else rank 0 submits after shutdown)
        """,
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert re.search(
        r"allreduce 'last_one' was submitted by rank 0 at script\.py:8 in <module> but "
        r"rank 1 exited without submitting it",
        text,
    ), text


@pytest.mark.parametrize(
    "frozen,path_env",
    [
        (1, {}),  # peer rounds and the express way (the default on one host)
        (0, {}),
        (0, {"HOROVOD_PEER_ROUNDS": "0"}),  # through the coordinator, eager data
        (0, {"HOROVOD_CACHE_CAPACITY": "0"}),  # through the coordinator, negotiated
    ],
    ids=["rank1-rounds", "rank0-rounds", "rank0-eager", "rank0-negotiated"],
)
def test_a_frozen_rank_stops_the_job_at_the_stall_shutdown_on_every_path(frozen, path_env):
    """Issue 38: a rank stops itself (SIGSTOP) in a loop of allreduces. Whatever path the
    allreduces take, and even when the frozen rank is rank 0 (which runs the stall inspector),
    the job is stopped at HOROVOD_STALL_SHUTDOWN_TIME_SECONDS with a report naming the frozen
    rank, and the stopped process does not outlive horovodrun."""
    t0 = time.monotonic()
    out = run_script(
        f"""
        import os, signal
        import numpy as np
        import horovod.numpy as hvd

        hvd.init()
        print("pid", hvd.rank(), os.getpid(), flush=True)
        for step in range(1_000_000):
            if hvd.rank() == {frozen} and step == 100:
                os.kill(os.getpid(), signal.SIGSTOP)
            hvd.allreduce(np.ones(1024, np.float32), name="x")
        """,
        env={**STALL_ENV, **path_env},
        timeout=60,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert time.monotonic() - t0 < 30, text
    tail = out.stderr[out.stderr.index("horovodrun: the job failed.") :]
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3 was exceeded" in tail, text
    other = 1 - frozen
    assert re.search(rf"Root cause, as diagnosed by rank {other}\b|as diagnosed by rank 0", tail)
    assert f"rank {frozen}" in tail.split("Root cause", 1)[1], tail
    pids = [int(p) for p in re.findall(r"<stdout>:pid \d (\d+)", out.stdout)]
    assert len(pids) == 2, out.stdout
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, "a worker outlived horovodrun"
        time.sleep(0.1)
