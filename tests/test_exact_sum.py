"""fp16 sync rounds summed exactly as pushes arrive (issue #36, ps/server/modes/exact_sum.py).

Through the shard's own intake (begin_push / add_data / add_verdict / finish_push, as
both doors drive it): the same pushes delivered in every order, whole or with their pieces
interleaved, by 2 to 8 workers, give bit-identical masters, equal to the exact mean
rounded once for any number of workers (which the rank-order fp32 sum of wide-ranging fp16
values is not); the gradient memory is the same for 2 workers as for 8 (pushes one after another); a push
that is not accepted (cancelled, cut off, non-finite, malformed, superseded) leaves the
sum and the masters untouched; an overflow skips the round; bad input is refused naming what
to do; per-chunk rounds, checkpoints and a restore mid-round keep the same bits.
"""

from __future__ import annotations

import itertools
import random
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from psar.ps import wire
from psar.ps.errors import FailedPrecondition, InvalidArgument, PSError
from psar.ps.headers import PushHeader
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.durability.checkpoints import CheckpointManager
from psar.ps.server.modes import exact_sum
from psar.ps.server.modes.exact_sum import UNIT, ExactSum, fixed_point, into_fixed
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig
from tests.ps_fixtures import pull

PARAMS = [("w", 700), ("b", 37), ("v", 300)]
CHUNK = 1024  # bytes: 256-element slots, so every push has several
SCALE = 2.0**-3  # every push's loss scale (the shard's own, as in sync)
PIECE = 100  # elements per piece
SGD = OptimizerConfig(name="sgd", lr=1.0, momentum=0.0, impl="fused")


def _job(workers: int, optimizer: OptimizerConfig = SGD) -> Job:
    slots = plan_slots(PARAMS, 1, chunk_bytes=CHUNK)
    ls = LossScaleConfig(enabled=True, init_scale=SCALE, growth_interval=1000)
    return Job(mode="sync", num_workers=workers, optimizer=optimizer, loss_scale=ls,
               slots=slots, job_id="exact")  # fmt: skip


def _wide_fp16(numel: int, rng: torch.Generator) -> torch.Tensor:
    """fp16 values over the whole finite range (subnormals to 65504), any sign: sums of
    them in fp32 round, and differently in different orders."""
    bits = torch.randint(0, 0x7BFF + 1, (numel,), generator=rng, dtype=torch.int32)
    sign = torch.randint(0, 2, (numel,), generator=rng, dtype=torch.int32) << 15
    return (bits | sign).to(torch.int16).view(torch.float16)


