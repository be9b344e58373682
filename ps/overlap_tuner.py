"""Whether the pull overlap pays on this host, decided from measured step times.

The forward-order pull (ps/overlap.py PullGate) runs the pull on another thread while
the next forward starts. That wins where a core is idle and loses where none is: the
pulling thread then takes its core from forward (measured in docs/architectures.md:
1 worker + 1 shard on 2 cores, 18.6 ms/step with it vs 19.1-20.0 without; 2 workers + 1
shard, 24-25 vs 22.8-23.9). A worker cannot know what else shares its cores, so it
measures: after `warmup` steps, `trial` steps alternate with and without the pull
overlap (every worker on the same schedule, so in sync mode both arms see the same
barrier), and the arm with the lower median step time is kept for the rest of the run.
Results do not depend on it (the weights are bit-identical either way); only timing does.

A step's time is the interval between the starts of two consecutive `step()` calls; it
holds the pull of the first (whose arm is the one measured), then the next forward and
backward, which that pull overlaps or not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WARMUP_STEPS = 5
"""Steps before the trial: connections, allocator and caches settle."""


@dataclass
class PullOverlapTuner:
    total_steps: int
    """Steps this run will take (a trial only happens when the run is long enough)."""
    trial: int
    """Steps alternating with / without the pull overlap (0: no trial)."""
    warmup: int = WARMUP_STEPS
    times: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    decision: bool | None = None
    """The arm kept once the trial ended (None: still trying, or no trial)."""

    def __post_init__(self) -> None:
        if self.trial < 0:
            raise ValueError(f"--pull-overlap-trial must be >= 0, got {self.trial}")
        # Too short a run gains nothing from deciding; keep the configured behaviour.
        self.active = self.trial >= 2 and self.total_steps >= self.warmup + 2 * self.trial

    def arm(self, step: int) -> bool:
        """Use the pull overlap for the pull that ends step `step` (0-based)?"""
        if self.decision is not None:
            return self.decision
        if not self.active or step < self.warmup or step >= self.warmup + self.trial:
            return True
        return (step - self.warmup) % 2 == 0

    def record(self, step: int, used: bool, seconds: float) -> bool:
        """The interval that began at step `step` (whose pull used `used`) took
        `seconds`. Returns True when this call decided the trial."""
        if not self.active or self.decision is not None:
            return False
        if self.warmup <= step < self.warmup + self.trial:
            self.times[used].append(seconds)
        if step + 1 >= self.warmup + self.trial and self.times[True] and self.times[False]:
            self.decision = self.median_s(True) <= self.median_s(False)
            return True
        return False

    def median_s(self, used: bool) -> float:
        return statistics.median(self.times[used])
