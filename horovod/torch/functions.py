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


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Make every rank's optimizer state (tensor state, scalar state and param-group options
    such as ``lr``) equal to ``root_rank``'s. Works for every ``torch.optim`` optimizer except
    LBFGS, wrapped in a DistributedOptimizer or not.

    The root's state decides the layout: which parameters have state, under which keys, with
    which shapes and dtypes. Every other rank makes its own match (creating what it lacks,
    dropping what the root does not have) and then receives the values. Parameters whose
    ``.grad`` was None when the root stepped have no state there and so none anywhere, and a
    root with no state at all (a fresh optimizer) leaves every rank with none, as a single
    process would have. Upstream instead builds missing state with a step on zero gradients,
    which needs every rank to lack the same state; no parameter is changed here. ``model``:
    accepted for upstream's signature, unused."""
    del model
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state
    layout = None
    if F.rank() == root_rank:  # tensors by (shape, dtype, on the parameter's device)
        layout = (
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            {
                i: {
                    key: ("tensor", tuple(v.shape), v.dtype, v.device == p.device)
                    if torch.is_tensor(v)
                    else ("value", v)
                    for key, v in state[p].items()
                }
                for i, p in enumerate(params)
                if state.get(p)
            },
        )
    options, wanted = F.broadcast_object(layout, root_rank, name="optimizer_state.layout")
    if len(options) != len(optimizer.param_groups):
        raise ValueError(
            f"broadcast_optimizer_state: rank {root_rank}'s optimizer has {len(options)} "
            f"param groups, this rank's {len(optimizer.param_groups)}: every rank must build "
            "the same optimizer over the same model"
        )
    for group, opts in zip(optimizer.param_groups, options, strict=True):
        group.update(opts)
    handles = []
    for i, p in enumerate(params):
        spec = wanted.get(i)
        if spec is None:
            state.pop(p, None)
            continue
        mine = state[p]
        for key in [k for k in mine if k not in spec]:
            del mine[key]
        for key, (kind, *rest) in sorted(spec.items()):
            if kind == "value":
                mine[key] = rest[0]
                continue
            shape, dtype, on_param = rest
            device = p.device if on_param else torch.device("cpu")
            t = mine.get(key)
            if not (torch.is_tensor(t) and t.shape == shape and t.dtype == dtype):
                t = mine[key] = torch.empty(shape, dtype=dtype, device=device)
            handles.append(broadcast_async_(t, root_rank, name=f"optimizer_state.{i}.{key}"))
    for h in handles:
        synchronize(h)


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
