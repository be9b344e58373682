"""``psar report RUN_DIR``: tables and plots from a finished (or running) training run.

Input contract (written by the training loop):

* ``RUN_DIR/steps-<arch>-rank<R>.jsonl`` (in an elastic job, where a later worker may be
  given a departed one's rank, also ``steps-<arch>-rank<R>.<n>.jsonl``, n = 1, 2, ...: one
  file per worker, never overwritten) -- one JSON object per step with keys ``step``,
  ``time`` (s since the run's start), ``loss``, ``samples`` (cumulative), ``loss_scale``,
  ``bytes`` (cumulative: ``bytes_sent`` + ``bytes_received``, what this worker put on
  and took off the wire, counted alike for both architectures), ``staleness`` (int or null), ``skipped``, ``rank``, ``arch``,
  ``mode``.
* optional ``RUN_DIR/report-*.json`` summaries (``arch``, ``mode``, ``world_size``,
  ``samples_per_sec``, ``final_train_loss``, ``val_loss``, ``skipped_steps``,
  ``staleness`` = ``{p50, p99, max, histogram}``, ``workers_took_part``: workers that pushed
  at least one gradient, or null on a PS rank that does not ask the shards; and where the
  workload has extra held-out metrics, ``val_extra_metrics``, their names, each a key too:
  recsys' ``val_logloss``, ``val_auc``, a column each).

Output, into ``RUN_DIR``: ``report.md`` (a table per run, i.e. per (arch, mode)) and,
when matplotlib is installed (``pip install 'psar[plots]'``), PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from psar.trainkit.cli_strict import StrictParser
from psar.worker.final_loss import final_loss
from psar.worker.report_intervals import report_compare, write_interval_plot
from psar.worker.validation import column, extra_names

__all__ = [
    "RankSeries",
    "build_parser",
    "load_run",
    "main",
    "smooth_losses",
    "summarize",
    "write_interval_plot",
    "write_plots",
]

#: Steps in the sliding window of the samples/s-over-time plot: one step is too noisy
#: (a barrier stall reads as zero throughput), the whole run hides slowdowns.
RATE_WINDOW = 10


def smooth_losses(losses: Sequence[float], window: int | None = None) -> list[float]:
    """Trailing mean of the finite losses over `window` steps (default: a twentieth of
    the run, 1 to 50 steps), so a curve shows the trend under per-batch noise."""
    if window is None:
        window = max(1, min(50, len(losses) // 20))
    out: list[float] = []
    buf: list[float] = []
    for v in losses:
        if math.isfinite(v):
            buf = (buf + [v])[-window:]
        out.append(sum(buf) / len(buf) if buf else math.nan)
    return out


@dataclass
class RankSeries:
    """The step records of one ``steps-*.jsonl`` file, column by column."""

    path: Path
    arch: str
    mode: str
    rank: int
    step: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    loss_scale: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    skipped: int = 0
    bad_lines: int = 0
    instance: int = 0
    """n of ``steps-<arch>-rank<R>.<n>.jsonl``: the rank's n+1-th worker (elastic jobs)."""

    @property
    def rank_label(self) -> str:
        """The rank, and which of its workers where several held it (``1.2``)."""
        return f"{self.rank}.{self.instance}" if self.instance else str(self.rank)

    @property
    def label(self) -> str:
        return f"{self.arch}/{self.mode} rank {self.rank_label}"

    def samples_per_sec(self) -> float | None:
        """Steady-state rate between the first and last step (excludes start-up time)."""
        if len(self.time) >= 2 and self.time[-1] > self.time[0]:
            return (self.samples[-1] - self.samples[0]) / (self.time[-1] - self.time[0])
        if self.time and self.time[-1] > 0:
            return self.samples[-1] / self.time[-1]
        return None

    def final_loss(self) -> float | None:
        """psar's final loss (worker/records.py final_loss): the mean of the last 10 finite
        step losses (skipped steps may be NaN/Inf)."""
        return final_loss(self.loss)


