"""A user's own optimizer on the shards (worker/own_loop.py), without a socket: parameter
groups with hyper-parameters of their own, each step's learning rates shipped with its
push, clipping by the global norm (held rounds and RoundNorm in sync, a push's own norm
in async), and the optimizer's state read back and restored with an Init.

Every reference is torch's own optimizer of the same class over the same groups, stepped
with the same numbers: the shard must hold exactly what it holds."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from psar.ps.errors import DeadlineExceeded, InvalidArgument
from psar.ps.headers import PushHeader
from psar.ps.job import Job
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import OptimizerConfig, ParamGroup, StepOptions
from tests.procs import run_ps_workers, shards
from tests.ps_fixtures import (
    grad_for,
    init_values,
    make_slots,
    masters,
    mean_in_rank_order,
    pull,
    weights_digest,
)
from tests.ps_fixtures import push as fixture_push

SGD_GROUPS = (
    ParamGroup(params=("w",), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ParamGroup(params=("b",), lr=0.05, momentum=0.5, dampening=0.1),
)
ADAMW_GROUPS = (
    ParamGroup(params=("w",), lr=0.01, beta1=0.8, beta2=0.99, weight_decay=0.1),
    ParamGroup(params=("b",), lr=0.003, eps=1e-6, amsgrad=True),
)
LRS = [(0.1, 0.05), (0.07, 0.0), (0.02, 0.2)]
"""Each step's learning rates, as a worker's LR scheduler changes them."""


def own_job(
    mode: str,
    name: str,
    *,
    shard: int = 0,
    num_shards: int = 1,
    workers: int = 2,
    step_options: bool = True,
) -> Job:
    groups = SGD_GROUPS if name == "sgd" else ADAMW_GROUPS
    slots = make_slots(num_shards=num_shards, shard=shard)
    held = {s.param for s in slots}
    return Job(
        mode=mode,
        num_workers=workers,
        optimizer=OptimizerConfig(name=name, lr=1.0, momentum=0.0),
        slots=slots,
        shard_index=shard,
        num_shards=num_shards,
        momentum_correction=False,
        step_options=step_options,
        param_groups=tuple(
            ParamGroup(**{**g.__dict__, "params": tuple(n for n in g.params if n in held)})
            for g in groups
        ),
    )


def push(st: ShardState, *, options: StepOptions, **kw: object):  # noqa: ANN201
    """tests.ps_fixtures.push with step options in the header (a whole push)."""
    real = st.intake.begin_push

    def begin(header: PushHeader, **k: object):  # noqa: ANN202
        header.options = options
        return real(header, **k)

    st.intake.begin_push = begin  # type: ignore[method-assign]
    try:
        return fixture_push(st, **kw)
    finally:
        st.intake.begin_push = real  # type: ignore[method-assign]


def reference(
    name: str, job: Job, values: dict[str, torch.Tensor], updates: list[tuple[dict, tuple]]
) -> dict[str, torch.Tensor]:
    """torch's optimizer over the whole parameters (not slots), with the job's groups;
    each update: (gradients by slot, the step's learning rates)."""
    slots = job.slots
    full = {}
    for param in dict.fromkeys(s.param for s in slots):
        parts = [values[s.key] for s in slots if s.param == param]
        full[param] = torch.nn.Parameter(torch.cat(parts).clone())
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    opt = cls(
        [
            {"params": [full[n] for n in g.params], **g.torch_options(name)}
            for g in job.param_groups
        ],
        foreach=False,
    )
    for grads, lrs in updates:
        for param, p in full.items():
            p.grad = torch.cat([grads[s.key] for s in slots if s.param == param]).clone()
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        opt.step()
    out, at = {}, dict.fromkeys(full, 0)  # the held slots of a parameter, in order
    for s in slots:
        out[s.key] = full[s.param].detach()[at[s.param] : at[s.param] + s.numel].clone()
        at[s.param] += s.numel
    return out


@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_groups_and_shipped_learning_rates_step_as_torch_does(name: str, mode: str) -> None:
    job = own_job(mode, name)
    values = init_values(job)
    st = ShardState()
    st.init(job, values)
    updates = []
    for clock, lrs in enumerate(LRS, start=1):
        grads = {w: grad_for(job, w, clock) for w in range(2)}
        base = st.version
        for w in range(2):
            push(st, options=StepOptions(lrs=lrs), worker=w, clock=clock, base_version=base,
                 grads=grads[w])  # fmt: skip
            if mode == "async":
                updates.append((grads[w], lrs))
        if mode == "sync":
            updates.append((mean_in_rank_order(grads), lrs))
    want = reference(name, job, values, updates)
    got = masters(st)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # The shard's own groups keep their configured learning rates (a checkpoint's).
    assert [g["lr"] for g in st.optimizer.param_groups] == [g.lr for g in job.param_groups]


def test_a_push_with_the_wrong_number_of_learning_rates_is_refused() -> None:
    st = ShardState()
    job = own_job("sync", "sgd")
    st.init(job, init_values(job))
    before = weights_digest(st)
    with pytest.raises(InvalidArgument, match="2 parameter groups"):
        push(st, options=StepOptions(lrs=(0.1,)), worker=0, clock=1, base_version=0,
             grads=grad_for(job, 0, 1))  # fmt: skip
    assert weights_digest(st) == before


def test_a_job_that_says_it_sends_step_options_is_refused_at_init_by_a_chunking_shard() -> None:
    # Rank 0 of a loop of its own (or with clipping) says so in the job: a shard started
    # with --chunk-rounds refuses the Init, naming the flag, and holds no job afterwards;
    # without the flag, or in a mode without rounds, the same job is served.
    job = own_job("sync", "sgd")
    st = ShardState(chunk_rounds=True)
    with pytest.raises(InvalidArgument, match="start the shards without --chunk-rounds"):
        st.init(job, init_values(job))
    assert not st.initialized
    plain = ShardState()
    assert plain.init(job, init_values(job)) is False
    unrounded = own_job("async", "sgd")
    assert ShardState(chunk_rounds=True).init(unrounded, init_values(unrounded)) is False
    with pytest.raises(ValueError, match="cannot have chunk_rounds"):
        dataclasses.replace(job, chunk_rounds=True)


def test_step_options_are_refused_by_a_shard_applying_chunks_early() -> None:
    # A job that did not say so (a client from before the field) is refused at the push.
    job = own_job("sync", "sgd", step_options=False)
    st = ShardState(chunk_rounds=True)
    st.init(job, init_values(job))
    with pytest.raises(InvalidArgument, match="--chunk-rounds"):
        push(st, options=StepOptions(clip_norm=1.0), worker=0, clock=1, base_version=0,
             grads=grad_for(job, 0, 1))  # fmt: skip


def clipped(grads: dict[str, torch.Tensor], max_norm: float) -> tuple[dict, float]:
    """What torch.nn.utils.clip_grad_norm_ makes of these gradients, and their norm."""
    ts = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in grads.items()}
    for k, p in ts.items():
        p.grad = grads[k].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(list(ts.values()), max_norm))
    return {k: p.grad for k, p in ts.items()}, norm


