"""PSBackend's overlap of communication with compute (ps/client/overlap.py does the pieces).

A part of the PSBackend (it holds one as `overlap`, made in setup()), so
ps/client/backend.py keeps to the step itself: the push opens from the first full gradient
bucket during backward; the pull runs on in the background after step() returns, and the
next forward waits only for the layers it reaches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from psar.ps.client.errors import NeedsResync
from psar.ps.client.host_cpu import CoLocatedCPU
from psar.ps.client.overlap import PushBuckets
from psar.ps.client.overlap_tuner import ARM_NAMES, Arm, OverlapTuner
from psar.ps.client.pull_gate import PullGate, ungateable_reason
from psar.ps.headers import PullHeader

log = logging.getLogger("psar.ps")


class Overlap:
    """The push buckets, the pull gate, the trial of arms and the threads that push and
    pull. `backend`: the PSBackend whose client, slots, buffers and clock it works on
    (typed Any: in ps/ an import of the backend here, even for annotations, would be a
    cycle)."""

    def __init__(self, backend: Any, model: torch.nn.Module) -> None:
        self.b = b = backend
        ps = b.cfg.ps
        # Sparse row pushes must precede the dense push of their clock, so with sparse
        # tables the dense push starts after backward (ps/client/sparse_worker.py).
        self.enabled = ps.overlap and not b.sparse
        self.buckets = PushBuckets(
            b.params,
            b.slots,
            b.send,
            num_shards=len(b.addresses),
            bucket_bytes=int(ps.bucket_mib * (1 << 20)),
            on_first_bucket=self._first_bucket if self.enabled else lambda: None,
            io=b.io,
            buffers=b.buffers,
        )
        if b.sparse:
            self.buckets.decide = lambda finite: b.sparse.push(b.clock + 1, finite, b.loss_scale)
        # On CUDA pulled bytes land in pinned buffers; each slot goes to the device as
        # soon as it is complete, and forward waits for exactly the slots it reaches.
        # Early pulls land in host buffers too (a slot may arrive while backward still
        # runs), copied into the parameters once the round's header says they hold.
        staged = b.io.cuda or b.early_pull
        self.gate = PullGate(b.slots, b.io, b.load_slot if staged else None)
        self.gate.on_failure = self._recover_pull
        self.pull_enabled = self.enabled and ps.pull_overlap
        why = ungateable_reason(model) if self.pull_enabled else ""
        if why:
            # The gate could not make forward wait for every weight it reads: pulling
            # before forward keeps the bits those of a run without pull overlap.
            log.warning(
                "worker %d: pull overlap off: %s, so forward's parameter reads cannot be "
                "gated; pulling before each forward instead",
                b.rank,
                why,
            )
            self.pull_enabled = False
        # The trial's arms: what is configured first, then the cheaper ones.
        arms: list[Arm] = [(True, True)] if self.pull_enabled else []
        arms += [(True, False), (False, False)] if self.enabled else [(False, False)]
        host = CoLocatedCPU(
            ps.overlap_host_busy,
            cpu_compute=b.device.type == "cpu",
            in_shared_memory=b.client.shards_in_shared_memory,
        )
        self.tuner = OverlapTuner(b.total_steps, ps.overlap_trial, arms, host=host)
        self._step_index = 0
        self._step_started: float | None = None
        self.arm: Arm = arms[0]
        if self.enabled:
            self.buckets.attach()
        if self.pull_enabled:
            self.gate.attach(model, {**b.params, **b.buffers})
        self._push_pool = ThreadPoolExecutor(1, thread_name_prefix="psar-push")
        self._pull_pool = ThreadPoolExecutor(1, thread_name_prefix="psar-pull")
        self.push_future: Future | None = None
        self.pull_future: Future | None = None
        self.early: _Pulling | None = None
        """The early pull of the step whose push is streaming (--early-pull)."""
        self.poisoned = False

    def tune(self, now: float) -> None:
        """This step's push has ended: time the interval since the last one ended and
        pick the arm of this step's pull and the next step's push (ps/client/overlap_tuner.py)."""
        t = self.tuner
        if self._step_started is not None and t.record(
            self._step_index - 1, self.arm, now - self._step_started
        ):
            (log.info if self.b.rank == 0 else log.debug)("worker %d: %s", self.b.rank, t.summary())
        self._step_started = now
        self.arm = t.arm(self._step_index)
        self._step_index += 1

    def report(self) -> dict[str, Any]:
        """For the run's report: the overlap that ran, and the trial's figures."""
        t = self.tuner
        push, pull = t.decision if t.decision is not None else t.arms[0]
        out: dict[str, Any] = {"overlap": {"push": push, "pull": pull}}
        if t.untried:
            out["overlap_untried"] = t.untried
        elif t.decision is not None:
            out["overlap_trial_ms"] = {ARM_NAMES[a]: 1e3 * t.score_s(a) for a in t.arms}
        return out

    def _first_bucket(self) -> None:
        """Backward filled its first bucket: stream now, unless this step's arm pushes
        after backward (the buckets wait in their queues for step())."""
        if self.arm[0]:
            self.start_push()

    def start_push(self) -> None:
        """Open this step's push streams (from the first full bucket, during backward;
        else from step()). Once per step."""
        if self.push_future is not None:
            return
        self.await_pull()  # the previous pull has landed everywhere (normally long ago)
        if self.poisoned:
            return  # this step's gradient is never sent (see step())
        self.push_future = self._push_pool.submit(
            self.b.client.push,
            clock=self.b.clock + 1,
            base_versions=list(self.b.versions),
            dtype=self.b.precision.wire,
            loss_scale=self.b.loss_scale,
            items=self.buckets.items,
            int_buffers=self.b.int_buffers.values(),  # forward has counted this step
        )
        if self.b.early_pull:  # the pull of this very push, streaming back as slots apply
            self.early = self._open_pull(self.b.clock + 1, early=True)

    def _open_pull(self, clock: int, *, early: bool = False) -> _Pulling:
        """Start a pull in the background (the gate closes on every slot)."""
        p = _Pulling(len(self.b.addresses))

        def ended(f: Future) -> None:
            if f.exception() is None:
                self.gate.complete()
            else:
                self.gate.fail()
            p.arrived.set()

        self.gate.begin()
        p.fut = self._pull_pool.submit(
            self.b.client.pull,
            clock=clock,
            dtype=self.b.precision.weights,
            out=self.b.recv,
            on_header=p.on_header,
            on_piece=self.gate.landed,
            early=early,
            cutter=p.cutters,
            clip_total_sq=self.b.clip_total,  # clipping in rounds (backend_own.py)
        )
        p.fut.add_done_callback(ended)
        return p

    def drop_early(self) -> None:
        """This step's push failed: cut its early pull short (its round will not close
        with this push) and forget it; what it landed never reached the parameters."""
        p, self.early = self.early, None
        if p is None:
            return
        for cut in p.cutters:
            cut()
        p.fut.exception()  # waits; its error is the push's to handle

    def pull_in_background(self) -> float:
        """Start the pull and return once every shard's header is in (the round closed;
        the data follows while the next forward runs); returns the seconds waited."""
        return self.await_headers(self._open_pull(self.b.clock))

    def await_headers(self, p: _Pulling) -> float:
        """Return once every shard's header of pull `p` is in; the seconds waited."""
        t0 = time.perf_counter()
        p.arrived.wait()
        fut = p.fut
        headers, waits = p.headers, p.waits
        if p is self.early:  # its clock started with the push: time blocked here only
            self.early = None
            waits = [time.perf_counter() - t0]
        if fut.done() and fut.exception() is not None:
            err = fut.exception()
            if not isinstance(err, NeedsResync):
                raise err
            # Nothing ran on these weights yet: resync and pull again, in full.
            self.b.faults.resync(fresh=False, cause=err, pushed=self.b.pushed)
            wait = self.b.pull_resyncing()
            self.gate.recovered()
            return wait
        self.pull_future = fut
        self.b.took_headers([h for h in headers if h is not None])
        return max(waits)

    def await_pull(self) -> None:
        """Wait until the pull in flight (if any) has landed in full."""
        fut = self.pull_future
        if fut is not None:
            fut.exception()  # waits
            self._recover_pull()

    def _recover_pull(self) -> None:
        """The background pull ended; if it failed, pull again in full (resyncing as the
        shards ask). If a forward already ran on part of its weights, this step's
        gradient is of mixed weights: it is not pushed (step() skips it)."""
        fut, self.pull_future = self.pull_future, None
        if fut is None:
            return
        err = fut.exception()
        if err is None:
            return
        if not isinstance(err, NeedsResync):
            raise err
        self.poisoned = self.poisoned or self.gate.consumed
        log.warning("worker %d: pull failed mid-transfer (%s); pulling again", self.b.rank, err)
        self.b.faults.resync(fresh=False, cause=err, pushed=self.b.pushed)
        self.b.pull_resyncing()
        self.gate.recovered()

    def close(self, *, failed: bool = False) -> None:
        """The run ended: the last pull lands, the hooks come off, the threads end.
        `failed`: push streams end without a verdict (the shards refuse them)."""
        if failed:
            self.buckets.abort()
            return
        self.await_pull()
        self.buckets.detach()
        self.gate.detach()
        self._push_pool.shutdown(wait=False)
        self._pull_pool.shutdown(wait=False)


class _Pulling:
    """A pull in the background: its future, and every shard's header as it comes."""

    def __init__(self, n: int) -> None:
        self.headers: list[PullHeader | None] = [None] * n
        self.waits = [0.0] * n
        self.arrived = threading.Event()
        self.cutters: list[Callable[[], None]] = []
        self.fut: Future = Future()
        self._t0 = time.perf_counter()

    def on_header(self, i: int, h: PullHeader) -> None:
        self.headers[i], self.waits[i] = h, time.perf_counter() - self._t0
        if all(x is not None for x in self.headers):
            self.arrived.set()