def _grads(job: Job, workers: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    rng = torch.Generator().manual_seed(seed)
    return [{s.key: _wide_fp16(s.numel, rng) for s in job.slots} for _ in range(workers)]


def _shard(job: Job, **kw: object) -> ShardState:
    st = ShardState(**kw)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(7)
    st.init(job, {s.key: torch.randn(s.numel, generator=g) for s in job.slots})
    return st


def _header(w: int, clock: int, base: int, **kw: object) -> PushHeader:
    return PushHeader(worker=w, clock=clock, base_version=base, dtype=torch.float16,
                      loss_scale=SCALE, **kw)  # type: ignore[arg-type]  # fmt: skip


def _pieces(w: int, grads: dict[str, torch.Tensor]) -> list[tuple[int, str, int, bytes]]:
    out = []
    for key, t in grads.items():
        for off, data in wire.iter_pieces(t, PIECE * 2):
            out.append((w, key, off, data))
    return out


def _round(st: ShardState, grads: list[dict[str, torch.Tensor]], order: list[int],
           interleave: random.Random | None = None, clock: int = 1) -> None:  # fmt: skip
    """Every worker's push of `clock`, begun in `order`; the pieces whole push after
    whole push in that order, or shuffled across workers (each slot's in order)."""
    base = st.version
    tickets = {w: st.intake.begin_push(_header(w, clock, base), lock_timeout=5) for w in order}
    events = [p for w in order for p in _pieces(w, grads[w])]
    if interleave is not None:
        queues = {w: [p for p in events if p[0] == w] for w in order}
        events = []
        while any(queues.values()):
            w = interleave.choice([w for w in order if queues[w]])
            events.append(queues[w].pop(0))
    try:
        for w, key, off, data in events:
            st.intake.add_data(tickets[w], key, off, data)
        for w in order:
            st.intake.finish_push(tickets[w])
    finally:
        for t in tickets.values():
            t.release()


def _exact_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The mean of fp16 values / SCALE as documented: the exact sum divided by the count
    and the scale, rounded once to fp32 (nearest, ties to even), for any count. For a
    power-of-two count that is also the integer sum converted once to fp32, divided once."""
    ints = torch.stack([(t.to(torch.float32) * UNIT).to(torch.int64) for t in values]).sum(0)
    n = len(values)
    if n & (n - 1) == 0:
        mean = ints.to(torch.float32) / (UNIT * SCALE * n)
        exact = (ints.to(torch.float64) / (UNIT * SCALE * n)).to(torch.float32)
        assert torch.equal(mean, exact)
        return mean
    div = Fraction(UNIT) * Fraction(SCALE) * n
    return torch.tensor([_round_fp32(Fraction(a) / div) for a in ints.tolist()])


def _round_fp32(x: Fraction) -> float:
    """`x` rounded to the nearest fp32 (ties to even), by exact comparison with the
    fp32 values around fp64's nearest (independent of the shard's arithmetic)."""
    c = torch.tensor(float(x), dtype=torch.float32)
    cands = [c, torch.nextafter(c, c.new_tensor(float("inf"))),
             torch.nextafter(c, c.new_tensor(float("-inf")))]  # fmt: skip
    best = min(cands, key=lambda v: (abs(Fraction(v.item()) - x), int(v.view(torch.int32)) & 1))
    return best.item()


def _masters(st: ShardState) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in st.masters.items()}


@pytest.mark.parametrize("workers", range(2, 9))
def test_every_arrival_order_gives_the_same_bits(workers: int) -> None:
    job = _job(workers)
    grads = _grads(job, workers)
    orders = list(itertools.permutations(range(workers)))
    rng = random.Random(workers)
    if len(orders) > 8:
        orders = [orders[0], orders[-1], *rng.sample(orders, 6)]
    digests, ref = set(), None
    for i, order in enumerate(orders):
        for interleave in (None, random.Random(i)):
            st = _shard(job)
            before = _masters(st)
            _round(st, grads, list(order), interleave)
            assert st.version == 1
            digests.add(st.state_digest())
            ref = ref or (st, before)
    assert len(digests) == 1, f"{workers} workers: {len(digests)} different results"
    # The masters are the exact mean, rounded once, stepped by SGD (lr 1): w - mean.
    st, before = ref
    for s in job.slots:
        mean = _exact_mean([g[s.key] for g in grads])
        p = torch.nn.Parameter(before[s.key].clone())
        p.grad = mean
        torch.optim.SGD([p], lr=1.0, fused=True).step()
        assert torch.equal(st.masters[s.key].detach(), p.detach()), s.key


def test_the_exact_sum_is_more_exact_than_the_rank_order_sum() -> None:
    """The same pushes into a shard summing in rank order in fp32 (--no-exact-fp16-sum,
    the behaviour before #36) end elsewhere: fp32 rounds sums of wide-ranging values."""
    job = _job(8)
    grads = _grads(job, 8)
    exact, ordered = _shard(job), _shard(job, exact_fp16_sum=False)
    for st in (exact, ordered):
        _round(st, grads, list(range(8)))
    assert exact.state_digest() != ordered.state_digest()
    assert exact.stats()["version"] == ordered.stats()["version"] == 1


def test_gradient_memory_does_not_grow_with_workers() -> None:
    """Measured: the shard's gradient bytes (Stats gradient_bytes) after a round of 2
    and of 8 workers. Pushes one after another: the same for 2 and 8 with the exact sum
    (12 bytes per parameter: sums and means; one push's fp16 scratch); staged in rank order, 4 bytes per
    parameter per worker. All pushes streaming at once: each holds its fp16 bytes (2 per
    parameter) until it is accepted, half of what staging holds until the close."""
    numel = sum(n for _, n in PARAMS)
    held = {}
    for exact in (True, False):
        for workers in (2, 8):
            for together in (False, True):
                job = _job(workers)
                st = _shard(job, exact_fp16_sum=exact)
                grads = _grads(job, workers)
                if together:
                    _round(st, grads, list(range(workers)))
                else:
                    for w in range(workers):
                        _round(st, grads, [w])
                assert st.version == 1
                held[exact, workers, together] = st.stats()["gradient_bytes"]
    assert held[True, 2, False] == held[True, 8, False] == 12 * numel + 2 * numel
    assert held[True, 8, True] == 12 * numel + 2 * numel * 8
    for together in (False, True):
        assert held[False, 8, together] == 4 * numel * 8
        assert held[False, 2, together] == 4 * numel * 2


def _sum_state(st: ShardState) -> tuple:
    """What the round's exact sum holds: its int64 sums and who counted in each slot."""
    e = st.policy.exact
    assert e is not None
    sums = {k: e.total(k) for k in e.numel}
    return sums, {k: set(v) for k, v in e.counted.items() if v}, e.round


def _same_sum(a: tuple, b: tuple) -> bool:
    return a[1:] == b[1:] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def _cut(st: ShardState, w: int, grads: dict[str, torch.Tensor], slots: int) -> None:
    """`w`'s push of round 1: its first `slots` slots arrive whole, then it is cut off."""
    t = st.intake.begin_push(_header(w, 1, 0), lock_timeout=5)
    try:
        for _, key, off, data in _pieces(w, {k: grads[k] for k in list(grads)[:slots]}):
            st.intake.add_data(t, key, off, data)
    finally:
        t.release()


def test_a_push_not_accepted_leaves_the_sum_and_masters_untouched() -> None:
    """Worker 0's push is in; worker 1's is cancelled, cut off mid-push, non-finite,
    malformed, superseded by its own re-send, or names a non-zero slot absent: after
    each, the round's int64 sums, who counted, and the masters are bit for bit what they
    were; the round then ends with the bits of a round that never saw them."""
    job = _job(3)
    grads = _grads(job, 3)
    keys = list(grads[1])
    clean = _shard(job)
    _round(clean, grads, [0, 1, 2])
    st = _shard(job)
    _round(st, grads, [0])
    before, masters = _sum_state(st), st.state_digest()
    assert before[1] == {k: {0} for k in keys}

    def untouched(what: str) -> None:
        assert _same_sum(_sum_state(st), before), what
        assert st.state_digest() == masters, what

    for slots in (0, 2, len(keys)):  # cancelled after its header, some slots, every slot
        _cut(st, 1, grads[1], slots)
        untouched(f"cut after {slots} slots")
    nonfinite = {k: v.clone() for k, v in grads[1].items()}
    nonfinite[keys[-1]][5] = float("inf")  # the last slot: the others were summed already
    with pytest.raises(InvalidArgument, match="non-finite"):
        _round(st, [grads[0], nonfinite], [1])
    untouched("non-finite")
    t = st.intake.begin_push(_header(1, 1, 0), lock_timeout=5)
    try:
        for _, key, off, data in _pieces(1, {k: grads[1][k] for k in keys[:2]}):
            st.intake.add_data(t, key, off, data)
        with pytest.raises(InvalidArgument):  # a piece past its slot's end
            st.intake.add_data(t, keys[2], 10_000, b"\0\0" * 4)
    finally:
        t.release()
    untouched("malformed")
    t = st.intake.begin_push(_header(1, 1, 0, verdict_follows=True), lock_timeout=5)
    try:
        for _, key, off, data in _pieces(1, grads[1]):
            st.intake.add_data(t, key, off, data)
        with pytest.raises(InvalidArgument, match="send zeros for a slot with no gradient"):
            st.intake.add_verdict(t, False, (keys[1],))
    finally:
        t.release()
    untouched("absent but not zeros")
    # Superseded: a re-send waits for the worker's lock while the stalled push is cut
    # off (as a door does); the stalled push's slots are withdrawn before it goes on.
    stalled = st.intake.begin_push(_header(1, 1, 0), lock_timeout=5)
    for _, key, off, data in _pieces(1, {k: grads[1][k] for k in keys[:2]}):
        st.intake.add_data(stalled, key, off, data)
    seen: list[tuple] = []

    def resend() -> None:
        t = st.intake.begin_push(_header(1, 1, 0), lock_timeout=5)
        seen.append(_sum_state(st))
        try:
            for _, key, off, data in _pieces(1, grads[1]):
                st.intake.add_data(t, key, off, data)
            st.intake.finish_push(t)
        finally:
            t.release()

    thread = threading.Thread(target=resend)
    thread.start()
    stalled.release()
    thread.join(10)
    assert _same_sum(seen[0], before), "superseded"
    assert st.version == 0
    _round(st, grads, [2])
    assert st.state_digest() == clean.state_digest()


def test_an_overflow_skips_the_round_and_the_next_round_sums_from_zero() -> None:
    job = _job(3)
    a, b = _grads(job, 3, seed=1), _grads(job, 3, seed=2)
    st, clean = _shard(job), _shard(job)
    base = st.version
    for w in (0, 1):  # data arrives, then worker 2's overflow
        t = st.intake.begin_push(_header(w, 1, base, verdict_follows=True), lock_timeout=5)
        for _, key, off, data in _pieces(w, a[w]):
            st.intake.add_data(t, key, off, data)
        st.intake.add_verdict(t, False)
        st.intake.finish_push(t)
        t.release()
    t = st.intake.begin_push(_header(2, 1, base, overflow=True), lock_timeout=5)
    st.intake.finish_push(t)
    t.release()
    assert (st.version, st.rounds, st.skipped_rounds) == (0, 1, 1)
    assert st.loss_scale.scale == SCALE / 2
    # The scale the workers pulled goes with round 2; the skipped round left nothing.
    clean.loss_scale.scale = SCALE / 2
    for s, r in ((st, 2), (clean, 1)):
        base = s.version
        tickets = [s.intake.begin_push(PushHeader(worker=w, clock=r, base_version=base,
                   dtype=torch.float16, loss_scale=SCALE / 2), lock_timeout=5) for w in range(3)]  # fmt: skip
        for w, t in enumerate(tickets):
            for _, key, off, data in _pieces(w, b[w]):
                s.intake.add_data(t, key, off, data)
            s.intake.finish_push(t)
            t.release()
    assert torch.equal(torch.cat([p.detach() for p in st.masters.values()]),
                       torch.cat([p.detach() for p in clean.masters.values()]))  # fmt: skip


def test_bad_pushes_are_refused_saying_what_to_do() -> None:
    job = _job(2)
    grads = _grads(job, 2)
    st = _shard(job)
    before = _masters(st)
    # A non-finite slot without the overflow flag (checked before it is added).
    bad = {k: v.clone() for k, v in grads[1].items()}
    bad[next(iter(bad))][3] = float("inf")
    with pytest.raises(InvalidArgument, match="non-finite"):
        _round(st, [grads[0], bad], [1])
    # Another loss scale than the round's.
    _round(st, grads, [0])  # worker 0 opens the round, scaled by SCALE
    h = PushHeader(worker=1, clock=1, base_version=0, dtype=torch.float16, loss_scale=1.0)
    with pytest.raises(FailedPrecondition, match="scale by the loss scale of your last pull"):
        st.intake.begin_push(h, lock_timeout=5)
    # A loss scale so small that fp16 values unscaled by it could overflow fp32 (the
    # mean converted at the close would be inf; the hostile sync campaign, seed 36).
    for tiny in (2.0**-113, 1e-45, 5e-324):
        h = PushHeader(worker=1, clock=1, base_version=0, dtype=torch.float16, loss_scale=tiny)
        with pytest.raises(InvalidArgument, match="below 2\\^-112"):
            st.intake.begin_push(h, lock_timeout=5)
    # One so large that the close's divisor (2^24 x scale x workers) would be inf in fp32
    # and the mean 0: refused at the header, as the first push of a round too (below).
    for huge in (2.0**65, 1e38, 3.0e38):
        h = PushHeader(worker=1, clock=1, base_version=0, dtype=torch.float16, loss_scale=huge)
        with pytest.raises(InvalidArgument, match="above 2\\^64"):
            st.intake.begin_push(h, lock_timeout=5)
    # Another dtype than the round's.
    h = PushHeader(worker=1, clock=1, base_version=0, dtype=torch.float32, loss_scale=SCALE)
    with pytest.raises(FailedPrecondition, match="every worker must push in the same dtype"):
        st.intake.begin_push(h, lock_timeout=5)
    assert st.version == 0 and all(torch.equal(before[k], p) for k, p in _masters(st).items())
    # A verdict naming absent a slot whose data was not zeros.
    t = st.intake.begin_push(_header(1, 1, 0, verdict_follows=True), lock_timeout=5)
    for _, key, off, data in _pieces(1, grads[1]):
        st.intake.add_data(t, key, off, data)
    with pytest.raises(InvalidArgument, match="send zeros for a slot with no gradient"):
        st.intake.add_verdict(t, False, (next(iter(grads[1])),))
    t.release()
    _round(st, grads, [1])  # the honest push closes the round
    assert st.version == 1


def test_a_slot_no_worker_used_is_not_stepped() -> None:
    """Absent in every push (header or verdict): not stepped at all (DDP's unused
    parameter); absent in some: their zeros count in its mean."""
    opt = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1, impl="fused")
    job = _job(2, opt)
    grads = _grads(job, 2)
    keys = list(grads[0])
    st = _shard(job)
    before = _masters(st)
    base = st.version
    for w in (0, 1):
        g = {k: (torch.zeros_like(v) if k == keys[0] or (w and k == keys[1]) else v)
             for k, v in grads[w].items()}  # fmt: skip
        verdict = w == 1
        h = _header(w, 1, base, verdict_follows=verdict,
                    absent=() if verdict else (keys[0],))  # fmt: skip
        t = st.intake.begin_push(h, lock_timeout=5)
        for _, key, off, data in _pieces(w, g):
            st.intake.add_data(t, key, off, data)
        if verdict:
            st.intake.add_verdict(t, False, (keys[0], keys[1]))
        st.intake.finish_push(t)
        t.release()
    assert torch.equal(st.masters[keys[0]].detach(), before[keys[0]])
    assert st.masters[keys[0]] not in st.optimizer.state
    assert not torch.equal(st.masters[keys[1]].detach(), before[keys[1]])


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_per_chunk_rounds_and_threads_give_the_same_bits(opt: str) -> None:
    cfg = OptimizerConfig(name=opt, lr=0.01, momentum=0.9, weight_decay=0.01)
    job = _job(4, cfg)
    rounds = [_grads(job, 4, seed=s) for s in range(3)]
    digests = set()
    for kw in ({}, {"chunk_rounds": True}, {"update_threads": 3}, {"chunk_rounds": True,
               "update_threads": 2}):  # fmt: skip
        st = _shard(job, **kw)
        for r, grads in enumerate(rounds, start=1):
            order = random.Random(r).sample(range(4), 4)
            _round(st, grads, order, random.Random(r), clock=r)
            pull(st, 0, r, timeout=5.0)
        st.policy.quiesce()
        digests.add(st.state_digest())
    assert len(digests) == 1


