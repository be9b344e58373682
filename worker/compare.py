"""`psar compare`: one workload, seed, global batch and precision under allreduce, ps-sync,
ps-async and ps-ssp, and hybrid-sync where the workload has sparse tables (and, asked for,
ps-local / allreduce-local: local SGD / DiLoCo every --sync-every steps; hybrid-async,
hybrid-ssp), optionally with one emulated straggler; a side-by-side table.

Each run is a `psar launch` job (psar.worker.launch.run_job) writing into OUT/<run>/: the
summaries (report-<rank>.json), the per-step logs (steps-<arch>-rank<R>.jsonl), the
launch log, and `psar report`'s report.md and plots. OUT/compare.json holds the table.
A straggler is emulated with `psar train --slowdown FACTOR` (that worker sleeps FACTOR-1
times its measured compute after each step); see docs/launch.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from psar.trainkit.choices import DEFAULT_MODE, LOCAL_SGD_MODES, MODES, local_sgd
from psar.trainkit.cli_strict import StrictParser
from psar.worker import compare_repeats, report
from psar.worker.final_loss import final_loss
from psar.worker.intervals import format_interval
from psar.worker.launch import LaunchSpec, add_launch_flags, auto_servers, launch, train_flags
from psar.worker.validation import column, extra_names

RUNS: dict[str, tuple[str, str]] = {
    "allreduce": ("allreduce", DEFAULT_MODE),
    **{f"ps-{m}": ("ps", m) for m in MODES},
    **{f"allreduce-{m}": ("allreduce", m) for m in LOCAL_SGD_MODES},
    **{f"hybrid-{m}": ("hybrid", m) for m in MODES if not local_sgd(m)},
}
DEFAULT_RUNS = ("allreduce", "ps-sync", "ps-async", "ps-ssp")
"""What --runs means when not given (plus hybrid-sync where the workload has sparse
tables: default_runs); the local-SGD runs (--sync-every) are asked for."""
TABLE_KEYS = (
    "samples_per_sec",
    "time_to_target_s",
    "final_train_loss",
    "val_loss",
    "staleness_p50",
    "staleness_p99",
    "staleness_max",
    "bytes_per_step",
    "skipped_steps",
)
_OWN = ("--arch", "--mode", "--report", "--run-dir", "--metrics-port")
#: The default workload's size when no --workload-option is given: big enough that the
#: loss curves show a trend above the batch noise (the mlp's own 32-64-64 default on
#: 4096 samples is done in ~1.5 s a run), near a minute for the four runs on a laptop.
DEFAULT_MLP_OPTIONS = ("in_dim=256", "hidden=512", "samples=65536")


def build_parser() -> StrictParser:
    p = StrictParser(
        prog="psar compare",
        description=__doc__.split("\n\n", 1)[0],
        epilog="Any other flag is passed to every `psar train`. Exit code: 0 when every run "
        "finished, 1 when one failed (its row says so), 2 on bad flags, 128+N on signal N.",
    )
    add_launch_flags(p, job=False)
    p.add_argument("--steps", type=int, default=1000, help="steps per worker (default: 1000)")
    p.add_argument("--workload", default="mlp", help="built-in mlp, lm, recsys, or your own "
                   "factory as package.module:function (default: mlp)")  # fmt: skip
    p.add_argument("--precision", default="fp32", help="(default: fp32)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="(default: 0)")
    p.add_argument("--runs", default=None,
                   help=f"subset of {','.join(RUNS)} (default: {','.join(DEFAULT_RUNS)}, and "
                   "hybrid-sync where the workload has sparse tables)")  # fmt: skip
    p.add_argument("--sync-every", type=compare_repeats.positive_int, default=20, metavar="H",
                   help="the *-local runs: psar train --mode local --sync-every H (local SGD / "
                   "DiLoCo; other --outer-* flags pass through to every run) (default: 20)")  # fmt: skip
    p.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                   help="time-to-target threshold (default: 1.05 x the worst final "
                   "smoothed loss among the runs, so every run reaches it)")  # fmt: skip
    p.add_argument("--smooth", type=int, default=10, metavar="STEPS",
                   help="window of the trailing mean of rank 0's loss (default: 10)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="run folder (default: runs/compare-<timestamp>)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="stop a run after this long (default: 600)")  # fmt: skip
    p.add_argument("--repeats", type=compare_repeats.positive_int, default=1, metavar="N",
                   help="run every configuration N times, in turn, and report samples/s and "
                   "time to target as mean ± 95%% interval (default: 1)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print compare.json instead of the table")
    return p


class _ProgressTee:
    """launch.log gets every line of a run; the terminal gets rank 0's progress every
    tenth of the run, labelled, so a run of a minute or two is not silent (issue #45)."""

    STEP = re.compile(r"^\[worker0\] .*\bstep (\d+)/(\d+)")

    def __init__(self, log: TextIO, terminal: TextIO | None, label: str) -> None:
        self.log, self.terminal, self.label, self.partial = log, terminal, label, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        if self.terminal is not None:
            *lines, self.partial = (self.partial + text).split("\n")
            for line in lines:
                if (m := self.STEP.match(line)) and self._shown(int(m[1]), int(m[2])):
                    said = line.split("] ", 2)[-1].strip()
                    print(f"psar compare: {self.label}: {said}", file=self.terminal, flush=True)
        return len(text)

    @staticmethod
    def _shown(step: int, total: int) -> bool:
        return step == total or step % max(1, total // 10) == 0

    def flush(self) -> None:
        self.log.flush()


def run_job(spec: LaunchSpec, run_dir: Path, progress: TextIO | None = None) -> dict[str, Any]:
    """Launch `spec` with its reports and step logs in `run_dir`; returns what it wrote.
    progress: where rank 0's progress goes every tenth of the run (None: the log only)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec.train_args = [*spec.train_args, "--report", str(run_dir / "report-{rank}.json"),
                       "--run-dir", str(run_dir)]  # fmt: skip
    t0 = time.perf_counter()
    with open(run_dir / "launch.log", "w", buffering=1) as log:
        spec.out = spec.err = _ProgressTee(log, progress, run_dir.name)  # type: ignore[assignment]
        code = launch(spec)
    series, summaries = report.load_run(run_dir)
    return {"exit_code": code, "launch_seconds": time.perf_counter() - t0,
            "series": series, "summaries": summaries}  # fmt: skip


def smoothed(losses: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (fewer at the start); non-finite losses skipped."""
    out, buf = [], []
    for v in losses:
        if math.isfinite(v):
            buf = (buf + [v])[-window:]
        out.append(sum(buf) / len(buf) if buf else math.nan)
    return out


def _quantile(ordered: list[int], q: float) -> int:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def metrics(result: dict[str, Any], window: int) -> dict[str, Any]:
    """One row of the table from a run's step logs and summaries (target filled later)."""
    series = result["series"]
    rank0 = next((s for s in series if s.rank == 0), None)
    row: dict[str, Any] = {k: None for k in TABLE_KEYS}
    row.update(exit_code=result["exit_code"], launch_seconds=result["launch_seconds"])
    if rank0 is None:
        return row
    total = sum(s.samples[-1] for s in series if s.samples)
    job_s = max(s.time[-1] for s in series if s.time)
    smooth = smoothed(rank0.loss, window)
    summary0 = next((d for d in result["summaries"] if d.get("rank") == 0), {})
    hist: Counter[int] = Counter()
    for d in result["summaries"]:
        for k, n in ((d.get("staleness") or {}).get("histogram") or {}).items():
            hist[int(k)] += n
    stale = sorted(hist.elements())
    row.update(
        samples_per_sec=total / job_s if job_s > 0 else None,
        samples_per_sec_sum_of_workers=sum(s.samples[-1] / max(s.time[-1], 1e-9) for s in series),
        final_train_loss=final_loss(rank0.loss, window),  # one definition (final_loss.py)
        val_loss=summary0.get("val_loss"),
        staleness_p50=_quantile(stale, 0.5) if stale else None,
        staleness_p99=_quantile(stale, 0.99) if stale else None,
        staleness_max=stale[-1] if stale else None,
        bytes_per_step=sum(_steady_bytes(s) for s in series) / len(series),
        skipped_steps=rank0.skipped,
        job_seconds=job_s,
        steps_rank0=len(rank0.step),
        _time=rank0.time,
        _smooth=smooth,
    )
    # The workload's extra held-out metrics (recsys: val_logloss, val_auc), rank 0's.
    row.update({k: summary0.get(k) for k in extra_names([summary0])})
    if "val_extra_metrics" in summary0:
        row["val_extra_metrics"] = summary0["val_extra_metrics"]
    return row


def _steady_bytes(s: Any) -> float:
    """A worker's bytes per step after its first: a PS worker's first pull (before step 1)
    and DDP's initial broadcast are start-up, not a step's traffic."""
    if len(s.bytes) < 2:
        return s.bytes[-1] / max(1, len(s.step))
    return (s.bytes[-1] - s.bytes[0]) / (len(s.bytes) - 1)


def time_to(row: dict[str, Any], target: float) -> float | None:
    """First step time at which the smoothed rank-0 loss is below `target`."""
    for t, v in zip(row.get("_time") or [], row.get("_smooth") or [], strict=True):
        if v < target:
            return t
    return None


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def table(doc: dict[str, Any]) -> str:
    """The markdown table of compare.json."""
    tgt = doc["target_loss"]
    head = ["run", "samples/s", f"time to loss<{tgt:.4g} (s)", "final train loss",
            "val loss", "staleness p50/p99/max", "bytes/step/worker", "skipped", "exit"]  # fmt: skip
    extra = extra_names(list(doc["runs"].values()))  # recsys: val logloss, val AUC
    head += [column(n) for n in extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in doc["runs"].items():
        stale = "/".join(_fmt(r[k]) for k in ("staleness_p50", "staleness_p99", "staleness_max"))
        cells = [name, format_interval(compare_repeats.interval_of(r, "samples_per_sec")),
                 format_interval(compare_repeats.interval_of(r, "time_to_target_s"), 3),
                 _fmt(r["final_train_loss"]), _fmt(r["val_loss"]), stale,
                 _fmt(r["bytes_per_step"]), _fmt(r["skipped_steps"]), str(r["exit_code"]),
                 *(_fmt(r.get(k)) for k in extra)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    c = doc["config"]
    strag = ", ".join(f"rank {k} x{v:g}" for k, v in c["straggler"].items()) or "none"
    lines.append(
        f"\n{c['workload']}, {c['workers']} workers x batch {c['batch_size']} "
        f"(global {c['workers'] * c['batch_size']}), {c['steps']} steps/worker, "
        f"{c['precision']}, seed {c['seed']}, ps shards {c['servers']}, ssp bound "
        f"{c['staleness']}, straggler: {strag}. Target loss {tgt:.4g} "
        f"({'given' if doc['target_given'] else '1.05 x worst final smoothed loss'}); losses "
        f"are rank 0's, mean of the last {doc['smooth_window']} steps. samples/s: all "
        "workers' samples / job time. bytes/step/worker: what one worker sends plus what it "
        "receives per step, payload only, the same count for both: a PS worker pushes the "
        "gradient once and pulls the weights once; a ring-allreduce rank sends and receives "
        "2(n-1)/n of the gradient each way."
    )
    if doc.get("repeats", 1) > 1:
        lines.append(
            f"Each run {doc['repeats']} times, in turn; samples/s and time to target: mean ± "
            "half-width of the 95% interval (Student's t); the other columns are means."
        )
    return "\n".join(lines)


def default_runs(workload: str, extra: Sequence[str], seed: int) -> tuple[str, ...]:
    """DEFAULT_RUNS, and hybrid-sync where the workload has sparse tables (issue #46):
    the workload is built here on the meta device (its tables take no memory) to see."""
    from psar.trainkit.sparse_tables import marked_tables
    from psar.worker.workloads import load_workload

    given = [v for k, v in zip(extra, extra[1:]) if k == "--workload-option"]  # noqa: B905
    given += [t.split("=", 1)[1] for t in extra if t.startswith("--workload-option=")]
    options = dict(o.split("=", 1) for o in given if "=" in o)
    model = load_workload(workload, seed, options, materialize=False).model
    return (*DEFAULT_RUNS, "hybrid-sync") if marked_tables(model) else DEFAULT_RUNS


def compare(args: argparse.Namespace, extra: list[str]) -> tuple[int, dict[str, Any]]:
    if args.runs is None:
        args.runs = ",".join(default_runs(args.workload, extra, args.seed))
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        raise ValueError(f"--runs: unknown {bad or args.runs!r}; accepted: {', '.join(RUNS)}")
    if own := [t for t in extra if t.split("=", 1)[0] in _OWN]:
        raise ValueError(f"{own[0]} is set by compare for each run")
    out = args.out or Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    train = ["--workload", args.workload, "--steps", str(args.steps), "--precision",
             args.precision, "--batch-size", str(args.batch_size), "--seed", str(args.seed),
             *extra]  # fmt: skip
    if args.workload == "mlp" and not any(t.startswith("--workload-option") for t in extra):
        train += [arg for o in DEFAULT_MLP_OPTIONS for arg in ("--workload-option", o)]
    reps: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    rank0_series = []
    t0 = time.perf_counter()
    code = 0
    jobs = [(rep, name) for rep in range(args.repeats) for name in names]  # A B A B: fair drift
    for i, (rep, name) in enumerate(jobs, 1):
        arch, mode = RUNS[name]
        run_dir = compare_repeats.run_dir(out, name, rep, args.repeats)
        spec = LaunchSpec(arch=arch, mode=mode, servers=args.servers, workers=args.workers,
                          staleness=args.staleness, straggler=dict(args.straggler),
                          timeout=args.timeout, train_args=[*train, *_mode_args(arch, mode, args)])  # fmt: skip
        print(f"psar compare: [{i}/{len(jobs)}] {name} (log: {run_dir / 'launch.log'})",
              file=sys.stderr, flush=True)  # fmt: skip
        result = run_job(spec, run_dir, progress=sys.stderr)
        reps[name].append(metrics(result, args.smooth))
        _plots(run_dir, result)
        if rep == 0:
            rank0_series += [s for s in result["series"] if s.rank == 0]
        c = result["exit_code"]
        print(f"psar compare: {name}: exit {c}, {result['launch_seconds']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        if c:
            tail = (run_dir / "launch.log").read_text(errors="replace").splitlines()[-8:]
            print("\n".join(f"  | {line}" for line in tail), file=sys.stderr, flush=True)
        if c == 2 or c >= 128:  # bad flags (same for every run) or interrupted: stop here
            return c, {"runs": {n: rs[-1] for n, rs in reps.items() if rs}}
        code = code or (1 if c else 0)
    every = [r for rs in reps.values() for r in rs]
    finals = [r["final_train_loss"] for r in every if r["final_train_loss"] is not None]
    target = args.target_loss
    if target is None:
        target = max(finals) + 0.05 * abs(max(finals)) if finals else math.nan
    for r in every:
        r["time_to_target_s"] = time_to(r, target)
        r.pop("_time", None)
        r.pop("_smooth", None)
    rows = {name: compare_repeats.aggregate(rs) for name, rs in reps.items()}
    config = {k: getattr(args, k) for k in ("workload", "steps", "precision", "batch_size",
              "seed", "workers", "servers", "staleness")}  # fmt: skip
    config.update(straggler={str(k): v for k, v in args.straggler}, train_args=extra)
    doc = {"config": config, "target_loss": target, "target_given": args.target_loss is not None,
           "smooth_window": args.smooth, "table_keys": list(TABLE_KEYS), "runs": rows,
           "repeats": args.repeats,
           "machine": f"{platform.machine()}, {_cpus()} CPUs, {platform.platform()}",
           "seconds": time.perf_counter() - t0, "out": str(out)}  # fmt: skip
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "compare.md").write_text(f"# psar compare\n\n{table(doc)}\n")
    if rank0_series:
        _plots(out, {"series": rank0_series, "summaries": []})
    try:
        report.write_interval_plot(rows, out / "intervals.png", repeats=args.repeats)
    except ImportError:
        pass  # matplotlib is optional (psar[plots])
    return code, doc


def _mode_args(arch: str, mode: str, args: argparse.Namespace) -> list[str]:
    """What a run needs beyond launch's flags: --mode local's H."""
    return ["--sync-every", str(args.sync_every)] if local_sgd(mode) else []


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _plots(run_dir: Path, result: dict[str, Any]) -> None:
    """`psar report`'s report.md and plots for one run (or all runs' rank 0 together)."""
    if not result["series"]:
        return
    text = report.summarize(result["series"], result["summaries"])
    (run_dir / "report.md").write_text(f"# psar report: {run_dir.name}\n\n{text}")
    try:
        report.write_plots(result["series"], run_dir)
    except ImportError:
        pass  # matplotlib is optional (psar[plots])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    parser.refuse_unknown(extra, train_flags())
    if args.servers == 0:  # --servers auto
        args.servers = auto_servers(args.workers)
    try:
        code, doc = compare(args, extra)
    except ValueError as e:
        parser.exit(2, f"psar compare: error: {e}\n")
    if "config" not in doc:
        return code
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(table(doc))
        print(f"\nwrote {doc['out']}/compare.json, compare.md, plots; per run: report-*.json, "
              f"steps-*.jsonl, launch.log ({doc['seconds']:.0f} s)")  # fmt: skip
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
