"""Which overlap pays on this host, decided from measured step times (--overlap-trial).

Pushing during backward and pulling in forward order run communication on other
threads at the same time as compute. That wins where a core is idle and loses where none
is: the communicating threads then take their core from forward and backward (measured
in docs/architectures.md: 1 worker + 1 shard on 2 cores, 18.6 ms/step with both, 20.5-21.0
with neither; 2 workers + 1 shard, 24-25 with both, 22.8-23.5 with neither). A worker
cannot know what else shares its cores, so it measures: after `warmup` steps, `trial`
steps cycle through the arms (push and pull overlapped; push only; neither), every worker
on the same schedule so that in sync mode all of them try the same arm in the same step,
and the arm with the lowest median step time is kept for the rest of the run. Results do
not depend on it (the weights are bit-identical whichever arm runs); only timing does.

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

WARMUP_STEPS = 5
"""Steps before the trial: connections, allocator and caches settle."""

Arm = tuple[bool, bool]
"""(push during backward, pull in forward order)."""

ARM_NAMES = {(True, True): "push+pull", (True, False): "push", (False, False): "none"}


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

    def arm(self, step: int) -> Arm:
        """The arm for the step that starts now (0-based)."""
        if self.decision is not None:
            return self.decision
        if not self.active or step < self.warmup or step >= self.warmup + self.trial:
            return self.arms[0]
        return self.arms[(step - self.warmup) % len(self.arms)]

    def record(self, step: int, arm: Arm, seconds: float) -> bool:
        """The interval that began at step `step` (run with `arm`) took `seconds`.
        Returns True when this call decided the trial."""
        if not self.active or self.decision is not None:
            return False
        if self.warmup <= step < self.warmup + self.trial:
            self.times[arm].append(seconds)
        if step + 1 >= self.warmup + self.trial and all(self.times.values()):
            # min() keeps the first of equal medians: the configured arm wins ties.
            self.decision = min(self.arms, key=self.median_s)
            return True
        return False

    def median_s(self, arm: Arm) -> float:
        return statistics.median(self.times[arm])

    def summary(self) -> str:
        """One line for the log: the medians and what was kept."""
        assert self.decision is not None
        ms = ", ".join(f"{ARM_NAMES[a]} {1e3 * self.median_s(a):.1f}" for a in self.arms)
        n = min(len(t) for t in self.times.values())
        return (
            f"overlap kept: {ARM_NAMES[self.decision]} (median ms/step over {n}+ steps "
            f"each: {ms}; --overlap-trial)"
        )
