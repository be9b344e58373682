"""``psar plan``: predict per-step communication and memory for allreduce and PS.

The project CLI dispatches ``psar plan ...`` to :func:`main`; :func:`build_parser` is
exposed so ``--dry-run`` tooling can parse a command line without running it. The
model itself is pure and lives in :mod:`psar.worker.plan_model`; see docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from psar.trainkit.cli_strict import StrictParser
from psar.worker.compare_repeats import positive_int
from psar.worker.plan_command import launch_lines, train_flags
from psar.worker.plan_model import PlanResult, plan
from psar.worker.plan_sparse_cli import add_sparse_flags, render, sparse_inputs, to_dict
from psar.worker.plan_types import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_PS_CPU_RATE,
    DEFAULT_RING_CPU_RATE,
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    ArchPlan,
    PlanInputs,
)
from psar.worker.plan_units import (
    human_bytes,
    human_count,
    human_seconds,
    parse_bandwidth,
    parse_latency,
    parse_params,
    parse_size,
)

__all__ = ["build_parser", "inputs_from_args", "main", "render_table"]


def _flag_type(parse: Callable[[str], object], name: str) -> Callable[[str], object]:
    """Turn a model parser's ValueError into an argparse error that keeps our message.

    argparse replaces a plain ValueError with a generic "invalid value"; raising
    ArgumentTypeError makes it print "argument --flag: <our message>" instead, so the
    user sees the accepted forms.
    """

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = name
    return convert


def _int_at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a whole number >= 0 (0: shards on the worker hosts), got {text!r}"
        )
    return value


def _positive(what: str, example: str) -> Callable[[str], float]:
    """A parser of finite numbers > 0 whose error names what is wanted."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not 0 < value < float("inf"):
            raise ValueError(f"cannot read {text!r}; give {what} as a number > 0, like {example}")
        return value

    return parse


_positive_mib = _positive("MiB", "4 or 0.125")
"""--chunk-mib: MiB as a number > 0 (fractions allowed, like psar train's)."""
_positive_number = _positive("a count or rate", "2 or 1.5")
"""--cpu-cores, --*-cpu-gbps."""


