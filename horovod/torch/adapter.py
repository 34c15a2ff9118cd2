"""The torch tensor adapter: tensors to NumPy views of the same memory and back, the checks
on what a collective accepts, and handles (``poll``, ``synchronize``).

CPU tensors are viewed without a copy (bfloat16 and bool through a same-size integer view).
CUDA tensors stay on their device: they reach the engine as ``DeviceArray``s carrying the
tensor and an event on the caller's current stream, the device data plane (``horovod.device``)
moves them, and a result is handed back only after the caller's stream waits for the plane's
done event (``horovod.device.streams.consume``). With ``HOROVOD_DEVICE_PLANE_TEST`` CPU
tensors take that path too (the plane tested without a GPU).

Must not touch: the engine (everything goes through ``horovod.frontend``), autograd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from horovod import frontend as F
from horovod.common.dtypes import BFLOAT16
from horovod.common.exceptions import HorovodInternalError
from horovod.core.messages import CPU_DEVICE, DEVICE

Average, Sum, Adasum, Min, Max, Product = F.Average, F.Sum, F.Adasum, F.Min, F.Max, F.Product


SUPPORTED = {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
}


def device_of(t: torch.Tensor) -> int:
    """The request's device: CPU, a device tensor, or (refused on every rank by the
    coordinator) a tensor on a GPU other than this rank's."""
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return F.device_code(index, torch.cuda.device_count())
    if t.device.type == "cpu" and F.device_standin():
        return DEVICE
    return CPU_DEVICE


def make_device_plane(config: Any, local_rank: int) -> Any:
    from horovod.device.plane import DevicePlane

    return DevicePlane(config, local_rank, config.hierarchical_allreduce)


def _device_array(t: torch.Tensor) -> Any:
    from horovod.device.arrays import DeviceArray
    from horovod.device.streams import ready_event

    F.use_device_plane(make_device_plane)
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"tensors on {t.device.type} are not supported; use CPU or CUDA tensors")
    if t.device.type == "cuda" and F.device_standin():
        raise ValueError(
            f"a tensor on {t.device} reached the device plane's CPU stand-in "
            "(HOROVOD_DEVICE_PLANE_TEST, for tests without a GPU): unset "
            "HOROVOD_DEVICE_PLANE_TEST to use the GPU, or keep the tensors on the CPU"
        )
    return DeviceArray(t, ready_event(t))


def check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED:
        raise ValueError(
            f"Tensor type {t.type()} is not supported ({what}); use one of "
            "uint8, int8, int16, int32, int64, float16, bfloat16, float32, "
            "float64, bool"
        )
    if t.is_sparse or not t.is_contiguous():
        raise ValueError(f"Tensor is required to be contiguous ({what}); call .contiguous()")
    return t


def to_numpy(t: torch.Tensor) -> Any:
    """A NumPy view of a CPU tensor's memory; a ``DeviceArray`` for a device tensor."""
    t = t.detach()
    if t.device.type != "cpu" or F.device_standin():
        return _device_array(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[arg-type]
    return t.numpy()


def from_numpy(a: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    if type(a) is not np.ndarray and hasattr(a, "tensor"):  # a device result
        from horovod.device.streams import consume

        consume(a.tensor, a.done)
        return a.tensor
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(a)
    if like is not None and like.device.type != "cpu":
        out = out.to(like.device)
    return out


def write_back(dst: torch.Tensor, src_view: Any) -> None:
    """After an op into ``dst``: a device result is used only once the caller's stream waits
    for the plane (a CPU view needs nothing: the engine wrote into ``dst`` itself)."""
    if type(src_view) is not np.ndarray and hasattr(src_view, "tensor"):
        from horovod.device.streams import consume

        consume(dst, src_view.done)


def inplace_view(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t)


def is_plain(t: Any, grad_ok: bool = False) -> bool:
    """May a synchronous call on ``t`` try the express way (``Engine.express``): a contiguous
    dense CPU tensor of a supported dtype, and (unless ``grad_ok``, for the in-place calls)
    no autograd graph to record? Anything else goes the usual way, with its checks."""
    return (
        type(t) is torch.Tensor
        and (grad_ok or not t.requires_grad)
        and t.device.type == "cpu"
        and t.dtype in SUPPORTED
        and not F.device_standin()
        and t.layout is torch.strided
        and t.is_contiguous()
    )


def poll(handle: int) -> bool:
    return F.poll(handle)


def sync_call(submit: Any, *args: Any, **kwargs: Any) -> Any:
    """``synchronize(submit(*args, **kwargs))``, telling the engine that this thread waits
    at once (it runs the engine itself instead of waking the engine thread)."""
    with F.waited():
        handle = submit(*args, **kwargs)
    return synchronize(handle)


def synchronize(handle: int) -> Any:
    try:
        return F.synchronize(handle)
    except HorovodInternalError:
        raise
    except RuntimeError as e:  # pragma: no cover - defensive
        raise HorovodInternalError(e) from None
