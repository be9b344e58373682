"""The shard's update: optimizer steps on the masters, versions, rounds; the ShardView rules get.

`Updates` is the component every update rule (ps/server/modes/) is handed as its
`ShardView` (ps/server/modes/view.py): the reads and changes a rule may make, under
the shard's lock, and nothing else. It owns the masters' optimizer, schedule and loss
scale (`install`), steps them (ps/server/update/stepper.py), and counts what an update or a
skipped round changes. What happens when a round closes beyond that (joiners become live,
a checkpoint falls due) is the membership's and the durability's: `on_round_closed` and
`on_update` are theirs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Set
from typing import TYPE_CHECKING, Any

import torch

from psar.ps.errors import InvalidArgument
from psar.ps.headers import StepOptions
from psar.ps.job import Job
from psar.ps.server.metrics.recorder import ShardRecorder
from psar.ps.server.modes.registry import RuleOptions
from psar.ps.server.state import ShardData
from psar.ps.server.update import clipping
from psar.ps.server.update.buffers import round_buffers
from psar.ps.server.update.clipping import HeldRound, RoundNorms
from psar.ps.server.update.stepper import SlotStepper
from psar.trainkit.optim import (
    DynamicLossScale,
    StepAdjust,
    build_grouped_optimizer,
    build_optimizer,
    build_scheduler,
)

if TYPE_CHECKING:
    from psar.ps.server.modes import UpdatePolicy


class Updates:
    """Applies updates to a shard's masters (a ShardView; see the module docstring)."""

    def __init__(
        self,
        data: ShardData,
        stepper: SlotStepper,
        *,
        on_round_closed: Callable[[], None],
        on_update: Callable[[], None],
    ) -> None:
        self.data = data
        self.stepper = stepper
        """Runs and times the optimizer steps (ps/server/update/stepper.py: --torch-threads)."""
        self._on_round_closed = on_round_closed
        """A round closed: joiners waiting for it become live, a checkpoint may fall due."""
        self._on_update = on_update
        """An update outside rounds was applied: a checkpoint may fall due."""

    # ---- set up from a job (init, restore, rollback) -----------------------------------

    def install(self, job: Job, masters: dict[str, torch.nn.Parameter]) -> None:
        """Take these masters for `job`: a fresh optimizer, schedule, loss scale and update
        rule (the previous rule is closed: queued work of it must not run)."""
        d = self.data
        d.masters = masters
        d.numel = {s.key: s.numel for s in job.slots}
        if d.policy is not None:
            d.policy.close()
        options = RuleOptions(chunk_rounds=d.chunk_rounds, exact_fp16_sum=d.exact_fp16_sum)
        d.policy = d.modes.rule(job, options)
        d.optimizer = _optimizer(job, masters)
        # The schedule after the optimizer: building it sets the group's lr to the
        # schedule's start (a restore then loads the saved param group over it).
        d.scheduler = build_scheduler(d.optimizer, job.optimizer)
        d.loss_scale = DynamicLossScale(job.loss_scale)
        d.step_options, d.held, d.round_norms = StepOptions(), None, RoundNorms()

    @property
    def policy(self) -> UpdatePolicy:
        policy = self.data.policy
        assert policy is not None, "no update rule before init"
        return policy

    # ---- ShardView: what a rule reads ----------------------------------------------------

    @property
    def job(self) -> Job | None:
        return self.data.job

    @property
    def version(self) -> int:
        return self.data.version

    @property
    def rounds(self) -> int:
        return self.data.rounds

    @property
    def live(self) -> Set[int]:
        return self.data.live

    @property
    def masters(self) -> Mapping[str, torch.nn.Parameter]:
        return self.data.masters

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.data.optimizer

    @property
    def metrics(self) -> ShardRecorder:
        return self.data.metrics

    @property
    def buffer_keys(self) -> frozenset[str]:
        return self.data.buffer_keys

    @property
    def loss_scale(self) -> float:
        return self.data.loss_scale.scale

    def slowest_live_clock(self, default: int) -> int:
        return self.data.slowest_live_clock(default)

    # ---- ShardView: what a rule changes (under the lock) ----------------------------------

    def apply_update(
        self, grads: dict[str, torch.Tensor], staleness: list[int], adjust: StepAdjust | None = None
    ) -> None:
        """One optimizer step with these fp32 gradients (keyed by slot); `adjust`: this
        step's learning-rate scale / momentum (async/ssp, ps/server/modes/staleness.py). A slot
        missing from `grads` (no gradient: an unused parameter) is not stepped at all:
        torch's optimizers skip a parameter whose .grad is None, state and weight decay
        included, as they do for a DDP parameter no rank used.

        The step options of the push that made (or closed) this update apply: its
        learning rates, and clipping by the global norm (ps/server/update/clipping.py): a
        round's update is then held until a worker's pull brings the norm's total
        (release_held), a push's is scaled by its worker's own norm."""
        opts = self.data.step_options
        if opts.lrs:
            adjust = dataclasses.replace(adjust or StepAdjust(), lrs=opts.lrs)
        if opts.clip_norm > 0 and self.data.traits.rounds:
            part = clipping.sq_norm(grads)
            self.data.held = HeldRound(
                self.data.rounds + 1, grads, staleness, adjust, opts.clip_norm, part
            )
            return
        if opts.clip_norm > 0:
            clipping.scale_(grads, clipping.clip_coef(opts.clip_norm, opts.grad_norm))
        self._step(grads, staleness, adjust)

    def round_norm(self, clock: int) -> tuple[float, bool] | None:
        """This shard's part of round `clock`'s squared norm and whether the round was
        skipped, once known (None: the round's pushes are not all in yet)."""
        d = self.data
        if d.held is not None and d.held.round == clock:
            return d.held.sq_norm, False
        if d.rounds < clock:
            return None
        part = d.round_norms.get(clock)
        return (part, False) if part is not None else (0.0, True)

    def release_held(self, clock: int, total_sq: float) -> None:
        """A pull brought round `clock`'s squared norm over every shard: apply its held
        update clipped (a no-op once applied: every worker's pull brings the total)."""
        held = self.data.held
        if held is None or held.round != clock:
            return
        try:
            norm = clipping.total_norm(total_sq)
        except ValueError as e:
            raise InvalidArgument(str(e), reason="malformed") from None
        self.data.held = None
        self.data.round_norms.put(clock, held.sq_norm)
        clipping.scale_(held.grads, clipping.clip_coef(held.clip_norm, norm))
        self._step(held.grads, held.staleness, held.adjust)
        self.data.cond.notify_all()

    def _step(
        self, grads: dict[str, torch.Tensor], staleness: list[int], adjust: StepAdjust | None
    ) -> None:
        masters = self.data.masters
        for key, p in masters.items():
            p.grad = grads.get(key)
        try:
            self.stepper.step_all(self.data, adjust)
        finally:
            for p in masters.values():
                p.grad = None
        self.finish_update(staleness)

    def step_slot(self, key: str, grad: torch.Tensor) -> None:
        """The optimizer step of one slot only (per-chunk rounds); finish_update ends the
        round (torch's optimizers step each parameter on its own: same bits)."""
        self.stepper.step_slot(self.data, key, grad)

    def step_each(self, keys: Iterable[str], fn: Callable[[str], Any]) -> None:
        self.stepper.each(self.data, keys, fn)

    def buffer_values(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A sync round's buffer values (ps/server/update/buffers.py)."""
        job = self.data.job
        return round_buffers(job, grads) if job is not None else {}

    def set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Overwrite buffer slots with these values (they are never optimizer-stepped)."""
        for k, v in values.items():
            self.data.masters[k].detach().copy_(v)

    def finish_update(self, staleness: list[int]) -> None:
        """After the optimizer step(s) of an update: schedule, version, counters, round."""
        d = self.data
        d.scheduler.step()
        d.version += 1
        d.updates_applied += 1
        numel = sum(d.numel.values())
        d.metrics.update_timed(numel, self.stepper.commit(numel))
        d.metrics.optimizer_step()
        d.metrics.set_version(d.version)
        for s in staleness:
            d.staleness_counts[s] += 1
            d.metrics.gradient_applied(s)
        if d.traits.rounds:
            self._close_round(skipped=False)
        else:
            self._on_update()

    def skip_round(self, reason: str) -> None:
        """Close a round without an update (weights and optimizer state untouched)."""
        self.data.skipped_rounds += 1
        self.data.metrics.round_skipped(reason)
        self._close_round(skipped=True)

    def drop_nonfinite(self) -> None:
        self.data.dropped_nonfinite += 1
        self.data.metrics.nonfinite_dropped()
        self.data.metrics.push_rejected("nonfinite")

    def take_options(self, options: StepOptions, *, check_only: bool = False) -> None:
        """The push about to be handed to the rule says this of its step (its update, or
        the round it closes, takes it); refused where the job cannot honour it, did not
        declare step options, or a value cannot be stepped with (ps/server/limits.py):
        checked as soon as they arrive (check_only), before anything changes."""
        d = self.data
        job = d.require_job()
        groups = max(1, len(job.param_groups))
        if options.lrs and len(options.lrs) != groups:
            raise InvalidArgument(
                f"step options: {len(options.lrs)} learning rates for an optimizer of "
                f"{groups} parameter groups; send one per group, in group order",
                reason="malformed",
            )
        if options.given and self.policy.applies_chunks:
            raise InvalidArgument(
                "step options (learning rates, clipping) apply to whole updates, but this "
                "shard applies rounds chunk by chunk (--chunk-rounds): start it without",
                reason="malformed",
            )
        if options.given:
            d.limits.check_options(options, job)
        if not check_only:
            d.step_options = options

    def _close_round(self, skipped: bool) -> None:
        d = self.data
        d.rounds += 1
        d.last_round_skipped = skipped
        d.loss_scale.update(overflow=skipped)
        d.metrics.set_loss_scale(d.loss_scale.scale)
        d.restored_pending = False
        self._on_round_closed()


def _optimizer(job: Job, masters: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The masters' optimizer: one group of job.optimizer, or the job's param groups
    (buffer slots, never stepped, in group 0)."""
    if not job.param_groups:
        return build_optimizer(masters.values(), job.optimizer)
    group = job.group_of()
    members: list[list[torch.Tensor]] = [[] for _ in job.param_groups]
    for key, p in masters.items():
        members[group[key]].append(p)
    return build_grouped_optimizer(
        job.optimizer.name, list(zip(members, job.param_groups, strict=True))
    )
