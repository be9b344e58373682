"""The optimizer's implementation (`--optimizer-impl auto|fused|foreach|loop`, issue #36):
one field of the optimizer configuration both architectures build from (trainkit/optim.py).

A shard stepping its slots (cut from parameters as ps/partition.py cuts them, stepped in
groups on its update threads) gives the bits of torch's optimizer of the same
implementation stepping the whole parameters, as a DDP rank does: for SGD (momentum,
Nesterov, weight decay) and AdamW, under each choice. The choices differ from each other,
auto picks fused where torch has the kernel, a fused ask without one is refused naming the
flag, the choice travels with the job (an older spec without it reads loop).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from psar.ps import serde
from psar.ps.errors import InvalidArgument
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.shard import ShardState
from psar.ps.server.update import stepper
from psar.trainkit import optim
from psar.trainkit.cli_gen import add_flags, build
from psar.trainkit.config import TrainConfig
from psar.trainkit.optim import OptimizerConfig, build_optimizer, optimizer_impl, resolve_impl

# Parameters cut into slots of 256 elements (1 KiB): odd sizes, so a parameter's last
# slot ends in a vector tail, and many slots to deal into groups.
PARAMS = [("emb", 3001), ("w1", 1024), ("b1", 77), ("w2", 515), ("ln", 9)]
CONFIGS = {
    "sgd": dict(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": dict(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-plain": dict(name="sgd", lr=0.1, momentum=0.0),
    "adamw": dict(name="adamw", lr=0.01, weight_decay=0.01),
}
IMPLS = ("fused", "foreach", "loop")
STEPS = 4


def _values_and_grads() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    values = {n: torch.randn(k, generator=g) for n, k in PARAMS}
    grads = [{n: torch.randn(k, generator=g) for n, k in PARAMS} for _ in range(STEPS)]
    return values, grads


def _shard_run(cfg: OptimizerConfig, threads: int) -> dict[str, torch.Tensor]:
    """The shard's update path (apply_update, as every push takes it) on slots."""
    values, grads = _values_and_grads()
    slots = plan_slots(PARAMS, 1, chunk_bytes=1024)
    job = Job(mode="async", num_workers=1, optimizer=cfg, slots=slots, job_id="impl")
    st = ShardState(update_threads=threads)
    st.init(job, {s.key: values[s.param][s.start : s.start + s.numel] for s in slots})
    for step in grads:
        g = {s.key: step[s.param][s.start : s.start + s.numel].clone() for s in slots}
        st.apply_update(g, staleness=[0])
    out = {n: torch.empty(k) for n, k in PARAMS}
    for s in slots:
        out[s.param][s.start : s.start + s.numel] = st.masters[s.key].detach()
    assert st.stats()["optimizer_impl"] == resolve_impl(cfg, "cpu")
    st.stepper.close()
    return out


def _torch_run(cfg: OptimizerConfig) -> dict[str, torch.Tensor]:
    """torch's optimizer on the whole parameters (what a DDP rank runs)."""
    values, grads = _values_and_grads()
    params = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    opt = build_optimizer(params.values(), cfg)
    for step in grads:
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.fixture(autouse=True)
def _pool_for_tiny_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepper, "MIN_PARALLEL_NUMEL", 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_shard_slots_equal_torch_on_whole_parameters(config: str, impl: str) -> None:
    cfg = OptimizerConfig(**CONFIGS[config], impl=impl)  # type: ignore[arg-type]
    want = _torch_run(cfg)
    for threads in (1, 3):
        got = _shard_run(cfg, threads)
        for n in want:
            assert torch.equal(got[n], want[n]), (config, impl, threads, n)


@pytest.mark.parametrize("config", ["sgd-nesterov", "adamw"])
def test_the_choice_changes_the_bits(config: str) -> None:
    """fused and loop differ in the last bits (so each choice is a choice both
    architectures must share), by rounding only."""
    fused = _torch_run(OptimizerConfig(**CONFIGS[config], impl="fused"))  # type: ignore[arg-type]
    loop = _torch_run(OptimizerConfig(**CONFIGS[config], impl="loop"))  # type: ignore[arg-type]
    if config == "adamw":
        assert any(not torch.equal(fused[n], loop[n]) for n in fused)
    for n in fused:
        torch.testing.assert_close(fused[n], loop[n], rtol=1e-5, atol=1e-6)


