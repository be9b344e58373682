"""CPU per byte of each architecture's data path on this machine (`psar plan --cpu-*`).

Where the links are fast and the cores few, a step waits for the CPU that moves the
bytes, not for the wire: on this 2-core machine every emulated host of bench/links.py
shares the same two cores, and a Python parameter server on a 100 Gbit/s NIC would hit
its cores first too. The plan models that from one figure per architecture: the bytes
one core moves through its data path per second, each end counting (a push of M is M out
of a worker and M into a shard), the kernel's networking included. This measures both
between two hosts of a shaped LAN, pure communication, no model:

- ps: `psar server` on one host, a psar client (ps.client.PSClient, the TCP data plane:
  what a worker runs) on the other, pushing P bytes of fp32 gradient and pulling the
  weights back, sync with one worker (the shard's SGD step included);
- allreduce: two gloo ranks allreducing a P-byte fp32 tensor (what DDP runs).

Rate = bytes through the processes / busy CPU-seconds of the whole machine over the
timed loop (/proc/stat: user, system, irq and softirq; the machine must be otherwise
idle, as it is during a bench run).

On shared cores the workers' own CPU competes with the bytes too (`psar plan
--worker-cpu-ms`): `worker_cpu_seconds` runs one `psar train --arch allreduce` worker (a
ring of one: no bytes to move) for two numbers of steps of the caller's workload and
takes the difference of its CPU-seconds (getrusage of the reaped job) per step, so the
start-up cancels out: its forward, backward (the real part of an emulated compute) and
optimizer step.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common as c

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
from bench.ps_datapath import run_config
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


def measure(procs: c.Procs, a: Any, b: Any, mib: int = PAYLOAD_MIB, cycles: int = CYCLES) -> dict:
    """{"ps_bytes_per_cpu_second", "allreduce_bytes_per_cpu_second"} between hosts a, b."""
    addr = c.start_shards(procs, 1, hosts=[b], server=["--torch-threads", "1"])[0]
    p = a.run([c.PY, "-c", _PS_CLIENT, addr, str(mib), str(cycles)], timeout=600, cwd=c.ROOT,
              env=c.child_env())  # fmt: skip
    if p.returncode != 0:
        raise c.BenchError(f"ps CPU calibration failed: {p.stderr[-2000:]}")
    ps = json.loads(p.stdout.strip().splitlines()[-1])
    port = str(c.free_port())
    ranks = []
    for r, h in enumerate((a, b)):
        env = c.child_env({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": a.addr,
                           "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": h.ifname})  # fmt: skip
        ranks.append(procs.start(f"gloo{r}", [c.PY, "-c", _GLOO, str(mib), str(cycles)],
                                 env=env, host=h))  # fmt: skip
    procs.wait(["gloo0", "gloo1"], 600)
    ring = json.loads((procs.log_dir / "gloo0.log").read_text().strip().splitlines()[-1])
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
    if cpu - base < min_cpu_s and long < max_steps:
        per = max((cpu - base) / (long - short), 1e-4)
        long = min(max_steps, short + int(1.5 * min_cpu_s / per))
        cpu = cpu_of(long)
    return max(0.0, (cpu - base) / (long - short))


def main(argv: Sequence[str] | None = None) -> int:
    """python -m bench.cpu_rate [--worker-train FLAGS] [--no-rates]: JSON on stdout."""
    import argparse
    import shlex
    import tempfile

    p = argparse.ArgumentParser(
        prog="python -m bench.cpu_rate",
        description="The figures `psar plan --cpu-cores` needs from this machine: bytes per "
        "CPU-second of psar's PS data path and of gloo's ring (--ps-cpu-gbps, "
        "--allreduce-cpu-gbps: two hosts of an emulated LAN, needs root for network "
        "namespaces), and with --worker-train one worker's own CPU per step of your "
        "workload (--worker-cpu-ms).",
    )
    p.add_argument("--worker-train", metavar="FLAGS", default=None,
                   help='psar train flags of your workload without --steps, e.g. "--workload '
                   'mlp --batch-size 64 --threads 1": also measure worker_cpu_seconds_per_step '
                   "(a one-worker job at two lengths, differenced)")  # fmt: skip
    p.add_argument("--no-rates", action="store_true",
                   help="skip the two-host byte rates (no namespaces needed)")  # fmt: skip
    args = p.parse_args(argv)
    if args.no_rates and args.worker_train is None:
        p.error("--no-rates leaves nothing to measure: give --worker-train FLAGS too")
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="psar-cpu-rate-"))
    if not args.no_rates:
        from bench.links import unavailable

        netns, reason = unavailable(0.0)
        if reason:
            p.exit(1, f"cpu_rate: {reason} (--no-rates measures only --worker-train)\n")
        with netns.lan(["a", "b"]) as lan, c.Procs(tmp / "rates") as procs:
            out.update(measure(procs, lan["a"], lan["b"]))
    if args.worker_train is not None:
        try:
            w = worker_cpu_seconds(tmp / "worker", shlex.split(args.worker_train))
        except c.BenchError as e:
            p.exit(
                1, f"cpu_rate: --worker-train: psar train failed (logs in {tmp / 'worker'}): {e}\n"
            )
        out["worker_cpu_seconds_per_step"] = w
        out["worker_cpu_ms_flag"] = f"--worker-cpu-ms {1e3 * w:.4g}"
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
