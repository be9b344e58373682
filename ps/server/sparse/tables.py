"""A shard's sparse tables: create, pull rows, push row gradients.

Lives next to the dense shard (ps/server/state.py) and reads its job (workers), live set
and update policy, but keeps its own lock, versions and clocks per table. What a
validated push does is the policy's decision: its `rows` (ps/server/modes/rows.py)
holds sync pushes for a round, or applies async/ssp ones on arrival. Workers push rows
before their dense gradient of the same clock, so by the time a dense sync pull returns,
the table's round of that clock has closed too (a hybrid job pushes no dense round: its
workers join among themselves once their rows are in, worker/hybrid.py).

Every push is validated completely (ids, widths, finiteness) before anything changes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

from psar.ps.errors import FailedPrecondition, InvalidArgument, NotFound, quote
from psar.ps.server.modes.rows import RowPolicy, RowPush
from psar.ps.server.sparse.table import SparseTable
from psar.ps.sparse_spec import TableSpec
from psar.trainkit.finite import all_finite_readonly

log = logging.getLogger("psar.sparse")


class TablesMismatch(ValueError):
    """A checkpoint's sparse tables do not fit the shard restoring it (a ValueError, so
    that `psar server --restore` exits non-zero with the message)."""


class DenseShard(Protocol):
    """What the tables read of their dense shard (ps/server/state.py): its lock, job, live
    set, rounds and update rule (whose `rows` decides what a row push does)."""

    cond: threading.Condition
    live: set[int]
    rounds: int
    policy: Any

    def require_job(self) -> Any: ...


class SparseTables:
    def __init__(self, state: DenseShard) -> None:
        self.state = state
        self.tables: dict[str, SparseTable] = {}
        self.specs: list[TableSpec] | None = None
        self.clocks: dict[tuple[str, int], int] = {}
        self.closed: dict[str, int] = {}
        """table -> the clock of its newest closed sync round (RowRounds)."""
        self.pending: dict[tuple[str, int], dict[int, RowPush]] = {}
        self.staleness: dict[str, Counter[int]] = {}
        self.skipped: Counter[str] = Counter()
        self.restored_from = ""
        """Set when the tables came from a checkpoint ("the checkpoint of step N")."""
        self.untabled_restore = ""
        """Set when the shard was restored from a checkpoint holding no sparse tables."""
        self._lock = threading.Lock()

    # ---- setup ----------------------------------------------------------------------

    def create(self, specs: list[TableSpec]) -> bool:
        """Create the tables; True if identical ones exist already (a retry)."""
        with self._lock:
            if self.specs is not None:
                if self.specs == specs:
                    return True
                raise FailedPrecondition(
                    f"sparse tables already created with a different spec "
                    f"({spec_diff(self.specs, specs)}); "
                    + (
                        f"this shard restored them from {self.restored_from}: start the job "
                        "with the tables that wrote it, or the shard without --restore"
                        if self.restored_from
                        else "restart the shard"
                    ),
                    reason="conflicting_init",
                )
            if self.untabled_restore:
                log.warning(
                    "sparse tables %s: this shard was restored from %s, which holds no "
                    "sparse tables (written before psar checkpointed them): they start "
                    "from their initial rows",
                    quote(sorted(s.name for s in specs)),
                    self.untabled_restore,
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

    def _policy(self) -> tuple[RowPolicy, set[int], int, int]:
        """The shard's row policy, live set, number of workers and rounds, read under its
        lock."""
        st = self.state
        with st.cond:
            job = st.require_job()
            return st.policy.rows, set(st.live), job.capacity, st.rounds

    # ---- pull -----------------------------------------------------------------------

    def pull(
        self,
        worker: int,
        name: str,
        ids: torch.Tensor,
        out: Callable[[int, int], torch.Tensor | None] | None = None,
    ) -> tuple[int, torch.Tensor]:
        """(table version, fp32 rows) for these global ids; `out(rows, dim)`, asked once
        the ids are checked, may give the fp32 tensor to gather them into."""
        _, _, n, _ = self._policy()
        if not 0 <= worker < n:
            raise InvalidArgument(f"worker {worker} not in [0, {n})", reason="bad_worker")
        with self._lock:
            t = self.table(name)
            idx = t.local_index(ids, what="PullRows")
            into = out(idx.numel(), t.spec.dim) if out is not None else None
            return t.version, t.gather(idx, into)

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
        if not all_finite_readonly([p.grads]):  # may be a view of received bytes
            raise InvalidArgument(
                f"PushRows table {quote(name)}: non-finite row gradient without the overflow flag",
                reason="nonfinite",
            )
        return t

    def push(self, name: str, p: RowPush) -> tuple[bool, bool, int, int]:
        """Returns (applied, already_applied, table version, staleness)."""
        return self.push_many([(name, p)])[0]

    def push_many(self, pushes: list[tuple[str, RowPush]]) -> list[tuple[bool, bool, int, int]]:
        """`push` for several tables (PushTables): all are checked, under the lock, before
        any is applied, so a bad one leaves every table as it was."""
        rows, live, n, rounds = self._policy()
        for _, p in pushes:
            if not 0 <= p.worker < n:
                raise InvalidArgument(f"worker {p.worker} not in [0, {n})", reason="bad_worker")
        with self._lock:
            tables = [self.check(p, name) for name, p in pushes]
            return [
                self._push_checked(name, t, p, rows, live, rounds)
                for (name, p), t in zip(pushes, tables, strict=True)
            ]

    def _push_checked(
        self, name: str, t: SparseTable, p: RowPush, rows: RowPolicy, live: set[int], rounds: int
    ) -> tuple[bool, bool, int, int]:
        """One checked push, under the lock."""
        # The table's own rounds count too: a hybrid job pushes no dense rounds.
        if rows.from_before_restore(p.clock, max(rounds, self.closed.get(name, 0))):
            # Sent before this shard was restored or rolled back, by a worker that has
            # not re-registered yet: its dense push of that clock is refused
            # (`restored`), so these rows are dropped without recording the clock.
            return False, True, t.version, 0
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

    # ---- checkpoints (ps/server/durability/durability.py) -------------------------

    def snapshot(self) -> dict[str, Any]:
        """A copy of every table (rows, optimizer state, version, counters) and of the
        workers' clocks, for a checkpoint (taken under the shard's lock, then this one's).

        A sync round still open is not in it: each of its pushers' clocks is set back to
        before it, so after a restore those workers push that round again."""
        with self._lock:
            tables = {
                name: {
                    **t.state_dict(),
                    "skipped": int(self.skipped[name]),
                    "staleness": {int(k): int(v) for k, v in self.staleness[name].items()},
                }
                for name, t in self.tables.items()
            }
            clocks = dict(self.clocks)
            for (name, clock), pushes in self.pending.items():
                for w in pushes:
                    clocks[(name, w)] = min(clocks[(name, w)], clock - 1)
            return {"tables": tables, "clocks": [[n, w, c] for (n, w), c in sorted(clocks.items())]}

    @staticmethod
    def parse(snap: dict[str, Any] | None, job: Any, where: str) -> dict[str, SparseTable]:
        """The tables of a checkpoint's "sparse" part, checked against its job (this
        shard's index and the number of shards) and their own specs; raises
        TablesMismatch naming `where`, the table and what differs."""
        out: dict[str, SparseTable] = {}
        for name, state in ((snap or {}).get("tables") or {}).items():
            try:
                spec = TableSpec(**state["spec"])
            except (TypeError, KeyError, ValueError) as e:
                raise TablesMismatch(f"{where}: sparse table {name!r}: bad spec ({e})") from None
            if (spec.shard_index, spec.num_shards) != (job.shard_index, job.num_shards):
                raise TablesMismatch(
                    f"{where}: sparse table {name!r} holds the rows of shard "
                    f"{spec.shard_index} of {spec.num_shards}, but the checkpoint's job is "
                    f"shard {job.shard_index} of {job.num_shards}; restore each shard from "
                    "its own checkpoints"
                )
            missing = [k for k in ("version", "skipped", "staleness") if k not in state]
            if missing:
                raise TablesMismatch(f"{where}: sparse table {name!r}: no {', '.join(missing)}")
            try:
                out[name] = SparseTable.from_state(spec, state, where=where)
            except ValueError as e:
                raise TablesMismatch(str(e)) from None
        return out

    def install(
        self,
        snap: dict[str, Any] | None,
        tables: dict[str, SparseTable],
        where: str,
        *,
        clocks_at: int | None = None,
    ) -> None:
        """Replace every table by `tables` (from parse) with the snapshot's counters;
        open rounds are dropped. Clocks: the snapshot's, or `clocks_at` for every worker
        (a sync rollback, as the dense clocks). snap None: a checkpoint written before
        tables were checkpointed; a later CreateTables warns that they start afresh."""
        with self._lock:
            self.pending.clear()
            self.closed.clear()  # the rounds are the restored dense ones again
            self.untabled_restore = "" if snap is not None else where
            if snap is None:
                return  # the tables (if any) stay as they are: the checkpoint cannot say
            parts = snap.get("tables") or {}
            self.tables = dict(tables)
            self.specs = [t.spec for t in tables.values()] if tables else None
            self.staleness = {
                n: Counter({int(k): int(v) for k, v in parts[n]["staleness"].items()})
                for n in tables
            }
            self.skipped = Counter({n: int(parts[n]["skipped"]) for n in tables})
            if clocks_at is None:
                self.clocks = {(str(n), int(w)): int(c) for n, w, c in snap.get("clocks", [])}
            else:
                n_workers = self.state.require_job().capacity
                self.clocks = {(n, w): clocks_at for n in tables for w in range(n_workers)}
            self.restored_from = where if tables else ""


def spec_diff(have: list[TableSpec], want: list[TableSpec]) -> str:
    """What differs between two lists of table specs, for an error message."""
    a, b = {s.name: s for s in have}, {s.name: s for s in want}
    out = [f"table {n!r} only on the shard" for n in sorted(a.keys() - b.keys())]
    out += [f"table {n!r} only in the request" for n in sorted(b.keys() - a.keys())]
    for n in sorted(a.keys() & b.keys()):
        d = [f"{k} {v!r} != {getattr(b[n], k)!r}" for k, v in vars(a[n]).items()
             if getattr(b[n], k) != v]  # fmt: skip
        out += [f"table {n!r}: {', '.join(d)} (shard != request)"] if d else []
    return "; ".join(out) or "same tables in another order"
