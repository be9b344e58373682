"""Per-chunk rounds (ps/server/modes/sync_chunks.py): slots are updated while the round's last push
still streams, and every way a round can change its mind undoes them, bit for bit.

Each test drives a chunked shard and a plain sync shard through the same calls: the
chunked one must end in the same state (digest of masters, optimizer state, counters),
and a refused push must leave it where it was before the push began.
"""

from __future__ import annotations

import threading

import pytest
import torch

from psar.ps.errors import FailedPrecondition, InvalidArgument
from psar.ps.job import Job
from psar.ps.server.intake.pieces import PushHeader, PushTicket
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import LossScaleConfig
from tests.ps_fixtures import OPTIMIZERS, grad_for, init_values, make_job, make_state, masters

Grads = dict[str, torch.Tensor]


@pytest.fixture(params=OPTIMIZERS)
def opt(request: pytest.FixtureRequest) -> str:
    return request.param


def pair(job: Job) -> tuple[ShardState, ShardState]:
    values = init_values(job)
    return make_state(job, values, chunk_rounds=True), make_state(job, values)


def begin(st: ShardState, worker: int, clock: int = 1, scale: float = 1.0) -> PushTicket:
    h = PushHeader(
        worker=worker,
        clock=clock,
        base_version=st.version,
        dtype=torch.float32,
        loss_scale=scale,
        verdict_follows=True,
    )
    return st.intake.begin_push(h, lock_timeout=5.0)


def stream(st: ShardState, ticket: PushTicket, grads: Grads, keys: list[str] | None = None) -> None:
    """Send these slots (all by default) in backward order, as a worker's buckets do."""
    for key in keys if keys is not None else list(reversed(grads)):
        flat = grads[key].reshape(-1)
        for off in range(0, flat.numel(), 5):
            st.intake.add_data(ticket, key, off, flat[off : off + 5].numpy().tobytes())


def full_push(
    st: ShardState, worker: int, grads: Grads, clock: int = 1, overflow: bool = False
) -> None:
    """A whole push streamed in backward order, then its verdict."""
    t = begin(st, worker, clock)
    try:
        stream(st, t, grads)
        st.intake.add_verdict(t, overflow)
        st.intake.finish_push(t)
    finally:
        t.release()


def test_slots_are_updated_before_the_round_closes_with_the_same_result(opt: str) -> None:
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    g0, g1 = grad_for(job, 0, 1), grad_for(job, 1, 1)
    full_push(chunked, 0, g0)
    full_push(plain, 0, g0)
    before = {k: t.clone() for k, t in masters(chunked).items()}
    last = list(g1)[-1]  # backward order: the last slot arrives first
    t = begin(chunked, 1)
    stream(chunked, t, g1, [last])
    chunked.policy.quiesce()  # the early update runs on the policy's applier thread
    now = masters(chunked)
    assert not torch.equal(now[last], before[last])  # updated while the round is open
    assert all(torch.equal(now[k], before[k]) for k in g1 if k != last)
    assert chunked.rounds == 0 and chunked.version == 0
    stream(chunked, t, g1, [k for k in reversed(g1) if k != last])
    chunked.policy.quiesce()
    chunked.intake.add_verdict(t, False)
    chunked.intake.finish_push(t)
    t.release()
    full_push(plain, 1, g1)
    assert chunked.rounds == plain.rounds == 1
    assert chunked.state_digest() == plain.state_digest()
    assert chunked.stats()["chunks_applied_early"] == len(g1)
    assert chunked.stats()["chunk_undos"] == 0


