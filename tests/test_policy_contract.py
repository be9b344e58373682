"""One contract for every consistency mode, driving ShardState directly (no socket).

`PolicyContract` holds the tests every mode must pass; `TestSyncContract`,
`TestAsyncContract` and `TestSSPContract` run them once per mode (Flower's StateTest
pattern) and add what only that mode promises. Each test runs with SGD (momentum) and
AdamW so optimizer state exists and must stay untouched by refused requests.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch

from psar.ps.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from psar.ps.job import Job
from psar.ps.server.modes import BUILTIN, Modes
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import LossScaleConfig
from tests import drop_stale_mode
from tests.policy_decisions import DecisionContract, Promises
from tests.ps_fixtures import (
    OPTIMIZERS,
    assert_weights_equal,
    grad_for,
    init_values,
    make_job,
    make_state,
    masters,
    mean_in_rank_order,
    optimizer_config,
    pull,
    push,
    reference_weights,
    weights_digest,
    without_speculation,
)

Grads = dict[str, torch.Tensor]


class PolicyContract(DecisionContract):
    """Behaviour every update policy must show. Subclasses set `mode`. The decisions that
    moved behind UpdatePolicy (rounds, checkpoints, rollback, rejoining, pull waits and
    views, draining, sparse rows) come from DecisionContract (tests/policy_decisions.py)."""

    mode: str = ""
    staleness: int = 0
    num_workers: int = 3
    chunk_rounds: bool = False
    modes: Modes = BUILTIN
    """The registry the suite's shards serve from (a mode of one's own: BUILTIN and it)."""

    @pytest.fixture(params=OPTIMIZERS)
    def opt(self, request: pytest.FixtureRequest) -> str:
        return request.param

    # ---- helpers ----------------------------------------------------------------------

    def job(self, opt: str, **kw: object) -> Job:
        kw.setdefault("num_workers", self.num_workers)
        kw.setdefault("staleness", self.staleness)
        return make_job(self.mode, optimizer=opt, **kw)  # type: ignore[arg-type]

    def setup(self, opt: str, **kw: object) -> tuple[ShardState, Job, Grads]:
        job = self.job(opt, **kw)
        values = init_values(job)
        return self.new_state(job, values), job, values

    def new_state(self, job: Job, values: Grads | None = None) -> ShardState:
        return make_state(job, values, chunk_rounds=self.chunk_rounds, modes=self.modes)

    def push_clock(self, st: ShardState, job: Job, clock: int) -> dict[int, Grads]:
        """Every live worker pushes `clock`, from the weights it would have pulled."""
        sent = {}
        base = st.version
        for w in sorted(st.live):
            sent[w] = grad_for(job, w, clock)
            push(st, worker=w, clock=clock, base_version=base, grads=sent[w])
        return sent

    def updates_for(self, rounds: list[dict[int, Grads]]) -> list[Grads]:
        """The optimizer steps a correct shard applies for these pushes (in push order)."""
        if self.promises.rounds:  # local: rounds of pseudo-gradients
            return [mean_in_rank_order(r) for r in rounds]
        return [g for r in rounds for g in r.values()]

    # ---- refused requests change nothing ------------------------------------------------

    def test_unknown_worker_refused(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        before = st.state_digest()
        with pytest.raises(InvalidArgument, match="not in this job"):
            push(st, worker=job.num_workers, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        with pytest.raises(InvalidArgument, match="not in this job"):
            pull(st, job.num_workers, 0)
        with pytest.raises(InvalidArgument, match="not in this job"):
            st.members.leave(job.num_workers + 5)
        assert st.state_digest() == before

    def test_duplicate_clock_refused_retry_acknowledged(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        g = grad_for(job, 0, 1)
        outcome, _, already = push(st, worker=0, clock=1, base_version=0, grads=g)
        assert outcome.applied and not already
        before, stats = st.state_digest(), st.stats()
        with pytest.raises(FailedPrecondition, match="duplicate") as e:
            push(st, worker=0, clock=1, base_version=0, grads=g)
        assert e.value.reason == "duplicate"
        assert st.state_digest() == before
        # The same push re-sent because its reply was lost: acknowledged, never re-applied,
        # whatever bytes it carries.
        for grads in (g, grad_for(job, 0, 99)):
            outcome, version, already = push(
                st, worker=0, clock=1, base_version=0, grads=grads, retry=True
            )
            assert already and not outcome.applied
            assert version == st.version == stats["version"]
        assert st.state_digest() == before
        assert without_speculation(st.stats()) == without_speculation(stats)

    @pytest.mark.parametrize("clock", [0, 2, 7])
    @pytest.mark.parametrize("retry", [False, True])
    def test_out_of_order_clock_refused(self, opt: str, clock: int, retry: bool) -> None:
        st, job, _ = self.setup(opt)
        before = st.state_digest()
        with pytest.raises((FailedPrecondition, InvalidArgument), match="clock"):
            push(st, worker=1, clock=clock, base_version=0, grads=grad_for(job, 1, 1), retry=retry)
        assert st.state_digest() == before
        assert st.clocks == [0] * job.num_workers
        # The worker's lock was released: the right clock goes through.
        outcome, _, _ = push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))
        assert outcome.applied

    def test_incomplete_or_oversized_push_refused(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        g = grad_for(job, 0, 1)
        before = st.state_digest()
        with pytest.raises(InvalidArgument, match="incomplete"):
            push(st, worker=0, clock=1, base_version=0, grads=g, skip_keys=["w#1"])
        short = {k: (t[:-1] if k == "b#0" else t) for k, t in g.items()}
        with pytest.raises(InvalidArgument, match="incomplete"):
            push(st, worker=0, clock=1, base_version=0, grads=short)
        long = {k: (torch.cat([t, t[:1]]) if k == "b#0" else t) for k, t in g.items()}
        with pytest.raises(InvalidArgument, match="holds"):
            push(st, worker=0, clock=1, base_version=0, grads=long)
        assert st.state_digest() == before
        assert st.clocks[0] == 0
        outcome, _, _ = push(st, worker=0, clock=1, base_version=0, grads=g)
        assert outcome.applied and st.clocks[0] == 1

    def test_requests_before_init_refused(self, opt: str) -> None:
        st = ShardState()
        job = self.job(opt)
        before = st.state_digest()
        with pytest.raises(FailedPrecondition, match="not initialised") as e:
            push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        assert e.value.reason == "not_initialized"
        with pytest.raises(FailedPrecondition, match="not initialised"):
            pull(st, 0, 0, timeout=0.01)
        with pytest.raises(FailedPrecondition, match="not initialised"):
            st.members.leave(0)
        assert not st.initialized and st.state_digest() == before

    def test_identical_reinit_acknowledged_conflicting_refused(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        before = st.state_digest()
        # A retried init (rank 0 never saw the reply) is acknowledged and changes nothing.
        assert st.init(self.job(opt), values) is True
        assert st.state_digest() == before
        other_mode = "async" if self.mode == "sync" else "sync"
        conflicting = [
            self.job(opt, job_id="another run"),
            self.job(opt, num_workers=job.num_workers + 1),
            make_job(other_mode, optimizer=opt, num_workers=job.num_workers),
            self.job(optimizer_config(opt, lr=0.5)),
        ]
        for other in conflicting:
            with pytest.raises(FailedPrecondition, match="different job") as e:
                st.init(other, values)
            assert e.value.reason == "conflicting_init"
        assert st.state_digest() == before

    def test_left_worker_cannot_push(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        last = job.num_workers - 1
        assert st.members.leave(last) == job.num_workers - 1
        assert st.members.leave(last) == job.num_workers - 1  # leaving twice is harmless
        before = st.state_digest()
        with pytest.raises(FailedPrecondition, match="left") as e:
            push(st, worker=last, clock=1, base_version=0, grads=grad_for(job, last, 1))
        assert e.value.reason == "left"
        assert st.state_digest() == before

    # ---- what accepted pushes do --------------------------------------------------------

    def test_pull_after_everyone_pushed_returns_new_weights(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        header0, w0 = pull(st, 0, 0)
        assert header0.version == 0
        assert_weights_equal(w0, values)
        sent = self.push_clock(st, job, 1)
        want = reference_weights(job, values, self.updates_for([sent]))
        for w in range(job.num_workers):
            header, got = pull(st, w, 1, timeout=1.0)
            assert header.version == st.version
            assert header.dtype == torch.float32
            assert_weights_equal(got, want)
        assert_weights_equal(masters(st), want)
        assert not any(torch.equal(want[k], values[k]) for k in values)

    def test_version_counts_optimizer_updates(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        rounds = []
        for clock in (1, 2, 3):
            rounds.append(self.push_clock(st, job, clock))
            pull(st, 0, clock, timeout=1.0)
        steps = self.updates_for(rounds)
        assert st.version == st.updates_applied == len(steps)
        assert st.scheduler.last_epoch == len(steps)
        if opt == "adamw":
            for p in st.masters.values():
                assert int(st.optimizer.state[p]["step"]) == len(steps)
        else:
            assert all("momentum_buffer" in st.optimizer.state[p] for p in st.masters.values())
        assert_weights_equal(masters(st), reference_weights(job, values, steps))
        assert st.stats()["version"] == len(steps)

    def test_concurrent_workers_keep_exact_counts(self, opt: str) -> None:
        """Workers on their own threads, as gRPC handler threads drive a shard: nothing is
        lost or counted twice, sync ends bit-identical to one-at-a-time pushes, and SSP
        never answers a pull more than S clocks ahead of the slowest worker."""
        clocks = 4
        job = self.job(opt)
        values = init_values(job)
        st = self.new_state(job, values)

        def worker(w: int) -> None:
            version = 0
            for c in range(1, clocks + 1):
                g = grad_for(job, w, c)
                push(st, worker=w, clock=c, base_version=version, grads=g, piece_elems=2)
                version = pull(st, w, c, timeout=30.0)[0].version

        with ThreadPoolExecutor(job.num_workers) as ex:
            for fut in [ex.submit(worker, w) for w in range(job.num_workers)]:
                fut.result(timeout=60.0)
        assert st.clocks == [clocks] * job.num_workers
        if self.promises.rounds:
            one_at_a_time = self.new_state(job, values)
            for c in range(1, clocks + 1):
                self.push_clock(one_at_a_time, job, c)
            assert st.state_digest() == one_at_a_time.state_digest()
        else:
            n = job.num_workers * clocks
            assert st.version == st.updates_applied == n
            assert sum(st.stats()["staleness_histogram"]) == n
        if self.mode == "ssp":
            assert st.max_clock_gap <= self.staleness

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_loss_scale_is_divided_out(self, opt: str, dtype: torch.dtype) -> None:
        scale = 2.0**10
        scaled, job, _ = self.setup(opt)
        plain, _, _ = self.setup(opt)
        for clock in (1, 2):
            base = scaled.version
            for w in range(job.num_workers):
                g = grad_for(job, w, clock)
                s = {k: t * scale for k, t in g.items()}
                push(
                    scaled,
                    worker=w,
                    clock=clock,
                    base_version=base,
                    grads=s,
                    dtype=dtype,
                    loss_scale=scale,
                )
                push(plain, worker=w, clock=clock, base_version=base, grads=g, dtype=dtype)
        assert plain.version > 0
        assert scaled.state_digest() == plain.state_digest()


# ---- sync -------------------------------------------------------------------------------


class TestSyncContract(PolicyContract):
    mode = "sync"
    num_workers = 4

    @pytest.mark.parametrize(
        "orders",
        [
            [(0, 1, 2, 3), (3, 2, 1, 0)],
            [(2, 0, 3, 1), (1, 3, 0, 2)],
            [(3, 1, 0, 2), (0, 2, 3, 1)],
        ],
        ids=["fwd-rev", "shuffle1", "shuffle2"],
    )
    def test_arrival_order_does_not_change_the_bits(self, opt: str, orders: list) -> None:
        job = self.job(opt)
        values = init_values(job)
        digests, rounds = set(), []
        for order in [tuple(range(self.num_workers)), *orders]:
            st = self.new_state(job, values)
            rounds = []
            for clock in (1, 2):
                base, sent = st.version, {}
                for w in order:
                    sent[w] = grad_for(job, w, clock)
                    outcome, _, _ = push(
                        st, worker=w, clock=clock, base_version=base, grads=sent[w]
                    )
                    assert outcome.applied and outcome.staleness == 0
                rounds.append(sent)
                pull(st, order[0], clock, timeout=1.0)
            digests.add(st.state_digest())
        assert len(digests) == 1
        assert_weights_equal(masters(st), reference_weights(job, values, self.updates_for(rounds)))

    def test_round_closes_only_when_every_live_worker_pushed(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        sent = {}
        for w in range(job.num_workers):
            assert st.rounds == 0 and st.version == 0
            assert weights_digest(st) == weights_digest(self.new_state(job, values))
            if w:
                with pytest.raises(DeadlineExceeded, match="waited"):
                    pull(st, 0, 1, timeout=0.01)
            sent[w] = grad_for(job, w, 1)
            push(st, worker=w, clock=1, base_version=0, grads=sent[w])
        assert st.rounds == 1 and st.version == 1
        header, got = pull(st, 0, 1, timeout=1.0)
        assert header.rounds == 1 and not header.last_round_skipped
        assert_weights_equal(got, reference_weights(job, values, [mean_in_rank_order(sent)]))
        # The next round wants clock 2 from weights of version 1, nothing else.
        with pytest.raises(FailedPrecondition, match="version"):
            push(st, worker=0, clock=2, base_version=0, grads=sent[0])
        with pytest.raises(FailedPrecondition, match="clock"):
            push(st, worker=0, clock=3, base_version=1, grads=sent[0])

    @pytest.mark.parametrize("scaling", [False, True], ids=["fixed-scale", "dynamic-scale"])
    def test_overflow_skips_the_round(self, opt: str, scaling: bool) -> None:
        ls = LossScaleConfig(enabled=scaling, init_scale=2.0**10, growth_interval=2)
        st, job, values = self.setup(opt, loss_scale=ls)
        # Where the shards own the loss scale (sync) it backs off on the skipped round;
        # where the workers keep their own (local SGD's inner steps) the shard has none.
        scaling = scaling and self.promises.shard_loss_scale
        scale0 = 2.0**10 if scaling else 1.0
        assert st.loss_scale.scale == scale0
        # One clean round first, so optimizer state exists and must survive the skip.
        self.push_clock(st, job, 1)
        pull(st, 0, 1, timeout=1.0)
        before_w, before_v = weights_digest(st), st.version
        for w in (2, 0, 3, 1):  # the flag arrives in the middle
            if w == 3:
                push(st, worker=w, clock=2, base_version=before_v, overflow=True)
            else:
                push(st, worker=w, clock=2, base_version=before_v, grads=grad_for(job, w, 2))
        assert weights_digest(st) == before_w
        assert (st.version, st.rounds, st.skipped_rounds) == (before_v, 2, 1)
        assert st.updates_applied == before_v
        header, _ = pull(st, 1, 2, timeout=1.0)
        assert header.last_round_skipped and header.skipped_rounds == 1
        halved = scale0 / 2 if scaling else 1.0
        assert header.loss_scale == st.loss_scale.scale == halved
        # growth_interval clean rounds later the scale doubles back.
        for clock in (3, 4):
            self.push_clock(st, job, clock)
            header, _ = pull(st, 0, clock, timeout=1.0)
            assert not header.last_round_skipped
            assert header.loss_scale == (halved if clock == 3 or not scaling else scale0)
        assert (st.version, st.rounds, st.skipped_rounds) == (before_v + 2, 4, 1)

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
    def test_nonfinite_without_overflow_flag_refused(self, opt: str, bad: float) -> None:
        st, job, _ = self.setup(opt)
        push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))
        before, stats = st.state_digest(), st.stats()
        g = grad_for(job, 0, 1)
        g["w#1"][2] = bad
        with pytest.raises(InvalidArgument, match="non-finite") as e:
            push(st, worker=0, clock=1, base_version=0, grads=g)
        assert e.value.reason == "nonfinite"
        # Finite bytes that overflow once the loss scale is divided out count too.
        huge = {k: torch.full_like(t, 3e38) for k, t in grad_for(job, 0, 1).items()}
        with pytest.raises(InvalidArgument, match="non-finite"):
            push(st, worker=0, clock=1, base_version=0, grads=huge, loss_scale=0.5)
        assert st.state_digest() == before
        assert without_speculation(st.stats()) == without_speculation(stats)
        outcome, _, _ = push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        assert outcome.applied

    def test_staleness_is_always_zero(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        for clock in (1, 2, 3):
            base = st.version
            for w in range(job.num_workers):
                outcome, _, _ = push(
                    st, worker=w, clock=clock, base_version=base, grads=grad_for(job, w, clock)
                )
                assert outcome.staleness == 0
            pull(st, 0, clock, timeout=1.0)
        assert st.stats()["staleness_histogram"] == [3 * job.num_workers]
        assert st.max_clock_gap == 0

    @pytest.mark.parametrize("who_pushed", [(0, 1, 2), (0, 1, 2, 3)], ids=["never", "after"])
    def test_leaving_worker_lets_the_round_close(self, opt: str, who_pushed: tuple) -> None:
        st, job, values = self.setup(opt)
        sent = {}
        for w in who_pushed:
            sent[w] = grad_for(job, w, 1)
            push(st, worker=w, clock=1, base_version=0, grads=sent[w])
        if len(who_pushed) == job.num_workers:
            # Everyone pushed: the round closed; the last worker then leaves.
            assert st.rounds == 1
            st.members.leave(3)
        else:
            assert st.rounds == 0
            assert st.members.leave(3) == job.num_workers - 1
            assert st.rounds == 1
        # Mean over those who pushed.
        assert_weights_equal(
            masters(st), reference_weights(job, values, [mean_in_rank_order(sent)])
        )
        # The next round closes with the remaining three.
        nxt = self.push_clock(st, job, 2)
        assert sorted(nxt) == [0, 1, 2] and st.rounds == 2
        want = reference_weights(job, values, [mean_in_rank_order(sent), mean_in_rank_order(nxt)])
        assert_weights_equal(pull(st, 2, 2, timeout=1.0)[1], want)

    def test_worker_that_pushed_then_left_is_counted(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        sent = {3: grad_for(job, 3, 1)}
        push(st, worker=3, clock=1, base_version=0, grads=sent[3])
        st.members.leave(3)
        assert st.rounds == 0
        for w in (0, 1, 2):
            sent[w] = grad_for(job, w, 1)
            push(st, worker=w, clock=1, base_version=0, grads=sent[w])
        assert st.rounds == 1
        assert_weights_equal(
            masters(st), reference_weights(job, values, [mean_in_rank_order(sent)])
        )


class TestChunkedSyncContract(TestSyncContract):
    """Sync with per-chunk rounds (psar server --chunk-rounds): every sync promise holds,
    bit for bit; tests/test_chunk_rounds.py covers what only it does (early slots, undo)."""

    chunk_rounds = True


class TestLocalContract(TestSyncContract):
    """--mode local (ps/server/modes/local.py): pushes are pseudo-gradients and the job's
    optimizer is the outer one, but the shard keeps every promise of a sync round."""

    mode = "local"


# ---- async and ssp ------------------------------------------------------------------------


class AsyncBehaviour(PolicyContract):
    """What async promises; SSP is async with a bound on pulls, so it promises it too."""

    def test_each_push_is_its_own_update(self, opt: str) -> None:
        st, job, values = self.setup(opt)
        applied = []
        for i, w in enumerate((2, 0, 1)):
            g = grad_for(job, w, 1)
            outcome, version, _ = push(st, worker=w, clock=1, base_version=st.version, grads=g)
            applied.append(g)
            assert outcome.applied and outcome.staleness == 0
            assert version == st.version == i + 1
            assert_weights_equal(masters(st), reference_weights(job, values, applied))

    def test_staleness_is_version_at_apply_minus_base(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        o0, _, _ = push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
        o1, _, _ = push(st, worker=1, clock=1, base_version=1, grads=grad_for(job, 1, 1))
        # Worker 2 computed its gradient from version 0; two updates landed since.
        o2, v, _ = push(st, worker=2, clock=1, base_version=0, grads=grad_for(job, 2, 1))
        assert [o0.staleness, o1.staleness, o2.staleness] == [0, 0, 2]
        assert o2.applied and v == 3
        assert st.stats()["staleness_histogram"] == [2, 0, 1]
        before = st.state_digest()
        with pytest.raises(InvalidArgument, match="base version"):
            push(st, worker=0, clock=2, base_version=4, grads=grad_for(job, 0, 2))
        assert st.state_digest() == before

    @pytest.mark.parametrize("how", ["nan", "inf-after-unscale", "overflow-flag"])
    def test_nonfinite_push_is_dropped_and_counted(self, opt: str, how: str) -> None:
        st, job, _ = self.setup(opt)
        push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))
        before_w, version = weights_digest(st), st.version
        g = grad_for(job, 0, 1)
        if how == "nan":
            outcome, v, _ = push(
                st,
                worker=0,
                clock=1,
                base_version=1,
                grads={k: t * float("nan") for k, t in g.items()},
            )
        elif how == "inf-after-unscale":
            g["b#0"][0] = 3e38
            outcome, v, _ = push(st, worker=0, clock=1, base_version=1, grads=g, loss_scale=0.5)
        else:
            outcome, v, _ = push(st, worker=0, clock=1, base_version=1, overflow=True)
        assert outcome.dropped_nonfinite and not outcome.applied
        assert v == version == st.version
        assert st.dropped_nonfinite == 1 and st.updates_applied == version
        assert weights_digest(st) == before_w
        assert st.clocks[0] == 1  # the worker moves on
        outcome, _, _ = push(st, worker=0, clock=2, base_version=1, grads=grad_for(job, 0, 2))
        assert outcome.applied


class TestAsyncContract(AsyncBehaviour):
    mode = "async"

    def test_pull_never_waits(self, opt: str) -> None:
        st, job, _ = self.setup(opt)
        for clock in (1, 2, 3):
            push(st, worker=0, clock=clock, base_version=st.version, grads=grad_for(job, 0, clock))
        header, _ = pull(st, 0, 3, timeout=0.0)
        assert header.clock_gap == 3 and header.version == 3


class TestSSPContract(AsyncBehaviour):
    mode = "ssp"
    staleness = 1

    def _fast_and_slow(self, opt: str) -> tuple[ShardState, Job]:
        """Worker 0 at clock 2, worker 1 at clock 1, worker 2 (the slowest) at clock 0."""
        st, job, _ = self.setup(opt)
        for w, clocks in ((0, (1, 2)), (1, (1,))):
            for c in clocks:
                push(st, worker=w, clock=c, base_version=st.version, grads=grad_for(job, w, c))
        return st, job

    def test_pull_within_the_bound_is_answered(self, opt: str) -> None:
        st, _ = self._fast_and_slow(opt)
        header, _ = pull(st, 1, 1, timeout=0.0)
        assert header.clock_gap == 1
        header, _ = pull(st, 0, 1, timeout=0.0)
        assert header.clock_gap == 1

    def test_pull_too_far_ahead_blocks_until_the_slowest_pushes(self, opt: str) -> None:
        st, job = self._fast_and_slow(opt)
        before = st.state_digest()
        with pytest.raises(DeadlineExceeded, match="slowest"):
            pull(st, 0, 2, timeout=0.02)
        assert st.state_digest() == before
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(pull, st, 0, 2, timeout=30.0)
            with pytest.raises(FutureTimeout):
                fut.result(timeout=0.05)  # it cannot finish: worker 2 is 2 clocks behind
            push(st, worker=2, clock=1, base_version=0, grads=grad_for(job, 2, 1))
            header, got = fut.result(timeout=30.0)
        assert header.clock_gap == 1 and header.version == st.version == 4
        assert_weights_equal(got, masters(st))
        assert st.stats()["max_clock_gap"] == 1

    def test_leave_of_the_slowest_releases_the_pull(self, opt: str) -> None:
        st, _ = self._fast_and_slow(opt)
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(pull, st, 0, 2, timeout=30.0)
            with pytest.raises(FutureTimeout):
                fut.result(timeout=0.05)
            assert st.members.leave(2) == 2
            header, _ = fut.result(timeout=30.0)
        assert header.clock_gap == 1  # now measured against worker 1

    @pytest.mark.parametrize("ahead", [1, 2, 3])
    def test_bound_is_staleness_clocks(self, opt: str, ahead: int) -> None:
        job = self.job(opt, num_workers=2)
        st = self.new_state(job)
        for c in range(1, ahead + 1):
            push(st, worker=0, clock=c, base_version=st.version, grads=grad_for(job, 0, c))
        for c in range(1, ahead + 1):
            if c <= self.staleness:
                assert pull(st, 0, c, timeout=0.0)[0].clock_gap == c
            else:
                with pytest.raises(DeadlineExceeded):
                    pull(st, 0, c, timeout=0.0)


# ---- a mode of one's own: one module (tests/drop_stale_mode.py), one suite ----------------


class TestDropStaleContract(AsyncBehaviour):
    """Async that drops gradients staler than K, added as one module and registered the
    way the stock modes are: every promise of the contract and of async holds (K is large
    for those), and what only it does is below."""

    mode = drop_stale_mode.NAME
    modes = drop_stale_mode.MODES
    max_staleness = 100

    @property
    def promises(self) -> Promises:
        return Promises(rounds=False, pull_wait=None)

    def job(self, opt: str, **kw: object) -> Job:
        kw.setdefault("mode_options", {"max_staleness": self.max_staleness})
        return super().job(opt, **kw)

    @pytest.mark.parametrize("k", [0, 1])
    def test_a_gradient_staler_than_k_is_dropped(self, opt: str, k: int) -> None:
        st, job, values = self.setup(opt, mode_options={"max_staleness": k})
        applied = []
        for w in range(job.num_workers):  # every one computed from version 0
            g = grad_for(job, w, 1)
            before = st.version
            outcome, _, _ = push(st, worker=w, clock=1, base_version=0, grads=g)
            assert outcome.staleness == before
            assert outcome.applied == (before <= k) and not outcome.dropped_nonfinite
            if outcome.applied:
                applied.append(g)
        assert st.clocks == [1] * job.num_workers  # a dropped push still moves its clock
        assert st.version == st.updates_applied == len(applied) == k + 1
        assert st.policy.dropped_stale == job.num_workers - k - 1  # type: ignore[attr-defined]
        assert_weights_equal(masters(st), reference_weights(job, values, applied))

    def test_its_configuration_is_checked_when_the_job_arrives(self) -> None:
        for options, words in [({}, "needs the mode option"), ({"max_staleness": -1}, ">= 0"),
                               ({"max_staleness": 1, "other": 2}, "unknown mode options")]:  # fmt: skip
            job = self.job("sgd", mode_options=options)
            with pytest.raises(InvalidArgument, match=words):
                make_state(job, modes=self.modes)
        with pytest.raises(InvalidArgument, match="is not served by this shard"):
            make_state(self.job("sgd"))  # the stock registry does not serve it


def test_every_mode_has_a_contract_suite() -> None:
    suites = (
        TestSyncContract,
        TestChunkedSyncContract,
        TestLocalContract,
        TestAsyncContract,
        TestSSPContract,
        TestDropStaleContract,
    )
    assert {c.mode for c in suites} == set(drop_stale_mode.MODES.names())
    assert any(c.chunk_rounds for c in suites)
    assert all(issubclass(c, PolicyContract) for c in suites)
    assert all(issubclass(c, DecisionContract) for c in suites)
    for c in suites:  # what each suite holds a mode to is what the mode declares
        traits = c.modes.get(c.mode).traits
        promises = c.promises.fget(c)  # type: ignore[attr-defined]
        assert traits.rounds == promises.rounds, c.__name__
        assert traits.shard_owns_loss_scale == promises.shard_loss_scale, c.__name__
