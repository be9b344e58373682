"""Where a PS step's CPU goes: CPU ms per step of every shard and worker process.

Starts `psar server` shards and `psar train --arch ps` workers on the reference workload
(as bench/step_throughput.py does), samples each process's CPU time over a window in the
middle of the run and divides by the steps rank 0 logged in the window
(bench/lib/cpuwindow.py, which bench/sparse.py's --cpu-window-s uses too). Next to it: the
medians of the step phases. A 2-core machine is CPU-bound when the processes' CPU ms per
step add up to about 2x the step time. A diagnostic, not a benchmark: it prints, keeps no
baseline and writes no JSON.

    python -m bench.experiments.step_cpu                          # 2 workers, 1 shard
    python -m bench.experiments.step_cpu --workers 1 -- --no-overlap   # after --: psar train
    python -m bench.experiments.step_cpu --server=--chunk-rounds    # a `psar server` flag
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.lib import common as c
from bench.lib.cpuwindow import per_step, sample_window


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.step_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument(
        "--steps", type=int, default=600, help="per worker (the run must outlast the window)"
    )
    p.add_argument("--window-s", type=float, default=4.0, help="seconds of CPU sampling")
    p.add_argument("--server", action="append", default=[], metavar="FLAG",
                   help="extra `psar server` flag, repeatable (--server=--chunk-rounds)")  # fmt: skip
    p.add_argument("train", nargs="*", help="extra `psar train` flags (after --)")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="psar-step-cpu-"))
    # Every process logs to a file (a piped, undrained stdout could fill and stall a
    # shard), a failed one raises with its log's tail, and all are stopped on the way out.
    with c.supervisor(tmp) as sup:
        addrs = ",".join(c.start_shards(sup, a.shards, server=a.server))
        workers = [f"worker{r}" for r in range(a.workers)]
        for r, name in enumerate(workers):
            sup.start(name, [*c.PSAR, "train", "--arch", "ps", "--servers", addrs, "--rank",
                               str(r), "--world-size", str(a.workers), *c.REF_TRAIN, "--steps",
                               str(a.steps), "--run-dir", str(tmp / f"r{r}"), "--log-every", "0",
                               *a.train])  # fmt: skip
        # Start-up and the first fifth of the steps stay outside the window.
        got = sample_window({name: ch.pid for name, ch in sup.children.items()}, tmp / "r0",
                            after_step=max(2, a.steps // 5), window_s=a.window_s,
                            timeout=600)  # fmt: skip
        sup.wait(workers, timeout=600)
    res = per_step(got, tmp / "r0")
    if "cpu_ms_per_step" not in res:
        raise SystemExit(f"no CPU window: {res.get('error', 'too few steps')}")
    step = res["wall_ms_per_step"]
    print(f"step {step:.1f} ms (rank 0's steps in the {a.window_s:g} s window); CPU:")
    for name, ms in res["cpu_ms_per_step"].items():
        print(f"  {name}: {ms:.1f} CPU ms/step ({100 * ms / step:.0f}%)")
    total = res["cpu_ms_per_step_all"]
    print(f"  all: {total:.1f} CPU ms/step = {total / step:.2f} cores busy")
    logs = sorted((tmp / "r0").glob("steps-*.jsonl"))
    recs = [json.loads(line) for line in logs[0].read_text().splitlines()]
    recs = recs[len(recs) // 5 :]
    phases = {k: 1e3 * statistics.median(r["phases"].get(k, 0.0) for r in recs)
              for k in recs[0].get("phases", {})}  # fmt: skip
    print("  phases (median ms):", {k: round(v, 2) for k, v in phases.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
