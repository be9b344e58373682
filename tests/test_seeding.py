"""trainkit/seeding.py: what --seed and the rank do to a process's generators."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from psar.trainkit.seeding import process_seed, seed_process


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_same_seed_and_rank_draw_the_same() -> None:
    seed_process(7, 1)
    first = _draws()
    torch.rand(5)  # whatever ran in between
    seed_process(7, 1)
    assert _draws() == first


def test_ranks_and_seeds_draw_apart() -> None:
    seen = set()
    for seed, rank in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        seed_process(seed, rank)
        seen.add(tuple(torch.rand(2).tolist()))
    assert len(seen) == 4  # seed 1 rank 0 differs from seed 0 rank 1
    assert process_seed(1, 0) != process_seed(0, 1)


def test_dropout_masks_follow_the_seed() -> None:
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    seed_process(3, 0)
    a = drop(x)
    seed_process(3, 0)
    assert torch.equal(drop(x), a)
    seed_process(3, 1)
    assert not torch.equal(drop(x), a)


def test_a_negative_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="rank"):
        process_seed(0, -1)
