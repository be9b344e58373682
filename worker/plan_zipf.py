"""Expected distinct rows a batch touches, for `psar plan`'s sparse tables.

The recsys workload draws ids from a bounded Zipf law (docs/sparse.md): the row of
popularity rank k (1..R) with probability p_k = k^-s / H(R, s), H(R, s) = sum_j j^-s.
Among n independent draws the expected number of distinct rows is exactly

    E[distinct] = sum over k of 1 - (1 - p_k)^n

(row k is touched unless all n draws miss it). Summed term by term that is R terms, too
slow in pure Python for a 50M-row table; the head (the hot rows, where the terms change
fastest) is summed exactly and the tail in geometric buckets whose ranks differ by a
factor of at most 1 + TAIL_STEP, each bucket's sum taken as its size times the term at
its geometric centre (both the normalizer H and E). Within a bucket k^-s changes by less
than s * TAIL_STEP, so the midpoint rule's error is of order (s * TAIL_STEP)^2: under
1e-6 relative at the defaults (tests/test_plan_sparse.py checks it against the exact
sum and a Monte-Carlo count). Pure Python, no torch: `psar plan --help` imports it.
"""

from __future__ import annotations

import math

#: Ranks summed term by term before the tail's buckets start.
HEAD = 4096
#: A tail bucket spans ranks [a, a * (1 + TAIL_STEP)).
TAIL_STEP = 1e-3


def _buckets(rows: int) -> list[tuple[float, int]]:
    """(representative rank, number of ranks) covering 1..rows: one per rank in the
    head, then geometric buckets."""
    out = [(float(k), 1) for k in range(1, min(rows, HEAD) + 1)]
    a = HEAD + 1
    while a <= rows:
        b = min(rows, max(a, int(a * (1 + TAIL_STEP)))) + 1  # ranks a .. b-1
        out.append((math.sqrt(a * (b - 1)), b - a))
        a = b
    return out


def expected_distinct(draws: float, rows: int, zipf: float) -> float:
    """Expected distinct rows among `draws` i.i.d. bounded-Zipf draws over `rows` rows
    (exponent `zipf` >= 0; 0 is uniform)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if zipf < 0 or not math.isfinite(zipf):
        raise ValueError(f"zipf exponent must be a finite number >= 0, got {zipf}")
    if draws <= 0:
        return 0.0
    if zipf == 0:  # uniform: every row alike
        return rows * -math.expm1(draws * math.log1p(-1 / rows)) if rows > 1 else 1.0
    buckets = _buckets(rows)
    norm = sum(c * k**-zipf for k, c in buckets)
    total = 0.0
    for k, c in buckets:
        p = k**-zipf / norm
        # 1 - (1 - p)^n without cancellation for tiny p (cold rows) or huge n.
        total += c * (-math.expm1(draws * math.log1p(-p)) if p < 1 else 1.0)
    return min(total, float(rows), draws)


def touched_rows(table_rows: tuple[int, ...], lookups: float, zipf: float) -> list[float]:
    """Expected distinct rows of each table touched by `lookups` draws per table."""
    return [expected_distinct(lookups, r, zipf) for r in table_rows]
