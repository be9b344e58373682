"""Scaling: ps-sync samples/s against workers (1, 2, 4, 8) and shards (1, 2, 4).

Compute is emulated (`--emulate-compute-ms T`, default 100 ms) on a model big enough
that communication matters (MLP 784-1024-1024-10: 1.86M parameters, 7.45 MB of fp32
gradient pushed and 7.45 MB of weights pulled by every worker every step) and a small
batch (16) so the real compute stays well under T. Ideal linear scaling from one
worker is N x (the 1-worker rate with the same shards); the ratio to it shows where a
shard's link (here: its process and the machine's CPUs, all on loopback) becomes the
bottleneck: with S shards each carries N x 7.45 MB in and out per step.

samples/s = every worker's samples per step / its median step time, added up.

    python -m bench.scaling                 # 1,2,4,8 workers x 1,2,4 shards
    python -m bench.scaling --quick --json  # 1,4 workers x 1,2 shards
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c


def measure(out: Path, args) -> dict:  # noqa: ANN001
    train = [*c.REF_WORKLOAD, "--batch-size", str(args.batch_size), "--threads", "1",
             "--precision", "fp32", "--log-every", "0", "--eval-batches", "0",
             "--emulate-compute-ms", str(args.compute_ms), "--steps", str(args.steps)]  # fmt: skip
    rows = []
    base: dict[int, float] = {}
    for s in args.shards:
        for n in args.workers:
            c.log(f"scaling: {n} workers, {s} shards")
            run = c.ps_job(out / f"w{n}-s{s}", workers=n, shards=s, mode="sync", train=train,
                           timeout=args.timeout)  # fmt: skip
            rate = c.robust_rate(run)
            base.setdefault(s, rate / n)  # the first (smallest) worker count is the base
            rows.append({
                "workers": n,
                "shards": s,
                "samples_per_sec": rate,
                "step_ms": 1e3 * c.job_step_seconds(run),
                "ratio_to_linear": rate / (n * base[s]),
                "ratio_to_compute_bound": rate / (n * args.batch_size / (args.compute_ms / 1e3)),
            })  # fmt: skip
    return {"compute_ms": args.compute_ms, "batch_size": args.batch_size, "steps": args.steps,
            "model": "mlp 784-1024-1024-10 (1,863,690 params, 7.45 MB fp32)",
            "base_workers": min(args.workers), "results": rows}  # fmt: skip


def table(doc: dict) -> str:
    head = ["shards", "workers", "samples/s", "step ms", "x linear from 1 worker",
            "x compute-bound ideal"]  # fmt: skip
    rows = [[r["shards"], r["workers"], r["samples_per_sec"], r["step_ms"], r["ratio_to_linear"],
             r["ratio_to_compute_bound"]] for r in doc["results"]]  # fmt: skip
    return (
        "## Scaling (ps sync)\n\n" + c.md_table(head, rows) + f"\n\n{doc['model']}, batch "
        f"{doc['batch_size']}/worker, emulated compute {doc['compute_ms']:g} ms/step, "
        f"{doc['steps']} steps. x linear: samples/s / (workers x the {doc['base_workers']}-"
        "worker rate with the same shards); x compute-bound ideal: / (workers x batch / "
        "compute time)."
    )


def write_plot(out: Path, doc: dict) -> None:
    lines = {}
    for s in sorted({r["shards"] for r in doc["results"]}):
        rs = [r for r in doc["results"] if r["shards"] == s]
        lines[f"{s} shard(s)"] = ([r["workers"] for r in rs], [r["samples_per_sec"] for r in rs])
    rs = [r for r in doc["results"] if r["shards"] == min(r["shards"] for r in doc["results"])]
    n0 = min(r["workers"] for r in rs)
    r0 = next(r["samples_per_sec"] for r in rs if r["workers"] == n0)
    lines["linear from 1 worker, 1 shard"] = ([r["workers"] for r in rs],
                                               [r0 * r["workers"] / n0 for r in rs])  # fmt: skip
    c.plot(out / "scaling.png", lines, xlabel="workers", ylabel="samples/s",
           title="ps sync scaling (emulated compute)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.scaling", __doc__)
    p.add_argument("--workers", default=None, help="(default 1,2,4,8; quick 1,4)")
    p.add_argument("--shards", default=None, help="(default 1,2,4; quick 1,2)")
    p.add_argument("--compute-ms", type=float, default=100.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=None, help="(default 30; quick 15)")
    args = p.parse_args(argv)
    args.workers = sorted(
        int(x) for x in (args.workers or ("1,4" if args.quick else "1,2,4,8")).split(",")
    )
    args.shards = sorted(
        int(x) for x in (args.shards or ("1,2" if args.quick else "1,2,4")).split(",")
    )
    args.steps = args.steps or (15 if args.quick else 30)
    c.install_sigterm()
    out = c.out_dir(args, "scaling")
    doc = measure(out, args)
    write_plot(out, doc)
    return c.finish(args, out, "scaling", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