def test_an_overflow_verdict_undoes_every_early_slot(opt: str) -> None:
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    for clock in (1, 2):  # round 2 has optimizer state (momentum, Adam moments) to undo
        g0, g1 = grad_for(job, 0, clock), grad_for(job, 1, clock)
        for st in (chunked, plain):
            full_push(st, 0, g0, clock)
        before = chunked.state_digest()
        t = begin(chunked, 1, clock)
        stream(chunked, t, g1)
        assert chunked.state_digest() != before  # every slot was applied early
        chunked.intake.add_verdict(t, clock == 2)  # round 2: worker 1 overflowed at its end
        if clock == 2:
            assert chunked.state_digest() == before
        chunked.intake.finish_push(t)
        t.release()
        full_push(plain, 1, g1, clock, overflow=clock == 2)
        assert chunked.state_digest() == plain.state_digest()
    assert chunked.skipped_rounds == plain.skipped_rounds == 1
    assert chunked.stats()["chunk_undos"] == 1


def test_a_push_cut_off_after_its_slots_counted_changes_nothing(opt: str) -> None:
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    g0, g1 = grad_for(job, 0, 1), grad_for(job, 1, 1)
    full_push(chunked, 0, g0)
    full_push(plain, 0, g0)
    before = chunked.state_digest()
    t = begin(chunked, 1)
    stream(chunked, t, g1)  # every slot applied; then the connection drops
    t.release()
    assert chunked.state_digest() == before
    full_push(chunked, 1, g1)  # the retry
    full_push(plain, 1, g1)
    assert chunked.state_digest() == plain.state_digest()


def test_a_push_refused_at_its_end_changes_nothing(opt: str) -> None:
    """Non-finite data in the last slot while the verdict says finite: refused, and the
    slots that were already applied from its finite part are undone."""
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, _ = pair(job)
    full_push(chunked, 0, grad_for(job, 0, 1))
    before = chunked.state_digest()
    bad = grad_for(job, 1, 1)
    first = list(bad)[0]  # sent last
    bad[first][0] = float("nan")
    t = begin(chunked, 1)
    stream(chunked, t, bad)
    chunked.policy.quiesce()
    chunked.intake.add_verdict(t, False)
    with pytest.raises(InvalidArgument, match="non-finite") as e:
        chunked.intake.finish_push(t)
    t.release()
    assert e.value.reason == "nonfinite"
    assert chunked.state_digest() == before
    assert chunked.stats()["chunks_applied_early"] == len(bad) - 1


def test_loss_scaled_fp16_push_unscaled_per_slot_gives_the_same_bits(opt: str) -> None:
    # The shard's scale, which the workers' pulls gave them and every push carries.
    ls = LossScaleConfig(enabled=True, init_scale=1024.0)
    job = make_job("sync", optimizer=opt, num_workers=2, loss_scale=ls)
    chunked, plain = pair(job)
    for st in (chunked, plain):
        for w in (0, 1):
            g = {k: (v * 1024).half() for k, v in grad_for(job, w, 1).items()}
            h = PushHeader(
                worker=w, clock=1, base_version=0, dtype=torch.float16, loss_scale=1024.0
            )
            t = st.intake.begin_push(h)
            for key in reversed(g):
                st.intake.add_data(t, key, 0, g[key].numpy().tobytes())
            st.intake.finish_push(t)
            t.release()
    assert chunked.state_digest() == plain.state_digest()


def test_a_worker_leaving_mid_round_drops_its_share(opt: str) -> None:
    job = make_job("sync", optimizer=opt, num_workers=3)
    chunked, plain = pair(job)
    grads = [grad_for(job, w, 1) for w in range(3)]
    for st in (chunked, plain):
        full_push(st, 0, grads[0])
        full_push(st, 1, grads[1])
    t = begin(chunked, 2)
    stream(chunked, t, grads[2])  # applied as the mean of three workers
    chunked.members.leave(2)  # ... who then leaves before its push ends: the mean of two
    plain.members.leave(2)
    assert chunked.rounds == plain.rounds == 1
    assert chunked.state_digest() == plain.state_digest()
    with pytest.raises(FailedPrecondition, match="left"):
        chunked.intake.add_verdict(t, False)
        chunked.intake.finish_push(t)
    t.release()
    assert chunked.state_digest() == plain.state_digest()


