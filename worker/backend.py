"""The small protocol the training loop talks to; each architecture implements it.

The loop (worker/loop.py) never asks which architecture it runs on: `PSBackend`
(ps/client/backend.py) and `DDPBackend` (allreduce/backend.py) both provide these calls,
like ps-lite's push/pull/wait or torchtitan's parallelize_fn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class StepOutcome:
    """What one optimizer step turned into."""

    skipped: bool
    """The step was skipped everywhere (non-finite gradients)."""
    loss_scale: float
    """Loss scale to use for the next step."""
    staleness: int | None = None
    """PS: staleness of this worker's gradient as the shards applied it (max over shards)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent in communication phases this step (push, pull, wait, allreduce, optimizer)."""


class Backend(Protocol):
    arch: str
    """'ps' or 'allreduce'."""
    mode: str
    """'sync' | 'async' | 'ssp' for ps; 'ddp' for allreduce."""
    rank: int
    world_size: int
    device: torch.device

    def setup(self, model: torch.nn.Module) -> torch.nn.Module:
        """Take the freshly built model (same seed everywhere); return the module to train.
        Every rank starts from rank 0's weights."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for micro-batches that only accumulate (no communication)."""
        ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on (multiplied by the loss scale, if any)."""
        ...

    def step(self) -> StepOutcome:
        """Combine this step's gradients across workers and update the weights."""
        ...

    def comm_bytes(self) -> dict[str, int]:
        """Cumulative bytes moved: bytes_pushed/bytes_pulled (ps) or bytes_allreduced."""
        ...

    def report_extras(self) -> dict[str, Any]:
        """What this architecture adds to the run's report (fault figures, overlap)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The trained weights (fp32 where the architecture keeps them) for --save."""
        ...

    def finish(self) -> None:
        """Leave the job cleanly (nobody waits for this worker any more)."""
        ...

    def abort(self) -> None:
        """The loop failed mid-step: release whatever waits on this step (threads,
        streams) so the process can exit with the error."""
        ...