def _milliseconds(text: str) -> float:
    """--compute-ms: a plain non-negative number of milliseconds, stored in seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r}; give milliseconds as a number >= 0, like 120 or 7.5"
        )
    return value / 1e3


def build_parser() -> argparse.ArgumentParser:
    """The ``psar plan`` argument parser (prog="psar plan")."""
    p = StrictParser(
        prog="psar plan",
        description=(
            "Predict per-step communication, step time and memory of ring allreduce (DDP) "
            "and a sharded parameter server for one model, and say which wins. "
            "Alpha-beta model on full-duplex links; see docs/cost-model.md."
        ),
    )
    p.add_argument(
        "--params",
        required=True,
        type=_flag_type(parse_params, "params"),
        help="parameter count: 500M, 1.5B, 7e9, 125k (B = billion here)",
    )
    p.add_argument("--workers", required=True, type=positive_int, help="N workers (>= 1)")
    p.add_argument("--servers", default=1, type=positive_int, help="S PS shards (>= 1; default 1)")
    p.add_argument(
        "--shard-hosts",
        default=None,
        type=_int_at_least_zero,
        metavar="K",
        help="the shards run on K hosts of their own (1 <= K <= S); 0: on the worker hosts, "
        "sharing their NICs (default: one host per shard, K = S)",
    )
    p.add_argument(
        "--bandwidth",
        default="100Gbit/s",
        type=_flag_type(parse_bandwidth, "bandwidth"),
        help="per-NIC bandwidth each way: 100Gbit/s, 25GB/s, 10Gbps, 1.25GiB/s (default 100Gbit/s)",
    )
    p.add_argument(
        "--latency",
        default="5us",
        type=_flag_type(parse_latency, "latency"),
        help="per-message latency: 5us, 0.5ms, 2s, 100ns (default 5us)",
    )
    p.add_argument(
        "--wire-dtype",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="dtype gradients and weights travel in (default fp32)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZER_STATES),
        help="sets the fp32 optimizer state: adamw 2/param, sgd-momentum 1, sgd 0 (default adamw)",
    )
    p.add_argument(
        "--worker-weights",
        default="fp32",
        choices=sorted(DTYPE_BYTES),
        help="dtype of the working weights and gradients on PS workers (default fp32)",
    )
    p.add_argument(
        "--compute-ms",
        type=_milliseconds,
        default=None,
        help="forward+backward time per step in ms; enables step-time predictions",
    )
    p.add_argument(
        "--bucket",
        default=f"{DEFAULT_BUCKET_BYTES // 2**20}MiB",
        type=_flag_type(parse_size, "bucket"),
        help="gradient bucket whose comm cannot overlap compute (default 25MiB, DDP's bucket_cap_mb)",
    )
    p.add_argument(
        "--sync-every",
        default=1,
        type=positive_int,
        metavar="H",
        help="workers synchronise once every H steps (psar train --mode local: local SGD / "
        "DiLoCo); per-step bytes and times are one sync's divided by H (default 1: every step)",
    )
    p.add_argument(
        "--early-pull",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sync PS pipelined: each chunk is pulled back while later ones are pushed, so a "
        "NIC's two directions work at once. Default: what psar train does by default, which "
        "is on wherever a worker has a shard on another host (--shard-hosts >= 1, or more "
        "than one worker), off for one worker with its shards on its own host; "
        "--no-early-pull models push, then pull",
    )
    p.add_argument(
        "--exact-fp16-sum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sync, --wire-dtype fp16: the shards sum each round exactly as pushes arrive "
        "(psar server's default: 12 bytes of round gradient per parameter held, whatever "
        "the number of workers); --no-exact-fp16-sum models psar server --no-exact-fp16-sum "
        "(every worker's push staged in fp32 until the round closes: 4(N+1) bytes)",
    )
    p.add_argument(
        "--chunk-mib",
        default=4.0,
        type=_flag_type(_positive_mib, "chunk-mib"),
        help="--early-pull: the slot size workers push and pull by (psar train --chunk-mib; "
        "default 4): the last chunk's pull waits for its push",
    )
    p.add_argument(
        "--cpu-cores",
        default=None,
        type=_flag_type(_positive_number, "cpu-cores"),
        metavar="C",
        help="model the CPU too: C cores move each host's bytes, at --ps-cpu-gbps and "
        "--allreduce-cpu-gbps per core; a step then waits for the slower of links and cores "
        "(default: links only)",
    )
    p.add_argument(
        "--cpu-shared",
        action="store_true",
        help="with --cpu-cores: every host's processes share those C cores (one machine "
        "emulating the cluster, as bench/links.py's namespaces do)",
    )
    p.add_argument(
        "--ps-cpu-gbps",
        default=DEFAULT_PS_CPU_RATE / 1e9,
        type=_flag_type(_positive_number, "ps-cpu-gbps"),
        help="GB/s one core moves through psar's PS data path, each end counting "
        f"(python -m bench.experiments.cpu_rate; default {DEFAULT_PS_CPU_RATE / 1e9:g}, measured on a "
        "2-core AMD EPYC VM)",
    )
    p.add_argument(
        "--allreduce-cpu-gbps",
        default=DEFAULT_RING_CPU_RATE / 1e9,
        type=_flag_type(_positive_number, "allreduce-cpu-gbps"),
        help=f"GB/s one core moves through gloo's ring allreduce (default "
        f"{DEFAULT_RING_CPU_RATE / 1e9:g}, as above)",
    )
    p.add_argument(
        "--worker-cpu-ms",
        default=0.0,
        type=_milliseconds,
        metavar="W",
        help="with --cpu-shared: CPU ms a worker spends per step besides moving bytes "
        "(forward, backward, optimizer; `python -m bench.experiments.cpu_rate --no-rates --worker-train "
        "FLAGS` measures it on one worker of your workload): a step's compute phase lasts at "
        "least N*W/C (default 0: not counted)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_sparse_flags(p)
    return p


def default_early_pull(args: argparse.Namespace) -> bool:
    """psar train's --early-pull default for the planned layout (ps/client/locality.py: on
    where some shard is on another host than the worker; sync only, not --sync-every)."""
    hosts = args.servers if args.shard_hosts is None else args.shard_hosts  # None: K = S
    remote = hosts > 0 or args.workers > 1
    return remote and args.sync_every == 1


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Map parsed flags onto the model's inputs."""
    return PlanInputs(
        params=args.params,
        workers=args.workers,
        servers=args.servers,
        bandwidth_bytes_per_second=args.bandwidth,
        latency_seconds=args.latency,
        wire_dtype=args.wire_dtype,
        optimizer=args.optimizer,
        worker_weights=args.worker_weights,
        compute_seconds=args.compute_ms,
        bucket_bytes=args.bucket,
        shard_hosts=args.shard_hosts,
        sync_every=args.sync_every,
        early_pull=default_early_pull(args) if args.early_pull is None else args.early_pull,
        chunk_bytes=max(1, int(args.chunk_mib * 2**20)),
        exact_fp16_sum=args.exact_fp16_sum,
        cpu_cores=args.cpu_cores,
        cpu_shared=args.cpu_shared,
        ps_cpu_bytes_per_second=args.ps_cpu_gbps * 1e9,
        allreduce_cpu_bytes_per_second=args.allreduce_cpu_gbps * 1e9,
        worker_cpu_seconds=args.worker_cpu_ms,
    )


