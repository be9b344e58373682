"""A sparse embedding table's spec and its deterministic initial rows: what shards,
PS workers and DDP workers (the workload's local copy) all compute the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainkit.choices import SPARSE_OPTIMIZERS

OPTIMIZERS = SPARSE_OPTIMIZERS
BLOCK_ROWS = 65536
"""Rows per generator block of :func:`init_rows` (one seeded generator per block)."""


@dataclass(kw_only=True)
class TableSpec:
    """What a shard needs to hold its rows of one table."""

    name: str
    rows: int
    dim: int
    optimizer: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    init_std: float = 0.01
    init_seed: int = 0
    shard_index: int = 0
    num_shards: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"sparse optimizer {self.optimizer!r} unknown; accepted: {', '.join(OPTIMIZERS)}"
            )
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: rows and dim must be >= 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"table {self.name!r}: shard {self.shard_index} of {self.num_shards}")


def local_rows(rows: int, shard: int, num_shards: int) -> int:
    """How many of `rows` rows shard `shard` holds (rows r with r % num_shards == shard)."""
    return max(0, (rows - shard + num_shards - 1) // num_shards)


def init_rows(
    rows: int, dim: int, std: float, seed: int, *, shard: int = 0, num_shards: int = 1
) -> torch.Tensor:
    """Initial values N(0, std^2) of rows r % num_shards == shard, in increasing r.

    Block b (rows b*BLOCK_ROWS ...) is drawn from its own generator seeded
    (seed, b), so any shard (or a worker) computes the same values for the same row
    without drawing the whole table at once.
    """
    out = torch.empty(local_rows(rows, shard, num_shards), dim)
    at = 0
    for b0 in range(0, rows, BLOCK_ROWS):
        n = min(BLOCK_ROWS, rows - b0)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + b0 // BLOCK_ROWS) % (1 << 63))
        block = torch.randn(n, dim, generator=gen)
        mine = block[(shard - b0) % num_shards :: num_shards]
        out[at : at + len(mine)] = mine * std
        at += len(mine)
    return out
