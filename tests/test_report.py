"""``psar report``: report.md table, PNG plots, and the error paths."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from psar.worker import report

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def write_steps(path: Path, arch: str, mode: str, rank: int, n: int, staleness) -> None:
    """A synthetic step file: 8 samples/step, one step per 0.1 s after a 1 s start-up."""
    with path.open("w") as fh:
        for i in range(1, n + 1):
            rec = {
                "step": i,
                "time": 1.0 + 0.1 * i,
                "loss": 2.0 / i,
                "samples": 8 * i,
                "loss_scale": 65536.0,
                "bytes": 1000 * i,
                "staleness": staleness(i),
                "skipped": i == 3,
                "rank": rank,
                "arch": arch,
                "mode": mode,
            }
            fh.write(json.dumps(rec) + "\n")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    write_steps(tmp_path / "steps-ps-rank0.jsonl", "ps", "async", 0, 20, lambda i: i % 5)
    write_steps(tmp_path / "steps-allreduce-rank0.jsonl", "allreduce", "ddp", 0, 10, lambda i: None)
    summary = {
        "arch": "ps",
        "mode": "async",
        "world_size": 2,
        "samples_per_sec": 160.0,
        "final_train_loss": 0.1,
        "val_loss": 0.125,
        "skipped_steps": 1,
        "staleness": {"p50": 2, "p99": 4, "max": 4, "histogram": {"0": 4}},
    }
    (tmp_path / "report-ps-async.json").write_text(json.dumps(summary))
    return tmp_path


def table_rows(md: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in md.splitlines()
        if line.startswith("| ") and not line.startswith("| arch")
    ]


def test_report_table_and_plots(run_dir: Path, capsys):
    assert report.main([str(run_dir)]) == 0
    md = (run_dir / "report.md").read_text()
    assert "## ps / async" in md and "## allreduce / ddp" in md
    rows = {(r[0], r[1], r[2]): r for r in table_rows(md)}
    ps = rows[("ps", "async", "0")]
    # steps, samples/s (8 samples per 0.1 s), final loss, val loss, skipped, staleness.
    assert ps[3] == "20"
    assert math.isclose(float(ps[4]), 80.0)
    # psar's final loss: the mean of the last 10 steps' losses (worker/final_loss.py)
    assert math.isclose(float(ps[5]), round(sum(2.0 / i for i in range(11, 21)) / 10, 4))
    assert ps[6] == "0.125"
    assert ps[7] == "1"
    assert ps[8:] == ["2", "4", "4"]
    ar = rows[("allreduce", "ddp", "0")]
    assert ar[3] == "10" and ar[6] == "-" and ar[8:] == ["-", "-", "-"]
    summary = rows[("ps", "async", "all (n=2)")]
    assert summary[4] == "160" and summary[6] == "0.125"

    out = capsys.readouterr().out
    assert "| ps | async | 0 |" in out and "report.md" in out
    if HAVE_MPL:
        for name in ("loss_vs_time", "loss_vs_samples", "samples_per_sec", "staleness"):
            png = run_dir / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert str(png) in out
    else:
        assert "pip install 'psar[plots]'" in out


def test_no_plots_flag(run_dir: Path):
    assert report.main([str(run_dir), "--no-plots"]) == 0
    assert (run_dir / "report.md").exists()
    assert not list(run_dir.glob("*.png"))


def test_truncated_line_is_tolerated(run_dir: Path):
    with (run_dir / "steps-ps-rank0.jsonl").open("a") as fh:
        fh.write('{"step": 21, "time": 3.')  # a writer killed mid-line
    assert report.main([str(run_dir), "--no-plots"]) == 0
    md = (run_dir / "report.md").read_text()
    assert "1 unparseable line" in md


def test_missing_matplotlib_still_writes_table(run_dir: Path, monkeypatch, capsys):
    def no_mpl(*a, **k):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "write_plots", no_mpl)
    assert report.main([str(run_dir)]) == 0
    assert (run_dir / "report.md").exists()
    assert "pip install 'psar[plots]'" in capsys.readouterr().out


def test_empty_dir_exits_2(tmp_path: Path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no steps-*.jsonl in {tmp_path}; run psar train --run-dir {tmp_path} first" in err
    assert not (tmp_path / "report.md").exists()


def test_missing_dir_exits_2(tmp_path: Path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_parser():
    p = report.build_parser()
    assert p.prog == "psar report"
    assert p.parse_args(["d"]).run_dir == Path("d")


# --- smoothed curves and intervals (issue #19) ----------------------------------------


def test_smooth_losses_is_a_trailing_mean_over_a_twentieth() -> None:
    losses = [float(i % 2) for i in range(100)]  # 0, 1, 0, 1 ...: window 5
    got = report.smooth_losses(losses)
    assert got[0] == 0.0 and got[1] == 0.5
    assert got[-1] == pytest.approx(sum(losses[-5:]) / 5)
    assert report.smooth_losses([1.0, math.inf, 3.0], 2) == [1.0, 1.0, 2.0]
    assert math.isnan(report.smooth_losses([math.nan])[0])


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_loss_plot_draws_raw_faint_and_smoothed_on_top(run_dir: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    calls: list[dict] = []
    real = Axes.plot

    def spy(self, *args, **kw):  # noqa: ANN001, ANN202
        calls.append(kw)
        return real(self, *args, **kw)

    monkeypatch.setattr(Axes, "plot", spy)
    series, _ = report.load_run(run_dir)
    report.write_plots(series, run_dir)
    loss_calls = calls[: 2 * 2 * len(series)]  # two loss plots, raw + smoothed per series
    raw = [k for k in loss_calls if k.get("alpha")]
    smooth = [k for k in loss_calls if "label" in k]
    assert len(raw) == len(smooth) == 2 * len(series)
    assert all(k["alpha"] < 0.5 for k in raw)
    assert all(k["color"] for k in smooth)  # the same colour as its raw curve


def _compare_folder(path: Path, repeats: int) -> Path:
    rows = {
        "allreduce": {"samples_per_sec": 100.0, "samples_per_sec_interval": [100.0, 7.5],
                      "time_to_target_s": 2.0, "time_to_target_s_interval": [2.0, 0.25]},
        "ps-sync": {"samples_per_sec": 90.0, "samples_per_sec_interval": [90.0, None],
                    "time_to_target_s": None, "time_to_target_s_interval": None},
    }  # fmt: skip
    path.mkdir()
    (path / "compare.json").write_text(json.dumps({"runs": rows, "repeats": repeats}))
    (path / "compare.md").write_text("# psar compare\n\n| run | samples/s |\n")
    return path


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_report_on_a_compare_folder_draws_the_intervals(tmp_path: Path, capsys) -> None:
    folder = _compare_folder(tmp_path / "cmp", 3)
    assert report.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert "| run | samples/s |" in out and "intervals.png" in out
    assert (folder / "intervals.png").stat().st_size > 0


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_interval_plot_error_bars_are_the_half_widths(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    bars: list[tuple] = []
    real = Axes.bar

    def spy(self, x, height, *args, **kw):  # noqa: ANN001, ANN202
        bars.append((list(x), list(height), list(kw["yerr"])))
        return real(self, x, height, *args, **kw)

    monkeypatch.setattr(Axes, "bar", spy)
    rows = json.loads((_compare_folder(tmp_path / "c", 3) / "compare.json").read_text())["runs"]
    assert report.write_interval_plot(rows, tmp_path / "i.png", repeats=3) == tmp_path / "i.png"
    assert bars[0] == (["allreduce", "ps-sync"], [100.0, 90.0], [7.5, 0.0])
    assert bars[1] == (["allreduce"], [2.0], [0.25])  # ps-sync never reached the target
    assert report.write_interval_plot({"x": {}}, tmp_path / "none.png", repeats=1) is None


def test_step_logs_of_an_elastic_job_never_overwrite_and_report_reads_them_all(
    tmp_path: Path,
) -> None:
    """Issue #45 defect 10: a joiner given a departed worker's rank writes a file of its
    own (the plain name stays the first worker's); a fixed job keeps the plain name."""
    from psar.worker.records import open_step_file

    names = []
    for n in range(3):
        with open_step_file(str(tmp_path), "ps", 1, exclusive=True) as fh:
            fh.write(json.dumps({"step": 1, "loss": float(n), "rank": 1, "arch": "ps",
                                 "mode": "sync", "samples": 1, "time": 1.0}) + "\n")  # fmt: skip
            names.append(Path(fh.name).name)
    assert names == ["steps-ps-rank1.jsonl", "steps-ps-rank1.1.jsonl", "steps-ps-rank1.2.jsonl"]
    series, _ = report.load_run(tmp_path)
    assert [(s.rank_label, s.loss) for s in series] == [
        ("1", [0.0]),
        ("1.1", [1.0]),
        ("1.2", [2.0]),
    ]
    assert "| 1.2 |" in report.summarize(series, [])
    with open_step_file(str(tmp_path), "ps", 0, exclusive=False) as fh:
        fh.write("x\n")
    with open_step_file(str(tmp_path), "ps", 0, exclusive=False) as fh:  # a rerun replaces
        assert Path(fh.name).name == "steps-ps-rank0.jsonl"
    assert (tmp_path / "steps-ps-rank0.jsonl").read_text() == ""
