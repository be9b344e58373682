"""Architectures head to head: allreduce, ps-sync, ps-async, ps-ssp on `mlp` and `lm`.

Each case (workload x worker count) is one `psar compare` (worker.compare's API): the
four runs share the workload, seed, per-worker batch, steps and precision (fp32, one
compute thread per process), and compare reports samples/s (all workers' samples / job
time). Time to target loss is recomputed here from rank 0's smoothed loss (compare's
window): target = 1.05 x the worst final smoothed loss among the runs that did not
diverge (a run diverged when its final smoothed loss is not below its first), so every
converging run reaches it and one blow-up cannot make the target meaningless. Every
result is also given as a ratio to allreduce measured in the same case.

    python -m bench.head_to_head                  # mlp, lm x 2, 4 workers
    python -m bench.head_to_head --quick --json   # mlp x 2 workers, short
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c
from worker import compare as cmp
from worker import report

BASELINE = "allreduce"


def run_case(
    out: Path, workload: str, workers: int, steps: int, batch: int, timeout: float
) -> dict:
    argv = ["--workload", workload, "--workers", str(workers), "--steps", str(steps),
            "--batch-size", str(batch), "--out", str(out / f"{workload}-w{workers}"),
            "--timeout", str(timeout), "--threads", "1", "--log-every", "0"]  # fmt: skip
    args, extra = cmp.build_parser().parse_known_args(argv)
    code, doc = cmp.compare(args, extra)
    if "config" not in doc:
        raise c.BenchError(f"psar compare {' '.join(argv)} stopped with exit {code}")
    curves = {
        name: _rank0_curve(Path(doc["out"]) / name, doc["smooth_window"]) for name in doc["runs"]
    }
    diverged = {n: not (math.isfinite(sm[-1]) and sm[-1] <= sm[0]) if sm else True
                for n, (_, sm) in curves.items()}  # fmt: skip
    finals = [sm[-1] for n, (_, sm) in curves.items() if not diverged[n]]
    target = 1.05 * max(finals) if finals else doc["target_loss"]
    ttt = {n: next((t for t, v in zip(*curves[n], strict=True) if v < target), None)
           for n in doc["runs"]}  # fmt: skip
    base = doc["runs"].get(BASELINE, {})
    runs = {}
    for name, r in doc["runs"].items():
        sps = r["samples_per_sec"]
        runs[name] = {
            "samples_per_sec": sps,
            "samples_per_sec_x_allreduce": _div(sps, base.get("samples_per_sec")),
            "time_to_target_s": ttt[name],
            "time_to_target_x_allreduce": _div(ttt[name], ttt.get(BASELINE)),
            "final_train_loss": r["final_train_loss"],
            "diverged": diverged[name],
            "staleness_p99": r["staleness_p99"],
            "exit_code": r["exit_code"],
        }
    return {"workload": workload, "workers": workers, "steps": steps, "batch_size": batch,
            "target_loss": target, "compare_out": doc["out"], "runs": runs}  # fmt: skip


def _rank0_curve(run_dir: Path, window: int) -> tuple[list[float], list[float]]:
    """(times, smoothed losses) of rank 0, its first value the mean of the first window."""
    rank0 = next((s for s in report.load_run(run_dir)[0] if s.rank == 0), None)
    if rank0 is None or not rank0.loss:
        return [], []
    sm = cmp.smoothed(rank0.loss, window)
    k = min(window, len(sm)) - 1
    return rank0.time[k:], sm[k:]


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(doc: dict) -> str:
    head = ["workload", "workers", "run", "samples/s", "x allreduce", "time to target (s)",
            "x allreduce", "final loss", "diverged", "staleness p99"]  # fmt: skip
    rows = []
    for case in doc["cases"]:
        for name, r in case["runs"].items():
            rows.append([case["workload"], case["workers"], name, r["samples_per_sec"],
                         r["samples_per_sec_x_allreduce"], r["time_to_target_s"],
                         r["time_to_target_x_allreduce"], r["final_train_loss"],
                         r["diverged"], r["staleness_p99"]])  # fmt: skip
    targets = "; ".join(f"{k['workload']} w{k['workers']}: {k['target_loss']:.4g}"
                        for k in doc["cases"])  # fmt: skip
    return (
        "## Architectures head to head\n\n"
        + c.md_table(head, rows)
        + f"\n\nfp32, one thread per process, 1 ps shard, ssp bound 2, batch "
        f"{doc['cases'][0]['batch_size']}/worker. Target losses (rank 0, smoothed): {targets}. "
        "For time to target lower is better; x allreduce < 1 means faster than allreduce."
    )


def write_plot(out: Path, doc: dict) -> None:
    names = list(doc["cases"][0]["runs"])
    labels = [f"{k['workload']} w{k['workers']}" for k in doc["cases"]]
    lines = {n: (labels, [k["runs"][n]["samples_per_sec"] or 0 for k in doc["cases"]])
             for n in names}  # fmt: skip
    c.plot(out / "head_to_head.png", lines, xlabel="case", ylabel="samples/s",
           title="architectures head to head", bars=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.head_to_head", __doc__)
    p.add_argument("--workloads", default=None, help="(default mlp,lm; quick mlp)")
    p.add_argument("--workers", default=None, help="(default 2,4; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="per worker (default 200; quick 60)")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    c.install_sigterm()
    out = c.out_dir(args, "head_to_head")
    workloads = (args.workloads or ("mlp" if args.quick else "mlp,lm")).split(",")
    workers = [int(w) for w in (args.workers or ("2" if args.quick else "2,4")).split(",")]
    steps = args.steps or (60 if args.quick else 200)
    cases = [run_case(out, wl, n, steps, args.batch_size, args.timeout)
             for wl in workloads for n in workers]  # fmt: skip
    doc = {"baseline": BASELINE, "cases": cases}
    write_plot(out, doc)
    return c.finish(args, out, "head_to_head", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
