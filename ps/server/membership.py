"""Who is in a shard's live set: leases, heartbeats, leaving, registering and rejoining.

A mixin of ShardState (ps/server/shard.py): every method takes the shard's lock. The rules,
per mode (docs/reliability.md has the whole protocol):

- A worker is *live* while its lease holds. Sync rounds close when every live worker
  has pushed (the mean is over those that pushed); SSP waits only for live workers.
- A worker whose lease runs out is *expired*: it leaves the live set and its pushes
  are refused with ABORTED (reason expired) until it registers again.
- A worker that calls Leave has *left* for good (its pushes are refused as before).
- Register (re)joins. async/ssp: the shard's record of the worker's clock becomes
  max(record, clock) and it is live at once. sync: it joins at round clock + 1 — live
  now if that round is the open one, else when round `clock` closes — so every shard
  adds it at the same round boundary.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from ps.errors import Aborted, FailedPrecondition, InvalidArgument
from ps.server.pushdata import PushHeader

if TYPE_CHECKING:
    from ps.server.shard import ShardState


class Restored(Aborted):
    """The request was made against an older incarnation of the shard (restored or
    rolled back since): the worker must re-synchronise (Register) and retry."""

    reason = "restored"


class Expired(Aborted):
    """The worker's lease expired (or it has not joined yet): Register to rejoin."""

    reason = "expired"


class TooLate(Aborted):
    """Register asked to join at a round that has already closed on this shard."""

    reason = "too_late"


def new_incarnation() -> int:
    """A random non-zero 63-bit id (0 on the wire means "do not check")."""
    return secrets.randbits(63) or 1


