"""`psar plan`'s sparse-table flags, verdict and report (docs/cost-model.md, "Sparse
tables"). With `--table-rows` the plan predicts four designs (allreduce_dense,
allreduce_sparse, ps, hybrid) and picks the fastest that fits; the model is
worker/plan_sparse.py. Pure Python: `psar plan --help` loads no torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from psar.worker.plan_sparse import (
    DEFAULT_ROUND_CPU_PS,
    DEFAULT_ROW_CPU_DDP,
    DEFAULT_ROW_CPU_PS_SHARD,
    DEFAULT_ROW_CPU_PS_WORKER,
    SPARSE_OPTIMIZERS,
    SparseArch,
    SparseInputs,
    plan_sparse,
)
from psar.worker.plan_types import DTYPE_BYTES, PlanInputs
from psar.worker.plan_units import SIZE_FORMS, human_bytes, human_seconds, parse_size

ORDER = ("allreduce_dense", "allreduce_sparse", "ps", "hybrid")
#: Ties go to the design that needs the fewest machines and moving parts.
PREFERENCE = ("allreduce_sparse", "allreduce_dense", "hybrid", "ps")


def _count(what: str, low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{what}: give a whole number >= {low}, got {text!r}")
        return value

    return parse


def _rows_list(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(float(t)) if "e" in t.lower() else int(t) for t in text.split(","))
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(
            f"give each table's rows as a whole number >= 1, one or a comma list like "
            f"1000000 or 1000000,100000 or 5e7, got {text!r}"
        )
    return rows


def _number(what: str, low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{what}: give a number in [{low:g}, {high:g}], got {text!r}"
            )
        return value

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (forms: {SIZE_FORMS})") from exc


def add_sparse_flags(p: argparse.ArgumentParser) -> None:
    """The sparse-table flags; without --table-rows the plan is the dense one."""
    g = p.add_argument_group("sparse embedding tables (docs/cost-model.md, Sparse tables)")
    g.add_argument("--table-rows", type=_rows_list, default=None, metavar="R[,R...]",
                   help="rows of each embedding table (one or a comma list): predicts "
                   "allreduce_dense, allreduce_sparse, ps and hybrid; --params is then the "
                   "dense layers only")  # fmt: skip
    g.add_argument(
        "--table-dim",
        type=_count("--table-dim", 1),
        default=64,
        metavar="D",
        help="embedding width (default 64)",
    )
    g.add_argument("--lookups-per-sample", "--bag", dest="bag", metavar="L", default=4,
                   type=_count("--lookups-per-sample", 1),
                   help="ids per sample per table (the bag; default 4)")  # fmt: skip
    g.add_argument(
        "--batch",
        type=_count("--batch", 1),
        default=4096,
        metavar="B",
        help="samples per worker per step (default 4096)",
    )
    g.add_argument("--zipf", type=_number("--zipf", 0.0, 10.0), default=1.05, metavar="S",
                   help="Zipf exponent of id popularity, 0 (uniform) to 10 (default 1.05, "
                   "the recsys workload's)")  # fmt: skip
    g.add_argument("--touched-rows", type=_number("--touched-rows", 0.0, 1e15), metavar="U", default=None,
                   help="distinct rows one worker touches per step, all tables together "
                   "(default: expected from batch x bag draws under --zipf)")  # fmt: skip
    g.add_argument("--worker-mem", type=_size, default=None, metavar="SIZE",
                   help="memory of one worker for the model: a design that needs more does "
                   "not fit (25GiB, 12GB; default: not checked; the shards' need is printed, not checked)")  # fmt: skip
    g.add_argument(
        "--sparse-wire-dtype",
        choices=sorted(DTYPE_BYTES),
        default="fp16",
        help="row gradients on the wire (psar train's default fp16)",
    )
    g.add_argument(
        "--sparse-optimizer",
        choices=SPARSE_OPTIMIZERS,
        default="sgd",
        help="the tables' optimizer (psar train's; default sgd)",
    )
    for flag, default, who in (
        ("--row-cpu-ps-worker-us", DEFAULT_ROW_CPU_PS_WORKER, "a PS or hybrid worker's per touched row"),
        ("--row-cpu-ps-shard-us", DEFAULT_ROW_CPU_PS_SHARD, "a shard's per row a worker pulls and pushes"),
        ("--row-cpu-ddp-us", DEFAULT_ROW_CPU_DDP, "a DDP-sparse rank's per row of the union it applies beyond its own"),
        ("--round-cpu-ps-us", DEFAULT_ROUND_CPU_PS, "--arch ps's dense round, per worker per shard per step (hybrid has none)"),
    ):  # fmt: skip
        g.add_argument(flag, type=_number(flag, 0.0, 1e6), default=default * 1e6, metavar="US",
                       help=f"with --cpu-cores: CPU us {who}, beyond its bytes and --worker-cpu-ms "
                       f"(default {default * 1e6:g}, from measurement on a 2-core EPYC: "
                       "docs/cost-model.md, Sparse tables)")  # fmt: skip


def sparse_inputs(args: argparse.Namespace) -> SparseInputs | None:
    """The tables' inputs (None without --table-rows); ValueError names a flag the sparse
    model does not take."""
    if args.table_rows is None:
        return None
    if args.sync_every != 1:  # rows move every step; psar train --arch hybrid refuses --mode local
        raise ValueError(
            f"--sync-every {args.sync_every}: not modelled with --table-rows (rows are pulled "
            "and pushed every step); accepted: 1"
        )
    return SparseInputs(
        table_rows=args.table_rows, dim=args.table_dim, bag=args.bag, batch=args.batch,
        zipf=args.zipf, touched_rows=args.touched_rows, worker_mem_bytes=args.worker_mem,
        sparse_wire_dtype=args.sparse_wire_dtype, sparse_optimizer=args.sparse_optimizer,
        row_cpu_ps_worker=args.row_cpu_ps_worker_us / 1e6,
        row_cpu_ps_shard=args.row_cpu_ps_shard_us / 1e6, row_cpu_ddp=args.row_cpu_ddp_us / 1e6,
        round_cpu_ps=args.round_cpu_ps_us / 1e6,
    )  # fmt: skip


def _against(best: SparseArch, runner: SparseArch) -> str:
    """The term that separates the winner from the runner-up: the cores' time for the
    bytes and rows, the links' time, or (both equal) the last bucket nothing hides."""
    d_cpu = runner.cpu_seconds - best.cpu_seconds
    d_link = runner.link.seconds - best.link.seconds
    if runner.score <= best.score * (1 + 1e-12):
        return f"it ties {runner.name} and needs fewer moving parts"
    if (best.name, runner.name) == ("hybrid", "ps") and d_link >= d_cpu:
        return (f"both move the same rows, but ps also pushes the dense part to the shards and "
                f"pulls it back ({human_seconds(runner.link.seconds)} on the links) where "
                f"hybrid's ring runs while the rows are pushed ({human_seconds(best.link.seconds)})")  # fmt: skip
    if d_cpu >= d_link and d_cpu > 0:
        return (f"the cores bound the communication: {runner.name}'s bytes and rows take "
                f"{human_seconds(runner.cpu_seconds)} of them against {human_seconds(best.cpu_seconds)}"
                f" (links {human_seconds(runner.link.seconds)} and {human_seconds(best.link.seconds)})")  # fmt: skip
    return (f"{runner.name} needs {human_seconds(runner.link.seconds)} on the links (a worker sends "
            f"{human_bytes(runner.bytes_sent_per_worker_per_step)}) against "
            f"{human_seconds(best.link.seconds)} ({human_bytes(best.bytes_sent_per_worker_per_step)})")  # fmt: skip


