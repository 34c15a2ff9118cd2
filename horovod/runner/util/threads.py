"""Upstream's ``horovod.runner.util.threads``: starting a function on a thread, and running a
function over many argument lists on a pool of threads.

Must not touch: the launcher's own processes and threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def in_thread(
    target: Callable[..., Any],
    args: Iterable[Any] = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return the thread. ``silent``: an exception
    ``target`` raises is swallowed instead of reported by ``threading.excepthook``."""
    args = tuple(args)

    def run() -> None:
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    t = threading.Thread(target=run, name=name, daemon=daemon)
    t.start()
    return t


def execute_function_multithreaded(
    fn: Callable[..., Any],
    args_list: list[Iterable[Any]],
    block_until_all_done: bool = True,
    max_concurrent_executions: int = 1000,
) -> dict[int, Any] | None:
    """``fn(*args)`` for every entry of ``args_list`` on up to ``max_concurrent_executions``
    threads; with ``block_until_all_done``, the results by index (an exception is raised
    here), else None at once."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(max_concurrent_executions, len(args_list))))
    futures = {i: pool.submit(fn, *args) for i, args in enumerate(args_list)}
    pool.shutdown(wait=block_until_all_done)
    if not block_until_all_done:
        return None
    return {i: f.result() for i, f in futures.items()}