def test_sync_rounds_clip_by_the_norm_over_every_shard() -> None:
    # Two shards hold parts of the model; neither sees the whole norm. Each holds its
    # round's update, answers its part, and applies the update clipped once a pull brings
    # the total; a pull without it waits.
    jobs = [own_job("sync", "sgd", shard=i, num_shards=2) for i in range(2)]
    shards = []
    for job in jobs:
        st = ShardState()
        st.init(job, init_values(job))
        shards.append(st)
    before = [masters(st) for st in shards]
    grads = {w: {k: 10 * g for k, g in grad_for(jobs[0], w, 1).items()} for w in range(2)}
    grads1 = {w: {k: 10 * g for k, g in grad_for(jobs[1], w, 1).items()} for w in range(2)}
    for st, gs in zip(shards, (grads, grads1), strict=True):
        for w in range(2):
            push(st, options=StepOptions(lrs=(0.1, 0.05), clip_norm=0.5), worker=w, clock=1,
                 base_version=0, grads=gs[w])  # fmt: skip
    for st, old in zip(shards, before, strict=True):  # held: nothing applied yet
        assert st.rounds == 0 and all(torch.equal(masters(st)[k], v) for k, v in old.items())
        with pytest.raises(DeadlineExceeded):
            pull(st, 0, 1, timeout=0.2)
    parts = [st.pulls.round_norm(0, 1, 5.0) for st in shards]
    assert not any(skipped for _, skipped in parts)
    total = sum(part for part, _ in parts)
    mean = {**mean_in_rank_order(grads), **mean_in_rank_order(grads1)}
    want_grads, norm = clipped(mean, 0.5)
    assert norm > 0.5, "the test must clip"
    assert math.isclose(math.sqrt(total), norm, rel_tol=1e-6)
    for st, job in zip(shards, jobs, strict=True):
        st.pulls.release_held(1, total)
        st.pulls.release_held(1, total)  # the other worker's pull: already applied
        pull(st, 0, 1)
        assert st.rounds == 1
        # Asked again after the round applied (a slower worker): the same part.
        assert st.pulls.round_norm(1, 1, 5.0) == parts[shards.index(st)]
        want = reference("sgd", job, init_values(job),
                         [({k: want_grads[k] for k in st.masters}, (0.1, 0.05))])  # fmt: skip
        for k, v in want.items():
            torch.testing.assert_close(masters(st)[k], v, rtol=1e-6, atol=1e-7)


