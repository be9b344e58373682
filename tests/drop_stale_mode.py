"""A mode added as one module: async that drops gradients staler than K (--mode drop_stale).

Everything a mode is lives here, as it does for the stock modes in ps/server/modes/: its
configuration (`DropStaleConfig`, read from the job's mode_options: no proto change), its
traits (what the workers are told with the job) and its update rule (an AsyncPolicy that
drops a gradient computed from weights more than K updates old instead of applying it).
`MODES` is the stock registry with it added; a shard built with it serves the mode
(ShardState(modes=MODES)). tests/test_policy_contract.py runs the contract suite on it
(TestDropStaleContract), tests/test_modes.py drives it over the wire; docs/architecture.md
walks through it.

Why such a rule: where workers differ a lot in speed, the slowest one's gradients are
computed from weights many updates old, and applying them can hurt more than skipping
them (Dutta et al., "Slow and Stale Gradients Can Win the Race", 2018, discuss the
trade-off); SSP bounds staleness by making fast workers wait, this bounds it by dropping.
"""

from __future__ import annotations

from dataclasses import dataclass

from psar.ps.headers import PushOutcome
from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes import (
    BUILTIN,
    Mode,
    RuleOptions,
    ShardView,
    StagedPush,
    UpdatePolicy,
    asynchronous,
)
from psar.ps.server.modes.asynchronous import AsyncPolicy

NAME = "drop_stale"


@dataclass(frozen=True)
class DropStaleConfig:
    """The mode's configuration: its knobs, from the job's mode_options."""

    max_staleness: int
    """K: a gradient computed from weights more than K updates old is dropped (>= 0)."""

    @classmethod
    def of(cls, job: Job) -> DropStaleConfig:
        """Read and check the options; a ValueError says what to send instead."""
        unknown = sorted(set(job.mode_options) - {"max_staleness"})
        if unknown:
            raise ValueError(
                f"--mode {NAME}: unknown mode options {unknown}; it takes max_staleness"
            )
        k = job.mode_options.get("max_staleness")
        if k is None or k < 0 or k != int(k):
            raise ValueError(
                f"--mode {NAME} needs the mode option max_staleness, a whole number >= 0 (got {k})"
            )
        return cls(max_staleness=int(k))


TRAITS: ModeTraits = asynchronous.TRAITS
"""async's: each push on its own (no rounds), staleness counted in versions, workers pull
after every push and keep their own loss scale, a rejoining worker enters at once."""


class DropStalePolicy(AsyncPolicy):
    """Async, but a gradient staler than K is dropped (counted, refused as too_stale in
    the metrics); the worker's clock still moves on, as for a dropped overflow."""

    def __init__(self, config: DropStaleConfig) -> None:
        super().__init__()
        self.max_staleness = config.max_staleness
        self.dropped_stale = 0

    def accept(self, view: ShardView, push: StagedPush) -> PushOutcome:
        staleness = view.version - push.base_version
        if staleness > self.max_staleness and not push.overflow:
            self.dropped_stale += 1
            view.metrics.push_rejected("too_stale")
            return PushOutcome(applied=False, dropped_nonfinite=False, staleness=staleness)
        return super().accept(view, push)


def _rule(job: Job, options: RuleOptions) -> UpdatePolicy:
    return DropStalePolicy(DropStaleConfig.of(job))


MODE = Mode(name=NAME, traits=TRAITS, rule=_rule, configure=DropStaleConfig.of)
MODES = BUILTIN.with_modes(MODE)
"""The stock modes and this one: what a shard serving it is built with."""