def test_a_restore_or_rollback_mid_round_drops_the_partial_sum(tmp_path: Path) -> None:
    """A shard half-way through summing a round is restored from a checkpoint (a fresh
    shard, as after a crash) or rolled back (in place); the rounds pushed again give the
    bits of a run that never stopped."""
    job = _job(3)
    a, b, c = (_grads(job, 3, seed=s) for s in (4, 5, 6))
    straight = _shard(job)
    for r, g in enumerate((a, b, c), start=1):
        _round(straight, g, [2, 0, 1], clock=r)
    st = _shard(job, checkpoints=CheckpointManager(tmp_path, every=1))
    _round(st, a, [1, 2, 0])
    st.checkpoints.flush()
    with st.cond:
        snap, step = st.durability.snapshot(), st.durability.checkpoint_step
    _round(st, b, [0, 1, 2], clock=2)
    _round(st, c, [0, 1], clock=3)  # worker 2 has not pushed round 3: half summed
    assert st.policy.exact is not None and st.policy.exact.counted
    back = ShardState()
    back.durability.restore(step, snap)
    assert st.durability.rollback(max_round=1)["rolled_back"]
    for shard in (back, st):
        for r, g in ((2, b), (3, c)):
            _round(shard, g, [1, 2, 0], clock=r)
        assert shard.state_digest() == straight.state_digest()
    st.checkpoints.close()


