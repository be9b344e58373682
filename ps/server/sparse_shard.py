"""A shard's sparse tables: create, pull rows, push row gradients, per consistency mode.

Lives next to the dense ShardState (ps/server/shard.py) and reads its job (mode, workers) and
live set, but keeps its own lock, versions and clocks per table.

- **sync**: a table's round for clock c closes when every live worker has pushed its
  rows for c (an empty push counts). The row gradients are summed per row in fp32 in
  worker-rank order and divided by the number of workers that pushed, exactly as the
  dense round does, then applied once. Workers push rows before their dense gradient
  of the same clock, so by the time a dense sync pull returns, the table's round of
  that clock has closed too. A round in which any worker overflowed is skipped.
- **async / ssp**: each push is applied on arrival (SSP's bound is enforced by the
  dense pull). Staleness = table version at apply - version the rows were pulled at.

Every push is validated completely (ids, widths, finiteness) before anything changes.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ps.errors import FailedPrecondition, InvalidArgument, NotFound
from ps.server.sparse_table import SparseTable
from ps.sparse_spec import TableSpec


@dataclass
class RowPush:
    worker: int
    clock: int
    base_version: int
    overflow: bool
    ids: torch.Tensor
    grads: torch.Tensor
    """fp32 (n, dim), loss scale already divided out."""


class SparseTables:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.tables: dict[str, SparseTable] = {}
        self.specs: list[TableSpec] | None = None
        self.clocks: dict[tuple[str, int], int] = {}
        self.pending: dict[tuple[str, int], dict[int, RowPush]] = {}
        self.staleness: dict[str, Counter[int]] = {}
        self.skipped: Counter[str] = Counter()
        self._lock = threading.Lock()

    # ---- setup ----------------------------------------------------------------------

    def create(self, specs: list[TableSpec]) -> bool:
        """Create the tables; True if identical ones exist already (a retry)."""
        with self._lock:
            if self.specs is not None:
                if self.specs == specs:
                    return True
                raise FailedPrecondition(
                    "sparse tables already created with a different spec; restart the shard",
                    reason="conflicting_init",
                )
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise InvalidArgument(f"sparse tables: duplicate table names {names}")
            self.tables = {s.name: SparseTable(s) for s in specs}
            self.staleness = {s.name: Counter() for s in specs}
            self.specs = list(specs)
            return False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def table(self, name: str) -> SparseTable:
        t = self.tables.get(name)
        if t is None:
            raise NotFound(
                f"no sparse table {name!r} on this shard (tables: {sorted(self.tables)}); "
                "the worker of rank 0 creates them at start"
            )
        return t

    def _mode(self) -> tuple[str, set[int], int]:
        st = self.state
        with st._cond:
            job = st._require_job()
            return job.mode, set(st.live), job.num_workers

    # ---- pull -----------------------------------------------------------------------

    def pull(self, worker: int, name: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(table version, fp32 rows) for these global ids."""
        _, _, n = self._mode()
        if not 0 <= worker < n:
            raise InvalidArgument(f"worker {worker} not in [0, {n})", reason="bad_worker")
        with self._lock:
            t = self.table(name)
            idx = t.local_index(ids, what="PullRows")
            return t.version, t.gather(idx)

    # ---- push -----------------------------------------------------------------------

    def check(self, p: RowPush, name: str) -> SparseTable:
        """Validate a push without changing anything; returns its table."""
        t = self.table(name)
        if p.overflow:
            return t
        t.local_index(p.ids, what="PushRows")
        dim = t.spec.dim
        if p.grads.dim() != 2 or p.grads.shape != (p.ids.numel(), dim):
            raise InvalidArgument(
                f"PushRows table {name!r}: expected {p.ids.numel()} x {dim} gradient values, "
                f"got shape {tuple(p.grads.shape)} (wrong embedding width?)"
            )
        if not bool(torch.isfinite(p.grads).all()):
            raise InvalidArgument(
                f"PushRows table {name!r}: non-finite row gradient without the overflow flag",
                reason="nonfinite",
            )
        return t

    def push(self, name: str, p: RowPush) -> tuple[bool, bool, int, int]:
        """Returns (applied, already_applied, table version, staleness)."""
        mode, live, n = self._mode()
        if not 0 <= p.worker < n:
            raise InvalidArgument(f"worker {p.worker} not in [0, {n})", reason="bad_worker")
        with self._lock:
            t = self.check(p, name)
            key = (name, p.worker)
            if p.clock <= self.clocks.get(key, 0):
                return False, True, t.version, 0
            idx = p.ids // t.spec.num_shards
            self.clocks[key] = p.clock
            if mode != "sync":
                if p.overflow:
                    self.skipped[name] += 1
                    return False, False, t.version, 0
                stale = max(0, t.version - p.base_version)
                t.apply(idx, p.grads)
                self.staleness[name][stale] += 1
                return True, False, t.version, stale
            rnd = self.pending.setdefault((name, p.clock), {})
            rnd[p.worker] = p
            # Rounds close in clock order; an older one still open closes here once the
            # live set has shrunk to its pushers (a worker's lease ran out mid-round).
            for key in sorted(k for k in self.pending if k[0] == name):
                if not live <= set(self.pending[key]):
                    break
                self._close(t, name, key[1])
            return True, False, t.version, 0

    def _close(self, t: SparseTable, name: str, clock: int) -> None:
        rnd = self.pending.pop((name, clock))
        if any(q.overflow for q in rnd.values()):
            self.skipped[name] += 1
            t.version += 1
            return
        order = [rnd[w] for w in sorted(rnd)]
        ids = torch.cat([q.ids for q in order])
        grads = torch.cat([q.grads for q in order])
        uniq, inv = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(uniq.numel(), t.spec.dim).index_add_(0, inv, grads)
        summed.div_(len(order))
        t.apply(uniq // t.spec.num_shards, summed)
        self.staleness[name][0] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                name: {
                    "version": t.version,
                    "bytes": t.nbytes,
                    "skipped": self.skipped[name],
                    "staleness_histogram": dict(sorted(self.staleness[name].items())),
                }
                for name, t in self.tables.items()
            }
