"""AllReduce overhead: `psar train --arch allreduce` against a plain DDP script.

Both train the reference workload (MLP 784-1024-1024-10, batch 128 per worker, SGD
momentum 0.9, fp32, one compute thread per process, gloo) under torchrun with the same
number of workers, launched the same way, alternated A B A B ... so drift on a shared
machine hits both alike. samples/s of a run = the ranks' steady-state rates added up
(samples per step / median step time, warm-up steps left out; bench/common.py
robust_rate: a burst of other load moves it little); the result is the ratio of the
medians over the repeats, goal >= 0.95. The mean rate (samples / time) is reported too.

    python -m bench.allreduce_overhead              # 8 pairs x 100 steps, 2 workers
    python -m bench.allreduce_overhead --quick --json
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c

GOAL = 0.95


def run_psar(out: Path, workers: int, steps: int, timeout: float) -> c.Run:
    py = [*c.psar_train_args(out), *c.REF_TRAIN, "--steps", str(steps)]
    return c.ddp_job(out, workers=workers, py_args=py, timeout=timeout)


def run_plain(out: Path, workers: int, steps: int, timeout: float, *, local: bool = False,
              hosts: list | None = None) -> c.Run:  # fmt: skip
    """bench/plain_ddp.py on `workers` ranks (local: --no-comm, compute only)."""
    out.mkdir(parents=True, exist_ok=True)
    py = [str(c.ROOT / "bench" / "plain_ddp.py"), "--steps", str(steps), "--out", str(out),
          *(["--no-comm"] if local else [])]  # fmt: skip
    return c.ddp_job(out, workers=workers, py_args=py, timeout=timeout, hosts=hosts)


def measure(out: Path, *, workers: int, steps: int, repeats: int, timeout: float) -> dict:
    runs = {
        "psar": lambda i: run_psar(out / f"psar-{i}", workers, steps, timeout),
        "plain": lambda i: run_plain(out / f"plain-{i}", workers, steps, timeout),
    }
    got = c.alternate(runs, repeats)
    rates = {k: [c.robust_rate(r) for r in v] for k, v in got.items()}
    mean_rates = {k: [c.job_rate(r) for r in v] for k, v in got.items()}
    steps_s = {k: [c.job_step_seconds(r) for r in v] for k, v in got.items()}
    med = {k: c.median(v) for k, v in rates.items()}
    pairs = [a / b for a, b in zip(rates["psar"], rates["plain"], strict=True)]
    ratio = med["psar"] / med["plain"]
    return {
        "workers": workers,
        "steps": steps,
        "repeats": repeats,
        "samples_per_sec": rates,
        "mean_samples_per_sec": mean_rates,
        "mean_ratio": c.median(mean_rates["psar"]) / c.median(mean_rates["plain"]),
        "step_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in steps_s.items()},
        "median_samples_per_sec": med,
        "ratio": ratio,
        "pair_ratios": pairs,
        "median_pair_ratio": c.median(pairs),
        "best_ratio": max(rates["psar"]) / max(rates["plain"]),
        "goal": GOAL,
        "goal_met": ratio >= GOAL,
    }


def table(doc: dict) -> str:
    rows = [
        [name, doc["median_samples_per_sec"][name], c.median(doc["step_ms"][name]),
         ", ".join(c.fmt(x) for x in doc["samples_per_sec"][name])]
        for name in ("plain", "psar")
    ]  # fmt: skip
    head = ["run", "samples/s (median)", "step ms (median)", "samples/s per repeat"]
    return (
        "## AllReduce overhead\n\n"
        + c.md_table(head, rows)
        + f"\n\npsar / plain DDP = **{doc['ratio']:.3f}x** (median of per-pair ratios "
        f"{doc['median_pair_ratio']:.3f}, of the fastest runs {doc['best_ratio']:.3f}); goal >= "
        f"{GOAL}: "
        f"**{'met' if doc['goal_met'] else 'NOT met'}**. {doc['workers']} workers, "
        f"{doc['steps']} steps, {doc['repeats']} ABAB repeats, reference workload."
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.allreduce_overhead", __doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="per run (default 100; quick 40)")
    p.add_argument("--repeats", type=int, default=None, help="ABAB pairs (default 8; quick 2)")
    args = p.parse_args(argv)
    c.install_sigterm()
    out = c.out_dir(args, "allreduce_overhead")
    doc = measure(out, workers=args.workers, steps=args.steps or (40 if args.quick else 100),
                  repeats=args.repeats or (2 if args.quick else 8), timeout=args.timeout)  # fmt: skip
    return c.finish(args, out, "allreduce_overhead", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