def test_exact_sum_unit() -> None:
    """ExactSum alone: integer sums of fp16 values, means rounded once, a round's
    commits only, and 12 bytes per element (sums, means)."""
    s = ExactSum({"k": 5})
    s.open(1, 1.0, shard_scale=1.0)
    vals = [torch.tensor([65504.0, 2.0**-24, -1.0, 0.5, 3.0], dtype=torch.float16),
            torch.tensor([-65504.0, 2.0**-24, 1.0, 0.25, 0.0], dtype=torch.float16),
            torch.tensor([1.0, -(2.0**-24), 2.0**-14, 0.0, 1e-3], dtype=torch.float16)]  # fmt: skip
    for w, v in enumerate(vals):
        s.add(w, 1, "k", v)
    s.add(0, 2, "k", vals[0])  # another round's: dropped
    want = [Fraction(sum(Fraction(float(v[i])) for v in vals)) / 3 for i in range(5)]
    got = s.mean("k", out=torch.empty(5))
    for g, w in zip(got.tolist(), want, strict=True):
        assert abs(Fraction(g) - w) <= abs(w) * Fraction(1, 2**23)  # within the last bit
    assert got[0].item() == pytest.approx(1 / 3)  # 65504 - 65504 + 1: no cancellation lost
    assert s.nbytes() == 5 * (8 + 4)  # the sums, and the mean buffer
    s.close({0, 1, 2})
    s.add(1, 1, "k", vals[0])  # after the close: dropped
    assert torch.equal(s.mean("k", out=torch.empty(5)), got)


