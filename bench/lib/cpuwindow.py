"""CPU ms per step of running processes: each process's CPU time (/proc/PID/stat, user +
system, with its descendants) over a window of a run, divided by the steps rank 0 logged
in that window. bench/sparse.py (`--cpu-window-s`) and bench/experiments/step_cpu.py use
it; a 2-core machine is CPU-bound when the processes' CPU ms per step add up to about 2x
the step time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from psar.worker.supervisor import descendants


def tree(pid: int) -> list[int]:
    """`pid` and every live process under it (torchrun's ranks are its children)."""
    return [pid, *descendants([pid])]


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
    procs = {name: tree(pid) for name, pid in pids.items()}
    a = {p: cpu_seconds(p) for ps in procs.values() for p in ps}
    t0 = time.time()
    time.sleep(window_s)
    b = {p: cpu_seconds(p) for p in a}
    # A process that started or ended inside the window (a helper) is left out whole.
    cpu = {
        name: sum(b[p] - a[p] for p in ps if a[p] is not None and b[p] is not None)
        for name, ps in procs.items()
    }
    gone = sorted(n for n, pid in pids.items() if b.get(pid) is None)
    return {"t": (t0, time.time()), "cpu_s": cpu, "gone": gone}


def cpu_seconds(pid: int) -> float | None:
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
