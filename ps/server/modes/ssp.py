"""--mode ssp: stale synchronous parallel (Bösen): async, but a worker more than the job's
`staleness` clocks ahead of the slowest live worker waits on its pull.

The mode is this module: its traits, its rule (an AsyncPolicy whose pulls wait) and its
configuration (the job's staleness bound S, and async's knobs)."""

from __future__ import annotations

from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes.asynchronous import AsyncPolicy
from psar.ps.server.modes.base import UpdatePolicy
from psar.ps.server.modes.registry import Mode, RuleOptions
from psar.ps.server.modes.view import ShardView

TRAITS = ModeTraits(
    rounds=False,
    staleness="bounded",
    between_steps="pull",
    shard_owns_loss_scale=False,
    rejoin="at_once",
)


class SSPPolicy(AsyncPolicy):
    """Bounded staleness (Bösen's SSP): async, but a worker whose clock is more than S ahead
    of the slowest live worker waits on its pull until the slowest catches up.

    Blocking the reader wastes no work; rejecting stale gradients would waste whole steps,
    so no gradient inside the bound is ever thrown away.
    """

    def __init__(self, staleness: int) -> None:
        super().__init__()
        self.staleness = staleness

    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        return clock - view.slowest_live_clock(default=clock) <= self.staleness

    def pull_waited(self, view: ShardView, seconds: float) -> None:
        view.metrics.ssp_wait(seconds)


def _rule(job: Job, options: RuleOptions) -> UpdatePolicy:
    return SSPPolicy(job.staleness)


MODE = Mode(name="ssp", traits=TRAITS, rule=_rule)
