"""Staleness-aware updates of the async and ssp shards (issue #17, item 5).

The math (trainkit/optim.py) against hand computations on tiny tensors; the policies
(ps/server/modes/staleness.py through AsyncPolicy / SSPPolicy) on a ShardState against hand-made
optimizer steps; the job fields through the wire to a real gRPC shard, bad values refused
with INVALID_ARGUMENT and nothing installed.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.job import Job
from psar.ps.server.shard import ShardState
from psar.trainkit.config import PSConfig
from psar.trainkit.optim import (
    StepAdjust,
    adjusted,
    async_momentum,
    delay_compensate_,
    lr_factor,
    staleness_lr_factor,
)
from tests.ps_fixtures import (
    applied_optimizer,
    init_chunks,
    init_values,
    make_job,
    make_state,
    masters,
    optimizer_config,
    pull,
    push,
    push_chunks,
    raw_stub,
    reference_weights,
    serving,
)

TIMEOUT = 10.0
Grads = dict[str, torch.Tensor]


# ---- the math -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("momentum", "workers", "want"),
    [
        (0.9, 1, 0.9),
        (0.9, 2, 0.4),
        (0.9, 4, 0.15),
        (0.9, 8, 0.025),
        (0.9, 16, 0.0),
        (0.5, 3, 0.0),
        (0.0, 4, 0.0),
    ],
)
def test_momentum_rule(momentum: float, workers: int, want: float) -> None:
    assert async_momentum(momentum, workers) == pytest.approx(want)


def test_momentum_rule_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        async_momentum(0.9, 0)


def test_staleness_lr_factor() -> None:
    assert [staleness_lr_factor(s) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="staleness"):
        staleness_lr_factor(-1)


def test_delay_compensation_by_hand() -> None:
    g = torch.tensor([1.0, 2.0, -3.0])
    w_now = torch.tensor([1.0, 1.0, 0.0])
    w_base = torch.tensor([0.5, 2.0, 0.0])
    # g + 0.5 * g^2 * (w_now - w_base) = [1 + 0.5*1*0.5, 2 + 0.5*4*(-1), -3 + 0]
    out = delay_compensate_(g, 0.5, w_now, w_base)
    assert out is g  # in place
    assert torch.equal(g, torch.tensor([1.25, 0.0, -3.0]))
    same = torch.tensor([1.0, 2.0])
    assert torch.equal(
        delay_compensate_(same, 0.0, w_now[:2], w_base[:2]), torch.tensor([1.0, 2.0])
    )


def test_adjusted_sgd_step_by_hand_and_restored() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)
    g1, g2 = torch.tensor([0.5, -1.0]), torch.tensor([1.0, 1.0])
    p.grad = g1.clone()
    with adjusted(opt, StepAdjust(lr_scale=0.5, momentum=0.15)):
        opt.step()  # buf = g1; p -= 0.05 * g1
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    p.grad = g2.clone()
    with adjusted(opt, StepAdjust(lr_scale=0.25, momentum=0.15)):
        opt.step()  # buf = 0.15 * g1 + g2; p -= 0.025 * buf
    buf = 0.15 * g1 + g2
    want = torch.tensor([1.0, 2.0]) - 0.05 * g1 - 0.025 * buf
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9


def test_adjusted_adamw_sets_beta1_only_for_the_step() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.999), weight_decay=0.0, foreach=False)
    p.grad = torch.tensor([2.0])
    seen = {}
    with adjusted(opt, StepAdjust(momentum=0.15)):
        seen = dict(opt.param_groups[0])
        opt.step()
    assert seen["betas"] == (0.15, 0.999) and seen["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    # The first AdamW step moves by lr * sign(g) whatever beta1 is (bias-corrected).
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.01]), rtol=0, atol=1e-6)


def test_nesterov_whose_momentum_the_rule_zeroes_still_steps() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True, foreach=False)
    p.grad = torch.tensor([1.0])
    with adjusted(opt, StepAdjust(momentum=async_momentum(0.5, 3))):
        opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9]))


# ---- the policies on a shard ----------------------------------------------------------


def _job(mode: str = "async", **kw: object) -> Job:
    opt = kw.pop("optimizer", optimizer_config("sgd", weight_decay=0.0))
    job = make_job(mode, num_workers=int(kw.pop("num_workers", 2)), optimizer=opt)  # type: ignore[arg-type]
    return dataclasses.replace(job, **kw)  # type: ignore[arg-type]


def _grad(job: Job, scale: float) -> Grads:
    return {s.key: torch.linspace(-1.0, 1.0, s.numel) * scale for s in job.slots}


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_staleness_lr_and_momentum_rule_by_hand(mode: str) -> None:
    """2 workers, SGD lr 0.1 momentum 0.9 -> 0.4 on the shard. Worker 0's gradient lands
    fresh (full lr), worker 1's is one update stale (lr / 2)."""
    job = _job(mode, staleness=1, staleness_lr=True)
    values = init_values(job)
    st = make_state(job, values)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads=g0)
    push(st, worker=1, clock=1, base_version=0, grads=g1)
    assert st.staleness_counts == {0: 1, 1: 1}
    for k, v in values.items():
        buf = 0.4 * g0[k] + g1[k]
        want = v - 0.1 * g0[k] - 0.05 * buf
        torch.testing.assert_close(st.masters[k].detach(), want, rtol=0, atol=1e-6)
    # The optimizer keeps its configured hyperparameters (schedulers, checkpoints).
    assert st.optimizer.param_groups[0]["momentum"] == 0.9
    assert st.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_momentum_rule_off_applies_the_configured_optimizer(opt: str) -> None:
    job = _job(optimizer=optimizer_config(opt), num_workers=4, momentum_correction=False)
    assert applied_optimizer(job) == job.optimizer
    values = init_values(job)
    st = make_state(job, values)
    grads = [_grad(job, 0.1 * (i + 1)) for i in range(3)]
    for i, g in enumerate(grads):
        push(st, worker=i, clock=1, base_version=0, grads=g)
    want = reference_weights(job, values, grads)
    for k in want:
        assert torch.equal(st.masters[k].detach(), want[k])


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_momentum_rule_matches_torch_with_the_reduced_momentum(opt: str) -> None:
    job = _job(optimizer=optimizer_config(opt), num_workers=4)
    cfg = applied_optimizer(job)
    assert (cfg.beta1 if opt == "adamw" else cfg.momentum) == pytest.approx(0.15)
    values = init_values(job)
    st = make_state(job, values)
    grads = [_grad(job, 0.1 * (i + 1)) for i in range(4)]
    for i, g in enumerate(grads):
        push(st, worker=i, clock=1, base_version=0, grads=g)
    want = reference_weights(job, values, grads)
    for k in want:
        assert torch.equal(st.masters[k].detach(), want[k]), k


