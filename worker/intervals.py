"""Mean and 95% confidence interval of a few repeated measurements (`psar compare
--repeats N`), so a reader can tell a win from noise.

The interval is Student's t: mean +- t(0.975, N-1) x s / sqrt(N), s the sample standard
deviation. With N = 1 there is no spread to estimate: the half-width is None.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

__all__ = ["format_interval", "mean_interval", "t975"]

# Two-sided 95% quantiles of Student's t by degrees of freedom (df -> t_0.975).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000,
         120: 1.980}  # fmt: skip


def t975(df: int) -> float:
    """t(0.975, df); between table entries the smaller df's (wider: never optimistic)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    below = [d for d in _T975 if d <= df]
    return _T975[max(below)] if df <= 120 else 1.960


def mean_interval(values: Iterable[float | None]) -> tuple[float, float | None] | None:
    """(mean, 95% half-width) of the finite values; None when there are none, half-width
    None when there is only one."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, None
    return mean, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def _num(v: float, digits: int) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def format_interval(interval: tuple[float, float | None] | None, digits: int = 4) -> str:
    """`mean ± half-width` (the mean alone when there is no half-width; '-' for None)."""
    if interval is None:
        return "-"
    mean, half = interval
    return _num(mean, digits) if half is None else f"{_num(mean, digits)} ± {_num(half, 2)}"
