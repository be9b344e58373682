"""Data path: push + pull of an fp32 payload through 1, 2, 4 real shards, against raw TCP.

Each shard is a real `psar server` process (run through worker/supervisor.py, logs in the
run folder); the client is psar.ps.client.psclient.PSClient used as a worker uses it (init
with psar.ps.job.Job objects from psar.ps.partition.plan_slots, then push/pull in a loop, mode
async, one worker, so nothing ever waits on a barrier: bench/lib/datapath.py). Two
transports move the same push and pull through the same PSClient calls, cycles
alternating on the same shards: "grpc" (--data-plane grpc) and "tcp", the shards' data
plane (ps/server/doors/dataplane.py; one DataPlaneClient per shard, port from GetJob, shards in
parallel). Right before every cycle the same script times one raw loopback TCP transfer
of the same payload (bench/baselines/tcp.py), so the ratio compares like with like on a
noisy machine; by default it first waits (bounded) for the CPUs to be quiet.
The wait (`--settle-s`, 20 s each time, `--settle-budget-s` 600 s in all) lasts until
both CPUs are >= 80% idle over 0.25 s; `settle_wait_s` in the JSON says how long a row
waited. Without it, 64 MiB runs minutes apart ranged 0.1-1.2 GB/s; with it, repeats agree
within ~20%. Raw loopback TCP on this VM flips between ~3.5 and ~5.5 GB/s from one minute
to the next, which the per-cycle TCP transfer follows. The slot chunk (4 MiB, what
workers use) and gRPC's 1 MiB messages were chosen by measurement (64 MiB chunks no
faster; 4 MiB messages slower; docs/results.md, 2026-11-29).

GB/s = (push bytes + pull bytes) / median push+pull cycle time, 1e9 bytes per GB.
ratio_to_tcp = gbps / tcp_gbps, tcp_gbps being one-way raw TCP for the same payload
(median of those transfers). The JSON document's `results` holds one object per (size,
shards, transport): payload_mib, shards, transport, gbps, ratio_to_tcp, push/pull/TCP
GB/s, cycle times and the settings. The shard's own update is measured by
bench/shard_update.py, the CPU each byte costs by bench/experiments/cpu_rate.py.

    python -m bench.ps_datapath                       # 16,64,256 MiB x 1,2,4 shards
    python -m bench.ps_datapath --json --repeats 7
    python -m bench.ps_datapath --quick --json        # CI smoke: 1 MiB, tiny
    python -m bench.ps_datapath --transports tcp      # the data plane only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` and `ps` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.baselines.tcp import MIB, TcpSink
from bench.lib import common as c
from bench.lib.datapath import Settler, run_config
from psar.ps import wire
from psar.ps.client.tcp_transport import DEFAULT_MAX_FRAME_BYTES
from psar.ps.partition import DEFAULT_CHUNK_BYTES
from psar.worker.supervisor import Supervisor

TRANSPORTS = ("grpc", "tcp")


@dataclass
class Result:
    payload_mib: float
    shards: int
    transport: str
    """"grpc" (PSClient over gRPC) or "tcp" (the shards' data plane, ps/server/doors/dataplane.py)."""
    gbps: float
    """(push + pull bytes) / median cycle time, GB/s."""
    ratio_to_tcp: float
    """gbps / tcp_gbps."""
    push_gbps: float
    """payload / median push time."""
    pull_gbps: float
    """payload / median pull time."""
    tcp_gbps: float
    """Raw loopback TCP, one way, same payload: median of one transfer right before
    each timed cycle of this row."""
    cycle_ms: float
    """Median push+pull cycle."""
    cycle_ms_min: float
    cycle_ms_max: float
    repeats: int
    warmup: int
    tensors: int
    chunk_mib: float
    message_mib: float
    """gRPC: MiB per streamed message; tcp: MiB per piece frame (--frame-mib) pushed,
    the shard's pull pieces are --message-mib."""
    shard_omp_threads: int
    """OMP_NUM_THREADS given to the shards (0: inherited)."""
    settle_s: float
    """Longest wait for a quiet machine before each cycle."""
    settle_wait_s: float
    """Seconds this row spent waiting for a quiet machine."""


# ---- the sweep -------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = c.parser("python -m bench.ps_datapath", __doc__)
    p.add_argument("--sizes", type=_floats, help="payload sizes in MiB (default 16,64,256)")
    p.add_argument("--shards", type=_ints, help="shard counts (default 1,2,4)")
    p.add_argument("--repeats", type=int, help="timed push+pull cycles per config (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed cycles first (default 1)")
    p.add_argument("--tensors", type=int, default=4, help="tensors the payload is split over")
    p.add_argument(
        "--chunk-mib",
        type=float,
        default=DEFAULT_CHUNK_BYTES / MIB,
        help="plan_slots chunk size: tensors bigger than this are cut into slots (default: "
        "psar.ps.partition's, 4; 64 measured no faster, docs/results.md)",
    )
    p.add_argument(
        "--message-mib",
        type=float,
        default=wire.DEFAULT_MESSAGE_BYTES / MIB,
        help="MiB per streamed gRPC message, client and server (default: psar.ps.wire's, 1; "
        "4 and 8 measured slower)",
    )
    p.add_argument(
        "--transports",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=list(TRANSPORTS),
        help="grpc (PSClient), tcp (the shards' data plane), or both, alternating "
        "(default grpc,tcp)",
    )
    p.add_argument(
        "--frame-mib",
        type=float,
        default=DEFAULT_MAX_FRAME_BYTES / MIB,
        help="tcp: MiB of tensor bytes per pushed piece frame (default: psar.ps.client.tcp_transport's, 4)",
    )
    p.add_argument(
        "--shard-omp-threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for the shard processes (default 0: inherit the environment)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        help="before each timed transfer wait up to this long for the CPUs to be "
        "--settle-idle idle (shared machines; default 20, 0 with --quick)",
    )
    p.add_argument(
        "--settle-budget-s",
        type=float,
        default=600.0,
        help="most seconds spent settling in the whole run (default 600)",
    )
    p.add_argument(
        "--settle-idle",
        type=float,
        default=0.8,
        help="idle fraction of all CPUs that counts as quiet (default 0.8)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    args.sizes = args.sizes or ([1.0] if quick else [16.0, 64.0, 256.0])
    args.shards = args.shards or ([1, 2] if quick else [1, 2, 4])
    args.repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    args.settle_s = args.settle_s if args.settle_s is not None else (0.0 if quick else 20.0)
    if args.repeats < 1 or args.warmup < 0 or args.tensors < 1:
        p.error("--repeats and --tensors must be >= 1, --warmup >= 0")
    if any(s <= 0 for s in args.sizes) or any(n < 1 for n in args.shards):
        p.error("--sizes must be > 0 and --shards >= 1")
    if args.chunk_mib <= 0 or args.message_mib <= 0 or args.frame_mib <= 0:
        p.error("--chunk-mib, --message-mib and --frame-mib must be > 0")
    if not args.transports or set(args.transports) - set(TRANSPORTS):
        p.error(f"--transports: a comma-separated subset of {','.join(TRANSPORTS)}")
    if min(args.settle_s, args.settle_budget_s, args.shard_omp_threads) < 0:
        p.error("--settle-s, --settle-budget-s and --shard-omp-threads must be >= 0")
    if not 0 <= args.settle_idle <= 1:
        p.error("--settle-idle must be in [0, 1]")
    return args


def shards_env(omp_threads: int) -> dict[str, str]:
    """The shards' environment: this one's, with OMP_NUM_THREADS when omp_threads > 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return {**env, "OMP_NUM_THREADS": str(omp_threads)} if omp_threads > 0 else env


def run(args: argparse.Namespace, out: Path, log: Callable[[str], object] = c.log) -> list[Result]:
    message_bytes = int(args.message_mib * MIB)
    frame_bytes = int(args.frame_mib * MIB)
    # The shard refuses message_bytes > max/2; leave room for the piece header.
    max_message_bytes = max(16 << 20, 2 * message_bytes + (1 << 20), frame_bytes)
    chunk_bytes = int(args.chunk_mib * MIB)
    server = ["--message-bytes", str(message_bytes), "--max-message-bytes", str(max_message_bytes)]
    env = shards_env(args.shard_omp_threads)
    results = []
    settle = Settler(args.settle_s, args.settle_idle, args.settle_budget_s)
    with TcpSink() as sink:
        for size in args.sizes:
            payload = int(size * MIB) // 4 * 4
            sink.time_transfers(payload, 1, warmup=args.warmup)  # allocate, warm up
            for shards in args.shards:
                tcp_s: list[float] = []
                waited0 = settle.waited_s

                def before_cycle(timed: bool, payload: int = payload, tcp_s: list = tcp_s) -> None:
                    # Quiet machine first, then one raw TCP transfer of the same payload
                    # right before each PS cycle: both see the same machine state.
                    settle()
                    t = sink.time_transfers(payload, 1, warmup=0)
                    if timed:
                        tcp_s.extend(t)

                # A fresh set of shards per (size, shards): a shard serves one job.
                logs = out / f"{size:g}mib-{shards}shards"
                with Supervisor(logs, env=env, cwd=c.ROOT, grace=5.0) as sup:
                    addresses = c.start_shards(sup, shards, server=server, env=env, timeout=60)
                    times = run_config(
                        addresses,
                        payload_bytes=payload,
                        tensors=args.tensors,
                        chunk_bytes=chunk_bytes,
                        message_bytes=message_bytes,
                        max_message_bytes=max_message_bytes,
                        repeats=args.repeats,
                        warmup=args.warmup,
                        before_cycle=before_cycle,
                        transports=args.transports,
                        frame_bytes=frame_bytes,
                    )
                tcp_gbps = payload / statistics.median(tcp_s) / 1e9
                for transport, (push_s, pull_s) in times.items():
                    r = _result(args, size, shards, transport, payload, tcp_gbps, push_s, pull_s)
                    r.settle_wait_s = round(settle.waited_s - waited0, 2)
                    log(
                        f"  {size:g} MiB x {shards} shards, {transport}: {r.gbps:.2f} GB/s, raw "
                        f"TCP {r.tcp_gbps:.2f} GB/s ({r.ratio_to_tcp:.2f}x)"
                    )
                    results.append(r)
    return results


def _result(
    args: argparse.Namespace,
    size: float,
    shards: int,
    transport: str,
    payload: int,
    tcp_gbps: float,
    push_s: list[float],
    pull_s: list[float],
) -> Result:
    cycles = [a + b for a, b in zip(push_s, pull_s, strict=True)]
    cycle = statistics.median(cycles)
    gbps = 2 * payload / cycle / 1e9
    return Result(
        payload_mib=size,
        shards=shards,
        transport=transport,
        gbps=round(gbps, 4),
        ratio_to_tcp=round(gbps / tcp_gbps, 4),
        push_gbps=round(payload / statistics.median(push_s) / 1e9, 4),
        pull_gbps=round(payload / statistics.median(pull_s) / 1e9, 4),
        tcp_gbps=round(tcp_gbps, 4),
        cycle_ms=round(cycle * 1e3, 3),
        cycle_ms_min=round(min(cycles) * 1e3, 3),
        cycle_ms_max=round(max(cycles) * 1e3, 3),
        repeats=args.repeats,
        warmup=args.warmup,
        tensors=args.tensors,
        chunk_mib=args.chunk_mib,
        message_mib=args.message_mib if transport == "grpc" else args.frame_mib,
        shard_omp_threads=args.shard_omp_threads,
        settle_s=args.settle_s,
        settle_wait_s=0.0,
    )


def table(doc: dict) -> str:
    head = ["payload MiB", "shards", "transport", "push+pull GB/s", "x raw TCP", "push GB/s",
            "pull GB/s", "raw TCP GB/s", "cycle ms, median (min-max)"]  # fmt: skip
    rows = [[r["payload_mib"], r["shards"], r.get("transport", "grpc"), r["gbps"],
             r["ratio_to_tcp"], r.get("push_gbps"), r.get("pull_gbps"), r.get("tcp_gbps"),
             f"{c.fmt(r.get('cycle_ms'))} ({c.fmt(r.get('cycle_ms_min'))}-"
             f"{c.fmt(r.get('cycle_ms_max'))})"] for r in doc["results"]]  # fmt: skip
    r0 = (doc["results"] or [{}])[0]
    return (
        "## PS data path\n\n" + c.md_table(head, rows) + f"\n\nfp32, {r0.get('tensors')} tensors, "
        f"chunk {c.fmt(r0.get('chunk_mib'))} MiB; median of {r0.get('repeats')} cycles after "
        f"{r0.get('warmup')} warm-up; GB/s = (push + pull bytes) / cycle; x raw TCP: over one-way "
        "loopback TCP of the same payload, timed right before each cycle."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    c.install_sigterm()  # SIGTERM unwinds through every supervisor: no orphans
    out = c.out_dir(args, "ps_datapath")
    results = run(args, out)
    doc = {"results": [asdict(r) for r in results]}
    return c.finish(args, out, "ps_datapath", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