def test_a_mean_converted_on_arrival_is_converted_again_when_the_sum_changes() -> None:
    """The last expected worker's slot converts the mean at once (the close finds it);
    a withdrawn push makes it stale and the next mean is of what the sum holds then."""
    n = 3000
    rng = torch.Generator().manual_seed(9)
    vals = [_wide_fp16(n, rng) for _ in range(3)]
    s = ExactSum({"k": n})
    s.open(1, SCALE, expected=3, shard_scale=SCALE)
    for w, v in enumerate(vals):
        s.add(w, 1, "k", v)
    assert s._ready["k"] == s._changed["k"]  # converted as the third arrived
    assert torch.equal(s.mean("k"), _exact_mean(vals))
    s.withdraw(2, 1)
    assert torch.equal(s.mean("k", out=torch.empty(n)), _exact_mean(vals[:2]))
    assert s.nbytes() == n * (8 + 4)


def test_a_worker_that_leaves_mid_push_is_withdrawn_at_the_close() -> None:
    """Worker 2's push has two slots in the sum when it leaves; the round closes with
    workers 0 and 1: their mean alone (as a 2-worker round), nothing of worker 2's."""
    job3, job2 = _job(3), _job(2)
    grads = _grads(job3, 3)
    two = _shard(job2)
    _round(two, grads[:2], [1, 0])
    st = _shard(job3)
    t = st.intake.begin_push(_header(2, 1, 0), lock_timeout=5)
    try:
        for _, key, off, data in _pieces(2, {k: grads[2][k] for k in list(grads[2])[:2]}):
            st.intake.add_data(t, key, off, data)
        _round(st, grads, [0, 1])
        assert st.version == 0  # waits for worker 2
        st.members.leave(2)
        assert st.version == 1
    finally:
        t.release()  # its push ends after the close: refused at its end, changes nothing
    assert torch.equal(torch.cat([p.detach() for p in st.masters.values()]),
                       torch.cat([p.detach() for p in two.masters.values()]))  # fmt: skip


