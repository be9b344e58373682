"""--staleness-lr-power and --dc-adaptive (issue #17, item 5; ps/server/modes/staleness.py).

The arithmetic by hand (pure logic, on an in-process ShardState), validation in the
config, the Job and on the wire (a real gRPC shard), and one run of real `psar server` /
`psar train` processes in async mode with both rules on.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.psclient import PSClient
from psar.ps.job import Job
from psar.ps.server.modes.staleness import dc_adaptive_, mean_square_update, step_adjust
from psar.trainkit.config import PSConfig
from tests.procs import run_ps_workers, shards
from tests.ps_fixtures import (
    init_chunks,
    init_values,
    make_job,
    make_state,
    masters,
    optimizer_config,
    pull,
    push,
    raw_stub,
    serving,
)

TIMEOUT = 10.0
Grads = dict[str, torch.Tensor]


def _job(mode: str = "async", **kw: object) -> Job:
    # Plain SGD (no momentum, no decay): the hand computations are the rules alone.
    opt = optimizer_config("sgd", momentum=0.0, weight_decay=0.0)
    job = make_job(mode, num_workers=2, optimizer=opt, staleness=4)
    return dataclasses.replace(job, **kw)  # type: ignore[arg-type]


def _grad(job: Job, scale: float) -> Grads:
    return {s.key: torch.linspace(-1.0, 1.0, s.numel) * scale for s in job.slots}


# ---- the arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("power", "staleness", "want"),
    [(1.0, 3, 0.25), (0.5, 3, 0.5), (0.5, 0, 1.0), (0.5, 8, 1 / 3), (2.0, 1, 0.25)],
)
def test_lr_scale_is_the_powered_staleness_factor(
    power: float, staleness: int, want: float
) -> None:
    adj = step_adjust(_job(staleness_lr=True, staleness_lr_power=power), staleness)
    got = adj.lr_scale if adj is not None else 1.0
    assert got == pytest.approx(want, rel=1e-12)


def test_power_without_staleness_lr_changes_nothing() -> None:
    adj = step_adjust(_job(staleness_lr_power=0.5), 3)  # the momentum rule stays
    assert adj is not None and adj.lr_scale == 1.0


def test_mean_square_update_by_hand() -> None:
    g1, g2 = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 3.0])
    v = mean_square_update(None, g1)  # from zeros, as the paper
    torch.testing.assert_close(v, torch.tensor([0.2, 0.0, 0.05]), rtol=0, atol=1e-7)
    same = mean_square_update(v, g2)
    assert same is v  # in place
    torch.testing.assert_close(
        v, 0.95 * torch.tensor([0.2, 0.0, 0.05]) + 0.05 * g2 * g2, rtol=0, atol=1e-7
    )


def test_dc_adaptive_by_hand() -> None:
    g = torch.tensor([2.0, 0.0, -1.0])
    v = torch.tensor([4.0, 0.0, 0.25])
    w_now, w_base = torch.tensor([1.0, 5.0, 0.0]), torch.tensor([0.5, 0.0, 1.0])
    # g + lam0 * g^2 / sqrt(v) * (w_now - w_base), lam0 = 3:
    #   [2 + 3 * 4/2 * 0.5, 0 (g and v 0: no correction, no nan), -1 + 3 * 1/0.5 * (-1)]
    out = dc_adaptive_(g, 3.0, v, w_now, w_base)
    assert out is g  # in place
    assert torch.equal(g, torch.tensor([5.0, 0.0, -7.0]))


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_staleness_lr_power_on_a_shard(mode: str) -> None:
    """Worker 0's gradient lands fresh (full lr), worker 1's one update stale:
    lr / sqrt(2) with power 0.5 (lr / 2 with the default power 1)."""
    job = _job(mode, staleness_lr=True, staleness_lr_power=0.5)
    values = init_values(job)
    st = make_state(job, values)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads=g0)
    push(st, worker=1, clock=1, base_version=0, grads=g1)
    lr = job.optimizer.lr
    for k, v in values.items():
        want = v - lr * g0[k] - lr / math.sqrt(2.0) * g1[k]
        torch.testing.assert_close(st.masters[k].detach(), want, rtol=0, atol=1e-6)
    assert st.optimizer.param_groups[0]["lr"] == pytest.approx(lr)  # restored


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_dc_adaptive_on_a_shard(mode: str) -> None:
    """Both workers pull version 0; worker 0's push is fresh (it only feeds the mean
    square), worker 1's is one update stale and corrected with lambda0 / sqrt(v)."""
    lam0 = 2.0
    job = _job(mode, delay_compensation=lam0, dc_adaptive=True)
    values = init_values(job)
    st = make_state(job, values)
    pull(st, 0, 0)
    pull(st, 1, 0)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads={k: t.clone() for k, t in g0.items()})
    w1 = masters(st)
    push(st, worker=1, clock=1, base_version=0, grads={k: t.clone() for k, t in g1.items()})
    lr = job.optimizer.lr
    for k, v in values.items():
        torch.testing.assert_close(w1[k], v - lr * g0[k], rtol=0, atol=1e-7)
        ms = 0.95 * (0.05 * g0[k] * g0[k]) + 0.05 * g1[k] * g1[k]
        corr = torch.where(ms > 0, g1[k] * g1[k] / ms.sqrt(), torch.zeros_like(ms))
        dc = g1[k] + lam0 * corr * (w1[k] - v)
        torch.testing.assert_close(st.masters[k].detach(), w1[k] - lr * dc, rtol=0, atol=1e-6)
    assert st.policy.bases.missing == 0  # type: ignore[attr-defined]


