"""Eager TensorFlow tensors on a GPU to the device data plane: torch views of the same memory
(DLPack) through ``horovod.torch``, results back the same way (docs/gpu.md). Needs PyTorch
beside TensorFlow; without it GPU tensors go through host memory as CPU tensors do.

Must not touch: the engine, graph mode (inside ``tf.function`` tensors go through the host
callbacks of ``mpi_ops``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from horovod import frontend as F


def on_device(inputs: Sequence[tf.Tensor]) -> bool:
    """Do these eager tensors go to the device data plane: tensors on a GPU, or any tensor
    with ``HOROVOD_DEVICE_PLANE_TEST`` (the plane tested without a GPU)?"""
    if not _have_torch():
        return False  # without PyTorch, GPU tensors go through host memory
    return F.device_standin() or any("GPU" in (getattr(x, "device", "") or "") for x in inputs)


@functools.cache
def _have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def call(
    fn: Callable[..., Sequence[Any]],
    inputs: Sequence[tf.Tensor],
    touts: Sequence[tf.DType],
    to_tensor: Callable[[Any, tf.DType], tf.Tensor],
) -> list[tf.Tensor]:
    """``fn`` on torch views of the tensors (DLPack: no copy) through horovod.torch, so the
    device data plane moves them; results back the same way. TensorFlow exports no stream
    over DLPack, so its GPU work is finished before torch reads the tensors, and torch's
    before TensorFlow reads the results (docs/gpu.md)."""
    import torch

    import horovod.torch as api

    on_gpu = any("GPU" in (getattr(x, "device", "") or "") for x in inputs)
    if on_gpu:
        tf.test.experimental.sync_devices()
    views = [torch.from_dlpack(tf.experimental.dlpack.to_dlpack(x)) for x in inputs]
    outs = fn(api, *views)
    if on_gpu:
        torch.cuda.current_stream().synchronize()
    results = []
    for o, d in zip(outs, touts, strict=True):
        if isinstance(o, torch.Tensor):
            results.append(tf.experimental.dlpack.from_dlpack(torch.to_dlpack(o.contiguous())))
        else:
            results.append(to_tensor(o, d))
    return results
