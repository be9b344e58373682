"""Who is in a shard's live set: leases, heartbeats, leaving, registering and rejoining.

`Membership` is a component of the shard (ps/server/shard.py); it owns the live set, the
leases and the workers' admission (clock, incarnation) and takes the shard's lock in every
public method. The rules, per mode (docs/reliability.md has the whole protocol):

- A worker is *live* while its lease holds. Sync rounds close when every live worker
  has pushed (the mean is over those that pushed); SSP waits only for live workers.
- A worker whose lease runs out is *expired*: it leaves the live set and its pushes
  are refused with ABORTED (reason expired) until it registers again.
- A worker that calls Leave has *left* for good (its pushes are refused as before).
- Register (re)joins. async/ssp: the shard's record of the worker's clock becomes
  max(record, clock) and it is live at once. sync: it joins at round clock + 1 — live
  now if that round is the open one, else when round `clock` closes — so every shard
  adds it at the same round boundary.
- Join (elastic jobs, shard 0): a new worker is given a free rank, then registers with it
  on every shard as above (docs/elastic.md).
- A rank belongs to the instance that registered it: a Leave naming another instance,
  and a joiner's Register for a rank another instance holds, are refused (holders.py).
- Elastic data (shard 0): a worker leaving the live set gives back the batch ids it was
  dealt and did not push (ps/server/membership/ledger.py), so another worker trains on them.
"""

from __future__ import annotations

import secrets
from typing import Any

from psar.ps import serde
from psar.ps.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted
from psar.ps.headers import PushHeader
from psar.ps.server.membership.holders import check_holder, check_joiner, check_takeover
from psar.ps.server.modes.view import ShardView
from psar.ps.server.state import ShardData


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


MAX_REASON = 1000
"""The most characters of a worker's reason a stopped job repeats to every worker."""