def test_constant_lambda_is_unchanged_without_dc_adaptive() -> None:
    job = _job(delay_compensation=0.5)
    values = init_values(job)
    st = make_state(job, values)
    pull(st, 0, 0)
    pull(st, 1, 0)
    g0, g1 = _grad(job, 0.3), _grad(job, -0.7)
    push(st, worker=0, clock=1, base_version=0, grads={k: t.clone() for k, t in g0.items()})
    w1 = masters(st)
    push(st, worker=1, clock=1, base_version=0, grads={k: t.clone() for k, t in g1.items()})
    assert st.policy.bases.mean_sq == {}  # type: ignore[attr-defined]
    for k, v in values.items():
        dc = g1[k] + 0.5 * g1[k] * g1[k] * (w1[k] - v)
        torch.testing.assert_close(st.masters[k].detach(), w1[k] - 0.1 * dc, rtol=0, atol=1e-7)


# ---- validation and the wire ----------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -0.5, 4.5, math.nan, math.inf])
def test_bad_power_refused_in_job_and_config(bad: float) -> None:
    with pytest.raises(ValueError, match="--staleness-lr-power"):
        _job(staleness_lr=True, staleness_lr_power=bad)
    with pytest.raises(ValueError, match="--staleness-lr-power"):
        PSConfig(staleness_lr=True, staleness_lr_power=bad)


def test_dc_adaptive_needs_a_lambda0() -> None:
    with pytest.raises(ValueError, match="--delay-compensation LAMBDA0"):
        _job(dc_adaptive=True)
    with pytest.raises(ValueError, match="--delay-compensation LAMBDA0"):
        PSConfig(dc_adaptive=True)


def test_fields_cross_the_wire_and_an_old_spec_reads_power_1() -> None:
    job = _job(staleness_lr=True, staleness_lr_power=0.5, delay_compensation=4.0)
    job = dataclasses.replace(job, dc_adaptive=True)
    assert serde.job_from_pb(serde.job_to_pb(job)) == job
    old = serde.job_to_pb(_job(staleness_lr=True))
    old.ClearField("staleness_lr_power")  # a spec written before the field existed
    assert serde.job_from_pb(old).staleness_lr_power == 1.0
    with serving() as (port, _state), raw_stub(port) as stub:
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        got = serde.job_from_pb(stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT).job)
    assert got.staleness_lr_power == 0.5 and got.dc_adaptive and got.delay_compensation == 4.0


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [("staleness_lr_power", -1.0, "staleness-lr-power"),
     ("staleness_lr_power", math.nan, "staleness-lr-power"),
     ("dc_adaptive", True, "LAMBDA0")],
)  # fmt: skip
def test_bad_spec_on_the_wire_is_invalid_argument_and_installs_nothing(
    field: str, value: object, says: str
) -> None:
    job = _job(staleness_lr=True)
    chunks = init_chunks(job, init_values(job))
    setattr(chunks[0].header.job, field, value)
    with serving() as (port, state), raw_stub(port) as stub:
        with pytest.raises(grpc.RpcError) as e:
            stub.Init(iter(chunks), timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (e.value.details() or "")
        assert not state.initialized
        assert not stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT).initialized


@pytest.mark.slow
def test_async_workers_train_with_both_rules_on_real_processes(tmp_path: Path) -> None:
    """Real shards and workers: the flags reach every shard's job, training runs with
    stale gradients corrected, and every loss stays finite."""
    flags = ["--workload", "mlp", "--steps", "12", "--batch-size", "16", "--seed", "1",
             "--precision", "fp32", "--eval-batches", "0", "--mode", "async",
             "--staleness-lr", "--staleness-lr-power", "0.5",
             "--delay-compensation", "2", "--dc-adaptive"]  # fmt: skip
    with shards(2) as addrs:
        reports = run_ps_workers(addrs, 2, tmp_path, flags)
        with PSClient(addrs, worker=0) as client:
            jobs = client.get_jobs(wait=False)
            stats = client.stats()
    assert len(jobs) == 2
    for j in jobs:
        assert j is not None
        assert (j.mode, j.staleness_lr, j.staleness_lr_power) == ("async", True, 0.5)
        assert (j.delay_compensation, j.dc_adaptive) == (2.0, True)
    for rep in reports:
        assert len(rep["losses"]) == 12
        assert all(math.isfinite(x) for x in rep["losses"])
    assert all(s["updates_applied"] == 24 for s in stats)  # every push applied, none dropped
