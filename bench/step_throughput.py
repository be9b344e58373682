"""Step throughput: psar (ps sync with 1 and 2 shards, allreduce) against plain baselines.

In one process tree and one run, on the reference workload (MLP 784-1024-1024-10, batch
128 per worker, SGD momentum, fp32, one compute thread per process) with each worker
count: psar `--arch ps --mode sync` with 1 and 2 shards, psar `--arch allreduce`, a plain
DDP script (bench/plain_ddp.py), a plain RPC parameter server written the PyTorch RPC
tutorial's way (bench/rpc_ps_baseline.py), and a no-communication run (plain_ddp.py
--no-comm: the same processes doing the same compute and optimizer step, no DDP). The
configurations alternate A B C ... A B C ... over the repeats; medians are reported.

samples/s = every worker's samples per step / its median step time, added up
(bench/common.py robust_rate). The step logs carry no per-phase times, so exposed
communication per step = median step time - the no-communication run's median step
time, measured alongside (the same CPU contention, so it is what communication costs).

    python -m bench.step_throughput                  # 2 and 4 workers, 3 repeats
    python -m bench.step_throughput --quick --json   # 2 workers, 1 repeat
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c
from bench.allreduce_overhead import run_plain, run_psar

CONFIGS = ("plain-ddp", "psar-allreduce", "psar-ps-sync-1", "psar-ps-sync-2", "rpc-ps")
BASELINE = "plain-ddp"


def run_rpc(out: Path, workers: int, steps: int, timeout: float) -> c.Run:
    py = [str(c.ROOT / "bench" / "rpc_ps_baseline.py"), "--steps", str(steps), "--out", str(out)]
    return c.ddp_job(out, workers=workers + 1, py_args=py, timeout=timeout)


def run_ps(out: Path, workers: int, shards: int, steps: int, timeout: float) -> c.Run:
    train = [*c.REF_TRAIN, "--steps", str(steps)]
    return c.ps_job(out, workers=workers, shards=shards, mode="sync", train=train, timeout=timeout)


def measure(out: Path, *, workers: int, steps: int, repeats: int, timeout: float) -> dict:
    d = out / f"w{workers}"
    runs = {
        "no-comm": lambda i: run_plain(d / f"nocomm-{i}", workers, steps, timeout, local=True),
        "plain-ddp": lambda i: run_plain(d / f"plain-{i}", workers, steps, timeout),
        "psar-allreduce": lambda i: run_psar(d / f"allreduce-{i}", workers, steps, timeout),
        "psar-ps-sync-1": lambda i: run_ps(d / f"ps1-{i}", workers, 1, steps, timeout),
        "psar-ps-sync-2": lambda i: run_ps(d / f"ps2-{i}", workers, 2, steps, timeout),
        "rpc-ps": lambda i: run_rpc(d / f"rpc-{i}", workers, steps, timeout),
    }
    got = c.alternate(runs, repeats)
    rate = {k: c.median([c.robust_rate(r) for r in v]) for k, v in got.items()}
    step = {k: c.median([c.job_step_seconds(r) for r in v]) for k, v in got.items()}
    compute = step["no-comm"]
    rows = {}
    for name in CONFIGS:
        rows[name] = {
            "samples_per_sec": rate[name],
            "ratio_to_plain_ddp": rate[name] / rate[BASELINE],
            "step_ms": 1e3 * step[name],
            "exposed_comm_ms": 1e3 * (step[name] - compute),
            "per_repeat_samples_per_sec": [c.robust_rate(r) for r in got[name]],
        }
    return {"workers": workers, "steps": steps, "repeats": repeats,
            "compute_ms_no_comm": 1e3 * compute, "no_comm_samples_per_sec": rate["no-comm"],
            "runs": rows}  # fmt: skip


def table(doc: dict) -> str:
    head = ["workers", "run", "samples/s", "x plain DDP", "step ms", "exposed comm ms/step"]
    rows = []
    for m in doc["results"]:
        rows.append([m["workers"], "no communication (compute only)", m["no_comm_samples_per_sec"],
                     None, m["compute_ms_no_comm"], 0.0])  # fmt: skip
        for name, r in m["runs"].items():
            rows.append([m["workers"], name, r["samples_per_sec"], r["ratio_to_plain_ddp"],
                         r["step_ms"], r["exposed_comm_ms"]])  # fmt: skip
    m0 = doc["results"][0]
    return (
        "## Step throughput (psar vs plain DDP vs a plain RPC parameter server)\n\n"
        + c.md_table(head, rows)
        + f"\n\nReference workload, {m0['steps']} steps per run, median of {m0['repeats']} "
        "alternated repeats. Exposed comm = step time - the no-communication run's step "
        "time (same processes, same contention; the step logs carry no phase times)."
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.step_throughput", __doc__)
    p.add_argument("--workers", default=None, help="comma-separated (default 2,4; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="per run (default 100; quick 30)")
    p.add_argument("--repeats", type=int, default=None, help="(default 3; quick 1)")
    args = p.parse_args(argv)
    c.install_sigterm()
    out = c.out_dir(args, "step_throughput")
    workers = [int(w) for w in (args.workers or ("2" if args.quick else "2,4")).split(",")]
    steps = args.steps or (30 if args.quick else 100)
    repeats = args.repeats or (1 if args.quick else 3)
    results = []
    for n in workers:
        c.log(f"step_throughput: {n} workers")
        results.append(measure(out, workers=n, steps=steps, repeats=repeats, timeout=args.timeout))
    doc = {"baseline": BASELINE, "results": results}
    return c.finish(args, out, "step_throughput", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
