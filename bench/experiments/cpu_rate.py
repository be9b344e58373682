"""CPU per byte of each architecture's data path on this machine (`psar plan --cpu-*`).

Where the links are fast and the cores few, a step waits for the CPU that moves the
bytes, not for the wire: on this 2-core machine every emulated host of bench/links.py
shares the same two cores, and a Python parameter server on a 100 Gbit/s NIC would hit
its cores first too. The plan models that from one figure per architecture: the bytes
one core moves through its data path per second, each end counting (a push of M is M out
of a worker and M into a shard), the kernel's networking included. This measures both
between two hosts of a shaped LAN, pure communication, no model:

- ps: `psar server` on one host, a psar client (psar.ps.client.PSClient, the TCP data plane:
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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import common as c
from bench.lib.cpucost import CYCLES, PAYLOAD_MIB, measure, worker_cpu_seconds
from bench.lib.netem import unavailable

__all__ = ["CYCLES", "PAYLOAD_MIB", "measure", "worker_cpu_seconds"]


def main(argv: Sequence[str] | None = None) -> int:
    """python -m bench.experiments.cpu_rate [--worker-train FLAGS] [--no-rates]: JSON on stdout."""
    import argparse
    import shlex
    import tempfile

    p = argparse.ArgumentParser(
        prog="python -m bench.experiments.cpu_rate",
        description="The figures `psar plan --cpu-cores` needs from this machine: bytes per "
        "CPU-second of psar's PS data path and of gloo's ring (--ps-cpu-gbps, "
        "--allreduce-cpu-gbps: two hosts of an emulated LAN, needs root for network "
        "namespaces), and with --worker-train one worker's own CPU per step of your "
        "workload (--worker-cpu-ms).",
    )
    p.add_argument("--worker-train", metavar="FLAGS", default=None,
                   help='psar train flags of your workload without --steps, e.g. "--workload '
                   'mlp --batch-size 64 --torch-threads 1": also measure worker_cpu_seconds_per_step '
                   "(a one-worker job at two lengths, differenced)")  # fmt: skip
    p.add_argument("--no-rates", action="store_true",
                   help="skip the two-host byte rates (no namespaces needed)")  # fmt: skip
    args = p.parse_args(argv)
    if args.no_rates and args.worker_train is None:
        p.error("--no-rates leaves nothing to measure: give --worker-train FLAGS too")
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="psar-cpu-rate-"))
    if not args.no_rates:
        netns, reason = unavailable(0.0)
        if reason:
            p.exit(1, f"cpu_rate: {reason} (--no-rates measures only --worker-train)\n")
        with netns.lan(["a", "b"]) as lan, c.supervisor(tmp / "rates") as sup:
            out.update(measure(sup, lan["a"], lan["b"]))
    if args.worker_train is not None:
        try:
            w = worker_cpu_seconds(tmp / "worker", shlex.split(args.worker_train))
        except c.ProcessError as e:
            p.exit(
                1, f"cpu_rate: --worker-train: psar train failed (logs in {tmp / 'worker'}): {e}\n"
            )
        except RuntimeError as e:  # the step's CPU never stood out of start-up's
            p.exit(1, f"cpu_rate: --worker-train: {e}\n")
        out["worker_cpu_seconds_per_step"] = w
        out["worker_cpu_ms_flag"] = f"--worker-cpu-ms {1e3 * w:.4g}"
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
