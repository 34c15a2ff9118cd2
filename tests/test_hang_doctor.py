"""The hang doctor end to end, under the real horovodrun: a stalled job is reported with the
missing rank, the tensor and where that rank is (file, line, function), a collective called by a
subset of ranks is named as such, and past the shutdown limit the job ends with that report as
its root cause. Nothing hangs: every job here is bounded by the stall settings."""

import re

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

STALL_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3",
}


def test_sleeping_rank_is_named_with_its_file_line_and_function():
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
        env=STALL_ENV,
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
