"""The launcher side: ``horovodrun`` (``horovod.runner.launch``), host parsing and placement,
worker processes, and ``horovod.run`` (``run``). It never imports the training runtime.

Must not touch: the training runtime (core, transport, frontends): the launcher and the runtime
never import each other.
"""

from horovod.runner.run_func import RemoteTraceback, run

__all__ = ["RemoteTraceback", "run"]
