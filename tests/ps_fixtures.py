"""Shared helpers for the parameter-server tests (plain functions: conftest.py is not ours).

Everything here is deterministic: gradients and initial values come from seeded
generators, and the reference optimizer runs the same torch code on the same
fp32 values in the same order as a shard does, so results compare bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.headers import PullHeader, PushHeader
from psar.ps.job import Job
from psar.ps.partition import Slot, plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.modes import BUILTIN, Modes
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig, build_optimizer

# Two parameters; with CHUNK_BYTES = 32 (8 fp32 elements) "w" is cut into two slots,
# so every test exercises multi-slot pushes: w#0 (8), w#1 (4), b#0 (5).
PARAMS: list[tuple[str, int]] = [("w", 12), ("b", 5)]
CHUNK_BYTES = 32
MODES = ("sync", "async", "ssp")
APPLIED_ALONE = ("async", "ssp", "drop_stale")
"""Modes whose shards apply each push on its own (tests/drop_stale_mode.py's too)."""
OPTIMIZERS = ("sgd", "adamw")


def optimizer_config(name: str = "sgd", **kw: object) -> OptimizerConfig:
    """SGD with momentum and weight decay, or AdamW: both keep per-slot state."""
    if name == "sgd":
        base: dict[str, object] = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    else:
        base = {"lr": 0.01, "weight_decay": 0.01}
    base.update(kw)
    return OptimizerConfig(name=name, **base)  # type: ignore[arg-type]


def make_slots(
    params: Sequence[tuple[str, int]] = PARAMS, num_shards: int = 1, shard: int = 0
) -> list[Slot]:
    plan = plan_slots(params, num_shards, chunk_bytes=CHUNK_BYTES)
    return [s for s in plan if s.shard == shard]


def make_job(
    mode: str = "sync",
    *,
    num_workers: int = 2,
    optimizer: str | OptimizerConfig = "sgd",
    staleness: int = 0,
    loss_scale: LossScaleConfig | None = None,
    slots: list[Slot] | None = None,
    shard_index: int = 0,
    num_shards: int = 1,
    job_id: str = "test",
    sync_every: int | None = None,
    mode_options: dict[str, float] | None = None,
    chunk_rounds: bool = False,
    early_pull: bool = False,
    staleness_rule: str = "fixed",
) -> Job:
    """A job for a shard under test. `staleness_rule` fixed (its fields at their defaults:
    the momentum rule alone) is what the by-hand expectations here compute
    (applied_optimizer); tests/test_staleness_rule_wiring.py asks for adaptive."""
    opt = optimizer if isinstance(optimizer, OptimizerConfig) else optimizer_config(optimizer)
    if sync_every is None:  # --mode local needs H; the shard's behaviour does not depend on it
        sync_every = 4 if mode == "local" else 0
    return Job(
        mode=mode,
        staleness=staleness,
        num_workers=num_workers,
        optimizer=opt,
        loss_scale=loss_scale or LossScaleConfig(),
        shard_index=shard_index,
        num_shards=num_shards,
        slots=slots if slots is not None else make_slots(),
        job_id=job_id,
        sync_every=sync_every,
        mode_options=mode_options or {},
        chunk_rounds=chunk_rounds,
        early_pull=early_pull,
        staleness_rule=staleness_rule,
    )


def init_values(job: Job, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.key: torch.randn(s.numel, generator=g) for s in job.slots}


def make_state(
    job: Job,
    values: dict[str, torch.Tensor] | None = None,
    *,
    chunk_rounds: bool = False,
    modes: Modes = BUILTIN,
) -> ShardState:
    st = ShardState(chunk_rounds=chunk_rounds, modes=modes)
    st.init(job, values if values is not None else init_values(job))
    return st


def grad_for(job: Job, worker: int, clock: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic fp32 gradient for (worker, clock), small enough to scale by 2**10."""
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 7919 * worker + clock)
    return {s.key: 0.1 * torch.randn(s.numel, generator=g) for s in job.slots}


def push(
    st: ShardState,
    *,
    worker: int,
    clock: int,
    base_version: int,
    grads: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    loss_scale: float = 1.0,
    overflow: bool = False,
    retry: bool = False,
    piece_elems: int = 3,
    skip_keys: Sequence[str] = (),
):
    """One push through begin_push/add_data/finish_push, as the servicer drives it.

    Returns finish_push's (outcome, version, already_applied). Slots in `skip_keys`
    send no data (an incomplete push).
    """
    header = PushHeader(
        worker=worker,
        clock=clock,
        base_version=base_version,
        dtype=dtype,
        loss_scale=loss_scale,
        overflow=overflow,
        retry=retry,
    )
    ticket = st.intake.begin_push(header, lock_timeout=5.0)
    try:
        if not overflow:
            assert grads is not None, "a push without overflow needs gradients"
            itemsize = wire.DTYPE_ITEMSIZE[dtype]
            for key, t in grads.items():
                if key in skip_keys:
                    continue
                flat = t.detach().to(dtype).reshape(-1).contiguous()
                for off, data in wire.iter_pieces(flat, piece_elems * itemsize):
                    st.intake.add_data(ticket, key, off, data)
        return st.intake.finish_push(ticket)
    finally:
        ticket.release()


def pull(
    st: ShardState,
    worker: int,
    clock: int,
    *,
    timeout: float | None = 5.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[PullHeader, dict[str, torch.Tensor]]:
    """A pull, reassembled into flat fp32-or-`dtype` tensors keyed by slot."""
    header, pieces = st.pulls.pull(worker, clock, dtype, timeout)
    out = {key: torch.empty(n, dtype=dtype) for key, n in st.numel.items()}
    for key, off, data in pieces:
        src = wire.decode(data, dtype)
        out[key][off : off + src.numel()].copy_(src)
    return header, out


def masters(st: ShardState) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in st.masters.items()}


def weights_digest(st: ShardState) -> str:
    """sha256 over the fp32 masters and the optimizer state only (no counters, no clocks):
    equal before and after a skipped round or a dropped push."""
    h = hashlib.sha256()
    for key, p in st.masters.items():
        h.update(key.encode())
        h.update(p.detach().numpy().tobytes())
        for name, value in sorted(st.optimizer.state.get(p, {}).items()):
            h.update(name.encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().reshape(-1).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def mean_in_rank_order(grads: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The sync round's mean, with the shard's operation order (sum by rank, then divide)."""
    ranks = sorted(grads)
    total = {k: t.clone() for k, t in grads[ranks[0]].items()}
    for r in ranks[1:]:
        for k, t in grads[r].items():
            total[k].add_(t)
    if len(ranks) > 1:
        for t in total.values():
            t.div_(len(ranks))
    return total


def reference_weights(
    job: Job, values: dict[str, torch.Tensor], updates: Sequence[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The weights after applying `updates` (one optimizer step each) with torch's own
    optimizer built from the job's config: what a correct shard must hold."""
    params = {
        s.key: torch.nn.Parameter(values[s.key].detach().clone().reshape(-1)) for s in job.slots
    }
    opt = build_optimizer(params.values(), applied_optimizer(job))
    for g in updates:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach().clone() for k, p in params.items()}


def applied_optimizer(job: Job) -> OptimizerConfig:
    """The optimizer an async/ssp shard applies: the momentum rule for asynchrony
    (docs/staleness-rule.md): momentum (AdamW: beta1) minus 1 - 1/N, floored at 0, where
    N > 1 workers push alone; written out here, not taken from the shard's code."""
    cfg = job.optimizer
    if job.mode not in APPLIED_ALONE or not job.momentum_correction or job.num_workers < 2:
        return cfg
    implicit = 1.0 - 1.0 / job.num_workers
    if cfg.name == "adamw":
        return dataclasses.replace(cfg, beta1=max(0.0, cfg.beta1 - implicit))
    return dataclasses.replace(cfg, momentum=max(0.0, cfg.momentum - implicit))


def assert_weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].to(torch.float32), want[k]), f"slot {k} differs"


# ---- a real gRPC server on loopback ---------------------------------------------------


@contextlib.contextmanager
def serving(cfg: ServerConfig | None = None) -> Iterator[tuple[int, ShardState]]:
    """A shard's gRPC server on 127.0.0.1 (a free port); stopped on exit."""
    server, port, state = start_server(cfg or ServerConfig(bind="127.0.0.1:0", threads=8))
    try:
        yield port, state
    finally:
        stop_server(server)


@contextlib.contextmanager
def raw_stub(port: int) -> Iterator[pb_grpc.ParameterServerStub]:
    """A raw stub with default channel options (it may send more than the server takes)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ParameterServerStub(channel)
    finally:
        channel.close()


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_chunks(
    job: Job, values: dict[str, torch.Tensor], message_bytes: int = 16
) -> list[pb.InitChunk]:
    out = [pb.InitChunk(header=pb.InitHeader(job=serde.job_to_pb(job)))]
    for s in job.slots:
        flat = values[s.key].detach().to(torch.float32).reshape(-1).contiguous()
        for off, data in wire.iter_pieces(flat, message_bytes):
            out.append(pb.InitChunk(data=pb.TensorData(key=s.key, offset=off, data=data)))
    return out


def push_chunks(
    header: pb.PushHeader,
    grads: dict[str, torch.Tensor] | None,
    *,
    dtype: torch.dtype = torch.float32,
    message_bytes: int = 16,
) -> list[pb.PushChunk]:
    out = [pb.PushChunk(header=header)]
    for key, t in (grads or {}).items():
        flat = t.detach().to(dtype).reshape(-1).contiguous()
        for off, data in wire.iter_pieces(flat, message_bytes):
            out.append(pb.PushChunk(data=pb.TensorData(key=key, offset=off, data=data)))
    return out


def stats_digest(stub: pb_grpc.ParameterServerStub) -> str:
    return stub.Stats(pb.StatsRequest(), timeout=5).state_digest


# Diagnostic counters of per-chunk rounds: a refused push may count slots it let the
# shard update early and then undo (the state itself is unchanged; the digest checks it).
SPECULATION_COUNTERS = ("chunks_applied_early", "chunk_undos")
NOT_STATE = (*SPECULATION_COUNTERS, "gradient_bytes")
"""Stats a refused request may change: the per-chunk speculation counters, and the memory
held for gradients in flight (a worker's first push allocates its staging)."""


def without_speculation(stats: Any) -> Any:
    """Stats (a dict or a StatsReply) without what is not the shard's state (NOT_STATE)."""
    if isinstance(stats, dict):
        return {k: v for k, v in stats.items() if k not in NOT_STATE}
    out = type(stats)()
    out.CopyFrom(stats)
    for name in NOT_STATE:
        out.ClearField(name)
    return out
