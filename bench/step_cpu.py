"""Where a PS step's CPU goes: CPU ms per step of every shard and worker process.

Starts `psar server` shards and `psar train --arch ps` workers on the reference workload
(as bench/step_throughput.py does), samples each process's CPU time (/proc/PID/stat,
user + system) over a window in the middle of the run, and divides by the steps rank 0
logged in the window (`sample_window`, `per_step`: bench/sparse.py uses them too). Next
to it: the medians of the step phases. A 2-core machine is CPU-bound when the processes'
CPU ms per step add up to about 2x the step time.

    python -m bench.step_cpu                          # 2 workers, 1 shard, defaults
    python -m bench.step_cpu --workers 1 -- --no-overlap   # flags after -- go to psar train
    python -m bench.step_cpu --server=--chunk-rounds    # a `psar server` flag
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (torchrun's ranks are its children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(x) for x in task.read_text().split())
    return out


def _logged_steps(log_dir: Path) -> int:
    """Steps rank 0 has logged so far: a line count (polled while the job runs, so it
    parses nothing)."""
    logs = sorted(log_dir.glob("steps-*rank0.jsonl"))
    return logs[0].read_bytes().count(b"\n") if logs else 0


def _wall_steps(log_dir: Path) -> list[float]:
    """Wall-clock ends of rank 0's steps so far (its step log under `log_dir`)."""
    logs = sorted(log_dir.glob("steps-*rank0.jsonl"))
    if not logs:
        return []
    return [json.loads(x)["wall"] for x in logs[0].read_text().splitlines() if x.strip()]


def sample_window(
    pids: dict[str, int], log_dir: Path, *, after_step: int, window_s: float, timeout: float
) -> dict:
    """CPU seconds of each named process (with its descendants) over `window_s` seconds
    that start once rank 0 has logged `after_step` steps; {} if that never happens."""
    t_end = time.monotonic() + timeout
    while _logged_steps(log_dir) < after_step:
        if time.monotonic() > t_end:
            return {}
        time.sleep(0.05)
    tree = {name: descendants(pid) for name, pid in pids.items()}
    a = {p: _cpu(p) for ps in tree.values() for p in ps}
    t0 = time.time()
    time.sleep(window_s)
    b = {p: _cpu(p) for p in a}
    # A process that started or ended inside the window (a helper) is left out whole.
    cpu = {
        name: sum(b[p] - a[p] for p in ps if a[p] is not None and b[p] is not None)
        for name, ps in tree.items()
    }
    gone = sorted(n for n, pid in pids.items() if b.get(pid) is None)
    return {"t": (t0, time.time()), "cpu_s": cpu, "gone": gone}


def _cpu(pid: int) -> float | None:
    """CPU seconds of `pid` so far, None once it has ended (gone, or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_step(sample: dict, log_dir: Path) -> dict:
    """CPU ms per step of each process in a `sample_window` (rank 0's steps that ended in
    the window), their sum, and the wall ms per step over the same window."""
    if not sample:
        return {}
    if sample.get("gone"):
        return {"error": f"{', '.join(sample['gone'])} ended inside the window: run more steps"}
    t0, t1 = sample["t"]
    n = sum(1 for w in _wall_steps(log_dir) if t0 <= w <= t1)
    if not n:
        return {}
    ms = {name: round(1e3 * v / n, 2) for name, v in sample["cpu_s"].items()}
    return {"steps": n, "wall_ms_per_step": round(1e3 * (t1 - t0) / n, 2),
            "cpu_ms_per_step": ms, "cpu_ms_per_step_all": round(sum(ms.values()), 2)}  # fmt: skip


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
    # Procs: every process logs to a file (a piped, undrained stdout could fill and stall
    # a shard), a failed one raises with its log's tail, and all are killed on the way out.
    with c.Procs(tmp) as procs:
        addrs = ",".join(c.start_shards(procs, a.shards, server=a.server))
        workers = [f"worker{r}" for r in range(a.workers)]
        for r, name in enumerate(workers):
            procs.start(name, [*c.PSAR, "train", "--arch", "ps", "--servers", addrs, "--rank",
                               str(r), "--world-size", str(a.workers), *c.REF_TRAIN, "--steps",
                               str(a.steps), "--run-dir", str(tmp / f"r{r}"), "--log-every", "0",
                               *a.train])  # fmt: skip
        # Start-up and the first fifth of the steps stay outside the window.
        got = sample_window({name: pr.pid for name, pr in procs.procs.items()}, tmp / "r0",
                            after_step=max(2, a.steps // 5), window_s=a.window_s,
                            timeout=600)  # fmt: skip
        procs.wait(workers, timeout=600)
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
