"""The pure parts of the own-loop API: the optimizer prepare() hands back
(worker/own_optimizer.py), the configuration it reads from the launcher's environment
(worker/own_loop.py config_of) and `psar launch ... -- COMMAND` (worker/launch.py).
The whole path with real processes: tests/test_own_loop.py."""

from __future__ import annotations

import io

import pytest
import torch

from psar.worker.launch import launch, parse
from psar.worker.own_loop import config_of
from psar.worker.own_optimizer import distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def _wrapped(remote: dict | None = None) -> tuple[torch.nn.Module, torch.optim.SGD, list, object]:
    model = _model()
    own = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    calls: list[int] = []
    names = {id(p): n for n, p in model.named_parameters()}
    opt = distributed(own, lambda: calls.append(1), lambda: remote, names)
    return model, own, calls, opt


def test_the_optimizer_is_the_users_class_sharing_its_groups() -> None:
    _, own, calls, opt = _wrapped()
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "DistributedSGD"
    assert opt.param_groups is own.param_groups and opt.state is own.state
    # A scheduler changes what the next step ships: the lr in the shared groups.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    assert opt.step(lambda: torch.tensor(2.0)).item() == 2.0  # closure's loss returned
    sched.step()
    assert calls == [1] and own.param_groups[0]["lr"] == pytest.approx(0.05)


def test_the_step_is_the_architectures_not_torchs() -> None:
    model, _, calls, opt = _wrapped()
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [1]
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_reads_the_remote_state_in_torchs_format() -> None:
    model = _model()
    remote = {n: {"momentum_buffer": torch.full_like(p, float(i))}
              for i, (n, p) in enumerate(model.named_parameters())}  # fmt: skip
    own = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = distributed(own, lambda: None, lambda: remote, names)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert torch.equal(sd["state"][3]["momentum_buffer"], torch.full((1,), 3.0))
    assert len(own.state) == 0  # the local state is left as it was
    # The same file loads into a plain torch optimizer (under either architecture).
    fresh = torch.optim.SGD(_model().parameters(), lr=0.5, momentum=0.9)
    fresh.load_state_dict(sd)
    assert len(fresh.state) == 4


def test_state_dict_without_remote_state_is_torchs() -> None:
    _, own, _, opt = _wrapped(remote=None)
    assert opt.state_dict() == own.state_dict()


def test_loading_or_adding_groups_after_prepare_says_what_to_do() -> None:
    _, own, _, opt = _wrapped()
    with pytest.raises(RuntimeError, match="before prepare"):
        opt.load_state_dict(own.state_dict())
    with pytest.raises(RuntimeError, match="before prepare"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


@pytest.mark.parametrize(
    "env, arch",
    [
        ({}, "allreduce"),
        ({"PSAR_SERVERS": "127.0.0.1:1"}, "ps"),
        ({"PSAR_ARCH": "ps"}, "ps"),
        ({"PSAR_ARCH": "ps", "PSAR_ARGS": "--arch allreduce"}, "allreduce"),
    ],
)
def test_the_architecture_comes_from_the_environment(env: dict, arch: str) -> None:
    cfg = config_of((), env)
    assert cfg.arch == arch
    assert cfg.ps.servers == env.get("PSAR_SERVERS", "")  # from `env`, not os.environ


def test_psar_args_are_train_flags_and_fp32_is_the_default() -> None:
    cfg = config_of(["--seed", "7"], {"PSAR_ARGS": "--arch ps --mode ssp --staleness 3"})
    assert (cfg.arch, cfg.ps.mode, cfg.ps.staleness, cfg.seed) == ("ps", "ssp", 3, 7)
    assert cfg.precision == "fp32"
    with pytest.raises(ValueError, match="psar train --help"):
        config_of((), {"PSAR_ARGS": "--no-such-flag"})


def test_launch_runs_a_command_after_the_double_dash() -> None:
    s = parse(["--arch", "ps", "--workers", "2", "--steps", "3", "--", "python", "t.py", "-x"])
    assert s.command == ["python", "t.py", "-x"] and s.train_args == ["--steps", "3"]
    with pytest.raises(SystemExit):
        parse(["--workers", "2", "--"])
    s = parse(["--arch", "ps", "--mode", "local", "--", "python", "t.py"])
    s.err = io.StringIO()
    assert launch(s) == 2 and "--mode local" in s.err.getvalue() and s.pids == []


def test_an_optimizer_the_shards_cannot_run_is_refused_before_any_shard_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from psar.worker.own_loop import prepare

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # prepare() leaves the process as it is
    model = _model()
    env = {"PSAR_SERVERS": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "1"}  # nobody listens
    with pytest.raises(ValueError, match=r"torch\.optim\.SGD, torch\.optim\.AdamW"):
        prepare(model, torch.optim.Adam(model.parameters()), env=env)


@pytest.mark.parametrize("flags", [["--max-workers", "4"], ["--join"]])
def test_an_elastic_job_is_refused_by_prepare_saying_which_loop_runs_one(flags: list) -> None:
    from psar.worker.own_loop import prepare

    model = _model()
    env = {"PSAR_SERVERS": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "1"}  # nobody listens
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"--max-workers / --join .*psar train"):
        prepare(model, opt, args=flags, env=env)
