"""``hvd.PriorityDistributedOptimizer(optimizer, model)``: gradients sent in the order the next
forward pass needs them, and each layer updated as soon as its gradient has arrived.

Backward produces the last layers' gradients first, and the next forward pass needs the first
layers' parameters first. With the usual optimizer, ``step()`` waits for every gradient, so the
next forward pass waits for the last one to cross the link. Here:

- gradients are queued by a hook as backward produces them; at most ``window_bytes`` are in
  flight (submitted to the engine), the others wait in a queue ordered by the layer's position
  in the forward pass (learned from the first forward pass; before it, the model's parameter
  order), so the first layers' gradients overtake the later layers' queued ones;
- ``step()`` does not wait: it leaves every update to the next forward pass, where a pre-hook on
  each module waits for that module's gradients only, applies the wrapped optimizer to those
  parameters, and lets the forward pass go on while later layers' gradients still travel.

``synchronize()`` applies every pending update now (call it before evaluating, saving or
leaving the training loop; ``state_dict()`` does). Averages over ``process_set``, each gradient
under its parameter's name. Elementwise optimizers (SGD, Adam, ...) give the same result as
stepping all parameters at once; one that couples parameters (LARS/LAMB-style norms over all
of them) would not. One backward pass per step (``backward_passes_per_step`` is not
supported here).

Must not touch: the bucketed optimizer (``horovod.torch.optimizer``).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from horovod.frontend.process_sets import ProcessSet
from horovod.torch.allreduce_ops import allreduce_async_
from horovod.torch.mpi_ops import synchronize

WINDOW_BYTES = 4 << 20


class _PriorityOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, model: torch.nn.Module, window: int, ps: ProcessSet) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[misc,call-arg]
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        self._hvd_names = {id(p): f"priority.{n}" for n, p in model.named_parameters()}
        everything = [p for g in self.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(everything) if id(p) not in self._hvd_names]
        if missing:
            raise ValueError(
                f"PriorityDistributedOptimizer: parameter(s) {missing} of the optimizer are not "
                "parameters of the model given"
            )
        self._hvd_window = window
        self._hvd_set = ps
        self._hvd_order = {id(p): i for i, p in enumerate(model.parameters())}
        self._hvd_seen_forward: list[int] = []  # parameter ids in the first forward's order
        self._hvd_queue: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._hvd_flight: dict[int, tuple[int, torch.Tensor, int]] = {}  # id -> handle, p, bytes
        self._hvd_inflight_bytes = 0
        self._hvd_done: dict[int, torch.Tensor] = {}  # id -> averaged gradient, not applied
        self._hvd_owed: set[int] = set()  # parameters whose update the next forward applies
        self._hvd_seq = 0
        self._hvd_hooks: list[Any] = []
        for p in model.parameters():
            if p.requires_grad and id(p) in mine:
                self._hvd_hooks.append(p.register_post_accumulate_grad_hook(self._hvd_ready))
        for module in model.modules():
            own: list[torch.Tensor] = [p for p in module.parameters(recurse=False) if id(p) in mine]
            if own:
                self._hvd_hooks.append(module.register_forward_pre_hook(self._hvd_pre_hook(own)))

    # ------------------------------------------------------------------ backward side
    def _hvd_ready(self, p: torch.Tensor) -> None:
        """A gradient is ready: queue it by the forward pass's order, send what fits."""
        assert p.grad is not None
        pid = id(p)
        if pid in self._hvd_owed or pid in self._hvd_flight:
            raise RuntimeError(
                "PriorityDistributedOptimizer: a second backward pass before the previous "
                "step's update was applied (one backward pass per step(); call synchronize() "
                "to apply pending updates)"
            )
        grad = p.grad.detach().clone()  # (the user's zero_grad may zero p.grad meanwhile)
        self._hvd_seq += 1
        heapq.heappush(self._hvd_queue, (self._hvd_order[pid], self._hvd_seq, p, grad))
        self._hvd_owed.add(pid)
        self._hvd_pump()

    def _hvd_pump(self) -> None:
        while self._hvd_queue and (
            self._hvd_inflight_bytes < self._hvd_window or not self._hvd_flight
        ):
            _, _, p, grad = heapq.heappop(self._hvd_queue)
            nbytes = grad.numel() * grad.element_size()
            handle = allreduce_async_(grad, name=self._hvd_names[id(p)], process_set=self._hvd_set)
            self._hvd_flight[id(p)] = (handle, grad, nbytes)
            self._hvd_inflight_bytes += nbytes

    def _hvd_complete(self, pid: int) -> None:
        handle, grad, nbytes = self._hvd_flight.pop(pid)
        self._hvd_done[pid] = synchronize(handle)
        self._hvd_inflight_bytes -= nbytes
        self._hvd_pump()

    # ------------------------------------------------------------------ forward side
    def _hvd_pre_hook(self, own: list[torch.Tensor]) -> Any:
        def hook(module: torch.nn.Module, inputs: Any) -> None:
            if len(self._hvd_seen_forward) < len(self._hvd_order):
                seen = set(self._hvd_seen_forward)
                self._hvd_seen_forward += [id(p) for p in own if id(p) not in seen]
                if len(self._hvd_seen_forward) == len(self._hvd_order):
                    self._hvd_order = {pid: i for i, pid in enumerate(self._hvd_seen_forward)}
            self._hvd_apply([p for p in own if id(p) in self._hvd_owed])

        return hook

    def _hvd_apply(self, params: list[torch.Tensor]) -> None:
        """Wait for ``params``' averaged gradients and step the wrapped optimizer on them."""
        if not params:
            return
        for p in params:
            pid = id(p)
            while pid not in self._hvd_done:
                if pid in self._hvd_flight:
                    self._hvd_complete(pid)
                elif self._hvd_flight:  # the window is full of others: finish the oldest
                    self._hvd_complete(next(iter(self._hvd_flight)))
                else:
                    self._hvd_pump()
        wanted = {id(p) for p in params}
        saved = self.param_groups
        try:
            self.param_groups = [
                {**g, "params": [p for p in g["params"] if id(p) in wanted]} for g in saved
            ]
            with torch.no_grad():
                for p in params:
                    p.grad = self._hvd_done.pop(id(p)).to(p.dtype)
            super(self.__class__, self).step()  # type: ignore[misc]
        finally:
            self.param_groups = saved
            for p in params:
                p.grad = None  # the next backward starts from zero
                self._hvd_owed.discard(id(p))

    # ------------------------------------------------------------------ the optimizer API
    def step(self, closure: Any = None) -> Any:
        """Send what is still queued; the updates happen in the next forward pass."""
        loss = closure() if closure is not None else None
        self._hvd_pump()
        return loss

    def synchronize(self) -> None:
        """Apply every pending update now, in the forward pass's order."""
        owed = sorted(self._hvd_owed, key=lambda pid: self._hvd_order.get(pid, 0))
        params = {id(p): p for g in self.param_groups for p in g["params"]}
        self._hvd_apply([params[pid] for pid in owed])

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super(self.__class__, self).state_dict()  # type: ignore[misc]


def priority_optimizer(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    window_bytes: int = WINDOW_BYTES,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """``optimizer`` wrapped as the module docstring says (an object of a subclass of its own
    class, as ``DistributedOptimizer``)."""
    from horovod.common.process_sets import global_process_set

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"PriorityDistributedOptimizer: model must be the torch.nn.Module being trained, "
            f"got {type(model).__name__}"
        )
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 1:
        raise ValueError(
            f"PriorityDistributedOptimizer: window_bytes must be an int >= 1, got {window_bytes!r}"
        )
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_PriorityOptimizer.__dict__),
    )
    return cls(optimizer.param_groups, model, window_bytes, process_set or global_process_set)
