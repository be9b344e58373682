"""An elastic job on one ShardState, driven directly (no socket): Join gives ranks, a sync
joiner enters at a round boundary, the data follows membership (rounds dealt in rank
order, a killed or leaving worker's batches dealt again), the learning-rate rule, and the
ledger through a checkpoint. Lease expiry runs on an injected clock."""

from __future__ import annotations

import dataclasses

import pytest

from psar.ps.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from psar.ps.job import Job
from psar.ps.server.durability.checkpoints import CheckpointManager
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import (
    assert_weights_equal,
    grad_for,
    init_values,
    make_job,
    masters,
    mean_in_rank_order,
    pull,
    push,
    reference_weights,
)
from tests.test_fault_shard import FakeClock


def elastic_job(mode: str = "sync", workers: int = 2, **kw) -> Job:
    extra = {k: kw.pop(k) for k in ("max_workers", "data_batches", "data_per_step") if k in kw}
    extra.setdefault("max_workers", 4)
    return dataclasses.replace(make_job(mode, num_workers=workers, **kw), **extra)


def elastic_shard(mode: str = "sync", workers: int = 2, *, tmp=None, **kw) -> tuple:
    clock = FakeClock()
    manager = CheckpointManager(tmp, every=1) if tmp is not None else None
    st = ShardState(lease_s=5.0, join_grace_s=20.0, clock=clock, checkpoints=manager)
    job = elastic_job(mode, workers, **kw)
    values = init_values(job)
    st.init(job, values)
    return st, job, values, clock


def sync_round(st: ShardState, job: Job, workers: list[int]) -> dict:
    """Every worker in `workers` pushes the open round; returns what each sent."""
    r, base = st.rounds + 1, st.version
    sent = {w: grad_for(job, w, r) for w in workers}
    for w in workers:
        push(st, worker=w, clock=r, base_version=base, grads=sent[w])
    return sent


# ---- Join ------------------------------------------------------------------------------


def test_join_gives_the_lowest_free_rank_until_the_job_is_full() -> None:
    st, *_ = elastic_shard("async", 2, max_workers=4)
    assert st.members.join("a")["worker"] == 2
    assert st.members.join("b")["worker"] == 3  # 2 is reserved for "a" until it registers
    with pytest.raises(ResourceExhausted, match="--max-workers"):
        st.members.join("c")
    assert st.joins == 2


def test_a_rank_given_but_never_registered_is_free_after_the_join_grace() -> None:
    st, _, _, clock = elastic_shard("async", 2, max_workers=3)
    assert st.members.join("a")["worker"] == 2
    with pytest.raises(ResourceExhausted):
        st.members.join("b")
    clock.t += 21
    assert st.members.join("b")["worker"] == 2


def test_ranks_of_workers_that_left_are_given_before_those_of_expired_ones() -> None:
    st, _, _, clock = elastic_shard("async", 3, max_workers=3)
    st.members.register(1, 0, instance="one")
    clock.t += 25  # workers 0 and 2 never came: their first term ends
    st.members.heartbeat(1)
    assert st.members.expire_leases() == [0, 2]
    st.members.leave(1)
    assert st.members.join("x")["worker"] == 1  # left (gone for good) before expired


def test_join_is_refused_by_a_fixed_job_and_by_other_shards() -> None:
    st = ShardState()
    st.init(make_job("sync", num_workers=2), init_values(make_job("sync", num_workers=2)))
    with pytest.raises(FailedPrecondition, match="--max-workers"):
        st.members.join("x")
    job = elastic_job("sync", 2, shard_index=1, num_shards=2)
    st1 = ShardState()
    st1.init(job, init_values(job))
    with pytest.raises(FailedPrecondition, match="shard 0"):
        st1.members.join("x")


def test_ranks_past_max_workers_are_refused() -> None:
    st, *_ = elastic_shard("sync", 2, max_workers=3)
    st.members.register(2, 0)  # room for rank 2
    with pytest.raises(InvalidArgument, match="workers 0..2"):
        st.members.register(3, 0)


def test_a_joiner_is_not_counted_as_a_rejoin_even_on_a_used_rank() -> None:
    st, *_ = elastic_shard("async", 2, max_workers=2)
    st.members.register(1, 0, instance="old")
    st.members.leave(1)
    w = st.members.join("new")["worker"]
    assert w == 1
    assert not st.members.register(w, 0, instance="new", joined=True)["rejoined"]
    assert st.rejoins == 0 and 1 in st.live


