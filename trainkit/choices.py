"""Names both the worker's config and the shards validate, checked in one place: the
consistency modes and the sparse-table optimizers. Here (not in ps/) so that a DDP
process, which validates the same config, loads nothing of the parameter server.

The shards decide by a mode's traits (ps/server/modes/, sent to the workers with the
job); what is here is only what a worker's configuration must know before it meets a
shard (tests/test_modes.py holds it to the shards' registry)."""

from __future__ import annotations

MODES: tuple[str, ...] = ("sync", "async", "ssp", "local")
"""PS consistency modes (--mode): the stock shard's (ps/server/modes/); local: local SGD /
DiLoCo (also under --arch allreduce)."""

DEFAULT_MODE = "sync"

LOCAL_SGD_MODES: tuple[str, ...] = ("local",)
"""Modes whose workers take --sync-every inner steps between pushes (local SGD / DiLoCo):
a worker decides its loop by them before it meets a shard, under --arch allreduce too."""

BUFFER_AVERAGING_MODES: tuple[str, ...] = ("sync",)
"""Modes whose rounds may average the model's buffers (--buffers average)."""

CHUNK_ROUND_MODES: tuple[str, ...] = BUFFER_AVERAGING_MODES
"""Modes whose rounds may be applied slot by slot, so workers may pull early (--early-pull;
the shards' registry says the same of its modes: Mode.chunk_rounds)."""

OUTER_OPTIMIZERS: tuple[str, ...] = ("sgd", "nesterov")
"""--mode local: the optimizer applied to the averaged pseudo-gradients (--outer-optimizer)."""

SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "lazy_adam")
"""Row-wise optimizers of sparse embedding tables (--sparse-optimizer)."""


def check_mode(mode: str) -> None:
    """Raise ValueError naming --mode and the accepted values for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"--mode: unknown {mode!r}; accepted: {', '.join(MODES)}")


def local_sgd(mode: str) -> bool:
    """Workers of `mode` take inner steps between pushes (--sync-every)."""
    return mode in LOCAL_SGD_MODES


def chunk_rounds(mode: str) -> bool:
    """`mode`'s rounds may be applied slot by slot (per-chunk rounds, early pulls)."""
    return mode in CHUNK_ROUND_MODES


def averages_buffers(mode: str) -> bool:
    """`mode` may average buffers over a round (--buffers average)."""
    return mode in BUFFER_AVERAGING_MODES
