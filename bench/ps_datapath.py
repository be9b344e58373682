"""PS data path: push + pull of an fp32 payload through 1..N real shards on loopback.

Each shard is a real `psar server` process; the client is ps.client.psclient.PSClient used as a
worker uses it (init with ps.job.Job objects from ps.partition.plan_slots, then
push/pull in a loop, mode async, one worker, so nothing ever waits on a barrier).
Two transports move the same push and pull through the same PSClient calls, cycles
alternating on the same shards: "grpc" (--data-plane grpc) and "tcp", the shards' data
plane (ps/server/dataplane.py; PSClient talks to it with one DataPlaneClient per shard, port
from GetJob, shards in parallel).
Right before every cycle the same script times one raw loopback TCP transfer of the
same payload (bench/baselines.py), so the ratio compares like with like on a noisy
machine; by default it first waits (bounded) for the CPUs to be quiet.

GB/s = (push bytes + pull bytes) / median push+pull cycle time, 1e9 bytes per GB.
ratio_to_tcp = gbps / tcp_gbps, tcp_gbps being one-way raw TCP for the same payload
(median of those transfers). --json prints a list of objects with payload_mib,
shards, transport, gbps and ratio_to_tcp (and push/pull/TCP GB/s, cycle times and the
settings), one per (size, shards, transport).

    python -m bench.ps_datapath                       # 16,64,256 MiB x 1,2,4 shards
    python -m bench.ps_datapath --json --repeats 7
    python -m bench.ps_datapath --quick --json        # CI smoke: 1 MiB, tiny
    python -m bench.ps_datapath --transports tcp      # the data plane only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` and `ps` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.baselines import MIB, TcpSink, readline_with_timeout, stop_process
from ps import wire
from ps.client.psclient import ClientConfig, PSClient
from ps.client.tcp_transport import DEFAULT_MAX_FRAME_BYTES
from ps.job import Job
from ps.partition import DEFAULT_CHUNK_BYTES, plan_slots
from trainkit.optim import OptimizerConfig

_HELLO = "psar server listening on "
TRANSPORTS = ("grpc", "tcp")


@dataclass
class Result:
    payload_mib: float
    shards: int
    transport: str
    """"grpc" (PSClient over gRPC) or "tcp" (the shards' data plane, ps/server/dataplane.py)."""
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


# ---- a shared, noisy machine -----------------------------------------------------------


def cpu_idle_fraction(interval_s: float = 0.25) -> float | None:
    """Fraction of all CPUs idle over `interval_s` (/proc/stat); None where unavailable."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        return f[3] + f[4], sum(f)  # idle + iowait, total

    try:
        i0, t0 = sample()
        time.sleep(interval_s)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (i1 - i0) / max(1, t1 - t0)


class Settler:
    """Before a timed transfer, wait until the CPUs are at least `idle` idle, so it is not
    measured while other jobs hold the cores: at most max_wait_s each time and budget_s
    in all (then it stops waiting), so a busy machine cannot stall the run."""

    def __init__(self, max_wait_s: float, idle: float, budget_s: float) -> None:
        self.max_wait_s, self.idle, self.budget_s = max_wait_s, idle, budget_s
        self.waited_s = 0.0
        self.last_idle: float | None = None

    def __call__(self) -> None:
        limit = min(self.max_wait_s, self.budget_s - self.waited_s)
        if limit <= 0:
            return
        t0 = time.monotonic()
        while True:
            self.last_idle = cpu_idle_fraction()
            if self.last_idle is None or self.last_idle >= self.idle:
                break
            if time.monotonic() - t0 >= limit:
                break
        self.waited_s += time.monotonic() - t0


# ---- shard processes -------------------------------------------------------------------


@contextlib.contextmanager
def shard_processes(
    n: int,
    *,
    message_bytes: int,
    max_message_bytes: int,
    omp_threads: int = 0,
    start_timeout_s: float = 60.0,
) -> Iterator[list[str]]:
    """Start n `psar server` processes on 127.0.0.1:0; yield their addresses; stop them.

    omp_threads > 0 sets OMP_NUM_THREADS (torch's intra-op threads) in the shards.
    """
    env = dict(os.environ)
    if omp_threads > 0:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    procs: list[subprocess.Popen[str]] = []
    try:
        for i in range(n):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "worker.cli",
                        "server",
                        "--bind",
                        "127.0.0.1:0",
                        "--shard",
                        str(i),
                        "--message-bytes",
                        str(message_bytes),
                        "--max-message-bytes",
                        str(max_message_bytes),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    env=env,
                )
            )
        addresses = []
        for p in procs:  # started together, so their start-ups overlap
            line = readline_with_timeout(p, start_timeout_s)
            if not line.startswith(_HELLO):
                raise RuntimeError(f"psar server did not start: {line!r}")
            addresses.append(line[len(_HELLO) :])
        yield addresses
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            stop_process(p)


# ---- one configuration -----------------------------------------------------------------


def tensor_sizes(payload_bytes: int, tensors: int) -> list[int]:
    """fp32 element counts of `tensors` tensors adding up to payload_bytes (equal split)."""
    total = payload_bytes // 4
    if total < tensors:
        raise ValueError(f"payload of {payload_bytes} bytes is too small for {tensors} tensors")
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def run_config(
    addresses: Sequence[str],
    *,
    payload_bytes: int,
    tensors: int,
    chunk_bytes: int,
    message_bytes: int,
    max_message_bytes: int,
    repeats: int,
    warmup: int,
    before_cycle: Callable[[bool], object] | None = None,
    transports: Sequence[str] = ("grpc",),
    frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> dict[str, tuple[list[float], list[float]]]:
    """Push+pull `payload_bytes` through the shards; per transport, (push seconds, pull
    seconds) per repeat. Transports alternate cycle by cycle (A B A B ...).

    before_cycle(timed) runs before every cycle, outside its timing (timed is False
    for the warm-up cycles)."""
    sizes = tensor_sizes(payload_bytes, tensors)
    params = [(f"t{i}", n) for i, n in enumerate(sizes)]
    slots = plan_slots(params, len(addresses), chunk_bytes=chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, generator=gen) for name, n in params}
    # Tiny finite gradients: the shard's SGD step changes the weights a little each push.
    grads_full = {name: torch.randn(n, generator=gen).mul_(1e-6) for name, n in params}
    pulled = {name: torch.empty(n) for name, n in params}

    def views(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {s.key: src[s.param][s.start : s.start + s.numel] for s in slots}

    jobs = [
        Job(
            mode="async",
            num_workers=1,
            optimizer=OptimizerConfig(name="sgd", lr=1e-3, momentum=0.0),
            shard_index=i,
            num_shards=len(addresses),
            slots=[s for s in slots if s.shard == i],
            job_id="bench-ps-datapath",
        )
        for i in range(len(addresses))
    ]
    cfg = ClientConfig(
        message_bytes=message_bytes,
        max_message_bytes=max_message_bytes,
        data_frame_bytes=frame_bytes,
        data_plane="auto",
    )
    # The client a worker uses; cfg.data_plane picks the transport of each cycle.
    with PSClient(addresses, worker=0, cfg=cfg) as client:
        client.set_slots(slots)
        # As ps/client/backend.py does: init (rank 0), read the jobs back (and the lease and
        # data ports), register, and keep the lease alive while we push and pull.
        client.init(jobs, views(weights))
        if client.get_jobs(wait=True) != jobs:
            raise RuntimeError("the shards serve a different job than the one sent")
        if "tcp" in transports and not all(client._data_ports):
            raise RuntimeError("a shard has no data plane (started with --data-port -1?)")
        client.register(clock=0)
        client.start_heartbeats()
        grads, out = views(grads_full), views(pulled)
        headers = client.pull(clock=0, dtype=torch.float32, out=out)
        versions = [h.version for h in headers]
        times: dict[str, tuple[list[float], list[float]]] = {t: ([], []) for t in transports}
        cycles = (warmup + repeats) * len(transports)
        for clock in range(1, cycles + 1):
            transport = transports[(clock - 1) % len(transports)]
            cfg.data_plane = transport
            timed = clock > warmup * len(transports)
            if before_cycle is not None:
                before_cycle(timed)
            t0 = time.perf_counter()
            replies = client.push(
                clock=clock, base_versions=versions, dtype=torch.float32, grads=grads
            )
            t1 = time.perf_counter()
            headers = client.pull(clock=clock, dtype=torch.float32, out=out)
            t2 = time.perf_counter()
            versions = [h.version for h in headers]
            if not all(r.applied for r in replies):
                raise RuntimeError(f"a push was not applied: {replies}")
            if timed:
                times[transport][0].append(t1 - t0)
                times[transport][1].append(t2 - t1)
        if versions != [cycles] * len(addresses):
            raise RuntimeError(f"shards applied {versions} updates, expected {cycles}")
    return times


# ---- the sweep -------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.ps_datapath",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
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
        "ps.partition's, 4; 64 measured no faster, see bench/README.md)",
    )
    p.add_argument(
        "--message-mib",
        type=float,
        default=wire.DEFAULT_MESSAGE_BYTES / MIB,
        help="MiB per streamed gRPC message, client and server (default: ps.wire's, 1; "
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
        help="tcp: MiB of tensor bytes per pushed piece frame (default: ps.client.tcp_transport's, 4)",
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
    p.add_argument(
        "--quick", action="store_true", help="CI smoke: 1 MiB, 1 and 2 shards, 2 repeats"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of results only")
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


def run(args: argparse.Namespace, log: Callable[[str], object] = print) -> list[Result]:
    message_bytes = int(args.message_mib * MIB)
    frame_bytes = int(args.frame_mib * MIB)
    # The shard refuses message_bytes > max/2; leave room for the piece header.
    max_message_bytes = max(16 << 20, 2 * message_bytes + (1 << 20), frame_bytes)
    chunk_bytes = int(args.chunk_mib * MIB)
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

                with shard_processes(
                    shards,
                    message_bytes=message_bytes,
                    max_message_bytes=max_message_bytes,
                    omp_threads=args.shard_omp_threads,
                ) as addresses:
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


def format_table(results: Sequence[Result]) -> str:
    head = (
        f"{'MiB':>6} {'shards':>6} {'GB/s':>7} {'x TCP':>6} {'push':>7} {'pull':>7} "
        f"{'TCP':>7} {'cycle ms':>9}  transport"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.payload_mib:>6g} {r.shards:>6} {r.gbps:>7.2f} {r.ratio_to_tcp:>6.2f} "
            f"{r.push_gbps:>7.2f} {r.pull_gbps:>7.2f} {r.tcp_gbps:>7.2f} {r.cycle_ms:>9.1f}  "
            f"{r.transport}"
        )
    return "\n".join(lines)


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: no orphans


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = run(args, log=log)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(
            f"PS data path, fp32, {args.tensors} tensors, chunk {args.chunk_mib:g} MiB, "
            f"message {args.message_mib:g} MiB (tcp frames {args.frame_mib:g} MiB), median of "
            f"{args.repeats} after "
            f"{args.warmup} warm-up; GB/s = (push + pull bytes) / cycle"
        )
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
