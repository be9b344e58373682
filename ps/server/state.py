"""A shard's state as data: what its components share, checkpoints hold and Stats report.

No behaviour lives here (a few read-only accessors). The components of ps/server/shard.py
change it, each its own part, under `cond` (every change is followed by
`cond.notify_all()` where a waiter may care):

| fields | written by (ps/server/...) |
|---|---|
| job, numel, masters, optimizer, scheduler, loss_scale, policy | shard.py (init), update/updates.py (install), durability/durability.py (restore, rollback) |
| version, rounds, skipped_rounds, last_round_skipped, updates_applied, dropped_nonfinite, staleness_counts, step_options, held, round_norms | update/updates.py (step_options: set by intake/intake.py as it hands a push over) |
| clocks, int_buffers, push_paced_s | intake/intake.py (clocks: also membership/membership.py on register, durability/durability.py) |
| live, left, expired, joining, instances, leases, lease_expirations, rejoins, joins, leaves, reserved, ledger | membership/membership.py (ledger: made by shard.py's init, consumed by intake/intake.py, restored by durability/durability.py) |
| incarnation, restores, restored_step, restored_pending, draining | durability/durability.py (incarnation: also shard.py's init) |
| max_clock_gap | pulls/pulls.py |
| sparse | the sparse servicer (doors/sparse_servicer.py) or a restore |

A worker's *clock* is the number of gradients it has pushed; the shard's *version* the
number of updates it has applied; a *round* (modes whose updates come in rounds) closes
when every live worker has pushed once.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from psar.ps.errors import FailedPrecondition
from psar.ps.headers import StepOptions
from psar.ps.job import Job, ModeTraits
from psar.ps.server.limits import ShardLimits
from psar.ps.server.membership.leases import LeaseTable
from psar.ps.server.membership.ledger import DataLedger
from psar.ps.server.metrics.recorder import ShardRecorder
from psar.ps.server.update.buffers import IntBufferLog
from psar.ps.server.update.clipping import HeldRound, RoundNorms
from psar.trainkit.optim import DynamicLossScale

if TYPE_CHECKING:
    from psar.ps.server.durability.checkpoints import CheckpointManager
    from psar.ps.server.modes import Modes, UpdatePolicy
    from psar.ps.server.sparse.tables import SparseTables


class ShardData:
    """The state of one shard (see the module docstring for who writes what)."""

    def __init__(
        self,
        *,
        modes: Modes,
        metrics: ShardRecorder,
        message_bytes: int,
        leases: LeaseTable,
        checkpoints: CheckpointManager | None,
        chunk_rounds: bool,
        push_lead_bytes: int,
        exact_fp16_sum: bool = True,
        limits: ShardLimits | None = None,
    ) -> None:
        self.cond = threading.Condition()
        """The shard's lock; every state change is made holding it."""
        self.modes = modes
        """The modes this shard serves (ps/server/modes/): a job's mode becomes its traits
        and its update rule there."""
        self.metrics = metrics
        self.message_bytes = message_bytes
        """Bytes of tensor data per piece of a pull."""
        self.chunk_rounds = chunk_rounds
        """sync: apply each slot as soon as every worker's piece of it is in
        (ps/server/modes/sync_chunks.py); results are bit-identical either way."""
        self.exact_fp16_sum = exact_fp16_sum
        """sync: sum a round's fp16 pushes exactly as they arrive, in an int64 accumulator
        per slot (ps/server/modes/exact_sum.py), not staged per worker."""
        self.push_lead_bytes = push_lead_bytes
        self.limits = limits if limits is not None else ShardLimits()
        """The bounds on what clients declare and send (ps/server/limits.py)."""
        """Per-chunk rounds, data plane: read a push at most this far ahead of the slowest
        push of its round still streaming (ps/server/intake/pacing.py); 0: no pacing."""
        # ---- the job and the update ----------------------------------------------------
        self.job: Job | None = None
        """The job as this shard holds it (Modes.serve: with its mode's traits)."""
        self.numel: dict[str, int] = {}
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer
        self.scheduler: Any
        self.loss_scale: DynamicLossScale
        self.policy: UpdatePolicy | None = None
        """The update rule of the job's mode (None before init)."""
        self.version = 0
        self.rounds = 0
        self.skipped_rounds = 0
        self.last_round_skipped = False
        self.updates_applied = 0
        self.dropped_nonfinite = 0
        self.staleness_counts: Counter[int] = Counter()
        self.step_options = StepOptions()
        """The step options of the push handed to the rule last (a worker's own loop: its
        learning rates, clipping); the update it makes or closes takes them."""
        self.held: HeldRound | None = None
        """A round's update held for its global norm (ps/server/update/clipping.py)."""
        self.round_norms = RoundNorms()
        """This shard's parts of recent rounds' squared norms (RoundNorm)."""
        # ---- workers ----------------------------------------------------------------------
        self.clocks: list[int] = []
        self.max_clock_gap = 0
        self.int_buffers = IntBufferLog()
        """Shard 0: rank 0's integer buffers by clock (ps/server/update/buffers.py), sent with
        every pull."""
        self.live: set[int] = set()
        self.left: set[int] = set()
        self.expired: set[int] = set()
        self.joining: dict[int, int] = {}
        """Workers waiting to join at a round boundary -> the round they wait for."""
        self.instances: dict[int, str] = {}
        self.leases = leases
        self.lease_expirations = 0
        self.rejoins = 0
        self.joins = 0
        """Ranks given by Join (elastic jobs)."""
        self.leaves = 0
        """Workers that left with Leave."""
        self.reserved: dict[int, tuple[str, float]] = {}
        """Elastic jobs: ranks Join gave and whose worker has not registered yet -> (its
        instance, the lease clock's time the reservation lapses)."""
        self.ledger: DataLedger | None = None
        """Shard 0 of a job with elastic data: the batch ids dealt to the workers
        (ps/server/membership/ledger.py)."""
        self.push_paced_s = 0.0
        """Seconds pushes were held back by pacing, all together (Stats)."""
        # ---- durability -------------------------------------------------------------------
        self.checkpoints = checkpoints
        self.incarnation = 0
        self.restores = 0
        self.restored_step = 0
        self.restored_pending = False
        self.draining = False
        self.sparse: SparseTables | None = None
        """The sparse tables, once the sparse servicer or a restore made them."""

    @property
    def initialized(self) -> bool:
        return self.job is not None

    @property
    def master_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.masters.values())

    @property
    def buffer_keys(self) -> frozenset[str]:
        """The slots holding model buffers (values, never stepped)."""
        return frozenset(self.job.buffer_slots) if self.job is not None else frozenset()

    @property
    def traits(self) -> ModeTraits:
        """How the job's mode behaves (rounds, rejoining, ...); only once a job is held."""
        traits = self.require_job().traits
        assert traits is not None, "a held job carries its mode's traits (Modes.serve)"
        return traits

    def require_job(self) -> Job:
        """The job, or the refusal of a request that came before it."""
        if self.job is None:
            raise FailedPrecondition(
                "shard not initialised yet: the worker of rank 0 initialises every shard; "
                "start it (or wait for it) before pushing or pulling",
                reason="not_initialized",
            )
        return self.job

    def slowest_live_clock(self, default: int) -> int:
        return min((self.clocks[w] for w in self.live), default=default)
