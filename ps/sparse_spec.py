"""A sparse embedding table's spec and its deterministic initial rows: what shards,
PS workers and DDP workers (the workload's local copy) all compute the same way."""

from __future__ import annotations

from dataclasses import dataclass

from psar.trainkit.choices import SPARSE_OPTIMIZERS
from psar.trainkit.sparse_tables import BLOCK_ROWS, init_rows, local_rows

OPTIMIZERS = SPARSE_OPTIMIZERS


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


__all__ = ["BLOCK_ROWS", "OPTIMIZERS", "TableSpec", "init_rows", "local_rows"]
