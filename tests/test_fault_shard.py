"""Leases, rejoining, checkpoints, restore, rollback and draining of one ShardState,
driven directly (no socket). Lease expiry runs on an injected clock: no sleeping."""

from __future__ import annotations

import threading

import pytest
import torch

from psar.ps.errors import FailedPrecondition, Unavailable
from psar.ps.server.durability.checkpoints import CheckpointManager, list_checkpoints
from psar.ps.server.intake.pieces import PushHeader
from psar.ps.server.membership.leases import LeaseTable
from psar.ps.server.membership.membership import Expired, Restored, TooLate
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
    weights_digest,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def shard(mode: str = "sync", workers: int = 3, *, tmp=None, every: int = 0, **kw) -> tuple:
    clock = FakeClock()
    manager = CheckpointManager(tmp, every=every) if tmp is not None else None
    st = ShardState(lease_s=5.0, join_grace_s=20.0, clock=clock, checkpoints=manager)
    job = make_job(mode, num_workers=workers, optimizer=kw.pop("opt", "sgd"), **kw)
    values = init_values(job)
    st.init(job, values)
    return st, job, values, clock


def round_of(st: ShardState, job, clock: int, workers=None) -> dict:
    sent = {}
    base = st.version
    for w in workers if workers is not None else sorted(st.live):
        sent[w] = grad_for(job, w, clock)
        push(st, worker=w, clock=clock, base_version=base, grads=sent[w])
    return sent


# ---- leases ---------------------------------------------------------------------------


def test_lease_table_grace_renew_expire() -> None:
    clock = FakeClock()
    t = LeaseTable(lease_s=5, join_grace_s=20, clock=clock)
    t.grant([0, 1])
    clock.t += 19
    assert t.expired() == []  # the first term is join_grace_s
    t.renew(0)  # heard from: lease_s from now on
    clock.t += 2
    assert t.expired() == [1]
    clock.t += 2.5  # 4.5 s after the renewal: inside lease_s = 5
    assert t.expired() == [1]
    clock.t += 1
    assert t.expired() == [0, 1]
    with pytest.raises(ValueError):
        LeaseTable(lease_s=0)


def test_sync_round_closes_with_the_live_workers_when_a_lease_expires() -> None:
    st, job, values, clock = shard("sync", 3)
    sent = round_of(st, job, 1, workers=[0, 1])
    assert st.rounds == 0  # worker 2 has not pushed
    clock.t += 19
    st.members.heartbeat(0), st.members.heartbeat(1)
    assert st.members.expire_leases() == []
    clock.t += 2  # past worker 2's first term; 0 and 1 renewed
    assert st.members.expire_leases() == [2]
    # The round closed with the mean over those that pushed.
    assert st.rounds == 1 and st.live == {0, 1} and st.lease_expirations == 1
    assert_weights_equal(masters(st), reference_weights(job, values, [mean_in_rank_order(sent)]))
    with pytest.raises(Expired, match="expired"):
        push(st, worker=2, clock=1, base_version=0, grads=grad_for(job, 2, 1))


def test_ssp_stops_waiting_for_an_expired_worker() -> None:
    st, job, _, clock = shard("ssp", 2, staleness=0)
    push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
    with pytest.raises(Exception, match="waited"):
        pull(st, 0, 1, timeout=0.05)
    result = {}
    t = threading.Thread(target=lambda: result.update(h=pull(st, 0, 1, timeout=10)[0]))
    t.start()
    clock.t += 25
    st.members.heartbeat(0)
    assert st.members.expire_leases() == [1]
    t.join(timeout=10)
    assert result["h"].version == 1


