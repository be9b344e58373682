"""Built-in ``mlp`` workload: an MLP classifier on generated data with a known answer.

Inputs are standard Gaussian vectors; each label is the argmax of a fixed random
linear "teacher" applied to the input. The teacher is in the student's function class,
so the task is fully learnable (zero-error solution exists) and the loss must fall:
a run whose loss does not drop has a bug, not a hard problem.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, opt_int, seeded

__all__ = ["build_model", "make", "make_dataset"]


def build_model(in_dim: int, hidden: int, depth: int, classes: int) -> nn.Sequential:
    """``in_dim -> hidden (x depth, ReLU) -> classes``; uses the global RNG for init."""
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def make_dataset(
    data_seed: int, in_dim: int, classes: int, samples: int, val_samples: int
) -> tuple[TensorDataset, TensorDataset]:
    """Generate (train, val) sets labelled by a random linear teacher.

    A local Generator (not the global RNG) makes the data depend only on its
    arguments. Train and val come from one draw, so they never share a sample.
    """
    gen = torch.Generator().manual_seed(data_seed)
    teacher = torch.randn(in_dim, classes, generator=gen)
    x = torch.randn(samples + val_samples, in_dim, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    train = TensorDataset(x[:samples].clone(), y[:samples].clone())
    val = TensorDataset(x[samples:].clone(), y[samples:].clone())
    return train, val


def make(
    seed: int,
    *,
    in_dim: Any = 32,
    hidden: Any = 64,
    depth: Any = 2,
    classes: Any = 10,
    samples: Any = 4096,
    val_samples: Any = 1024,
    data_seed: Any = 0,
) -> Workload:
    """Build the ``mlp`` workload. Options (``--workload-option key=value``):

    - ``in_dim`` (int, 32): input features.
    - ``hidden`` (int, 64): width of each hidden layer.
    - ``depth`` (int, 2): number of hidden layers (0 = a linear model).
    - ``classes`` (int, 10): output classes.
    - ``samples`` (int, 4096): training samples.
    - ``val_samples`` (int, 1024): validation samples (0 = no validation set).
    - ``data_seed`` (int, 0): seeds the teacher and inputs. It is separate from
      ``seed`` so that runs with different model seeds solve the same problem.

    The reference 784-1024-1024-10 MLP is ``in_dim=784 hidden=1024 depth=2``.
    """
    in_dim = opt_int("in_dim", in_dim, minimum=1)
    hidden = opt_int("hidden", hidden, minimum=1)
    depth = opt_int("depth", depth, minimum=0)
    classes = opt_int("classes", classes, minimum=2)
    samples = opt_int("samples", samples, minimum=1)
    val_samples = opt_int("val_samples", val_samples, minimum=0)
    data_seed = opt_int("data_seed", data_seed)

    with seeded(seed):
        model = build_model(in_dim, hidden, depth, classes)
    train, val = make_dataset(data_seed, in_dim, classes, samples, val_samples)
    dims = "-".join(str(d) for d in [in_dim] + [hidden] * depth + [classes])
    return Workload(
        model=model,
        train_dataset=train,
        val_dataset=val if val_samples > 0 else None,
        loss_fn=F.cross_entropy,
        val_metric="loss",
        description=f"mlp {dims} on {samples} teacher-labelled Gaussian samples",
    )
