"""bench/lib/cpuwindow.py's window sampler (bench/sparse.py --cpu-window-s,
bench/experiments/step_cpu.py): CPU ms per step of real processes, a child counted with
its parent, the steps rank 0 logged in the window."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.lib import cpuwindow as step_cpu

# A "job": rank 0 logs a step every ~20 ms of busy CPU; with an argument it first starts
# a child that sleeps (so the parent's tree holds two processes, one idle).
JOB = textwrap.dedent(
    """
    import json, subprocess, sys, time
    from pathlib import Path
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = Path(sys.argv[1]) / "steps-x-rank0.jsonl"
    with log.open("w") as f:
        for step in range(1, 400):
            t = time.process_time()
            while time.process_time() - t < 0.02:
                pass
            f.write(json.dumps({"step": step, "wall": time.time()}) + "\\n")
            f.flush()
    kid.kill()
    """
)


def test_a_busy_process_costs_its_cpu_per_step_and_an_idle_one_nothing(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path)])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        got = step_cpu.sample_window(
            {"busy": busy.pid, "idle": idle.pid}, tmp_path, after_step=5, window_s=1.0, timeout=60
        )
        assert len(step_cpu.tree(busy.pid)) == 2  # the job and its sleeping child
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    out = step_cpu.per_step(got, tmp_path)
    assert out["steps"] > 0
    # Each step spins 20 ms of CPU; the loop and the log add a little, the kid nothing.
    assert 15.0 < out["cpu_ms_per_step"]["busy"] < 40.0
    assert out["cpu_ms_per_step"]["idle"] < 2.0
    assert out["cpu_ms_per_step_all"] == round(sum(out["cpu_ms_per_step"].values()), 2)


def test_no_window_when_rank_0_never_reaches_the_step(tmp_path: Path) -> None:
    (tmp_path / "steps-x-rank0.jsonl").write_text(json.dumps({"step": 1, "wall": 0.0}) + "\n")
    got = step_cpu.sample_window({}, tmp_path, after_step=5, window_s=1.0, timeout=0.2)
    assert got == {} and step_cpu.per_step(got, tmp_path) == {}


def test_a_run_that_ends_inside_the_window_gives_no_figure(tmp_path: Path) -> None:
    log = tmp_path / "steps-x-rank0.jsonl"
    log.write_text("".join(json.dumps({"step": i, "wall": 0.0}) + "\n" for i in range(5)))
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    got = step_cpu.sample_window(
        {"job": short.pid}, tmp_path, after_step=5, window_s=1.5, timeout=5
    )
    short.wait()
    assert got["gone"] == ["job"]
    assert "ended inside the window" in step_cpu.per_step(got, tmp_path)["error"]


@pytest.mark.slow
def test_the_command_prints_every_process_cpu_per_step() -> None:
    """`python -m bench.experiments.step_cpu` end to end: a real shard and two real workers."""
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "bench.experiments.step_cpu", "--steps", "80", "--window-s",
                        "0.5"], cwd=root, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {ln.split(":")[0].strip(): ln for ln in p.stdout.splitlines() if ":" in ln}
    for name in ("shard0", "worker0", "worker1", "all"):
        assert "CPU ms/step" in lines[name], p.stdout
    assert "phases (median ms)" in lines, p.stdout