def test_async_clips_each_push_by_its_workers_own_norm() -> None:
    job = own_job("async", "sgd", workers=1)
    values = init_values(job)
    st = ShardState()
    st.init(job, values)
    g = {k: 10 * t for k, t in grad_for(job, 0, 1).items()}
    want_grads, norm = clipped(g, 0.5)
    push(st, options=StepOptions(lrs=(0.1, 0.05), clip_norm=0.5, grad_norm=norm), worker=0,
         clock=1, base_version=0, grads=g)  # fmt: skip
    want = reference("sgd", job, values, [(want_grads, (0.1, 0.05))])
    for k, v in want.items():
        torch.testing.assert_close(masters(st)[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizer_state_read_back_and_restored_with_an_init(name: str) -> None:
    # A loop that saved its optimizer and resumes: the shard read back after two steps,
    # and a fresh shard initialised with those weights and that state, step alike.
    job = own_job("sync", name, workers=1)
    st = ShardState()
    st.init(job, init_values(job))
    for clock in (1, 2):
        push(st, options=StepOptions(lrs=(0.01, 0.02)), worker=0, clock=clock,
             base_version=st.version, grads=grad_for(job, 0, clock))  # fmt: skip
        pull(st, 0, clock)
    state = st.optimizer_state()
    assert {v.name for v in state} >= ({"momentum_buffer"} if name == "sgd" else {"step"})
    resumed = ShardState()
    resumed.init(job, masters(st), state)
    assert weights_digest(resumed) == weights_digest(st)
    for s in (st, resumed):
        push(s, options=StepOptions(lrs=(0.01, 0.02)), worker=0, clock=s.rounds + 1,
             base_version=s.version, grads=grad_for(job, 0, 3))  # fmt: skip
    assert weights_digest(resumed) == weights_digest(st)


def test_job_param_groups_are_checked() -> None:
    slots = make_slots()
    with pytest.raises(ValueError, match="in no group"):
        Job(slots=slots, param_groups=(ParamGroup(params=("w",), lr=0.1),))
    with pytest.raises(ValueError, match="more than one group"):
        Job(slots=slots, param_groups=(ParamGroup(params=("w", "b"), lr=0.1),
                                       ParamGroup(params=("b",), lr=0.1)))  # fmt: skip
    with pytest.raises(ValueError, match="schedule must be constant"):
        Job(slots=slots, optimizer=OptimizerConfig(schedule="warmup_cosine"),
            param_groups=(ParamGroup(params=("w", "b"), lr=0.1),))  # fmt: skip
    with pytest.raises(ValueError, match="nesterov"):
        ParamGroup(params=("w",), lr=0.1, nesterov=True)


def test_a_worker_that_clips_meets_a_chunking_shard_at_init_with_the_flag_named(
    tmp_path: Path,
) -> None:
    # Real processes: a shard started with --chunk-rounds, psar's own loop clipping by
    # the global norm (its pushes would carry step options): rank 0's Init is refused,
    # and the worker exits non-zero saying which shard flag to drop, before any step.
    with shards(1, "--chunk-rounds") as addrs:
        with pytest.raises(AssertionError, match="exited") as e:
            run_ps_workers(addrs, 1, tmp_path, ["--workload", "mlp", "--steps", "3",
                           "--clip-grad-norm", "1.0", "--mode", "sync"], timeout=120)  # fmt: skip
    assert "start the shards without --chunk-rounds" in str(e.value)
    assert not (tmp_path / "report-0.json").exists()