# ---- a rank belongs to the instance that registered it (issue #45) ----------------------------


def _membership(st: ShardState) -> tuple:
    return (sorted(st.live), sorted(st.left), dict(st.joining), dict(st.instances), st.leaves)


def test_only_the_ranks_holder_may_leave_it() -> None:
    st, *_ = elastic_shard("async", 2)
    st.members.register(0, 0, instance="zero")
    st.members.register(1, 0, instance="one")
    before = _membership(st)
    for who in ("", "zero", "intruder"):  # no instance, another worker's, a stranger's
        with pytest.raises(FailedPrecondition, match="instance") as e:
            st.members.leave(1, who)
        assert e.value.reason == "not_holder"
        assert _membership(st) == before  # refused: nothing changed
    assert st.members.leave(1, "one") == 1 and st.live == {0}
    assert st.members.leave(1, "one") == 1  # its retry is harmless


def test_a_stale_leave_of_a_previous_holder_is_refused() -> None:
    st, *_ = elastic_shard("async", 2, max_workers=2)
    st.members.register(1, 0, instance="old")
    st.members.leave(1, "old")
    w = st.members.join("new")["worker"]
    st.members.register(w, 0, instance="new", joined=True)
    before = _membership(st)
    with pytest.raises(FailedPrecondition, match="another instance"):
        st.members.leave(1, "old")  # the old holder's Leave, arriving late
    assert _membership(st) == before and 1 in st.live


def test_a_rank_nobody_registered_cannot_be_left() -> None:
    st, *_ = elastic_shard("async", 2)
    with pytest.raises(FailedPrecondition, match="no registered instance"):
        st.members.leave(1, "anyone")
    assert st.live == {0, 1} and st.leaves == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_joiner_never_replaces_a_rank_another_instance_holds(mode: str) -> None:
    st, *_ = elastic_shard(mode, 2, max_workers=4)
    st.members.register(1, 0, instance="one")
    given = st.members.join("j")["worker"]  # rank 2, reserved for "j"
    before = _membership(st)
    for rank, who in ((1, "j"), (1, "intruder"), (given, "intruder"), (given, ""), (0, "j")):
        with pytest.raises(FailedPrecondition, match="joined=true|another instance"):
            st.members.register(rank, 0, instance=who, joined=True)
        assert _membership(st) == before  # refused: nothing changed
    st.members.register(given, 0, instance="j", joined=True)  # the joiner itself
    st.members.register(given, 0, instance="j", joined=True)  # and its retry
    assert st.instances[given] == "j" and st.instances[1] == "one"


def test_a_joiners_rank_is_not_taken_over_by_a_plain_register_while_it_holds_it() -> None:
    st, *_ = elastic_shard("async", 2, max_workers=3)
    w = st.members.join("j")["worker"]
    st.members.register(w, 0, instance="j", joined=True)
    before = _membership(st)
    with pytest.raises(FailedPrecondition, match="took it through Join"):
        st.members.register(w, 0, instance="static")  # a fixed --rank process, say
    assert _membership(st) == before and st.rejoins == 0
    st.members.register(w, 0, instance="j")  # the joiner's own re-register: fine
    st.members.leave(w, "j")
    st.members.register(w, 0, instance="static")  # free once the joiner left
    assert st.instances[w] == "static" and w in st.live


# ---- sync: entering at a round boundary ----------------------------------------------------


def test_sync_joiner_enters_at_the_round_after_the_open_one() -> None:
    st, job, *_ = elastic_shard("sync", 2, data_batches=100)
    sync_round(st, job, [0])  # round 1 is open: worker 0 pushed
    reply = st.members.join("j")
    assert reply["clock"] == 1  # the rounds closed + 1: it enters round 2
    st.members.register(reply["worker"], reply["clock"], instance="j", joined=True)
    assert 2 not in st.live and st.joining == {2: 1}
    sync_round(st, job, [1])  # round 1 closes without waiting for the joiner
    assert st.rounds == 1 and st.live == {0, 1, 2}
    # Round 2 was dealt at that boundary to its three members, in rank order.
    assert [pull(st, w, 1)[0].batches for w in (0, 1, 2)] == [(2,), (3,), (4,)]


