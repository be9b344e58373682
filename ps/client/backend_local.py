"""PSBackend's --mode local (local SGD / DiLoCo): H inner steps on the worker, then one
push of the pseudo-gradient and one pull of the new masters.

The worker keeps its inner optimizer (trainkit/local_sgd.py); the shards hold the masters
and the outer optimizer (the job's optimizer, ps/server/modes/local.py), and average the
workers' pseudo-gradients in rank order like a sync round. The worker's clock counts
outer rounds. Pushes stream after the H-th backward (there is nothing to overlap them
with), so the overlap machinery is off in this mode.
"""

from __future__ import annotations

import time
from typing import Any

from psar.ps.client.backend_resync import _MAX_RESYNCS
from psar.ps.client.psclient import NeedsResync
from psar.trainkit.backend import StepOutcome
from psar.trainkit.local_sgd import LocalSteps, outer_optimizer_config
from psar.trainkit.optim import OptimizerConfig, effective_loss_scale


class LocalMixin:
    """Needs PSBackend's cfg, client, params, slots, _send, clock, versions, ..."""

    cfg: Any
    client: Any
    local: LocalSteps | None
    deals_data: bool
    _deal: tuple[int, tuple[int, ...]]
    _deal_used: int

    def _outer_config(self) -> OptimizerConfig:
        """The optimizer the shards apply in this mode: the outer one."""
        lc = self.cfg.local
        return outer_optimizer_config(lc.outer_optimizer, lc.effective_lr(), lc.outer_momentum)

    def _setup_local(self) -> None:
        """After the first pull: the worker's weights are the masters, the first anchor."""
        if self.sparse:
            raise ValueError(
                "--mode local: this model has sparse embedding tables, whose rows the shards "
                "update per step; local SGD averages dense weights only (use --mode sync)"
            )
        ls = effective_loss_scale(self.cfg.loss_scale, self.precision.loss_scaling)
        # A relaunched worker re-enters at the outer round the shards are at (its inner
        # optimizer state starts afresh).
        self.start_step = self.clock * self.cfg.local.sync_every
        self.local = LocalSteps(
            list(self.params.values()),
            self.cfg.optimizer,
            sync_every=self.cfg.local.sync_every,
            total_steps=self.total_steps,
            loss_scale=ls,
            device=self.device,
            start_step=self.start_step,
        )
        self.loss_scale = self.local.loss_scale

    def _local_step(self, local: LocalSteps) -> StepOutcome:
        t0 = time.perf_counter()
        skipped = local.inner_step()
        self.loss_scale = local.loss_scale
        t1 = time.perf_counter()
        if not self._round_due(local):
            return StepOutcome(skipped, self.loss_scale, staleness=0, phases={"optimizer": t1 - t0})
        pseudo, drift, finite = local.pseudo_gradients()
        if finite:
            by_param = dict(zip(self.params, pseudo, strict=True))
            for s in self.slots:
                flat = by_param[s.param].reshape(-1)[s.start : s.start + s.numel]
                self._send[s.key].copy_(flat)  # cast to the wire dtype
        pushed, pulled = self.bytes_pushed, self.bytes_pulled
        # What a resync re-sends if a restored shard lost this push (backend_resync.py).
        self._push_args = {"dtype": self.precision.wire, "loss_scale": 1.0, "overflow": not finite}
        replies = None
        for attempt in range(_MAX_RESYNCS):
            try:
                replies = self.client.push(
                    clock=self.clock + 1,
                    base_versions=self.versions,
                    grads=self._send,
                    retry=attempt > 0,
                    **self._push_args,  # pseudo-gradients are not loss-scaled
                )
                break
            except NeedsResync as e:
                before = self.clock
                self._resync(fresh=False, cause=e)
                if self.clock != before:
                    # The round this pseudo-gradient was for is gone (rollback, or the
                    # others moved on): restart from the masters the shards have now.
                    self._pull_resyncing()
                    local.rebase(0, drift, skipped=True)
                    return StepOutcome(True, self.loss_scale, staleness=0)
        if replies is None:
            raise RuntimeError(f"worker {self.rank}: could not resync with the shards")
        self.clock += 1
        self._pushed = self.clock
        if finite:
            self.bytes_pushed += sum(b.numel() * b.element_size() for b in self._send.values())
        t2 = time.perf_counter()
        wait = self._pull_resyncing()  # the round closes when every worker has pushed
        t3 = time.perf_counter()
        round_skipped = self._headers[0].skipped_rounds > self._skipped_seen
        self._skipped_seen = self._headers[0].skipped_rounds
        nbytes = self.bytes_pushed - pushed + self.bytes_pulled - pulled
        local.rebase(nbytes, drift, skipped=round_skipped)
        return StepOutcome(
            skipped=skipped or round_skipped,
            loss_scale=self.loss_scale,
            staleness=0,
            phases={
                "optimizer": t1 - t0,
                "push": t2 - t1,
                "wait": wait,
                "pull": max(0.0, t3 - t2 - wait),
            },
            outer_round=True,
            round_bytes=nbytes,
            drift=drift,
        )

    def _round_due(self, local: LocalSteps) -> bool:
        """Does this inner step end an outer round? Every H steps and the run's last; in
        an elastic job, when the round's dealt batches are all taken (H steps' worth)."""
        if self.deals_data:
            return self._deal_used >= len(self._deal[1])
        return local.due()

    def local_report(self) -> dict[str, Any]:
        return self.local.report() if self.local is not None else {}
