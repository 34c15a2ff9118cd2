"""``import horovod.numpy as hvd``: the framework-free Horovod API on NumPy arrays.

It is the reference frontend: every collective in its sync, ``_async``, in-place ``_`` and
grouped forms, handles (``poll``/``synchronize``), join, barrier, object collectives, process
sets, compression, Local SGD and DiLoCo, and elastic training (``hvd.elastic.run``, ``hvd.elastic.ObjectState``), with the semantics of upstream's ``horovod.torch`` applied to arrays.

Must not touch: anything: it re-exports ``horovod.frontend``.
"""

from horovod import elastic
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.frontend import *  # noqa: F403
from horovod.frontend import __all__ as _frontend_all
from horovod.frontend.local_sgd import DiLoCo, LocalSGD

__all__ = list(_frontend_all) + ["DiLoCo", "HostsUpdatedInterrupt", "LocalSGD", "elastic"]
