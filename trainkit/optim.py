"""Optimizers, learning-rate schedules and dynamic loss scaling shared by both architectures.

The parameter-server shards and the DDP backend build their optimizer from the same
`OptimizerConfig` with the same functions, so an update is the same torch code
whichever architecture runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from psar.trainkit.optim_config import (  # noqa: F401 - their home before the split
    IMPLS,
    OPTIMIZERS,
    SCHEDULES,
    LossScaleConfig,
    OptimizerConfig,
)

_TORCH_CLASSES = {"sgd": "SGD", "adamw": "AdamW"}


@functools.cache
def has_fused(name: str, device_type: str) -> bool:
    """Whether this torch has the fused kernel of optimizer `name` on `device_type`: one
    step of a one-element parameter tried (a feature test, never a version check; cached)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        p = torch.nn.Parameter(torch.zeros(1, device=device_type))
        p.grad = torch.zeros(1, device=device_type)
        getattr(torch.optim, _TORCH_CLASSES[name])([p], lr=0.1, fused=True).step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def resolve_impl(cfg: OptimizerConfig, device: torch.device | str) -> str:
    """The implementation `cfg.impl` means for parameters on `device` (auto decided);
    ValueError where fused is asked for and this torch has no such kernel there."""
    device_type = torch.device(device).type
    if cfg.impl == "auto":
        return "fused" if has_fused(cfg.name, device_type) else "loop"
    if cfg.impl == "fused" and not has_fused(cfg.name, device_type):
        raise ValueError(
            f"--optimizer-impl fused: torch {torch.__version__} has no fused {cfg.name} "
            f"kernel for {device_type}; use --optimizer-impl auto, foreach or loop"
        )
    return cfg.impl


def impl_kwargs(impl: str) -> dict[str, bool]:
    """torch's constructor arguments for a resolved implementation."""
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def _first_momentum(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's fused SGD steps its list as a first step (buffer = gradient) only when no
    parameter of it has a momentum buffer yet, and fails on a None buffer otherwise: a
    parameter with its first gradient while the others have buffers (a slot no push had
    a gradient for until now, an unused parameter used at last) would crash the step.
    Such a buffer starts as -0.0: the kernel's buffer x momentum + gradient is then the
    gradient bit for bit (signed zeros included), torch's first step for it."""
    for group in opt.param_groups:
        with_grad = [p for p in group["params"] if p.grad is not None]
        fresh = [p for p in with_grad if opt.state[p].get("momentum_buffer") is None]
        if fresh and len(fresh) < len(with_grad):
            for p in fresh:
                opt.state[p]["momentum_buffer"] = torch.full_like(p, -0.0)


def build_optimizer(params: Iterable[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer for `cfg` (torch's own implementation, never a re-implementation),
    with the implementation `cfg.impl` resolves to on the parameters' device."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    kw = impl_kwargs(resolve_impl(cfg, device))
    if cfg.name == "sgd":
        sgd = torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay, **kw,
        )  # fmt: skip
        if kw.get("fused") and cfg.momentum:
            sgd.register_step_pre_hook(_first_momentum)
        return sgd
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        weight_decay=cfg.weight_decay, **kw,
    )  # fmt: skip


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """The implementation a built optimizer runs (reports, Stats)."""
    d = optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "loop"


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """One parameter group of an optimizer with hyper-parameters of its own (torch's
    `param_groups[i]`): what a user's own torch.optim optimizer ships to the shards
    (worker/own_loop.py). SGD reads lr, momentum, dampening, nesterov and weight_decay;
    AdamW lr, beta1, beta2, eps, weight_decay and amsgrad."""

    params: tuple[str, ...]
    """The names of the parameters in this group (model.named_parameters())."""
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    amsgrad: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(str(n) for n in self.params))
        numbers = ("lr", "momentum", "dampening", "weight_decay", "beta1", "beta2", "eps")
        for name in numbers:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"param group {name} must be a finite number >= 0, got {value}")
        if not (self.beta1 < 1.0 and self.beta2 < 1.0):
            raise ValueError(f"param group betas must be < 1, got ({self.beta1}, {self.beta2})")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("param group: nesterov needs momentum > 0 and dampening 0")

    def torch_options(self, name: str) -> dict[str, object]:
        """This group's hyper-parameters as torch's optimizer `name` takes them."""
        if name == "sgd":
            return {
                "lr": self.lr,
                "momentum": self.momentum,
                "dampening": self.dampening,
                "nesterov": self.nesterov,
                "weight_decay": self.weight_decay,
            }
        return {
            "lr": self.lr,
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "amsgrad": self.amsgrad,
        }