def _rate(bytes_per_second: float) -> str:
    """Show a bandwidth both in bits (how links are sold) and bytes (how M is counted)."""
    bits = bytes_per_second * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit} ({human_bytes(bytes_per_second)}/s)"
    return f"{bits:.4g} bit/s ({human_bytes(bytes_per_second)}/s)"


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else human_bytes(n)


_NA = "-"
_BOTTLENECK = {"none": "none", "worker_nic": "worker NIC", "shard_nic": "shard NIC", "cpu": "CPU"}


def _rows(ar: ArchPlan, ps: ArchPlan) -> list[tuple[str, str, str]]:
    """The table body: (label, allreduce cell, ps cell)."""

    def both(
        label: str,
        get: Callable[[ArchPlan], float | None],
        fmt: Callable[[float], str] = human_bytes,
    ) -> tuple[str, str, str]:
        vals = [get(a) for a in (ar, ps)]
        a, p = (_NA if v is None else fmt(v) for v in vals)
        return label, a, p

    assert ps.shard_comm is not None and ps.memory_per_shard is not None
    rows = [
        both("sent per worker per step", lambda a: a.bytes_sent_per_worker_per_step),
        both("received per worker per step", lambda a: a.bytes_received_per_worker_per_step),
        both("received per shard per step", lambda a: a.bytes_received_per_shard_per_step),
        both("sent per shard per step", lambda a: a.bytes_sent_per_shard_per_step),
        both("worker NIC time per step", lambda a: a.worker_comm.seconds, human_seconds),
        ("shard NIC time per step", _NA, human_seconds(ps.shard_comm.seconds)),
        *(
            [both("CPU time per step (bytes moved)", lambda a: a.cpu_seconds, human_seconds)]
            if ar.cpu_seconds or ps.cpu_seconds
            else []
        ),
        both("comm time per step", lambda a: a.comm_seconds_per_step, human_seconds),
        ("bottleneck", _BOTTLENECK[ar.bottleneck], _BOTTLENECK[ps.bottleneck]),
        both("memory per worker", lambda a: a.memory_per_worker.total),
        ("memory per shard", _NA, human_bytes(ps.memory_per_shard.total)),
    ]
    if ar.compute_seconds is not None:
        if ar.workers_cpu_seconds:
            rows.append(
                both(
                    "compute phase (workers' CPU, N*W/C)",
                    lambda a: a.compute_phase_seconds,
                    human_seconds,
                )
            )
        rows += [
            both("exposed tail (last bucket)", lambda a: a.tail_seconds, human_seconds),
            both("step time, no overlap", lambda a: a.step_seconds_no_overlap, human_seconds),
            both("step time, with overlap", lambda a: a.step_seconds_overlap, human_seconds),
        ]
    return rows


