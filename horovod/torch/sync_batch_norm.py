"""``hvd.SyncBatchNorm``: batch normalisation with statistics over the global batch, on CPU
and CUDA tensors (upstream's works on GPUs only).

The per-rank sums, sums of squares and counts are combined with one differentiable allreduce.
Because the allreduce's backward pass is itself an allreduce, autograd produces exactly the
gradient of normalising the concatenated batch; no hand-written backward is needed.

Must not touch: the engine (it uses the collectives of ``mpi_ops``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from horovod import frontend
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.mpi_ops import Sum, allreduce


class SyncBatchNorm(_BatchNorm):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _set_size(self) -> int:
        ps = self.process_set
        n = ps.size() if ps is not global_process_set else frontend.size()
        return n or 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.momentum is None:
            factor = 0.0
        else:
            factor = self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training or self._set_size() == 1:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(
                input,
                self.running_mean if not use_batch or self.track_running_stats else None,
                self.running_var if not use_batch or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch,
                factor,
                self.eps,
            )
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.double()
        count = torch.tensor([input.numel() / c], dtype=torch.float64, device=input.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = allreduce(stats, op=Sum, process_set=self.process_set)
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean * mean
        if self.track_running_stats:
            assert self.running_mean is not None and self.running_var is not None
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean))
                self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var))
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + self.eps)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out
