"""Data-parallel PyTorch training on a Ray cluster with horovod.ray: the digits CNN, each rank a
Ray actor.

    python examples/ray_torch_digits.py                      # a local Ray cluster, 2 workers
    python examples/ray_torch_digits.py --address auto       # the Ray cluster this node is in
    python examples/ray_torch_digits.py --num-hosts 2 --workers-per-host 4

The training function is upstream Horovod's usual one (hvd.init, DistributedSampler,
DistributedOptimizer, rank 0's weights broadcast); RayExecutor runs it on every actor and
returns what each rank returned. No horovodrun, no ssh: Ray places and starts the workers.
"""

from __future__ import annotations

import argparse
import os
import sys


def train(epochs: int, batch_size: int, lr: float) -> dict:
    """One rank's training (runs inside a Ray actor)."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    train_set, test_set = (
        TensorDataset(x[n_test:], y[n_test:]),
        TensorDataset(x[:n_test], y[:n_test]),
    )
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 2 * 2, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(epochs):
        model.train()
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        xt, yt = test_set.tensors
        shard = slice(hvd.rank(), None, hvd.size())
        correct = (model(xt[shard]).argmax(1) == yt[shard]).float().mean()
    accuracy = hvd.allreduce(correct, name="accuracy").item()
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    return {"rank": hvd.rank(), "size": hvd.size(), "accuracy": accuracy, "checksum": checksum}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--num-hosts", type=int, help="instead of --num-workers: hosts x workers")
    ap.add_argument("--workers-per-host", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.02, help="single-worker learning rate")
    ap.add_argument("--min-accuracy", type=float, default=0.9)
    args = ap.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local cluster: loopback
    import ray

    from horovod.ray import RayExecutor

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=max(2, args.num_workers), include_dashboard=False)
    settings = RayExecutor.create_settings(timeout_s=60)
    if args.num_hosts:
        executor = RayExecutor(
            settings, num_hosts=args.num_hosts, num_workers_per_host=args.workers_per_host
        )
    else:
        executor = RayExecutor(settings, num_workers=args.num_workers)
    executor.start()
    try:
        results = executor.run(train, args=[args.epochs, args.batch_size, args.lr])
    finally:
        executor.shutdown()
        ray.shutdown()
    for r in results:
        print(f"rank {r['rank']} of {r['size']}: test accuracy {r['accuracy']:.3f}")
    same = len({round(r["checksum"], 6) for r in results}) == 1
    print(f"replicas identical: {same}")
    ok = same and results[0]["accuracy"] >= args.min_accuracy
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
