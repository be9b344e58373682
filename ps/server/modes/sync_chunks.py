"""Per-chunk rounds (sync mode, `psar server --chunk-rounds`): a shard applies the
optimizer to a slot as soon as every worker of the round has pushed that slot, while
later slots are still arriving (issue #10; docs/architecture.md).

Why it is speculative: whether a round is skipped (any worker's overflow) is known only
when every worker's push has ended — a worker learns its gradient is finite after its
last bucket, and sends that verdict last. So a slot applied early keeps an undo copy of
its master and optimizer state until the round closes. Whatever changes what the round
would apply restores the applied slots from those copies, bit for bit:
- an overflow verdict (the round will be skipped on every shard, every slot);
- a push refused or cut off after its slots counted (a refused push changes nothing);
- a worker leaving mid-round without having pushed (fewer workers in the mean);
- a checkpoint snapshot or an off-round pull (they must see the closed round).
Slots restored this way are applied again when the round closes, from the staged
gradients. The round itself (version, scheduler step, loss scale, clocks, checkpoint)
closes as before, once every live worker's push is accepted.

The early updates run on an applier thread of the policy, so the thread receiving a
worker's stream never waits for them (torch releases the GIL while it computes). Every
event above invalidates queued work by bumping a generation number under the apply
lock, which an update in progress holds, so an undo never races an update.

Early pulls (ps/server/pulls/early.py) read the slots applied so far while the round is
still open: `writes` counts every change of a slot's master (apply, undo), so a puller
can tell at the close whether what it sent early still holds, and `_wake` is notified
whenever a slot is applied, undone, or the round closes.

Results are bit-identical to the whole-round update: the same fp32 operations per
element, in the same worker-rank order (torch.add(a, b, out=) is a.add_(b)), and torch's
SGD/AdamW (every implementation) step each parameter on its own either way. A round of
fp16 pushes summed exactly (ps/server/modes/exact_sum.py) takes each slot's mean from the
exact sum instead, into the slot's own buffer here (the sum stays whole for a redo).
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any

import torch

from psar.ps.server.intake import pacing
from psar.ps.server.modes.base import StagedPush
from psar.ps.server.modes.exact_sum import ExactSum
from psar.ps.server.modes.rounds import SyncPolicy, unused_by_all

if TYPE_CHECKING:
    from psar.ps.server.intake.pieces import PushTicket
    from psar.ps.server.modes.view import ShardView


class ChunkedSyncPolicy(SyncPolicy):
    """SyncPolicy whose update is applied slot by slot as the round's pushes stream in."""

    applies_chunks = True

    def __init__(self, exact_fp16: bool = False) -> None:
        super().__init__(exact_fp16)
        self.tickets: dict[int, PushTicket] = {}
        """This round's data-carrying push of each worker (kept once accepted)."""
        self.applied: dict[str, tuple[int, ...]] = {}
        """Slots applied early this round -> the workers whose mean they took."""
        self._undo_master: dict[str, torch.Tensor] = {}
        self._undo_state: dict[str, dict[str, Any] | None] = {}
        self._state_bufs: dict[str, dict[str, torch.Tensor]] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self.chunks_early = 0
        """Slots applied before their round's last push was accepted."""
        self.chunk_undos = 0
        """Times the early slots of a round were restored (see the module docstring)."""
        # The applier: queued (generation, key, workers, sources); `_apply_lock` is held
        # by an update in progress and by whatever undoes or closes (shard lock first).
        self._gen = 0
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._apply_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy = False
        self.writes: dict[str, int] = collections.defaultdict(int)
        """Per slot, how many times its master was changed (applied, restored): an early
        pull compares the count it sent a slot at with the count at the round's close."""
        self.retired = False
        """The shard replaced this policy (restore, rollback): early pulls stop waiting."""
        self.early_slots = 0
        """Slots early pulls sent before their round closed (Stats)."""
        self.early_voids = 0
        """Early pulls whose early slots had changed again at the close (Stats)."""
        self.early_bytes: dict[tuple[str, torch.dtype], tuple[int, list]] = {}
        """(slot, dtype) -> (writes, wire pieces): the early pulls of one write share them."""

    # ---- hooks (under the shard lock) -----------------------------------------------

    def push_started(self, view: ShardView, ticket: PushTicket) -> None:
        if ticket.duplicate:
            return  # a retry of an accepted push: its data is dropped, the original counts
        w = ticket.header.worker
        if self.tickets.pop(w, None) is not None:
            self._undo(view)  # defensive: a worker's earlier push ended without a drop
        if not ticket.header.overflow:
            self.tickets[w] = ticket

    def slot_complete(self, view: ShardView, ticket: PushTicket, key: str) -> None:
        if self.tickets.get(ticket.header.worker) is not ticket or key in self.applied:
            return
        if key in view.buffer_keys:
            return  # a buffer's value, taken when the round closes (never stepped)
        workers = self._workers(view)
        sources: list | None = []
        for w in workers:
            t = self.tickets.get(w)
            if t is None or not t.unscaled.get(key, False) or t.verdict:
                return  # not in yet, non-finite (refused at its end), or overflowing
            sources.append(t.staging)
        if self.kind == "exact":
            assert self.exact is not None
            if not set(workers) <= self.exact.counted.get(key, set()):
                return  # a worker's part is not in the sum yet: its own completion queues
            sources = None  # every worker's slot is in the exact sum
        with self._wake:
            self._queue.append((self._gen, key, workers, sources))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(view,), name="psar-chunk-apply", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def push_dropped(self, view: ShardView, ticket: PushTicket) -> None:
        w = ticket.header.worker
        if self.tickets.get(w) is ticket:
            del self.tickets[w]
            self._undo(view)
        elif w not in self.pending and self._applied_with(w):
            # Defensive (issue #45: a cut-off push left early chunks applied): a slot that
            # took the mean with a worker whose push is not accepted does not hold. An
            # undo is always safe: the close applies the restored slots again.
            self._undo(view)

    def _applied_with(self, worker: int) -> bool:
        with self._apply_lock:
            return any(worker in ws for ws in self.applied.values())

    def on_leave(self, view: ShardView, worker: int) -> None:
        if worker not in self.pending:
            # It had not pushed: the round's mean no longer counts it.
            self.tickets.pop(worker, None)
            self._undo(view)
        super().on_leave(view, worker)

    def settle(self, view: ShardView) -> None:
        self._undo(view)

    def quiesce(self) -> None:
        """Wait until every queued early update has run or been dropped."""
        with self._wake:
            self._wake.wait_for(lambda: not self._queue and not self._busy)

    def close(self) -> None:
        """The shard is replacing this policy (restore, rollback): drop queued work."""
        with self._apply_lock:
            self._gen += 1
        self.retired = True
        self._notify()

    def slot_writes(self, key: str) -> int:
        return self.writes[key]

    def push_ahead(self, ticket: PushTicket, lead_bytes: int) -> bool:
        return pacing.ahead(self.tickets, ticket, lead_bytes)

    def _notify(self) -> None:
        """Wake the early pulls: a slot was applied or undone, or the round closed."""
        with self._wake:
            self._wake.notify_all()

    # ---- the applier thread -----------------------------------------------------------

    def _run(self, view: ShardView) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._wake.wait_for(lambda: self._queue, 5.0):
                    self._thread = None  # idle: a new one starts with the next slot
                    return
                gen, key, workers, sources = self._queue.popleft()
                self._busy = True
            try:
                with self._apply_lock:
                    if gen == self._gen and key not in self.applied:
                        self._save(view, key)
                        self._apply(view, key, sources)
                        self.applied[key] = workers
                        self.chunks_early += 1
                        view.metrics.chunk_applied_early()
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    # ---- closing the round ----------------------------------------------------------

    def _close(self, view: ShardView, pushes: list[StagedPush], exact: ExactSum | None) -> None:
        try:
            self._close_round(view, pushes, exact)
        finally:
            self._notify()  # view.rounds has moved on (or the round was skipped)

    def _close_round(
        self, view: ShardView, pushes: list[StagedPush], exact: ExactSum | None
    ) -> None:
        workers = tuple(p.worker for p in pushes)
        self.tickets.clear()
        if any(p.overflow for p in pushes):
            self._undo(view)
            view.skip_round("overflow")
            return
        sources: list | None = [p.grads for p in pushes]
        # A slot some push had no gradient for was applied early from bytes the verdict
        # then declared zeros (the shard zeroed them since): redo it from the zeros; a
        # slot no push used is only restored, never stepped (docs/architecture.md).
        absent = frozenset().union(*(p.absent for p in pushes))
        unused = unused_by_all(pushes)
        buffers = view.buffer_values(sources)
        if exact is not None:  # the exact sum says which slots no worker used
            sources = None
            unused = frozenset(k for k in view.masters if k in exact.numel and exact.unused(k))
        with self._apply_lock:  # waits for an update in progress; drops queued ones
            self._gen += 1
            redo: dict[str, bool] = {}  # slots still to apply -> taken with other workers
            for key in view.masters:
                done = self.applied.pop(key, None)
                if done != workers or key in absent:
                    redo[key] = done is not None
            self.applied.clear()

            def one(key: str) -> None:
                if redo[key]:  # go back, then redo
                    self._restore(view, key)
                if key not in unused and key not in buffers:
                    self._apply(view, key, sources)

            # Slots are independent (own master, state, undo and sum buffers): the
            # shard's update threads may take them in any order, same bits.
            view.set_buffers(buffers)
            view.step_each(redo, one)
        view.finish_update(staleness=[0] * len(pushes))

    # ---- one slot -------------------------------------------------------------------

    def _workers(self, view: ShardView) -> tuple[int, ...]:
        """Whose gradients the round's mean takes if it closed now: every live worker,
        and any that pushed and then left."""
        return tuple(sorted(view.live | self.pending.keys()))

    def _apply(
        self, view: ShardView, key: str, sources: list[dict[str, torch.Tensor]] | None
    ) -> None:
        """Mean of the sources' slot in rank order (as SyncPolicy sums), or of the exact
        sum (sources None), one step on it."""
        if sources is None:
            assert self.exact is not None
            grad = self._sums.get(key)
            if grad is None:
                grad = self._sums[key] = torch.empty(self.exact.numel[key])
            view.step_slot(key, self.exact.mean(key, out=grad))
            self.writes[key] += 1
            return
        if len(sources) == 1:
            grad = sources[0][key]
        else:
            grad = self._sums.get(key)
            if grad is None:
                grad = self._sums[key] = torch.empty_like(sources[0][key])
            torch.add(sources[0][key], sources[1][key], out=grad)
            for s in sources[2:]:
                grad.add_(s[key])
            grad.div_(len(sources))
        view.step_slot(key, grad)
        self.writes[key] += 1

    def _undo(self, view: ShardView) -> None:
        with self._apply_lock:
            self._gen += 1  # queued updates were decided on what no longer holds
            if not self.applied:
                return
            for key in self.applied:
                self._restore(view, key)
            self.applied.clear()
        self.chunk_undos += 1
        view.metrics.chunk_undo()
        self._notify()

    def _save(self, view: ShardView, key: str) -> None:
        """Copy the slot's master and optimizer state into persistent undo buffers."""
        p = view.masters[key]
        buf = self._undo_master.get(key)
        if buf is None:
            buf = self._undo_master[key] = torch.empty_like(p.detach())
        buf.copy_(p.detach())
        state = view.optimizer.state.get(p)
        if not state:
            self._undo_state[key] = None
            return
        bufs = self._state_bufs.setdefault(key, {})
        saved: dict[str, Any] = {}
        for name, v in state.items():
            if isinstance(v, torch.Tensor):
                b = bufs.get(name)
                if b is None or b.shape != v.shape or b.dtype != v.dtype:
                    b = bufs[name] = torch.empty_like(v)
                b.copy_(v)
                saved[name] = b
            else:
                saved[name] = v
        self._undo_state[key] = saved

    def _restore(self, view: ShardView, key: str) -> None:
        self.writes[key] += 1
        p = view.masters[key]
        p.detach().copy_(self._undo_master[key])
        saved = self._undo_state[key]
        if saved is None:
            view.optimizer.state.pop(p, None)  # the step created it
            return
        cur = view.optimizer.state[p]
        for name in [n for n in cur if n not in saved]:
            del cur[name]
        for name, v in saved.items():
            old = cur.get(name)
            if isinstance(v, torch.Tensor):
                if isinstance(old, torch.Tensor) and old.shape == v.shape:
                    old.copy_(v)
                else:
                    cur[name] = v.clone()
            else:
                cur[name] = v
