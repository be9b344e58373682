"""The pull-overlap trial (ps/overlap_tuner.py): pure logic, no timing (the step times
are given). Real runs with the trial active are in tests/test_overlap.py."""

from __future__ import annotations

import pytest

from ps.overlap_tuner import PullOverlapTuner


def run(t: PullOverlapTuner, with_s: float, without_s: float, steps: int) -> list[bool]:
    arms = []
    for k in range(steps):
        used = t.arm(k)
        arms.append(used)
        t.record(k, used, with_s if used else without_s)
    return arms


@pytest.mark.parametrize(
    ("with_s", "without_s", "kept"), [(0.025, 0.023, False), (0.018, 0.02, True)]
)
def test_the_faster_arm_is_kept(with_s: float, without_s: float, kept: bool) -> None:
    t = PullOverlapTuner(total_steps=100, trial=6, warmup=3)
    arms = run(t, with_s, without_s, 100)
    assert arms[:3] == [True] * 3  # warm-up
    assert arms[3:9] == [True, False] * 3  # the trial alternates
    assert arms[9:] == [kept] * 91
    assert t.decision is kept
    assert t.median_s(True) == with_s and t.median_s(False) == without_s


def test_decided_once_with_medians_not_means() -> None:
    t = PullOverlapTuner(total_steps=50, trial=6, warmup=0)
    times = {True: [0.02, 0.02, 5.0], False: [0.03, 0.03, 0.03]}  # one huge outlier
    decided = [t.record(k, k % 2 == 0, times[k % 2 == 0][k // 2]) for k in range(6)]
    assert decided == [False] * 5 + [True]
    assert t.decision is True
    assert not t.record(6, True, 1.0) and t.decision is True


@pytest.mark.parametrize(("total", "trial"), [(44, 20), (100, 0), (100, 1)])
def test_short_runs_and_no_trial_keep_the_overlap(total: int, trial: int) -> None:
    t = PullOverlapTuner(total_steps=total, trial=trial)
    assert run(t, 0.05, 0.01, total) == [True] * total
    assert t.decision is None


def test_negative_trial_is_refused() -> None:
    with pytest.raises(ValueError, match="--pull-overlap-trial"):
        PullOverlapTuner(total_steps=10, trial=-1)
