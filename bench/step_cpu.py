"""Where a PS step's CPU goes: CPU ms per step of every shard and worker process.

Starts `psar server` shards and `psar train --arch ps` workers on the reference workload
(as bench/step_throughput.py does), samples each process's CPU time (/proc/PID/stat,
user + system) over a window in the middle of the run, and divides by the number of
steps in the window (median step time from rank 0's step log). Next to it: the medians
of the step phases. A 2-core machine is CPU-bound when the processes' CPU ms per step
add up to about 2x the step time.

    python -m bench.step_cpu                          # 2 workers, 1 shard, defaults
    python -m bench.step_cpu --workers 1 -- --no-overlap   # flags after -- go to psar train
    python -m bench.step_cpu --server=--chunk-rounds    # a `psar server` flag
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_cpu", description=__doc__,
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
    env = c.child_env()
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        addrs = []
        for i in range(a.shards):
            s = subprocess.Popen([*c.PSAR, "server", "--bind", "127.0.0.1:0", "--shard", str(i),
                                  *a.server], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, cwd=c.ROOT)  # fmt: skip
            procs.append((f"shard{i}", s))
            while m := s.stdout.readline():
                if hit := re.search(r"listening on (\S+:\d+)", m):
                    addrs.append(hit.group(1))
                    break
        for r in range(a.workers):
            w = subprocess.Popen(
                [*c.PSAR, "train", "--arch", "ps", "--servers", ",".join(addrs), "--rank", str(r),
                 "--world-size", str(a.workers), *c.REF_TRAIN, "--steps", str(a.steps),
                 "--run-dir", str(tmp / f"r{r}"), "--log-every", "0", *a.train],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=c.ROOT)  # fmt: skip
            procs.append((f"worker{r}", w))
        time.sleep(6.0)  # start-up and the first steps stay outside the window
        before = [cpu_seconds(pr.pid) for _, pr in procs]
        t0 = time.monotonic()
        time.sleep(a.window_s)
        after = [cpu_seconds(pr.pid) for _, pr in procs]
        window = time.monotonic() - t0
        for name, pr in procs:
            if name.startswith("worker") and pr.wait(timeout=600) != 0:
                raise SystemExit(f"{name} exited {pr.returncode}")
        logs = sorted((tmp / "r0").glob("steps-*.jsonl"))
        recs = [json.loads(line) for line in logs[0].read_text().splitlines()]
        recs = recs[len(recs) // 5 :]
        step = statistics.median(
            q["time"] - p_["time"] for p_, q in zip(recs, recs[1:], strict=False)
        )
        steps = window / step
        print(f"step {1e3 * step:.1f} ms (median, rank 0); CPU over {window:.1f} s:")
        total = 0.0
        for (name, _), x, y in zip(procs, before, after, strict=True):
            total += (y - x) / steps
            print(
                f"  {name}: {1e3 * (y - x) / steps:.1f} CPU ms/step ({100 * (y - x) / window:.0f}%)"
            )
        print(f"  all: {1e3 * total:.1f} CPU ms/step = {total / step:.2f} cores busy")
        phases = {k: 1e3 * statistics.median(r["phases"].get(k, 0.0) for r in recs)
                  for k in recs[0].get("phases", {})}  # fmt: skip
        print("  phases (median ms):", {k: round(v, 2) for k, v in phases.items()})
    finally:
        for _, pr in procs:
            pr.kill()
            pr.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
