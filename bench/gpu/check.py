"""GPU check: NCCL DDP and a PS job with CUDA workers in fp16 (with and without
overlap: push during backward from pinned buffers after CUDA events); prints throughput
(samples/s over the window in which every worker trains; ps_over_ddp: the PS's over
DDP's of the same run) and whether the CUDA paths behave (same losses, host tensors).

Run on a machine with CUDA (a few minutes at most):

    python -m bench.gpu.check [--steps 200] [--json] [--timeout-s 300]

It exits 0 with "skipped: no CUDA device" anywhere else, so it can never break CI.
DDP uses as many ranks as there are GPUs (NCCL refuses two ranks on one GPU); with
a single GPU it runs one NCCL rank, which still exercises the NCCL path end to end.

Every job runs through worker/supervisor.py's Supervisor (bench/lib/common.py) with its
output in a log file; a job that outlives --timeout-s, fails, or is interrupted (Ctrl-C, SIGTERM)
stops every process this script started, and the script exits 1 with the log's tail.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import common as c


def train_args(steps: int, report: str) -> list[str]:
    return ["--workload", "mlp", "--workload-option", "in_dim=784", "--workload-option",
            "hidden=1024", "--workload-option", "samples=65536", "--batch-size", "256",
            "--steps", str(steps), "--precision", "fp16", "--device", "cuda",
            "--eval-batches", "5", "--log-every", "50", "--report", report]  # fmt: skip


def run_ddp(gpus: int, steps: int, tmp: Path, timeout: float) -> tuple[dict, float]:
    """Rank 0's report, and samples/s over the window every rank trains in."""
    report = tmp / "ddp.json"
    py = ["-m", "psar.worker.cli", "train", "--arch", "allreduce", "--backend", "nccl",
          "--run-dir", str(tmp / "ddp"), *train_args(steps, str(report))]  # fmt: skip
    run = c.ddp_job(tmp / "ddp", workers=gpus, py_args=py, timeout=timeout)
    return json.loads(report.read_text()), c.steady_rate(run)[0]


def run_ps(workers: int, steps: int, tmp: Path, timeout: float,
           *extra: str) -> tuple[list[dict], float]:  # fmt: skip
    """Every worker's report, and samples/s over the window every worker trains in."""
    name = "-".join(["ps", *(e.lstrip("-") for e in extra if e.startswith("--"))])
    with c.supervisor(tmp / name) as sup:  # leaving it stops every process it started
        (addr,) = c.start_shards(sup, 1, timeout=min(timeout, 120.0))
        for r in range(workers):
            # LOCAL_RANK picks the worker's GPU (cuda:LOCAL_RANK % device count).
            cmd = [*c.PSAR, "train", "--arch", "ps", "--servers", addr, "--rank", str(r),
                   "--world-size", str(workers), "--run-dir", str(tmp / name),
                   *train_args(steps, str(tmp / f"{name}-{r}.json")), *extra]  # fmt: skip
            sup.start(f"worker{r}", cmd, env=c.child_env({"LOCAL_RANK": str(r)}))
        sup.wait([f"worker{r}" for r in range(workers)], timeout)
    reports = [json.loads((tmp / f"{name}-{r}.json").read_text()) for r in range(workers)]
    return reports, c.steady_rate(c.load_run(tmp / name))[0]


def check(gpus: int, steps: int, tmp: Path, timeout: float) -> dict:
    import torch

    ddp, ddp_rate = run_ddp(gpus, steps, tmp, timeout)
    saved = tmp / "ps-weights.pt"
    # overlap on: push during backward (side stream), pull in forward order (per-slot copies)
    ps, ps_rate = run_ps(2, steps, tmp, timeout, "--save", str(saved))
    plain, plain_rate = run_ps(2, steps, tmp, timeout, "--no-overlap")
    weights = torch.load(saved, weights_only=True)  # no map_location: as saved
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "ddp_nccl_ranks": gpus,
        "ddp_global_samples_per_sec": ddp_rate,
        "ddp_final_loss": ddp["final_train_loss"],
        "ps_fp16_workers": 2,
        "ps_global_samples_per_sec": ps_rate,
        "ps_over_ddp": ps_rate / ddp_rate if ddp_rate else None,
        "ps_final_loss": ps[0]["final_train_loss"],
        "ps_skipped_steps": ps[0]["skipped_steps"],
        "ps_final_loss_scale": ps[0]["final_loss_scale"],
        "ps_no_overlap_global_samples_per_sec": plain_rate,
        "ps_no_overlap_final_loss": plain[0]["final_train_loss"],
        # The overlap changes when bytes move, never what is computed: same losses.
        "ps_overlap_same_loss": ps[0]["final_train_loss"] == plain[0]["final_train_loss"],
        # --save from CUDA workers writes host tensors: the file loads without a GPU.
        "ps_save_on_host": all(t.device.type == "cpu" for t in weights.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="per job (DDP, each PS run), seconds (default: 300)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the jobs' logs and reports here (default: a temp dir)")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    c.install_sigterm()  # SIGTERM unwinds through every supervisor: no orphans
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        tmp = args.out or Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            result = check(gpus, args.steps, tmp, args.timeout_s)
        except (c.ProcessError, OSError, ValueError, KeyError) as e:
            print(f"gpu_check: failed: {e}", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # every supervisor has stopped its processes
        sys.exit(130)
