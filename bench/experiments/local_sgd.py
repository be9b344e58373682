"""Local SGD / DiLoCo (--mode local) against synchronous training, head to head (issue #20).

One case, measured in one run: the byte-level `lm` workload, 4 workers, 1 PS shard, every
worker and the shard on a host of its own (network namespaces, tests/netns.py) whose NIC
is shaped to --mbit (default 1000 Mbit/s) both ways with tc, as bench/links.py does
(bench/lib/netem.py).
Without network namespaces (not root, no `ip`/`tc`) the runs go over loopback and the
document says so. Each architecture (--archs: ps, allreduce) runs twice with the same
seed, data, per-worker batch, steps and inner optimizer:

- sync: `--mode sync` (ps) / plain DDP (allreduce), communicating every step;
- local: `--mode local --sync-every H` (default H = 20; DiLoCo's outer Nesterov, momentum
  0.9, outer lr 0.7 unless --train-flags says otherwise).

Figures, per architecture, local against sync measured in the same run:
- final loss at equal samples: the validation loss (bits per byte, on the final shared
  weights) and rank 0's smoothed training loss; goal: local <= 1.03 x sync;
- bytes per sample: all workers' bytes (ps: pushed + pulled, allreduce: allreduced) /
  all workers' samples; goal: sync / local >= 10;
- time to target: the first wall time at which rank 0's smoothed training loss (trailing
  mean of --smooth steps) is below the target, the target being sync's final smoothed
  loss x (1 + --target-slack) (default 3%: the loss goal's own slack), so that sync
  reaches it by definition; goal: local / sync <= 0.5.

    python -m bench.experiments.local_sgd                          # 4 workers, 1 Gbit/s, ps
    python -m bench.experiments.local_sgd --archs ps,allreduce     # both architectures
    python -m bench.experiments.local_sgd --quick --json           # short smoke run
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import common as c
from psar.worker.compare import smoothed

LOSS_GOAL = 1.03
BYTES_GOAL = 10.0
TIME_GOAL = 0.5


def _lm(args) -> list[str]:  # noqa: ANN001
    opts = [f"seq_len={args.seq_len}", f"d_model={args.d_model}", f"n_layers={args.n_layers}",
            "n_heads=4", "max_bytes=2000000"]  # fmt: skip
    return [
        "--workload", "lm", *(x for o in opts for x in ("--workload-option", o)),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seed", "0",
        "--optimizer", "adamw", "--lr", str(args.lr), "--precision", "fp32",
        "--torch-threads", "1", "--log-every", "0", "--eval-batches", "20",
    ]  # fmt: skip


def run_pair(out: Path, arch: str, args, hosts) -> dict:  # noqa: ANN001
    """sync and local for one architecture; their step logs and reports."""
    train = [*_lm(args), *shlex.split(args.train_flags)]
    local = ["--sync-every", str(args.sync_every)]
    shard_hosts, worker_hosts = (hosts[:1], hosts[1:]) if hosts else (None, None)
    runs = {}
    for name in ("sync", "local"):
        d = out / f"{arch}-{name}"
        c.log(f"local_sgd: {arch} {name} ({args.workers} workers, {args.steps} steps)")
        if arch == "ps":
            runs[name] = c.ps_job(d, workers=args.workers, shards=1, mode=name,
                                  train=[*train, *(local if name == "local" else [])],
                                  timeout=args.timeout, shard_hosts=shard_hosts,
                                  worker_hosts=worker_hosts)  # fmt: skip
        else:
            extra = ["--mode", "local", *local] if name == "local" else []
            runs[name] = c.ddp_job(d, workers=args.workers, hosts=worker_hosts,
                                   py_args=[*c.psar_train_args(d), *train, *extra],
                                   timeout=args.timeout)  # fmt: skip
    return runs


def _bytes(summary: dict) -> int:
    keys = ("bytes_pushed", "bytes_pulled", "bytes_allreduced")
    return sum(int(summary.get(k) or 0) for k in keys)


def figures(run: c.Run, arch: str, window: int) -> dict:
    """One run's figures: losses, bytes per sample, rank 0's smoothed curve."""
    rank0 = run.series[0]
    reps = run.summaries
    samples = sum(s.samples[-1] for s in run.series)
    # DDP ranks are lockstep and rank 0 writes the job's report: its bytes are per rank.
    moved = _bytes(reps[0]) * len(run.series) if arch == "allreduce" else sum(map(_bytes, reps))
    smooth = smoothed(rank0.loss, window)
    r0 = next(r for r in reps if r.get("rank", 0) == 0)
    return {
        "val_bits_per_byte": r0.get("val_loss"),
        "final_train_loss": smooth[-1],
        "bytes_per_sample": moved / samples,
        "samples": samples,
        "wall_s": rank0.time[-1],
        "outer_rounds": r0.get("outer_rounds"),
        "drift_mean": (r0.get("drift") or {}).get("mean"),
        "_time": rank0.time,
        "_smooth": smooth,
    }


def time_to(f: dict, target: float) -> float | None:
    for t, v in zip(f["_time"], f["_smooth"], strict=True):
        if v < target:
            return t
    return None


def compare_pair(runs: dict, arch: str, args) -> dict:  # noqa: ANN001
    s, loc = (figures(runs[k], arch, args.smooth) for k in ("sync", "local"))
    target = s["final_train_loss"] * (1 + args.target_slack)
    ts, tl = time_to(s, target), time_to(loc, target)
    ratios = {
        "val_loss_local_over_sync": loc["val_bits_per_byte"] / s["val_bits_per_byte"],
        "train_loss_local_over_sync": loc["final_train_loss"] / s["final_train_loss"],
        "bytes_per_sample_sync_over_local": s["bytes_per_sample"] / loc["bytes_per_sample"],
        "time_to_target_local_over_sync": tl / ts if tl is not None and ts else None,
        "wall_local_over_sync": loc["wall_s"] / s["wall_s"],
    }
    t = ratios["time_to_target_local_over_sync"]
    goals = {
        "loss_within_3pct": ratios["val_loss_local_over_sync"] <= LOSS_GOAL,
        "bytes_10x_fewer": ratios["bytes_per_sample_sync_over_local"] >= BYTES_GOAL,
        "time_to_target_half": t is not None and t <= TIME_GOAL,
    }
    for f in (s, loc):
        f.pop("_time")
        f.pop("_smooth")
    return {"arch": arch, "target_train_loss": target, "time_to_target_s": {"sync": ts,
            "local": tl}, "sync": s, "local": loc, "ratios": ratios, "goals": goals}  # fmt: skip


def table(doc: dict) -> str:
    head = ["arch", "run", "val bits/byte", "final train loss", "bytes/sample", "wall s",
            "time to target s", "outer rounds", "mean drift"]  # fmt: skip
    rows, ratio_rows = [], []
    for case in doc["cases"]:
        for name in ("sync", "local"):
            f = case[name]
            rows.append([case["arch"], name, f["val_bits_per_byte"], f["final_train_loss"],
                         f["bytes_per_sample"], f["wall_s"], case["time_to_target_s"][name],
                         f["outer_rounds"], f["drift_mean"]])  # fmt: skip
        r, g = case["ratios"], case["goals"]
        ratio_rows.append([case["arch"], r["val_loss_local_over_sync"], g["loss_within_3pct"],
                           r["bytes_per_sample_sync_over_local"], g["bytes_10x_fewer"],
                           r["time_to_target_local_over_sync"], g["time_to_target_half"],
                           r["wall_local_over_sync"]])  # fmt: skip
    link = f"{doc['mbit']:g} Mbit/s emulated NICs" if doc["shaped"] else "loopback (no shaping)"
    return (
        "## Local SGD / DiLoCo vs sync\n\n"
        + c.md_table(head, rows)
        + "\n\n"
        + c.md_table(
            [
                "arch",
                "val loss local/sync",
                "<= 1.03",
                "bytes/sample sync/local",
                ">= 10",
                "time to target local/sync",
                "<= 0.5",
                "wall local/sync",
            ],
            ratio_rows,
        )  # fmt: skip
        + f"\n\n{doc['workload']}; {doc['workers']} workers x batch {doc['batch_size']}, "
        f"{doc['steps']} steps each, 1 shard, {link}; local: --sync-every {doc['sync_every']} "
        f"{doc['train_flags'] or '(outer nesterov 0.9, lr 0.7)'}. Target = sync's final "
        f"smoothed train loss x {1 + doc['target_slack']:g}; losses smoothed over "
        f"{doc['smooth']} steps (rank 0). {doc.get('note', '')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.experiments.local_sgd", __doc__)
    p.add_argument("--archs", default="ps", help="ps, allreduce or both (default ps)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="(default 400; quick 60)")
    p.add_argument("--sync-every", type=int, default=None, help="H (default 20; quick 10)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="inner (and sync) AdamW lr")
    p.add_argument("--mbit", type=float, default=1000.0, help="NIC rate (0: no shaping)")
    p.add_argument("--smooth", type=int, default=20, help="loss smoothing window, steps")
    p.add_argument("--target-slack", type=float, default=0.03)
    p.add_argument("--train-flags", default="", help="more `psar train` flags for every run")
    args = p.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 400)
    args.sync_every = args.sync_every or (10 if args.quick else 20)
    c.install_sigterm()
    out = c.out_dir(args, "local_sgd")
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    doc = {"workload": f"lm d_model {args.d_model} x {args.n_layers} layers, seq {args.seq_len}",
           "workers": args.workers, "batch_size": args.batch_size, "steps": args.steps,
           "sync_every": args.sync_every, "mbit": args.mbit, "smooth": args.smooth,
           "target_slack": args.target_slack, "train_flags": args.train_flags}  # fmt: skip
    netns, reason = (None, "--mbit 0") if not args.mbit else _netns()
    doc["shaped"] = netns is not None
    if reason:
        doc["note"] = f"No emulated link ({reason}): loopback."
        c.log(f"local_sgd: no emulated link: {reason}")
    cases = []
    if netns is None:
        cases = [compare_pair(run_pair(out, a, args, None), a, args) for a in archs]
    else:
        from bench.lib.netem import shape_all

        names = ["s0", *(f"w{r}" for r in range(args.workers))]
        with netns.lan(names) as lan:
            shape_all(netns, lan, args.mbit, 0.0)
            hosts = [lan[n] for n in names]
            cases = [compare_pair(run_pair(out, a, args, hosts), a, args) for a in archs]
    doc["cases"] = cases
    doc["goals_met"] = all(all(x["goals"].values()) for x in cases)
    return c.finish(args, out, "local_sgd", doc, table(doc))


def _netns() -> tuple[object | None, str | None]:
    from bench.lib.netem import unavailable

    return unavailable(0.0)


if __name__ == "__main__":
    sys.exit(main())
