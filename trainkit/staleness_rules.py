"""The async/ssp shard's staleness rule `adaptive` (issue #34), as pure tensor arithmetic.

An async/ssp shard applies each push as its own optimizer step, on weights that moved
since the worker computed the gradient (its staleness s). Two things differ from sync at
equal samples, and no fixed rule measured serves both the MLP and the LM
(docs/staleness-rule.md):

- **Per-sample movement.** Sync takes one step with the mean of N gradients; async takes
  N steps. With the momentum rule (explicit momentum b_a = max(0, b - (1 - 1/N)),
  Mitliagkas et al. 2016) a push at lr x c moves the weights, in a direction where the
  gradient hardly changes, N c (1 - b) / (1 - b_a) times what sync moves per sample:
  0.33 for N = 2 and 0.47 for N = 4 at c = 1. c = (1 - b_a) / (N (1 - b)) matches sync
  (the linear scaling view; Goyal et al. 2017).
- **Stability under delay.** A gradient s updates old turns a direction of curvature h
  into the delayed recurrence x' = x - lr c v', v' = b_a v + h x_{t-s}, stable only while
  lr c h < edge(b_a, s) (`delayed_edge`: 0.37 for b_a = 0.15, s = 3, where sync's heavy
  ball has 2 (1 + 0.9) = 3.8). A model whose sharpest directions sit near that edge
  (the LM: the edge of stability, Cohen et al. 2021) needs smaller steps; one far from it
  (the MLP) loses per sample with them.

`AdaptiveRule` decides per slot from what the shard observes, push after push:

1. *Curvature along the motion* (a secant, as Barzilai-Borwein): two consecutive pushes
   computed on weights w1 and w2 give h = (g2 - g1) . (w2 - w1) / |w2 - w1|^2 per slot
   (moving means of the numerator and denominator; a pair whose base interval holds
   the earlier push's own update is skipped: its noise would bias h upwards).
2. *Coherence*: phi = mean(g_t . g_{t-1}) / mean(|g|^2) per slot, the share of the
   gradient that is signal rather than batch noise (the gradient noise scale of McCandlish
   et al. 2018 in another form). Staleness harms the signal; noise averages out either way.
3. *Margin*: m = max(min(1, PHI_GAIN phi), min(1, lr c h / (KAPPA edge(b_a, tau)))),
   tau the moving mean of the staleness, c the slots' recent mean scale. The step scale is
   c = c_sync^(1 - m) x c_stale^m: c_sync = (1 - b_a) / (N (1 - b)) (sync's per-sample
   movement) where the slot is far from its edge and its gradient is noise;
   c_stale = (1 + s)^-1/2 (Zhang et al. 2016's staleness-aware lr, at the power the LM
   measured best, bench/README.md issue #17) where it is at the edge or coherent.
4. *Delay compensation* (DC-ASGD, Zheng et al. 2017): g + lambda v (w_now - w_base), v
   the moving mean of g * g per element (DC-ASGD's diagonal Fisher proxy), with lambda
   *measured*: h |drift|^2 / sum(v drift^2), so the correction's curvature along this
   push's drift is the secant's h (no tuned lambda0; `compensate_`).

Momentum: b_a, the momentum rule's. With AdamW (scale-invariant in its gradient, and
lr h is no stability product for it) the margin is the coherence alone and the scale
becomes the step's learning-rate factor, the gradient-weighted mean of the slots': not
measured against sync (docs/staleness-rule.md says where the rule falls short).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from psar.trainkit.optim import StepAdjust, async_momentum

STALENESS_RULES = ("adaptive", "fixed", "momentum", "none")
"""--staleness-rule: adaptive (this module), fixed (the explicit --staleness-lr /
--delay-compensation settings), momentum (the momentum rule alone), none (as configured)."""

STAT_DECAY = 0.95
"""Moving means of the per-slot statistics (DC-ASGD's MeanSquare uses the same 0.95)."""
TAU_DECAY = 0.9
"""Moving mean of the staleness (the delay the stability edge is computed for)."""
KAPPA = 0.25
"""A slot is at its edge (m = 1) once lr c h reaches this fraction of the delayed edge."""
PHI_GAIN = 2.0
"""A slot whose gradient is half signal (phi 0.5) or more takes the stale-side scale."""
STALE_POWER = 0.5
"""c_stale = (1 + s) ** -STALE_POWER."""
MAX_DELAY = 64
"""Delays above this are treated as this (the edge is ~0 by then anyway)."""


def check_rule(name: str) -> str:
    """`name` if it is a staleness rule, else ValueError naming the accepted ones."""
    if name not in STALENESS_RULES:
        raise ValueError(
            f"--staleness-rule: unknown {name!r}; accepted: {', '.join(STALENESS_RULES)}"
        )
    return name


def resolve_rule(
    rule: str,
    *,
    staleness_lr: bool = False,
    staleness_lr_power: float = 1.0,
    delay_compensation: float = 0.0,
    dc_adaptive: bool = False,
    momentum_correction: bool = True,
) -> str:
    """The rule a job applies, given --staleness-rule and the older flags that are now its
    aliases: any setting of the fixed rule (--staleness-lr, --staleness-lr-power,
    --delay-compensation, --dc-adaptive) selects fixed; --no-momentum-correction alone
    selects none (the optimizer as configured), unless the rule is fixed, whose own setting
    it is. `rule` adaptive is the default, so an alias overrides it; any other rule an
    alias contradicts is refused (ValueError)."""
    check_rule(rule)
    aliases = [
        flag
        for flag, given in (
            ("--staleness-lr", staleness_lr),
            ("--staleness-lr-power", staleness_lr_power != 1.0),
            ("--delay-compensation", delay_compensation != 0.0),
            ("--dc-adaptive", dc_adaptive),
        )
        if given
    ]
    want = "fixed" if aliases else ("none" if not momentum_correction else None)
    if want is None or rule == want or (rule == "fixed" and not aliases):
        return rule  # fixed without the momentum rule: its own field says so
    if rule != "adaptive":
        given = aliases[0] if aliases else "--no-momentum-correction"
        raise ValueError(
            f"{given} is an alias that selects --staleness-rule {want}; it contradicts "
            f"--staleness-rule {rule}: give one of them"
        )
    return want


class RuleSettings(Protocol):
    """The fields --staleness-rule and its aliases set (psar.ps.job.Job, psar.trainkit.config.PSConfig)."""

    staleness_rule: str
    staleness_lr: bool
    staleness_lr_power: float
    delay_compensation: float
    dc_adaptive: bool
    momentum_correction: bool


def rule_of(settings: RuleSettings) -> str:
    """resolve_rule over an object holding the flags' fields by their names (the job,
    psar train's PS configuration): both resolve the aliases the same way."""
    return resolve_rule(
        settings.staleness_rule,
        staleness_lr=settings.staleness_lr,
        staleness_lr_power=settings.staleness_lr_power,
        delay_compensation=settings.delay_compensation,
        dc_adaptive=settings.dc_adaptive,
        momentum_correction=settings.momentum_correction,
    )


@functools.lru_cache(maxsize=4096)
def _edge(momentum: float, delay: int) -> float:
    n = delay + 2

    def radius(a: float) -> float:
        # state (x_t, x_{t-1}, ..., x_{t-delay}, lr v_t): x' = x - b lr v - a x_{t-delay}
        m = torch.zeros(n, n, dtype=torch.float64)
        m[0, 0] = 1.0
        m[0, delay] -= a
        m[0, n - 1] = -momentum
        for i in range(1, delay + 1):
            m[i, i - 1] = 1.0
        m[n - 1, delay] += a
        m[n - 1, n - 1] = momentum
        return float(torch.linalg.eigvals(m).abs().max())

    lo, hi = 0.0, 2.0 * (1.0 + momentum) + 1e-9
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if radius(mid) < 1.0 else (lo, mid)
    return lo


def delayed_edge(momentum: float, delay: float) -> float:
    """The largest lr * h for which heavy-ball momentum `momentum` with gradients `delay`
    steps old is stable on a quadratic of curvature h (x' = x - lr v', v' = momentum v +
    h x_{t-delay}). 2 (1 + momentum) without delay; 2 sin(pi / (4 delay + 2)) without
    momentum; a fractional delay interpolates between its neighbours."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not delay >= 0.0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    delay = min(float(delay), float(MAX_DELAY))
    lo = int(math.floor(delay))
    frac = delay - lo
    m = round(momentum, 4)
    e = _edge(m, lo)
    return e if frac == 0.0 else (1.0 - frac) * e + frac * _edge(m, lo + 1)


@dataclass
class _Slot:
    """Moving statistics of one slot (see the module docstring)."""

    mean_sq: torch.Tensor | None = None
    secant_num: float = 0.0
    secant_den: float = 0.0
    coherence_num: float = 0.0
    coherence_den: float = 0.0
    applied: float = 1.0
    """The scale of this slot's last step."""

    def curvature(self) -> float:
        return max(0.0, self.secant_num / self.secant_den) if self.secant_den > 0 else 0.0

    def coherence(self) -> float:
        if self.coherence_den <= 0:
            return 0.0
        return min(1.0, max(0.0, self.coherence_num / self.coherence_den))


@dataclass
class _Push:
    grads: dict[str, torch.Tensor]
    base_version: int
    base: Mapping[str, torch.Tensor] | None
    """The weights it was computed on (None: not held, so no secant with it)."""
    applied_at: int
    squares: dict[str, float]
    """|g|^2 per slot (the next push's coherence needs it again)."""


def _mix(a: float, b: float, decay: float) -> float:
    return decay * a + (1.0 - decay) * b


def compensate_(
    g: torch.Tensor, h: float, mean_sq: torch.Tensor | None, drift: torch.Tensor
) -> torch.Tensor:
    """g + lambda v drift in place (DC-ASGD's Taylor term, v the mean square of g as its
    diagonal Fisher proxy), lambda = h |drift|^2 / sum(v drift^2): the correction's
    curvature along the drift is the secant's h (v None or 0 along it: h drift)."""
    d2 = drift * drift
    along = float(torch.dot(mean_sq.flatten(), d2.flatten())) if mean_sq is not None else 0.0
    if along > 0:
        return g.addcmul_(mean_sq, drift, value=h * float(d2.sum()) / along)  # type: ignore[arg-type]
    return g.add_(drift, alpha=h)


@dataclass
class AdaptiveRule:
    """The `adaptive` staleness rule of one shard (state: the slots' moving statistics)."""

    num_workers: int
    momentum: float
    """The configured SGD momentum / AdamW beta1 (what sync applies)."""
    adamw: bool = False
    slots: dict[str, _Slot] = field(default_factory=dict)
    prev: _Push | None = None
    tau: float | None = None
    """Moving mean of the staleness."""
    scale: float = 1.0
    """Moving mean of the slots' mean scale (the c of lr c h in the margin; 1 at first)."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        self.applied_momentum = async_momentum(self.momentum, self.num_workers)

    @property
    def sync_scale(self) -> float:
        """c that moves the weights per sample as sync does (N pushes at momentum b_a
        against one step at b): (1 - b_a) / (N (1 - b))."""
        return (1.0 - self.applied_momentum) / (self.num_workers * (1.0 - self.momentum))

    def adjust(
        self,
        grads: dict[str, torch.Tensor],
        *,
        staleness: int,
        version: int,
        lr: float,
        w_now: Mapping[str, torch.Tensor],
        w_base: Mapping[str, torch.Tensor] | None,
    ) -> StepAdjust:
        """Rewrite `grads` (fp32, in place: compensated, and scaled for SGD) for a push
        computed on version `version - staleness` and applied at `version` with the
        scheduled `lr`; returns the step's lr scale and momentum. `w_base`: the weights
        the worker computed on (None: not held; no compensation, no secant)."""
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        base_version = version - staleness
        self._observe(grads, base_version, version, w_base)
        self.tau = staleness if self.tau is None else _mix(self.tau, staleness, TAU_DECAY)
        edge = delayed_edge(self.applied_momentum, self.tau)
        stale_scale = (1.0 + staleness) ** -STALE_POWER
        weighted = total = scales = 0.0
        for key, g in grads.items():
            s = self.slots[key]
            h = s.curvature()
            if staleness and w_base is not None and h > 0:
                compensate_(g, h, s.mean_sq, w_now[key].detach() - w_base[key])
            margin = min(1.0, PHI_GAIN * s.coherence())
            if edge > 0 and not self.adamw:  # lr * h is SGD's stability product only
                margin = max(margin, min(1.0, lr * self.scale * h / (KAPPA * edge)))
            c = self.sync_scale ** (1.0 - margin) * stale_scale**margin
            s.applied = c
            scales += c
            if self.adamw:
                w = float(torch.dot(g.reshape(-1), g.reshape(-1)))
                weighted, total = weighted + c * w, total + w
            else:
                g.mul_(c)
        if grads:
            self.scale = _mix(self.scale, scales / len(grads), STAT_DECAY)
        lr_scale = (weighted / total if total > 0 else stale_scale) if self.adamw else 1.0
        return StepAdjust(lr_scale=lr_scale, momentum=self.applied_momentum)

    def _observe(
        self,
        grads: dict[str, torch.Tensor],
        base_version: int,
        version: int,
        w_base: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Update every slot's statistics with this push (before it is compensated)."""
        for key, g in grads.items():
            s = self.slots.setdefault(key, _Slot())
            if s.mean_sq is None:
                s.mean_sq = (g * g).mul_(1.0 - STAT_DECAY)  # from zeros, as DC-ASGD-a
            else:
                s.mean_sq.mul_(STAT_DECAY).addcmul_(g, g, value=1.0 - STAT_DECAY)
        # Dot products rather than elementwise temporaries: the shard runs this per push.
        flat = {key: g.detach().reshape(-1) for key, g in grads.items()}
        squares = {key: float(torch.dot(f, f)) for key, f in flat.items()}
        prev = self.prev
        if prev is not None:
            lo, hi = sorted((prev.base_version, base_version))
            secant = (
                w_base is not None
                and prev.base is not None
                and lo != hi
                and not lo <= prev.applied_at < hi
            )
            for key, f in flat.items():
                pg = prev.grads.get(key)
                if pg is None:
                    continue
                pf = pg.reshape(-1)
                s = self.slots[key]
                s.coherence_num = _mix(s.coherence_num, float(torch.dot(f, pf)), STAT_DECAY)
                sq = 0.5 * (squares[key] + prev.squares[key])
                s.coherence_den = _mix(s.coherence_den, sq, STAT_DECAY)
                if secant and key in prev.base:  # type: ignore[operator]
                    assert w_base is not None and prev.base is not None
                    db = (w_base[key] - prev.base[key]).reshape(-1)
                    num = float(torch.dot(f, db)) - float(torch.dot(pf, db))
                    s.secant_num = _mix(s.secant_num, num, STAT_DECAY)
                    s.secant_den = _mix(s.secant_den, float(torch.dot(db, db)), STAT_DECAY)
        # This push becomes the previous one: into the last one's buffers (read above, no
        # longer needed), not a fresh copy of every slot per push.
        held = prev.grads if prev is not None else {}
        kept = {}
        for k, g in grads.items():
            buf = held.get(k)
            kept[k] = (
                buf.copy_(g) if buf is not None and buf.shape == g.shape else g.detach().clone()
            )
        self.prev = _Push(kept, base_version, w_base, version, squares)