def _push(st: ShardState, w: int, grads: dict[str, torch.Tensor]) -> None:
    """`w`'s whole push of round 1 in its grads' dtype (fp16 or fp32), accepted."""
    dtype = next(iter(grads.values())).dtype
    h = PushHeader(worker=w, clock=1, base_version=0, dtype=dtype, loss_scale=SCALE)
    t = st.intake.begin_push(h, lock_timeout=5)
    try:
        for _, key, off, data in _pieces(w, grads):
            st.intake.add_data(t, key, off, data)
        st.intake.finish_push(t)
    finally:
        t.release()


def _refused_first(st: ShardState, how: str, grads: dict[str, torch.Tensor]) -> None:
    """Worker 1's push opens round 1 and is not accepted, `how`."""
    keys = list(grads)
    dtype = torch.float32 if how == "fp32 cut" else torch.float16
    scale = 2 * SCALE if how == "other scale" else SCALE
    absent = ("nope#0",) if how == "unknown absent" else ()
    h = PushHeader(worker=1, clock=1, base_version=0, dtype=dtype, loss_scale=scale,
                   absent=absent)  # fmt: skip
    if how == "unknown absent":
        with pytest.raises(PSError, match="absent slot 'nope#0' is not on this shard"):
            st.intake.begin_push(h, lock_timeout=5)
        return
    if how == "other scale":  # not the shard's: refused at its header, first or not
        with pytest.raises(FailedPrecondition, match=f"scaled by {SCALE} \\(the shard's"):
            st.intake.begin_push(h, lock_timeout=5)
        return
    t = st.intake.begin_push(h, lock_timeout=5)
    try:
        pieces = _pieces(1, {k: grads[k].to(dtype) for k in keys[:2]})
        for _, key, off, data in pieces:
            st.intake.add_data(t, key, off, data)
        if how == "bad piece":  # refused mid-stream, as the hostile campaign's push was
            with pytest.raises(InvalidArgument, match="expected"):
                st.intake.add_data(t, keys[2], 1, b"\0\0")
    finally:
        t.release()  # never finished: not accepted