def choose(
    archs: dict[str, SparseArch], inp: PlanInputs, sp: SparseInputs
) -> tuple[str | None, str]:
    """The fastest design that fits, and why."""
    fit = [a for a in archs.values() if a.fits]
    judged = "a step" if inp.compute_seconds is not None else "communication per step"
    if not fit:
        need = min(archs.values(), key=lambda a: a.memory_per_worker.total)
        return None, (f"nothing fits: the leanest worker ({need.name}) needs "
                      f"{human_bytes(need.memory_per_worker.total)}, more than --worker-mem "
                      f"{human_bytes(sp.worker_mem_bytes or 0)}.")  # fmt: skip
    best = min(fit, key=lambda a: (a.score, PREFERENCE.index(a.name)))
    others = sorted((a for a in fit if a is not best), key=lambda a: a.score)
    vs = ", ".join(f"{a.name} {human_seconds(a.score)}" for a in others)
    why = [f"{best.name} wins: {human_seconds(best.score)} of {judged}"
           + (f" against {vs}" if vs else "")]  # fmt: skip
    if others:
        why.append(_against(best, others[0]))
    if best.workers_cpu_seconds:
        why.append(f"every design first spends N*W/C = {human_seconds(best.workers_cpu_seconds)} "
                   "of the shared cores on the workers' own compute")  # fmt: skip
    dropped = [a for a in archs.values() if not a.fits]
    for a in dropped:
        why.append(f"{a.name} does not fit: a worker needs {human_bytes(a.memory_per_worker.total)}"
                   f" > --worker-mem {human_bytes(sp.worker_mem_bytes or 0)}")  # fmt: skip
    if others and best.score > 0 and (others[0].score - best.score) / best.score < 0.05:
        why.append(f"within 5% of {others[0].name}: treat it as a tie")
    return best.name, "; ".join(why) + "."