def _placement(inp: PlanInputs) -> str:
    k = inp.hosts_of_shards
    if k == 0:
        return "on the worker hosts"
    if k == inp.servers:
        return "on a host of its own" if k == 1 else "each on a host of its own"
    return f"on {k} host{'s' if k != 1 else ''} of their own"


def _bound_line(result: PlanResult) -> str:
    """The BytePS optimum next to the ring, so the reader sees how much a PS could gain."""
    inp = result.inputs
    n, k, bound = inp.workers, inp.hosts_of_shards, result.byteps_bound_seconds
    ring = result.allreduce.worker_comm.bandwidth_seconds
    gain = f"; ring/bound = {ring / bound:.3g}x" if bound > 0 else ""
    return (
        f"BytePS bound, N = {n}, K = {k}: t = 2N(N-1)M / ((N^2 + KN - 2K) B) = "
        f"{human_seconds(bound)} of bandwidth per step (ring {human_seconds(ring)}{gain})"
    )


def render_table(result: PlanResult) -> str:
    """Human-readable report: a header of the inputs, an aligned table, the verdict."""
    inp = result.inputs
    lines = [
        f"psar plan: {human_count(inp.params)} parameters, {inp.workers} workers, "
        f"{inp.servers} PS shard{'s' if inp.servers != 1 else ''} {_placement(inp)}",
        f"  wire {inp.wire_dtype}: M = {human_bytes(inp.wire_bytes)} per worker per step; "
        f"each NIC {_rate(inp.bandwidth_bytes_per_second)} each way (full duplex), "
        f"latency {human_seconds(inp.latency_seconds)}",
        f"  optimizer {inp.optimizer}; PS worker weights {inp.worker_weights}; "
        + (
            f"compute {human_seconds(inp.compute_seconds)} per step; bucket {_size(inp.bucket_bytes)}"
            if inp.compute_seconds is not None
            else "no --compute-ms, so the winner is judged on comm time"
        ),
        *(
            [
                f"  --mode local: one sync every {inp.sync_every} steps; per-step figures are "
                "one sync divided by H (the sync itself is not overlapped)"
            ]  # fmt: skip
            if inp.sync_every > 1
            else []
        ),
        "",
    ]
    header = ("", "allreduce (ring)", f"ps ({inp.servers} shard{'s' if inp.servers != 1 else ''})")
    rows = [header, *_rows(result.allreduce, result.ps)]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = max(len(r[2]) for r in rows)
    for label, a, p in rows:
        lines.append(f"  {label:<{w0}}  {a:>{w1}}  {p:>{w2}}".rstrip())
    # The verdict stays the last line (scripts read it); the bound goes just above it.
    lines += ["", *launch_lines(result), "", _bound_line(result), result.reason]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``psar plan``; bad flags exit 2 through argparse's SystemExit."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        inputs = inputs_from_args(args)
        tables = sparse_inputs(args)  # None without --table-rows: the dense plan alone
    except ValueError as exc:  # flags fine one by one, not together (--shard-hosts > S)
        parser.error(str(exc))
    result = plan(inputs)
    if args.json:
        doc = result.to_dict()
        doc["launch_command"] = [ln.strip() for ln in launch_lines(result)[1:]]
        doc["train_flags"] = train_flags(inputs, result.winner)
        if tables is not None:  # the keys above describe the dense layers alone
            doc["sparse"] = to_dict(inputs, tables)
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(result) if tables is None else render(inputs, tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
