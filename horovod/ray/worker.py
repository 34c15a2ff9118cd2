"""The Ray actor each Horovod rank runs in (upstream's ``horovod.ray.BaseHorovodWorker``).

The executor creates one actor per rank, asks where it landed (``node_info``), gives it the
rank's ``HOROVOD_*`` environment (``update_env_vars``), optionally builds the user's executable
object in it (``start_executable``), then calls functions in it: ``run(fn, args, kwargs)`` and
``execute(fn)`` (``fn(executable)``). The function calls ``hvd.init()`` like any worker.

Must not touch: the training runtime at import (a rank's frameworks are imported by the user's
function in the actor, never by this module: ``import horovod.ray`` stays light, ray #32332).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any


class BaseHorovodWorker:
    """The body of a rank's actor (wrapped with ``ray.remote`` by the executor)."""

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        self.world_rank, self.world_size = world_rank, world_size
        self.executable: Any = None

    def node_info(self) -> tuple[str, str, int]:
        """(Ray node id, host name, pid): where this rank runs."""
        import ray

        return ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid()

    def update_env_vars(self, env: Mapping[str, str]) -> None:
        os.environ.update({k: str(v) for k, v in env.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: Callable[..., Any] | None = None,
        executable_args: list | None = None,
        executable_kwargs: dict | None = None,
    ) -> None:
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> Any:
        return fn(*(args or ()), **(kwargs or {}))

    def run_elastic(
        self, fn: Callable[..., Any], args: Any, kwargs: Any, env: Mapping[str, str]
    ) -> Any:
        """One elastic worker: ``fn`` in this fresh actor with the worker's environment; Horovod
        is shut down when it returns or raises (the actor is not reused)."""
        self.update_env_vars(env)
        try:
            return fn(*(args or ()), **(kwargs or {}))
        finally:
            self.stop_horovod()

    def stop_horovod(self) -> None:
        """Shut this rank's Horovod down if the user's functions started it (so shared-memory
        segments and sockets are released before the actor is killed)."""
        ctx_mod = sys.modules.get("horovod.core.context")
        if ctx_mod is not None and ctx_mod.current() is not None:
            ctx_mod.shutdown()
