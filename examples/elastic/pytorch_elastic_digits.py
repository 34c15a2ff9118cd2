"""Elastic PyTorch training with horovod.torch: a small CNN on scikit-learn's digits that keeps
training when workers are lost and grows and shrinks with the hosts.

    horovodrun -np 2 --min-np 1 -H localhost:2 python examples/elastic/pytorch_elastic_digits.py
    horovodrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh \\
        python examples/elastic/pytorch_elastic_digits.py

Written as for upstream Horovod's elastic mode: the model, optimizer, sampler and the epoch
and batch counters live in ``hvd.elastic.TorchState``; the training function is wrapped in
``@hvd.elastic.run``; the state is committed every few batches (a failure rolls every rank
back to the last commit), and a reset callback rescales the learning rate to the new size.
See docs/elastic.md.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = torch.nn.Linear(16 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)  # 8x8 -> 4x4
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05, help="single-worker learning rate")
    ap.add_argument("--batches-per-commit", type=int, default=5)
    ap.add_argument("--min-accuracy", type=float, default=0.85)
    ap.add_argument("--save", default="", help="write the final parameters here (rank's own)")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    train_set, test_set = digits()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:  # the job's size changed: scale the learning rate with it
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            model.train()
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: {hvd.size()} workers", flush=True)
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)

    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if args.save:
        torch.save(model.state_dict(), f"{args.save}.rank{hvd.rank()}")
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.3f} with {hvd.size()} workers", flush=True)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