def test_sync_ignores_the_staleness_fields() -> None:
    job = _job("sync", staleness_lr=True, delay_compensation=1.0)
    values = init_values(job)
    st = make_state(job, values)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads=g0)
    push(st, worker=1, clock=1, base_version=0, grads=g1)
    mean = {k: (g0[k] + g1[k]) / 2 for k in g0}
    want = reference_weights(job, values, [mean])
    for k in want:
        torch.testing.assert_close(st.masters[k].detach(), want[k], rtol=0, atol=1e-7)


def _dc_job(mode: str = "async", lam: float = 0.5) -> Job:
    # Plain SGD (no momentum) so the hand computation is the DC formula alone.
    return _job(
        mode,
        staleness=4,
        optimizer=optimizer_config("sgd", momentum=0.0, weight_decay=0.0),
        delay_compensation=lam,
    )


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_delay_compensation_by_hand_on_a_shard(mode: str) -> None:
    job = _dc_job(mode)
    values = init_values(job)
    st = make_state(job, values)
    pull(st, 0, 0)
    pull(st, 1, 0)  # both computed on the initial weights (version 0)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads={k: t.clone() for k, t in g0.items()})
    w1 = masters(st)
    push(st, worker=1, clock=1, base_version=0, grads={k: t.clone() for k, t in g1.items()})
    for k, v in values.items():
        # Fresh (staleness 0): no compensation.
        torch.testing.assert_close(w1[k], v - 0.1 * g0[k], rtol=0, atol=1e-7)
        dc = g1[k] + 0.5 * g1[k] * g1[k] * (w1[k] - v)
        torch.testing.assert_close(st.masters[k].detach(), w1[k] - 0.1 * dc, rtol=0, atol=1e-7)
    assert st.policy.bases.missing == 0  # type: ignore[attr-defined]


