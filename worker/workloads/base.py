"""The Workload contract: what a training job needs from a model and its data.

A *factory* is any callable ``factory(seed: int, **options) -> Workload``. Every
process of a job (each worker, each allreduce rank) calls the same factory with the
same seed and options, so the factory must be deterministic: same seed and options
give bit-identical initial weights and identical datasets in any process. Nothing is
ever shipped between processes except the seed and the option strings.

This module also holds small helpers factories use to build models reproducibly
(:func:`seeded`) and to convert ``--workload-option key=value`` strings
(:func:`opt_int`, :func:`opt_float`, :func:`opt_bool`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "Workload",
    "WorkloadFactory",
    "opt_bool",
    "opt_float",
    "opt_int",
    "seeded",
]


@dataclass(kw_only=True)
class Workload:
    """A model, its data, and how to score it; built by a workload factory."""

    model: torch.nn.Module
    """The model to train, already initialised from the factory's seed. Workers copy
    its initial weights as-is, so every process must build the same values."""

    train_dataset: torch.utils.data.Dataset
    """Map-style training set: ``len(ds)`` and ``ds[i] -> (input, target)`` tensors.
    A ``TensorDataset`` is fastest: batches are gathered by indexing its tensors."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(model(inputs), targets)`` -> scalar mean loss over the batch. A mean
    (not a sum) keeps the gradient scale independent of batch size and world size."""

    val_dataset: torch.utils.data.Dataset | None = None
    """Optional held-out set with the same item format; ``None`` skips validation."""

    val_metric: str = "loss"
    """Name of the reported validation metric, e.g. ``"bits_per_byte"``."""

    val_transform: Callable[[float], float] | None = None
    """Maps the mean validation loss (nats) to ``val_metric``; ``None`` = identity.
    Use a module-level function rather than a lambda so the Workload can be pickled."""

    val_metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float | None]] | None = None
    """Optional extra held-out metrics: called once, after validation, with the model's
    outputs and the targets of every evaluated validation sample (concatenated, on CPU,
    outputs float32) -> ``{name: value}``, e.g. recsys' ``val_logloss`` and ``val_auc``.
    Names start with ``val_``; each becomes a key of the report (and a column of
    ``psar report`` / ``psar compare``). For a metric that is no per-batch mean, like
    AUC. Use a module-level function, as for ``val_transform``."""

    find_unused_parameters: bool = False
    """Tell DDP that some parameters may get no gradient in a step (e.g. a branch
    that is skipped); DDP otherwise waits forever for their gradients."""

    description: str = ""
    """One line for logs and reports, e.g. ``"mlp 32-64-64-10, 4096 samples"``."""

    def __post_init__(self) -> None:
        # Fail at construction, with the field name, rather than deep in a training loop.
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"Workload.model must be a torch.nn.Module, got {type(self.model)!r}")
        if not callable(self.loss_fn):
            raise TypeError("Workload.loss_fn must be callable: (model_output, target) -> loss")
        if self.val_transform is not None and not callable(self.val_transform):
            raise TypeError("Workload.val_transform must be callable or None")
        if self.val_metrics is not None and not callable(self.val_metrics):
            raise TypeError("Workload.val_metrics must be callable or None")

    def val_value(self, mean_loss: float) -> float:
        """Convert a mean validation loss into the reported ``val_metric`` value."""
        return self.val_transform(mean_loss) if self.val_transform else mean_loss

    def extra_val_metrics(
        self, outputs: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, float | None]:
        """``val_metrics(outputs, targets)`` checked: {} without the hook; a name that does
        not start with ``val_``, or would replace the report's own ``val_loss`` /
        ``val_loss_unit``, is refused here rather than overwriting a report key."""
        if self.val_metrics is None:
            return {}
        got = dict(self.val_metrics(outputs, targets))
        for name in got:
            if not name.startswith("val_") or name in RESERVED_VAL_KEYS:
                raise ValueError(
                    f"Workload.val_metrics: name {name!r} must start with 'val_' and not be "
                    f"one of {', '.join(RESERVED_VAL_KEYS)}"
                )
        return got


#: Report keys the training loop writes itself: a workload's val_metrics may not use them.
RESERVED_VAL_KEYS = ("val_loss", "val_loss_unit", "val_extra_metrics")


class WorkloadFactory(Protocol):
    """``factory(seed, **options) -> Workload``; option values arrive as strings."""

    def __call__(self, seed: int, **options: Any) -> Workload: ...


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the global torch RNG seeded to ``seed``, then restore it.

    ``nn.Module`` constructors draw their initial weights from the global RNG, so we
    seed it, but inside ``fork_rng`` so the caller's RNG stream is left untouched.
    ``devices=[]``: models are built on CPU, and forking CUDA RNGs would initialise CUDA.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def opt_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Parse option ``name`` as an int (accepts ints and strings like ``"64"``, ``"2_000"``)."""
    try:
        result = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r}: expected an integer") from None
    if isinstance(value, float) and value != result:
        raise ValueError(f"option {name}={value!r}: expected an integer")
    if minimum is not None and result < minimum:
        raise ValueError(f"option {name}={result}: must be >= {minimum}")
    return result


def opt_float(
    name: str, value: Any, *, low: float | None = None, high: float | None = None
) -> float:
    """Parse option ``name`` as a float, optionally checking ``low <= value <= high``."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r}: expected a number") from None
    if (low is not None and result < low) or (high is not None and result > high):
        raise ValueError(f"option {name}={result}: must be in [{low}, {high}]")
    return result


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def opt_bool(name: str, value: Any) -> bool:
    """Parse option ``name`` as a bool: true/false, yes/no, on/off, 1/0 (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"option {name}={value!r}: expected true/false")
