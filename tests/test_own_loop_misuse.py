"""Misuse of the own-loop API (worker/own_loop.py prepare()) gets a clear error or does
what torch does, under either architecture, never a silent no-op or a hang (issue 45,
defects 16 and 17). One process, world size 1: a real shard served in this process (ps)
or a real gloo group of one (allreduce). Two real processes, a rank stepping without a
backward: tests/test_own_loop_resume.py's neighbour test_own_loop_skipped_backward.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from psar.worker.own_loop import OwnLoop, prepare
from tests.ps_fixtures import serving


def _model(frozen: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if frozen:
        model[0].requires_grad_(False)
    return model


@pytest.fixture(params=["ps", "allreduce"])
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """The environment prepare() reads, for one architecture in this process."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    from tests.procs import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    base = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for k, v in base.items():  # torch.distributed's env:// reads os.environ
        monkeypatch.setenv(k, v)
    if request.param == "allreduce":
        yield {**base, "PSAR_ARCH": "allreduce"}
        return
    with serving() as (port, _state):
        yield {**base, "PSAR_SERVERS": f"127.0.0.1:{port}"}


@contextlib.contextmanager
def _prepared(model: torch.nn.Module, opt: torch.optim.Optimizer, env: dict) -> Iterator[OwnLoop]:
    run = prepare(model, opt, env=env, args=["--torch-threads", "1", "--device", "cpu"])
    try:
        yield run
    finally:
        run.finish()


def _train_step(run: OwnLoop, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    run.optimizer.zero_grad()
    run.backward(torch.nn.functional.cross_entropy(run.model(x), y))
    run.optimizer.step()


def test_frozen_parameters_in_the_optimizer_are_skipped_as_torch_does(env: dict) -> None:
    # AdamW(model.parameters()) over a partly frozen model: torch allows it and steps
    # only the parameters with a gradient; so does the run, under either architecture.
    model = _model(frozen=True)
    reference = _model(frozen=True)
    frozen_before = model[0].weight.detach().clone()
    with _prepared(model, torch.optim.AdamW(model.parameters(), lr=0.05), env) as run:
        local = torch.optim.AdamW(reference.parameters(), lr=0.05)
        for step in range(3):
            _train_step(run, step)
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 2, (16,), generator=gen)
            local.zero_grad()
            torch.nn.functional.cross_entropy(reference(x), y).backward()
            local.step()
        state = run.optimizer.state_dict()
    assert torch.equal(model[0].weight, frozen_before)  # not stepped
    assert not torch.equal(model[2].weight, _model()[2].weight)  # trained
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # torch's format: state for the trained parameters (indices 2, 3) only.
    assert sorted(state["state"]) == [2, 3]


def test_a_second_prepare_is_refused(env: dict) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _prepared(model, opt, env) as run:
        for again in [(model, opt), (run.model, opt), (_model(), run.optimizer)]:
            with pytest.raises(RuntimeError, match=r"prepare\(\) was called already"):
                prepare(*again, env=env)
        _train_step(run, 0)  # the first run goes on unharmed
        assert run.last_step is not None and not run.last_step.skipped


def test_an_optimizer_over_another_models_parameters_is_refused(env: dict) -> None:
    model, other = _model(), _model()
    with pytest.raises(ValueError, match=r"param group 0 holds 4 tensors that are not parameters"):
        prepare(model, torch.optim.SGD(other.parameters(), lr=0.1), env=env)


def test_a_step_without_backward_is_refused_and_sends_nothing(env: dict) -> None:
    model = _model()
    with _prepared(model, torch.optim.SGD(model.parameters(), lr=0.1), env) as run:
        _train_step(run, 0)
        before = [p.detach().clone() for p in model.parameters()]
        run.optimizer.zero_grad()
        with pytest.raises(RuntimeError, match=r"step\(\) without a backward"):
            run.optimizer.step()
        assert run.step == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_scheduler_built_before_prepare_does_not_step_locally() -> None:
    # An LR scheduler wraps the step() of the optimizer it is given, in the instance:
    # built on yours before prepare(), that wrapper must not become run.optimizer's step.
    from psar.worker.own_optimizer import distributed

    model = _model()
    own = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.optim.lr_scheduler.StepLR(own, step_size=1)
    calls: list[int] = []
    opt = distributed(own, lambda: calls.append(1), lambda: None, {})
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