@pytest.mark.parametrize("how", ["cut", "bad piece", "other scale", "unknown absent", "fp32 cut"])
def test_a_refused_first_push_does_not_decide_how_its_round_sums(how: str) -> None:
    """Issue #36 item 3 (the hostile sync campaign, seed 1809): the first push of a round
    decides whether it sums exactly (fp16) or in rank order (fp32, bf16), and the exact
    sum's loss scale. One that is then not accepted (cut off, refused mid-stream or at
    its header, scaled otherwise) must decide nothing: the round's honest pushes, in
    another dtype or scale, are accepted and give the bits of a shard that never saw it.
    (Before the fix its dtype and scale stayed, and the honest pushes were refused
    FAILED_PRECONDITION, or an fp16 round was summed in rank order.)"""
    job = _job(3)  # 3: the rank-order fp32 sum rounds twice, the exact sum once
    grads = _grads(job, 3)
    if how in ("cut", "bad piece", "unknown absent"):  # then a round of fp32 pushes
        grads = [{k: (v.float() * SCALE).clamp(-1e4, 1e4) for k, v in g.items()} for g in grads]
    clean, st = _shard(job), _shard(job)
    _refused_first(st, how, grads[1])
    assert st.version == 0 and st.state_digest() == clean.state_digest()
    ordered = _shard(job, exact_fp16_sum=False)
    for s in (st, clean, ordered):
        for w in (0, 1, 2):
            _push(s, w, grads[w])
        assert s.version == 1
    assert st.state_digest() == clean.state_digest()
    if how == "fp32 cut":  # the round was summed exactly, as an fp16 round is
        assert ordered.state_digest() != st.state_digest()


@pytest.mark.parametrize("scale", [SCALE * 2, SCALE / 2, 1.0])
def test_a_whole_first_push_at_another_scale_than_the_shards_is_refused(scale: float) -> None:
    """A broken worker's push opens round 1 at a scale the shard's pulls never gave, and
    would complete: it is refused at its header (FAILED_PRECONDITION, the shard's scale
    named), so it cannot fix the round's scale and get the honest pushes refused; they
    then give the bits of a shard that never saw it."""
    job = _job(2)
    grads = _grads(job, 2, seed=5)
    clean, st = _shard(job), _shard(job)
    h = PushHeader(worker=1, clock=1, base_version=0, dtype=torch.float16, loss_scale=scale)
    with pytest.raises(FailedPrecondition, match="scale by the loss scale of your last pull"):
        st.intake.begin_push(h, lock_timeout=5)
    assert st.policy.exact is None or st.policy.exact.scale is None
    for s in (st, clean):
        for w in (0, 1):
            _push(s, w, grads[w])
        assert s.version == 1
    assert st.state_digest() == clean.state_digest()


