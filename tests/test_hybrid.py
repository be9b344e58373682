"""--arch hybrid (worker/hybrid.py): sparse tables on the PS shards, dense layers allreduced.

Sync hybrid trains exactly as DDP with sparse gradients (fp32, per step), as
tests/test_sparse_train.py holds PS sync to DDP; real shards, torchrun ranks and gloo.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from psar.ps.partition import plan_slots
from psar.trainkit.config import DDPConfig, TrainConfig
from psar.worker import launch
from psar.worker.hybrid import ROUND_SLOT, tables_view
from psar.worker.workloads import load_workload
from tests.procs import ENV, PSAR, free_port, run_own_group, run_ps_workers, run_torchrun, shards

STEPS = 12
COMMON = ["--workload", "recsys", "--workload-option", "rows=10000,1000",
          "--workload-option", "dim=8", "--workload-option", "samples=4096",
          "--workload-option", "val_samples=256", "--workload-option", "sparse=true",
          "--steps", str(STEPS), "--batch-size", "32", "--seed", "3", "--lr", "0.5",
          "--momentum", "0", "--eval-batches", "2", "--precision", "fp32",
          "--wire-dtype", "fp32"]  # fmt: skip


def run_hybrid(addrs: list[str], tmp: Path, args: list[str], world: int = 2) -> dict:
    """`psar train --arch hybrid` under torchrun (the process group) with --servers;
    rank 0's report."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "psar.worker.cli", "train", "--arch", "hybrid", "--servers", ",".join(addrs),
        "--torch-threads", "1", "--report", str(tmp / "report-hybrid.json"),
        "--log-every", "0", *args,
    ]  # fmt: skip
    p = run_own_group(cmd, 240)
    if p.returncode != 0:
        raise AssertionError(
            f"hybrid exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        )
    return json.loads((tmp / "report-hybrid.json").read_text())


def _rel(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


# ---- pure logic ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"clip_grad_norm": 1.0}, "--clip-grad-norm"),
        ({"ddp": DDPConfig(checkpoint_dir="ck")}, "--checkpoint-dir"),
    ],
)
def test_config_refuses_what_hybrid_does_not_do_yet(kw: dict, flag: str) -> None:
    TrainConfig(arch="hybrid")  # accepted as such
    with pytest.raises(ValueError, match=f"{flag} with --arch hybrid: not supported"):
        TrainConfig(arch="hybrid", **kw)
    TrainConfig(arch="ps", **kw)  # the same flags stay valid elsewhere


def test_tables_view_holds_the_tables_at_their_paths_and_a_round_slot_per_shard() -> None:
    model = load_workload("recsys", 0, {"rows": "100,50", "dim": "4"}, materialize=False).model
    view = tables_view(model, 3)
    mods = dict(view.named_modules())
    for name in ("tables.0", "tables.1"):  # the same module objects, under the same names
        assert mods[name] is dict(model.named_modules())[name]
    rounds = [(n, p.numel()) for n, p in view.named_parameters() if n.startswith("psar_round")]
    assert [n for n, _ in rounds] == [ROUND_SLOT.format(i) for i in range(3)]
    assert sorted(s.shard for s in plan_slots(rounds, 3)) == [0, 1, 2]


def test_a_model_without_tables_is_refused() -> None:
    model = load_workload("mlp", 0).model
    with pytest.raises(ValueError, match="no table marked psar_sparse_table.*--arch allreduce"):
        tables_view(model, 2)


def test_launch_gives_hybrid_workers_the_shards_and_no_rank_flags() -> None:
    spec = launch.parse(["--arch", "hybrid", "--servers", "2", "--steps", "3"])
    launch.validate(spec)
    flags = launch._ps_flags(spec, "h:1,h:2", 1)
    assert flags[:2] == ["--servers", "h:1,h:2"] and "--rank" not in flags
    # A script of its own runs under hybrid too (tests/test_own_loop_hybrid.py).
    launch.validate(launch.parse(["--arch", "hybrid", "--", "python", "x.py"]))


