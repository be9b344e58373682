"""A user's own workload with every awkward part a real model has (used by
tests/test_user_model.py through `--workload tests.user_workloads:make_tricky`)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, seeded


class Tricky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, bias=False)
        self.norm = nn.BatchNorm1d(16)  # buffers: running mean/var, num_batches_tracked
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8, bias=False)
        self.tied = nn.Linear(16, 16, bias=False)
        self.tied_again = self.tied  # a shared module: one parameter, used twice
        self.unused = nn.Linear(16, 16)  # never gets a gradient
        self.steps = nn.Parameter(torch.zeros(1, dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.embed(x)))
        h = F.relu(self.hidden(self.tied_again(self.tied(h))))
        return self.head(h)


def make_tricky(seed: int) -> Workload:
    with seeded(seed):
        model = Tricky()
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    y = (x @ torch.randn(8, 8, generator=g)).argmax(dim=1)
    return Workload(
        model=model,
        train_dataset=TensorDataset(x[:448], y[:448]),
        val_dataset=TensorDataset(x[448:], y[448:]),
        loss_fn=F.cross_entropy,
        find_unused_parameters=True,
    )


def make_failing(seed: int) -> Workload:
    """A model whose backward fails at its third step, after later layers' gradients are
    already being pushed (tests/test_overlap.py: the worker must exit with the error)."""
    with seeded(seed):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    calls = {"n": 0}

    def fail_on_third(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("user backward failed on purpose")
        return grad

    model[0].weight.register_hook(fail_on_third)  # the first layer's gradient comes last
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 8, generator=g)).argmax(dim=1)
    return Workload(model=model, train_dataset=TensorDataset(x, y), loss_fn=F.cross_entropy)


def make_late_overflow(seed: int) -> Workload:
    """A model whose 4th backward gives its first layer (whose gradient comes last) an
    inf gradient, half a second after the other layers' gradients were ready: with small
    buckets every shard has those slots — and with --chunk-rounds has updated them — well
    before the overflow verdict arrives (tests/test_overlap.py: the update is undone)."""
    with seeded(seed):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                              nn.Linear(16, 8))  # fmt: skip
    calls = {"n": 0}

    def late_inf(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] != 4:
            return grad
        time.sleep(0.5)
        return grad * float("inf")

    model[0].weight.register_hook(late_inf)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 8, generator=g)).argmax(dim=1)
    return Workload(model=model, train_dataset=TensorDataset(x, y), loss_fn=F.cross_entropy)
