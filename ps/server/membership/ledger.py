"""Elastic data: which batch ids each worker trains on, following membership (docs/elastic.md).

Shard 0 of a job with elastic data (Job.data_batches > 0) keeps a `DataLedger`. The job's
data is a stream of batch ids 0..total-1 (the worker maps id k to the samples of batch
k % N of epoch k // N, N the batches of one epoch: worker/data.py ElasticBatches), so
the ids of an epoch are disjoint slices of that epoch's permutation. The ledger deals
them, `per_step` at a time, and each id is trained on exactly once:

- **Pool.** Ids not dealt yet: the ones given back (sorted, dealt first) then the fresh
  ones, in order.
- **Deal.** A worker's step of clock c gets the next `per_step` ids of the pool
  (`deal(worker, c)`; asked again, the same ids). Rounds modes (sync, local) deal a new
  round to its members in rank order the moment the previous round closes
  (`deal_round`); async/ssp deal when a worker pulls, in the order they ask.
- **Consume.** Shard 0 taking the worker's push of clock c consumes its deal of clock c:
  those ids are done (their gradient is in).
- **Give back.** A worker that leaves the live set (Leave, its lease expired) or whose
  clock jumps past a deal (a sync worker re-entering at a later round) gives back what it
  was dealt and did not push: those ids return to the front of the pool and are dealt
  again. So a killed worker's unfinished batch is trained on by another worker, and no
  id is trained on twice (a push is refused once its worker is out of the live set).

Determinism: in rounds modes the deal is a function of each round's members (in rank
order) and of whose pushes each round took; in async/ssp of the order in which workers
asked, as the weights themselves are.

Not thread-safe by itself: shard 0 calls it under its lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from psar.ps.job import Job


class DataLedger:
    """The batch ids of an elastic job, dealt to its workers (see the module docstring)."""

    def __init__(self, total: int, per_step: int = 1) -> None:
        if total < 1 or per_step < 1:
            raise ValueError(f"ledger: total ({total}) and per_step ({per_step}) must be >= 1")
        self.total = total
        self.per_step = per_step
        self.fresh = 0
        """The next id never dealt."""
        self.returned: list[int] = []
        """Ids given back, sorted: dealt before the fresh ones."""
        self.deals: dict[int, dict[int, tuple[int, ...]]] = {}
        """worker -> clock -> ids dealt for that step and not consumed yet."""
        self.dealt = 0
        """Ids dealt, the ones dealt again included."""
        self.given_back = 0
        """Ids given back by workers that left or died before pushing them."""
        self.consumed = 0
        """Ids whose gradient shard 0 took."""
        self.finished_by: int | None = None
        """The worker whose push took the job's last outstanding ids (every id dealt and
        consumed): its weights after that push are the job's final model (membership.py
        tells it, in its Leave reply, to write --save). Not checkpointed: a restored shard
        names none, and the last worker out writes it instead."""

    # ---- reading -------------------------------------------------------------------------

    def remaining(self) -> int:
        """Ids not dealt yet (given-back ones included)."""
        return len(self.returned) + self.total - self.fresh

    def outstanding(self) -> int:
        """Ids dealt and not consumed yet."""
        return sum(len(ids) for d in self.deals.values() for ids in d.values())

    def exhausted(self) -> bool:
        """Every id has been dealt (a worker that asks now gets none: it is done)."""
        return self.remaining() == 0

    # ---- dealing -------------------------------------------------------------------------

    def deal(self, worker: int, clock: int) -> tuple[int, ...]:
        """The ids of `worker`'s step `clock` (the same ones every time it asks); () once
        the pool is empty. The last deal of a job may hold fewer than per_step ids."""
        held = self.deals.get(worker, {}).get(clock)
        if held is not None:
            return held
        ids = self._take(self.per_step)
        if ids:
            self.deals.setdefault(worker, {})[clock] = ids
            self.dealt += len(ids)
        return ids

    def deal_round(self, members: Iterable[int], clock: int) -> None:
        """Rounds modes: round `clock` opens; deal it to its members in rank order."""
        for w in sorted(members):
            self.deal(w, clock)

    def _take(self, n: int) -> tuple[int, ...]:
        out = self.returned[:n]
        del self.returned[:n]
        fresh = min(n - len(out), self.total - self.fresh)
        out.extend(range(self.fresh, self.fresh + fresh))
        self.fresh += fresh
        return tuple(out)

    # ---- pushes and departures ----------------------------------------------------------

    def consume(self, worker: int, clock: int) -> None:
        """Shard 0 took `worker`'s push of `clock`: the ids of that step are done."""
        mine = self.deals.get(worker, {})
        took = mine.pop(clock, ())
        self.consumed += len(took)
        if not mine:
            self.deals.pop(worker, None)
        if took and self.finished_by is None and self.exhausted() and not self.deals:
            self.finished_by = worker

    def give_back(self, worker: int, *, through: int | None = None) -> int:
        """`worker` will not push what it was dealt (every deal, or those of clocks up to
        `through`): the ids go back to the front of the pool. Returns how many."""
        mine = self.deals.get(worker, {})
        clocks = [c for c in mine if through is None or c <= through]
        n = 0
        for c in clocks:
            for i in mine.pop(c):
                bisect.insort(self.returned, i)
                n += 1
        if not mine:
            self.deals.pop(worker, None)
        self.given_back += n
        return n

    # ---- checkpoints ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain ints and lists)."""
        return {
            "total": self.total,
            "per_step": self.per_step,
            "fresh": self.fresh,
            "returned": list(self.returned),
            "deals": [[w, c, list(ids)] for w, d in self.deals.items() for c, ids in d.items()],
            "dealt": self.dealt,
            "given_back": self.given_back,
            "consumed": self.consumed,
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> DataLedger:
        led = cls(int(s["total"]), int(s["per_step"]))
        led.fresh = int(s["fresh"])
        led.returned = sorted(int(i) for i in s["returned"])
        for w, c, ids in s["deals"]:
            led.deals.setdefault(int(w), {})[int(c)] = tuple(int(i) for i in ids)
        led.dealt, led.given_back = int(s["dealt"]), int(s["given_back"])
        led.consumed = int(s["consumed"])
        return led


def ledger_for(job: Job) -> DataLedger | None:
    """Shard 0 of a job with elastic data deals its batch ids; no other shard does."""
    if job.data_batches and job.shard_index == 0:
        return DataLedger(job.data_batches, job.data_per_step)
    return None
