"""What moving bytes and training a step cost in CPU on this machine: the measurements
behind `python -m bench.experiments.cpu_rate` (bench/experiments/cpu_rate.py says what each one is), used by the
crossover grid (bench/lib/grid.py) to model the cores its emulated hosts share."""

from __future__ import annotations

import json
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib import common as c

PAYLOAD_MIB = 32
CYCLES = 8

_BUSY = """
def busy_s():
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:8]]
    import os
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
"""

_PS_CLIENT = (
    _BUSY
    + """
import json, sys, time
from bench.lib.datapath import run_config
addr, mib, cycles = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
marks = []
def before(timed):
    if timed and not marks:
        marks.append(busy_s())
times = run_config([addr], payload_bytes=mib << 20, tensors=4, chunk_bytes=4 << 20,
                   message_bytes=1 << 20, max_message_bytes=16 << 20, repeats=cycles,
                   warmup=2, before_cycle=before, transports=("tcp",))
cpu = busy_s() - marks[0]
print(json.dumps({"cpu_s": cpu, "bytes": 4 * (mib << 20) * cycles}))
"""
)

_GLOO = (
    _BUSY
    + """
import json, os, sys, time
import torch, torch.distributed as dist
mib, cycles = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.ones((mib << 20) // 4)
for _ in range(2):
    dist.all_reduce(t)
dist.barrier()
b0 = busy_s()
for _ in range(cycles):
    dist.all_reduce(t)
dist.barrier()
if dist.get_rank() == 0:
    n = dist.get_world_size()
    print(json.dumps({"cpu_s": busy_s() - b0, "bytes": 4 * (n - 1) * (mib << 20) * cycles}))
dist.barrier()
time.sleep(0.05)  # gloo's threads drop their work first: allreduce/process_group.py
dist.destroy_process_group()
"""
)


def measure(
    sup: c.Supervisor, a: Any, b: Any, mib: int = PAYLOAD_MIB, cycles: int = CYCLES
) -> dict:
    """{"ps_bytes_per_cpu_second", "allreduce_bytes_per_cpu_second"} between hosts a, b."""
    addr = c.start_shards(sup, 1, hosts=[b], server=["--torch-threads", "1"])[0]
    p = a.run([c.PY, "-c", _PS_CLIENT, addr, str(mib), str(cycles)], timeout=600, cwd=c.ROOT,
              env=c.child_env())  # fmt: skip
    if p.returncode != 0:
        raise c.ProcessError(f"ps CPU calibration failed: {p.stderr[-2000:]}")
    ps = json.loads(p.stdout.strip().splitlines()[-1])
    port = str(c.free_port())
    for r, h in enumerate((a, b)):
        env = c.child_env({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": a.addr,
                           "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": h.ifname})  # fmt: skip
        sup.start(f"gloo{r}", c.on(h, [c.PY, "-c", _GLOO, str(mib), str(cycles)]), env=env)
    sup.wait(["gloo0", "gloo1"], 600)
    ring = json.loads(sup.lines("gloo0")[-1])
    return {
        "payload_mib": mib,
        "cycles": cycles,
        "ps_bytes_per_cpu_second": ps["bytes"] / ps["cpu_s"],
        "allreduce_bytes_per_cpu_second": ring["bytes"] / ring["cpu_s"],
    }


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def worker_cpu_seconds(out: Path, train: Sequence[str], steps: tuple[int, int] = (10, 40),
                       timeout: float = 600.0, min_cpu_s: float = 2.0,
                       max_steps: int = 5000) -> float:  # fmt: skip
    """CPU-seconds one worker spends per step of `train` (psar train flags without
    --steps) besides moving bytes: a one-worker allreduce job at two lengths, differenced.
    Where the difference is under `min_cpu_s` (a light step, lost in start-up's noise),
    the longer run is redone long enough for it, up to `max_steps`. Nothing else of ours
    may finish meanwhile (reaped children all count)."""

    def cpu_of(n: int) -> float:
        d = out / f"worker-cpu-{n}"
        before = _children_cpu_s()
        c.ddp_job(d, workers=1, timeout=timeout,
                  py_args=[*c.psar_train_args(d), *train, "--steps", str(n)])  # fmt: skip
        return _children_cpu_s() - before

    short, long = steps
    base, cpu = cpu_of(short), cpu_of(long)
    # A first difference lost in start-up's noise can overstate the step (CI: 1.5 s of
    # noise read as 50 ms a step, a redo 30 steps longer, and a difference of 0): redo at
    # least twice as long each time, until it stands out.
    for _ in range(4):
        if cpu - base >= min_cpu_s or long >= max_steps:
            break
        per = max((cpu - base) / (long - short), 1e-4)
        long = min(max_steps, short + max(2 * (long - short), int(1.5 * min_cpu_s / per)))
        cpu = cpu_of(long)
    if cpu <= base:
        raise RuntimeError(
            f"the CPU of {long} steps ({cpu:.2f} s) did not stand out of {short} steps' "
            f"({base:.2f} s): measure on a quieter machine, or with a heavier --worker-train"
        )
    return (cpu - base) / (long - short)
