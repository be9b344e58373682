"""`psar compare --repeats N`: where each repeat runs, and one row from N repeats' rows.

Repeats run in turn (A B C A B C ...) so a burst of other load on the machine hits every
configuration alike. A configuration's row holds the means, and for samples/s and time to
target the 95% interval as [mean, half-width] (worker/intervals.py); each repeat's own
figures stay in the row under "repeats".
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from psar.worker.intervals import mean_interval

#: Figures of every repeat kept in the row, and those given a 95% interval.
KEPT = (
    "samples_per_sec",
    "time_to_target_s",
    "final_train_loss",
    "val_loss",
    "exit_code",
    "val_logloss",
    "val_auc",
)  # the last two: recsys' (None for other workloads)
INTERVALS = ("samples_per_sec", "time_to_target_s")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def run_dir(out: Path, name: str, rep: int, repeats: int) -> Path:
    """OUT/<run> for a single repeat (as before --repeats), else OUT/<run>/r<i>."""
    return out / name if repeats == 1 else out / name / f"r{rep + 1}"


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the rows of N repeats (their time_to_target_s already set)."""
    if len(reps) == 1:
        return reps[0]
    row: dict[str, Any] = {}
    for key in reps[0]:
        vals = [r.get(key) for r in reps]
        nums = [v for v in vals if isinstance(v, int | float) and not isinstance(v, bool)]
        if key == "exit_code":
            row[key] = max((v for v in vals if v is not None), default=None)
        elif nums and len(nums) == len([v for v in vals if v is not None]):
            got = mean_interval(nums)
            row[key] = None if got is None else got[0]
        else:
            row[key] = vals[-1]
    for key in INTERVALS:
        got = mean_interval(r.get(key) for r in reps)
        row[f"{key}_interval"] = None if got is None else list(got)
    reached = sum(r.get("time_to_target_s") is not None for r in reps)
    row["time_to_target_reached"] = f"{reached}/{len(reps)}"
    row["repeats"] = [{k: r.get(k) for k in KEPT} for r in reps]
    return row


def interval_of(row: dict[str, Any], key: str) -> tuple[float, float | None] | None:
    """The row's (mean, half-width) for key: its interval when repeated, else its value."""
    got = row.get(f"{key}_interval")
    if got is not None:
        return got[0], got[1]
    value = row.get(key)
    return None if value is None else (value, None)
