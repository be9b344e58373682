"""A worker's bounded cache of a sparse table's hot rows (issue #46 item 2).

Under Zipf ids the head of a table (a few hundred rows) is in nearly every batch of every
worker, so each step pulls it again. The cache keeps up to `capacity` of those rows on
the worker and serves them for up to `staleness` steps after the step that pulled them;
every other row is pulled fresh, as without a cache. Rows are only ever read from the
cache: the gradients of every row the batch touched are pushed as before, so the shards'
tables get every update (a cached row is simply read `staleness` steps late at most, the
bounded-staleness contract SSP makes for whole models).

Refresh: the cache is filled all at once, from the step's own pull, when it is empty or
older than the bound: the `capacity` rows the batch named most often (its multiplicities:
the Zipf head names its rows many times in one batch, cold rows once), so refilling costs
no extra bytes. Between refreshes the batch's rows that are cached are hits.

`staleness` 0 is exact: a row is never served from the cache (a row pulled at a step may
be changed by that step's round), so a run with the cache at 0 is the same bits as one
without (tests/test_hot_rows.py holds it). Hot rows are the ones every round changes, so
an exact cache would have nothing to save; the saving comes with a bound of 1 or more.

Pure logic over tensors (no client): ps/client/sparse_worker.py asks it which rows to
pull and hands it what came back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CacheCounts:
    """What a cache served: rows looked up, rows served from it, bytes not pulled."""

    lookups: int = 0
    hits: int = 0
    bytes_saved: int = 0

    def add(self, other: CacheCounts) -> None:
        self.lookups += other.lookups
        self.hits += other.hits
        self.bytes_saved += other.bytes_saved

    def as_dict(self) -> dict[str, float | int]:
        rate = self.hits / self.lookups if self.lookups else 0.0
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": round(rate, 6),
            "bytes_saved": self.bytes_saved,
        }


class HotRowCache:
    """One table's hot rows on one worker (module docstring). `row_bytes`: what one
    row costs to pull (its values in the wire dtype and its 8-byte id), for bytes_saved."""

    def __init__(self, capacity: int, staleness: int, row_bytes: int) -> None:
        if capacity < 0 or staleness < 0:
            raise ValueError("a hot-row cache needs capacity >= 0 and staleness >= 0")
        self.capacity = capacity
        self.staleness = staleness
        self.row_bytes = row_bytes
        self.ids = torch.empty(0, dtype=torch.int64)
        """The cached ids, sorted (searchsorted finds a batch's rows among them)."""
        self.rows: torch.Tensor | None = None
        self.versions: list[int] = []
        """The table's version on each shard when the cached rows were pulled."""
        self.filled_at = -1
        """The step whose pull filled the cache (-1: never)."""
        self.counts = CacheCounts()

    @property
    def serves(self) -> bool:
        """Whether it may ever serve a row (a capacity and a bound of one step or more)."""
        return self.capacity > 0 and self.staleness > 0

    def fresh_at(self, step: int) -> bool:
        """Whether the cached rows may be served at `step` (within the bound)."""
        return self.serves and self.filled_at >= 0 and step - self.filled_at <= self.staleness

    def lookup(self, ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For unique `ids` at `step`: (a bool mask of the ids served from the cache, their
        rows in the order of ids[mask]); the rest are to be pulled."""
        self.counts.lookups += ids.numel()
        if not self.fresh_at(step) or not self.ids.numel() or not ids.numel():
            return torch.zeros(ids.numel(), dtype=torch.bool), None
        pos = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        hit = self.ids[pos] == ids
        n = int(hit.sum())
        self.counts.hits += n
        self.counts.bytes_saved += n * self.row_bytes
        assert self.rows is not None
        return hit, self.rows[pos[hit]]

    def offer(
        self,
        step: int,
        ids: torch.Tensor,
        rows: torch.Tensor,
        named: torch.Tensor,
        versions: list[int],
    ) -> None:
        """The step's pull came back with every row of unique `ids` (`rows`, fresh, as
        the cache was not fresh), `named` times each in the batch: refill the cache with
        the most named, up to its capacity."""
        if not self.serves or self.fresh_at(step):
            return
        k = min(self.capacity, ids.numel())
        # Ties by id (stable sort of the ids first): every worker with the same batch
        # keeps the same rows, and a rerun the same.
        top = torch.sort(named, descending=True, stable=True).indices[:k]
        keep = torch.sort(ids[top])  # new tensors: values and indices
        self.ids = keep.values
        self.rows = rows[top[keep.indices]]  # one gather, a copy of its own
        self.versions = list(versions)
        self.filled_at = step

    def clear(self) -> None:
        """Forget every row (the shards' tables were restored or rolled back)."""
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows = None
        self.filled_at = -1
