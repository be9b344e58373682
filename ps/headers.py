"""The headers of a push and a pull, and a push's outcome: what both sides of the wire
speak (ps/serde.py maps them to and from the proto messages). A push's StepOptions are
psar.trainkit.optim's (the DDP backend reads them too)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from psar.trainkit.optim import StepOptions

__all__ = ["PullHeader", "PushHeader", "PushOutcome", "StepOptions"]


@dataclass(slots=True)
class PushHeader:
    worker: int
    clock: int
    base_version: int
    dtype: torch.dtype
    loss_scale: float = 1.0
    overflow: bool = False
    retry: bool = False
    verdict_follows: bool = False
    """The data streams during backward; a verdict (finite or overflow) follows it."""
    absent: tuple[str, ...] = ()
    """Slots with no gradient this step (unused parameters; their data is zeros). A
    streamed push sends them in its verdict instead: they are known after backward."""
    int_buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """To shard 0: the worker's integer buffers (Job.int_buffers), every one or none."""
    options: StepOptions = StepOptions()
    """A whole push's step options (a streamed push sends them in its verdict)."""


@dataclass(slots=True)
class PullHeader:
    version: int
    rounds: int
    loss_scale: float
    last_round_skipped: bool
    skipped_rounds: int
    dtype: torch.dtype
    clock_gap: int
    int_buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """From shard 0: rank 0's integer buffers of the newest clock not past the pull's."""
    batches: tuple[int, ...] = ()
    """From shard 0 of a job with elastic data: the batch ids of the puller's next step."""
    data_done: bool = False
    """From shard 0 of a job with elastic data: every batch id has been dealt; leave."""
    live_workers: int = 0
    """The shard's live workers when it answered (the job's world size now)."""


@dataclass(slots=True)
class PushOutcome:
    applied: bool
    dropped_nonfinite: bool
    staleness: int