def test_delay_compensation_without_the_base_applies_plainly_and_counts() -> None:
    job = _dc_job()
    values = init_values(job)
    st = make_state(job, values)
    pull(st, 0, 0)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads=g0)
    w1 = masters(st)
    # Worker 1 never pulled here (say it pulled before a restart): w_base is unknown.
    push(st, worker=1, clock=1, base_version=0, grads={k: t.clone() for k, t in g1.items()})
    for k in values:
        torch.testing.assert_close(st.masters[k].detach(), w1[k] - 0.1 * g1[k], rtol=0, atol=1e-7)
    assert st.policy.bases.missing == 1  # type: ignore[attr-defined]


def test_served_weights_keep_one_copy_per_base_in_use() -> None:
    job = _dc_job()
    st = make_state(job)
    bases = st.policy.bases  # type: ignore[attr-defined]
    pull(st, 0, 0)
    pull(st, 1, 0)
    assert list(bases.copies) == [0]  # two workers, one version: one copy
    push(st, worker=0, clock=1, base_version=0, grads=_grad(job, 0.1))
    pull(st, 0, 1)
    assert sorted(bases.copies) == [0, 1]
    push(st, worker=1, clock=1, base_version=0, grads=_grad(job, 0.1))
    pull(st, 1, 1)
    assert sorted(bases.copies) == [1, 2]  # version 0 is nobody's base any more
    st.members.leave(1)
    assert sorted(bases.copies) == [1]


def test_no_copies_without_delay_compensation() -> None:
    st = make_state(_job())
    pull(st, 0, 0)
    assert st.policy.bases.copies == {}  # type: ignore[attr-defined]


# ---- validation and the wire ----------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_bad_lambda_refused_in_job_and_config(bad: float) -> None:
    with pytest.raises(ValueError, match="--delay-compensation"):
        _job(delay_compensation=bad)
    with pytest.raises(ValueError, match="--delay-compensation"):
        PSConfig(delay_compensation=bad)


def test_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from psar.worker import cli

    argv = ["--servers", "h:1", "--staleness-lr", "--delay-compensation", "0.25"]
    argv += ["--no-momentum-correction"]
    assert cli.main(["train", "--dry-run", *argv]) == 0
    ps = json.loads(capsys.readouterr().out)["ps"]
    assert ps["staleness_lr"] and ps["delay_compensation"] == 0.25
    assert not ps["momentum_correction"]
    assert cli.main(["train", "--dry-run", "--servers", "h:1"]) == 0
    ps = json.loads(capsys.readouterr().out)["ps"]  # the defaults
    assert not ps["staleness_lr"] and ps["delay_compensation"] == 0.0
    assert ps["momentum_correction"]