def test_graceful_leave_after_its_push_counts_its_last_gradient() -> None:
    st, job, values, _ = elastic_shard("sync", 2, data_batches=100)
    sent = sync_round(st, job, [0, 1])
    sent2 = sync_round(st, job, [1])
    st.members.leave(1)  # worker 1 pushed round 2, then left
    assert st.rounds == 1  # round 2 waits for worker 0 only
    sent2.update(sync_round(st, job, [0]))
    assert st.rounds == 2 and st.live == {0}
    want = reference_weights(job, values, [mean_in_rank_order(sent), mean_in_rank_order(sent2)])
    assert_weights_equal(masters(st), want)
    # It left before round 2 closed: round 3 is dealt to worker 0 alone, nothing skipped.
    assert pull(st, 0, 2)[0].batches == (4,)
    assert st.leaves == 1 and st.ledger.given_back == 0


def test_a_killed_workers_batch_is_dealt_again_in_rank_order() -> None:
    st, job, _, clock = elastic_shard("sync", 3, data_batches=100, data_per_step=2)
    # Round 1: ids 0-5 dealt in rank order; worker 1 dies before pushing.
    assert [pull(st, w, 0)[0].batches for w in (0, 1, 2)] == [(0, 1), (2, 3), (4, 5)]
    sync_round(st, job, [0, 2])
    clock.t += 25
    st.members.heartbeat(0), st.members.heartbeat(2)
    assert st.members.expire_leases() == [1]
    assert st.rounds == 1  # the round closed with the live workers
    # Its ids (2, 3) come back and go first, to the lowest rank of round 2.
    assert [pull(st, w, 1)[0].batches for w in (0, 2)] == [(2, 3), (6, 7)]
    assert st.ledger.given_back == 2 and st.stats()["data_returned"] == 2


def test_the_data_ends_and_workers_are_told() -> None:
    st, job, *_ = elastic_shard("sync", 2, data_batches=3)
    assert [pull(st, w, 0)[0].batches for w in (0, 1)] == [(0,), (1,)]
    sync_round(st, job, [0, 1])
    heads = [pull(st, w, 1)[0] for w in (0, 1)]
    assert [(h.batches, h.data_done) for h in heads] == [((2,), False), ((), True)]
    assert heads[0].live_workers == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_join_to_a_job_whose_data_is_all_dealt_is_refused_and_changes_nothing(
    mode: str,
) -> None:
    """Issue #45 defect 9: a joiner would wait for a round nobody closes; it is told."""
    st, job, *_ = elastic_shard(mode, 2, data_batches=3)
    assert st.members.join("early")["worker"] == 2  # ids are left: a rank is given
    [pull(st, w, 0) for w in (0, 1)]
    sync_round(st, job, [0, 1])  # (async: two pushes at clock 1 all the same)
    pull(st, 0, 1)  # the last id is dealt
    assert st.ledger.exhausted()
    before = (st.joins, dict(st.reserved), set(st.live), st.state_digest())
    with pytest.raises(FailedPrecondition, match="data is all dealt") as e:
        st.members.join("late")
    assert e.value.reason == "data_done"
    assert (st.joins, dict(st.reserved), set(st.live), st.state_digest()) == before


def _register(st: ShardState, workers: range) -> None:
    for w in workers:
        st.members.register(w, 0, instance=f"i{w}")


def test_the_worker_whose_push_took_the_last_ids_writes_the_model() -> None:
    """Issue #45 defect 7: rank 0 left mid-job (SIGTERM); the shards name the writer of
    --save: the worker whose push took the job's last ids, and nobody else."""
    st, job, *_ = elastic_shard("sync", 2, data_batches=5)
    _register(st, range(2))
    [pull(st, w, 0) for w in (0, 1)]  # round 1: ids 0, 1
    sync_round(st, job, [0, 1])
    assert st.members.leave(0, "i0") == 1  # rank 0 leaves after its push: not the writer
    assert not st.members.writes_model(0, "i0")
    trained = []
    while ids := pull(st, 1, st.rounds)[0].batches:  # ids 2, 3, 4 to worker 1 alone
        trained += ids
        sync_round(st, job, [1])
    assert sorted(trained) == [2, 3, 4] and st.ledger.finished_by == 1
    st.members.leave(1, "i1")
    assert st.members.writes_model(1, "i1") and not st.members.writes_model(1, "other")


