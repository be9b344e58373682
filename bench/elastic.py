"""Preemption: one schedule of membership changes, psar's elastic PS against the allreduce
arch under torchrun's elastic agent.

The schedule, the same for both, on the lm workload, one epoch (each sample once): start
2 workers; grow to 4; SIGKILL 2; SIGTERM 1; grow back to 4. Each change comes when the
job has trained a set share of the epoch (--at, from the workers' step logs) and the
last change has settled (every live worker trains), so both meet it at the same point
of the work.

- ps: `psar server` (one shard, --lease-s) and `psar train --arch ps --mode sync
  --world-size 2 --max-workers 4`; joiners `--join`. The job keeps running: a joiner
  enters at the next round, a SIGTERM'd worker leaves after its step, a killed one's lease
  runs out; shard 0 deals the data, so what a worker leaves is trained by the others.
- allreduce: one torchrun elastic agent per worker (`--nnodes 1:4 --nproc-per-node 1`,
  `--rdzv-backend c10d` on loopback, its store in a process of its own, as a stable
  rendezvous host) running `psar train --arch allreduce --checkpoint-dir D`: every
  membership change restarts every worker, which resume from the newest checkpoint
  (rank 0 writes one every --checkpoint-every steps) with the data cut for the new world
  size. What users have.

Counted from what the workers logged (bench/lib/elastic_count.py): samples lost (of the
epoch, never in the final model) and repeated (in it more than once), time lost per event
(the stall after it, and work a restart rolled back), samples/s over time (a plot), and
the final validation loss against a fixed-size job (2 workers, same arch) over the same
epoch. Compute is emulated (`--emulate-compute-ms`) so 4 workers fit on 2 cores.

    python -m bench.elastic --quick --json
    python -m bench.elastic            # longer epoch, and the plot
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib import common as c
from bench.lib import elastic_count as ec
from bench.lib.elastic_jobs import PSJob, TorchrunJob, data_size

GOAL = 1.3
#: (event, share of the epoch trained when it comes, workers started, killed, stopped)
SCHEDULE = (
    ("grow to 4", ["w2", "w3"], [], []),
    ("SIGKILL 2", [], ["w1", "w2"], []),
    ("SIGTERM 1", [], [], ["w3"]),
    ("grow back to 4", ["w4", "w5", "w6"], [], []),
)


def run_schedule(job: PSJob | TorchrunJob, at: list[float], timeout: float) -> dict:
    """Start 2 workers, then each event of SCHEDULE once the job has trained its share of
    the epoch; wait for the job to end. Returns its events (name, wall) and times."""
    t0 = time.time()
    for name in ("w0", "w1"):
        job.start(name)
    events = [("start 2", t0)]
    end_by = t0 + timeout
    for (name, start, kill, stop), share in zip(SCHEDULE, at, strict=True):
        # Each change once the last one settled (every live worker trains): a change in
        # the middle of a torchrun rendezvous round fails the round (its store waits for
        # the dead node), which would measure the schedule, not the architecture.
        while job.progress() < share or not job.settled():
            job.check(end_by, f"waiting for {share:.0%} of the epoch before '{name}'")
            time.sleep(0.2)
        events.append((name, time.time()))
        c.log(f"elastic: {job.arch}: {name} at {job.progress():.0%} of the epoch")
        for w in kill:
            job.kill(w)
        for w in stop:
            job.stop(w)
        for w in start:
            job.start(w)
    job.wait_done(end_by)
    return {"events": events, "t0": t0, "end": time.time()}


def measure_arch(arch: str, out: Path, args, size: dict) -> dict:  # noqa: ANN001
    make = PSJob if arch == "ps" else TorchrunJob
    with make(out / arch, args, size) as job:
        sched = run_schedule(job, args.at, args.timeout)
        final = job.final()
    n, b = size["dataset_len"], args.batch_size
    if arch == "ps":
        counted = ec.count_ps(out / arch / "run", n, b, args.seed, final.get("consumed_ids"))
    else:
        procs = ec.load_procs(out / arch / "procs", n, b, args.seed)
        counted = ec.count_allreduce(procs)
    t0, end = sched["t0"], sched["end"]
    planned = size["planned"]
    lost = counted.lost(planned)
    return {
        "seconds": end - t0,
        "samples_lost": lost,
        "samples_repeated": counted.repeated(),
        "samples_planned": planned,
        "samples_trained": sum(counted.trained.values()) + counted.unlogged,
        "samples_unlogged": counted.unlogged,
        "samples_rolled_back": sum(s for _, s, _ in counted.rolled_back),
        "samples_per_sec": sum(counted.trained.values()) / (end - t0),
        "events": [
            {**e, "at_s": round(t - t0, 3)}
            for e, (_, t) in zip(
                ec.time_lost(counted, sched["events"], end), sched["events"], strict=True
            )
        ],
        "step_s": counted.step_s,
        "val_loss": final.get("val_loss"),
        "restarts": final.get("restarts"),
        "rate_over_time": ec.rate_series(counted.timeline, t0, end, args.bin_s),
        **{k: v for k, v in final.items() if k not in ("val_loss", "restarts", "consumed_ids")},
    }


def measure(out: Path, args) -> dict:  # noqa: ANN001
    size = data_size(args)
    c.log(f"elastic: lm, {size['dataset_len']} windows of {args.seq_len} bytes, batch "
          f"{args.batch_size}: {size['planned']} samples in the epoch")  # fmt: skip
    rows = {arch: measure_arch(arch, out, args, size) for arch in args.archs}
    if not args.no_fixed:
        for arch, row in rows.items():
            c.log(f"elastic: {arch}: the fixed-size job (2 workers, the same epoch)")
            fixed = (PSJob if arch == "ps" else TorchrunJob).fixed(out / f"{arch}-fixed", args)
            row["fixed_val_loss"] = fixed["val_loss"]
            row["fixed_seconds"] = fixed["seconds"]
    if set(rows) != {"ps", "allreduce"}:
        return {**rows, "note": "one architecture only (--archs): no comparison"}
    ps, ar = rows["ps"], rows["allreduce"]
    speedup = ar["seconds"] / ps["seconds"]
    doc = {
        **rows,
        "ps_speedup": speedup,
        "schedule": ["start 2", *(e[0] for e in SCHEDULE)],
        "at_share_of_epoch": args.at,
        "workload": f"lm {' '.join(size['options'])}",
        "batch_size": args.batch_size,
        "compute_ms": args.compute_ms,
        "lease_s": args.lease_s,
        "checkpoint_every": args.checkpoint_every,
        "rdzv_conf": TorchrunJob.RDZV_CONF,
        "goal": GOAL,
        "goal_met": speedup >= GOAL and ps["samples_lost"] == 0,
    }
    _plot(out, doc)
    return doc


def _plot(out: Path, doc: dict) -> None:
    lines = {}
    for arch in ("ps", "allreduce"):
        xs, ys = zip(*doc[arch]["rate_over_time"], strict=True)
        lines[arch] = (list(xs), list(ys))
    c.plot(out / "elastic_rate.png", lines, xlabel="seconds since start",
           ylabel="samples/s (in the final model)", title="Preemption schedule")  # fmt: skip


def table(doc: dict) -> str:
    if "note" in doc:
        return "## Elastic\n\n" + doc["note"]
    head = ["arch", "seconds", "samples lost", "samples repeated", "rolled back",
            "samples/s", "val loss", "fixed-size val loss", "time lost per event (s)"]  # fmt: skip
    rows = []
    for arch in ("ps", "allreduce"):
        r = doc[arch]
        lost = ", ".join(f"{e['event']}: {e['time_lost_s']:.1f}" for e in r["events"][1:])
        rows.append([arch, r["seconds"], r["samples_lost"], r["samples_repeated"],
                     r["samples_rolled_back"], r["samples_per_sec"], r["val_loss"],
                     r.get("fixed_val_loss"), lost])  # fmt: skip
    met = "met" if doc["goal_met"] else "NOT met"
    return (
        "## Elastic: the preemption schedule\n\n" + c.md_table(head, rows) + "\n\n"
        f"{' -> '.join(doc['schedule'])} at {', '.join(f'{a:.0%}' for a in doc['at_share_of_epoch'])}"
        f" of one epoch of {doc['workload']}, batch {doc['batch_size']}, emulated compute "
        f"{doc['compute_ms']:g} ms/step. ps (sync, lease {doc['lease_s']:g} s) finishes "
        f"**{doc['ps_speedup']:.3g}x** faster than torchrun elastic (checkpoint every "
        f"{doc['checkpoint_every']} steps; rdzv {doc['rdzv_conf']}); goal >= {GOAL}x and no "
        f"sample lost: **{met}**."
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.elastic", __doc__)
    p.add_argument("--batches", type=int, default=None,
                   help="batches in the epoch (default 1200; quick 360), a multiple of 12")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--compute-ms", type=float, default=100.0, help="emulated compute per step")
    p.add_argument("--at", default="0.15,0.35,0.55,0.7",
                   help="share of the epoch trained at each event (4 values)")  # fmt: skip
    p.add_argument("--lease-s", type=float, default=3.0, help="ps: the shards' --lease-s")
    p.add_argument("--checkpoint-every", type=int, default=10, help="allreduce: steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bin-s", type=float, default=2.0, help="samples/s over time: bin width")
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed-size jobs")
    p.add_argument("--archs", default="ps,allreduce", help="run only these (debugging)")
    args = p.parse_args(argv)
    args.batches = args.batches or (360 if args.quick else 1200)
    args.at = [float(x) for x in args.at.split(",")]
    args.archs = [a for a in args.archs.split(",") if a]
    if not args.archs or set(args.archs) - {"ps", "allreduce"}:
        p.error("--archs: ps, allreduce or both")
    if len(args.at) != len(SCHEDULE) or args.at != sorted(args.at) or not 0 < args.at[0]:
        p.error(f"--at: {len(SCHEDULE)} increasing shares of the epoch in (0, 1)")
    if args.batches % 12 or args.batches < 48:
        p.error("--batches: a multiple of 12 (world sizes 1-4 cut the epoch whole), >= 48")
    if not math.isfinite(args.compute_ms) or args.compute_ms <= 0:
        p.error("--compute-ms must be > 0")
    c.install_sigterm()
    out = c.out_dir(args, "elastic")
    doc = measure(out, args)
    return c.finish(args, out, "elastic", doc, table(doc))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
