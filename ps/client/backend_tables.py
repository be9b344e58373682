"""PSBackend's steps for a job whose dense part is not the shards' (--arch hybrid,
worker/hybrid.py): the shards hold only the sparse tables, so a step is every table's row
push for the next clock, and no dense round at all.

The dense round of --arch ps does three things for the tables, which such a job does
itself, through the collective its dense part runs anyway:

- *Reads that see the round.* A dense sync pull returns once its round has closed, so
  the next row pull sees the table round of that clock closed too. Without one, the
  job's workers must have every worker's rows of clock c on the shards before any of
  them pulls the rows of c + 1 (`reads_wait`: sync rounds, and SSP at a bound of 0):
  a worker whose row push has been answered joins a collective that ends only once
  every worker's has (the shards close a table round before they answer its last push).
- *The overflow verdict.* A sync round with an overflow anywhere is skipped on every
  shard; the same collective carries each worker's overflow, so every worker learns the
  shards' verdict and skips its dense step with them.
- *The loss scale.* Every worker keeps one (`settle`), moved by that verdict: the same
  on every worker where the verdict is shared; its own elsewhere (async, SSP >= 1), as under
  --arch ps. Row pushes carry it, so the shards divide out whichever scale was used.

Async and SSP at a bound of 1 or more need no wait: the dense collective already keeps
the workers within one clock of each other, and a worker joins it only after its rows of
the clock before were answered. Saved: a round slot's push and pull per shard and step
(2 of a step's 4 round trips and 8 of a shard's 12 frames: docs/results.md).
"""

from __future__ import annotations

import time
from typing import Any

from psar.trainkit.backend import StepOutcome


class TablesOnly:
    """The tables' side of a step without a dense round. `backend`: the PSBackend whose
    sparse side, clock and loss scale it works on (typed Any, as its other parts)."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    @property
    def reads_wait(self) -> bool:
        """Must every worker's rows of a clock be on the shards before any worker pulls
        the next clock's rows (the module docstring)? The shards' mode says: in rounds
        (sync), or a staleness bound of 0."""
        t = self.b.traits
        return t.rounds or (t.staleness == "bounded" and self.b.job_staleness == 0)

    def step(self, finite: bool) -> StepOutcome:
        """Push every table's rows for the next clock; `finite`: whether the rest of this
        worker's gradient (its dense part) is. `skipped`: this worker's overflow, rows or
        dense (the job's verdict is the caller's to form, then `settle`)."""
        b = self.b
        t0 = time.perf_counter()
        rows_finite = b.sparse.push(b.clock + 1, finite, b.loss_scale)
        b.clock += 1
        b.pushed = b.clock
        cache = b.sparse.take_cache_counts()
        return StepOutcome(
            skipped=not rows_finite,
            loss_scale=b.loss_scale,
            staleness=b.sparse.pushed_staleness,
            phases={"push": time.perf_counter() - t0},
            cache_lookups=cache.lookups,
            cache_hits=cache.hits,
            cache_bytes_saved=cache.bytes_saved,
        )

    def settle(self, overflow: bool) -> float:
        """The step's verdict moves the loss scale (backs off on an overflow, grows after
        a run of good steps); returns the scale the next step uses."""
        b = self.b
        b._local_scale.update(overflow=overflow)
        b.loss_scale = b._local_scale.scale
        return b.loss_scale
