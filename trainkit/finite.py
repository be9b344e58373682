"""Finiteness of gradients: one fused check (and optional unscale) per device and dtype."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def all_finite(tensors: Iterable[torch.Tensor | None], *, unscale: float = 1.0) -> bool:
    """True if every tensor is free of inf/nan; with unscale != 1 also multiplies them by it.

    One fused pass (the kernel torch.amp.GradScaler uses) instead of isfinite().all()
    per tensor, which costs ~20x more on a CPU: it sits on every step's path.
    """
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel():
            by_device.setdefault((t.device, t.dtype), []).append(t)
    finite = True
    for (device, _), group in by_device.items():
        found = torch.zeros(1, device=device)
        inv = torch.full((1,), unscale, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        finite = finite and not bool(found.item())
    return finite


def all_finite_readonly(tensors: Iterable[torch.Tensor | None]) -> bool:
    """all_finite for tensors that must not be written (views of received bytes): the
    extremes of each tensor are finite exactly when all of it is (min and max propagate
    NaN; an inf is an extreme). ~7x cheaper than isfinite().all() on a CPU."""
    for t in tensors:
        if t is not None and t.numel():
            lo, hi = torch.aminmax(t)
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                return False
    return True