def test_the_writer_is_the_finisher_not_the_last_worker_out() -> None:
    st, job, *_ = elastic_shard("sync", 2, data_batches=3)
    _register(st, range(2))
    [pull(st, w, 0) for w in (0, 1)]
    sync_round(st, job, [0, 1])
    heads = [pull(st, w, 1)[0] for w in (0, 1)]  # id 2 to worker 0; worker 1 is done
    assert heads[1].data_done
    st.members.leave(1, "i1")  # out first, the job's data still training
    sync_round(st, job, [0])
    st.members.leave(0, "i0")
    assert st.members.writes_model(0, "i0") and not st.members.writes_model(1, "i1")


def test_a_job_stopped_before_its_data_is_done_is_written_by_its_last_worker_out() -> None:
    st, job, *_ = elastic_shard("async", 2, data_batches=100)
    _register(st, range(2))
    st.members.leave(1, "i1")
    assert not st.members.writes_model(1, "i1")
    st.members.leave(0, "i0")
    assert st.members.writes_model(0, "i0") and st.ledger.finished_by is None


def test_a_fixed_job_names_no_writer() -> None:
    st, *_ = elastic_shard("sync", 2)  # no elastic data: rank 0 writes, as always
    _register(st, range(2))
    st.members.leave(1, "i1"), st.members.leave(0, "i0")
    assert not st.members.writes_model(0, "i0") and not st.members.writes_model(1, "i1")


def test_sync_lr_scales_with_the_workers_in_the_round() -> None:
    st, job, values, _ = elastic_shard("sync", 2)
    st.members.leave(1)
    sent = sync_round(st, job, [0])  # one worker of the two the lr was set for
    half = dataclasses.replace(job.optimizer, lr=0.5 * job.optimizer.lr)
    half = dataclasses.replace(job, optimizer=half)
    assert_weights_equal(masters(st), reference_weights(half, values, [sent[0]]))


def test_local_mode_does_not_scale_its_outer_step() -> None:
    st, job, values, _ = elastic_shard("local", 2)
    st.members.leave(1)
    sent = sync_round(st, job, [0])
    assert_weights_equal(masters(st), reference_weights(job, values, [sent[0]]))


def test_elastic_sync_refuses_per_chunk_rounds() -> None:
    job = elastic_job("sync", 2)
    with pytest.raises(InvalidArgument, match="--chunk-rounds"):
        ShardState(chunk_rounds=True).init(job, init_values(job))


# ---- async / ssp --------------------------------------------------------------------------


def test_ssp_joiner_enters_as_the_slowest_live_worker() -> None:
    st, job, *_ = elastic_shard("ssp", 2, staleness=1)
    for c in (1, 2, 3):
        push(st, worker=0, clock=c, base_version=st.version, grads=grad_for(job, 0, c))
    for c in (1, 2):
        push(st, worker=1, clock=c, base_version=st.version, grads=grad_for(job, 1, c))
    reply = st.members.join("j")
    assert reply["clock"] == 2
    st.members.register(reply["worker"], reply["clock"], instance="j", joined=True)
    assert st.clocks[2] == 2 and 2 in st.live
    pull(st, 0, 3, timeout=1)  # worker 0 is one ahead of the slowest: it does not wait


def test_async_deal_follows_the_order_workers_ask_and_a_rejoin_keeps_its_deal() -> None:
    st, job, _, clock = elastic_shard("async", 2, data_batches=50)
    assert pull(st, 1, 0)[0].batches == (0,)
    assert pull(st, 0, 0)[0].batches == (1,)
    assert pull(st, 1, 0)[0].batches == (0,)  # a retried pull: the same
    push(st, worker=1, clock=1, base_version=st.version, grads=grad_for(job, 1, 1))
    assert pull(st, 1, 1)[0].batches == (2,)
    # Worker 1's process restarts inside its lease: the new one takes the same step.
    st.members.register(1, 1, instance="restarted")
    assert pull(st, 1, 1)[0].batches == (2,)


# ---- checkpoints ----------------------------------------------------------------------------


def test_the_ledger_goes_through_a_checkpoint_and_a_rollback(tmp_path) -> None:
    st, job, *_ = elastic_shard("sync", 2, tmp=tmp_path, data_batches=40)
    sync_round(st, job, [0, 1])
    before = st.ledger.state()
    sync_round(st, job, [0, 1])
    assert st.ledger.state() != before
    st.checkpoints.flush()
    st.durability.rollback(1)
    assert st.rounds == 1 and st.ledger.state() == before


