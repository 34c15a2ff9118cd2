"""``SparkBackend``: how an estimator runs its training function on Spark (upstream's
``horovod.spark.common.backend``): ``horovod.spark.run`` on ``num_proc`` tasks.

Must not touch: the training runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class SparkBackend:
    """Runs ``fn`` on ``num_proc`` Spark tasks as one Horovod job (``horovod.spark.run``'s
    arguments, kept for every call)."""

    def __init__(
        self,
        num_proc: int | None = None,
        env: Mapping[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        verbose: int = 1,
        nics: Any = None,
        start_timeout: float | None = None,
        prefix_output_with_timestamp: bool = False,
        **_upstream: Any,
    ) -> None:
        if num_proc is not None and num_proc < 1:
            raise ValueError(f"SparkBackend: num_proc must be at least 1, got {num_proc}")
        self._num_proc = num_proc
        self._kwargs = dict(
            env=env,
            stdout=stdout,
            stderr=stderr,
            verbose=verbose,
            nics=nics,
            start_timeout=start_timeout,
            prefix_output_with_timestamp=prefix_output_with_timestamp,
        )

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        from horovod.spark.runner import run

        opts = dict(self._kwargs)
        if env:
            opts["env"] = {**(opts["env"] or {}), **env}
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(), **opts)

    def num_processes(self) -> int:
        if self._num_proc is None:
            from horovod.spark.runner import spark_context

            return int(spark_context().defaultParallelism)
        return self._num_proc
