"""A shard's durability: checkpoints, restore, rollback and draining (a component of the
shard, ps/server/shard.py; the files themselves are ps/server/durability/checkpoints.py's).

- Checkpoints are taken at steps that are multiples of --checkpoint-every (the step is
  the round in sync mode, the version otherwise), after init (step 0), by the interval
  timer (async/ssp) and on SIGTERM. The snapshot is taken under the shard's lock and
  written by ps/server/durability/checkpoints.py's background writer.
- `restore` turns a fresh shard into the one a checkpoint describes (--restore DIR),
  its sparse tables included (ps/server/sparse/tables.py: snapshot, parse, install).
- `rollback` (sync) goes back to an older checkpoint of this shard, so that every shard
  of the job continues from the same round (docs/reliability.md).
- `drain` (SIGTERM) refuses new pushes but lets the sync round in flight finish (the
  intake refuses them, ps/server/intake/intake.py).
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch

from psar.ps import serde
from psar.ps.errors import FailedPrecondition
from psar.ps.job import Job
from psar.ps.server.durability import checkpoints
from psar.ps.server.membership.ledger import DataLedger, ledger_for
from psar.ps.server.sparse.tables import SparseTables, TablesMismatch
from psar.ps.server.state import ShardData
from psar.ps.server.update.buffers import IntBufferLog
from psar.ps.server.update.updates import Updates

log = logging.getLogger("psar.shard")


def new_incarnation() -> int:
    """A random non-zero 63-bit id (0 on the wire means "do not check")."""
    return secrets.randbits(63) or 1


class Durability:
    """Checkpoint, restore, rollback and drain (see the module docstring). `started`: what
    the shard does once it holds a job (init or restore): leases, metrics, waiters.
    `forget`: drop what other components cached of the state a restore replaces."""

    def __init__(
        self,
        data: ShardData,
        updates: Updates,
        *,
        started: Callable[[Job], None],
        forget: Callable[[], None],
    ) -> None:
        self.data = data
        self.updates = updates
        self._started = started
        self._forget = forget

    @property
    def round_in_flight(self) -> bool:
        """sync: some worker has pushed for the open round."""
        d = self.data
        return d.policy.round_in_flight() if d.job is not None and d.policy else False

    @property
    def checkpoint_step(self) -> int:
        """What checkpoints are numbered by: the round (modes in rounds: every shard then
        checkpoints the same rounds) or the version."""
        d = self.data
        return d.rounds if d.job is not None and d.traits.rounds else d.version

    def maybe_checkpoint(self, force: bool = False) -> None:
        """Under the lock, after an update or a round: a checkpoint if one is due."""
        d = self.data
        m, job = d.checkpoints, d.job
        if m is None or job is None:
            return
        step = self.checkpoint_step
        if force or m.due(step, rounds=d.traits.rounds):
            m.submit(step, self.snapshot())

    def checkpoint_now(self, reason: str, *, wait: bool = False) -> bool:
        """Checkpoint the current state (interval timer, SIGTERM). In sync mode only a
        final (wait=True) checkpoint is taken off the round grid."""
        d = self.data
        with d.cond:
            m, job = d.checkpoints, d.job
            if m is None or job is None or (d.traits.rounds and not wait):
                return False
            step = self.checkpoint_step
            if not wait and step == m.last_step:
                return False
            snap = self.snapshot()
        log.info("checkpoint (%s) at step %d", reason, step)
        if wait:
            m.write_now(step, snap)
        else:
            m.submit(step, snap)
        return True

    # ---- what goes in a checkpoint ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the shard's state (call under the shard's lock)."""
        d = self.data
        job = d.job
        assert job is not None
        self.updates.policy.settle(self.updates)  # per-chunk rounds: no slot of an open round
        sparse = d.sparse
        return {
            "format": checkpoints.FORMAT,
            "job": serde.job_to_pb(job).SerializeToString(),
            "step": self.checkpoint_step,
            "time": time.time(),
            "masters": {k: p.detach().clone() for k, p in d.masters.items()},
            "optimizer": copy.deepcopy(d.optimizer.state_dict()),
            "scheduler": copy.deepcopy(d.scheduler.state_dict()),
            "loss_scale": [float(d.loss_scale.scale), int(d.loss_scale.clean_steps)],
            "counters": {
                "version": d.version,
                "rounds": d.rounds,
                "updates_applied": d.updates_applied,
                "skipped_rounds": d.skipped_rounds,
                "last_round_skipped": d.last_round_skipped,
                "dropped_nonfinite": d.dropped_nonfinite,
                "max_clock_gap": d.max_clock_gap,
                "restores": d.restores,
            },
            "clocks": list(d.clocks),
            # Integer buffers as int64 tensors, so the checksums cover them too.
            "int_buffers": {
                str(c): {
                    "worker": w,
                    "values": {k: torch.tensor(v, dtype=torch.int64) for k, v in vals.items()},
                }
                for c, (w, vals) in d.int_buffers.by_clock.items()
            },
            "live": sorted(d.live),
            "left": sorted(d.left),
            "staleness": {int(k): int(v) for k, v in d.staleness_counts.items()},
            # Sparse tables (ps/server/sparse/tables.py): rows, per-row optimizer state,
            # versions and clocks; their tensors get checksums like every other one.
            "sparse": sparse.snapshot() if sparse is not None else {"tables": {}, "clocks": []},
            # Elastic data (shard 0): the batch ids dealt, consumed and left to deal.
            "ledger": d.ledger.state() if d.ledger is not None else {},
        }

    def _load(self, snap: dict[str, Any]) -> None:
        """Put a snapshot's masters, optimizer, schedule, loss scale and counters into the
        shard (under its lock; data.job must already be the snapshot's job)."""
        d = self.data
        job = d.job
        assert job is not None
        masters = {
            s.key: torch.nn.Parameter(snap["masters"][s.key].clone().reshape(-1)) for s in job.slots
        }
        self.updates.install(job, masters)
        d.optimizer.load_state_dict(snap["optimizer"])
        d.scheduler.load_state_dict(snap["scheduler"])
        d.loss_scale.scale, d.loss_scale.clean_steps = snap["loss_scale"]
        c = snap["counters"]
        d.version, d.rounds = int(c["version"]), int(c["rounds"])
        d.updates_applied, d.skipped_rounds = int(c["updates_applied"]), int(c["skipped_rounds"])
        d.last_round_skipped = bool(c["last_round_skipped"])
        d.dropped_nonfinite, d.max_clock_gap = int(c["dropped_nonfinite"]), int(c["max_clock_gap"])
        d.staleness_counts.clear()
        d.staleness_counts.update(snap["staleness"])
        # A checkpoint written before integer buffers existed has none: workers keep theirs.
        d.int_buffers = IntBufferLog.for_job(job)
        for clock, e in sorted(snap.get("int_buffers", {}).items(), key=lambda kv: int(kv[0])):
            values = {k: tuple(int(x) for x in t.tolist()) for k, t in e["values"].items()}
            d.int_buffers.put(int(clock), int(e["worker"]), values)
        saved = snap.get("ledger")  # a file written before elastic data has none
        d.ledger = DataLedger.from_state(saved) if saved else ledger_for(job)
        self._forget()

    def _settle_ledger(self) -> None:
        """After a restore or rollback: what the checkpoint had dealt to workers that are
        no longer live goes back to the pool (their deals would never be pushed)."""
        d = self.data
        if d.ledger is not None:
            for w in [w for w in d.ledger.deals if w not in d.live]:
                d.ledger.give_back(w)

    # ---- restore and rollback --------------------------------------------------------------

    def restore(self, step: int, snap: dict[str, Any]) -> None:
        """Become the shard a checkpoint describes (psar server --restore)."""
        d = self.data
        with d.cond:
            if d.job is not None:
                raise FailedPrecondition("restore: this shard is already initialised")
            job = checkpoints.job_of(snap)
            where = f"the checkpoint of step {step}"
            # Checked before anything changes: TablesMismatch stops `psar server`.
            tables = SparseTables.parse(snap.get("sparse"), job, where)
            job = d.modes.serve(job)  # with its mode's traits (a file may predate them)
            d.job = job
            self._load(snap)
            if d.sparse is None:
                d.sparse = SparseTables(d)  # the sparse servicer takes this one
            d.sparse.install(snap.get("sparse"), tables, where)
            d.clocks = [int(c) for c in snap["clocks"]]
            d.live = set(snap["live"])
            d.left = set(snap["left"])
            self._settle_ledger()
            d.restores = int(snap["counters"]["restores"]) + 1
            d.restored_step = step
            d.restored_pending = d.traits.rounds  # every shard must follow it back
            if d.checkpoints is not None:
                d.checkpoints.last_step = step
            self._started(job)
            d.metrics.shard_restored()

    def rollback(self, max_round: int) -> dict[str, Any]:
        """sync: go back to the newest checkpoint at a round <= max_round, keeping the
        live set and leases; every worker's clock becomes that round."""
        d = self.data
        with d.cond:
            job = d.require_job()
            if not d.traits.rounds:
                raise FailedPrecondition("rollback is for sync mode only", reason="malformed")
            if d.rounds <= max_round:
                return self._rollback_reply(False)
            if d.checkpoints is None:
                raise FailedPrecondition(
                    f"cannot roll back to round {max_round}: this shard writes no checkpoints "
                    "(sync-mode restores need --checkpoint-dir on every shard)",
                    reason="no_checkpoint",
                )
            found = d.checkpoints.newest(max_step=max_round)
            if found is None:
                raise FailedPrecondition(
                    f"cannot roll back to round {max_round}: no checkpoint at or before it",
                    reason="no_checkpoint",
                )
            step, snap = found
            where = f"the checkpoint of step {step}"
            try:
                tables = SparseTables.parse(snap.get("sparse"), job, where)
            except TablesMismatch as e:
                raise FailedPrecondition(f"cannot roll back: {e}", reason="no_checkpoint") from e
            log.warning("rolling back from round %d to round %d", d.rounds, step)
            self._load(snap)
            d.clocks = [d.rounds] * job.capacity
            if d.sparse is not None:
                d.sparse.install(snap.get("sparse"), tables, where, clocks_at=d.rounds)
            d.joining.clear()
            self._settle_ledger()
            d.checkpoints.discard_after(step)
            d.restores += 1
            d.restored_step = step
            d.restored_pending = True  # other shards may still have to follow
            d.incarnation = new_incarnation()
            d.metrics.shard_restored()
            d.metrics.set_version(d.version)
            d.metrics.set_loss_scale(d.loss_scale.scale)
            d.cond.notify_all()
            return self._rollback_reply(True)

    def _rollback_reply(self, rolled_back: bool) -> dict[str, Any]:
        d = self.data
        return {
            "rounds": d.rounds,
            "version": d.version,
            "incarnation": d.incarnation,
            "rolled_back": rolled_back,
        }

    # ---- shutting down -----------------------------------------------------------------------

    def drain(self) -> None:
        """Shutting down: refuse new pushes, let the sync round in flight finish."""
        with self.data.cond:
            self.data.draining = True
            self.data.cond.notify_all()

    def wait_drained(self, timeout: float) -> bool:
        """Wait until no sync round is in flight (or the timeout); returns whether so."""
        with self.data.cond:
            return self.data.cond.wait_for(lambda: not self.round_in_flight, timeout)
