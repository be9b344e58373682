"""The protocol the training loop talks to; each architecture implements it.

The loop (worker/loop.py) never asks which architecture it runs on: `PSBackend`
(ps/client/backend.py) and `DDPBackend` (allreduce/backend.py) both provide these calls,
like ps-lite's push/pull/wait or torchtitan's parallelize_fn. Everything the loop reads
from a backend is declared here, and tests/test_backend_protocol.py holds both classes
(and the loop's source) to it: a member the loop needs but only one backend has would
otherwise surface as an AttributeError in the other architecture's runs only.

The protocol is kept small on purpose (12 members): what an architecture says of itself
before any instance exists (its name, mode, what its report carries, the rank flags) is
one `ArchInfo` from `describe(cfg)`; what a worker is (rank, world size, precision, the
step it starts after) travels in one `BackendContext`; the figures only the report reads
come from one `report()`; the data an elastic PS job deals is one part, `dealer`, None
elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only: this module stays free of config/precision imports
    from typing import Self

    from psar.trainkit.config import TrainConfig
    from psar.trainkit.optim import StepOptions
    from psar.trainkit.precision import PrecisionPolicy
    from psar.trainkit.recorder import WorkerRecorder


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
    cache_lookups: int = 0
    """--hot-row-cache: sparse rows this step looked up in the worker's hot-row caches."""
    cache_hits: int = 0
    """--hot-row-cache: of those, rows served from the cache (not pulled)."""
    cache_bytes_saved: int = 0
    """--hot-row-cache: bytes those rows would have cost to pull."""


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend is built from, the same for both architectures: the loop
    (worker/loop.py) and a loop of its own (worker/own_loop.py) make one and hand it to
    `from_config`; each backend takes what it needs. A PS worker joining a running job
    learns its rank and the job's size in setup(): its backend's `ctx` is then replaced
    by one saying so (read rank and world_size from `backend.ctx` after setup())."""

    cfg: TrainConfig
    precision: PrecisionPolicy
    """The worker's resolved precision (its device too); the report's "wire_dtype"."""
    rank: int
    """-1: a worker joining an elastic job without --rank (shard 0 gives it one)."""
    world_size: int
    total_steps: int
    """The run's length (schedules, the overlap trial)."""
    metrics: WorkerRecorder | None = None
    """The worker's recorder (PS: its transport series); None: nothing recorded."""
    find_unused_parameters: bool = False
    """The workload's hint that some parameters get no gradient (DDP must be told)."""
    start_step: int = 0
    """Steps an earlier process of this worker already did (0 for a fresh run); set by
    setup(). The loop continues at start_step + 1 (docs/reliability.md)."""

    @property
    def device(self) -> torch.device:
        return self.precision.device


class OnContext:
    """What a worker is, read from the BackendContext its backend holds (both backends
    derive from this; a PS joiner's `ctx` is replaced in setup(), and these follow)."""

    ctx: BackendContext

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def precision(self) -> PrecisionPolicy:
        return self.ctx.precision

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def start_step(self) -> int:
        return self.ctx.start_step

    @start_step.setter
    def start_step(self, step: int) -> None:
        # The context is frozen (shared by reference); a resumed worker gets a new one.
        self.ctx = dataclasses.replace(self.ctx, start_step=step)


@dataclass(frozen=True)
class ArchInfo:
    """What an architecture says of a run before any backend instance exists."""

    arch: str
    """'ps' or 'allreduce': the report's "arch", the metrics' arch label, log file names."""
    mode: str
    """The consistency mode for ps (--mode); for allreduce ddp, or --mode local's."""
    staleness: bool
    """StepOutcome.staleness means something here (ps: a gradient may be applied to newer
    weights than it was computed on); the report then carries its percentiles."""
    per_rank: bool
    """Every rank writes its own --report (ps workers are separate processes with their
    own staleness and faults); False: rank 0 writes the job's (DDP ranks are lockstep)."""
    flag_rank: int = -1
    """The rank this architecture's flags give (-1: not given, the launcher's environment
    decides; trainkit/roles.py)."""
    flag_world_size: int = 0
    """The world size its flags give (0: not given)."""
    tables_on_shards: bool = False
    """Marked sparse tables live on the shards (ps, hybrid): a worker holds only the rows
    its batch touches, and the shards build the rows from psar_init (docs/sparse.md)."""
    collective_step: bool = False
    """The ranks meet in a collective every step (DDP's backward allreduce, hybrid's
    dense allreduce): a rank that skips a step's backward leaves the others waiting
    there, so a loop of its own has them agree first (allreduce/own_agree.py)."""


def describe(backend: Backend) -> ArchInfo:
    """What a built backend's architecture says of its run (its class's describe())."""
    return type(backend).describe(backend.ctx.cfg)


@runtime_checkable
class Dealer(Protocol):
    """The data of a job whose shards deal it (an elastic PS job, docs/elastic.md): the
    loop trains on the batch ids next_batches() gives instead of cutting its own shard
    from its rank, and a SIGTERM makes it leave after the step in flight."""

    def plan_data(self, total_batches: int, stream: str) -> None:
        """Before setup(): the job's batch ids are 0..total_batches-1 and `stream` says
        how the workers map an id to samples."""
        ...

    def next_batches(self, *, stop: bool = False) -> list[int] | None:
        """After setup() and after each step(): the batch ids of the next step; None when
        the data is done or `stop` (the worker then has left the job)."""
        ...

    writes_model: bool
    """Once next_batches() returned None: this worker writes --save, the job's final
    model (the shards name it; whoever holds rank 0 may have left long before)."""


@runtime_checkable
class Backend(Protocol):
    # ---- what the class says before any instance exists -----------------------------
    @classmethod
    def describe(cls, cfg: TrainConfig) -> ArchInfo:
        """Its name, its mode under `cfg`, what its report carries, the rank flags."""
        ...

    @classmethod
    def from_config(cls, ctx: BackendContext) -> Self:
        """The backend for one worker: the loop's one way to build either."""
        ...

    # ---- per instance ---------------------------------------------------------------
    ctx: BackendContext
    """What it was built from; after setup(), with the rank and world size it runs at and
    the step it continues after (ctx.start_step)."""
    dealer: Dealer | None
    """Where the shards deal the job's data (an elastic PS job): its part; else None."""

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

    def report(self, *, final: bool = False) -> dict[str, Any]:
        """The figures this architecture adds to the step log and the run's report.
        Always the cumulative bytes this worker put on the wire (`bytes_sent`) and took
        off it (`bytes_received`), counted the same way under both architectures
        (payload, no protocol headers), and each one's own: bytes_pushed/bytes_pulled
        (ps), bytes_allreduced (the gradient payload given to allreduce). `final` (once,
        after the last step): also "shards", each parameter-server shard's own figures
        (rank 0; [] elsewhere and where there are no shards), then the architecture's
        extras (fault figures, overlap, --mode local's rounds)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The trained weights (fp32 where the architecture keeps them) for --save."""
        ...

    def finish(self, *, failed: bool = False, why: str = "") -> None:
        """Leave the job cleanly (nobody waits for this worker any more). `failed`: the
        loop failed mid-step; release only what waits on this step (threads, streams),
        so the process can exit with the error. `why` (with failed): the error every
        other worker must hear, as they wait on this step (a user's own loop stepped
        without a backward): where they wait through the shards, the job stops with it
        (where they wait in a collective, the loop has told them itself)."""
        ...
