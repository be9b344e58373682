"""Your own training loop on psar: one call, `prepare(model, optimizer)`, and the loop runs
under `--arch ps` or `--arch allreduce` unchanged (docs/own-loop.md).

    from psar import prepare

    run = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), seed=0)
    sampler = DistributedSampler(data, num_replicas=run.world_size, rank=run.rank,
                                 seed=0, drop_last=True)
    sched = run.register(torch.optim.lr_scheduler.StepLR(run.optimizer, 100))
    for x, y in DataLoader(data, batch_size=32, sampler=sampler, drop_last=True):
        run.optimizer.zero_grad()
        run.backward(F.cross_entropy(run.model(x), y))
        run.clip_grad_norm_(1.0)
        run.optimizer.step()
        sched.step()
    run.save_state("state")    # every rank; prepare(..., resume_from="state") (and the
    run.finish()               # same run.register calls) continue from here bit for bit

The architecture is chosen where psar train's is: `--arch` in PSAR_ARGS (every `psar
train` flag may go there; `psar launch ... -- python train.py` sets it), else PSAR_ARCH,
else ps where PSAR_SERVERS names shards and allreduce otherwise. Ranks come from the
launcher's environment (torchrun, Slurm, Kubernetes, psar launch: docs/launch-contract.md).
This module never asks which architecture runs: it builds the backend as the loop does
(worker/loop.py) and speaks the Backend protocol (trainkit/backend.py) only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from psar.trainkit.backend import Backend, BackendContext, StepOutcome, describe
from psar.trainkit.config import TrainConfig
from psar.trainkit.optim import StepOptions
from psar.trainkit.precision import pick_device, resolve
from psar.trainkit.recorder import NullWorkerRecorder
from psar.trainkit.seeding import seed_process
from psar.trainkit.user_optim import current_lrs
from psar.worker import own_state
from psar.worker.loop import make_backend, resolve_ranks
from psar.worker.own_optimizer import (
    PREPARED,
    distributed,
    refuse_a_second_prepare,
    refuse_foreign_parameters,
)
from psar.worker.supervisor import free_port

logger = logging.getLogger("psar.own_loop")

DEFAULTS = ("--precision", "fp32", "--no-pull-overlap")
"""What a loop of its own starts from before PSAR_ARGS and `args`: fp32 (a DDP script's
precision unless it autocasts; run.autocast() follows --precision), and the weights in
place when step() returns, as under DDP (--pull-overlap lets the next forward start while
they land: then read parameters outside forward only after run.finish())."""

UNKNOWN_LENGTH = 1 << 40
"""The run's length when prepare() is not told it (total_steps)."""

T = TypeVar("T")


