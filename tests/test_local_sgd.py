"""--mode local (local SGD / DiLoCo) under both architectures.

Real processes, as tests/test_train_equivalence.py: `psar server` shards and `psar train
--arch ps` workers, and a gloo process group under torchrun. In fp32 the parameter
server's outer rounds (average on the shards, outer optimizer on the masters) and DDP's
(allreduce, outer optimizer on every rank) must give the same training; with H=1, an
outer SGD at lr 1.0 and a momentum-free inner SGD, local SGD *is* synchronous SGD.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from psar.ps.job import Job
from psar.ps.serde import job_from_pb, job_to_pb
from psar.ps.server.modes import BUILTIN, RuleOptions
from psar.ps.server.modes.local import LocalPolicy
from psar.trainkit.config import DDPConfig, LocalConfig, PSConfig, TrainConfig
from psar.trainkit.local_sgd import LocalSteps, outer_optimizer_config
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig
from psar.worker import cli
from tests.procs import run_ps_workers, run_torchrun, shards

STEPS, H = 12, 4
COMMON = ["--workload", "mlp", "--steps", str(STEPS), "--batch-size", "16", "--seed", "3",
          "--lr", "0.05", "--momentum", "0.9", "--eval-batches", "2",
          "--precision", "fp32"]  # fmt: skip
LOCAL = ["--mode", "local", "--sync-every", str(H)]


def _rel(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def diloco_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """PS (2 shards, 2 workers) and DDP (2 ranks), DiLoCo defaults (nesterov 0.9, lr 0.7)."""
    tmp = tmp_path_factory.mktemp("diloco")
    args = [*COMMON, *LOCAL]
    with shards(2) as addrs:
        ps = run_ps_workers(addrs, 2, tmp, [*args, "--save", str(tmp / "ps.pt")])
    ddp = run_torchrun(2, tmp, [*args, "--save", str(tmp / "ddp.pt")])
    return {"ps": ps, "ddp": ddp, "tmp": tmp}


@pytest.mark.slow
def test_ps_local_matches_ddp_local_per_outer_round(diloco_runs: dict) -> None:
    ps0, ddp = diloco_runs["ps"][0], diloco_runs["ddp"]
    assert len(ps0["losses"]) == len(ddp["losses"]) == STEPS
    # Every step's loss, and so every outer round's start weights, agree in fp32.
    assert _rel(ps0["losses"], ddp["losses"]) <= 1e-5
    a = torch.load(diloco_runs["tmp"] / "ps.pt")
    b = torch.load(diloco_runs["tmp"] / "ddp.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_reports_count_outer_rounds_bytes_and_drift(diloco_runs: dict) -> None:
    for rep in [*diloco_runs["ps"], diloco_runs["ddp"]]:
        assert rep["mode"] == "local"
        assert rep["sync_every"] == H
        assert rep["outer_rounds"] == STEPS // H
        assert rep["bytes_per_outer_round"] > 0
        assert rep["drift"]["max"] >= rep["drift"]["mean"] > 0
    ps0 = diloco_runs["ps"][0]
    # One push and one pull per outer round, none in between (plus the pull at start).
    rounds = STEPS // H
    first_pull = ps0["bytes_pulled"] // (rounds + 1)
    assert ps0["bytes_pushed"] + ps0["bytes_pulled"] - first_pull == (
        ps0["bytes_per_outer_round"] * rounds
    )
    # The two workers trained on different data between syncs: their drifts differ.
    assert diloco_runs["ps"][0]["drift"] != diloco_runs["ps"][1]["drift"]
    # The workers end on the same (shared) weights: same validation loss.
    assert diloco_runs["ps"][0]["val_loss"] == diloco_runs["ps"][1]["val_loss"]


@pytest.mark.slow  # default run under 10 minutes; CI runs -m slow too
def test_h1_outer_sgd_lr1_is_synchronous_sgd(tmp_path: Path) -> None:
    # Inner SGD without momentum from the same weights, then the plain average of the
    # new weights: w - lr * mean(g_i), one synchronous SGD step. Against PS sync itself.
    plain = [*COMMON, "--momentum", "0", "--steps", "6"]
    local = [*plain, "--mode", "local", "--sync-every", "1", "--outer-optimizer", "sgd",
             "--outer-lr", "1.0"]  # fmt: skip
    (tmp_path / "s").mkdir()
    (tmp_path / "l").mkdir()
    with shards(1) as addrs:
        sync = run_ps_workers(addrs, 2, tmp_path / "s", plain)
    with shards(1) as addrs:
        loc = run_ps_workers(addrs, 2, tmp_path / "l", local)
    assert loc[0]["outer_rounds"] == 6 and "outer_rounds" not in sync[0]
    for r in range(2):
        assert _rel(loc[r]["losses"], sync[r]["losses"]) <= 1e-5


@pytest.mark.slow
def test_model_averaging_ddp_matches_ps_with_sgd_outer(tmp_path: Path) -> None:
    # Plain local SGD (outer sgd, lr 1.0) with bf16 on the wire: both architectures agree
    # to the documented low-precision tolerance; nothing moves between syncs.
    args = [*COMMON, *LOCAL, "--outer-optimizer", "sgd", "--wire-dtype", "bf16",
            "--run-dir", str(tmp_path)]  # fmt: skip
    with shards(1) as addrs:
        ps = run_ps_workers(addrs, 2, tmp_path, args)
    ddp = run_torchrun(2, tmp_path, args)
    assert _rel(ps[0]["losses"], ddp["losses"]) <= 5e-3
    # bf16 on the wire: a pseudo-gradient push is half the size of an fp32 pull (one
    # push per round; one pull per round and one at start).
    rounds = STEPS // H
    assert ps[0]["bytes_pushed"] * 2 * (rounds + 1) == ps[0]["bytes_pulled"] * rounds > 0
    rows = _rows(tmp_path, "steps-ps-rank0.jsonl")
    # Bytes grow only at the syncs (step 1's count is the pull at start).
    moved = [b["step"] for a, b in zip(rows, rows[1:], strict=False) if b["bytes"] > a["bytes"]]
    assert moved == [H, 2 * H, 3 * H]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"ps": {"mode": "local"}}, "--mode local needs --sync-every"),
        ({"local": {"sync_every": 5}}, "--sync-every 5 needs --mode local"),
        ({"local": {"sync_every": -1}}, "--sync-every must be >= 1"),
        ({"local": {"outer_optimizer": "adam"}}, "--outer-optimizer: unknown 'adam'; accepted: sgd, nesterov"),
        ({"local": {"outer_lr": -1.0}}, "--outer-lr must be a finite number"),
        ({"local": {"outer_lr": math.inf}}, "--outer-lr must be a finite number"),
        ({"local": {"outer_momentum": 1.0}}, "--outer-momentum must be in (0, 1)"),
        ({"ps": {"mode": "local"}, "local": {"sync_every": 2}, "worker_weights": "bf16"},
         "--worker-weights bf16 with --mode local"),
        ({"ps": {"mode": "local"}, "local": {"sync_every": 2}, "ddp": {"checkpoint_dir": "x"}},
         "--checkpoint-dir with --mode local"),
    ],
)  # fmt: skip
def test_bad_local_flags_name_the_flag(kw: dict, needle: str) -> None:
    sections = {"ps": PSConfig, "local": LocalConfig, "ddp": DDPConfig}
    with pytest.raises(ValueError) as e:
        TrainConfig(**{k: sections[k](**v) if k in sections else v for k, v in kw.items()})
    assert needle in str(e.value)


def test_cli_maps_the_local_flags(capsys) -> None:
    argv = ["train", "--dry-run", "--servers", "h:1", "--mode", "local", "--sync-every", "20", "--outer-optimizer",
            "sgd", "--outer-lr", "0.9"]  # fmt: skip
    cli.main(argv)
    out = json.loads(capsys.readouterr().out)
    assert out["ps"]["mode"] == "local"
    assert out["local"] == {**out["local"], "sync_every": 20, "outer_optimizer": "sgd",
                            "outer_lr": 0.9}  # fmt: skip
    with pytest.raises(SystemExit) as e:
        cli.main([*argv[:-4], "--outer-optimizer", "lion"])
    assert e.value.code == 2
    assert "--outer-optimizer: unknown 'lion'; accepted: sgd, nesterov" in capsys.readouterr().err


def test_outer_lr_defaults() -> None:
    assert LocalConfig(outer_optimizer="nesterov").effective_lr() == 0.7
    assert LocalConfig(outer_optimizer="sgd").effective_lr() == 1.0
    assert LocalConfig(outer_optimizer="sgd", outer_lr=0.5).effective_lr() == 0.5
    n = outer_optimizer_config("nesterov", 0.7, 0.9)
    assert n.nesterov and n.momentum == 0.9 and n.lr == 0.7
    s = outer_optimizer_config("sgd", 1.0, 0.9)
    assert not s.nesterov and s.momentum == 0.0


def test_job_local_round_trips_and_needs_sync_every() -> None:
    job = Job(mode="local", sync_every=20, num_workers=4)
    assert job_from_pb(job_to_pb(job)) == job
    with pytest.raises(ValueError, match="--mode local needs --sync-every"):
        Job(mode="local")
    with pytest.raises(ValueError, match="only --mode local takes it"):
        Job(mode="sync", sync_every=3)
    assert isinstance(BUILTIN.rule(job, RuleOptions(chunk_rounds=True)), LocalPolicy)


def test_local_steps_pseudo_gradient_and_rebase() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ls = LocalSteps([w], OptimizerConfig(lr=0.5, momentum=0.0), sync_every=2, total_steps=5,
                    loss_scale=LossScaleConfig(), device=torch.device("cpu"))  # fmt: skip
    w.grad = torch.tensor([1.0, -2.0])
    assert not ls.inner_step() and not ls.due()
    w.grad = torch.tensor([1.0, -2.0])
    assert not ls.inner_step() and ls.due()
    pseudo, drift, finite = ls.pseudo_gradients()
    assert finite and torch.equal(pseudo[0], torch.tensor([1.0, -2.0]))
    assert drift == pytest.approx(math.sqrt(5.0))
    w.grad = torch.tensor([math.inf, 0.0])
    assert ls.inner_step()  # a non-finite inner gradient skips the step, weights stay
    assert torch.equal(w.detach(), torch.tensor([0.0, 4.0]))
    ls.restore_anchor()
    assert torch.equal(w.detach(), torch.tensor([1.0, 2.0]))
    ls.rebase(100, drift, skipped=False)
    assert ls.report()["outer_rounds"] == 1 and ls.report()["bytes_per_outer_round"] == 100


def test_plan_divides_per_step_communication_by_h() -> None:
    from psar.worker.plan_model import PlanInputs, plan

    base = dict(params=10**8, workers=4, bandwidth_bytes_per_second=125e6, compute_seconds=0.2)
    every, local = plan(PlanInputs(**base)), plan(PlanInputs(**base, sync_every=20))
    for a, b in ((every.allreduce, local.allreduce), (every.ps, local.ps)):
        assert b.bytes_sent_per_worker_per_step == pytest.approx(
            a.bytes_sent_per_worker_per_step / 20
        )
        assert b.comm_seconds_per_step == pytest.approx(a.comm_seconds_per_step / 20)
        # Nothing overlaps the sync: a step costs compute + its share of the sync.
        assert b.step_seconds_overlap == pytest.approx(0.2 + b.comm_seconds_per_step)
        assert b.memory_per_worker.total > a.memory_per_worker.total  # inner state + anchor
    assert "every 20 steps" in local.reason
    with pytest.raises(ValueError, match="sync every must be >= 1"):
        PlanInputs(**base, sync_every=0)


def test_compare_knows_the_local_runs() -> None:
    from psar.worker import compare

    assert compare.RUNS["ps-local"] == ("ps", "local")
    assert compare.RUNS["allreduce-local"] == ("allreduce", "local")
    args, _ = compare.build_parser().parse_known_args(["--sync-every", "8"])
    assert compare._mode_args("ps", "local", args) == ["--sync-every", "8"]
    assert compare._mode_args("ps", "sync", args) == []


def test_launch_tells_allreduce_ranks_the_local_mode() -> None:
    from psar.worker.launch import LaunchSpec, _ps_flags

    assert _ps_flags(LaunchSpec(arch="allreduce", mode="local"), "", 0) == ["--mode", "local"]
    assert _ps_flags(LaunchSpec(arch="allreduce", mode="sync"), "", 0) == []


@pytest.mark.slow
def test_compare_runs_local_under_both_architectures(tmp_path: Path) -> None:
    from psar.worker.compare import main as compare_main

    out = tmp_path / "cmp"
    argv = ["--steps", "8", "--workers", "2", "--out", str(out), "--smooth", "2",
            "--runs", "ps-local,allreduce-local", "--sync-every", "4", "--eval-batches", "1"]  # fmt: skip
    assert compare_main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    for name in ("ps-local", "allreduce-local"):
        row = doc["runs"][name]
        assert row["exit_code"] == 0 and row["steps_rank0"] == 8
        rep = json.loads((out / name / "report-0.json").read_text())
        assert rep["mode"] == "local" and rep["outer_rounds"] == 2


@pytest.mark.slow
def test_shard_killed_and_restored_every_shard_continues_from_the_same_outer_round(
    tmp_path: Path,
) -> None:
    # As tests/test_fault_restore.py's sync case: outer rounds are rounds, so a restored
    # shard's peers follow it back to the same checkpointed round.
    from tests.fault_procs import Workers, shard_set, stats, wait_until

    every, steps = 3, 40
    ckpt = tmp_path / "ckpt"
    with shard_set(2, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every),
                   "--lease-s", "5") as shards:  # fmt: skip
        addrs = [s.address for s in shards]
        workers = Workers(addrs, 2, tmp_path, ["--steps", str(steps), "--mode", "local",
                          "--sync-every", "2", "--emulate-compute-ms", "60",
                          "--chunk-mib", "0.005", "--eval-batches", "2"])  # fmt: skip
        try:
            wait_until(lambda: stats(addrs)[1]["rounds"] >= 2 * every + 1, 120, "rounds>=7")
            shards[1].kill9()
            shards[1].start("--restore", str(ckpt))
            reports = workers.wait()
            final = stats(addrs)
        finally:
            workers.close()
    assert final[1]["restores"] == 1 and final[0]["restores"] == 1
    assert final[0]["restored_step"] == final[1]["restored_step"] >= 2 * every
    assert final[0]["rounds"] == final[1]["rounds"]
    assert final[0]["updates_applied"] == final[1]["updates_applied"]
    for rep in reports:
        assert rep["mode"] == "local" and rep["restores"] == 1
        assert len(rep["losses"]) == steps
        assert rep["losses"][-1] < rep["losses"][0]
    # Both end on the same shared weights.
    assert reports[0]["val_loss"] is not None
    assert reports[0]["val_loss"] == reports[1]["val_loss"]
