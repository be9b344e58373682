"""psar compare shows each run's progress on the terminal, and every report has one
definition of final loss and a val loss in every row (issue #45 defect 14)."""

from __future__ import annotations

import io
import math

from psar.worker import report
from psar.worker.compare import _ProgressTee
from psar.worker.final_loss import final_loss


def test_final_loss_is_the_mean_of_the_last_ten_finite_losses() -> None:
    assert final_loss([]) is None and final_loss([math.nan]) is None
    assert final_loss([5.0, 1.0, 3.0]) == 3.0  # fewer than ten: the mean of all of them
    losses = [100.0] * 5 + [1.0] * 9 + [math.inf]
    assert final_loss(losses) == 1.0  # the last ten: nine 1.0s and an inf, skipped


def test_rank0_progress_reaches_the_terminal_every_tenth() -> None:
    log, term = io.StringIO(), io.StringIO()
    tee = _ProgressTee(log, term, "ps-sync")
    for step in range(10, 101, 10):
        tee.write(f"[worker0] [##....] step {step}/100 | 9 samples/s | loss {1 / step:.4f}\n")
        tee.write(f"[worker1] [##....] step {step}/100 | 9 samples/s | loss 1.0\n")
    tee.write("[shard0] INFO something\n[worker0] [#] step 5/100 | partial li")
    tee.write("ne\n")
    shown = term.getvalue().splitlines()
    assert shown[0] == "psar compare: ps-sync: step 10/100 | 9 samples/s | loss 0.1000"
    assert len(shown) == 10 and shown[-1].startswith("psar compare: ps-sync: step 100/100")
    assert log.getvalue().count("\n") == 22  # the log keeps every line


def test_every_row_of_a_ddp_report_has_the_jobs_val_loss(tmp_path) -> None:
    """DDP's rank 0 reports for the job: rank 1's row shows the job's val loss, not '-'."""
    s0 = report.RankSeries(path=tmp_path / "a", arch="allreduce", mode="ddp", rank=0)
    s1 = report.RankSeries(path=tmp_path / "b", arch="allreduce", mode="ddp", rank=1)
    for s in (s0, s1):
        s.step, s.loss = [1, 2], [0.5, 0.4]
    md = report.summarize([s0, s1], [{"arch": "allreduce", "mode": "ddp", "rank": 0,
                                      "val_loss": 0.42, "world_size": 2}])  # fmt: skip
    rows = [r for r in md.splitlines() if r.startswith("| allreduce")]
    assert len(rows) == 3 and all("| 0.42 |" in r for r in rows), md
