"""``ElasticSampler``: shards a dataset over the ranks and can resume mid-epoch.

Call ``record_batch(batch_idx, batch_size)`` after each batch and ``set_epoch(epoch)`` at the
end of each epoch; ``state_dict()``/``load_state_dict()`` save and restore the position, after
which the remaining samples of the epoch are re-sharded over the current ranks.

Must not touch: the dataset (it only chooses indices).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from horovod import frontend


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (call it at the end of each epoch, with the next number)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-read the job's size and rank and re-shard what remains of the epoch."""
        self.num_replicas = frontend.size()
        self.rank = frontend.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        remaining = indices[self.processed_num :]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        padded = remaining + remaining[: total - len(remaining)]
        self.indices = padded[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
