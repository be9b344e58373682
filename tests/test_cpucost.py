"""bench/lib/cpucost.py's worker_cpu_seconds: the differencing of two run lengths, with
the runs replaced by a model of their CPU (start-up plus a per-step cost plus noise)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lib import cpucost


def _model(monkeypatch: pytest.MonkeyPatch, per_step: float, noise: Iterator[float]) -> list[int]:
    """Each run costs 3 s of start-up + per_step x steps + the next noise; returns the
    lengths run, in order."""
    runs: list[int] = []
    total = [0.0]

    def job(out: Path, *, workers: int, py_args: list[str], timeout: float) -> None:
        n = int(py_args[py_args.index("--steps") + 1])
        runs.append(n)
        total[0] += 3.0 + per_step * n + next(noise)

    monkeypatch.setattr(cpucost.c, "ddp_job", job)
    monkeypatch.setattr(cpucost, "_children_cpu_s", lambda: total[0])
    return runs


def test_a_first_difference_inflated_by_start_up_noise_is_redone_until_it_stands_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # CI's slow run: a 1 ms step, the 40-step run 1.5 s noisier than the 10-step one.
    # The redo sized from that (50 ms a step: about 70 steps) was lost in noise too and the
    # result read 0; now it keeps going, at least twice as long each time.
    runs = _model(monkeypatch, 1e-3, iter([0.0, 1.5, -0.1, 0.0, 0.0, 0.0, 0.0]))
    per = cpucost.worker_cpu_seconds(tmp_path, ["--workload", "mlp"], steps=(10, 40))
    assert runs[:2] == [10, 40] and len(runs) > 3
    assert runs[-1] > runs[-2] and per == pytest.approx(1e-3, rel=0.05)


def test_a_step_that_never_stands_out_is_an_error_not_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _model(monkeypatch, 0.0, iter([0.5] + [0.0] * 10))
    with pytest.raises(RuntimeError, match="did not stand out of 10 steps'"):
        cpucost.worker_cpu_seconds(tmp_path, [], steps=(10, 40), max_steps=500)