def test_groups_are_sized_for_the_threads() -> None:
    slots = plan_slots(PARAMS, 1, chunk_bytes=1024)
    job = Job(mode="async", num_workers=1, optimizer=OptimizerConfig(), slots=slots, job_id="g")
    st = ShardState(update_threads=3)
    st.init(job, {s.key: torch.zeros(s.numel) for s in slots})
    groups = st.stepper.groups(st)
    assert len(groups) == 3 * stepper.GROUPS_PER_THREAD
    assert sorted(k for g in groups for k in g) == sorted(st.masters)
    sizes = [sum(st.masters[k].numel() for k in g) for g in groups]
    assert sizes == sorted(sizes, reverse=True)
    assert max(sizes) - min(sizes) <= max(s.numel for s in slots)
    one = ShardState(update_threads=1)
    one.init(job, {s.key: torch.zeros(s.numel) for s in slots})
    assert len(one.stepper.groups(one)) == 2  # one thread: never dealt (one step), 2 per thread


def test_auto_is_fused_where_torch_has_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sgd", "adamw"):
        cfg = OptimizerConfig(name=name)
        assert cfg.impl == "auto"
        want = "fused" if optim.has_fused(name, "cpu") else "loop"
        assert resolve_impl(cfg, "cpu") == want
        p = torch.nn.Parameter(torch.zeros(3))
        assert optimizer_impl(build_optimizer([p], cfg)) == want
    # A torch without the kernel (simulated): auto falls back to loop, fused is refused.
    monkeypatch.setattr(optim, "has_fused", lambda name, device: False)
    assert resolve_impl(OptimizerConfig(name="adamw"), "cpu") == "loop"
    with pytest.raises(ValueError, match=r"--optimizer-impl fused: .*no fused adamw kernel"):
        resolve_impl(OptimizerConfig(name="adamw", impl="fused"), "cpu")
    slots = plan_slots(PARAMS, 1)
    job = Job(mode="async", num_workers=1, optimizer=OptimizerConfig(impl="fused"), slots=slots)
    with pytest.raises(InvalidArgument, match="cannot run the job's optimizer"):
        ShardState().init(job, {s.key: torch.zeros(s.numel) for s in slots})


def test_the_choice_travels_with_the_job() -> None:
    slots = plan_slots(PARAMS, 1)
    for impl in ("auto", *IMPLS):
        job = Job(mode="sync", num_workers=2, optimizer=OptimizerConfig(impl=impl), slots=slots)
        assert serde.job_from_pb(serde.job_to_pb(job)).optimizer.impl == impl
    spec = serde.job_to_pb(Job(mode="sync", num_workers=2, slots=slots))
    spec.optimizer.impl = ""  # a spec (or a checkpoint's job) from before the field
    assert serde.job_from_pb(spec).optimizer.impl == "loop"
    spec.optimizer.impl = "turbo"
    with pytest.raises(InvalidArgument, match=r"--optimizer-impl: unknown 'turbo'"):
        serde.job_from_pb(spec)


def test_the_flag() -> None:
    p = argparse.ArgumentParser()
    add_flags(p, TrainConfig)
    cfg = build(TrainConfig, p.parse_args(["--optimizer-impl", "foreach"]))
    assert cfg.optimizer.impl == "foreach"
    assert build(TrainConfig, p.parse_args([])).optimizer.impl == "auto"
    with pytest.raises(ValueError, match=r"--optimizer-impl: unknown 'fast'; accepted: auto"):
        dataclasses.replace(cfg.optimizer, impl="fast")


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_steps_a_parameter_whose_first_gradient_comes_late(nesterov: bool) -> None:
    """torch's fused SGD fails on a list where some parameters have momentum buffers and
    one has none (its first gradient after the others'): an async shard's slot that no
    push had a gradient for until now, an unused parameter used at last. Built through
    build_optimizer it steps, each parameter exactly as a fused SGD of its own would
    (signed zeros in the gradient included)."""
    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=nesterov,
                          weight_decay=0.01, impl="fused")  # fmt: skip
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(300, generator=g) for _ in range(2)]
    grads = [[torch.randn(300, generator=g) for _ in range(2)] for _ in range(3)]
    grads[1][1][:5] = -0.0  # the late parameter's first gradient holds negative zeros
    together = [torch.nn.Parameter(t.clone()) for t in start]
    alone = [torch.nn.Parameter(t.clone()) for t in start]
    opt = build_optimizer(together, cfg)
    solo = [build_optimizer([p], cfg) for p in alone]
    for step, gs in enumerate(grads):
        for i, (p, q) in enumerate(zip(together, alone, strict=True)):
            late = i == 1 and step == 0  # parameter 1 has no gradient at step 0
            p.grad = None if late else gs[i].clone()
            q.grad = None if late else gs[i].clone()
        opt.step()
        for o in solo:
            o.step()
    for p, q, o in zip(together, alone, solo, strict=True):
        assert torch.equal(p.detach(), q.detach())
        buf, ref = opt.state[p]["momentum_buffer"], o.state[q]["momentum_buffer"]
        assert torch.equal(buf, ref) and torch.equal(buf.signbit(), ref.signbit())
