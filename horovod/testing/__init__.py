"""Run N ranks as N threads of this process, over the in-process loopback transport.

    from horovod.testing import run_ranks
    import horovod.numpy as hvd

    def body(rank):
        return hvd.allreduce(np.array([rank]), op=hvd.Sum)

    results = run_ranks(body, size=3)   # one result per rank

Each rank thread calls ``hvd.init()`` before ``fn``; after it, a rank that succeeded waits at a
barrier for the others, then calls ``hvd.shutdown()``. A failing rank shuts down at once, so
the others fail with the shutdown message instead of waiting forever. Most multi-rank tests of
pyhorovod use this and take milliseconds.

Must not touch: the runtime's internals beyond ``horovod.core.context``'s public functions.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from horovod.core import context as _context
from horovod.transport.loopback import LoopbackWorld


class RankFailed(AssertionError):
    """One or more rank threads raised; the message holds each rank's traceback."""

    def __init__(self, failures: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        first = min(failures)
        parts = [
            f"rank {r} raised {type(e).__name__}: {e}\n{tracebacks[r]}"
            for r, e in sorted(failures.items())
        ]
        super().__init__(
            f"{len(failures)} rank(s) failed; first: rank {first}\n\n" + "\n".join(parts)
        )
        self.failures = failures
        self.first = failures[first]


def _barrier_quietly() -> None:
    from horovod.frontend import barrier

    try:
        barrier()
    except Exception:
        pass  # the job already failed elsewhere; that rank's error is what gets reported


def run_ranks(
    fn: Callable[[int], Any],
    size: int,
    *,
    env: Mapping[str, str] | None = None,
    hosts: Sequence[str] | None = None,
    init: bool = True,
    timeout: float = 60.0,
    init_kwargs: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(rank)`` on ``size`` rank threads and return the results in rank order.

    ``env``: HOROVOD_* settings for every rank (the process environment is not read).
    ``hosts``: a host name per rank, to simulate a multi-host layout (local/cross ranks).
    Raises ``RankFailed`` if any rank raised, and ``TimeoutError`` (after aborting every rank)
    if the ranks did not finish within ``timeout`` seconds.
    """
    world = LoopbackWorld(size)
    results: list[Any] = [None] * size
    failures: dict[int, BaseException] = {}
    tbs: dict[int, str] = {}
    contexts: list[Any] = [None] * size
    base_env = {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    base_env.update(env or {})

    def body(rank: int) -> None:
        spec = _context.RankSpec(world, rank, dict(base_env), list(hosts) if hosts else None)
        _context.enter_rank(spec)
        try:
            if init:
                _context.init(**(init_kwargs or {}))
                contexts[rank] = _context.current()
            results[rank] = fn(rank)
            ctx = _context.current()
            if init and ctx is not None and not ctx.stopped:
                _barrier_quietly()  # like upstream's tests: nobody shuts down under the others
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            failures[rank] = e
            tbs[rank] = "".join(traceback.format_exception(*sys.exc_info()))
        finally:
            try:
                _context.shutdown()
            except BaseException as e:  # noqa: BLE001
                failures.setdefault(rank, e)
                tbs.setdefault(rank, traceback.format_exc())

    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True) for r in range(size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        for ctx in contexts:
            if ctx is not None:
                ctx.engine._abort("run_ranks timed out")
        for t in threads:
            t.join(5)
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout:g} s")
    if failures:
        raise RankFailed(failures, tbs)
    return results


def engine() -> Any:
    """The engine of this process's initialized job (``hvd.init()`` first): for benchmarks
    and tests that look at its counters or switch its size limits."""
    ctx = _context.current()
    if ctx is None:
        raise RuntimeError("Horovod has not been initialized; use hvd.init()")
    return ctx.engine
