"""A shard's intake of pushes: admit a header, take its pieces, hand the whole push to the rule.

A component of the shard (ps/server/shard.py). Both doors (the gRPC servicer and the TCP
data plane) feed a push through the same four calls: `begin_push` (the header: checked
completely, the worker's push lock taken), `add_data` / `add_data_from` (each piece,
validated from its description before a byte lands in the worker's staging buffers,
ps/server/intake/pieces.py), `add_verdict` (the finiteness verdict of a push streamed during
backward), `finish_push` (complete and finite: the update rule takes it). A refused push
changes nothing: masters and optimizer state stay byte for byte.

Per-chunk rules (sync with --chunk-rounds) hear of each slot as it completes, and a push
running ahead of its round's slowest is paced (ps/server/intake/pacing.py). A worker's
newer push, on either door, cuts off its stalled one instead of waiting for its lock
(`in_flight`, ps/server/intake/takeover.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from psar.ps.errors import DeadlineExceeded, PSError, Unavailable
from psar.ps.headers import PushHeader, PushOutcome, StepOptions
from psar.ps.server.intake import pacing
from psar.ps.server.intake.pieces import (
    PushTicket,
    add_exact,
    add_piece,
    add_piece_streamed,
    add_verdict,
    check_absent,
    check_complete,
    check_header,
    slot_complete,
    unscale_rest,
    unscale_slot,
    zero_absent,
)
from psar.ps.server.intake.scratch import ExactStaging, ScratchPool
from psar.ps.server.intake.takeover import InFlightPushes
from psar.ps.server.membership.membership import Membership, Restored
from psar.ps.server.modes.base import StagedPush
from psar.ps.server.state import ShardData
from psar.ps.server.update.buffers import check_int_buffers
from psar.ps.server.update.updates import Updates

log = logging.getLogger(__name__)


class Intake:
    """Takes pushes into a shard (see the module docstring)."""

    def __init__(self, data: ShardData, members: Membership, updates: Updates) -> None:
        self.data = data
        self.members = members
        self.updates = updates
        self._staging: dict[int, dict[str, torch.Tensor]] = {}
        """Per worker, the buffers its pushes land in (reused push after push)."""
        self._raw_staging: dict[int, dict[str, torch.Tensor]] = {}
        """Per worker, its model buffers' slots when its pushes go into an exact sum."""
        self.scratch = ScratchPool()
        """One-slot buffers a push into an exact sum lands in (ps/server/intake/scratch.py)."""
        self._worker_locks: dict[int, threading.Lock] = {}
        self._pacing = 0
        """Pushes waiting in pace_push now: a completed or dropped slot wakes the shard's
        condition (and every pull waiting on it) only when one is."""
        self.in_flight = InFlightPushes()
        """The push each worker is streaming, on either door: a newer one cuts it off
        instead of waiting for its lock (ps/server/intake/takeover.py)."""

    def forget(self) -> None:
        """The state was replaced (restore, rollback): fresh staging buffers from now on."""
        self._staging.clear()
        self._raw_staging.clear()

    def gradient_bytes(self) -> int:
        """Bytes this shard holds for gradients in flight: every worker's staging, the
        scratch pool and the update rule's own (an exact sum's accumulators)."""
        staged = [*self._staging.values(), *self._raw_staging.values()]
        held = sum(t.numel() * t.element_size() for s in staged for t in s.values())
        policy = self.data.policy
        return held + self.scratch.allocated + (policy.gradient_bytes() if policy else 0)

    # ---- the header --------------------------------------------------------------------

    def begin_push(
        self, header: PushHeader, *, incarnation: int = 0, lock_timeout: float = 60.0
    ) -> PushTicket:
        """Validate a push header; returns the ticket that its data goes into."""
        d = self.data
        with d.cond:
            job = d.require_job()
            check_header(header, job.capacity)
            check_int_buffers(job, header.int_buffers)
            if header.options.given:
                self.updates.take_options(header.options, check_only=True)
            self.members.check_incarnation(incarnation)
            self._check_draining(header.clock)
            lock = self._worker_locks.setdefault(header.worker, threading.Lock())
        # One push per worker at a time: a retry racing its original waits here, then
        # finds the original applied and is acknowledged as a duplicate.
        if not lock.acquire(timeout=lock_timeout):
            raise DeadlineExceeded(f"worker {header.worker}: another push is still in flight")
        try:
            with d.cond:
                self.members.check_incarnation(incarnation)
                duplicate = self.members.check_clock(header)
                policy = self.updates.policy
                if not duplicate:
                    policy.check_push(
                        self.updates, header.worker, header.clock, header.base_version
                    )
                self.members.touch(header.worker)
                absent = check_absent(d.numel, header.absent)
                # Last of the checks: the first data push of a sync round decides how it
                # sums, and must undo that if it is not accepted (on_drop below).
                exact, asked = None, not duplicate and not header.overflow
                if asked:
                    exact = policy.exact_sum(self.updates, header)
                staging = self._staging_for(header.worker, exact is not None)
                ticket = PushTicket(
                    header=header,
                    staging=staging,
                    exact=exact,
                    duplicate=duplicate,
                    lock=lock,
                    incarnation=d.incarnation,
                    absent=absent,
                    raw=d.buffer_keys,
                    asked=asked,
                )
                if policy.applies_chunks or asked:
                    ticket.on_drop = self._push_dropped
                if policy.applies_chunks:
                    policy.push_started(self.updates, ticket)
        except BaseException:
            lock.release()
            raise
        return ticket

    def _staging_for(self, worker: int, exact: bool) -> dict[str, torch.Tensor] | ExactStaging:
        """Where `worker`'s push lands: its own fp32 copy of every slot, or (a push into
        an exact sum) one-slot scratch from the pool, its own copy of the buffers only."""
        d = self.data
        if exact:
            raw = self._raw_staging.get(worker)
            if raw is None:
                raw = {k: torch.empty(d.numel[k]) for k in d.buffer_keys}
                self._raw_staging[worker] = raw
            return ExactStaging(self.scratch, d.numel, raw)
        staging = self._staging.get(worker)
        if staging is None:
            staging = {k: torch.empty(n) for k, n in d.numel.items()}
            self._staging[worker] = staging
        return staging

    def _check_draining(self, clock: int) -> None:
        """Draining: only pushes that finish the sync round already in flight get in."""
        d = self.data
        in_flight = d.policy.round_in_flight() if d.policy is not None else False
        if d.draining and not (in_flight and clock == d.rounds + 1):
            raise Unavailable("draining: this shard is shutting down; retry after its restart")

    # ---- the pieces ------------------------------------------------------------------------

    def add_data(self, ticket: PushTicket, key: str, offset: int, data: bytes) -> None:
        """Copy one piece of a push into the staging buffers (validated first)."""
        add_piece(self.data.numel, ticket, key, offset, data)
        if slot_complete(self.data.numel, ticket, key):
            self._slot_done(ticket, key)

    def add_data_from(
        self,
        ticket: PushTicket,
        key: str,
        offset: int,
        nbytes: int,
        read_into: Callable[[memoryview], None],
        read: Callable[[int], Any],
    ) -> None:
        """add_data for a piece whose bytes are still in a socket: checked from its
        description, then (fp32) read straight into the staging buffer, no copy."""
        add_piece_streamed(self.data.numel, ticket, key, offset, nbytes, read_into, read)
        if slot_complete(self.data.numel, ticket, key):
            self._slot_done(ticket, key)

    def pace_push(self, ticket: PushTicket, offset: int) -> float:
        """Before a slot's first piece is read: wait while this push runs `push_lead_bytes`
        ahead of the slowest other push of its round (ps/server/intake/pacing.py). Returns
        the seconds waited."""
        d = self.data
        if offset or not d.push_lead_bytes or not self.updates.policy.applies_chunks:
            return 0.0
        left = pacing.BUDGET_S - ticket.paced_s
        if left <= 0:
            return 0.0
        t0 = time.monotonic()
        with d.cond:  # the policy is read each time: a restore may replace it
            self._pacing += 1
            try:
                d.cond.wait_for(
                    lambda: not self.updates.policy.push_ahead(ticket, d.push_lead_bytes), left
                )
            finally:
                self._pacing -= 1
            waited = time.monotonic() - t0
            if waited > 1e-4:
                d.push_paced_s += waited
                ticket.paced_s += waited
                d.metrics.push_paced(waited)
        return waited

    def _slot_done(self, ticket: PushTicket, key: str) -> None:
        """A slot of a push is complete: unscale it now, while later slots still stream
        (off the round's critical path), or add it to the round's exact sum; and tell a
        per-chunk policy."""
        if ticket.exact is not None:
            add_exact(ticket, key)
        else:
            unscale_slot(ticket, key)
        if self.updates.policy.applies_chunks:
            d = self.data
            with d.cond:
                if ticket.incarnation == d.incarnation:
                    self.updates.policy.slot_complete(self.updates, ticket, key)
                if self._pacing:
                    d.cond.notify_all()  # a paced push behind this one may go on

    def _push_dropped(self, ticket: PushTicket) -> None:
        """A push ends without being accepted: a per-chunk policy undoes what it applied
        early, then an exact sum subtracts what the push added, and the rule forgets
        what the push decided about its round (nothing of it stays)."""
        with self.data.cond:
            policy = self.updates.policy
            if policy.applies_chunks:
                policy.push_dropped(self.updates, ticket)
            if ticket.exact is not None:
                ticket.exact.withdraw(ticket.header.worker, ticket.header.clock)
            if ticket.asked and ticket.incarnation == self.data.incarnation:
                policy.push_not_accepted(self.updates, ticket.header.worker)
            if self._pacing:
                self.data.cond.notify_all()  # it no longer holds paced pushes back

    def add_verdict(
        self,
        ticket: PushTicket,
        overflow: bool,
        absent: tuple[str, ...] = (),
        options: StepOptions | None = None,
    ) -> None:
        """The finiteness verdict of a push that streamed during backward (and the
        slots it had no gradient for, known only then; and its step options, known
        only when the worker's optimizer steps)."""
        if options is not None and options.given:
            with self.data.cond:
                self.updates.take_options(options, check_only=True)
        named = check_absent(self.data.numel, absent)
        add_verdict(ticket, overflow, named)
        ticket.options = options
        if ticket.exact is not None and named and not overflow:
            # Their bytes (zeros) are in the sum already: counted as absent now.
            h = ticket.header
            ticket.exact.name_absent(h.worker, h.clock, named - ticket.raw)
            for k in named:
                ticket.unscaled[k] = True
        if overflow and self.updates.policy.applies_chunks:
            with self.data.cond:  # the round will be skipped: nothing of it may stay applied
                self.updates.policy.push_dropped(self.updates, ticket)

    # ---- the end -------------------------------------------------------------------------------

    def finish_push(self, ticket: PushTicket) -> tuple[PushOutcome, int, bool]:
        """Validate completeness and finiteness, then hand the push to the policy.

        Returns (outcome, shard version after it, already_applied).
        """
        d = self.data
        try:
            h = ticket.header
            d.metrics.bytes_received(ticket.bytes_in)
            if ticket.duplicate:
                with d.cond:
                    return PushOutcome(False, False, 0), d.version, True
            if h.verdict_follows and ticket.verdict is None:
                check_complete(d.numel, ticket)  # refuses: the verdict never came
            if ticket.verdict:
                h.overflow = True  # data already staged is ignored, like a header overflow
            if not h.overflow:
                check_complete(d.numel, ticket)
                if ticket.exact is None:  # an exact sum counted them as zeros already
                    zero_absent(ticket)
            grads = ticket.staging
            if isinstance(grads, ExactStaging):
                grads = dict(grads.raw)  # the gradients are in the round's exact sum
            if not h.overflow and not unscale_rest(ticket):
                with d.cond:  # sync refuses it; async/ssp drop and count it below
                    self.updates.policy.nonfinite_unflagged(self.updates, h.worker)
                h.overflow = True
            with d.cond:
                # Re-check under the lock: another thread may have moved the round on,
                # or a rollback may have replaced the state the push was checked against.
                if ticket.incarnation != d.incarnation:
                    raise Restored("restored: the shard was rolled back during this push")
                policy = self.updates.policy
                self.members.check_clock(h)
                policy.check_push(self.updates, h.worker, h.clock, h.base_version)
                options = ticket.options or h.options
                if options.given:  # checked on arrival; again before anything changes
                    self.updates.take_options(options, check_only=True)
                staged = StagedPush(
                    h.worker, h.clock, h.base_version, h.overflow, grads, ticket.absent
                )
                if h.overflow and not policy.holds_gradients:
                    staged.grads = {}
                elif (ticket.absent or ticket.raw) and not policy.holds_gradients:
                    # Applied alone (async/ssp): a slot this push has no gradient for
                    # is left alone, not stepped with zeros (apply_update skips it);
                    # buffers are values, taken from rank 0 as DDP broadcasts them.
                    if h.worker == 0:
                        self.updates.set_buffers({k: grads[k] for k in ticket.raw})
                    skip = ticket.absent | ticket.raw
                    staged.grads = {k: g for k, g in grads.items() if k not in skip}
                outcome = self._hand_over(ticket, staged, options)
                if ticket.exact is not None:  # what it added stays: its scratch may go
                    ticket.exact.accept(h.worker, h.clock)
                d.metrics.push_accepted()
                d.cond.notify_all()
                return outcome, d.version, False
        finally:
            ticket.release()

    def _hand_over(
        self, ticket: PushTicket, staged: StagedPush, options: StepOptions
    ) -> PushOutcome:
        """Hand a checked push to the rule (under the lock). An error the checks did not
        foresee (a bug, or a value they missed: issue #45's learning rate that the fp32
        step could not take) is INTERNAL, never UNKNOWN, and leaves no round open: a push
        whose round did not close is undone (its clock, its options, its place in the
        round; ticket.release() then withdraws its data), and a round whose close failed
        is skipped, so the workers' next pushes find the next round open."""
        d, h = self.data, ticket.header
        policy = self.updates.policy
        clock, before, at = d.clocks[h.worker], d.step_options, (d.rounds, d.version)
        d.clocks[h.worker] = h.clock
        deal = None
        if d.ledger is not None:  # elastic data: this step's batches are done
            deal = d.ledger.deals.get(h.worker, {}).get(h.clock)
            d.ledger.consume(h.worker, h.clock)
        ints = d.int_buffers.by_clock.get(h.clock)
        if h.int_buffers and policy.takes_int_buffers(d.int_buffers.held(h.clock), h.worker):
            d.int_buffers.put(h.clock, h.worker, h.int_buffers)
        ticket.accepted = True
        self.updates.take_options(options)
        try:
            return policy.accept(self.updates, staged)
        except Exception as e:
            closed = (d.rounds, d.version) != at
            if not closed:
                ticket.accepted = False
                d.clocks[h.worker] = clock
                d.step_options = before
                if deal is not None and d.ledger is not None:  # the batches are its again
                    d.ledger.deals.setdefault(h.worker, {})[h.clock] = deal
                    d.ledger.consumed -= len(deal)
                if ints is not None:
                    d.int_buffers.by_clock[h.clock] = ints
                else:
                    d.int_buffers.by_clock.pop(h.clock, None)
                policy.accept_failed(self.updates, h.worker)
            d.cond.notify_all()
            what = "its round was skipped" if closed else "nothing of it was applied"
            log.exception("worker %d's push of clock %d failed in the update", h.worker, h.clock)
            raise PSError(
                f"internal error applying worker {h.worker}'s push of clock {h.clock} "
                f"({type(e).__name__}: {e}); {what}: "
                + ("pull and go on" if closed else "retry the push")
                + ", and report this with the shard's log",
                reason="internal",
            ) from None
