"""Which overlap pays on this host, decided from measured step times (--overlap-trial).

Pushing during backward and pulling in forward order run communication on other
threads at the same time as compute. That wins where a core is idle and loses where none
is: the communicating threads then take their core from forward and backward (measured
in docs/architecture.md: 1 worker + 1 shard on 2 cores, 18.6 ms/step with both, 20.5-21.0
with neither; 2 workers + 1 shard, 24-25 with both, 22.8-23.5 with neither). A worker
cannot know what else shares its cores, so it measures: after `warmup` steps, `trial`
steps try the arms (push and pull overlapped; push only; neither), every worker on the
same schedule so that in sync mode all of them try the same arm in the same step, and the
arm with the lowest steady-state step time is kept for the rest of the run. Results do not
depend on it (the weights are bit-identical whichever arm runs); only timing does.

Before the trial, a host check (`host`, ps/client/host_cpu.py) may keep the cheapest arm
untried: where compute is on the CPU, every shard is on this host and the host's CPUs were
nearly all busy over the warm-up steps, there is no idle core for overlap to use, and the
arms differ by less than the trial can tell apart.

The arms run in blocks of consecutive steps, twice over (A A A B B B C C C A A A ...), and
the first step of each block is not counted: what an arm costs a shared machine (another
worker's compute slowed by this one's sending threads, a shard's queue) shows only once it
has run for a while. Cycling the arms step by step (A B C A B C) measured every arm within
1 ms here while the kept arm then ran 12% apart (2 workers, 1 shard, 2 cores: "push"
8,000-8,250 samples/s, "none" 9,100-9,700). An arm's score is the mean of its counted
steps, the slowest left out (a stall in every step counts, one hiccup does not). A trial
too short for blocks of two (fewer than 4 x the arms steps) cycles step by step and
compares medians, as before.

A step's time is the interval between the ends of two consecutive pushes (inside
`step()`, before its pull). The arm picked when step k's push has ended runs that step's
pull, the next forward (which a background pull overlaps), and the next step's push
during backward and its end: everything in the interval that starts there, and nothing
of any other arm. (Timing from step start to step start would charge an arm with the
push that the previous arm streamed, or did not, during its backward.)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

WARMUP_STEPS = 5
"""Steps before the trial: connections, allocator and caches settle."""
ROUNDS = 2
"""Times the trial runs through the arms in blocks (so a slow minute hits them all)."""

Arm = tuple[bool, bool]
"""(push during backward, pull in forward order)."""

ARM_NAMES = {(True, True): "push+pull", (True, False): "push", (False, False): "none"}


class HostCheck(Protocol):
    """Asked before the trial (ps/client/host_cpu.py CoLocatedCPU): start() once the first
    warm-up interval has ended (connections are up), verdict() as the warm-up ends: a reason
    to keep the cheapest arm untried, or None."""

    def start(self) -> None: ...

    def verdict(self) -> str | None: ...


@dataclass
class OverlapTuner:
    total_steps: int
    """Steps this run will take (a trial only happens when the run is long enough)."""
    trial: int
    """Steps cycling through the arms (0: no trial)."""
    arms: list[Arm]
    """What may run, preferred first: the configured arm, then the cheaper ones."""
    warmup: int = WARMUP_STEPS
    times: dict[Arm, list[float]] = field(default_factory=dict)
    decision: Arm | None = None
    """The arm kept once the trial ended (None: still trying, or no trial)."""
    host: HostCheck | None = None
    """Asked over the warm-up steps whether the host leaves overlap anything to gain."""
    untried: str = ""
    """Why the cheapest arm was kept without a trial (the host check's reason), or ""."""

    def __post_init__(self) -> None:
        if self.trial < 0:
            raise ValueError(f"--overlap-trial must be >= 0, got {self.trial}")
        if not self.arms:
            raise ValueError("an overlap trial needs at least one arm")
        # Too short a run gains nothing from deciding; keep the configured behaviour.
        self.active = (
            len(self.arms) > 1
            and self.trial >= len(self.arms)
            and self.total_steps >= self.warmup + 2 * self.trial
        )
        self.times = {a: [] for a in self.arms}
        per_arm = self.trial // (ROUNDS * len(self.arms))
        self.block = per_arm if per_arm >= 2 else 1
        """Steps an arm runs in a row (1: step by step)."""
        self.steps = self.block * len(self.arms) * ROUNDS if self.block > 1 else self.trial
        """Steps the trial takes (the rest of `trial` runs the configured arm)."""

    def arm(self, step: int) -> Arm:
        """The arm for the step that starts now (0-based)."""
        if self.decision is not None:
            return self.decision
        if not self.active or step < self.warmup or step >= self.warmup + self.steps:
            return self.arms[0]
        return self.arms[((step - self.warmup) // self.block) % len(self.arms)]

    def record(self, step: int, arm: Arm, seconds: float) -> bool:
        """The interval that began at step `step` (run with `arm`) took `seconds`.
        Returns True when this call decided the trial."""
        if not self.active or self.decision is not None:
            return False
        at = step - self.warmup
        if self.host is not None and step == 0:
            self.host.start()  # after the first interval: connections are up
        if self.host is not None and at == -1 and (why := self.host.verdict()):
            self.untried = why
            self.decision = self.arms[-1]
            return True
        if 0 <= at < self.steps and (self.block == 1 or at % self.block):  # not a block's first
            self.times[arm].append(seconds)
        if at + 1 >= self.steps and all(self.times.values()):
            # min() keeps the first of equal scores: the configured arm wins ties.
            self.decision = min(self.arms, key=self.score_s)
            return True
        return False

    def score_s(self, arm: Arm) -> float:
        """Seconds per step of `arm`: step by step, the median; in blocks, the mean
        without the slowest step."""
        ts = self.times[arm]
        if self.block == 1:
            return statistics.median(ts)
        kept = sorted(ts)[:-1] if len(ts) > 2 else ts
        return statistics.fmean(kept)

    def summary(self) -> str:
        """One line for the log: the medians and what was kept."""
        assert self.decision is not None
        if self.untried:
            return f"overlap kept: {ARM_NAMES[self.decision]}, no trial: {self.untried}"
        ms = ", ".join(f"{ARM_NAMES[a]} {1e3 * self.score_s(a):.1f}" for a in self.arms)
        n = min(len(t) for t in self.times.values())
        how = "median" if self.block == 1 else f"mean in blocks of {self.block}"
        return (
            f"overlap kept: {ARM_NAMES[self.decision]} ({how}, ms/step over {n}+ steps "
            f"each: {ms}; --overlap-trial)"
        )
