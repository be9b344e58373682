"""PSBackend's fault handling: re-registering with the shards (docs/reliability.md).

A part of the PSBackend (it holds one as `faults`), so ps/client/backend.py keeps to the
step itself. When a shard says it was restored or rolled back, or that the worker's lease
expired, the worker re-registers (`resync`); in sync mode it first rolls every shard back
to the same checkpointed round, so the job stays consistent. The part keeps the fault
figures the report shows.
"""

from __future__ import annotations

import logging
from typing import Any

from psar.ps.client.errors import NeedsResync

log = logging.getLogger("psar.ps")
_MAX_RESYNCS = 50


class Resync:
    """Re-registering, and the fault figures. `backend`: the PSBackend whose client,
    clock, versions and send buffers it works on (typed Any: in ps/ an import of the
    backend here, even for annotations, would be a cycle)."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.restores = 0
        self.rolled_back_updates = 0
        self.unsent_steps = 0
        """Steps whose gradient was never pushed: a background pull broke after the step's
        forward had used part of its weights (the clock stays; docs/reliability.md)."""
        self.resyncs = 0
        self.rejoined = False
        self._known_restores: list[int] | None = None

    @property
    def _in_rounds(self) -> bool:
        """The shards update in rounds every worker joins (their mode's traits: sync, and
        local SGD's outer rounds): a restore is followed by every shard, and clocks count
        rounds."""
        return self.b.traits.rounds

    def resync(
        self, *, fresh: bool, cause: Exception | None = None, pushed: int | None = None
    ) -> None:
        """(Re-)register on every shard and agree on this worker's clock.

        sync: if a shard was restored (or rolled back) to an earlier round, every shard
        further on is rolled back to a checkpoint at or before it, until all agree;
        then the worker joins at the next round boundary. async/ssp: the worker keeps
        its clock (a fresh process takes the shards' record of it).

        `pushed` (sync): the clock of the gradient still in the send buffers, pushed
        but not yet pulled back. A restored shard whose open round is that one lost the
        push with its crash: the worker joins that open round and pushes it again.
        """
        if cause is not None:
            log.warning("worker %d: %s; re-registering", self.b.rank, cause)
            self.resyncs += 1
        old_inc, old_clock = list(self.b.client.incarnations), self.b.clock
        for _ in range(_MAX_RESYNCS):
            q = self.b.client.register(query=True)
            if self._in_rounds:
                flagged = [r["rounds"] for r in q if r["restored"]]
                ahead = [r["shard"] for r in q if flagged and r["rounds"] > min(flagged)]
                if ahead:
                    for i in ahead:
                        self.b.client.rollback(i, min(flagged))
                    continue
                clock = max([r["rounds"] for r in q] + [r["clock"] for r in q])
            else:
                clock = max(r["clock"] for r in q) if fresh else self.b.clock
            if fresh:  # --join: where shard 0 said to enter (docs/elastic.md)
                clock = max(clock, self.b.elastic.join_clock)
            lost = []
            if self._in_rounds and pushed is not None and pushed == clock:
                lost = [r["shard"] for r in q if r["clock"] < clock and r["rounds"] == clock - 1]
            try:
                regs = self._register(clock, lost)
                if lost:
                    self.b.client.push(
                        clock=clock,
                        base_versions=[r["version"] for r in q],
                        grads=self.b.send,
                        retry=True,
                        shards=lost,
                        **self.b.push_args,
                    )
            except NeedsResync as e:  # too late (the round closed meanwhile) or restored
                log.info("worker %d: register: %s; again", self.b.rank, e)
                continue
            break
        else:
            raise RuntimeError(f"worker {self.b.rank}: could not register with the shards")
        self.b.clock = clock
        self.rejoined = self.rejoined or any(r["rejoined"] for r in regs)
        self._count_restores(regs, old_inc, old_clock, fresh)
        self.b.versions = [min(v, r["version"]) for v, r in zip(self.b.versions, regs, strict=True)]

    def _register(self, clock: int, rejoin_open: list[int]) -> list[dict[str, Any]]:
        """Register at `clock` everywhere, except on the shards in `rejoin_open`, where
        the worker joins the open round (clock - 1) to push it again."""
        if not rejoin_open:
            joined = self.b.elastic.given_rank and not self.b.start_step and self.b.clock == 0
            return self.b.client.register(clock=clock, instance=self.b.instance, joined=joined)
        rest = [i for i in range(len(self.b.addresses)) if i not in rejoin_open]
        got = dict(
            zip(
                rejoin_open,
                self.b.client.register(
                    clock=clock - 1, instance=self.b.instance, shards=rejoin_open
                ),
                strict=True,
            )
        )
        if rest:
            regs = self.b.client.register(clock=clock, instance=self.b.instance, shards=rest)
            got.update(zip(rest, regs, strict=True))
        log.warning("worker %d: re-pushing round %d to shards %s", self.b.rank, clock, rejoin_open)
        return [got[i] for i in range(len(self.b.addresses))]

    def _count_restores(
        self, regs: list[dict[str, Any]], old_inc: list[int], old_clock: int, fresh: bool
    ) -> None:
        """Count a restore/rollback and the updates it undid, as this worker saw them:
        sync: the rounds of this worker's clock that were undone (its pushed round
        included); async/ssp: the newest version it had seen minus the restored one."""
        known = self._known_restores
        self._known_restores = [r["restores"] for r in regs]
        if fresh or known is None:
            return
        if any(r["restores"] > k for r, k in zip(regs, known, strict=True)):
            if self._in_rounds:
                lost = max(0, old_clock - self.b.clock)
            else:
                lost = max(
                    (
                        max(0, seen - r["version"])
                        for seen, r, inc in zip(self.b.seen_versions, regs, old_inc, strict=True)
                        if r["incarnation"] != inc
                    ),
                    default=0,
                )
            self.restores += 1
            self.rolled_back_updates += lost
            log.warning("worker %d: shards restored; %d updates rolled back", self.b.rank, lost)
        self.b.seen_versions = [r["version"] for r in regs]

    def report(self) -> dict[str, Any]:
        """Fault-tolerance figures for the run's report."""
        b = self.b
        return {
            "start_step": b.start_step,
            "restores": self.restores,
            "rolled_back_updates": self.rolled_back_updates,
            "unsent_steps": self.unsent_steps,
            "resyncs": self.resyncs,
            "rejoined": self.rejoined,
            **(b.sparse.report() if b.sparse else {}),
        }
