"""The optimizer's and the loss scale's settings: plain dataclasses, no torch.

Split from trainkit/optim.py (which builds the torch objects from them and re-exports
them) so that the config tree, and so `psar ... --help`, loads without torch."""

from __future__ import annotations

from dataclasses import dataclass

from psar.trainkit.cli_gen import everyday

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "warmup_cosine")
IMPLS = ("auto", "fused", "foreach", "loop")
"""torch's implementations of an optimizer's step (`--optimizer-impl`): `fused` (one
kernel per tensor doing the whole update), `foreach` (each elementwise op over a list of
tensors), `loop` (torch's per-parameter path, foreach=False). They differ in the last bits
(fused AdamW vs loop: ~2.4e-7), so both architectures build from the same choice."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer that updates the fp32 master weights."""

    name: str = everyday("sgd")
    """Optimizer: sgd | adamw."""
    lr: float = everyday(0.05)
    """Peak learning rate."""
    momentum: float = everyday(0.9)
    """SGD momentum (0 disables it)."""
    nesterov: bool = False
    """SGD: use Nesterov momentum (needs momentum > 0)."""
    weight_decay: float = everyday(0.0)
    """Weight decay (decoupled for adamw, L2 for sgd, as torch does)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: str = everyday("constant")
    """Learning-rate schedule: constant | warmup_cosine (linear warm-up, then cosine decay)."""
    warmup_steps: int = everyday(0)
    """warmup_cosine: number of updates of linear warm-up."""
    total_steps: int = 0
    """warmup_cosine: number of updates over which the cosine decays (0: use the run's steps)."""
    min_lr_ratio: float = 0.0
    """warmup_cosine: final learning rate as a fraction of lr."""
    impl: str = "auto"
    """torch's implementation of the step: auto | fused | foreach | loop. auto: fused
    where this torch has the fused kernel of the optimizer for the device it runs on (the
    shards' CPU, a DDP rank's device), else loop. PS and DDP train the same bits under
    each choice; the choices differ from each other in the last bits."""

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(
                f"--optimizer-impl: unknown {self.impl!r}; accepted: {', '.join(IMPLS)}"
            )
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer: unknown {self.name!r}; accepted: {', '.join(OPTIMIZERS)}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"--schedule: unknown {self.schedule!r}; accepted: {', '.join(SCHEDULES)}"
            )
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ValueError("--momentum and --weight-decay must be >= 0")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("--nesterov needs --momentum > 0")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("--warmup-steps and --total-steps must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling with torch.amp.GradScaler's semantics and defaults."""

    enabled: bool = False
    """Scale the loss (needed for fp16 gradients; bf16 and fp32 need none)."""
    init_scale: float = 2.0**16
    """Starting scale."""
    growth_factor: float = 2.0
    """Multiply the scale by this after growth_interval clean steps."""
    backoff_factor: float = 0.5
    """Multiply the scale by this after a step with inf/nan gradients (that step is skipped)."""
    growth_interval: int = 2000
    """Clean steps between growths."""

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError("need growth_factor > 1 and 0 < backoff_factor < 1")
        if self.growth_interval < 1:
            raise ValueError("growth_interval must be >= 1")
