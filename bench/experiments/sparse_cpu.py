"""CPU per step of each sparse-table design, the figures `psar plan`'s per-row constants
come from (docs/cost-model.md, "Sparse tables").

Runs bench/sparse.py's recsys job (a `--rows` x 64 table plus a 100k one, batch 4096 per
worker, bag 4, fp32 on the wire, one thread per process) as whole jobs at two lengths and
takes the difference of their CPU-seconds (getrusage of every reaped child: ranks,
workers and shards alike) per step, so start-up (building the tables included) cancels:

- `ddp1`: DDP-sparse, one rank (no bytes to move; it applies its own touched rows);
- `ddp2`: DDP-sparse, two ranks (gloo's sparse allreduce, each rank applies both ranks' rows);
- `ps`: two shards and two `--arch ps` workers (the rows through the shards);
- `hybrid`: two shards and two `--arch hybrid` ranks.

Nothing else of ours may run meanwhile (reaped children all count); other users' load
inflates CPU per step (cache and scheduler contention), so run it on a quiet machine.

    python bench/experiments/sparse_cpu.py --rows 1000000 [--jobs ddp1,ddp2,ps,hybrid]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import common as c

JOBS = ("ddp1", "ddp2", "ps", "hybrid")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _common(rows: int, steps: int, batch: int) -> list[str]:
    """bench/sparse.py's flags for one length of the job."""
    # The same data at both lengths: generating more samples for the longer run would
    # count its CPU per step (enough for 2 workers x batch x LONG steps).
    opts = {"rows": f"{rows},100000", "dim": "64", "bag": "4",
            "samples": str(max(1_000_000, batch * 2 * (steps + 1))), "val_samples": "0"}  # fmt: skip
    return ["train", "--workload", "recsys",
            *(a for k, v in opts.items() for a in ("--workload-option", f"{k}={v}")),
            "--steps", str(steps), "--batch-size", str(batch), "--precision", "fp32",
            "--lr", "0.05", "--momentum", "0", "--eval-batches", "0", "--log-every", "0",
            "--torch-threads", "1", "--wire-dtype", "fp32"]  # fmt: skip


def _run(job: str, out: Path, rows: int, steps: int, batch: int, timeout: float) -> float:
    """CPU-seconds of one whole job of `steps` steps."""
    common = _common(rows, steps, batch)
    before = _children_cpu_s()
    with c.supervisor(out) as sup:
        if job in ("ddp1", "ddp2"):
            argv = [*c.TORCHRUN, "--nproc-per-node", job[-1], "--master-addr", "127.0.0.1",
                    "--master-port", str(c.free_port()), "-m", "psar.worker.cli", *common,
                    "--arch", "allreduce", "--workload-option", "sparse=true",
                    "--optimizer-impl", "loop"]  # fmt: skip
            sup.start("ddp", argv)
            sup.wait(["ddp"], timeout)
        else:
            addrs = ",".join(c.start_shards(sup, 2))
            rows_fp32 = ["--servers", addrs, "--sparse-wire-dtype", "fp32"]
            if job == "ps":
                for r in range(2):
                    sup.start(f"w{r}", [*c.PSAR, *common, "--arch", "ps", *rows_fp32,
                                        "--rank", str(r), "--world-size", "2"])  # fmt: skip
                sup.wait(["w0", "w1"], timeout)
            else:
                argv = [*c.TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", str(c.free_port()), "-m", "psar.worker.cli", *common,
                        "--arch", "hybrid", "--mode", "sync", *rows_fp32]  # fmt: skip
                sup.start("hybrid", argv)
                sup.wait(["hybrid"], timeout)
    return _children_cpu_s() - before  # the shards too: the supervisor reaped them


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", default="10,60", help="the two lengths, SHORT,LONG")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"subset of {', '.join(JOBS)}")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    if not jobs or set(jobs) - set(JOBS):
        ap.error(f"--jobs: accepted: {', '.join(JOBS)}; got {a.jobs!r}")
    short, long = (int(s) for s in a.steps.split(","))
    if not 0 < short < long:
        ap.error(f"--steps: give SHORT,LONG with 0 < SHORT < LONG, got {a.steps!r}")
    doc: dict = {"rows": [a.rows, 100_000], "batch_per_worker": a.batch, "steps": [short, long],
                 "machine": c.machine(), "cpu_ms_per_step": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs:
            cpu = [_run(job, Path(tmp) / f"{job}-{n}", a.rows, n, a.batch, a.timeout)
                   for n in (short, long)]  # fmt: skip
            doc["cpu_ms_per_step"][job] = 1e3 * (cpu[1] - cpu[0]) / (long - short)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