def _float(v: object) -> float:
    """JSON number (or null) as a float; NaN for anything missing."""
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _load_steps(path: Path) -> RankSeries | None:
    """Parse one step file; a truncated last line (run still writing) is skipped, not fatal."""
    # Filename fallbacks: steps-<arch>-rank<R>.jsonl, in case records lack the keys.
    stem = path.name.removeprefix("steps-").removesuffix(".jsonl")
    arch_fn, _, rank_fn = stem.rpartition("-rank")
    rank_fn, _, nth = rank_fn.partition(".")  # steps-<arch>-rank<R>.<n>: a later worker of R
    series: RankSeries | None = None
    bad = 0
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
                stale = rec.get("staleness")
                stale = None if stale is None else int(stale)
                rank = rec.get("rank")
                rank = int(rank) if rank is not None else int(rank_fn) if rank_fn.isdigit() else -1
                step = int(rec.get("step") or 0)
            except (TypeError, ValueError):
                bad += 1
                continue
            if series is None:
                series = RankSeries(
                    path=path,
                    arch=str(rec.get("arch") or arch_fn or "?"),
                    mode=str(rec.get("mode") or "?"),
                    rank=rank,
                    instance=int(nth) if nth.isdigit() else 0,
                )
            series.step.append(step or len(series.step) + 1)
            series.time.append(_float(rec.get("time")))
            series.loss.append(_float(rec.get("loss")))
            series.samples.append(_float(rec.get("samples")))
            series.loss_scale.append(_float(rec.get("loss_scale")))
            series.bytes.append(_float(rec.get("bytes")))
            if stale is not None:
                series.staleness.append(stale)
            series.skipped += bool(rec.get("skipped"))
    if series is not None:
        series.bad_lines = bad
    return series


