"""Intervals in `psar report`: bars with 95% error bars for the runs of a `psar compare
--repeats N` folder (compare.json rows carry `<key>_interval` = [mean, half-width]), and
`psar report` pointed at such a folder (its table, then intervals.png)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["report_compare", "write_interval_plot"]


def write_interval_plot(rows: dict[str, dict], path: Path, *, repeats: int) -> Path | None:
    """Bars of samples/s and time to target per run with their 95% intervals as error bars
    (`psar compare --repeats N`: rows carry `<key>_interval` = [mean, half-width]); None
    when no run has a figure. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    panels = [("samples_per_sec", "samples/s"), ("time_to_target_s", "time to target (s)")]
    fig = Figure(figsize=(9, 4))
    drawn = False
    for i, (key, label) in enumerate(panels, 1):
        ax = fig.add_subplot(1, 2, i)
        names, means, halves = [], [], []
        for name, row in rows.items():
            got = row.get(f"{key}_interval") or ([row[key], None] if row.get(key) else None)
            if got is None:
                continue
            names.append(name)
            means.append(got[0])
            halves.append(got[1] or 0.0)
        if names:
            drawn = True
            ax.bar(names, means, yerr=halves, capsize=6, color="tab:blue", alpha=0.8)
        ax.set(ylabel=label, title=f"{label}: mean ± 95% interval, {repeats} repeat(s)")
        ax.title.set_fontsize("small")
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    if not drawn:
        return None
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def report_compare(run_dir: Path, *, plots: bool) -> int:
    """A `psar compare` folder: its table, and the runs' intervals drawn (intervals.png)."""
    doc = json.loads((run_dir / "compare.json").read_text(encoding="utf-8"))
    text = (
        (run_dir / "compare.md").read_text(encoding="utf-8")
        if (run_dir / "compare.md").is_file()
        else ""
    )
    print(text.strip() or json.dumps(doc.get("runs", {}), indent=2))
    if plots:
        try:
            path = write_interval_plot(doc.get("runs", {}), run_dir / "intervals.png",
                                       repeats=int(doc.get("repeats", 1)))  # fmt: skip
        except ImportError:
            print("plots skipped: matplotlib not installed (pip install 'psar[plots]')")
            return 0
        if path is not None:
            print(f"wrote:\n  {path}")
    return 0
