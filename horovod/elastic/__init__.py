"""Elastic training on the worker side, framework-free: ``State``/``ObjectState`` (commit,
restore, sync), the ``run`` retry loop, and the poller that hears of host changes from
horovodrun's driver. Frameworks add their own states (``horovod.torch.elastic.TorchState``,
``horovod.tensorflow.elastic.TensorFlowKerasState``) on top of ``State``.

Must not touch: the launcher (the driver is ``horovod.runner.elastic``); the engine's internals.
"""

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.elastic.run import run, run_fn
from horovod.elastic.state import ObjectState, State

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "run",
    "run_fn",
]