def build_grouped_optimizer(
    name: str, groups: list[tuple[list[torch.Tensor], ParamGroup]]
) -> torch.optim.Optimizer:
    """torch's optimizer `name` (sgd | adamw) over these parameter groups, each with its
    own hyper-parameters (foreach=False as build_optimizer: the same kernels as there)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r}: accepted: {', '.join(OPTIMIZERS)}")
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    torch_groups = [{"params": list(ps), **g.torch_options(name)} for ps, g in groups]
    return cls(torch_groups, foreach=False)


def lr_factor(cfg: OptimizerConfig, updates: int) -> float:
    """Multiplier of cfg.lr after `updates` applied updates (a LambdaLR lambda)."""
    if cfg.schedule == "constant":
        return 1.0
    if cfg.warmup_steps and updates < cfg.warmup_steps:
        return (updates + 1) / cfg.warmup_steps
    total = max(cfg.total_steps, cfg.warmup_steps + 1)
    progress = min(1.0, (updates - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def with_run_length(cfg: OptimizerConfig, run_steps: int) -> OptimizerConfig:
    """cfg with total_steps filled from the run's length where a schedule needs it (0)."""
    if cfg.schedule != "constant" and cfg.total_steps == 0:
        return dataclasses.replace(cfg, total_steps=run_steps)
    return cfg


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR driven by the number of applied updates (call .step() after each one)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: lr_factor(cfg, n))


def effective_loss_scale(cfg: LossScaleConfig, needed: bool) -> LossScaleConfig:
    """cfg with scaling switched on where the precision needs it (fp16), or where asked."""
    return dataclasses.replace(cfg, enabled=cfg.enabled or needed)


class DynamicLossScale:
    """The loss-scale state machine of torch.amp.GradScaler, as a plain object.

    In PS sync mode every shard runs one of these on the same sequence of rounds,
    so all shards (and through their pull replies, all workers) agree on the scale.
    """

    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scale = cfg.init_scale if cfg.enabled else 1.0
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one step: back off after an overflow, grow after enough clean steps."""
        if not self.cfg.enabled:
            return
        if overflow:
            self.scale *= self.cfg.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.clean_steps = 0


MAX_GROUPS = 1024
"""Parameter groups a job's optimizer may have (their learning rates travel in headers)."""


@dataclass(frozen=True, slots=True)
class StepOptions:
    """What a worker's own loop says about one step (worker/own_loop.py), known when its
    optimizer steps: in a push's header, or in the verdict of a push streamed during
    backward. The default says nothing: the job's schedule, no clipping."""

    lrs: tuple[float, ...] = ()
    """Each parameter group's learning rate for this step; empty: the job's schedule."""
    clip_norm: float = 0.0
    """> 0: clip the update to this global L2 norm (docs/own-loop.md, "Clipping"): the shards
    clip, and the DDP backend clips the averaged gradient."""
    grad_norm: float = 0.0
    """Modes without rounds: the L2 norm of the worker's whole unscaled gradient."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "lrs", tuple(float(x) for x in self.lrs))
        if len(self.lrs) > MAX_GROUPS:
            raise ValueError(f"step options: {len(self.lrs)} learning rates, at most {MAX_GROUPS}")
        for name, values in (("lrs", self.lrs), ("clip_norm", (self.clip_norm, self.grad_norm))):
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(
                    f"step options: {name} must be finite numbers >= 0, got {values}; "
                    "a non-finite gradient norm is an overflow (send overflow=true)"
                )

    @property
    def given(self) -> bool:
        return bool(self.lrs) or self.clip_norm > 0


# ---- staleness-aware updates (PS async / ssp; ps/server/modes/staleness.py applies them) ----


def async_momentum(momentum: float, num_workers: int) -> float:
    """The explicit momentum an async/ssp shard applies so the *total* matches `momentum`.

    Asynchrony is itself momentum: Mitliagkas et al. ("Asynchrony begets momentum", 2016)
    show that with N workers pushing in turn (each gradient computed on weights about N-1
    updates old) the expected update follows momentum SGD with an implicit momentum of
    1 - 1/N. The configured momentum, tuned for sync, comes on top of it: with 0.9 and 4
    workers the total is about 1.65 (> 1: the weights oscillate with growing amplitude,
    which is how the LM diverged, docs/results.md). The rule: explicit = max(0, momentum -
    (1 - 1/N)), so explicit + implicit is what sync applies (0.9 -> 0.15 for N = 4,
    0.4 for N = 2, unchanged for N = 1). Used for SGD's momentum and AdamW's beta1."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    return max(0.0, momentum - (1.0 - 1.0 / num_workers))