@pytest.mark.parametrize(
    ("rounds", "staleness", "bound", "waits"),
    [(True, "none", 0, True), (False, "versions", 0, False), (False, "bounded", 0, True),
     (False, "bounded", 1, False), (False, "bounded", 3, False)],
)  # fmt: skip
def test_a_hybrid_step_waits_for_every_ranks_rows_where_the_tables_mode_needs_it(
    rounds: bool, staleness: str, bound: int, waits: bool
) -> None:
    """Sync rounds and SSP at a bound of 0 read each clock's rows only after every rank's;
    async and SSP >= 1 need no join (the dense allreduce keeps the ranks within a clock)."""
    from psar.ps.client.backend_tables import TablesOnly

    b = SimpleNamespace(traits=SimpleNamespace(rounds=rounds, staleness=staleness))
    b.job_staleness = bound
    assert TablesOnly(b).reads_wait is waits


# ---- real processes ---------------------------------------------------------------------


@pytest.mark.parametrize("accum", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_hybrid_sync_matches_ddp_sparse_fp32(tmp_path: Path, accum: int) -> None:
    common = [*COMMON, "--grad-accum", str(accum)]
    with shards(2) as addrs:
        hyb = run_hybrid(
            addrs,
            tmp_path,
            [*common, "--sparse-wire-dtype", "fp32", "--save", str(tmp_path / "h.pt")],
        )
    # torch's fused SGD refuses sparse gradients: DDP-sparse steps with the loop impl.
    ddp = run_torchrun(
        2, tmp_path, [*common, "--optimizer-impl", "loop", "--save", str(tmp_path / "d.pt")]
    )
    assert hyb["arch"] == "hybrid" and hyb["mode"] == "sync"
    assert len(hyb["losses"]) == len(ddp["losses"]) == STEPS
    assert _rel(hyb["losses"], ddp["losses"]) <= 1e-5
    assert hyb["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    a, b = torch.load(tmp_path / "h.pt"), torch.load(tmp_path / "d.pt")
    assert a.keys() == b.keys() and a["tables.0.weight"].shape == (10000, 8)
    for k in a:  # dense weights from the ranks, tables from the shards
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
    init = load_workload("recsys", 3, {"rows": "10000,1000", "dim": "8"}).model.state_dict()
    assert not torch.equal(init["mlp.0.weight"], a["mlp.0.weight"])  # the dense part trained
    assert not torch.equal(init["tables.0.weight"], a["tables.0.weight"])  # and the tables
    # Only the dense MLP is allreduced (fp32): (16 x 64 + 64) + (64 + 1) parameters.
    assert hyb["bytes_allreduced"] == STEPS * (16 * 64 + 64 + 64 + 1) * 4
    assert hyb["sparse_bytes_pushed"] > 0 and hyb["worker_param_bytes"] < 10000 * 8 * 4
    # Rows once (bytes_pushed holds them) plus the ring's share: 2 ranks send the payload.
    assert hyb["bytes_sent"] == hyb["bytes_pushed"] + hyb["bytes_allreduced"]
    for t in hyb["sparse_tables"].values():  # sync: every row push applied fresh
        assert t["staleness_histogram"] == {"0": 2 * STEPS}  # one push per shard per step
    # No dense round: the shards saw rows only (the round slots were pulled once, at setup).
    assert [(s["rounds"], s["updates_applied"]) for s in hyb["shards"]] == [(0, 0), (0, 0)]


@pytest.mark.slow  # real processes for 4-30 s: the slow suite
def test_one_hybrid_worker_started_by_hand_trains_as_one_ps_worker(tmp_path: Path) -> None:
    """`psar train --arch hybrid --servers ...` alone (no torchrun, no process group):
    nothing to allreduce, and the same training as one PS worker of the same model."""
    args = [*COMMON, "--sparse-wire-dtype", "fp32", "--steps", "6"]
    with shards(1) as addrs:
        cmd = [*PSAR, "train", "--arch", "hybrid", "--servers", addrs[0], "--torch-threads",
               "1", "--log-every", "0", "--report", str(tmp_path / "h.json"), *args]  # fmt: skip
        env = {k: v for k, v in ENV.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
        p = run_own_group(cmd, 120, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
    with shards(1) as addrs:
        (ps,) = run_ps_workers(addrs, 1, tmp_path, args)
    hyb = json.loads((tmp_path / "h.json").read_text())
    assert hyb["world_size"] == 1 and hyb["bytes_sent"] == hyb["bytes_pushed"]  # no ring
    assert _rel(hyb["losses"], ps["losses"]) <= 1e-6


@pytest.mark.slow
def test_hybrid_async_tables_train_beside_a_synchronous_dense_part(tmp_path: Path) -> None:
    args = [*COMMON, "--mode", "async", "--sparse-optimizer", "adagrad", "--sparse-lr", "0.05",
            "--steps", "30", "--save", str(tmp_path / "h.pt")]  # fmt: skip
    with shards(2) as addrs:
        rep = run_hybrid(addrs, tmp_path, args)
    assert rep["mode"] == "async" and all(np.isfinite(rep["losses"]))
    hist = rep["sparse_tables"]["tables.0.weight"]["staleness_histogram"]
    assert sum(hist.values()) == 2 * 30
    assert rep["bytes_allreduced"] == 30 * (16 * 64 + 64 + 64 + 1) * 4


@pytest.mark.slow
def test_psar_launch_runs_a_hybrid_job(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    args = [sys.executable, "-m", "psar.worker.cli", "launch", "--arch", "hybrid",
            "--servers", "2", "--workers", "2", *COMMON[:-4], "--precision", "fp32",
            "--torch-threads", "1", "--report", str(report), "--timeout", "200"]  # fmt: skip
    p = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "all 2 workers finished; stopped the shards" in p.stderr
    rep = json.loads(report.read_text())
    assert rep["arch"] == "hybrid" and rep["world_size"] == 2 and rep["steps"] == STEPS


@pytest.mark.slow
def test_an_overflow_skips_the_step_on_every_rank_and_on_the_shards(tmp_path: Path) -> None:
    """fp16: rank 0's non-finite gradient at step 3 makes its row push an overflow, so the
    shards skip the table round; the ranks' join carries the verdict, so rank 1, whose own
    gradient was finite, skips its dense step too and both back their loss scale off
    alike (worker/hybrid.py): the ranks stay in step."""
    args = [*COMMON[:-4], "--precision", "fp16", "--steps", "6", "--inject-overflow-step",
            "3", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    with shards(2) as addrs:
        rep = run_hybrid(addrs, tmp_path, args)
    assert rep["skipped_steps"] == 1 and all(np.isfinite(rep["losses"]))
    logs = [
        [json.loads(line) for line in (tmp_path / "run" / f"steps-hybrid-rank{r}.jsonl").open()]
        for r in (0, 1)
    ]
    for log in logs:
        assert [s["step"] for s in log if s["skipped"]] == [3]
        assert log[2]["loss_scale"] == log[1]["loss_scale"] / 2
    assert [s["loss_scale"] for s in logs[0]] == [s["loss_scale"] for s in logs[1]]


# ---- the DLRM-style recsys (issue #46 item 3) --------------------------------------------


def test_dlrm_options_add_dense_features_and_leave_the_plain_recsys_alone() -> None:
    from psar.worker.workloads.recsys import DLRMModel, RecsysModel

    base = {"rows": "500,50", "dim": "4", "samples": "64", "val_samples": "0"}
    plain = load_workload("recsys", 0, base, materialize=False)
    dlrm = load_workload("recsys", 0, {**base, "dense": "3", "interaction": "dot"})
    assert type(plain.model) is RecsysModel and type(dlrm.model) is DLRMModel
    x, _ = plain.train_dataset.tensors
    xd, _ = dlrm.train_dataset.tensors
    assert x.dtype == torch.int64 and xd.dtype == torch.float64 and xd.shape == (64, 3 + 8)
    assert torch.equal(xd[:, 3:].long(), x)  # the same ids, the dense features before them
    assert dlrm.model(xd[:5]).shape == (5,)
    with pytest.raises(ValueError, match="interaction: accepted: cat, dot"):
        load_workload("recsys", 0, {**base, "interaction": "sum"})


@pytest.mark.slow
def test_hybrid_sync_matches_ddp_sparse_on_the_dlrm_style_model(tmp_path: Path) -> None:
    args = [*COMMON, "--workload-option", "dense=6", "--workload-option", "interaction=dot",
            "--workload-option", "hidden=32"]  # fmt: skip
    with shards(2) as addrs:
        hyb = run_hybrid(addrs, tmp_path, [*args, "--sparse-wire-dtype", "fp32"])
    ddp = run_torchrun(2, tmp_path, [*args, "--optimizer-impl", "loop"])
    assert _rel(hyb["losses"], ddp["losses"]) <= 1e-5
    assert hyb["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
