"""The model zoo of tests/test_model_zoo.py: one small model per way a user's model can
read its parameters that a parameter server must get right (issue #17). Each factory is
run as `--workload tests.zoo_workloads:make --workload-option model=NAME`.

Every model is deterministic from its seed and counts its own training forwards where a
step-dependent path needs a clock, so PS workers and DDP ranks take the same paths.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, seeded

D_IN, D_H, CLASSES, VOCAB = 8, 16, 8, 32


class Tied(nn.Module):
    """Input embedding and output head share one weight (a language model's tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_H)
        self.hidden = nn.Linear(D_H, D_H)
        self.head = nn.Linear(D_H, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(dim=1)
        return self.head(torch.tanh(self.hidden(h)))


class Functional(nn.Module):
    """Reads its head's weight functionally: the head's own forward never runs, and it is
    registered (so pulled) last."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.hidden = nn.Linear(D_H, D_H)
        self.head = nn.Linear(D_H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(torch.relu(self.embed(x))))
        return F.linear(h, self.head.weight, self.head.bias)


class Sometimes(nn.Module):
    """`every_other` takes part on every other training step (on every rank); `rare`
    only where a rank's batch says so (some steps one rank uses it, some both, some
    none); `never` never does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.every_other = nn.Linear(D_H, D_H)
        self.rare = nn.Linear(D_H, D_H)
        self.never = nn.Linear(D_H, D_H)
        self.head = nn.Linear(D_H, CLASSES)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if self.training:
            self.calls += 1
            if self.calls % 2 == 0:
                h = h + self.every_other(h)
            if float(x[0, 0]) > 0.3:
                h = h + self.rare(h)
        return self.head(h)


class Frozen(nn.Module):
    """A frozen layer between trained ones (requires_grad=False: never on the wire)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.frozen = nn.Linear(D_H, D_H)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D_H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.frozen(torch.relu(self.embed(x)))))


class Norm(nn.Module):
    """BatchNorm: running statistics are buffers, updated by every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.norm = nn.BatchNorm1d(D_H)
        self.head = nn.Linear(D_H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(x))))


class Twice(nn.Module):
    """One module called twice per forward (its gradient accumulates from both)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.block = nn.Linear(D_H, D_H)
        self.head = nn.Linear(D_H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.head(h)


class DictOut(nn.Module):
    """Returns a dict holding a tuple: logits and an auxiliary output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.head = nn.Linear(D_H, CLASSES)
        self.aux = nn.Linear(D_H, 1)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.embed(x))
        return {"out": (self.head(h), self.aux(h))}


def _dict_loss(out: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
    logits, aux = out["out"]
    return F.cross_entropy(logits, y) + 0.1 * aux.pow(2).mean()


class Dropout(nn.Module):
    """Dropout on in training (as every transformers model has by default): its masks come
    from the process's global generator, which psar seeds from --seed and the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D_H)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(D_H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.embed(x))))


MODELS = {
    "tied": Tied,
    "functional": Functional,
    "sometimes": Sometimes,
    "frozen": Frozen,
    "batchnorm": Norm,
    "twice": Twice,
    "dict": DictOut,
    "dropout": Dropout,
}


def make(seed: int, model: str = "functional") -> Workload:
    """The zoo model `model` with a small classification set (448 train, 64 val)."""
    if model not in MODELS:
        raise ValueError(f"zoo model {model!r}: choose one of {', '.join(MODELS)}")
    with seeded(seed):
        net = MODELS[model]()
    g = torch.Generator().manual_seed(1234)
    if model == "tied":
        x = torch.randint(0, VOCAB, (512, 4), generator=g)
        y = (x.sum(dim=1) * 7) % VOCAB
    else:
        x = torch.randn(512, D_IN, generator=g)
        y = (x @ torch.randn(D_IN, CLASSES, generator=g)).argmax(dim=1)
    return Workload(
        model=net,
        train_dataset=TensorDataset(x[:448], y[:448]),
        val_dataset=TensorDataset(x[448:], y[448:]),
        loss_fn=_dict_loss if model == "dict" else F.cross_entropy,
        find_unused_parameters=model == "sometimes",
    )
