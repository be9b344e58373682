"""Checkpoints, restore, rollback and draining of a ShardState (a mixin; ps/server/shard.py).

- Checkpoints are taken at steps that are multiples of --checkpoint-every (the step is
  the round in sync mode, the version otherwise), after init (step 0), by the interval
  timer (async/ssp) and on SIGTERM. The snapshot is taken under the shard's lock and
  written by ps/server/checkpoint.py's background writer.
- `restore` turns a fresh shard into the one a checkpoint describes (--restore DIR),
  its sparse tables included (ps/server/sparse_shard.py: snapshot, parse, install).
- `rollback` (sync) goes back to an older checkpoint of this shard, so that every shard
  of the job continues from the same round (docs/reliability.md).
- `drain` (SIGTERM) refuses new pushes but lets the sync round in flight finish.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ps.errors import FailedPrecondition, Unavailable
from ps.server import checkpoint
from ps.server.membership import new_incarnation
from ps.server.sparse_shard import SparseTables, TablesMismatch

if TYPE_CHECKING:
    from ps.server.shard import ShardState

log = logging.getLogger("psar.shard")


class Recovery:
    """Checkpoint, restore, rollback and drain (see the module docstring)."""

    @property
    def round_in_flight(self: ShardState) -> bool:
        """sync: some worker has pushed for the open round."""
        return self.policy.round_in_flight() if self.job is not None else False

    def _check_draining(self: ShardState, clock: int) -> None:
        """Draining: only pushes that finish the sync round already in flight get in."""
        if self.draining and not (self.round_in_flight and clock == self.rounds + 1):
            raise Unavailable("draining: this shard is shutting down; retry after its restart")

    @property
    def checkpoint_step(self: ShardState) -> int:
        """What checkpoints are numbered by: the round (sync) or the version (the policy's
        choice)."""
        return self.policy.checkpoint_step(self) if self.job is not None else self.version

    def _maybe_checkpoint(self: ShardState, force: bool = False) -> None:
        m, job = self.checkpoints, self.job
        if m is None or job is None:
            return
        step = self.checkpoint_step
        if force or m.due(step, rounds=self.policy.rounds):
            m.submit(step, checkpoint.snapshot(self))

    def checkpoint_now(self: ShardState, reason: str, *, wait: bool = False) -> bool:
        """Checkpoint the current state (interval timer, SIGTERM). In sync mode only a
        final (wait=True) checkpoint is taken off the round grid."""
        with self._cond:
            m, job = self.checkpoints, self.job
            if m is None or job is None or (self.policy.rounds and not wait):
                return False
            step = self.checkpoint_step
            if not wait and step == m.last_step:
                return False
            snap = checkpoint.snapshot(self)
        log.info("checkpoint (%s) at step %d", reason, step)
        if wait:
            m.write_now(step, snap)
        else:
            m.submit(step, snap)
        return True

    def restore(self: ShardState, step: int, snap: dict[str, Any]) -> None:
        """Become the shard a checkpoint describes (psar server --restore)."""
        with self._cond:
            if self.job is not None:
                raise FailedPrecondition("restore: this shard is already initialised")
            job = checkpoint.job_of(snap)
            where = f"the checkpoint of step {step}"
            # Checked before anything changes: TablesMismatch stops `psar server`.
            tables = SparseTables.parse(snap.get("sparse"), job, where)
            self.job = job
            checkpoint.load_tensors(self, snap)
            if getattr(self, "sparse", None) is None:
                self.sparse = SparseTables(self)  # the sparse servicer takes this one
            self.sparse.install(snap.get("sparse"), tables, where)
            self.clocks = [int(c) for c in snap["clocks"]]
            self.live = set(snap["live"])
            self.left = set(snap["left"])
            self.restores = int(snap["counters"]["restores"]) + 1
            self.restored_step = step
            self.restored_pending = self.policy.rounds  # every shard must follow it back
            if self.checkpoints is not None:
                self.checkpoints.last_step = step
            self._started(self.job)
            self.metrics.shard_restored()

    def rollback(self: ShardState, max_round: int) -> dict[str, Any]:
        """sync: go back to the newest checkpoint at a round <= max_round, keeping the
        live set and leases; every worker's clock becomes that round."""
        with self._cond:
            job = self._require_job()
            if not self.policy.rounds:
                raise FailedPrecondition("rollback is for sync mode only", reason="malformed")
            if self.rounds <= max_round:
                return self._rollback_reply(False)
            if self.checkpoints is None:
                raise FailedPrecondition(
                    f"cannot roll back to round {max_round}: this shard writes no checkpoints "
                    "(sync-mode restores need --checkpoint-dir on every shard)",
                    reason="no_checkpoint",
                )
            found = self.checkpoints.newest(max_step=max_round)
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
            log.warning("rolling back from round %d to round %d", self.rounds, step)
            checkpoint.load_tensors(self, snap)
            self.clocks = [self.rounds] * job.num_workers
            if getattr(self, "sparse", None) is not None:
                self.sparse.install(snap.get("sparse"), tables, where, clocks_at=self.rounds)
            self.joining.clear()
            self.checkpoints.discard_after(step)
            self.restores += 1
            self.restored_step = step
            self.restored_pending = True  # other shards may still have to follow
            self.incarnation = new_incarnation()
            self.metrics.shard_restored()
            self.metrics.set_version(self.version)
            self.metrics.set_loss_scale(self.loss_scale.scale)
            self._cond.notify_all()
            return self._rollback_reply(True)

    def _rollback_reply(self: ShardState, rolled_back: bool) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "version": self.version,
            "incarnation": self.incarnation,
            "rolled_back": rolled_back,
        }

    def drain(self: ShardState) -> None:
        """Shutting down: refuse new pushes, let the sync round in flight finish."""
        with self._cond:
            self.draining = True
            self._cond.notify_all()

    def wait_drained(self: ShardState, timeout: float) -> bool:
        """Wait until no sync round is in flight (or the timeout); returns whether so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.round_in_flight, timeout)
