"""Data-parallel PyTorch training with horovod.torch: a small CNN on scikit-learn's digits.

    horovodrun -np 2 python examples/pytorch_digits.py
    horovodrun -np 2 python examples/pytorch_digits.py --resume     # continue from checkpoint

On a machine with GPUs each rank trains on GPU ``local_rank`` (``--no-cuda`` keeps the CPU):
gradients are then averaged on the device (NCCL, or staged through host memory where ranks
share a GPU; docs/gpu.md).

The script is written exactly as for upstream Horovod: each rank reads its shard of the data
(DistributedSampler), the learning rate is scaled by the number of ranks with a linear warmup,
gradients are averaged by hvd.DistributedOptimizer while backward runs, rank 0 alone writes the
checkpoint, and every rank resumes from it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 4x4 -> 2x2
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test])


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.02, help="single-process learning rate")
    ap.add_argument("--warmup-epochs", type=float, default=1.0)
    ap.add_argument("--checkpoint", default="checkpoints/pytorch_digits.pt")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ap.add_argument(
        "--min-accuracy",
        type=float,
        default=0.9,
        help="exit non-zero if the final test accuracy is lower",
    )
    ap.add_argument("--no-cuda", action="store_true", help="train on the CPU even with GPUs")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(1234)
    torch.set_num_threads(1)  # ranks share this host's cores
    device = torch.device("cpu")
    if torch.cuda.is_available() and not args.no_cuda:
        # one GPU per rank (ranks beyond the GPUs share them: the staged path)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())

    train_set, test_set = digits()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_sampler = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net().to(device)
    # Scale the learning rate by the number of ranks: the global batch is size x larger.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    start_epoch = 0
    if args.resume:
        if hvd.rank() == 0 and not os.path.exists(args.checkpoint):
            print(f"no checkpoint at {args.checkpoint}", flush=True)
        if os.path.exists(args.checkpoint):
            state = torch.load(args.checkpoint, map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"]
    # Every rank starts from rank 0's weights, optimizer state and epoch.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    steps_per_epoch = len(train_loader)
    for epoch in range(start_epoch, start_epoch + args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        total_loss = 0.0
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            progress = epoch + step / steps_per_epoch
            warm = min(1.0, (progress + 1.0 / steps_per_epoch) / args.warmup_epochs)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * hvd.size() * warm
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                correct += (model(x).argmax(1) == y).sum().item()
                seen += len(y)
        # Average the metrics over ranks: each rank saw only its shard.
        train_loss = metric_average(total_loss / steps_per_epoch, "train_loss")
        test_acc = metric_average(correct / max(seen, 1), "test_accuracy")
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}: train loss {train_loss:.4f}  test accuracy {test_acc:.3f}",
                flush=True,
            )
            os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                },
                args.checkpoint,
            )
    hvd.shutdown()
    if test_acc < args.min_accuracy:  # the same on every rank: each says why it fails
        print(
            f"test accuracy {test_acc:.3f} is below --min-accuracy {args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
