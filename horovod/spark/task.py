"""What a Spark task knows about itself (upstream's ``horovod.spark.task``).

Must not touch: the training runtime.
"""

from __future__ import annotations


def get_available_devices() -> list[str]:
    """The GPU addresses Spark assigned to this task (its ``gpu`` resource), as strings; an
    empty list outside a task or without GPUs."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return []
    ctx = TaskContext.get()
    if ctx is None:
        return []
    gpu = ctx.resources().get("gpu")
    return list(gpu.addresses) if gpu is not None else []
