"""run.save_state() / prepare(resume_from=), restored as the objects are registered again
(worker/own_loop.py,
worker/own_state.py) in one process: a real in-process shard (ps) or a gloo group of one
(allreduce). Two workers in real processes, cut mid-warm-up: tests/test_own_loop_resume.py.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from psar.worker import own_state
from psar.worker.own_loop import OwnLoop, prepare
from tests.ps_fixtures import serving
from tests.test_own_loop_misuse import env  # noqa: F401 - the fixture


@contextlib.contextmanager
def _next_job(environ: dict) -> Iterator[dict]:
    """The environment of the resumed job: under ps on a shard of its own (a shard serves
    one job, as `psar launch` starts new ones for each)."""
    if "PSAR_SERVERS" not in environ:
        yield environ
        return
    with serving() as (port, _state):
        yield {**environ, "PSAR_SERVERS": f"127.0.0.1:{port}"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
    )


def _warmup(n: int) -> float:
    return min(1.0, n / 3)  # HF's linear warm-up: lr 0 at the first step


def _start(
    environ: dict, resume: Path | None = None, *, register: bool = True
) -> tuple[OwnLoop, torch.optim.lr_scheduler.LambdaLR]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    run = prepare(model, opt, env=environ, args=["--torch-threads", "1"], resume_from=resume)
    sched = torch.optim.lr_scheduler.LambdaLR(run.optimizer, _warmup)
    return run, run.register(sched) if register else sched


def _steps(run: OwnLoop, sched: torch.optim.lr_scheduler.LambdaLR, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        step = run.step + 1
        gen = torch.Generator().manual_seed(step)  # the data of step `step`
        x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen)
        x, y = x.to(run.device), y.to(run.device)  # on a GPU: CUDA's generator for dropout
        run.optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(run.model(x), y)  # dropout: torch's RNG
        run.backward(loss)
        run.optimizer.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_a_resumed_run_continues_bit_for_bit(env: dict, tmp_path: Path) -> None:  # noqa: F811
    run, sched = _start(env)
    _steps(run, sched, 2)
    run.save_state(tmp_path)
    want = _steps(run, sched, 3)
    want_weights = [p.detach().clone() for p in run.model.parameters()]
    run.finish()

    with _next_job(env) as environ:
        # The one call: prepare(resume_from=) restores the step at once, the scheduler
        # as it is registered again, then the learning rates and the generators.
        again, sched = _start(environ, resume=tmp_path)
        assert again.step == 2 and again.load_state() == 2  # load_state(): optional
        assert [g["lr"] for g in again.optimizer.param_groups] == pytest.approx([0.05 * 2 / 3])
        got = _steps(again, sched, 3)
        weights = [p.detach().clone() for p in again.model.parameters()]
        again.finish()
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(weights, want_weights, strict=True))


def test_a_forward_before_every_saved_object_is_registered_is_refused(
    env: dict,  # noqa: F811
    tmp_path: Path,
) -> None:
    run, sched = _start(env)
    _steps(run, sched, 1)
    run.save_state(tmp_path)
    run.finish()
    with _next_job(env) as environ:
        again, sched = _start(environ, resume=tmp_path, register=False)
        try:
            with pytest.raises(RuntimeError, match=r"registered 1 object\(s\).*this one 0"):
                _steps(again, sched, 1)  # the scheduler was not registered: refused
            with pytest.raises(ValueError, match=r"registered 1 objects, this one 0"):
                again.load_state()
            again.register(sched)
            _steps(again, sched, 1)  # restored now
            assert again.step == 2
        finally:
            again.finish()


def test_resuming_needs_the_folder_in_prepare(env: dict, tmp_path: Path) -> None:  # noqa: F811
    run, _ = _start(env)
    try:
        with pytest.raises(RuntimeError, match=r"prepare\(\.\.\., resume_from=FOLDER\)"):
            run.load_state(tmp_path)
    finally:
        run.finish()


def test_rng_states_round_trip() -> None:
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    state = own_state.rng_state()
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    own_state.set_rng_state(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_a_folder_saved_in_part_is_refused(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    own_state.save_rank(tmp_path, 0, 2, 5, [0.1], [gen])
    with pytest.raises(FileNotFoundError, match=r"rank1\.pt.*on every rank"):
        own_state.load_rank(tmp_path, 1, 2)
    own_state.save_rank(tmp_path, 1, 2, 4, [0.1], [gen])
    with pytest.raises(ValueError, match="rank 1 saved step 4, rank 0 step 5"):
        own_state.load_rank(tmp_path, 1, 2)
    with pytest.raises(ValueError, match="resume with as many workers"):
        own_state.load_rank(tmp_path, 0, 3)
    with pytest.raises(TypeError, match=r"state_dict\(\) and load_state_dict\(\)"):
        own_state.check_registrable(object())
