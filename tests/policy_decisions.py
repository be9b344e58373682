"""The policy contract's second half: the decisions that moved behind UpdatePolicy.

`DecisionContract` is a base of tests/test_policy_contract.py's `PolicyContract`, so every
suite there (sync, chunked sync, async, ssp; Flower's StateTest pattern) runs these too.
Each test drives a real ShardState and checks what the mode promises (`PROMISES`) for one
decision: what closes a round, how checkpoints are numbered and when they fall, rollback,
restore, rejoining, how a pull's wait is recorded, pull views, an unflagged non-finite
gradient, draining, and sparse-table rows. tests/test_mode_wall.py keeps these decisions
inside the policy modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from psar.ps.errors import FailedPrecondition, InvalidArgument, Unavailable
from psar.ps.server.durability.checkpoints import CheckpointManager, list_checkpoints
from psar.ps.server.membership.membership import TooLate
from psar.ps.server.metrics.recorder import NullShardRecorder
from psar.ps.server.modes import Modes
from psar.ps.server.shard import ShardState
from psar.ps.server.sparse.tables import RowPush, SparseTables
from psar.ps.sparse_spec import TableSpec
from tests.ps_fixtures import grad_for, init_values, pull, push, weights_digest


@dataclass(frozen=True)
class Promises:
    rounds: bool
    """Updates come in rounds every live worker joins: see UpdatePolicy.rounds."""
    pull_wait: str | None
    """The ShardMetrics method a released pull's wait goes to (None: not recorded)."""
    shard_loss_scale: bool = False
    """The shard owns the job's loss scale (it backs off on a skipped round)."""


PROMISES = {
    "sync": Promises(rounds=True, pull_wait="barrier_wait", shard_loss_scale=True),
    "async": Promises(rounds=False, pull_wait=None),
    "ssp": Promises(rounds=False, pull_wait="ssp_wait"),
    # sync rounds of pseudo-gradients; the workers keep the loss scale of their inner steps
    "local": Promises(rounds=True, pull_wait="barrier_wait"),
}


class WaitRecorder(NullShardRecorder):
    """Metrics that remember which pull-wait series was observed."""

    def __init__(self) -> None:
        self.waits: list[str] = []

    def barrier_wait(self, seconds: float) -> None:
        self.waits.append("barrier_wait")

    def ssp_wait(self, seconds: float) -> None:
        self.waits.append("ssp_wait")


