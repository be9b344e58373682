"""Worker leases: who is still alive, judged by when each worker was last heard from.

A lease is renewed by any request of the worker (push, pull, register) and by the
heartbeats its client sends every lease_s / 3. A worker first seen (or one the shard
has just been restored with) gets a longer first term, `join_grace_s`, so that a slow
process start is not mistaken for a death.

The clock is injected, so unit tests expire leases without sleeping. The table is not
thread-safe by itself: the shard calls it under its own lock.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_LEASE_S = 10.0
DEFAULT_JOIN_GRACE_S = 60.0


class LeaseTable:
    """Deadlines per worker; `expired()` says whose passed."""

    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        join_grace_s: float = DEFAULT_JOIN_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"--lease-s must be > 0, got {lease_s}")
        self.lease_s = float(lease_s)
        self.join_grace_s = max(float(join_grace_s), self.lease_s)
        self.clock = clock
        self._deadline: dict[int, float] = {}

    def grant(self, workers: Iterable[int], *, grace: bool = True) -> None:
        """Start leases (a first term of join_grace_s with grace, else lease_s)."""
        term = self.join_grace_s if grace else self.lease_s
        now = self.clock()
        for w in workers:
            self._deadline[w] = now + term

    def renew(self, worker: int) -> None:
        """The worker was heard from: its lease runs lease_s from now (this also ends the
        longer first term: the worker has clearly started)."""
        if worker in self._deadline:
            self._deadline[worker] = self.clock() + self.lease_s

    def drop(self, worker: int) -> None:
        self._deadline.pop(worker, None)

    def holds(self, worker: int) -> bool:
        return worker in self._deadline

    def expired(self) -> list[int]:
        """Workers whose lease ran out (they stay in the table until dropped)."""
        now = self.clock()
        return sorted(w for w, d in self._deadline.items() if d <= now)


class Reaper:
    """A daemon thread that calls `members.expire_leases()` every `period` seconds (the
    shard's membership, ps/server/membership/membership.py).

    It holds only a weak reference to it, so a forgotten reaper never keeps a shard
    alive; `stop()` ends it.
    """

    def __init__(self, state: Any, period: float) -> None:
        self._ref = weakref.ref(state)
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, name="psar-lease-reaper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            state = self._ref()
            if state is None:
                return
            state.expire_leases()
            del state

    def stop(self) -> None:
        self._stop.set()