class Membership:
    """Lease and live-set handling of a ShardState (see the module docstring)."""

    def check_worker(self: ShardState, worker: int) -> None:
        job = self._require_job()
        if not 0 <= worker < job.num_workers:
            raise InvalidArgument(
                f"worker {worker} is not in this job (workers 0..{job.num_workers - 1})",
                reason="bad_worker",
            )

    def check_incarnation(self: ShardState, incarnation: int) -> None:
        if incarnation and incarnation != self.incarnation:
            raise Restored(
                f"restored: this shard was restored or rolled back (incarnation "
                f"{self.incarnation}, the request expected {incarnation}); register again "
                f"(the client does this by itself) and retry"
            )

    def _check_clock(self: ShardState, h: PushHeader) -> bool:
        """Clocks advance by one per push. Returns True for an acknowledged retry."""
        if h.clock < 1:
            raise InvalidArgument(
                f"push clock must be >= 1 (the worker's clock after this push), got {h.clock}",
                reason="malformed",
            )
        last = self.clocks[h.worker]
        if h.clock <= last:
            if h.retry:
                return True
            raise FailedPrecondition(
                f"duplicate push: worker {h.worker} clock {h.clock} was already taken "
                f"(worker clock is {last}); never counted twice. Set retry=true when "
                f"re-sending a push whose reply was lost",
                reason="duplicate",
            )
        if h.worker in self.left:
            raise FailedPrecondition(
                f"worker {h.worker} has left the job; it cannot push any more",
                reason="left",
            )
        if h.worker not in self.live:
            raise Expired(
                f"expired: worker {h.worker} is not in the live set (its lease of "
                f"{self.leases.lease_s:g}s expired, or it waits to join at round "
                f"{self.joining.get(h.worker, '?')}); register again to rejoin"
            )
        if h.clock != last + 1:
            raise FailedPrecondition(
                f"out-of-order push: worker {h.worker} sent clock {h.clock}, expected {last + 1}",
                reason="out_of_order",
            )
        return False

    def touch(self: ShardState, worker: int) -> None:
        """The worker was heard from (under the lock)."""
        if worker in self.live:
            self.leases.renew(worker)

    def heartbeat(self: ShardState, worker: int) -> tuple[bool, int, float]:
        """Renew the worker's lease; returns (live, incarnation, lease_s)."""
        with self._cond:
            self.check_worker(worker)
            self.touch(worker)
            return worker in self.live, self.incarnation, self.leases.lease_s

    def expire_leases(self: ShardState) -> list[int]:
        """Drop every live worker whose lease ran out; returns them."""
        with self._cond:
            if self.job is None:
                return []
            gone = [w for w in self.leases.expired() if w in self.live]
            for w in gone:
                self.leases.drop(w)
                self.expired.add(w)
                self._remove_live(w)
                self.lease_expirations += 1
                self.metrics.lease_expired()
            return gone

    def leave(self: ShardState, worker: int) -> int:
        """`worker` is done: nobody waits for it any more. Returns live workers left."""
        with self._cond:
            self.check_worker(worker)
            self.left.add(worker)
            self.expired.discard(worker)
            self.joining.pop(worker, None)
            self.leases.drop(worker)
            if worker in self.live:
                self._remove_live(worker)
            return len(self.live)

    def _remove_live(self: ShardState, worker: int) -> None:
        self.live.discard(worker)
        self.policy.on_leave(self, worker)
        self.metrics.set_live_workers(len(self.live))
        self._cond.notify_all()

    def _add_live(self: ShardState, worker: int) -> None:
        self.live.add(worker)
        self.left.discard(worker)
        self.leases.grant([worker], grace=False)
        self.metrics.set_live_workers(len(self.live))
        self._cond.notify_all()

    def promote_joiners(self: ShardState) -> None:
        """sync: a round just closed; workers waiting for this boundary become live."""
        for w, c in list(self.joining.items()):
            if c <= self.rounds:
                del self.joining[w]
                self._add_live(w)

    def register(
        self: ShardState, worker: int, clock: int, *, query: bool = False, instance: str = ""
    ) -> dict[str, Any]:
        """Join or rejoin the live set (see the module docstring); query only reads."""
        with self._cond:
            self.check_worker(worker)
            job = self.job
            assert job is not None
            rejoined = False
            if not query:
                was_live = worker in self.live
                old = self.instances.get(worker, "")
                lapsed = not was_live and (worker in self.expired or worker in self.left)
                if self.policy.rounds:  # join at a round boundary
                    self._register_sync(worker, clock)
                else:
                    self.clocks[worker] = max(self.clocks[worker], clock)
                    self.joining.pop(worker, None)
                    if not was_live:
                        self._add_live(worker)
                    self.touch(worker)
                changed = bool(old) and bool(instance) and instance != old
                if changed or lapsed:
                    rejoined = True
                    self.rejoins += 1
                    self.metrics.worker_rejoined()
                self.expired.discard(worker)
                if instance:
                    self.instances[worker] = instance
            return {
                "incarnation": self.incarnation,
                "clock": self.clocks[worker],
                "version": self.version,
                "rounds": self.rounds,
                "live": worker in self.live,
                "rejoined": rejoined,
                "lease_s": self.leases.lease_s,
                "restored": self.restored_pending,
                "restores": self.restores,
            }

    def _register_sync(self: ShardState, worker: int, clock: int) -> None:
        if self.rounds > clock:
            raise TooLate(
                f"too late: round {clock + 1} cannot be joined, {self.rounds} rounds have "
                f"closed here; register for round {self.rounds + 1} or later",
            )
        if clock < self.clocks[worker]:
            raise FailedPrecondition(
                f"sync: worker {worker} already pushed for round {self.clocks[worker]}; "
                f"register with clock >= {self.clocks[worker]}",
                reason="out_of_order",
            )
        if worker in self.live and self.clocks[worker] == clock == self.rounds + 1:
            self.touch(worker)  # it already pushed for the open round: it is in it
            return
        if self.rounds == clock:
            self.joining.pop(worker, None)
            self.clocks[worker] = clock
            if worker not in self.live:
                self._add_live(worker)
            self.touch(worker)
            return
        # Join at a later boundary: out of the live set until round `clock` closes.
        if worker in self.live:
            self.leases.drop(worker)
            self._remove_live(worker)
        self.clocks[worker] = clock
        self.joining[worker] = clock
        self.promote_joiners()  # leaving may have closed the round it waits for