def to_dict(inp: PlanInputs, sp: SparseInputs) -> dict[str, object]:
    """The `sparse` object of `psar plan --json`."""
    archs = plan_sparse(inp, sp)
    winner, reason = choose(archs, inp, sp)
    u, u_all = sp.touched(inp.workers)
    samples = inp.workers * sp.batch
    return {
        **{name: archs[name].to_dict(samples) for name in ORDER},
        "winner": winner,
        "reason": reason,
        "touched_rows_per_worker_per_step": u,
        "touched_rows_all_workers_per_step": u_all,
        "table_bytes_fp32": sp.elements * 4,
        "inputs": {
            "table_rows": list(sp.table_rows), "table_dim": sp.dim, "lookups_per_sample": sp.bag,
            "batch": sp.batch, "zipf": sp.zipf, "touched_rows": sp.touched_rows,
            "worker_mem_bytes": sp.worker_mem_bytes, "sparse_wire_dtype": sp.sparse_wire_dtype,
            "sparse_optimizer": sp.sparse_optimizer, "row_cpu_ps_worker_seconds": sp.row_cpu_ps_worker,
            "row_cpu_ps_shard_seconds": sp.row_cpu_ps_shard, "row_cpu_ddp_seconds": sp.row_cpu_ddp,
            "round_cpu_ps_seconds": sp.round_cpu_ps,
        },
    }  # fmt: skip


def render(inp: PlanInputs, sp: SparseInputs) -> str:
    """The report: inputs, one column per design, the verdict last (scripts read it)."""
    archs = plan_sparse(inp, sp)
    winner, reason = choose(archs, inp, sp)
    u, u_all = sp.touched(inp.workers)
    samples = inp.workers * sp.batch

    def row(label: str, get: Callable[[SparseArch], object]) -> list[str]:
        return [label, *(str(get(archs[n])) for n in ORDER)]

    def secs(x: float | None) -> str:
        return "-" if x is None else human_seconds(x)

    rows = [
        ["", *ORDER],
        row("sent per worker per step", lambda a: human_bytes(a.bytes_sent_per_worker_per_step)),
        row("received per worker per step", lambda a: human_bytes(a.bytes_received_per_worker_per_step)),
        row("link time per step", lambda a: secs(a.link.seconds)),
        row("CPU time per step (bytes, rows)", lambda a: secs(a.cpu_seconds)),
        row("memory per worker", lambda a: human_bytes(a.memory_per_worker.total)),
        row("memory per shard", lambda a: "-" if a.memory_per_shard is None else human_bytes(a.memory_per_shard.total)),
        row("fits --worker-mem", lambda a: "yes" if a.fits else "NO"),
    ]  # fmt: skip
    if inp.compute_seconds is not None:
        rows.append(row("step time", lambda a: secs(a.step_seconds)))
        rows.append(row("samples/s (all workers)",
                        lambda a: f"{samples / a.step_seconds:,.0f}" if a.step_seconds else "-"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    tables = ", ".join(f"{r:,}" for r in sp.table_rows)
    lines = [
        f"psar plan, sparse tables: rows {tables} x {sp.dim}; {inp.params:,} dense parameters; "
        f"{inp.workers} workers, {inp.servers} shard{'s' if inp.servers != 1 else ''}",
        f"  touched rows per step: {u:,.0f} per worker, {u_all:,.0f} all workers "
        + ("(given)" if sp.touched_rows is not None
           else f"(batch {sp.batch} x bag {sp.bag} Zipf({sp.zipf:g}) draws per table)"),
        "",
        *("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
          for r in rows),
        "",
        reason,
    ]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)