def config_of(args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> TrainConfig:
    """The TrainConfig of a loop of its own: DEFAULTS, then PSAR_ARGS (shell words), then
    `args`, parsed as `psar train` parses its flags; the architecture as the module
    docstring says."""
    from psar.trainkit import cli_gen
    from psar.worker import cli_parser  # the CLI machinery, only when configuring

    env = os.environ if env is None else env
    # The shards the launcher named, from `env` (the config itself reads os.environ).
    servers = ["--servers", env["PSAR_SERVERS"]] if env.get("PSAR_SERVERS") else []
    argv = [*DEFAULTS, *servers, *shlex.split(env.get("PSAR_ARGS", "")), *args]
    if "--arch" not in argv and not any(a.startswith("--arch=") for a in argv):
        arch = env.get("PSAR_ARCH", "").strip() or (
            "ps" if env.get("PSAR_SERVERS") else "allreduce"
        )
        argv = ["--arch", arch, *argv]
    parser = cli_parser.train_parser()
    try:
        parsed = parser.parse_args(argv)
    except SystemExit:
        raise ValueError(
            f"PSAR_ARGS / args {argv!r}: not `psar train` flags (see `psar train --help`)"
        ) from None
    return cli_gen.build(TrainConfig, parsed, parsed.config)


class OwnLoop:
    """What prepare() returns: everything a loop of its own needs (module docstring)."""

    def __init__(
        self,
        backend: Backend,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        names: dict[int, str],
        cfg: TrainConfig,
        local_rank: int,
        resume: Path | None = None,
    ) -> None:
        """`optimizer`: the user's, set up on `backend`; `names`: id(parameter) -> its
        name in the model; `resume`: the folder prepare(resume_from=) loaded."""
        self.backend = backend
        self.model = module
        """The module to train: forward through it (DDP-wrapped under allreduce)."""
        self.optimizer = distributed(optimizer, self._step, backend.remote_optimizer_state, names)
        """Your optimizer's class, sharing your param groups: step() does the
        architecture's work (worker/own_optimizer.py)."""
        self.cfg = cfg
        self.rank = backend.ctx.rank
        """This worker's rank, 0..world_size-1: give it to your data sampler."""
        self.world_size = backend.ctx.world_size
        self.local_rank = local_rank
        self.device = backend.ctx.device
        """Where the model lives (cuda:LOCAL_RANK with --device auto and a GPU)."""
        self.arch = describe(backend).arch
        """'ps', 'allreduce' or 'hybrid', for your logs (your loop need not look at it)."""
        self.mode = describe(backend).mode
        self.last_step: StepOutcome | None = None
        """The outcome of the last optimizer step: skipped, loss_scale, staleness (ps),
        grad_norm (with clipping: the norm before clipping)."""
        self._clip = 0.0
        self._finished = False
        self.step = 0
        """Optimizer steps done in this run, those of the run it resumed included
        (prepare(resume_from=) restores it): continue your loop at run.step + 1."""
        self._registered: list[Any] = []
        self._resume = resume
        """The folder prepare(resume_from=) loaded the model and optimizer from."""
        self._restored = False
        self._saved: dict[str, Any] | None = None
        """This rank's saved state (prepare(resume_from=)), restored as the objects it
        holds are registered again (register)."""
        # Until every saved object is registered again, a forward is refused: under ps
        # its backward would push a gradient already, so a refusal at step() would come
        # too late.
        self._unrestored = (
            module.register_forward_pre_hook(self._refuse_unrestored) if resume else None
        )
        if resume is not None:
            self._saved = own_state.load_rank(resume, self.rank, self.world_size)
            self.step = int(self._saved["step"])  # at once: the data position needs it
            self._restore_when_all_registered()
        # Whether a backward ran since the last step: a step without one is refused
        # (_check_backward), not pushed or allreduced with a gradient missing.
        self._backward_seen = False
        self._agreed = False
        # Where the ranks meet in a collective every step (DDP's backward, hybrid's dense
        # allreduce), a rank that skips a backward leaves the others waiting there: the
        # ranks agree first (_agree).
        self._must_agree = describe(backend).collective_step and self.world_size > 1
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._saw_backward)
            for p in module.parameters()
            if p.requires_grad
        ]

    # ---- the step ---------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the loss scale where the precision needs one (fp16);
        the optimizer's step unscales. Use it instead of loss.backward(): under allreduce
        the ranks also check here that each of them runs a backward this step."""
        self._agree(did_backward=True)
        self.backend.scale_loss(loss).backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        """Clip this step's update to a global L2 norm of `max_norm`, as
        torch.nn.utils.clip_grad_norm_ clips the averaged gradient under DDP. It takes
        effect in optimizer.step() (under ps the shards clip; docs/own-loop.md,
        "Clipping"); the norm before clipping is then run.last_step.grad_norm."""
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_: only the L2 norm (norm_type=2), got {norm_type}")
        if not 0 < max_norm < float("inf"):
            raise ValueError(
                f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm}"
            )
        self._clip = float(max_norm)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients without communicating: backward of every micro-batch but
        the last under it (DDP's no_sync; under ps nothing is pushed)."""
        return self.backend.no_sync()

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype --precision picks (fp32: none)."""
        return self.backend.ctx.precision.autocast()

    def _refuse_unrestored(self, *_: object) -> None:
        saved = len(self._saved["objects"]) if self._saved is not None else 0
        raise RuntimeError(
            f"prepare(resume_from={str(self._resume)!r}): the saved run registered {saved} "
            f"object(s) (LR schedulers, ...), this one {len(self._registered)} so far; "
            "register the same ones with run.register(), in the same order, before the "
            "first forward: each is restored as it is registered, and the random "
            "generators once the last one is"
        )

    def _step(self) -> None:
        if self._resume is not None and not self._restored:
            self._refuse_unrestored()
        self._check_backward()
        options = StepOptions(lrs=current_lrs(self.optimizer), clip_norm=self._clip)
        self._clip = 0.0
        self.last_step = self.backend.step(options)
        self.step += 1

    def _saw_backward(self, _param: torch.Tensor) -> None:
        self._backward_seen = True

    def _agree(self, *, did_backward: bool) -> None:
        """Where backward allreduces (DDP), once a step: every rank says whether it runs
        a backward (allreduce/own_agree.py). Elsewhere (ps) each worker's push is its
        own, and a worker without a gradient refuses its step alone (_check_backward)."""
        if self._agreed:
            return
        self._agreed = True
        if self._must_agree:
            from psar.allreduce.own_agree import agree_on_backward

            agree_on_backward(did_backward, self.rank, self.world_size, self.step + 1,
                              self.device)  # fmt: skip

    def _check_backward(self) -> None:
        """A step needs a backward since the last one: without it, under ps the round
        would average in a missing gradient, under allreduce the others would wait."""
        self._agree(did_backward=self._backward_seen)
        if not self._backward_seen:
            why = (
                f"rank {self.rank}: run.optimizer.step() without a backward since the last "
                f"step (step {self.step + 1}); call run.backward(loss) before every step "
                "(nothing was sent: the step is refused)"
            )
            if self.world_size > 1:
                # The others wait on this step (a sync round would never close): the
                # backend tells them (ps: the shards stop the job with this line, so
                # every rank raises it within a pull rather than wait out a timeout).
                self._end(failed=True, why=why)
                why += "; the job was stopped, and every rank was told why"
            raise RuntimeError(why)
        self._backward_seen = self._agreed = False

    # ---- saving and resuming ------------------------------------------------------------

    def register(self, obj: T) -> T:
        """Save and restore `obj` with the run (save_state; prepare(resume_from=)): an LR
        scheduler or anything with state_dict() and load_state_dict() (or a
        torch.Generator). Register the same objects in the same order in the resumed
        run: each is restored here, as it is registered, and once the last saved one is,
        each group's learning rate (a warm-up scheduler built on run.optimizer has just
        set it to its first value) and this rank's random generators. Returns `obj`."""
        own_state.check_registrable(obj)
        if self._saved is not None and not self._restored:
            # Not restored yet: fewer registered than saved, so this is saved one `at`.
            own_state.load_object(obj, self._saved["objects"][len(self._registered)])
            self._registered.append(obj)
            self._restore_when_all_registered()  # the lrs and generators after the last
            return obj
        self._registered.append(obj)
        return obj

    def _restore_when_all_registered(self) -> None:
        """The last of a resumed run's saved objects is registered (or it saved none):
        the learning rates and the random generators go back (last: prepare() reseeded
        them), and forwards are allowed."""
        assert self._saved is not None
        if len(self._registered) < len(self._saved["objects"]):
            return
        for group, lr in zip(self.optimizer.param_groups, self._saved["lrs"], strict=True):
            group["lr"] = lr
        own_state.set_rng_state(self._saved["rng"])
        self._restored = True
        if self._unrestored is not None:
            self._unrestored.remove()

    def save_state(self, folder: str | os.PathLike) -> None:
        """Save everything the run needs to continue bit for bit into `folder` (call it on
        every rank, between steps): the model and the optimizer (rank 0; under ps the
        optimizer's state is read back from the shards), and each rank's step, learning
        rates, registered objects and random generators (worker/own_state.py)."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            model = self.backend.state_dict()  # waits for the step's pull; fp32 weights
            own_state.save_shared(path, model, self.optimizer.state_dict())
        lrs = list(current_lrs(self.optimizer))
        own_state.save_rank(path, self.rank, self.world_size, self.step, lrs, self._registered)

    def load_state(self, folder: str | os.PathLike | None = None) -> int:
        """Optional (a resumed run restores itself as its objects are registered again,
        register): checks that it did, from `folder` if given, and returns run.step (the
        steps done). Refused where prepare() was not given resume_from, or where fewer
        objects were registered than the saved run had."""
        if self._resume is None:
            raise RuntimeError(
                "load_state(): pass the folder to prepare(..., resume_from=FOLDER): the "
                "model and the optimizer are loaded before the job starts (under --arch ps "
                "the shards take them with it), the rest as you register your objects"
            )
        if folder is not None and Path(folder).resolve() != self._resume.resolve():
            raise ValueError(
                f"load_state({str(folder)!r}): prepare() resumed from {str(self._resume)!r}; "
                "restore from the same folder"
            )
        if not self._restored:
            assert self._saved is not None
            raise ValueError(
                f"load_state(): the saved run registered {len(self._saved['objects'])} "
                f"objects, this one {len(self._registered)}; register the same ones "
                "(run.register), in the same order"
            )
        return self.step

    # ---- the end ----------------------------------------------------------------------

    def finish(self) -> None:
        """Leave the job (ps: the shards stop waiting for this worker; allreduce: the
        process group ends). Call it once, after the last step; `with prepare(...)` does."""
        self._end()

    def _end(self, *, failed: bool = False, why: str = "") -> None:
        """Once: drop the backward hooks and end the backend (finish's arguments)."""
        if not self._finished:
            self._finished = True
            for hook in self._hooks:
                hook.remove()
            self.backend.finish(failed=failed, why=why)

    def __enter__(self) -> OwnLoop:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None:
            with contextlib.suppress(Exception):
                self.backend.finish(failed=True)
            return
        self.finish()


def _tables_to_shards(model: torch.nn.Module, min_rows: int, resumed: Path | None) -> None:
    """Under an architecture that keeps the sparse tables on the shards: mark the big
    sparse=True embeddings too (--sparse-min-rows), and refuse a resume with tables (the
    shards build a table's rows from its psar_init; a saved table is not sent to them)."""
    from psar.trainkit.sparse_tables import mark_sparse_embeddings, marked_tables

    for name in mark_sparse_embeddings(model, min_rows):
        mod = model.get_submodule(name)
        logger.info(
            "%s (%d x %d, sparse=True, >= --sparse-min-rows %d rows) goes to the shards as a "
            "sparse table, initialised there N(0, 1) as torch initialises an embedding (its "
            "weights here are not sent)",
            name, mod.num_embeddings, mod.embedding_dim, min_rows,
        )  # fmt: skip
    if resumed is not None and marked_tables(model):
        raise ValueError(
            f"prepare(resume_from=...): the model's sparse tables ({', '.join(marked_tables(model))}) "
            "live on the shards, which build their rows from psar_init; resuming them from a "
            "saved state is not supported yet: resume under --arch allreduce, or start anew"
        )


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    seed: int | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    total_steps: int | None = None,
    resume_from: str | os.PathLike | None = None,
) -> OwnLoop:
    """Put your model and your own optimizer on the architecture the environment names.

    model: built the same way on every rank (rank 0's weights are the ones trained);
    load a checkpoint into it and into the optimizer before calling this.
    optimizer: any torch.optim optimizer over model's parameters under allreduce; under
    ps the shards run it, so torch.optim.SGD or AdamW (any number of param groups with
    hyper-parameters of their own; another class is refused before any shard is asked).
    seed: seeds torch, random and numpy from (seed, rank) once the model is placed, as
    `psar train --seed` does (default: --seed from PSAR_ARGS, else 0).
    args: more `psar train` flags (after PSAR_ARGS). total_steps: the run's length, if
    known (ps: the overlap trial fits in it).
    resume_from: a folder run.save_state() wrote: its model and optimizer are loaded
    into yours before the job starts, and run.step is set; register the same objects
    again (run.register) and each is restored as it is registered, then the learning
    rates and each rank's random generators (no other call is needed)."""
    refuse_a_second_prepare(model, optimizer)
    refuse_foreign_parameters(model, optimizer)
    resumed = None
    if resume_from is not None:  # first: under ps the shards take both with the job
        resumed = Path(resume_from)
        weights, opt_state = own_state.load_shared(resumed)
        model.load_state_dict(weights)
        optimizer.load_state_dict(opt_state)
    env = dict(os.environ if env is None else env)
    cfg = config_of(args, env)
    if cfg.elastic:  # the shards deal batch ids, which only psar train's loop reads
        raise ValueError(
            "--max-workers / --join (an elastic job, docs/elastic.md) need psar train's own "
            "loop, which trains on the batches shard 0 deals; run prepare() without them"
        )
    rank, world, local_rank = resolve_ranks(cfg, env)
    if world == 1 and "MASTER_ADDR" not in os.environ:  # a lone process: its own group
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device, local_rank)
    precision = resolve(device, cfg.precision, cfg.wire_dtype, cfg.worker_weights)
    ctx = BackendContext(
        cfg,
        precision,
        rank,
        world,
        total_steps or UNKNOWN_LENGTH,
        metrics=NullWorkerRecorder(),
        find_unused_parameters=cfg.ddp.find_unused_parameters,
    )
    backend = make_backend(ctx)
    names = {id(p): n for n, p in model.named_parameters()}
    info = describe(backend)
    if info.tables_on_shards:
        _tables_to_shards(model, cfg.ps.sparse_min_rows, resumed)
    logger.info("rank %d/%d: %s (%s), a loop of its own", rank, world, info.arch, info.mode)
    module = backend.setup(model, optimizer)
    # Dropout and other draws during training: the same run after run, and the same for
    # rank r under either architecture (trainkit/seeding.py), as psar train does.
    seed_process(cfg.seed if seed is None else seed, rank)
    setattr(model, PREPARED, True)  # refuse_a_second_prepare
    return OwnLoop(backend, module, optimizer, names, cfg, local_rank, resumed)