def load_run(run_dir: Path) -> tuple[list[RankSeries], list[dict]]:
    """All step series (sorted by arch, mode, rank) and summary dicts of ``run_dir``."""
    series = [s for p in sorted(run_dir.glob("steps-*.jsonl")) if (s := _load_steps(p))]
    series.sort(key=lambda s: (s.arch, s.mode, s.rank, s.instance))
    summaries = []
    for p in sorted(run_dir.glob("report-*.json")):
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            print(f"psar report: skipping {p.name}: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            data.setdefault("_file", p.name)
            summaries.append(data)
    return series, summaries


def _quantile(sorted_vals: Sequence[int], q: float) -> int:
    """Nearest-rank quantile (an observed staleness, not an interpolated one)."""
    idx = max(0, math.ceil(q * len(sorted_vals)) - 1)
    return sorted_vals[idx]


def _fmt(v: object, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.1f}"
    return str(v)


HEADER = (
    "arch",
    "mode",
    "rank",
    "steps",
    "samples/s",
    "final loss",
    "val loss",
    "skipped",
    "staleness p50",
    "staleness p99",
    "staleness max",
)


def _row(s: RankSeries, val_loss: object, extra: Sequence[object] = ()) -> list[str]:
    st = sorted(s.staleness)
    stale = [_quantile(st, 0.5), _quantile(st, 0.99), st[-1]] if st else [None] * 3
    return [
        s.arch,
        s.mode,
        s.rank_label,
        str(len(s.step)),
        _fmt(s.samples_per_sec(), 6),
        _fmt(s.final_loss()),
        _fmt(val_loss),
        str(s.skipped),
        *(_fmt(v) for v in stale),
        *(_fmt(v) for v in extra),
    ]


def _summary_row(d: dict, extra: Sequence[str] = ()) -> list[str]:
    stale = d.get("staleness") or {}
    label = "all" + (f" (n={d['world_size']})" if d.get("world_size") is not None else "")
    return [
        str(d.get("arch", "?")),
        str(d.get("mode", "?")),
        label,
        "-",
        _fmt(d.get("samples_per_sec"), 6),
        _fmt(d.get("final_train_loss")),
        _fmt(d.get("val_loss")),
        _fmt(d.get("skipped_steps")),
        *(_fmt(stale.get(k)) for k in ("p50", "p99", "max")),
        *(_fmt(d.get(k)) for k in extra),
    ]


def _table(rows: list[list[str]], extra: Sequence[str] = ()) -> str:
    header = (*HEADER, *(column(n) for n in extra))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summarize(series: list[RankSeries], summaries: list[dict]) -> str:
    """Markdown: one section and table per run (arch, mode); a row per rank, plus an
    ``all`` row per summary file of that run."""
    runs: dict[tuple[str, str], list[RankSeries]] = {}
    for s in series:
        runs.setdefault((s.arch, s.mode), []).append(s)
    for d in summaries:
        runs.setdefault((str(d.get("arch", "?")), str(d.get("mode", "?"))), [])
    parts = []
    for (arch, mode), ranks in runs.items():
        mine = [d for d in summaries if (str(d.get("arch")), str(d.get("mode"))) == (arch, mode)]

        extra = extra_names(mine)

        def val(rank: int, key: str, mine: list[dict] = mine) -> object:
            # A summary may be per rank (has "rank") or per run (applies to every rank);
            # a rank that wrote none (DDP: rank 0 reports for the job, every rank holding
            # the same model) shows the job's, so every row has a val loss.
            for d in mine:
                if d.get("rank") in (None, rank):
                    return d.get(key)
            return next((d.get(key) for d in mine if d.get("rank") == 0), None)

        rows = [_row(s, val(s.rank, "val_loss"), [val(s.rank, k) for k in extra]) for s in ranks]
        rows += [_summary_row(d, extra) for d in mine]
        parts.append(f"## {arch} / {mode}\n\n{_table(rows, extra)}\n")
        if bad := sum(s.bad_lines for s in ranks):
            parts.append(f"_{bad} unparseable line(s) skipped (truncated while writing?)._\n")
    return "\n".join(parts)


def _rate_over_time(s: RankSeries) -> tuple[list[float], list[float]]:
    """Samples/s over a sliding window of :data:`RATE_WINDOW` steps."""
    xs, ys = [], []
    for i in range(1, len(s.time)):
        j = max(0, i - RATE_WINDOW)
        dt = s.time[i] - s.time[j]
        if dt > 0:
            xs.append(s.time[i])
            ys.append((s.samples[i] - s.samples[j]) / dt)
    return xs, ys


def write_plots(series: list[RankSeries], out_dir: Path) -> list[Path]:
    """PNG plots, one line per step file; raises ImportError without matplotlib."""
    # The object API (no pyplot): no global figure state and no GUI backend pick-up.
    from matplotlib.figure import Figure

    def finite(vals: list[float]) -> list[float]:
        return [v if math.isfinite(v) else math.nan for v in vals]

    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        for ax in fig.axes:
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        written.append(path)

    for name, xattr, xlabel in (
        ("loss_vs_time.png", "time", "time since start (s)"),
        ("loss_vs_samples.png", "samples", "samples processed (per worker)"),
    ):
        fig = Figure(figsize=(8, 5))
        ax = fig.add_subplot()
        for s in series:
            # Raw per-step losses faint behind, the trailing mean in the same colour on top.
            (raw,) = ax.plot(getattr(s, xattr), finite(s.loss), linewidth=0.6, alpha=0.25)
            ax.plot(getattr(s, xattr), smooth_losses(s.loss), label=s.label, linewidth=1.5,
                    color=raw.get_color())  # fmt: skip
        ax.set(
            xlabel=xlabel,
            ylabel="training loss (raw faint, trailing mean solid)",
            title=f"loss vs {xattr}",
        )
        if all(v > 0 for s in series for v in s.loss if math.isfinite(v)):
            ax.set_yscale("log")
        save(fig, name)

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for s in series:
        ax.plot(*_rate_over_time(s), label=s.label, linewidth=1)
    ax.set(
        xlabel="time since start (s)",
        ylabel="samples/s",
        title=f"throughput ({RATE_WINDOW}-step window)",
    )
    save(fig, "samples_per_sec.png")

    # Staleness only exists in PS modes; an all-allreduce run gets no empty plot.
    stale = [s for s in series if s.staleness]
    if stale:
        fig = Figure(figsize=(8, 5))
        ax = fig.add_subplot()
        top = max(max(s.staleness) for s in stale)
        bins = [b - 0.5 for b in range(top + 2)]
        ax.hist(
            [s.staleness for s in stale],
            bins=bins,
            label=[s.label for s in stale],
            density=True,
        )
        ax.set(xlabel="staleness (versions)", ylabel="fraction of steps", title="staleness")
        save(fig, "staleness.png")
    return written


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``psar report``."""
    p = StrictParser(
        prog="psar report",
        description="Summarize a run directory written by `psar train --run-dir DIR`: "
        "report.md with a table per run, and PNG plots (needs psar[plots]).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="directory of steps-*.jsonl")
    p.add_argument("--no-plots", action="store_true", help="write report.md only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``psar report``; returns the exit status (0 ok, 2 nothing to report)."""
    args = build_parser().parse_args(argv)
    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        print(f"psar report: error: {run_dir} is not a directory", file=sys.stderr)
        return 2
    series, summaries = load_run(run_dir)
    if not series and (run_dir / "compare.json").is_file():
        return report_compare(run_dir, plots=not args.no_plots)
    if not series:
        print(
            f"psar report: error: no steps-*.jsonl in {run_dir}; "
            f"run psar train --run-dir {run_dir} first",
            file=sys.stderr,
        )
        return 2

    table = summarize(series, summaries)
    report = run_dir / "report.md"
    report.write_text(f"# psar report: {run_dir.name}\n\n{table}", encoding="utf-8")
    written = [report]
    print(table)

    if not args.no_plots:
        try:
            written += write_plots(series, run_dir)
        except ImportError:
            print("plots skipped: matplotlib not installed (pip install 'psar[plots]')")
    print("wrote:")
    for p in written:
        print(f"  {p}")
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m psar.worker.report DIR`
    raise SystemExit(main())
