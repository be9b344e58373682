"""A loop of the user's own (examples/own_loop.py through worker/own_loop.py's prepare())
trains exactly as psar's own loop does, under either architecture.

Real processes: `psar launch` starts the shards (ps) or the ranks of a DDP group (gloo),
and runs the example once per worker; `psar train` runs psar's own loop on the same
model and data (examples.own_loop:make_workload).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.procs import PSAR, run_own_group, run_ps_workers, shards

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loop.py"
STEPS = 12
# One weight decay for every parameter: psar's own loop has one for all of them.
EXAMPLE_ARGS = ["--steps", str(STEPS), "--batch-size", "32", "--lr", "0.1", "--warmup", "3",
                "--clip", "0.25", "--weight-decay", "0", "--seed", "0", "--log-every", "1"]  # fmt: skip
# The same run, said to psar's own loop.
TRAIN_ARGS = ["--workload", "examples.own_loop:make_workload", "--steps", str(STEPS),
              "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
              "--nesterov", "--weight-decay", "0", "--schedule", "warmup_cosine",
              "--warmup-steps", "3", "--clip-grad-norm", "0.25", "--seed", "0",
              "--precision", "fp32", "--eval-batches", "0"]  # fmt: skip
LINE = re.compile(r"step=(\d+) rank=(\d+) loss=(\S+) .*loss_scale=(\S+) skipped=(\w+)")


def _rel(a: list[float], b: list[float]) -> float:
    a_, b_ = np.asarray(a), np.asarray(b)
    assert a_.shape == b_.shape, (a, b)
    return float(np.max(np.abs(a_ - b_) / np.maximum(np.abs(b_), 1e-12)))


def _launch(
    arch: str,
    *example_args: str,
    flags: tuple[str, ...] = (),
    timeout: float = 300,
    steps_from: int = 1,
) -> tuple[dict, str]:
    """Run the example under `psar launch --arch arch *flags`, 2 workers; returns
    ({rank: [loss per step]}, rank 0's final_loss line); each step's loss scale in
    ({...})["scales"][rank]. `steps_from`: the first step it logs (a resumed run)."""
    ps = ["--mode", "sync", "--servers", "2"] if arch == "ps" else []
    args = [*PSAR, "launch", "--arch", arch, *ps, "--workers", "2", *flags, "--",
            sys.executable, str(EXAMPLE), *example_args]  # fmt: skip
    p = run_own_group(args, timeout, cwd=ROOT)
    assert p.returncode == 0, f"{arch}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    losses: dict = {0: [], 1: [], "scales": {0: [], 1: []}}
    for step, rank, loss, scale, skipped in LINE.findall(p.stdout):
        assert int(step) == len(losses[int(rank)]) + steps_from and skipped == "False"
        losses[int(rank)].append(float(loss))
        losses["scales"][int(rank)].append(float(scale))
    final = re.findall(r"final_loss=\S+", p.stdout)
    assert len(final) == 1, p.stdout[-2000:]  # rank 0's only
    return losses, final[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("own")
    out = {"tmp": tmp}
    for arch in ("ps", "allreduce"):
        out[arch] = _launch(arch, *EXAMPLE_ARGS, "--save", str(tmp / f"{arch}.pt"))
    with shards(2) as addrs:
        out["train"] = run_ps_workers(addrs, 2, tmp, TRAIN_ARGS, timeout=300)
    return out


@pytest.mark.slow
def test_ps_sync_and_allreduce_give_the_same_losses(runs: dict) -> None:
    (ps, ps_final), (ddp, ddp_final) = runs["ps"], runs["allreduce"]
    for rank in (0, 1):
        assert len(ps[rank]) == len(ddp[rank]) == STEPS
        assert _rel(ps[rank], ddp[rank]) <= 1e-5, (rank, ps[rank], ddp[rank])
    assert ps_final == ddp_final
    assert ps[0] != ps[1]  # each rank its own data: the comparison is per rank


@pytest.mark.slow
def test_the_example_equals_psar_own_loop(runs: dict) -> None:
    ps, _ = runs["ps"]
    for rank, report in enumerate(runs["train"]):
        assert _rel(ps[rank], report["losses"]) <= 1e-5, (rank, ps[rank], report["losses"])


@pytest.mark.slow
def test_state_dicts_agree_and_load_under_either_architecture(runs: dict) -> None:
    tmp = runs["tmp"]
    a, b = torch.load(tmp / "ps.pt"), torch.load(tmp / "allreduce.pt")
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-6)
    # The optimizer's state in torch's format under both: the shards' momentum buffers
    # read back under ps, the local optimizer's under allreduce.
    sa, sb = a["optimizer"], b["optimizer"]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) == 6
    for i in sa["state"]:
        buf = sa["state"][i]["momentum_buffer"]
        assert buf.abs().sum() > 0
        torch.testing.assert_close(buf, sb["state"][i]["momentum_buffer"], rtol=1e-4, atol=1e-6)
    assert [g["lr"] for g in sa["param_groups"]] == [g["lr"] for g in sb["param_groups"]]
    # ps's checkpoint, loaded before prepare(), goes on the same way under both (the
    # shards take the momentum with the job as torch's load_state_dict gives it here).
    more = ["--steps", "4", "--batch-size", "32", "--clip", "0.25", "--weight-decay", "0",
            "--log-every", "1", "--load", str(tmp / "ps.pt")]  # fmt: skip
    ps, _ = _launch("ps", *more)
    ddp, _ = _launch("allreduce", *more)
    for rank in (0, 1):
        assert _rel(ps[rank], ddp[rank]) <= 1e-5, (rank, ps[rank], ddp[rank])
    # And the momentum was loaded: from the same weights without it, the first step's
    # loss is the same and the second differs.
    a["optimizer"]["state"] = {}
    torch.save(a, tmp / "no-momentum.pt")
    fresh, _ = _launch("ps", *more[:-1], str(tmp / "no-momentum.pt"))
    assert abs(fresh[0][0] - ps[0][0]) <= 1e-6 * abs(ps[0][0])
    assert abs(fresh[0][1] - ps[0][1]) > 1e-5 * abs(ps[0][1])


@pytest.mark.slow
def test_fp16_with_accumulation(tmp_path: Path) -> None:
    # Two micro-batches a step, the first under run.no_sync(); fp16 with loss scaling.
    flags = ("--precision", "fp16", "--loss-scale-init-scale", "1024")
    ps, _ = _launch("ps", *EXAMPLE_ARGS, "--accum", "2", flags=flags)
    ddp, _ = _launch("allreduce", *EXAMPLE_ARGS, "--accum", "2", flags=flags)
    with shards(2) as addrs:
        train = run_ps_workers(addrs, 2, tmp_path, [*TRAIN_ARGS, *flags, "--grad-accum", "2"])
    for rank in (0, 1):
        # The documented tolerance between architectures in low precision
        # (docs/architecture.md); the same architecture's own loop: exactly as fp32.
        assert _rel(ps[rank], ddp[rank]) <= 5e-3, (rank, ps[rank], ddp[rank])
        assert _rel(ps[rank], train[rank]["losses"]) <= 1e-5, (rank, train[rank]["losses"])
        assert ps["scales"][rank] == ddp["scales"][rank] == [1024.0] * STEPS


def test_no_line_of_the_example_names_an_architecture() -> None:
    text = EXAMPLE.read_text()
    named = [
        line
        for line in text.splitlines()
        if re.search(r"\b(ps|allreduce|DDP|DistributedDataParallel|parameter server)\b", line)
    ]
    assert not named, named
    # The plain loop's parts, in the order a DDP user writes them.
    order = ["zero_grad()", "run.model(", "run.backward(", "run.clip_grad_norm_(",
             "run.optimizer.step()", "scheduler.step()"]  # fmt: skip
    loop = text[text.index("for step in range(run.step + 1, args.steps + 1)") :]
    at = [loop.index(s) for s in order]
    assert at == sorted(at)
