"""The job a shard serves, as plain Python (ps/serde.py converts it to and from the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ps.partition import Slot
from trainkit.choices import check_mode
from trainkit.optim import LossScaleConfig, OptimizerConfig


@dataclass(kw_only=True)
class Job:
    """What the worker of rank 0 tells every shard at initialisation."""

    mode: str = "sync"
    """Consistency mode: sync | async | ssp."""
    staleness: int = 0
    """SSP bound S: no worker runs more than S clocks ahead of the slowest live worker."""
    num_workers: int = 1
    """Number of workers in the job (all live at start)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer applied to this shard's fp32 masters."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Shard-owned dynamic loss scale (sync mode with fp16 gradients)."""
    shard_index: int = 0
    """Index of the shard this job description is for."""
    num_shards: int = 1
    """Number of shards in the job."""
    slots: list[Slot] = field(default_factory=list)
    """The slots this shard holds, in push/pull order."""
    job_id: str = ""
    """Free-form job name; two inits with different ids conflict."""

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, got {self.staleness}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} not in [0, {self.num_shards})")
        keys = [s.key for s in self.slots]
        if len(set(keys)) != len(keys):
            raise ValueError("slot keys must be unique")