def test_expired_worker_rejoins_async_with_its_clock() -> None:
    st, job, _, clock = shard("async", 2)
    push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))
    clock.t += 25
    st.members.heartbeat(0)
    assert st.members.expire_leases() == [1]
    alive, _, _ = st.members.heartbeat(1)
    assert not alive
    rec = st.members.register(1, 0, query=True)
    assert rec["clock"] == 1 and not rec["live"]
    rec = st.members.register(1, rec["clock"], instance="new-process")
    assert rec["live"] and rec["rejoined"] and st.rejoins == 1
    outcome, _, _ = push(st, worker=1, clock=2, base_version=1, grads=grad_for(job, 1, 2))
    assert outcome.applied
    # A restarted process (new instance id) while the lease still holds is a rejoin too.
    st.members.register(1, 2, instance="third")
    assert st.rejoins == 2


def test_sync_join_happens_at_a_round_boundary() -> None:
    st, job, _, clock = shard("sync", 3)
    round_of(st, job, 1)
    round_of(st, job, 2, workers=[0, 1])  # round 3 on this shard: 2 still missing
    clock.t += 25
    st.members.heartbeat(0), st.members.heartbeat(1)
    st.members.expire_leases()  # worker 2 gone: round 2 closed with 0 and 1
    assert st.rounds == 2
    push(st, worker=0, clock=3, base_version=2, grads=grad_for(job, 0, 3))
    with pytest.raises(TooLate):
        st.members.register(2, 1)
    # Join at round 4: not live while round 3 is open, so round 3 does not wait for it.
    rec = st.members.register(2, 3, instance="b")
    assert not rec["live"] and rec["clock"] == 3
    push(st, worker=1, clock=3, base_version=2, grads=grad_for(job, 1, 3))
    assert st.rounds == 3 and 2 in st.live  # promoted at the boundary
    h, _ = pull(st, 2, 3)
    assert h.rounds == 3
    round_of(st, job, 4)  # now round 4 needs all three
    assert st.rounds == 4 and st.clocks == [4, 4, 4]


def test_sync_register_now_when_the_open_round_is_its_round() -> None:
    st, job, _, _ = shard("sync", 2)
    st.members.leave(1)
    assert st.left == {1}
    rec = st.members.register(1, 0, instance="again")
    assert rec["live"] and rec["rejoined"]
    round_of(st, job, 1)
    assert st.rounds == 1 and st.updates_applied == 1


def test_left_worker_still_refused_and_unknown_worker_refused() -> None:
    st, job, _, _ = shard("async", 2)
    st.members.leave(1)
    with pytest.raises(FailedPrecondition, match="left"):
        push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))
    with pytest.raises(Exception, match="not in this job"):
        st.members.heartbeat(5)


# ---- checkpoints, restore, rollback ---------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_restore_gives_back_the_same_state(tmp_path, mode: str, opt: str) -> None:
    st, job, _, _ = shard(mode, 2, tmp=tmp_path, every=2, opt=opt)
    for c in (1, 2, 3, 4):
        round_of(st, job, c)
    st.checkpoints.flush()
    digest, stats = st.state_digest(), st.stats()
    again = ShardState(checkpoints=CheckpointManager(tmp_path))
    step, snap = again.checkpoints.newest()
    assert step == (4 if mode == "sync" else 8)
    again.durability.restore(step, snap)
    assert again.state_digest() == digest
    assert again.job == job and again.restores == 1 and again.incarnation != st.incarnation
    for key in ("version", "rounds", "updates_applied", "worker_clocks", "staleness_histogram"):
        assert again.stats()[key] == stats[key]
    # Both carry on identically.
    for s in (st, again):
        round_of(s, job, 5)
    assert weights_digest(again) == weights_digest(st)


def test_checkpoints_on_the_round_grid_are_pruned(tmp_path) -> None:
    st, job, _, _ = shard("sync", 1, tmp=tmp_path, every=2)
    for c in range(1, 10):
        round_of(st, job, c)
    st.checkpoints.flush()
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [4, 6, 8]
    assert st.checkpoints.written == 5  # rounds 0 (after init), 2, 4, 6, 8


