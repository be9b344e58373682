"""The torch RPC parameter servers against plain DDP and psar, on the reference workload.

Runs, in turn (A B C D A B C D ...): plain DDP (bench/plain_ddp.py), the RPC PS written
the tutorial's way and the async one (bench/rpc_ps_baseline.py --style tutorial|async:
TensorPipe, per-parameter rpc_async sends from backward hooks, batched updates with
futures), and psar ps-sync with 1 shard. Rates are total samples over the window in which
every worker trains, after each one's warm-up steps (bench/common.py window_rate); the
table gives the median over the repeats and its ratio to plain DDP measured in the same
run, and psar's ratio to the async RPC server.

    python -m bench.rpc_compare                # 2 workers, 100 steps, 3 repeats
    python -m bench.rpc_compare --quick --json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c
from bench.allreduce_overhead import run_plain


def run_rpc(out: Path, workers: int, steps: int, timeout: float, style: str) -> c.Run:
    py = [str(c.ROOT / "bench" / "rpc_ps_baseline.py"), "--style", style, "--steps", str(steps),
          "--out", str(out)]  # fmt: skip
    return c.ddp_job(out, workers=workers + 1, py_args=py, timeout=timeout)


def run_psar(out: Path, workers: int, steps: int, timeout: float) -> c.Run:
    train = [*c.REF_TRAIN, "--steps", str(steps)]
    return c.ps_job(out, workers=workers, shards=1, mode="sync", train=train, timeout=timeout)


def rate(run: c.Run) -> float:
    n = min(len(s.time) for s in run.series)
    return c.window_rate(run, skip=c.warmup_steps(n))[0]


def measure(out: Path, workers: int, steps: int, repeats: int, timeout: float) -> dict[str, Any]:
    configs = {
        "plain-ddp": lambda i: run_plain(out / f"plain-{i}", workers, steps, timeout),
        "rpc-tutorial": lambda i: run_rpc(out / f"rpct-{i}", workers, steps, timeout, "tutorial"),
        "rpc-async": lambda i: run_rpc(out / f"rpca-{i}", workers, steps, timeout, "async"),
        "psar-ps-sync-1": lambda i: run_psar(out / f"ps-{i}", workers, steps, timeout),
    }
    got = c.alternate(configs, repeats)
    rates = {k: [rate(r) for r in v] for k, v in got.items()}
    med = {k: c.median(v) for k, v in rates.items()}
    return {
        "workers": workers, "steps": steps, "repeats": repeats, "samples_per_sec": rates,
        "median_samples_per_sec": med,
        "over_plain_ddp": {k: v / med["plain-ddp"] for k, v in med.items()},
        "psar_over_rpc_async": med["psar-ps-sync-1"] / med["rpc-async"],
        "rpc_async_over_tutorial": med["rpc-async"] / med["rpc-tutorial"],
    }  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    head = ["run", "samples/s (median)", "x plain DDP", "each repeat"]
    rows = [[k, v, doc["over_plain_ddp"][k], ", ".join(c.fmt(x) for x in doc["samples_per_sec"][k])]
            for k, v in doc["median_samples_per_sec"].items()]  # fmt: skip
    return (
        "## Torch RPC parameter servers vs plain DDP and psar\n\n"
        + c.md_table(head, rows)
        + f"\n\n{doc['workers']} workers, reference workload, {doc['steps']} steps, median of "
        f"{doc['repeats']} alternated repeats; rates over the window every worker trains in. "
        f"psar ps-sync / rpc-async: **{doc['psar_over_rpc_async']:.2f}x**; rpc-async / "
        f"rpc-tutorial: {doc['rpc_async_over_tutorial']:.2f}x."
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.rpc_compare", __doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="(default 100; quick 30)")
    p.add_argument("--repeats", type=int, default=None, help="(default 3; quick 1)")
    args = p.parse_args(argv)
    steps = args.steps or (30 if args.quick else 100)
    repeats = args.repeats or (1 if args.quick else 3)
    c.install_sigterm()
    out = c.out_dir(args, "rpc-compare")
    doc = measure(out, args.workers, steps, repeats, args.timeout)
    return c.finish(args, out, "rpc_compare", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
