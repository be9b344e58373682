"""Seeding a process's random generators from the job's seed and its rank.

A workload's factory builds the initial weights under its own seeded generator
(worker/workloads/base.py: `seeded`), which leaves the process's global generators as
they were: different in every process. Whatever draws from them during training does
so too: dropout above all (every transformers model has it on by default), and random
augmentations. So once the workload is built, psar seeds them from (seed, rank), as a DDP
script calls `torch.manual_seed(seed + rank)` at its start: the same job gives the same
losses run after run, and a PS worker of rank r draws exactly what the DDP rank r draws.
"""

from __future__ import annotations

import random

import torch

_MIX = 1_000_003
"""Keeps (seed, rank) pairs apart: seed 1 rank 0 and seed 0 rank 1 draw differently."""


def process_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s generators in a job seeded `seed` (a 63-bit integer)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return (int(seed) * _MIX + int(rank)) % (1 << 63)


def seed_process(seed: int, rank: int) -> int:
    """Seed torch's generators (CPU and every CUDA device), Python's `random` and, where
    it is installed, NumPy's global generator from (seed, rank). Returns the seed used."""
    value = process_seed(seed, rank)
    torch.manual_seed(value)  # seeds the CUDA generators too, lazily (no CUDA init)
    random.seed(value)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of psar
        return value
    np.random.seed(value % (1 << 32))
    return value
