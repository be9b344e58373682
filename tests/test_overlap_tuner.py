"""The overlap trial (ps/client/overlap_tuner.py): pure logic, no timing (the step times are
given). Real runs with the trial active are in tests/test_overlap.py."""

from __future__ import annotations

import pytest

from psar.ps.client.overlap_tuner import OverlapTuner

BOTH, PUSH, NONE = (True, True), (True, False), (False, False)
ARMS = [BOTH, PUSH, NONE]


def run(t: OverlapTuner, seconds: dict, steps: int) -> list:
    used = []
    for k in range(steps):
        arm = t.arm(k)
        used.append(arm)
        t.record(k, arm, seconds[arm])
    return used


@pytest.mark.parametrize("fastest", ARMS)
def test_the_fastest_arm_is_kept(fastest: tuple) -> None:
    seconds = {a: 0.020 if a == fastest else 0.025 for a in ARMS}
    t = OverlapTuner(total_steps=100, trial=9, arms=ARMS, warmup=3)
    used = run(t, seconds, 100)
    assert used[:3] == [BOTH] * 3  # warm-up runs the configured arm
    assert used[3:12] == ARMS * 3  # the trial cycles through the arms
    assert used[12:] == [fastest] * 88
    assert t.decision == fastest
    assert "kept: " in t.summary() and "--overlap-trial" in t.summary()


def test_blocks_twice_over_their_first_steps_left_out() -> None:
    # 30 steps, 3 arms: blocks of 5, twice over; 4 counted steps per block, 8 per arm.
    t = OverlapTuner(total_steps=100, trial=30, arms=ARMS, warmup=5)
    assert (t.block, t.steps) == (5, 30)
    used = []
    for k in range(100):
        arm = t.arm(k)
        used.append(arm)
        # A block's first step pays for the switch (5 s): it must not count. Steady state:
        # push+pull 30 ms, push 25, none 20 ms.
        first = 5 <= k < 35 and (k - 5) % 5 == 0
        t.record(k, arm, 5.0 if first else {BOTH: 0.030, PUSH: 0.025, NONE: 0.020}[arm])
    assert used[5:35] == ([BOTH] * 5 + [PUSH] * 5 + [NONE] * 5) * 2
    assert used[35:] == [NONE] * 65 and t.decision == NONE
    assert all(len(v) == 8 for v in t.times.values())
    assert "mean in blocks of 5" in t.summary()


def test_a_stall_in_every_step_counts_one_hiccup_does_not() -> None:
    t = OverlapTuner(total_steps=100, trial=16, arms=[BOTH, NONE], warmup=0)  # blocks of 4
    # BOTH: median 20 ms but a 40 ms stall in half its steps (mean 30); NONE: 25 ms and
    # one 5 s hiccup.
    both = iter([0.02, 0.04, 0.02, 0.04, 0.02, 0.04])
    none = iter([0.025, 5.0, 0.025, 0.025, 0.025, 0.025])
    for k in range(16):
        arm = t.arm(k)
        if k % 4:
            t.record(k, arm, next(both) if arm == BOTH else next(none))
        else:
            t.record(k, arm, 1.0)  # a block's first step: not counted
    assert t.decision == NONE
    assert t.score_s(NONE) == pytest.approx(0.025) and t.score_s(BOTH) > 0.025


def test_medians_not_means_and_ties_keep_the_configured_arm() -> None:
    t = OverlapTuner(total_steps=50, trial=6, arms=[BOTH, NONE], warmup=0)
    times = {BOTH: [0.02, 0.03, 5.0], NONE: [0.03, 0.03, 0.03]}  # one huge outlier
    decided = [t.record(k, [BOTH, NONE][k % 2], times[[BOTH, NONE][k % 2]][k // 2])
               for k in range(6)]  # fmt: skip
    assert decided == [False] * 5 + [True]
    assert t.block == 1  # too short for blocks: step by step, medians
    assert t.decision == BOTH  # medians 0.03 and 0.03: the configured arm
    assert not t.record(6, BOTH, 1.0) and t.decision == BOTH


@pytest.mark.parametrize(
    ("total", "trial", "arms"),
    [(46, 21, ARMS), (100, 0, ARMS), (100, 2, ARMS), (100, 20, [NONE])],
    ids=["short-run", "no-trial", "trial-shorter-than-the-arms", "nothing-to-choose"],
)
def test_no_trial_runs_the_configured_arm(total: int, trial: int, arms: list) -> None:
    t = OverlapTuner(total_steps=total, trial=trial, arms=arms)
    assert run(t, {a: 0.01 for a in ARMS}, total) == [arms[0]] * total
    assert t.decision is None


def test_bad_trials_are_refused() -> None:
    with pytest.raises(ValueError, match="--overlap-trial"):
        OverlapTuner(total_steps=10, trial=-1, arms=ARMS)
    with pytest.raises(ValueError, match="arm"):
        OverlapTuner(total_steps=10, trial=3, arms=[])


class Host:
    """A host check whose verdict is given; counts its calls."""

    def __init__(self, why: str | None) -> None:
        self.why, self.started, self.asked = why, [], 0

    def start(self) -> None:
        self.started.append(True)

    def verdict(self) -> str | None:
        self.asked += 1
        return self.why


def test_a_busy_host_keeps_the_cheapest_arm_without_a_trial() -> None:
    host = Host("every shard is on this host and its CPUs were 90% busy")
    t = OverlapTuner(total_steps=100, trial=30, arms=ARMS, warmup=5, host=host)
    used = run(t, {BOTH: 0.01, PUSH: 0.02, NONE: 0.03}, 100)  # overlap would time faster
    assert used[:5] == [BOTH] * 5  # the warm-up runs the configured arm, as without a check
    assert used[5:] == [NONE] * 95  # then the cheapest, untried
    assert (host.started, host.asked) == ([True], 1)  # started after step 0, asked once
    assert t.decision == NONE and t.untried == host.why
    assert all(not ts for ts in t.times.values())
    assert t.summary() == f"overlap kept: none, no trial: {host.why}"


def test_a_host_with_room_runs_the_trial_as_before() -> None:
    host = Host(None)
    t = OverlapTuner(total_steps=100, trial=30, arms=ARMS, warmup=5, host=host)
    used = run(t, {BOTH: 0.01, PUSH: 0.02, NONE: 0.03}, 100)
    assert used[35:] == [BOTH] * 65 and t.decision == BOTH and not t.untried
    assert host.asked == 1


def test_no_trial_asks_no_host() -> None:
    host = Host("busy")
    t = OverlapTuner(total_steps=100, trial=0, arms=ARMS, host=host)
    assert run(t, {a: 0.01 for a in ARMS}, 100) == [BOTH] * 100
    assert (host.started, host.asked, t.decision) == ([], 0, None)
