"""Broadcasting model and optimizer state (upstream's ``horovod.torch.functions``).

Must not touch: the engine (it uses the collectives of ``mpi_ops``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from horovod import frontend as F
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.mpi_ops import broadcast_async_, synchronize


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    ``params``: a dict such as ``model.state_dict()`` (broadcast in sorted key order, buffers
    included) or ``model.named_parameters()``, or a list of tensors / ``(name, tensor)`` pairs.
    """
    if isinstance(params, dict):
        items: Iterable = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = list(params)
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            name, p = item
        elif isinstance(item, torch.Tensor):
            name, p = f"param.{i}", item
        else:
            raise ValueError(
                f"invalid params of type: {type(params)} (entry {i} is {type(item).__name__})"
            )
        handles.append(
            broadcast_async_(
                p.data if isinstance(p, torch.nn.Parameter) else p,
                root_rank,
                name=f"broadcast_parameters.{name}",
            )
        )
    for h in handles:
        synchronize(h)


def _base_step(optimizer: torch.optim.Optimizer) -> Any:
    if hasattr(optimizer, "_requires_update"):  # a DistributedOptimizer: skip its allreduce
        return super(optimizer.__class__, optimizer).step  # type: ignore[misc]
    return optimizer.step


def _build_state(optimizer: torch.optim.Optimizer) -> None:
    """Give this rank the state structure the root has, by one step on zero gradients. Unlike
    upstream, parameters are restored afterwards (weight decay would otherwise move them) and
    every value is then overwritten by the root's."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for p in params:
        p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)
    _base_step(optimizer)()
    with torch.no_grad():
        for p, s, g in zip(params, saved, grads, strict=True):
            p.copy_(s)
            p.grad = g


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Make every rank's optimizer state (tensor state, scalar state and param-group options
    such as ``lr``) equal to ``root_rank``'s. Works for every ``torch.optim`` optimizer except
    LBFGS. If the root has no state yet, every rank's state is left empty (so training matches
    a single process exactly); otherwise ranks without state first build its structure."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    root_has_state = F.broadcast_object(
        bool(state_dict["state"]), root_rank, name="optimizer_state.has_state"
    )
    if not root_has_state:
        optimizer.state.clear()  # nothing to copy: every rank starts from no state, exactly
    elif not state_dict["state"]:
        _build_state(optimizer)
        state_dict = optimizer.state_dict()

    scalars: dict[str, Any] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for gi, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{gi}"] = value
        for pid in group["params"]:
            for key, value in sorted(state_dict["state"].get(pid, {}).items()):
                if torch.is_tensor(value):
                    tensors.append((f"{key}.{pid}", value))
                else:
                    scalars[f"{key}.{pid}"] = value
    handles = [broadcast_async_(t, root_rank, name=f"optimizer_state.{n}") for n, t in tensors]
    scalars = F.broadcast_object(scalars, root_rank, name="optimizer_state.scalars")
    for h in handles:
        synchronize(h)

    params = [p for group in optimizer.param_groups for p in group["params"]]
    pid = 0
    for gi, group in enumerate(optimizer.param_groups):
        for key in list(group):
            if key != "params" and f"{key}.{gi}" in scalars:
                group[key] = scalars[f"{key}.{gi}"]
        for _ in group["params"]:
            p = params[pid]
            for key, value in list(optimizer.state.get(p, {}).items()):
                if not torch.is_tensor(value) and f"{key}.{pid}" in scalars:
                    optimizer.state[p][key] = scalars[f"{key}.{pid}"]
            pid += 1


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    return F.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    return F.allgather_object(obj, name, process_set)