class DecisionContract:
    """Mixed into PolicyContract, which provides mode, job/setup/new_state/push_clock."""

    mode: str
    chunk_rounds: bool
    modes: Modes
    job: Any
    setup: Any
    new_state: Any
    push_clock: Any

    @property
    def promises(self) -> Promises:
        """What the suite's mode promises (a mode of one's own overrides this)."""
        return PROMISES[self.mode]

    def _with_checkpoints(self, tmp_path: Path, **kw: Any) -> tuple[ShardState, Any]:
        job = self.job("sgd")
        st = ShardState(
            modes=self.modes,
            checkpoints=CheckpointManager(tmp_path, **kw),
            chunk_rounds=self.chunk_rounds,
        )
        st.init(job, init_values(job))
        return st, job

    def test_an_update_closes_a_round_only_in_rounds(self) -> None:
        st, job, _ = self.setup("sgd")
        self.push_clock(st, job, 1)
        n = job.num_workers
        assert (st.rounds, st.version) == ((1, 1) if self.promises.rounds else (0, n))
        assert st.traits.rounds == self.promises.rounds

    def test_checkpoints_are_numbered_and_placed_as_the_mode_says(self, tmp_path: Path) -> None:
        st, job = self._with_checkpoints(tmp_path, every=2)
        self.push_clock(st, job, 1)
        base = st.version
        for w in sorted(st.live):  # worker 0 overflows: sync skips the round, async drops it
            g = None if w == 0 else grad_for(job, w, 2)
            push(st, worker=w, clock=2, base_version=base, grads=g, overflow=w == 0)
        step = st.durability.checkpoint_step
        assert step == (st.rounds if self.promises.rounds else st.version)
        if self.promises.rounds:
            assert (st.rounds, st.version) == (2, 1)  # the skipped round is counted
        st.checkpoints.flush()
        assert [s for s, _ in list_checkpoints(tmp_path, 0)] == list(range(0, step + 1, 2))
        # Off the grid (interval timer): only where checkpoints need not line up.
        assert st.durability.checkpoint_now("interval") is (not self.promises.rounds)
        assert st.durability.checkpoint_now("shutdown", wait=True) is True  # the final one: always
        st.checkpoints.close()

    def test_rollback_only_in_rounds(self, opt: str, tmp_path: Path) -> None:
        job = self.job(opt)
        values = init_values(job)
        st = ShardState(
            modes=self.modes,
            checkpoints=CheckpointManager(tmp_path, every=1),
            chunk_rounds=self.chunk_rounds,
        )
        st.init(job, values)
        for clock in (1, 2):
            self.push_clock(st, job, clock)
        st.checkpoints.flush()
        if not self.promises.rounds:
            before = st.state_digest()
            with pytest.raises(FailedPrecondition, match="sync mode only"):
                st.durability.rollback(1)
            assert st.state_digest() == before
        else:
            assert (
                st.durability.rollback(1)["rolled_back"] and st.rounds == 1 and st.restored_pending
            )
            once = self.new_state(job, values)
            self.push_clock(once, job, 1)
            assert weights_digest(st) == weights_digest(once)
        st.checkpoints.close()

    def test_a_restored_shard_asks_its_peers_to_follow_only_in_rounds(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        self.push_clock(st, job, 1)
        with st.cond:
            snap = st.durability.snapshot()
        back = ShardState(modes=self.modes, chunk_rounds=self.chunk_rounds)
        back.durability.restore(st.durability.checkpoint_step, snap)
        assert back.restored_pending is self.promises.rounds
        assert back.members.register(0, 1, query=True)["restored"] is self.promises.rounds
        assert back.state_digest() == st.state_digest()

    def test_a_rejoining_worker_enters_where_the_mode_says(self) -> None:
        st, job, _ = self.setup("sgd")
        for clock in (1, 2):
            self.push_clock(st, job, clock)
        if self.promises.rounds:  # only at a round boundary still ahead
            with pytest.raises(TooLate):
                st.members.register(0, 1)
            assert st.members.register(0, 2)["live"]
        else:  # at once, never moving its clock back
            reply = st.members.register(0, 1)
            assert reply["live"] and reply["clock"] == 2

    def test_a_pull_wait_is_recorded_as_the_mode_says(self) -> None:
        job = self.job("sgd")
        st = ShardState(modes=self.modes, metrics=WaitRecorder(), chunk_rounds=self.chunk_rounds)
        st.init(job, init_values(job))
        self.push_clock(st, job, 1)
        pull(st, 0, 1, timeout=1.0)
        want = [self.promises.pull_wait] if self.promises.pull_wait else []
        assert st.metrics.waits == want

    def test_pull_views_only_where_weights_stand_still(self) -> None:
        st, job, _ = self.setup("sgd")
        _, pieces = st.pulls.pull(0, 0, torch.float32, 1.0, views=True)
        kinds = {type(data) for _, _, data in pieces}
        assert kinds == ({memoryview} if self.promises.rounds else {bytes})
        # Another dtype is a cast: a copy of its own, sent as views of it (no second copy),
        # which a change of the masters never reaches; gRPC (views=False) gets bytes.
        _, pieces = st.pulls.pull(0, 0, torch.bfloat16, 1.0, views=True)
        assert {type(data) for _, _, data in pieces} == {memoryview}
        before = [bytes(data) for _, _, data in pieces]
        with torch.no_grad():
            for p in st.masters.values():
                p.add_(1.0)
        assert [bytes(data) for _, _, data in pieces] == before
        _, pieces = st.pulls.pull(0, 0, torch.bfloat16, 1.0, views=False)
        assert {type(data) for _, _, data in pieces} == {bytes}

    def test_unflagged_nonfinite_is_refused_in_rounds_dropped_otherwise(self) -> None:
        st, job, _ = self.setup("sgd")
        g = {k: t * float("nan") for k, t in grad_for(job, 0, 1).items()}
        before = st.state_digest()
        if self.promises.rounds:  # every shard must skip the round: the worker must say so
            with pytest.raises(InvalidArgument, match="non-finite") as e:
                push(st, worker=0, clock=1, base_version=0, grads=g)
            assert e.value.reason == "nonfinite" and st.state_digest() == before
        else:  # dropped and counted; the worker moves on
            outcome, _, _ = push(st, worker=0, clock=1, base_version=0, grads=g)
            assert outcome.dropped_nonfinite and st.dropped_nonfinite == 1 and st.clocks[0] == 1
        assert weights_digest(st) == weights_digest(self.new_state(job))

    def test_draining_lets_only_the_round_in_flight_finish(self) -> None:
        st, job, _ = self.setup("sgd")
        push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        assert st.durability.round_in_flight is self.promises.rounds
        st.durability.drain()
        if self.promises.rounds:
            for w in range(1, job.num_workers):
                push(st, worker=w, clock=1, base_version=0, grads=grad_for(job, w, 1))
            assert st.rounds == 1 and not st.durability.round_in_flight
            assert st.durability.wait_drained(0.0)
        else:
            with pytest.raises(Unavailable, match="draining"):
                push(st, worker=1, clock=1, base_version=1, grads=grad_for(job, 1, 1))
            assert st.durability.wait_drained(0.0)

    def test_sparse_rows_follow_the_policy(self) -> None:
        st, job, _ = self.setup("sgd")
        tables = SparseTables(st)
        tables.create([TableSpec(name="emb", rows=16, dim=4, optimizer="sgd", lr=0.5)])
        t = tables.tables["emb"]
        w0 = t.weight.clone()
        n = job.num_workers
        for w in range(n):  # every worker pushes row 3; worker w's gradient is w + 1
            grads = torch.full((1, 4), float(w + 1))
            applied, dup, version, stale = tables.push(
                "emb", RowPush(w, 1, 0, False, torch.tensor([3]), grads)
            )
            assert applied and not dup
            if self.promises.rounds:  # the round waits for every live worker
                assert version == (1 if w == n - 1 else 0) and stale == 0
            else:  # applied on arrival, each a version later than it was pulled at
                assert version == w + 1 and stale == w
        total = sum(range(1, n + 1))
        step = total / n if self.promises.rounds else total
        torch.testing.assert_close(t.weight[3], w0[3] - 0.5 * step)
        assert torch.equal(t.weight[4:], w0[4:]) and not tables.pending