def staleness_lr_factor(staleness: int) -> float:
    """Staleness-aware learning rate (Zhang et al., "Staleness-aware Async-SGD", IJCAI
    2016): a gradient `staleness` updates old is applied with lr / (1 + staleness)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 / (1.0 + staleness)


def delay_compensate_(
    grad: torch.Tensor, lam: float, w_now: torch.Tensor, w_base: torch.Tensor
) -> torch.Tensor:
    """DC-ASGD (Zheng et al., ICML 2017), in place: g + lam * g * g * (w_now - w_base).

    A gradient g computed at w_base but applied at w_now is corrected by a first-order
    Taylor term, g(w_now) ~ g(w_base) + H (w_now - w_base), with the Hessian H
    approximated by lam * g g^T's diagonal (the paper's cheap, unbiased-in-expectation
    estimate of the Fisher information), element by element."""
    if lam:
        grad.addcmul_(grad * grad, w_now - w_base, value=lam)
    return grad


@dataclass(frozen=True, slots=True)
class StepAdjust:
    """Hyperparameters of one optimizer step that differ from the configured ones."""

    lr_scale: float = 1.0
    """Multiply every group's (scheduled) learning rate by this for this step."""
    momentum: float | None = None
    """SGD momentum / AdamW beta1 for this step (None: as configured)."""
    momenta: tuple[float, ...] = ()
    """Each group's momentum / beta1 for this step (overrides `momentum`; a user's own
    optimizer with groups of their own momenta)."""
    lrs: tuple[float, ...] = ()
    """Each group's learning rate for this step, before lr_scale (the worker's own LR
    scheduler, shipped with its push; worker/own_loop.py). Empty: the scheduled ones."""


@contextlib.contextmanager
def adjusted(optimizer: torch.optim.Optimizer, adjust: StepAdjust | None) -> Iterator[None]:
    """Run an optimizer step with `adjust` applied to its param groups, restored after
    (the scheduler and checkpoints see the configured values, never the adjusted ones)."""
    if adjust is None or (adjust.lr_scale == 1.0 and adjust.momentum is None and not adjust.lrs):
        yield
        return
    saved = [dict(g) for g in optimizer.param_groups]
    lrs = adjust.lrs or tuple(g["lr"] for g in optimizer.param_groups)
    momenta = adjust.momenta or (adjust.momentum,) * len(optimizer.param_groups)
    try:
        for g, lr, momentum in zip(optimizer.param_groups, lrs, momenta, strict=True):
            g["lr"] = lr * adjust.lr_scale
            if momentum is not None:
                if "betas" in g:
                    g["betas"] = (momentum, g["betas"][1])
                else:
                    g["momentum"] = momentum
        yield
    finally:
        for g, old in zip(optimizer.param_groups, saved, strict=True):
            for name in ("lr", "betas", "momentum"):
                if name in old:
                    g[name] = old[name]
