"""The job a shard serves, and how its mode behaves, as plain Python (ps/serde.py converts
them to and from the wire)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from psar.ps.partition import Slot
from psar.trainkit.choices import DEFAULT_MODE, averages_buffers, local_sgd
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig, ParamGroup
from psar.trainkit.staleness_rules import rule_of

MAX_INT_BUFFER_ELEMENTS = 4096
"""Integer buffer elements a job may carry in its headers (counters are scalars)."""

STALENESS = ("none", "versions", "bounded")
BETWEEN_STEPS = ("pull", "local_steps")
REJOIN = ("at_round_boundary", "at_once")


@dataclass(frozen=True, kw_only=True)
class ModeTraits:
    """How a consistency mode behaves, as its shards tell the workers with the job (GetJob).

    Workers and shards act on these, never on the mode's name: a mode (ps/server/modes/)
    declares them next to its update rule."""

    rounds: bool
    """How updates happen: in rounds (True) that close when every live worker has pushed
    once, the round's mean being one update, a round with an overflow anywhere skipped on
    every shard; or (False) each push on its own, as it arrives."""
    staleness: str
    """What staleness means: none (every gradient is applied to the weights it was computed
    from), versions (the shard's version at apply minus the version the worker pulled), or
    bounded (versions, and a pull waits while its worker is more than the job's `staleness`
    clocks ahead of the slowest live worker)."""
    between_steps: str
    """What a worker must do between steps: pull (the new weights after every push; the
    pull waits as the mode says) or local_steps (take the job's `sync_every` inner steps
    with its own optimizer, then push the pseudo-gradient and pull)."""
    shard_owns_loss_scale: bool
    """The shards own the dynamic loss scale (every pull carries it; a round with an
    overflow is skipped everywhere, the scale backs off); else each worker keeps its own."""
    rejoin: str
    """Where a (re)joining worker enters: at_round_boundary (the next round boundary still
    ahead, so every shard adds it at the same round) or at_once (its clock never moves back)."""

    def __post_init__(self) -> None:
        for name, accepted in (
            ("staleness", STALENESS),
            ("between_steps", BETWEEN_STEPS),
            ("rejoin", REJOIN),
        ):
            if getattr(self, name) not in accepted:
                raise ValueError(f"mode trait {name}: {getattr(self, name)!r} not in {accepted}")
        if self.rejoin == "at_round_boundary" and not self.rounds:
            raise ValueError("mode traits: joining at a round boundary needs rounds")


_MODE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(kw_only=True)
class Job:
    """What the worker of rank 0 tells every shard at initialisation."""

    mode: str = DEFAULT_MODE
    """Consistency mode: a mode the shards serve (ps/server/modes/; --mode's choices)."""
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
    sync_every: int = 0
    """local: inner steps each worker takes between pushes (H; every push is then a
    pseudo-gradient and `optimizer` is the outer optimizer). 0 for every other mode."""

    staleness_rule: str = "adaptive"
    """async/ssp: how a stale gradient is applied (trainkit/staleness_rules.py): adaptive
    (the default), fixed (the fields below), momentum (the momentum rule alone) or none.
    A spec without the field (written before it existed) reads fixed: what its shards
    applied."""
    staleness_lr: bool = False
    """async/ssp, rule fixed: apply a gradient `staleness` updates old with lr / (1 + staleness)
    (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016; ps/server/modes/staleness.py)."""
    delay_compensation: float = 0.0
    """async/ssp, rule fixed: DC-ASGD's lambda (Zheng et al., ICML 2017): each gradient g is applied as
    g + lambda * g * g * (w_now - w_base); 0 disables it."""
    staleness_lr_power: float = 1.0
    """async/ssp with staleness_lr: the lr scale is (1 / (1 + staleness)) ** this (0.5:
    lr / sqrt(1 + staleness); bench/README.md, issue #17)."""
    dc_adaptive: bool = False
    """async/ssp with delay_compensation: DC-ASGD-a (Zheng et al. 2017): lambda is
    delay_compensation / sqrt(v), v a moving mean (0.95) of g * g per element."""
    momentum_correction: bool = True
    """async/ssp with N > 1 workers: apply max(0, momentum - (1 - 1/N)) as SGD momentum /
    AdamW beta1, since asynchrony adds about 1 - 1/N of its own (Mitliagkas et al. 2016);
    False applies the configured momentum as given (a job spec without the field, e.g. in
    a checkpoint written before it existed, reads False: what those shards applied)."""

    buffer_slots: tuple[str, ...] = ()
    """Slots that hold model buffers (BatchNorm running stats): never stepped; the shard
    keeps rank 0's pushed values, or their mean over the round with buffers_average."""
    buffers_average: bool = False
    """sync: buffers become the mean of every worker's (--buffers average)."""
    int_buffers: tuple[tuple[str, int], ...] = ()
    """Shard 0 only: the model's integer buffers (name, numel), e.g. BatchNorm's
    num_batches_tracked. Exact values travel in push and pull headers; the shard keeps rank
    0's (DDP's broadcast). At most MAX_INT_BUFFER_ELEMENTS elements in all."""
    chunk_rounds: bool = False
    """Rounds applied slot by slot: a shard steps each slot as soon as every worker's piece
    of it is in, while later slots still stream (same bits as whole rounds). Rank 0 decides
    it for the job (it follows --early-pull); a shard whose mode has no such rounds refuses
    the job, naming why."""
    early_pull: bool = False
    """Every worker asks each step's pull while its push still streams, so a slot comes
    back as soon as it is applied (needs chunk_rounds). Rank 0 decides it for the job;
    the other workers follow the job they find on the shards."""
    step_options: bool = False
    """The workers send step options with their pushes (their own loop's learning rates,
    clipping by the global norm): rounds apply as whole updates. Rank 0 says so, so that a
    shard forced to apply rounds chunk by chunk (psar server --chunk-rounds) refuses the
    job at Init rather than at the first push."""
    mode_options: dict[str, float] = field(default_factory=dict)
    """The knobs of a mode that has no field of its own above (a mode added as one
    module: its configuration reads them, ps/server/modes/); empty for the built-in ones."""
    max_workers: int = 0
    """Elastic jobs (docs/elastic.md): the most workers the job may hold at once, ranks
    0..max_workers-1; workers started with --join ask shard 0 for a free rank. 0: the job
    keeps its num_workers (a fixed job)."""
    data_batches: int = 0
    """Elastic data: shard 0 deals the batch ids 0..data_batches-1 (ps/server/membership/
    ledger.py), data_per_step per step, in its pull headers, so the data follows
    membership and each id is trained on once. 0: each worker cuts its own shard of the
    data from its rank and the world size."""
    data_per_step: int = 1
    """Elastic data: batch ids per step (the worker's --grad-accum micro-batches)."""
    data_stream: str = ""
    """Elastic data: how the workers map a batch id to samples (workload, batch size, seed,
    dataset size): the shards never read it, but a worker whose differs is refused."""
    param_groups: tuple[ParamGroup, ...] = ()
    """The optimizer's parameter groups with their own hyper-parameters (a user's own
    torch.optim optimizer, worker/own_loop.py), each naming the parameters of this
    shard's slots it holds; `optimizer` then names the class only (its schedule:
    constant, the worker ships each step's learning rates with its push). Empty: one
    group with `optimizer`'s values."""
    traits: ModeTraits | None = field(default=None, compare=False)
    """How the serving shard's mode behaves: set on the job a shard installed (and sends
    back with GetJob), None on one a worker built. Not part of the job's identity."""

    @property
    def capacity(self) -> int:
        """How many ranks the job has room for: 0..capacity-1 (max_workers, or the fixed
        job's num_workers)."""
        return max(self.num_workers, self.max_workers)

    @property
    def elastic(self) -> bool:
        """Workers may join (Join) and the data follows membership."""
        return self.max_workers > 0

    def group_of(self) -> dict[str, int]:
        """Each slot's parameter group (0 for all without param_groups; buffer slots,
        never stepped, in group 0)."""
        by_param = {n: i for i, g in enumerate(self.param_groups) for n in g.params}
        return {s.key: by_param.get(s.param, 0) for s in self.slots}

    def _check_groups(self) -> None:
        self.param_groups = tuple(self.param_groups)
        if not self.param_groups:
            return
        names = [n for g in self.param_groups for n in g.params]
        if len(set(names)) != len(names):
            raise ValueError("param groups: a parameter is listed in more than one group")
        buffers = set(self.buffer_slots)
        stray = {s.param for s in self.slots if s.key not in buffers} - set(names)
        if stray:
            raise ValueError(
                f"param groups: parameters {sorted(stray)[:3]} of this shard's slots are in "
                "no group; every trained parameter belongs to exactly one group"
            )
        if self.optimizer.schedule != "constant":
            raise ValueError(
                "param groups come with the worker's own LR schedule (its learning rates "
                f"travel with each push): the job's schedule must be constant, got "
                f"{self.optimizer.schedule!r}"
            )

    def served(self, traits: ModeTraits) -> Job:
        """This job as a shard of a mode with `traits` holds it: with those traits, and
        without a loss-scale configuration where the shards do not own the loss scale
        (each worker keeps its own). Shards install it; workers compare with it."""
        ls = self.loss_scale if traits.shard_owns_loss_scale else LossScaleConfig()
        return dataclasses.replace(self, loss_scale=ls, traits=traits)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not _MODE_NAME.match(self.mode):
            raise ValueError(
                f"mode {self.mode!r}: a mode's name is lower case letters, digits and _"
            )
        self.buffer_slots = tuple(self.buffer_slots)
        if self.buffers_average and not averages_buffers(self.mode):
            raise ValueError(f"--buffers average needs --mode sync, not {self.mode}")
        if not 0.0 <= self.delay_compensation < math.inf:
            raise ValueError(
                f"--delay-compensation must be a finite number >= 0 (DC-ASGD's lambda; "
                f"0 disables it), got {self.delay_compensation}"
            )
        if not 0.0 < self.staleness_lr_power <= 4.0:
            raise ValueError(
                f"--staleness-lr-power must be in (0, 4] (the exponent of 1 / (1 + staleness); "
                f"1: Zhang et al.'s lr / (1 + staleness)), got {self.staleness_lr_power}"
            )
        if self.dc_adaptive and not self.delay_compensation:
            raise ValueError(
                "--dc-adaptive scales DC-ASGD's lambda: give its lambda0 with "
                "--delay-compensation LAMBDA0 (> 0)"
            )
        # The fixed rule's fields select it over the default, as the CLI's aliases do.
        self.staleness_rule = rule_of(self)
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.max_workers and self.max_workers < self.num_workers:
            raise ValueError(
                f"--max-workers {self.max_workers} is below the job's {self.num_workers} "
                "workers at start; give at least --world-size (0: a fixed job)"
            )
        if self.data_batches < 0 or self.data_per_step < 1:
            raise ValueError(
                f"elastic data: data_batches must be >= 0 and data_per_step >= 1, got "
                f"{self.data_batches} and {self.data_per_step}"
            )
        if (self.sync_every >= 1) != local_sgd(self.mode):
            raise ValueError(
                f"--sync-every {self.sync_every} with --mode {self.mode}: --mode local needs "
                "--sync-every H >= 1, and only --mode local takes it"
            )
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, got {self.staleness}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index {self.shard_index} not in [0, {self.num_shards})")
        keys = [s.key for s in self.slots]
        if len(set(keys)) != len(keys):
            raise ValueError("slot keys must be unique")
        stray = set(self.buffer_slots) - set(keys)
        if stray:
            raise ValueError(f"buffer slots not among the slots: {sorted(stray)[:3]}")
        self.int_buffers = tuple((str(n), int(k)) for n, k in self.int_buffers)
        names = [n for n, _ in self.int_buffers]
        if len(set(names)) != len(names) or any(k < 1 for _, k in self.int_buffers):
            raise ValueError("integer buffers must have unique names and >= 1 element each")
        if sum(k for _, k in self.int_buffers) > MAX_INT_BUFFER_ELEMENTS:
            raise ValueError(
                f"integer buffers hold more than {MAX_INT_BUFFER_ELEMENTS} elements; they "
                "travel in headers (larger ones stay each worker's own)"
            )
        self._check_groups()
        if self.early_pull and not self.chunk_rounds:
            raise ValueError("a job with early pulls needs chunk_rounds (slots applied early)")
        if self.step_options and self.chunk_rounds:
            raise ValueError(
                "a job whose workers send step options (learning rates, clipping) applies "
                "whole rounds: it cannot have chunk_rounds"
            )
        self.mode_options = {str(k): float(v) for k, v in self.mode_options.items()}
        bad = [k for k, v in self.mode_options.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"mode options {bad}: each must be a finite number")
