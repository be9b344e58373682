"""Stragglers: ps sync vs async vs ssp with one worker F times slower (classic: 8 workers, 3x).

Compute is emulated (`psar train --emulate-compute-ms T`: every step's forward+backward
is padded with sleep to T ms, times `--slowdown F` on the straggler), so a small machine
hosts many workers honestly: the model is tiny (default `mlp`, 32-64-64-10) and real
compute and communication are small next to T.

Theory: sync runs at the straggler's pace, N*B/(F*T) samples/s; async lets every
worker run at its own, ((N-1) + 1/F)*B/T; async/sync = (F(N-1) + 1)/N, 2.75 for N=8,
F=3. SSP with bound s lets fast workers lead the straggler by at most s+1 pushes and then
wait for it, so against a *persistent* straggler its steady rate is sync's (1x); over a
run of K steps the lead adds at most 1 + (N-1)(s+1)/(N(K-s-1)) (upper bound), while its
staleness stays bounded. SSP pays off when slowness moves between workers, not here.

Fair measurement: every worker gets the same number of steps K in every mode (sync
needs it). In async the fast workers then finish long before the straggler, and a
job-wall rate would charge the straggler's lonely tail to async. So samples/s is
measured over the window in which *every* worker is training (from the last worker's
first step to the first worker's last step, on the wall clock): the samples all workers
processed inside it / its length. In sync the window is the whole run. Time to target
loss: rank 0's (a fast worker's) smoothed loss, on its own clock, in every mode.

    python -m bench.stragglers --workers 8 --slow-factor 3 --json
    python -m bench.stragglers --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib import common as c
from psar.worker.compare import smoothed

GOAL = 2.5
MODES = ("sync", "async", "ssp")


def theory(n: int, f: float, t_s: float, batch: int) -> dict[str, float]:
    sync = n * batch / (f * t_s)
    async_ = ((n - 1) + 1 / f) * batch / t_s
    return {"sync": sync, "async": async_}


def ssp_bound(n: int, steps: int, bound: int) -> float:
    lead = bound + 1
    return 1 + (n - 1) * lead / (n * max(steps - lead, 1))


def run_mode(out: Path, args, mode: str) -> dict:  # noqa: ANN001
    train = ["--workload", args.workload, "--batch-size", str(args.batch_size), "--torch-threads", "1",
             "--precision", "fp32", "--log-every", "0", "--eval-batches", "0",
             "--emulate-compute-ms", str(args.compute_ms), "--steps", str(args.steps)]  # fmt: skip
    slow = {args.straggler_rank: ["--slowdown", str(args.slow_factor)]}
    run = c.ps_job(out / mode, workers=args.workers, shards=args.shards, mode=mode,
                   staleness=args.staleness, train=train, per_rank=slow, timeout=args.timeout)  # fmt: skip
    rate, window = c.window_rate(run)
    starts = [s.start_wall + s.time[0] for s in run.series]
    ends = [s.start_wall + s.time[-1] for s in run.series]
    total = sum(s.samples[-1] for s in run.series)
    rank0 = run.series[0]
    return {
        "samples_per_sec": rate,
        "window_s": window,
        "job_samples_per_sec": total / (max(ends) - min(starts)),
        "staleness": c.staleness(run),
        "_time": rank0.time,
        "_smooth": smoothed(rank0.loss, 10),
    }


def measure(out: Path, args) -> dict:  # noqa: ANN001
    rows = {}
    for mode in args.modes:
        c.log(f"stragglers: {mode}")
        rows[mode] = run_mode(out, args, mode)
    finals = [r["_smooth"][-1] for r in rows.values() if r["_smooth"]]
    target = args.target_loss if args.target_loss is not None else 1.05 * max(finals)
    for r in rows.values():
        r["time_to_target_s"] = next(
            (t for t, v in zip(r.pop("_time"), r["_smooth"], strict=True) if v < target), None
        )
        r["final_loss"] = r.pop("_smooth")[-1]
    th = theory(args.workers, args.slow_factor, args.compute_ms / 1e3, args.batch_size)
    sps = {m: r["samples_per_sec"] for m, r in rows.items()}
    ratio = lambda m: sps[m] / sps["sync"] if "sync" in sps and m in sps else None  # noqa: E731
    return {
        "workers": args.workers,
        "slow_factor": args.slow_factor,
        "straggler_rank": args.straggler_rank,
        "compute_ms": args.compute_ms,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "workload": args.workload,
        "shards": args.shards,
        "staleness_bound": args.staleness,
        "samples_per_sec": sps,
        "theory_samples_per_sec": th,
        "theory_async_over_sync": th["async"] / th["sync"],
        "async_over_sync": ratio("async"),
        "ssp_over_sync": ratio("ssp"),
        "theory_ssp_over_sync_steady": 1.0,
        "theory_ssp_over_sync_bound": ssp_bound(args.workers, args.steps, args.staleness),
        "staleness": {m: r["staleness"] for m, r in rows.items()},
        "time_to_target_s": {m: r["time_to_target_s"] for m, r in rows.items()},
        "target_loss": target,
        "modes": rows,
        "goal": GOAL,
        "goal_met": (ratio("async") or 0) >= GOAL,
    }


def table(doc: dict) -> str:
    th = doc["theory_samples_per_sec"]
    head = ["mode", "samples/s", "x sync", "theory samples/s", "time to target (s)",
            "final loss", "staleness p50/p99/max", "window s"]  # fmt: skip
    rows = []
    for m, r in doc["modes"].items():
        st = "/".join(c.fmt(r["staleness"][k]) for k in ("p50", "p99", "max"))
        x = (
            r["samples_per_sec"] / doc["samples_per_sec"]["sync"]
            if "sync" in doc["modes"]
            else None
        )
        rows.append([m, r["samples_per_sec"], x, th.get(m), r["time_to_target_s"],
                     r["final_loss"], st, r["window_s"]])  # fmt: skip
    a = doc["async_over_sync"]
    return (
        "## Stragglers\n\n" + c.md_table(head, rows) + f"\n\n{doc['workers']} workers, rank "
        f"{doc['straggler_rank']} {doc['slow_factor']:g}x slower, emulated compute "
        f"{doc['compute_ms']:g} ms/step, {doc['workload']} batch {doc['batch_size']}, "
        f"{doc['steps']} steps/worker, {doc['shards']} shard(s), ssp bound "
        f"{doc['staleness_bound']}. async/sync = **{c.fmt(a)}x** (theory "
        f"{doc['theory_async_over_sync']:.3g}x; goal >= {GOAL}: "
        f"**{'met' if doc['goal_met'] else 'NOT met'}**); ssp/sync {c.fmt(doc['ssp_over_sync'])}x "
        f"(theory: 1x steady, at most {doc['theory_ssp_over_sync_bound']:.3g}x over "
        f"{doc['steps']} steps). samples/s over the window "
        f"in which all workers train; target loss {doc['target_loss']:.4g} (rank 0, smoothed)."
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.stragglers", __doc__)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--straggler-rank", type=int, default=None, help="(default: the last)")
    p.add_argument("--compute-ms", type=float, default=80.0, help="emulated compute per step")
    p.add_argument("--steps", type=int, default=None, help="per worker (default 60; quick 25)")
    p.add_argument("--staleness", type=int, default=2, help="ssp bound (default 2)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--workload", default="mlp")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--target-loss", type=float, default=None)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.steps = args.steps or (25 if args.quick else 60)
    rank = args.workers - 1 if args.straggler_rank is None else args.straggler_rank
    args.straggler_rank = rank
    if not (args.workers >= 2 and 0 <= rank < args.workers and args.slow_factor >= 1):
        p.error("need --workers >= 2, 0 <= --straggler-rank < workers, --slow-factor >= 1")
    if bad := set(args.modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(bad)}")
    c.install_sigterm()
    out = c.out_dir(args, "stragglers")
    doc = measure(out, args)
    return c.finish(args, out, "stragglers", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