def test_a_slot_is_applied_early_only_once_every_workers_part_is_in_the_sum() -> None:
    """Per-chunk rounds (CI, stop 39): worker 0's slot was marked finite before its add
    reached the exact sum, and worker 1 completing the same slot in that gap had the
    slot stepped from worker 1's gradient alone (the close kept it). Forced here: worker
    1's last piece of the slot lands, and the early update runs, inside worker 0's add."""
    job = _job(2)
    grads = _grads(job, 2, seed=3)
    whole = _shard(job)
    _round(whole, grads, [0, 1])
    st = _shard(job, chunk_rounds=True)
    key = job.slots[0].key
    tickets = {w: st.intake.begin_push(_header(w, 1, 0), lock_timeout=5) for w in (0, 1)}
    last = {w: [p for p in _pieces(w, grads[w]) if p[1] == key][-1] for w in (0, 1)}
    try:
        for w, k, off, data in _pieces(1, grads[1]):
            if (w, k, off, data) != last[1]:
                st.intake.add_data(tickets[1], k, off, data)
        exact = st.policy.exact
        assert exact is not None
        real_add = exact.add

        def add(worker: int, round_: int, k: str, values: torch.Tensor) -> None:
            if worker == 0 and k == key:  # the gap: worker 1's slot completes now
                _, _, off1, data1 = last[1]
                st.intake.add_data(tickets[1], key, off1, data1)
                st.policy.quiesce()  # any early update it queued has run
            real_add(worker, round_, k, values)

        exact.add = add  # type: ignore[method-assign]
        for _, k, off, data in _pieces(0, grads[0]):
            st.intake.add_data(tickets[0], k, off, data)
        st.policy.quiesce()
        assert st.policy.chunks_early == len(job.slots)  # every slot applied early
        for w in (0, 1):
            st.intake.finish_push(tickets[w])
    finally:
        for t in tickets.values():
            t.release()
    assert st.state_digest() == whole.state_digest()


@pytest.mark.parametrize("n", [1, exact_sum.CHUNK - 1, exact_sum.CHUNK, 2 * exact_sum.CHUNK + 7])
def test_the_chunked_conversion_adds_subtracts_and_copies_the_whole_slot(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    values = (torch.randn(n, generator=g) * 1e3).half()
    start = torch.randint(-(2**40), 2**40, (n,), generator=g)
    for op, want in ((torch.Tensor.add_, start + fixed_point(values)),
                     (torch.Tensor.sub_, start - fixed_point(values)),
                     (torch.Tensor.copy_, fixed_point(values))):  # fmt: skip
        acc = start.clone()
        into_fixed(acc, values, op)
        assert torch.equal(acc, want), op


def test_a_round_first_push_with_a_loss_scale_past_fp32s_mean_is_refused_and_decides_nothing() -> (
    None
):
    # A broken first push must not set the round's scale (the shard's is), or the
    # close would divide by inf (a mean of 0) and honest pushes be refused for their scale.
    s = ExactSum({"w": 4})
    with pytest.raises(InvalidArgument, match="above 2\\^64"):
        s.open(1, 2.0**90, expected=2, shard_scale=SCALE)
    assert s.scale is None
    s.open(1, SCALE, expected=2, shard_scale=SCALE)
    assert s.scale == SCALE
    s.open(1, SCALE, expected=2, shard_scale=SCALE)  # the round's second push, same scale


@pytest.mark.parametrize("count", [3, 5, 6, 7, 12, 100, 3 * 4096])
def test_the_mean_is_the_correctly_rounded_mean_of_the_exact_sum(count: int) -> None:
    """Issue #45 defect 18: a 3-worker fp16 round's mean was the exact sum rounded to fp32,
    then divided (98 of 1,024 elements an ulp off). Now: the exact sum divided, rounded
    once, for any count, wide-ranging values and sums near the largest (the far path)."""
    rng = torch.Generator().manual_seed(count)
    vals = [_wide_fp16(400, rng) for _ in range(count)]
    acc = torch.stack([fixed_point(v) for v in vals]).sum(0)
    top = int(fixed_point(torch.tensor([65504.0], dtype=torch.float16))) * count
    acc[:8] = torch.tensor([top - i for i in range(8)])  # |q| >= 2^25: the sticky path
    acc[8:12] = torch.tensor([1, -1, count + 1, -(3 * count) // 2])  # tiny, and ties
    for scale in (SCALE, 1.0, 2.0**20):
        div = Fraction(UNIT) * Fraction(scale) * count
        want = torch.tensor([_round_fp32(Fraction(a) / div) for a in acc.tolist()])
        got = exact_sum.exact_mean(acc, count, UNIT * scale, out=torch.empty(400))
        assert torch.equal(got, want), (got != want).sum().item()
