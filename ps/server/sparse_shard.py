"""A shard's sparse tables: create, pull rows, push row gradients.

Lives next to the dense ShardState (ps/server/shard.py) and reads its job (workers), live
set and update policy, but keeps its own lock, versions and clocks per table. What a
validated push does is the policy's decision: its `rows` (ps/server/sparse_policy.py)
holds sync pushes for a round, or applies async/ssp ones on arrival. Workers push rows
before their dense gradient of the same clock, so by the time a dense sync pull returns,
the table's round of that clock has closed too.

Every push is validated completely (ids, widths, finiteness) before anything changes.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ps.errors import FailedPrecondition, InvalidArgument, NotFound, quote
from ps.server.sparse_policy import RowPolicy
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
                f"no sparse table {quote(name)} on this shard (tables: {quote(sorted(self.tables))}); "
                "the worker of rank 0 creates them at start"
            )
        return t

    def _policy(self) -> tuple[RowPolicy, set[int], int]:
        """The shard's row policy, live set and number of workers, read under its lock."""
        st = self.state
        with st._cond:
            job = st._require_job()
            return st.policy.rows, set(st.live), job.num_workers

    # ---- pull -----------------------------------------------------------------------

    def pull(self, worker: int, name: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(table version, fp32 rows) for these global ids."""
        _, _, n = self._policy()
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
                f"PushRows table {quote(name)}: expected {p.ids.numel()} x {dim} gradient values, "
                f"got shape {tuple(p.grads.shape)} (wrong embedding width?)"
            )
        if not bool(torch.isfinite(p.grads).all()):
            raise InvalidArgument(
                f"PushRows table {quote(name)}: non-finite row gradient without the overflow flag",
                reason="nonfinite",
            )
        return t

    def push(self, name: str, p: RowPush) -> tuple[bool, bool, int, int]:
        """Returns (applied, already_applied, table version, staleness)."""
        rows, live, n = self._policy()
        if not 0 <= p.worker < n:
            raise InvalidArgument(f"worker {p.worker} not in [0, {n})", reason="bad_worker")
        with self._lock:
            t = self.check(p, name)
            key = (name, p.worker)
            if p.clock <= self.clocks.get(key, 0):
                return False, True, t.version, 0
            self.clocks[key] = p.clock
            applied, stale = rows.accept(self, name, t, p, live)
            return applied, False, t.version, stale

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
