"""PSBackend: the training loop's backend for the parameter-server architecture.

Each step: the gradients (fp16/bf16/fp32 as --wire-dtype says) are pushed to every
shard, then the new weights are pulled back. Pulls wait as the consistency mode
requires (the sync round closes; the slowest SSP worker catches up). The worker acts on
the traits of the shards' mode (ps/job.py ModeTraits, sent with the job), never on its
name: where the shards own the loss scale (sync) it comes with every pull, so workers
never drift apart.

With --overlap (the default) the push streams bucket by bucket while backward runs,
and the pull runs on in the background after step() returns: the next forward waits
only for the layers it reaches (ps/client/overlap.py). The phases reported per step (push,
wait, pull) are the *exposed* parts: time the training thread spent blocked on them.

Faults (docs/reliability.md): the worker registers on every shard at start (a restarted
worker continues from the shards' record of its clock), heartbeats to keep its lease,
and re-registers when a shard asks for it (ps/client/backend_resync.py). A pull that fails
after a forward already used part of its weights makes that step a skipped one: its
gradient is never pushed, so no gradient of mixed weights is ever applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

import torch

from psar.ps import auth
from psar.ps.client.backend_elastic import Elastic, elastic_note
from psar.ps.client.backend_local import LocalRounds
from psar.ps.client.backend_overlap import Overlap
from psar.ps.client.backend_own import OwnLoopPart, OwnOptimizer
from psar.ps.client.backend_resync import _MAX_RESYNCS, Resync
from psar.ps.client.backend_tables import TablesOnly
from psar.ps.client.int_buffers import IntBuffers
from psar.ps.client.locality import resolve_early_pull
from psar.ps.client.psclient import ClientConfig, NeedsResync, PSClient
from psar.ps.client.reach import LISTEN_WAIT_S, wait_until_listening
from psar.ps.headers import PullHeader
from psar.ps.job import Job, ModeTraits
from psar.ps.partition import Slot, bytes_per_shard, check_every_shard_holds_a_slot, plan_slots
from psar.trainkit.backend import ArchInfo, BackendContext, OnContext, StepOutcome
from psar.trainkit.choices import chunk_rounds
from psar.trainkit.config import TrainConfig
from psar.trainkit.device_io import DeviceIO, state_to_host, to_host
from psar.trainkit.optim import DynamicLossScale, StepOptions, effective_loss_scale, with_run_length
from psar.trainkit.recorder import NullWorkerRecorder, WorkerRecorder
from psar.trainkit.sparse_tables import release_tables

log = logging.getLogger("psar.ps")


class PSBackend(OnContext):
    """One PS worker's backend: the step itself here; each concern a part it holds
    (`overlap`, `faults`, `local`, `own`, `elastic`: ps/client/backend_*.py) and calls,
    as the shard holds its components (ps/server/shard.py)."""

    @classmethod
    def describe(cls, cfg: TrainConfig) -> ArchInfo:
        """--mode; async/ssp apply gradients to newer weights (sync: 0), and each worker
        is its own process with its own staleness and faults: a report per rank.
        --rank/--world-size; -1/0 leave them to the launcher's environment (Backend)."""
        return ArchInfo(
            arch="ps",
            mode=cfg.ps.mode,
            staleness=True,
            per_rank=True,
            flag_rank=cfg.ps.rank,
            flag_world_size=cfg.ps.world_size,
            tables_on_shards=True,
        )

    @classmethod
    def from_config(cls, ctx: BackendContext) -> PSBackend:
        """The loop's one way to build a backend (Backend protocol). A PS worker pushes
        whichever gradients exist, so ctx.find_unused_parameters (a DDP need) is unused."""
        return cls(ctx)

    def __init__(self, ctx: BackendContext) -> None:
        cfg = ctx.cfg
        if cfg.local_sgd:  # pseudo-gradients go after the H-th backward: nothing to overlap
            cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, overlap=False))
        self.ctx = ctx
        self.cfg = cfg
        self.mode = cfg.ps.mode
        self.total_steps = ctx.total_steps
        metrics = ctx.metrics
        self.metrics: WorkerRecorder = metrics if metrics is not None else NullWorkerRecorder()
        self.addresses = cfg.ps.server_list()
        self.clock = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        ls = effective_loss_scale(cfg.loss_scale, ctx.precision.loss_scaling)
        self._ls_cfg = ls
        # Where the shards own the scale (their traits say) it comes with every pull;
        # elsewhere each worker keeps its own.
        self._local_scale = DynamicLossScale(ls)
        self.loss_scale = self._local_scale.scale
        self.skipped_seen = 0
        self.instance = secrets.token_hex(8)
        self.traits: ModeTraits
        """How the shards' mode behaves (from GetJob, in setup)."""
        self.clip_total: float | None = None
        """This step's round squared norm, sent with its pull (clipping in rounds)."""
        # The parts (ps/client/backend_*.py); the overlap's is made in setup().
        self.faults = Resync(self)
        """Re-registering with the shards, and the fault figures."""
        self.elastic = Elastic(self, cfg, ctx.world_size)
        """Joining a running job, the dealt data, leaving."""
        self.dealer = self.elastic if cfg.elastic else None
        self.local = LocalRounds(self) if cfg.local_sgd else None
        """--mode local: the inner steps and the outer rounds."""
        self.own = OwnLoopPart(self)
        """A loop of the user's own: its optimizer on the shards, each step's options."""
        self.tables = TablesOnly(self)
        """Steps of the tables alone, for a job whose dense part is not the shards'."""
        self.job_staleness = 0
        """The job's SSP bound (from GetJob, in setup)."""
        self.overlap: Overlap
        """Push during backward, pull during forward (setup() makes it)."""

    # ---- setup ----------------------------------------------------------------------

    def setup(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.nn.Module:
        if optimizer is not None and self.cfg.local_sgd:
            raise ValueError(
                "--mode local runs psar's own inner optimizer; a loop of your own runs under "
                "--mode sync, async or ssp"
            )
        self.io = DeviceIO(self.device)
        release_tables(model)  # the shards hold the sparse tables' rows (docs/sparse.md)
        model.to(self.device)
        self.model = model
        from psar.ps.client.sparse_worker import SparseSide  # sparse tables: docs/sparse.md

        self.sparse = SparseSide(self, model)
        params = [
            (n, p)
            for n, p in model.named_parameters()
            if p.requires_grad and p.is_floating_point() and n not in self.sparse.names
        ]
        self.params = dict(params)
        if optimizer is not None:
            self.own.optimizer = OwnOptimizer.of(optimizer, self.params)
        # Buffers (BatchNorm running stats) live on the shards too, as slots that are
        # never stepped: rank 0's values (or the mean, --buffers average) come back with
        # every pull, as DDP broadcasts rank 0's before every forward. Local SGD keeps
        # each worker's own (its pushes are pseudo-gradients of the parameters only).
        self.buffers = {
            n: b
            for n, b in model.named_buffers()
            if b.is_floating_point() and b.numel() and not self.cfg.local_sgd
        }
        # Integer ones (num_batches_tracked) travel exactly in shard 0's headers.
        self.int_buffers = IntBuffers(model, enabled=not self.cfg.local_sgd)
        chunk = int(self.cfg.ps.chunk_mib * (1 << 20))
        self.slots: list[Slot] = plan_slots(
            [(n, t.numel()) for n, t in [*params, *self.buffers.items()]],
            len(self.addresses),
            chunk_bytes=chunk,
        )
        check_every_shard_holds_a_slot(self.slots, len(self.addresses), self.cfg.ps.chunk_mib)
        # Early pulls (and the per-chunk rounds they need) are the job's: rank 0 proposes
        # them, every worker follows what the shards then serve (below).
        # A loop of its own (and clipping) sends the step's learning rates and clip when
        # its optimizer steps, after backward: the shards apply whole rounds (Job says so).
        self.sends_step_options = self.own.optimizer is not None or bool(self.cfg.clip_grad_norm)
        self.early_pull = resolve_early_pull(
            self.cfg.ps.early_pull,
            eligible=chunk_rounds(self.mode)
            and not self.sparse
            and not self.cfg.local_sgd
            and not self.sends_step_options,
            data_plane=self.cfg.ps.data_plane,
            addresses=self.addresses,
        )
        jobs = self._jobs()
        ps = self.cfg.ps
        # Nothing at --servers: say so in seconds, not after gRPC's deadline.
        wait_until_listening(self.addresses, within_s=min(LISTEN_WAIT_S, ps.timeout_s))
        self.client = PSClient(
            self.addresses,
            worker=self.rank,
            cfg=ClientConfig.of(  # the [ps] connection fields, as they are
                ps, auth_token=auth.read_token(ps.auth_token_file) if ps.auth_token_file else ""
            ),
        )
        self.client.set_slots(self.slots)
        if self.sparse:
            self.sparse.setup()  # before the dense init: a served job implies its tables
            self.sparse.watch(model)  # every table's rows at once, where the model can say
        if self.rank == 0 and not self.cfg.ps.join:
            values = {s.key: to_host(self._view(s), torch.float32) for s in self.slots}
            try:
                self.client.init(jobs, values, self.own.init_state())
            except Exception as e:  # the waiting workers fail now, with this reason
                self.client.report_init_failure(str(e))
                raise
            per = bytes_per_shard(self.slots, len(self.addresses))
            log.info(
                "bytes per shard: %s",
                ", ".join(f"{i}: {b / 2**20:.2f} MiB" for i, b in enumerate(per)),
            )
            del values
        # Low-precision worker weights only now: rank 0 initialised the fp32 masters from
        # the model's own fp32 values (as DDP starts from them), sent from the parameters'
        # memory, not from an fp32 copy beside fp16 ones (bench/lib/memory.py: that copy
        # was a worker's peak, 6 bytes per parameter; now the fp32 model it was built in).
        if self.precision.weights != torch.float32:
            model.to(self.precision.weights)
        got = self._await_jobs()
        if self.cfg.ps.join and got[0] is not None:
            jobs = self.elastic.enter_running_job(jobs, got[0])
        self.elastic.check_size(got[0])  # workers that disagree about the size stop the job
        for i, (want, have) in enumerate(zip(jobs, got, strict=True)):
            if have is None:
                raise RuntimeError(
                    f"worker {self.rank}: the worker of rank 0 never initialised shard {i} "
                    f"({self.addresses[i]}) within --timeout-s {self.cfg.ps.timeout_s:g}; is "
                    "it running, with the same --servers? (a shard restarted without "
                    "--restore stays empty: rank 0 only initialises at start)"
                )
            if have.traits is None:
                raise RuntimeError(
                    f"shard {i} ({self.addresses[i]}) did not say how its mode behaves (an "
                    "older psar?); run the same psar version on workers and shards"
                )
            self.traits = have.traits
            self.job_staleness = have.staleness
            # Rank 0 decided the job's early pulls: every worker takes them from it.
            want = dataclasses.replace(
                want, early_pull=have.early_pull, chunk_rounds=have.chunk_rounds
            )
            if have != want.served(have.traits):
                raise RuntimeError(
                    f"shard {i} ({self.addresses[i]}) serves a different job (mode {have.mode}, "
                    f"{have.num_workers} workers, {len(have.slots)} slots, id {have.job_id!r}"
                    f"{elastic_note(have, want)}); check --servers order, --mode, --world-size, "
                    "--max-workers and the model on every worker"
                )
        self.elastic.take_rank()  # --join: a rank only once the job served is this one
        io = self.io
        self.send = {s.key: io.host_buffer(s.numel, self.precision.wire) for s in self.slots}
        self.early_pull = got[0].early_pull if got else self.early_pull
        asked = self.cfg.ps.early_pull
        if self.rank == 0 or (asked is not None and asked != self.early_pull):
            log.info("worker %d: early pulls %s (the job's)", self.rank,
                     "on" if self.early_pull else "off")  # fmt: skip
        # On CPU, pulled bytes land straight in the parameters; on CUDA they land in
        # pinned host buffers and go to the device slot by slot (trainkit/device_io.py),
        # and so do early pulls (their slots may arrive while backward still runs).
        self._views = {s.key: self._view(s) for s in self.slots}
        if io.cuda or self.early_pull:
            self.recv = {s.key: io.host_buffer(s.numel, self.precision.weights) for s in self.slots}
        else:
            self.recv = dict(self._views)
        self._bwd_done = None
        self.versions = [0] * len(self.addresses)
        self.seen_versions = [0] * len(self.addresses)
        self.pushed: int | None = None
        self.push_args: dict[str, Any] = {}
        self.overlap = Overlap(self, model)
        # Its verdict waits for step(): the step's options travel with it.
        self.overlap.buckets.hold_verdict = self.sends_step_options
        self.faults.resync(fresh=True)
        self.start_step = self.clock
        self.client.start_heartbeats()
        self.pull_resyncing()
        self.overlap.buckets.begin_step()
        if self.local is not None:
            self.local.setup()
        return model

    def _await_jobs(self) -> list[Job | None]:
        """Every shard's job, once rank 0 has initialised them: waited for at most
        --timeout-s, saying every few seconds what it waits for."""
        bound = self.cfg.ps.timeout_s
        shards = ", ".join(f"{i} ({a})" for i, a in enumerate(self.addresses))

        def describe(seconds: float) -> str:
            return (
                f"worker {self.rank}: waiting {seconds:.0f} s of --timeout-s {bound:g} for "
                f"the worker of rank 0 to initialise shard(s) {shards}"
            )

        with self.client.waits.waiting(describe):
            return self.client.get_jobs(wait=True, timeout_s=bound)

    def _jobs(self) -> list[Job]:
        opt = with_run_length(self.cfg.optimizer, self.total_steps)
        if self.local is not None:  # the shards apply the outer optimizer
            opt = self.local.outer_config()
        elastic, own = self.elastic, self.own.optimizer
        data_batches, stream = elastic.data_plan if elastic.deals_data else (0, "")
        if own is not None:  # the user's: its class, groups, and schedule of its own
            opt = own.config
        return [
            Job(
                mode=self.mode,
                staleness=self.cfg.ps.staleness,
                num_workers=self.world_size,
                optimizer=opt,
                loss_scale=self._ls_cfg,  # the shards drop it where they do not own the scale
                shard_index=i,
                num_shards=len(self.addresses),
                slots=[s for s in self.slots if s.shard == i],
                job_id=self.cfg.ps.job_id,
                staleness_rule=self.cfg.ps.staleness_rule,
                staleness_lr=self.cfg.ps.staleness_lr,
                delay_compensation=self.cfg.ps.delay_compensation,
                momentum_correction=self.cfg.ps.momentum_correction,
                staleness_lr_power=self.cfg.ps.staleness_lr_power,
                dc_adaptive=self.cfg.ps.dc_adaptive,
                sync_every=self.cfg.local.sync_every,
                buffer_slots=tuple(
                    s.key for s in self.slots if s.shard == i and s.param in self.buffers
                ),
                buffers_average=self.cfg.ps.buffers == "average",
                int_buffers=self.int_buffers.spec() if i == 0 else (),
                max_workers=self.cfg.ps.max_workers,
                data_batches=data_batches,
                data_per_step=self.cfg.grad_accum * max(1, self.cfg.local.sync_every),
                data_stream=stream,
                param_groups=(
                    own.groups_on([s for s in self.slots if s.shard == i])
                    if own is not None
                    else ()
                ),
                chunk_rounds=self.early_pull,
                early_pull=self.early_pull,
                step_options=self.sends_step_options,
            )
            for i in range(len(self.addresses))
        ]

    def _view(self, s: Slot) -> torch.Tensor:
        p = self.params[s.param] if s.param in self.params else self.buffers[s.param]
        if not p.is_contiguous():
            raise ValueError(f"parameter {s.param} is not contiguous; call .contiguous() on it")
        return p.data.view(-1)[s.start : s.start + s.numel]

    # ---- the step -------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self._accumulating()  # nothing travels until the last micro-batch

    @contextlib.contextmanager
    def _accumulating(self) -> Iterator[None]:
        buckets = self.overlap.buckets
        buckets.accumulating = True
        try:
            yield
        finally:
            buckets.accumulating = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.local is not None:
            return self.local.scale_loss(loss)  # the inner steps' own loss scale
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def step(self, options: StepOptions | None = None) -> StepOutcome:
        if self.local is not None:
            return self.local.step()
        if options is None and self.cfg.clip_grad_norm:
            options = StepOptions(clip_norm=self.cfg.clip_grad_norm)
        options = self.own.step_options(options)
        t0 = time.perf_counter()
        # Pulled weights may overwrite the parameters only once the compute stream is
        # done with this step's backward (CUDA; None on a CPU).
        self._bwd_done = self.io.mark()
        fwd_wait = self.overlap.gate.take_waited()
        if self.overlap.push_future is None:
            self.overlap.start_push()  # no hook fired (overlap off, or no gradient at all)
        finite = self.overlap.buckets.finish(options)
        if self.overlap.poisoned:
            # A background pull failed after this step's forward had used part of its
            # weights: the gradient is of mixed weights. It is not pushed; the clock
            # stays, so the next step fills the same round.
            self.overlap.poisoned = False
            self.faults.unsent_steps += 1
            self.overlap.buckets.begin_step()
            return StepOutcome(skipped=True, loss_scale=self.loss_scale, staleness=0)
        future, self.overlap.push_future = self.overlap.push_future, None
        self.push_args = {
            "dtype": self.precision.wire,
            "loss_scale": self.loss_scale,
            "overflow": not finite,
            "absent": frozenset(self.overlap.buckets.absent),
            "int_buffers": self.int_buffers.values(),
            "options": options,
        }
        self.pushed = None
        replies = None
        for attempt in range(_MAX_RESYNCS):
            try:
                if attempt == 0:
                    assert future is not None
                    replies = future.result()
                else:
                    replies = self.client.push(
                        clock=self.clock + 1,
                        base_versions=self.versions,
                        grads=self.send,
                        retry=True,
                        **self.push_args,
                    )
                break
            except NeedsResync as e:
                self.overlap.drop_early()  # its round will not close with this push
                before = self.clock
                self.faults.resync(fresh=False, cause=e)
                if self.traits.rounds and self.clock != before:
                    # The round this gradient was for is gone (rollback, or the others
                    # moved on without us): drop it and continue from the new weights.
                    self.pull_resyncing()
                    self.sync_scale()
                    self.overlap.buckets.begin_step()
                    return StepOutcome(skipped=True, loss_scale=self.loss_scale, staleness=0)
        if replies is None:
            raise RuntimeError(f"worker {self.rank}: could not resync with the shards")
        self.clock += 1
        self.pushed = self.clock
        for i, r in enumerate(replies):
            self.seen_versions[i] = max(self.seen_versions[i], r.version)
        if finite:
            self.bytes_pushed += sum(b.numel() * b.element_size() for b in self.send.values())
        # Clipping in rounds: every shard's part of the round's squared norm, the total
        # then going with the pull (ps/server/update/clipping.py).
        self.clip_total, grad_norm = self.own.round_total(options)
        t1 = time.perf_counter()
        self.overlap.tune(t1)  # the push has ended: pick the arm of what follows
        in_background = (
            self.overlap.pull_enabled and self.overlap.arm[1] and self.clock < self.total_steps
        )
        if self.overlap.early is not None:  # --early-pull: this push's pull is streaming already
            wait = self.overlap.await_headers(self.overlap.early)
            if not in_background:
                self.overlap.await_pull()
                self.overlap.gate.settle_device()
        elif in_background:
            wait = self.overlap.pull_in_background()
        else:
            wait = self.pull_resyncing()  # the last step: everything lands before eval/save
        t2 = time.perf_counter()
        staleness = max(int(r.staleness) for r in replies)
        if self.traits.shard_owns_loss_scale:
            skipped = self.headers[0].skipped_rounds > self.skipped_seen
            self.sync_scale()
        else:
            skipped = not finite
            self._local_scale.update(overflow=skipped)
            self.loss_scale = self._local_scale.scale
        self.overlap.buckets.begin_step()
        cache = self.sparse.take_cache_counts() if self.sparse else None
        return StepOutcome(
            skipped=skipped,
            loss_scale=self.loss_scale,
            staleness=staleness,
            grad_norm=grad_norm,
            phases={
                "push": t1 - t0,
                "wait": wait,
                "pull": max(0.0, t2 - t1 - wait) + fwd_wait,
            },
            cache_lookups=cache.lookups if cache else 0,
            cache_hits=cache.hits if cache else 0,
            cache_bytes_saved=cache.bytes_saved if cache else 0,
        )

    def sync_scale(self) -> None:
        self.skipped_seen = self.headers[0].skipped_rounds
        self.loss_scale = self.headers[0].loss_scale

    def pull_resyncing(self) -> float:
        """_pull, re-registering first whenever a shard asks for it."""
        for _ in range(_MAX_RESYNCS):
            try:
                return self._pull()
            except NeedsResync as e:
                self.faults.resync(fresh=False, cause=e, pushed=self.pushed)
        raise RuntimeError(f"worker {self.rank}: could not resync with the shards")

    def _pull(self) -> float:
        """Pull the newest weights this worker may see; returns seconds spent waiting."""
        self.overlap.await_pull()
        self.overlap.gate.settle_host()  # CUDA: the last copies out of the host buffers are done
        dtype = self.precision.weights
        headers = self.client.pull(
            clock=self.clock, dtype=dtype, out=self.recv, clip_total_sq=self.clip_total
        )
        self.took_headers(headers)
        self.overlap.gate.loaded_all()
        # The shards answer only once the round/bound allows: time to the first reply
        # message is the wait; the rest of the pull is the transfer.
        return self.client.last_pull_wait_s

    def took_headers(self, headers: list[PullHeader]) -> None:
        dtype = self.precision.weights
        self.headers = headers
        self.versions = [h.version for h in self.headers]
        self.seen_versions = [
            max(a, b) for a, b in zip(self.seen_versions, self.versions, strict=True)
        ]
        self.bytes_pulled += sum(s.numel for s in self.slots) * dtype.itemsize
        if self.int_buffers and self.headers:
            self.int_buffers.load(self.headers[0].int_buffers)  # shard 0's: rank 0's
        if self.elastic.deals_data and self.headers:  # shard 0 deals the next push's batches
            self.elastic.took_header(self.headers[0])
        if self.traits.shard_owns_loss_scale:
            self.loss_scale = self.headers[0].loss_scale

    def load_slot(self, key: str) -> Any:
        """A pulled slot is in its host buffer: copy it to its parameter (CUDA)."""
        return self.io.load_in(self._views[key], self.recv[key], after=self._bwd_done)

    def state_dict(self) -> dict[str, Any]:
        self.overlap.await_pull()
        self.overlap.gate.settle_device()
        state = state_to_host(self.model.state_dict())
        if self.sparse:  # the worker holds no tables: fetch them from the shards
            state = self.sparse.fill_state(state)
        if self.precision.weights == torch.float32:
            return state
        # Low-precision worker weights: fetch the fp32 masters for the saved copy.
        full = {s.key: torch.empty(s.numel) for s in self.slots}
        self.client.pull(clock=self.clock, dtype=torch.float32, out=full)
        out = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        for s in self.slots:
            out[s.param].view(-1)[s.start : s.start + s.numel].copy_(full[s.key])
        return out

    def comm_bytes(self) -> dict[str, int]:
        """A PS worker sends its gradient once and receives the weights once (sparse
        tables: the rows it pushed and pulled)."""
        sparse = self.sparse.report() if getattr(self, "sparse", None) else {}
        return {
            "bytes_pushed": self.bytes_pushed,
            "bytes_pulled": self.bytes_pulled,
            "bytes_sent": self.bytes_pushed + sparse.get("sparse_bytes_pushed", 0),
            "bytes_received": self.bytes_pulled + sparse.get("sparse_bytes_pulled", 0),
        }

    def remote_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The state of the user's optimizer where the shards hold it (Backend protocol;
        backend_own.py)."""
        return self.own.remote_state()

    def report(self, *, final: bool = False) -> dict[str, Any]:
        """The bytes (Backend protocol); `final`: then the shards' figures (rank 0), the
        fault figures, the overlap run, and the integer buffers this worker ended with
        (carried through shard 0's headers)."""
        out: dict[str, Any] = self.comm_bytes()
        if not final:
            return out
        # Rank 0's, and an elastic job's model writer's (rank 0 may have left long before).
        writer = self.dealer is not None and self.elastic.writes_model
        out["shards"] = self.client.stats() if self.rank == 0 or writer else []
        out.update(self.faults.report())
        out.update(self.overlap.report())
        out.update(self.local.report() if self.local is not None else {})
        if self.int_buffers:
            out["int_buffers"] = {k: list(v) for k, v in self.int_buffers.values().items()}
        return out

    def finish(self, *, failed: bool = False, why: str = "") -> None:
        if failed:
            if why:  # the others wait on this worker's step: the job stops, told why
                self.client.stop_job(self.world_size, reason=why)
            self.overlap.close(failed=True)
            self.client.close()  # in-flight pulls and pushes end (cancelled)
            return
        self.overlap.close()
        if not self.elastic.left_job:
            self.client.leave()
        self.client.close()