def test_sync_rollback_goes_back_to_a_checkpointed_round(tmp_path) -> None:
    st, job, values, _ = shard("sync", 2, tmp=tmp_path, every=3)
    rounds = [round_of(st, job, c) for c in range(1, 6)]
    st.checkpoints.flush()
    inc = st.incarnation
    assert st.durability.rollback(7)["rolled_back"] is False  # already at or before it
    reply = st.durability.rollback(4)
    assert reply["rolled_back"] and reply["rounds"] == 3 and st.incarnation != inc
    assert st.clocks == [3, 3] and st.restored_pending
    want = reference_weights(job, values, [mean_in_rank_order(r) for r in rounds[:3]])
    assert_weights_equal(masters(st), want)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [0, 3]
    with pytest.raises(Restored):  # a worker still on the old incarnation must resync
        st.intake.begin_push(PushHeader(0, 4, 3, torch.float32), incarnation=inc)
    round_of(st, job, 4)  # no incarnation given (0): accepted
    assert st.rounds == 4 and not st.restored_pending


def test_rollback_releases_waiting_pulls_with_restored(tmp_path) -> None:
    st, job, _, _ = shard("sync", 2, tmp=tmp_path, every=1)
    round_of(st, job, 1)
    st.checkpoints.flush()
    push(st, worker=0, clock=2, base_version=1, grads=grad_for(job, 0, 2))
    round_of(st, job, 2, workers=[1])
    push(st, worker=0, clock=3, base_version=2, grads=grad_for(job, 0, 3))
    errors = []

    def wait() -> None:
        try:
            st.pulls.pull(0, 3, torch.float32, 10, incarnation=st.incarnation)
        except Restored as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    st.durability.rollback(1)
    t.join(timeout=10)
    assert errors and st.rounds == 1 and st.clocks == [1, 1]


def test_rollback_without_checkpoints_is_refused() -> None:
    st, job, _, _ = shard("sync", 1)
    round_of(st, job, 1)
    with pytest.raises(FailedPrecondition, match="checkpoint"):
        st.durability.rollback(0)


def test_stale_incarnation_refused_everywhere() -> None:
    st, job, _, _ = shard("async", 1)
    wrong = st.incarnation + 1
    with pytest.raises(Restored):
        st.pulls.pull(0, 0, torch.float32, 1, incarnation=wrong)
    with pytest.raises(Restored):
        st.intake.begin_push(PushHeader(0, 1, 0, torch.float32), incarnation=wrong)


def test_drain_finishes_the_round_in_flight(tmp_path) -> None:
    st, job, _, _ = shard("sync", 2, tmp=tmp_path, every=100)
    push(st, worker=0, clock=1, base_version=0, grads=grad_for(job, 0, 1))
    st.durability.drain()
    assert not st.durability.wait_drained(0.01)
    push(st, worker=1, clock=1, base_version=0, grads=grad_for(job, 1, 1))  # finishes round 1
    assert st.durability.wait_drained(0.01) and st.rounds == 1
    with pytest.raises(Unavailable, match="draining"):
        push(st, worker=0, clock=2, base_version=1, grads=grad_for(job, 0, 2))
    assert st.durability.checkpoint_now("shutdown", wait=True)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [0, 1]


def test_interval_checkpoints_in_async_mode(tmp_path) -> None:
    manager = CheckpointManager(tmp_path, interval_s=0.05)
    st = ShardState(checkpoints=manager)
    job = make_job("async", num_workers=1)
    st.init(job, init_values(job))
    manager.start_timer(st.durability)
    for c in (1, 2, 3):
        push(st, worker=0, clock=c, base_version=st.version, grads=grad_for(job, 0, c))
    deadline = threading.Event()
    for _ in range(200):  # polls until the timer has written version 3 (no time asserted)
        manager.flush()
        if 3 in [s for s, _ in list_checkpoints(tmp_path, 0)]:
            break
        deadline.wait(0.05)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [0, 3]
    assert manager.every_for("async") == 0 and manager.every_for("sync") == 100
    manager.close()
