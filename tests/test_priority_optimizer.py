"""PriorityDistributedOptimizer (issue 35's priority scheduling): the same training as the
bucketed optimizer, gradients sent in the next forward pass's order when the window is full,
each layer updated by its module's forward pre-hook, and its mistakes named."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import horovod.torch as hvd  # noqa: E402
from horovod.testing import run_ranks  # noqa: E402
from horovod.torch import priority_optimizer as prio  # noqa: E402


def make_model():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    )
    g = np.random.default_rng(0)  # the same start on every rank (threads share torch's RNG)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.tensor(g.standard_normal(tuple(p.shape)) * 0.3, dtype=p.dtype))
    return model


def data(rank):
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(5)
    ]


def train(rank, kind, window=1):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "plain":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        opt = hvd.PriorityDistributedOptimizer(opt, model, window_bytes=window)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    for x, y in data(rank):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if kind == "priority":
        opt.synchronize()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def test_the_same_training_as_the_bucketed_optimizer():
    def body(rank):
        return train(rank, "plain"), train(rank, "priority"), train(rank, "priority", 1 << 20)

    out = run_ranks(body, 3)
    for plain, small_window, large_window in out:
        np.testing.assert_allclose(small_window, plain, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(large_window, plain, rtol=1e-6, atol=1e-7)
        assert small_window.tobytes() == out[0][1].tobytes()  # the replicas agree bitwise


def test_queued_gradients_go_in_the_forward_pass_order(monkeypatch):
    sent: list[list[str]] = []
    real = prio.allreduce_async_

    def recording(tensor, name=None, **kw):
        sent[-1].append(name)
        return real(tensor, name=name, **kw)

    monkeypatch.setattr(prio, "allreduce_async_", recording)

    def body(rank):
        model = make_model()
        opt = hvd.PriorityDistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, 1
        )
        for x, y in data(rank)[:3]:
            if rank == 0:
                sent.append([])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            model(x)  # the next forward pass applies the updates (and sends the rest)
        opt.synchronize()
        return True

    assert run_ranks(body, 1) == [True]
    forward = [f"priority.{n}" for n, _ in make_model().named_parameters()]
    for names in sent:
        # the first gradient backward produced (the last layer's) goes at once; the queued
        # ones follow in the forward pass's order, not backward's
        assert names[0].startswith("priority.4.")
        rest = names[1:]
        assert rest == sorted(rest, key=forward.index), names


def test_mistakes_are_named():
    def body(rank):
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="model must be the torch.nn.Module"):
            hvd.PriorityDistributedOptimizer(sgd, "model")
        with pytest.raises(ValueError, match="window_bytes must be an int >= 1"):
            hvd.PriorityDistributedOptimizer(sgd, model, window_bytes=0)
        other = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="not parameters of the model given"):
            hvd.PriorityDistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
        opt = hvd.PriorityDistributedOptimizer(sgd, model)
        x, y = data(rank)[0]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        # a backward pass through a layer whose update no forward pre-hook applied yet
        first = model[0]
        with pytest.raises(RuntimeError, match="a second backward pass before"):
            torch.nn.functional.linear(x, first.weight, first.bias).sum().backward()
        state = opt.state_dict()  # applies what is pending
        assert not opt._hvd_owed and "state" in state
        return True

    assert run_ranks(body, 2) == [True, True]
