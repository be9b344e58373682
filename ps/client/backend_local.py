"""PSBackend's --mode local (local SGD / DiLoCo): H inner steps on the worker, then one
push of the pseudo-gradient and one pull of the new masters.

The worker keeps its inner optimizer (trainkit/local_sgd.py); the shards hold the masters
and the outer optimizer (the job's optimizer, ps/server/modes/local.py), and average the
workers' pseudo-gradients in rank order like a sync round. The worker's clock counts
outer rounds. Pushes stream after the H-th backward (there is nothing to overlap them
with), so the overlap machinery is off in this mode. A part of the PSBackend (it holds
one as `local` in this mode; None in the others).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from psar.ps.client.backend_resync import _MAX_RESYNCS
from psar.ps.client.psclient import NeedsResync
from psar.trainkit.backend import StepOutcome
from psar.trainkit.local_sgd import LocalSteps, outer_optimizer_config
from psar.trainkit.optim import OptimizerConfig, effective_loss_scale


class LocalRounds:
    """The worker's side of --mode local. `backend`: the PSBackend whose client, slots,
    send buffers and clock it works on (typed Any: in ps/ an import of the backend here,
    even for annotations, would be a cycle)."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.steps: LocalSteps | None = None
        """The inner optimizer and anchor, from setup() on (trainkit/local_sgd.py)."""

    def outer_config(self) -> OptimizerConfig:
        """The optimizer the shards apply in this mode: the outer one."""
        lc = self.b.cfg.local
        return outer_optimizer_config(lc.outer_optimizer, lc.effective_lr(), lc.outer_momentum)

    def setup(self) -> None:
        """After the first pull: the worker's weights are the masters, the first anchor."""
        b = self.b
        if b.sparse:
            raise ValueError(
                "--mode local: this model has sparse embedding tables, whose rows the shards "
                "update per step; local SGD averages dense weights only (use --mode sync)"
            )
        ls = effective_loss_scale(b.cfg.loss_scale, b.precision.loss_scaling)
        # A relaunched worker re-enters at the outer round the shards are at (its inner
        # optimizer state starts afresh).
        b.start_step = b.clock * b.cfg.local.sync_every
        self.steps = LocalSteps(
            list(b.params.values()),
            b.cfg.optimizer,
            sync_every=b.cfg.local.sync_every,
            total_steps=b.total_steps,
            loss_scale=ls,
            device=b.device,
            start_step=b.start_step,
        )
        b.loss_scale = self.steps.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The inner steps' own loss scale."""
        assert self.steps is not None, "setup() first"
        return self.steps.scale_loss(loss)

    def step(self) -> StepOutcome:
        """An inner step; every H steps (or as the deal says) also the outer round."""
        local, b = self.steps, self.b
        assert local is not None, "setup() first"
        t0 = time.perf_counter()
        skipped = local.inner_step()
        b.loss_scale = local.loss_scale
        t1 = time.perf_counter()
        if not self._round_due(local):
            return StepOutcome(skipped, b.loss_scale, staleness=0, phases={"optimizer": t1 - t0})
        pseudo, drift, finite = local.pseudo_gradients()
        if finite:
            by_param = dict(zip(b.params, pseudo, strict=True))
            for s in b.slots:
                flat = by_param[s.param].reshape(-1)[s.start : s.start + s.numel]
                b.send[s.key].copy_(flat)  # cast to the wire dtype
        pushed, pulled = b.bytes_pushed, b.bytes_pulled
        # What a resync re-sends if a restored shard lost this push (backend_resync.py).
        b.push_args = {"dtype": b.precision.wire, "loss_scale": 1.0, "overflow": not finite}
        replies = None
        for attempt in range(_MAX_RESYNCS):
            try:
                replies = b.client.push(
                    clock=b.clock + 1,
                    base_versions=b.versions,
                    grads=b.send,
                    retry=attempt > 0,
                    **b.push_args,  # pseudo-gradients are not loss-scaled
                )
                break
            except NeedsResync as e:
                before = b.clock
                b.faults.resync(fresh=False, cause=e)
                if b.clock != before:
                    # The round this pseudo-gradient was for is gone (rollback, or the
                    # others moved on): restart from the masters the shards have now.
                    b.pull_resyncing()
                    local.rebase(0, drift, skipped=True)
                    return StepOutcome(True, b.loss_scale, staleness=0)
        if replies is None:
            raise RuntimeError(f"worker {b.rank}: could not resync with the shards")
        b.clock += 1
        b.pushed = b.clock
        if finite:
            b.bytes_pushed += sum(t.numel() * t.element_size() for t in b.send.values())
        t2 = time.perf_counter()
        wait = b.pull_resyncing()  # the round closes when every worker has pushed
        t3 = time.perf_counter()
        round_skipped = b.headers[0].skipped_rounds > b.skipped_seen
        b.skipped_seen = b.headers[0].skipped_rounds
        nbytes = b.bytes_pushed - pushed + b.bytes_pulled - pulled
        local.rebase(nbytes, drift, skipped=round_skipped)
        return StepOutcome(
            skipped=skipped or round_skipped,
            loss_scale=b.loss_scale,
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
        elastic = self.b.elastic
        if elastic.deals_data:
            return elastic.deal_used >= len(elastic.deal[1])
        return local.due()

    def report(self) -> dict[str, Any]:
        return self.steps.report() if self.steps is not None else {}