# ---- workers that disagree about the job's size; who took part (issue #45 defect 13) ----


def test_a_worker_of_another_size_stops_the_job_and_every_call_after_says_why() -> None:
    st, job, *_ = elastic_shard("sync", 2)
    _register(st, range(2))
    before = (st.incarnation, st.state_digest())
    with pytest.raises(FailedPrecondition, match="nothing to stop") as same:
        st.members.stop(1, 2)  # its size is the job's: refused, nothing changed
    assert same.value.reason == "same_size" and (st.incarnation, st.state_digest()) == before
    sync_round(st, job, [0])  # rank 0 pushed round 1 and waits for rank 1 ...
    st.members.stop(1, 3)  # ... who was started with --world-size 3
    calls = {
        "pull": lambda: pull(st, 0, 1),
        "push": lambda: push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1)),
        "register": lambda: st.members.register(0, 1, instance="i0"),
        "join": lambda: st.members.join("j"),
    }
    for what, call in calls.items():
        with pytest.raises(FailedPrecondition, match="disagree about its size") as e:
            call()
        assert e.value.reason == "job_stopped", what
        assert "--world-size 3, rank 0 with 2" in str(e.value), what


def test_a_pull_waiting_for_a_round_ends_when_the_job_is_stopped() -> None:
    import threading

    st, job, *_ = elastic_shard("sync", 2)
    _register(st, range(2))
    sync_round(st, job, [0])
    got: list[BaseException] = []

    def waiting() -> None:
        try:
            pull(st, 0, 1, timeout=60)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            got.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    st.members.stop(1, 3)
    t.join(timeout=30)
    assert not t.is_alive() and isinstance(got[0], FailedPrecondition), got


def test_a_worker_that_failed_a_step_stops_the_job_with_its_own_line() -> None:
    """Issue #45 defect 16: a rank of a user's own loop stepped without a backward; the
    round it never pushes to would never close, so it stops the job with its error and
    every other worker's next call (and waiting pull) says it."""
    st, job, *_ = elastic_shard("sync", 2)
    _register(st, range(2))
    with pytest.raises(InvalidArgument, match="not in this job"):
        st.members.stop(7, 2, "rank 7: no backward")  # no such worker: nothing changed
    assert not st.members.stopped
    sync_round(st, job, [0])  # rank 0 pushed round 1 and waits for rank 1
    st.members.stop(1, 2, "rank 1: run.optimizer.step() without a\nbackward" + "x" * 5000)
    st.members.stop(0, 2, "a later reason")  # the first reason stands
    with pytest.raises(FailedPrecondition, match="worker 1 failed: rank 1: run") as e:
        pull(st, 0, 1)
    assert e.value.reason == "job_stopped" and "later" not in str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 1100  # one bounded line


def test_workers_that_took_part_count_each_holder_of_a_rank_that_pushed() -> None:
    st, job, *_ = elastic_shard("async", 2, data_batches=100, max_workers=2)
    _register(st, range(2))
    assert st.stats()["workers_took_part"] == 0
    for w in (0, 1):
        pull(st, w, 0)
        push(st, worker=w, clock=1, base_version=st.version, grads=grad_for(job, w, 1))
    st.members.leave(1, "i1")
    rank = st.members.join("joiner")["worker"]
    assert rank == 1  # the departed worker's rank, given again
    st.members.register(1, st.clocks[1], instance="joiner", joined=True)
    assert st.stats()["workers_took_part"] == 2  # the joiner has not pushed yet
    pull(st, 1, st.clocks[1])
    push(st, worker=1, clock=st.clocks[1] + 1, base_version=st.version, grads=grad_for(job, 1, 2))
    assert st.stats()["workers_took_part"] == 3


def test_a_fixed_job_counts_the_ranks_that_pushed() -> None:
    st = ShardState(lease_s=5.0, join_grace_s=20.0, clock=FakeClock())
    job = make_job("async", num_workers=3)
    st.init(job, init_values(job))
    push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
    push(st, worker=2, clock=1, base_version=st.version, grads=grad_for(job, 2, 1))
    assert st.stats()["workers_took_part"] == 2
