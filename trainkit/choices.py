"""Names both the worker's config and the shards validate, checked in one place: the
consistency modes and the sparse-table optimizers. Here (not in ps/) so that a DDP
process, which validates the same config, loads nothing of the parameter server."""

from __future__ import annotations

MODES: tuple[str, ...] = ("sync", "async", "ssp", "local")
"""PS consistency modes (--mode); local: local SGD / DiLoCo (also under --arch allreduce)."""

OUTER_OPTIMIZERS: tuple[str, ...] = ("sgd", "nesterov")
"""--mode local: the optimizer applied to the averaged pseudo-gradients (--outer-optimizer)."""

SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "lazy_adam")
"""Row-wise optimizers of sparse embedding tables (--sparse-optimizer)."""


def check_mode(mode: str) -> None:
    """Raise ValueError naming --mode and the accepted values for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"--mode: unknown {mode!r}; accepted: {', '.join(MODES)}")