def test_job_fields_cross_the_wire_to_a_real_shard() -> None:
    job = _job(staleness_lr=True, delay_compensation=0.75, momentum_correction=False)
    assert serde.job_from_pb(serde.job_to_pb(job)) == job
    with serving() as (port, _state), raw_stub(port) as stub:
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        got = serde.job_from_pb(stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT).job)
    assert got.staleness_lr and got.delay_compensation == 0.75 and not got.momentum_correction


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_lambda_on_the_wire_is_invalid_argument_and_installs_nothing(bad: float) -> None:
    job = _job()
    chunks = init_chunks(job, init_values(job))
    chunks[0].header.job.delay_compensation = bad
    with serving() as (port, state), raw_stub(port) as stub:
        with pytest.raises(grpc.RpcError) as e:
            stub.Init(iter(chunks), timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "delay-compensation" in (e.value.details() or "")
        assert not state.initialized
        assert not stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT).initialized


def test_delay_compensation_through_grpc_pulls() -> None:
    """The served-weights hook sits on the pull path the gRPC door takes (parked pulls)."""
    job = _dc_job()
    values = init_values(job)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)

    def header(worker: int) -> pb.PushHeader:
        return pb.PushHeader(
            worker=worker, clock=1, base_version=0, dtype=pb.FLOAT32, loss_scale=1.0
        )

    def pulled(stub: object, worker: int, clock: int) -> Grads:
        out = {s.key: torch.empty(s.numel) for s in job.slots}
        req = pb.PullRequest(worker=worker, clock=clock, dtype=pb.FLOAT32)
        for chunk in stub.Pull(req, timeout=TIMEOUT):  # type: ignore[attr-defined]
            if chunk.HasField("data"):
                d = chunk.data
                src = torch.frombuffer(bytearray(d.data), dtype=torch.float32)
                out[d.key][d.offset : d.offset + src.numel()] = src
        return out

    with serving() as (port, state), raw_stub(port) as stub:
        stub.Init(iter(init_chunks(job, values)), timeout=TIMEOUT)
        pulled(stub, 0, 0)
        pulled(stub, 1, 0)
        stub.Push(iter(push_chunks(header(0), g0)), timeout=TIMEOUT)
        w1 = pulled(stub, 0, 1)
        stub.Push(iter(push_chunks(header(1), g1)), timeout=TIMEOUT)
        final = pulled(stub, 1, 1)
        assert state.policy.bases.missing == 0  # type: ignore[attr-defined]
    for k, v in values.items():
        dc = g1[k] + 0.5 * g1[k] * g1[k] * (w1[k] - v)
        torch.testing.assert_close(final[k], w1[k] - 0.1 * dc, rtol=0, atol=1e-6)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_update_threads_give_the_same_bits_with_every_correction(
    opt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-slot optimizers of `--torch-threads` take the adjusted lr / momentum from
    the shard optimizer's group: the same bits as one thread, schedule included."""
    from psar.ps.server.update import stepper

    monkeypatch.setattr(stepper, "MIN_PARALLEL_NUMEL", 0)  # tiny slots: pool anyway
    cfg = optimizer_config(opt, schedule="warmup_cosine", warmup_steps=2, total_steps=8)
    job = _job(optimizer=cfg, num_workers=3, staleness_lr=True, delay_compensation=0.5)

    def run(threads: int) -> ShardState:
        st = ShardState(update_threads=threads)
        st.init(job, init_values(job))
        for c in range(1, 4):
            bases = {w: pull(st, w, c - 1)[0].version for w in range(3)}
            for w in (2, 0, 1):
                push(st, worker=w, clock=c, base_version=bases[w], grads=_grad(job, 0.1 * c + w))
        return st

    one, many = run(1), run(3)
    assert many.stepper._views  # the pool's per-slot optimizers stepped
    assert one.state_digest() == many.state_digest()
    assert set(one.staleness_counts) == {0, 1, 2}
    # The staleness-scaled lr never leaks into the group: it holds the schedule's value.
    want_lr = cfg.lr * lr_factor(cfg, one.updates_applied)
    for st in (one, many):
        assert st.optimizer.param_groups[0]["lr"] == pytest.approx(want_lr)
