"""What a shard takes from a client at most (issue #45): bounds on the counts a job
declares and on the values a push's step options carry, each a `psar server` flag
(ps/server/config.py) so a user whose job needs more can raise it.

Why bounds: a client's numbers size the shard's own structures (a job of 2^20 workers
took 7.7 s and ~223 bytes each to init) or go straight into the optimizer step (a
learning rate of 1e39 cannot be converted to the masters' fp32 and failed the step after
the push was taken; 1e30 moved the masters from 0.01 to 1e27). Every check here runs
before anything of the request changes the shard, and a refusal says which flag raises
the bound. Light on purpose: ps/server/config.py imports it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psar.ps.errors import InvalidArgument

if TYPE_CHECKING:
    from psar.ps.job import Job
    from psar.trainkit.optim import StepOptions

DEFAULT_MAX_STEP_LR = 1000.0
"""--max-step-lr: far above any learning rate a run trains with (SGD's largest are ~10,
LARS-style schedules ~100), far below what overflows an fp32 step."""
DEFAULT_MAX_JOB_WORKERS = 4096
"""--max-job-workers: a job's ranks (its workers, or an elastic job's --max-workers)."""
DEFAULT_MAX_JOB_SLOTS = 1 << 16
"""--max-job-slots: the slots a job gives one shard (a 104M-parameter model in 4 MiB
chunks is ~100 of them)."""
FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class ShardLimits:
    """The bounds one shard holds its clients to (see the module docstring)."""

    max_step_lr: float = DEFAULT_MAX_STEP_LR
    max_job_workers: int = DEFAULT_MAX_JOB_WORKERS
    max_job_slots: int = DEFAULT_MAX_JOB_SLOTS

    def __post_init__(self) -> None:
        if not 0 < self.max_step_lr <= FP32_MAX:
            raise ValueError(
                f"--max-step-lr must be > 0 and at most fp32's largest value {FP32_MAX:.4g} "
                f"(the masters' dtype), got {self.max_step_lr}"
            )
        if self.max_job_workers < 1 or self.max_job_slots < 1:
            raise ValueError("--max-job-workers and --max-job-slots must be >= 1")

    def check_job(self, job: Job) -> None:
        """Refuse a job whose declared counts exceed the bounds (before it sizes anything)."""
        if job.capacity > self.max_job_workers:
            raise InvalidArgument(
                f"the job declares {job.capacity} workers (num_workers {job.num_workers}, "
                f"max_workers {job.max_workers}); this shard serves at most "
                f"{self.max_job_workers}: start it with --max-job-workers N to serve more",
                reason="malformed",
            )
        if len(job.slots) > self.max_job_slots:
            raise InvalidArgument(
                f"the job gives this shard {len(job.slots)} slots; it holds at most "
                f"{self.max_job_slots}: use larger chunks, more shards, or start it with "
                "--max-job-slots N",
                reason="malformed",
            )

    def check_options(self, options: StepOptions, job: Job) -> None:
        """Refuse step options the job did not declare, or whose values the masters'
        fp32 step cannot take: each must be finite, >= 0, and representable in fp32; a
        learning rate also at most --max-step-lr."""
        if not job.step_options:
            raise InvalidArgument(
                "this push carries step options (learning rates, clipping) but the job did "
                "not declare them (JobSpec.step_options, set by rank 0 of a loop of its own "
                "or with --clip-grad-norm): start the job from such a worker, or send none",
                reason="malformed",
            )
        values = [("learning rate", v) for v in options.lrs]
        values += [("clip_norm", options.clip_norm), ("grad_norm", options.grad_norm)]
        for name, v in values:
            if not (math.isfinite(v) and 0 <= v <= FP32_MAX):
                raise InvalidArgument(
                    f"step options: {name} {v!r} must be a finite number >= 0 that fits the "
                    f"masters' fp32 (at most {FP32_MAX:.4g})",
                    reason="malformed",
                )
        big = [v for v in options.lrs if v > self.max_step_lr]
        if big:
            raise InvalidArgument(
                f"step options: learning rate {big[0]!r} is above this shard's cap "
                f"{self.max_step_lr!r}: a run that means it starts the shards with "
                "--max-step-lr",
                reason="malformed",
            )
