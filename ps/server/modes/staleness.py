"""Staleness-aware updates of the async and ssp policies (issues #17 and #34).

An async/ssp shard applies each push as its own optimizer step, on weights that moved
since the worker computed the gradient (its *staleness*, ps/server/modes/base.py). The
job's `staleness_rule` (--staleness-rule) decides how, here, for AsyncPolicy / SSPPolicy
only (ps/server/modes/asynchronous.py, ssp.py):

- **adaptive** (the default): trainkit/staleness_rules.py's AdaptiveRule, fed from the
  shard (`AdaptiveStep`): per slot, from the staleness, the curvature along the weights'
  motion, the gradient's coherence and the scheduled lr; with delay compensation on the
  weights each worker was served (ServedWeights below). Its statistics are not
  checkpointed: a restored shard (a new policy) starts them afresh.
- **momentum**: the momentum rule below, alone. **none**: the optimizer as configured.
- **fixed**: the momentum rule (unless --no-momentum-correction) and the corrections the
  job's fields ask for, as issue #17 built them:

- **Momentum rule** (`Job.momentum_correction`, on by default): asynchrony with N workers
  acts as an implicit momentum of about 1 - 1/N (Mitliagkas et al., "Asynchrony begets
  momentum", 2016), so the shard applies max(0, momentum - (1 - 1/N)) as SGD momentum /
  AdamW beta1 and the total stays what sync applies (psar.trainkit.optim.async_momentum).
- **Staleness-aware learning rate** (`--staleness-lr`): lr / (1 + staleness) for a
  gradient `staleness` updates old (Zhang et al., IJCAI 2016).
- **Delay compensation** (`--delay-compensation LAMBDA`): DC-ASGD (Zheng et al., ICML
  2017), g + lambda * g * g * (w_now - w_base). The shard keeps the weights it served each
  worker on its last pull (the paper's Algorithm 2, w_bak(m)), one copy per distinct
  version still some live worker's base, so w_base is exact; a push whose base it no
  longer holds (the worker rejoined, or pulled from before a restore) is applied
  uncompensated and counted (`ServedWeights.missing`; not in Stats yet). The
  constant-lambda variant (DC-ASGD-c), or with `--dc-adaptive` the adaptive one
  (DC-ASGD-a): lambda = LAMBDA0 / sqrt(v) per element, v a moving mean of g * g, so the
  correction no longer vanishes where gradients are small (bench/README.md, issue #17).
- **Staleness lr power** (`--staleness-lr-power P`): lr * (1 / (1 + staleness)) ** P.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from psar.trainkit.optim import StepAdjust, async_momentum, delay_compensate_, staleness_lr_factor
from psar.trainkit.staleness_rules import AdaptiveRule

if TYPE_CHECKING:
    from psar.ps.job import Job
    from psar.ps.server.modes.view import ShardView


def needs_bases(job: Job) -> bool:
    """Whether the shard keeps the weights it served each worker (ServedWeights)."""
    return job.staleness_rule == "adaptive" or bool(job.delay_compensation)


def step_adjust(job: Job, staleness: int) -> StepAdjust | None:
    """How one async/ssp step of a gradient `staleness` updates old differs from the
    configured optimizer under the rules fixed, momentum and none (None: not at all)."""
    fixed = job.staleness_rule == "fixed"
    lr_scale = 1.0
    if fixed and job.staleness_lr:
        lr_scale = staleness_lr_factor(staleness) ** job.staleness_lr_power
    momentum, momenta = None, ()
    adamw = job.optimizer.name == "adamw"
    correct = job.staleness_rule == "momentum" or (fixed and job.momentum_correction)
    if correct and job.num_workers > 1:
        configured = job.optimizer.beta1 if adamw else job.optimizer.momentum
        momentum = async_momentum(configured, job.num_workers)
        # A user's own optimizer (Job.param_groups): each group's own, corrected.
        momenta = tuple(
            async_momentum(g.beta1 if adamw else g.momentum, job.num_workers)
            for g in job.param_groups
        )
    if lr_scale == 1.0 and momentum is None:
        return None
    return StepAdjust(lr_scale=lr_scale, momentum=momentum, momenta=momenta)


class AdaptiveStep:
    """The adaptive rule of one async/ssp shard: its statistics, fed push by push."""

    def __init__(self, job: Job) -> None:
        adamw = job.optimizer.name == "adamw"
        self.rule = AdaptiveRule(
            num_workers=job.num_workers,
            momentum=job.optimizer.beta1 if adamw else job.optimizer.momentum,
            adamw=adamw,
        )
        # A user's own optimizer: each param group's momentum under the momentum rule
        # (the adaptive rule's statistics are per slot; its momentum is the first group's).
        self.momenta = tuple(
            async_momentum(g.beta1 if adamw else g.momentum, job.num_workers)
            for g in job.param_groups
        )

    def adjust(
        self, view: ShardView, bases: ServedWeights, worker: int, base_version: int,
        grads: dict[str, torch.Tensor],
    ) -> StepAdjust:  # fmt: skip
        """Compensate and scale `grads` in place (under the lock, before the step)."""
        adjust = self.rule.adjust(
            grads,
            staleness=view.version - base_version,
            version=view.version,
            lr=float(view.optimizer.param_groups[0]["lr"]),
            w_now=view.masters,
            w_base=bases.base(view, worker, base_version),
        )
        if self.momenta:
            adjust = StepAdjust(
                lr_scale=adjust.lr_scale, momentum=adjust.momentum, momenta=self.momenta
            )
        return adjust


MEAN_SQ_DECAY = 0.95
"""DC-ASGD-a's moving average of g * g (the paper's MeanSquare, its m = 0.95)."""


def mean_square_update(v: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """v <- 0.95 v + 0.05 g * g, in place (v None: start from zeros, as the paper)."""
    if v is None:
        v = torch.zeros_like(g)
    return v.mul_(MEAN_SQ_DECAY).addcmul_(g, g, value=1.0 - MEAN_SQ_DECAY)


def dc_adaptive_(
    g: torch.Tensor, lam0: float, v: torch.Tensor, w_now: torch.Tensor, w_base: torch.Tensor
) -> torch.Tensor:
    """DC-ASGD-a in place: g + lam0 / sqrt(v) * g * g * (w_now - w_base), element by
    element. v already holds this g (so g * g / sqrt(v) <= |g| / sqrt(0.05): bounded
    however small the gradients are), and where v is 0 so is g: no correction."""
    scale = (g * g).div_(v.sqrt().clamp_min_(1e-30))  # the same ops, two temporaries fewer
    return g.addcmul_(scale, w_now - w_base, value=lam0)


class ServedWeights:
    """DC-ASGD's w_bak: the weights each worker was last served, shared per version."""

    def __init__(self) -> None:
        self.base_of: dict[int, int] = {}
        """worker -> version of the weights its last pull returned."""
        self.copies: dict[int, dict[str, torch.Tensor]] = {}
        """version -> fp32 copy of the masters at that version (only versions in base_of)."""
        self.missing = 0
        """Pushes applied uncompensated: their base version was no longer held."""
        self.mean_sq: dict[str, torch.Tensor] = {}
        """--dc-adaptive: slot -> moving mean of g * g (not checkpointed: a restored shard
        starts it afresh, from the first push after the restore)."""

    def served(self, view: ShardView, worker: int) -> None:
        """`worker` is sent the weights of the shard's current version (under the lock)."""
        v = view.version
        if v not in self.copies:
            self.copies[v] = {k: p.detach().clone() for k, p in view.masters.items()}
        self.base_of[worker] = v
        self._evict()

    def forget(self, worker: int) -> None:
        """`worker` left: its base is no longer needed."""
        self.base_of.pop(worker, None)
        self._evict()

    def compensate(
        self, view: ShardView, worker: int, base_version: int, grads: dict[str, torch.Tensor]
    ) -> None:
        """DC-ASGD on `grads` in place (under the lock, before the step)."""
        lam = view.job.delay_compensation if view.job is not None else 0.0
        adaptive = view.job is not None and view.job.dc_adaptive
        if adaptive:  # every push feeds the mean square, fresh ones too (the paper's MeanSquare)
            for key, g in grads.items():
                self.mean_sq[key] = mean_square_update(self.mean_sq.get(key), g)
        if not lam or base_version == view.version:
            return  # nothing moved since the worker's pull: no correction
        base = self.base(view, worker, base_version)
        if base is None:
            return
        for key, g in grads.items():
            w_now = view.masters[key].detach()
            if adaptive:
                dc_adaptive_(g, lam, self.mean_sq[key], w_now, base[key])
            else:
                delay_compensate_(g, lam, w_now, base[key])

    def base(
        self, view: ShardView, worker: int, base_version: int
    ) -> dict[str, torch.Tensor] | None:
        """The weights `worker` computed this push on (None, counted: no longer held)."""
        held = self.base_of.get(worker) == base_version
        base = self.copies.get(base_version) if held else None
        if base is None:
            self.missing += 1
        return base

    def _evict(self) -> None:
        keep = set(self.base_of.values())
        for v in [v for v in self.copies if v not in keep]:
            del self.copies[v]
