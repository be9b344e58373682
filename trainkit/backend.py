"""The protocol the training loop talks to; each architecture implements it.

The loop (worker/loop.py) never asks which architecture it runs on: `PSBackend`
(ps/client/backend.py) and `DDPBackend` (allreduce/backend.py) both provide these calls,
like ps-lite's push/pull/wait or torchtitan's parallelize_fn. Everything the loop reads
from a backend is declared here, and tests/test_backend_protocol.py holds both classes
(and the loop's source) to it: a member the loop needs but only one backend has would
otherwise surface as an AttributeError in the other architecture's runs only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only: this module stays free of config/precision imports
    from typing import Self

    from psar.trainkit.config import TrainConfig
    from psar.trainkit.optim import StepOptions
    from psar.trainkit.precision import PrecisionPolicy


@dataclass
class StepOutcome:
    """What one optimizer step turned into."""

    skipped: bool
    """The step was skipped everywhere (non-finite gradients)."""
    loss_scale: float
    """Loss scale to use for the next step."""
    staleness: int | None = None
    """PS: staleness of this worker's gradient as the shards applied it (max over shards)."""
    grad_norm: float | None = None
    """With clipping: the L2 norm of the update's gradient before it was clipped (the
    averaged gradient's for DDP and PS rounds; a PS push's own in modes without rounds);
    None without clipping, or on a skipped step."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent in communication phases this step (push, pull, wait, allreduce, optimizer)."""
    outer_round: bool = False
    """--mode local: this step ended an outer round (the workers synchronised)."""
    round_bytes: int = 0
    """--mode local, outer_round: bytes this worker moved for the round."""
    drift: float = 0.0
    """--mode local, outer_round: L2 norm of this worker's weights minus the shared weights
    of the last sync, at this sync (how far the inner steps took it)."""


@runtime_checkable
class Backend(Protocol):
    # ---- what the class says before any instance exists -----------------------------
    arch: ClassVar[str]
    """'ps' or 'allreduce': the report's "arch", the metrics' arch label, log file names."""
    reports_staleness: ClassVar[bool]
    """StepOutcome.staleness means something here (ps: a gradient may be applied to newer
    weights than it was computed on); the report then carries its percentiles."""
    per_rank_reports: ClassVar[bool]
    """Every rank writes its own --report (ps workers are separate processes with their
    own staleness and faults); False: rank 0 writes the job's (DDP ranks are lockstep)."""

    @classmethod
    def rank_flags(cls, cfg: TrainConfig) -> tuple[int, int]:
        """(rank, world_size) as this architecture's flags give them (-1 / 0: not given,
        the launcher's environment decides; trainkit/roles.py)."""
        ...

    @classmethod
    def from_config(
        cls,
        cfg: TrainConfig,
        precision: PrecisionPolicy,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        metrics: Any,
        find_unused_parameters: bool,
    ) -> Self:
        """The backend for one worker. Same signature on every backend, so the loop builds
        either without knowing which; each takes what it needs (DDP: find_unused_parameters,
        the workload's hint; PS: metrics, for its transport series)."""
        ...

    # ---- per instance ---------------------------------------------------------------
    mode: str
    """The consistency mode for ps (--mode); for allreduce ddp, or --mode local's."""
    rank: int
    world_size: int
    device: torch.device
    precision: PrecisionPolicy
    """The worker's resolved precision; the report's "wire_dtype" comes from it."""
    start_step: int
    """Steps an earlier process of this worker already did (0 for a fresh run); valid
    after setup(). The loop continues at start_step + 1 (docs/reliability.md)."""
    deals_data: bool
    """The job's data is dealt to this worker (an elastic PS job, docs/elastic.md): the
    loop trains on the batch ids next_batches() gives instead of cutting its own shard
    from its rank, and a SIGTERM makes it leave after the step in flight."""

    def plan_data(self, total_batches: int, stream: str) -> None:
        """deals_data, before setup(): the job's batch ids are 0..total_batches-1 and
        `stream` says how the workers map an id to samples."""
        ...

    def next_batches(self, *, stop: bool = False) -> list[int] | None:
        """deals_data, after setup() and after each step(): the batch ids of the next step;
        None when the data is done or `stop` (the worker then has left the job)."""
        ...

    def setup(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.nn.Module:
        """Take the freshly built model (same seed everywhere); return the module to train.
        Every rank starts from rank 0's weights. `optimizer`: a user's own torch.optim
        optimizer over the model's parameters (worker/own_loop.py), which the step then
        runs (its class, its param groups' hyper-parameters, its state; its learning rates
        come with each step's options); None: the one --optimizer configures."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for micro-batches that only accumulate (no communication)."""
        ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward() on (multiplied by the loss scale, if any)."""
        ...

    def step(self, options: StepOptions | None = None) -> StepOutcome:
        """Combine this step's gradients across workers and update the weights. `options`
        (a loop of the user's own): each param group's learning rate for this step and
        the global norm to clip the update to; None: --clip-grad-norm, the schedule."""
        ...

    def remote_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """With a user's own optimizer: its state where the shards hold it, by parameter
        name, as torch's optimizer of that class holds it; None where the worker's own
        optimizer object holds it (DDP steps it locally)."""
        ...

    def comm_bytes(self) -> dict[str, int]:
        """Cumulative bytes this worker put on the wire (`bytes_sent`) and took off it
        (`bytes_received`), counted the same way under both architectures (payload, no
        protocol headers); plus each architecture's own: bytes_pushed/bytes_pulled (ps),
        bytes_allreduced (the gradient payload given to allreduce)."""
        ...

    def shard_stats(self) -> list[dict[str, Any]]:
        """The report's "shards": each parameter-server shard's own figures ([] where
        there are no shards). Asked on rank 0 only."""
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