class Membership:
    """Leases and the live set of a shard (see the module docstring). `view`: what the
    update rule is told a worker left with (a sync round may close)."""

    def __init__(self, data: ShardData, view: ShardView) -> None:
        self.data = data
        self.view = view
        self.joined: dict[int, str] = {}
        """rank -> the instance that took it through Join (a Register with joined=true):
        another instance may not take it over while it is live (holders.py)."""
        self.stopped = ""
        """Why the job was stopped (StopJob: its workers disagree about its size, or one
        failed a step the others wait on); every
        later push, pull, Register and Join is refused with it. "" while it runs."""
        self.since: dict[int, int] = {}
        """Elastic jobs: rank -> its clock when its current holder registered it; the
        holder took part once the clock moved past it (took_part)."""
        self.past_holders_took_part = 0
        """Elastic jobs: earlier holders of a rank that pushed before another took it."""
        self.model_writer: tuple[int, str] | None = None
        """Elastic data (shard 0): (rank, instance) told in its Leave reply to write the
        job's final model (--save); see writes_model."""

    def check_worker(self, worker: int) -> None:
        job = self.data.require_job()
        if not 0 <= worker < job.capacity:
            more = "" if job.elastic else " (an elastic job, --max-workers, has room for more)"
            raise InvalidArgument(
                f"worker {worker} is not in this job (workers 0..{job.capacity - 1}){more}",
                reason="bad_worker",
            )

    def check_running(self) -> None:
        """Refuse any call to a stopped job, with the reason (the caller holds the lock)."""
        if self.stopped:
            raise FailedPrecondition(self.stopped, reason="job_stopped")

    def stop(self, worker: int, num_workers: int, reason: str = "") -> None:
        """StopJob: `worker` was started with --world-size `num_workers`, and the job
        rank 0 initialised has another size: neither can train as it was started (rank
        0 would train alone once the others' first lease ran out, and say nothing:
        issue #45 defect 13). Or, with a `reason`, the worker refused a step the others
        wait on (a user's own loop stepped without a backward: the round would never
        close, issue #45 defect 16). Every worker's next call, and every waiting pull,
        is refused with the reason. Without one, refused, nothing changed, where the
        sizes agree."""
        d = self.data
        with d.cond:
            job = d.require_job()
            if reason:
                self.check_worker(worker)
                if not self.stopped:
                    text = " ".join(reason.split())[:MAX_REASON]
                    self._stop(f"{serde.JOB_STOPPED_PREFIX}: worker {worker} failed: {text}")
                return
            if num_workers == job.num_workers:
                raise FailedPrecondition(
                    f"StopJob: worker {worker} says --world-size {num_workers}, which is this "
                    "job's size: nothing disagrees, nothing to stop; nothing changed",
                    reason="same_size",
                )
            if self.stopped:
                return  # the first reason stands
            self._stop(
                f"{serde.JOB_STOPPED_PREFIX}: its workers disagree about its size (worker "
                f"{worker} was started with --world-size {num_workers}, rank 0 with "
                f"{job.num_workers}); restart the shards and start every worker with the "
                "same --world-size"
            )

    def _stop(self, why: str) -> None:
        """Stop the job with `why` (the caller holds the lock). A new incarnation wakes
        every pull waiting for a round (ready() looks at it); check_incarnation then
        answers each with `why`."""
        self.stopped = why
        self.data.incarnation = new_incarnation()
        self.data.cond.notify_all()

    def check_incarnation(self, incarnation: int) -> None:
        """Refuse a call made against an older incarnation (restored, rolled back) or to
        a stopped job (every push and pull path asks this first)."""
        self.check_running()
        if incarnation and incarnation != self.data.incarnation:
            raise Restored(
                f"restored: this shard was restored or rolled back (incarnation "
                f"{self.data.incarnation}, the request expected {incarnation}); register again "
                f"(the client does this by itself) and retry"
            )

    def check_clock(self, h: PushHeader) -> bool:
        """Clocks advance by one per push. Returns True for an acknowledged retry."""
        d = self.data
        if h.clock < 1:
            raise InvalidArgument(
                f"push clock must be >= 1 (the worker's clock after this push), got {h.clock}",
                reason="malformed",
            )
        last = d.clocks[h.worker]
        if h.clock <= last:
            if h.retry:
                return True
            raise FailedPrecondition(
                f"duplicate push: worker {h.worker} clock {h.clock} was already taken "
                f"(worker clock is {last}); never counted twice. Set retry=true when "
                f"re-sending a push whose reply was lost",
                reason="duplicate",
            )
        if h.worker in d.left:
            raise FailedPrecondition(
                f"worker {h.worker} has left the job; it cannot push any more",
                reason="left",
            )
        if h.worker not in d.live:
            raise Expired(
                f"expired: worker {h.worker} is not in the live set (its lease of "
                f"{d.leases.lease_s:g}s expired, or it waits to join at round "
                f"{d.joining.get(h.worker, '?')}); register again to rejoin"
            )
        if h.clock != last + 1:
            raise FailedPrecondition(
                f"out-of-order push: worker {h.worker} sent clock {h.clock}, expected {last + 1}",
                reason="out_of_order",
            )
        return False

    def touch(self, worker: int) -> None:
        """The worker was heard from (under the lock)."""
        if worker in self.data.live:
            self.data.leases.renew(worker)

    def heartbeat(self, worker: int) -> tuple[bool, int, float]:
        """Renew the worker's lease; returns (live, incarnation, lease_s)."""
        d = self.data
        with d.cond:
            self.check_worker(worker)
            self.touch(worker)
            return worker in d.live, d.incarnation, d.leases.lease_s

    def expire_leases(self) -> list[int]:
        """Drop every live worker whose lease ran out; returns them."""
        d = self.data
        with d.cond:
            if d.job is None:
                return []
            gone = [w for w in d.leases.expired() if w in d.live]
            for w in gone:
                d.leases.drop(w)
                d.expired.add(w)
                self._remove_live(w, change="expired")
                d.lease_expirations += 1
                d.metrics.lease_expired()
            return gone

    def leave(self, worker: int, instance: str | None = None) -> int:
        """`worker` is done: nobody waits for it any more. Returns live workers left.
        A push it made before counts (sync: in its round), whatever arrives after.
        instance: who asks (a Leave on the wire always names one, "" if its client did
        not): only the instance holding the rank may leave it (holders.py); None only
        for the shard's own callers (tests driving a ShardState)."""
        d = self.data
        with d.cond:
            self.check_worker(worker)
            if instance is not None:
                check_holder(d, worker, instance)
            if worker not in d.left:
                d.leaves += 1
            d.left.add(worker)
            d.expired.discard(worker)
            d.joining.pop(worker, None)
            d.leases.drop(worker)
            if worker in d.live:
                self._remove_live(worker, change="left")
            self._give_back(worker)
            self._pick_model_writer(worker, instance or d.instances.get(worker, ""))
            return len(d.live)

    def _pick_model_writer(self, worker: int, instance: str) -> None:
        """Elastic data, a worker leaves: is it the one to write the job's final model?
        Rank 0 may be long gone (SIGTERM, SIGKILL, a scale-down: issue #45 defect 7), so
        the shards name the writer: the worker whose push took the job's last ids (its
        pull after that push brought the final weights), else, where no push did (the
        job was stopped before its data was done), the last worker out of the live set."""
        d, led = self.data, self.data.ledger
        if led is None:
            return  # a fixed job: rank 0 writes, as always
        if led.finished_by == worker:
            self.model_writer = (worker, instance)
        elif led.finished_by is None and self.model_writer is None and not (d.live or d.joining):
            self.model_writer = (worker, instance)

    def writes_model(self, worker: int, instance: str) -> bool:
        """Whether `worker` (as `instance`) is the one to write the final model."""
        with self.data.cond:
            return self.model_writer == (worker, instance)

    def _remove_live(self, worker: int, change: str) -> None:
        d = self.data
        d.live.discard(worker)
        self._give_back(worker)
        d.policy.on_leave(self.view, worker)
        d.metrics.set_live_workers(len(d.live))
        d.metrics.membership_changed(change)
        d.cond.notify_all()

    def _add_live(self, worker: int) -> None:
        d = self.data
        d.live.add(worker)
        d.left.discard(worker)
        d.reserved.pop(worker, None)
        d.leases.grant([worker], grace=False)
        d.metrics.set_live_workers(len(d.live))
        d.metrics.membership_changed("joined")
        d.cond.notify_all()

    def _give_back(self, worker: int, *, through: int | None = None) -> None:
        """Elastic data: `worker` will not push what it was dealt (up to clock `through`):
        those batch ids go back to the pool (before the rule may close a round and deal
        the next one)."""
        led = self.data.ledger
        if led is not None and (n := led.give_back(worker, through=through)):
            self.data.metrics.data_returned(n)

    # ---- elastic data (shard 0) ------------------------------------------------------------

    def round_opened(self) -> None:
        """Rounds modes: a round opens (init, or the last one closed and its joiners are
        live): deal it to its members in rank order (under the lock)."""
        d = self.data
        if d.ledger is not None and d.traits.rounds:
            before = d.ledger.dealt
            d.ledger.deal_round(d.live, d.rounds + 1)
            d.metrics.data_dealt(d.ledger.dealt - before, d.ledger.remaining())

    def deal(self, worker: int, clock: int) -> tuple[tuple[int, ...], bool]:
        """Elastic data, under the lock: the batch ids of `worker`'s step `clock` (the
        same every time it asks), and whether the job's data is all dealt (no ids left
        for it: it leaves)."""
        d = self.data
        if d.ledger is None or (worker not in d.live and worker not in d.joining):
            return (), False  # a worker out of the live set gives back, never takes
        before = d.ledger.dealt
        ids = d.ledger.deal(worker, clock)
        if d.ledger.dealt != before:
            d.metrics.data_dealt(d.ledger.dealt - before, d.ledger.remaining())
        return ids, not ids

    def promote_joiners(self) -> None:
        """sync: a round just closed; workers waiting for this boundary become live."""
        d = self.data
        for w, c in list(d.joining.items()):
            if c <= d.rounds:
                del d.joining[w]
                self._add_live(w)

    def register(
        self,
        worker: int,
        clock: int,
        *,
        query: bool = False,
        instance: str = "",
        joined: bool = False,
    ) -> dict[str, Any]:
        """Join or rejoin the live set (see the module docstring); query only reads.
        joined: the worker got its rank from Join (a new worker, never a rejoin)."""
        d = self.data
        with d.cond:
            self.check_worker(worker)
            if not query:
                self.check_running()
            job = d.job
            assert job is not None
            rejoined = False
            if joined and not query:
                check_joiner(d, worker, instance)
            elif not query:
                check_takeover(d, self.joined, worker, instance)
            if not query:
                was_live = worker in d.live
                old = d.instances.get(worker, "")
                given = joined  # a new worker with a rank Join gave, not one coming back
                lapsed = not was_live and (worker in d.expired or worker in d.left) and not given
                if d.traits.rejoin == "at_round_boundary":
                    self._register_sync(worker, clock)
                else:
                    d.clocks[worker] = max(d.clocks[worker], clock)
                    self._give_back(worker, through=d.clocks[worker])  # never pushed now
                    d.joining.pop(worker, None)
                    if not was_live:
                        self._add_live(worker)
                    self.touch(worker)
                changed = bool(old) and bool(instance) and instance != old and not given
                if changed or lapsed:
                    rejoined = True
                    d.rejoins += 1
                    d.metrics.worker_rejoined()
                d.expired.discard(worker)
                self._count_holder(worker, old, instance)
                if instance:
                    d.instances[worker] = instance
                if joined:
                    self.joined[worker] = instance
            return {
                "incarnation": d.incarnation,
                "clock": d.clocks[worker],
                "version": d.version,
                "rounds": d.rounds,
                "live": worker in d.live,
                "rejoined": rejoined,
                "lease_s": d.leases.lease_s,
                "restored": d.restored_pending,
                "restores": d.restores,
            }

    def _count_holder(self, worker: int, old: str, instance: str) -> None:
        """Elastic jobs: a new instance registers `worker` (under the lock, after its
        clock is set): its predecessor took part if the clock moved while it held it."""
        d = self.data
        if d.job is None or not d.job.elastic or (old and instance == old):
            return
        if old and d.clocks[worker] > self.since.get(worker, 0):
            self.past_holders_took_part += 1
        self.since[worker] = d.clocks[worker]

    def took_part(self) -> int:
        """How many workers pushed at least one gradient into the job (the summary's
        workers_took_part): ranks that pushed; in an elastic job, where a rank passes
        from worker to worker, each of its holders that pushed while it held it."""
        d = self.data
        with d.cond:
            if d.job is None:
                return 0
            if not d.job.elastic:
                return sum(c > 0 for c in d.clocks)
            now = sum(c > self.since.get(w, 0) for w, c in enumerate(d.clocks))
            return self.past_holders_took_part + now

    def join(self, instance: str) -> dict[str, Any]:
        """Elastic jobs, shard 0: give a joining worker a free rank; it registers with it
        on every shard next (Register). The rank given is the lowest one that no worker
        holds (live, waiting for its round, or given by Join and not registered within
        the join grace): first one never used, then one whose worker left, then one
        whose worker's lease ran out (it may still come back, so it is taken last)."""
        d = self.data
        with d.cond:
            job = d.require_job()
            self.check_running()
            if not job.elastic:
                raise FailedPrecondition(
                    f"this job keeps its {job.num_workers} workers: start it with "
                    "--max-workers N (rank 0) to let workers join it",
                    reason="not_elastic",
                )
            if job.shard_index != 0:
                raise FailedPrecondition(
                    f"shard {job.shard_index} gives no ranks: ask shard 0 (the first of --servers)",
                    reason="not_shard0",
                )
            if d.ledger is not None and d.ledger.exhausted():
                # No round will deal a newcomer anything: in sync it would wait for a
                # round nobody closes (issue #45 defect 9). Nothing changes.
                raise FailedPrecondition(
                    f"the job's data is all dealt ({d.ledger.total} batch ids; "
                    f"{d.ledger.outstanding()} still training): nothing left for a joiner "
                    "to train; the job is finishing or finished",
                    reason="data_done",
                )
            now = d.leases.clock()
            for w, (_, until) in list(d.reserved.items()):
                if until <= now:
                    del d.reserved[w]
            mine = [w for w, (inst, _) in d.reserved.items() if instance and inst == instance]
            held = d.live | set(d.joining) | set(d.reserved)
            free = mine or [w for w in range(job.capacity) if w not in held]
            if not free:
                raise ResourceExhausted(
                    f"the job holds its {job.capacity} workers (--max-workers); wait for "
                    "one to leave, or start the job with a larger --max-workers",
                )

            def age(w: int) -> int:  # 0: never used, 1: left, 2: lease ran out
                return 2 if w in d.expired else 1 if (w in d.left or w in d.instances) else 0

            worker = min(free, key=lambda w: (age(w), w))
            d.reserved[worker] = (instance, now + d.leases.join_grace_s)
            d.joins += 0 if mine else 1  # a retried Join gets the same rank
            if d.traits.rounds:
                # The round after the open one: the open round waits for nobody new, and
                # the joiner is dealt its data with the round's other members.
                clock = d.rounds + 1
            else:  # async/ssp: enter as the slowest live worker, so nobody waits for it
                clock = max(d.clocks[worker], d.slowest_live_clock(default=0))
            return {"worker": worker, "live_workers": len(d.live), "clock": clock}

    def _register_sync(self, worker: int, clock: int) -> None:
        d = self.data
        if d.rounds > clock:
            raise TooLate(
                f"too late: round {clock + 1} cannot be joined, {d.rounds} rounds have "
                f"closed here; register for round {d.rounds + 1} or later",
            )
        if clock < d.clocks[worker]:
            raise FailedPrecondition(
                f"sync: worker {worker} already pushed for round {d.clocks[worker]}; "
                f"register with clock >= {d.clocks[worker]}",
                reason="out_of_order",
            )
        if worker in d.live and d.clocks[worker] == clock == d.rounds + 1:
            self.touch(worker)  # it already pushed for the open round: it is in it
            return
        if d.rounds == clock:
            d.joining.pop(worker, None)
            self._give_back(worker, through=clock)
            d.clocks[worker] = clock
            if worker not in d.live:
                self._add_live(worker)
            self.touch(worker)
            return
        # Join at a later boundary: out of the live set until round `clock` closes.
        if worker in d.live:
            d.leases.drop(worker)
            self._remove_live(worker, change="rejoining")
        self._give_back(worker, through=clock)  # rounds it skips are dealt to others
        d.reserved.pop(worker, None)
        d.clocks[worker] = clock
        d.joining[worker] = clock
        self.promote_joiners()  # leaving may have closed the round it waits for
