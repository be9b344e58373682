"""The sparse tables' row rules: how a table's row pushes become row updates.

Each mode's UpdatePolicy (ps/server/modes/) names one of these as its `rows`, so a sparse
table follows the dense rule of its shard and never compares mode names itself; a row rule
sees only the tables' open rounds, clocks and counters (`TableRounds`):

- `RowRounds` (sync): a table's round for clock c closes when every live worker has
  pushed its rows for c (an empty push counts). The round's mean gradient (the workers'
  row gradients, fp32, in worker-rank order, divided by the number that pushed) is
  applied then (SparseTable.apply_mean: an SGD table steps each worker's rows at
  lr / pushers in rank order, the others sum first and step once). A round in which any worker overflowed is
  skipped (the table's version still moves on, as the dense round count does).
- `RowsOnArrival` (async, ssp): each push is applied on arrival (SSP's bound is enforced
  by the dense pull). Staleness = table version at apply - version the rows were pulled at.

Both are stateless: the open rounds, counters and clocks stay in SparseTables
(ps/server/sparse/tables.py), so a policy replaced by a restore loses nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from psar.ps.server.sparse.table import SparseTable


@dataclass
class RowPush:
    """One worker's validated row gradients of one table for one clock."""

    worker: int
    clock: int
    base_version: int
    overflow: bool
    ids: torch.Tensor
    grads: torch.Tensor
    """fp32 (n, dim), loss scale already divided out."""


class TableRounds(Protocol):
    """What a row rule may change of a shard's tables (ps/server/sparse/tables.py holds them)."""

    pending: dict[tuple[str, int], dict[int, RowPush]]
    """(table, clock) -> the pushes of a round still open, by worker."""
    clocks: dict[tuple[str, int], int]
    """(table, worker) -> the newest clock pushed."""
    closed: dict[str, int]
    """table -> the clock of its newest closed round (sync)."""
    skipped: Counter[str]
    staleness: dict[str, Counter[int]]


class RowPolicy(ABC):
    """Takes a validated row push of one table (called under the tables' lock)."""

    @abstractmethod
    def accept(
        self, tables: TableRounds, name: str, t: SparseTable, p: RowPush, live: set[int]
    ) -> tuple[bool, int]:
        """Returns (accepted, staleness); `live` is the shard's live set at the push."""

    def from_before_restore(self, clock: int, rounds: int) -> bool:
        """Is a push of `clock` one sent before this shard was restored or rolled back
        (at round `rounds`: the dense rounds, or the table's own where they are further,
        as in a hybrid job, whose shards see no dense round), to be dropped? Only rounds
        can tell."""
        return False


class RowsOnArrival(RowPolicy):
    """Apply every push at once; an overflowing push is skipped (and counted)."""

    def accept(
        self, tables: TableRounds, name: str, t: SparseTable, p: RowPush, live: set[int]
    ) -> tuple[bool, int]:
        if p.overflow:
            tables.skipped[name] += 1
            return False, 0
        stale = max(0, t.version - p.base_version)
        t.apply(p.ids // t.spec.num_shards, p.grads)
        tables.staleness[name][stale] += 1
        return True, stale


class RowRounds(RowPolicy):
    """Hold pushes per (table, clock); close rounds in clock order once every live worker
    has pushed, as the mean in worker-rank order."""

    def accept(
        self, tables: TableRounds, name: str, t: SparseTable, p: RowPush, live: set[int]
    ) -> tuple[bool, int]:
        tables.pending.setdefault((name, p.clock), {})[p.worker] = p
        # Rounds close in clock order; an older one still open closes here once the
        # live set has shrunk to its pushers (a worker's lease ran out mid-round), or
        # once the workers missing from it have pushed a later clock: their rows of it
        # died with a shard that was then restored (the worker re-pushes only the dense
        # gradient of the round the crash lost, ps/client/backend_resync.py).
        for key in sorted(k for k in tables.pending if k[0] == name):
            moved_on = {w for w in live if tables.clocks.get((name, w), 0) > key[1]}
            if not live <= set(tables.pending[key]) | moved_on:
                break
            self._close(tables, t, name, key[1])
        return True, 0

    def from_before_restore(self, clock: int, rounds: int) -> bool:
        # A worker pushes the rows of clock c after its pull of round c - 1 returned (a
        # hybrid worker: after every worker's rows of c - 1 were in, worker/hybrid.py),
        # so a later clock was sent to this shard before a restore or rollback took it back.
        return clock > rounds + 1

    def _close(self, tables: TableRounds, t: SparseTable, name: str, clock: int) -> None:
        rnd = tables.pending.pop((name, clock))
        tables.closed[name] = clock
        if any(q.overflow for q in rnd.values()):
            tables.skipped[name] += 1
            t.version += 1
            return
        order = [rnd[w] for w in sorted(rnd)]
        s = t.spec.num_shards
        t.apply_mean([(q.ids // s, q.grads) for q in order])
        tables.staleness[name][0] += 1