def test_a_checkpoint_mid_round_holds_only_closed_rounds(opt: str) -> None:
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    full_push(chunked, 0, grad_for(job, 0, 1))
    full_push(plain, 0, grad_for(job, 0, 1))
    t = begin(chunked, 1)
    stream(chunked, t, grad_for(job, 1, 1))
    with chunked.cond:
        snap = chunked.durability.snapshot()
    for k, v in masters(plain).items():
        assert torch.equal(snap["masters"][k], v)
    chunked.intake.add_verdict(t, False)
    chunked.intake.finish_push(t)
    t.release()
    full_push(plain, 1, grad_for(job, 1, 1))
    assert chunked.state_digest() == plain.state_digest()


def test_several_rounds_with_workers_interleaved_match_plain_sync(opt: str) -> None:
    """Two workers stream slot by slot, alternating, for five rounds."""
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    for clock in range(1, 6):
        gs = [grad_for(job, w, clock) for w in (0, 1)]
        ts = [begin(chunked, w, clock) for w in (0, 1)]
        for key in reversed(gs[0]):
            for w in (1, 0) if clock % 2 else (0, 1):
                stream(chunked, ts[w], gs[w], [key])
        chunked.policy.quiesce()
        for w in (0, 1):
            chunked.intake.add_verdict(ts[w], False)
            chunked.intake.finish_push(ts[w])
            ts[w].release()
            full_push(plain, w, gs[w], clock)
        assert chunked.state_digest() == plain.state_digest()
    assert chunked.stats()["chunks_applied_early"] == 5 * len(job.slots)


def test_a_retried_duplicate_push_keeps_the_early_slots(opt: str) -> None:
    """A worker whose reply was lost re-sends its accepted push (retry=True): the retry is
    acknowledged and dropped, and the slots already updated stay updated."""
    job = make_job("sync", optimizer=opt, num_workers=2)
    chunked, plain = pair(job)
    g0, g1 = grad_for(job, 0, 1), grad_for(job, 1, 1)
    full_push(chunked, 0, g0)
    t = begin(chunked, 1)
    stream(chunked, t, g1, list(reversed(g1))[:2])
    chunked.policy.quiesce()
    h = PushHeader(worker=0, clock=1, base_version=0, dtype=torch.float32, retry=True)
    dup = chunked.intake.begin_push(h)
    stream(chunked, dup, g0)
    _, _, already = chunked.intake.finish_push(dup)
    dup.release()
    assert already and chunked.stats()["chunk_undos"] == 0
    assert chunked.stats()["chunks_applied_early"] == 2
    stream(chunked, t, g1, list(reversed(g1))[2:])
    chunked.intake.add_verdict(t, False)
    chunked.intake.finish_push(t)
    t.release()
    for w, g in ((0, g0), (1, g1)):
        full_push(plain, w, g)
    assert chunked.state_digest() == plain.state_digest()
    assert chunked.stats()["chunk_undos"] == 0


def test_workers_streaming_concurrently_end_with_the_same_bits(opt: str) -> None:
    """Three workers on their own threads stream six rounds at once (the applier thread
    racing them), one of them overflowing in round 4; then the same pushes one after
    another into a plain sync shard."""
    job = make_job("sync", optimizer=opt, num_workers=3)
    chunked, plain = pair(job)
    rounds = 6

    def overflow(w: int, clock: int) -> bool:
        return (w, clock) == (2, 4)

    def worker(w: int) -> None:
        for clock in range(1, rounds + 1):
            full_push(chunked, w, grad_for(job, w, clock), clock, overflow(w, clock))
            pull_until(chunked, w, clock)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    for clock in range(1, rounds + 1):
        for w in range(3):
            full_push(plain, w, grad_for(job, w, clock), clock, overflow(w, clock))
    assert chunked.rounds == plain.rounds == rounds and chunked.skipped_rounds == 1
    assert chunked.state_digest() == plain.state_digest()


def pull_until(st: ShardState, worker: int, clock: int) -> None:
    st.pulls.pull(worker, clock, torch.float32, timeout=30.0)
