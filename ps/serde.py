"""proto <-> Python conversion, in one place (Flower's serde module).

Everything else in ps/ works on plain dataclasses; tests/test_serde.py round-trips each.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from psar.ps import wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, quote
from psar.ps.headers import PullHeader, PushHeader, PushOutcome, StepOptions
from psar.ps.job import Job, ModeTraits
from psar.ps.partition import Slot
from psar.ps.sparse_spec import TableSpec
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig, ParamGroup

# A mode travels as its Mode enum value (the name in capitals) where the enum has one, else
# as mode_name (a mode registered as a module of its own, ps/server/modes/).
_MODE_ENUM = {pb.Mode.Name(v).lower(): v for v in pb.Mode.values() if v != pb.MODE_UNSPECIFIED}
_MODE_NAMES = {v: k for k, v in _MODE_ENUM.items()}


def mode_to_pb(mode: str) -> tuple[int, str]:
    """(Mode enum value, mode_name) of a mode name: one of the two is set."""
    value = _MODE_ENUM.get(mode)
    return (value, "") if value is not None else (pb.MODE_UNSPECIFIED, mode)


def mode_from_pb(value: int, name: str) -> str:
    if value in _MODE_NAMES:
        return _MODE_NAMES[value]
    if value == pb.MODE_UNSPECIFIED and name:
        return name
    known = ", ".join(pb.Mode.Name(v) for v in _MODE_NAMES)
    raise InvalidArgument(
        f"job mode enum {value} unknown (and no mode_name); use {known}, or name the mode"
    )


def traits_to_pb(t: ModeTraits) -> pb.ModeTraits:
    return pb.ModeTraits(
        rounds=t.rounds,
        staleness=pb.ModeTraits.Staleness.Value(t.staleness.upper()),
        between_steps=pb.ModeTraits.BetweenSteps.Value(t.between_steps.upper()),
        shard_owns_loss_scale=t.shard_owns_loss_scale,
        rejoin=pb.ModeTraits.Rejoin.Value(t.rejoin.upper()),
    )


def traits_from_pb(m: pb.ModeTraits) -> ModeTraits:
    """The traits a shard sent; unknown or unspecified enum values are refused."""
    try:
        return ModeTraits(
            rounds=m.rounds,
            staleness=pb.ModeTraits.Staleness.Name(m.staleness).lower(),
            between_steps=pb.ModeTraits.BetweenSteps.Name(m.between_steps).lower(),
            shard_owns_loss_scale=m.shard_owns_loss_scale,
            rejoin=pb.ModeTraits.Rejoin.Name(m.rejoin).lower(),
        )
    except ValueError as e:
        raise InvalidArgument(f"mode traits from the shard: {e}", reason="malformed") from None


def dtype_to_pb(dtype: torch.dtype) -> int:
    try:
        return wire.WIRE_FROM_DTYPE[dtype]
    except KeyError:
        raise InvalidArgument(
            f"dtype {dtype} cannot travel; use float32, float16 or bfloat16", reason="bad_dtype"
        ) from None


def dtype_from_pb(value: int) -> torch.dtype:
    try:
        return wire.DTYPE_FROM_WIRE[value]
    except KeyError:
        raise InvalidArgument(
            f"unknown dtype enum {value}; send FLOAT32, FLOAT16 or BFLOAT16", reason="bad_dtype"
        ) from None


MAX_WAIT_S = 24 * 3600.0
"""The longest a shard waits for one request: a pull's timeout (data plane timeout_s, a
gRPC deadline) longer than this, or none at all, waits this long. Condition.wait refuses
timeouts past threading.TIMEOUT_MAX (OverflowError), so no wire value reaches it raw."""
MAX_COUNT = 1 << 62
"""Largest clock, version or round accepted from the wire: far beyond any job, and small
enough that differences fit the int64 fields of replies (staleness, clock_gap)."""


def wait_seconds(what: str, seconds: float, *, zero_means_max: bool = False) -> float:
    """A timeout from the wire as the shard may wait on it: finite and >= 0, capped at
    MAX_WAIT_S (zero_means_max: 0 means "no limit", i.e. the cap)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(
            f"{what} must be a finite number of seconds >= 0, got {seconds}; send 0 for the "
            f"longest wait ({MAX_WAIT_S:.0f} s)",
            reason="malformed",
        )
    if seconds == 0 and zero_means_max:
        return MAX_WAIT_S
    return min(seconds, MAX_WAIT_S)


def check_count(what: str, value: int) -> int:
    """A clock, version or round from the wire (unsigned on the wire, so >= 0 already)."""
    if not 0 <= value <= MAX_COUNT:
        raise InvalidArgument(
            f"{what} {value} is out of range [0, 2**62]; a worker's clock counts its pushes "
            "and versions count updates: send the value the shard told you",
            reason="malformed",
        )
    return value


def check_finite_fields(what: str, msg: object, names: list[str]) -> None:
    """Every float field `names` of a proto message `msg` must be finite."""
    for name in names:
        value = getattr(msg, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(
                f"{what}.{name} must be a finite number, got {value}", reason="malformed"
            )


def _fields_of(cls: type, msg: object) -> dict[str, object]:
    """The dataclass `cls`'s fields read from the proto message `msg` of the same shape."""
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)}


def _optimizer_of(o: pb.OptimizerSpec) -> OptimizerConfig:
    fields = _fields_of(OptimizerConfig, o)
    # A spec without an implementation was written before the field existed, when every
    # optimizer ran torch's per-parameter loop: a restored job goes on with the same bits.
    fields["impl"] = fields["impl"] or "loop"
    return OptimizerConfig(**fields)


def job_to_pb(job: Job) -> pb.JobSpec:
    o, ls = job.optimizer, job.loss_scale
    mode, mode_name = mode_to_pb(job.mode)
    return pb.JobSpec(
        mode=mode,
        mode_name=mode_name,
        mode_options=job.mode_options,
        traits=traits_to_pb(job.traits) if job.traits is not None else None,
        staleness=job.staleness,
        num_workers=job.num_workers,
        # The proto messages mirror the dataclasses field for field (tests/test_serde.py).
        optimizer=pb.OptimizerSpec(**dataclasses.asdict(o)),
        loss_scale=pb.LossScaleSpec(**dataclasses.asdict(ls)),
        shard_index=job.shard_index,
        num_shards=job.num_shards,
        slots=[
            pb.SlotSpec(key=s.key, param=s.param, start=s.start, numel=s.numel) for s in job.slots
        ],
        job_id=job.job_id,
        sync_every=job.sync_every,
        buffer_slots=list(job.buffer_slots),
        buffers_average=job.buffers_average,
        int_buffers=[pb.IntBufferSpec(name=n, numel=k) for n, k in job.int_buffers],
        staleness_rule=job.staleness_rule,
        staleness_lr=job.staleness_lr,
        delay_compensation=job.delay_compensation,
        momentum_correction=job.momentum_correction,
        staleness_lr_power=job.staleness_lr_power,
        dc_adaptive=job.dc_adaptive,
        max_workers=job.max_workers,
        data_batches=job.data_batches,
        data_per_step=job.data_per_step,
        data_stream=job.data_stream,
        param_groups=[pb.ParamGroupSpec(**dataclasses.asdict(g)) for g in job.param_groups],
        chunk_rounds=job.chunk_rounds,
        early_pull=job.early_pull,
        step_options=job.step_options,
    )


def _group_from_pb(m: pb.ParamGroupSpec) -> ParamGroup:
    return ParamGroup(**{**_fields_of(ParamGroup, m), "params": tuple(m.params)})


def job_from_pb(spec: pb.JobSpec) -> Job:
    """A validated Job; a malformed spec raises InvalidArgument naming the problem."""
    mode = mode_from_pb(spec.mode, spec.mode_name)
    traits = traits_from_pb(spec.traits) if spec.HasField("traits") else None
    o, ls = spec.optimizer, spec.loss_scale
    check_finite_fields("optimizer", o, [f.name for f in dataclasses.fields(OptimizerConfig)])
    check_finite_fields("loss_scale", ls, [f.name for f in dataclasses.fields(LossScaleConfig)])
    try:
        return Job(
            mode=mode,
            staleness=spec.staleness,
            num_workers=spec.num_workers,
            optimizer=_optimizer_of(o),
            loss_scale=LossScaleConfig(**_fields_of(LossScaleConfig, ls)),
            shard_index=spec.shard_index,
            num_shards=spec.num_shards,
            slots=[Slot(s.key, s.param, s.start, s.numel, spec.shard_index) for s in spec.slots],
            job_id=spec.job_id,
            sync_every=spec.sync_every,
            buffer_slots=tuple(spec.buffer_slots),
            buffers_average=spec.buffers_average,
            int_buffers=tuple((b.name, b.numel) for b in spec.int_buffers),
            # A spec without the field (older clients, checkpoints) reads "": fixed, the
            # rule its fields below describe, as those shards applied them.
            staleness_rule=spec.staleness_rule or "fixed",
            staleness_lr=spec.staleness_lr,
            delay_compensation=spec.delay_compensation,
            momentum_correction=spec.momentum_correction,
            # A spec without the field (written before it existed) reads 0: the default 1.
            staleness_lr_power=spec.staleness_lr_power or 1.0,
            dc_adaptive=spec.dc_adaptive,
            max_workers=spec.max_workers,
            data_batches=spec.data_batches,
            # A spec without the field (written before it existed) reads 0: one per step.
            data_per_step=spec.data_per_step or 1,
            data_stream=spec.data_stream,
            mode_options=dict(spec.mode_options),
            param_groups=tuple(_group_from_pb(g) for g in spec.param_groups),
            traits=traits,
            chunk_rounds=spec.chunk_rounds,
            early_pull=spec.early_pull,
            step_options=spec.step_options,
        )
    except ValueError as e:
        raise InvalidArgument(f"invalid job spec: {e}", reason="malformed") from None


def int_values_to_pb(values: dict[str, tuple[int, ...]]) -> dict[str, pb.IntValues]:
    return {k: pb.IntValues(values=list(v)) for k, v in values.items()}


def int_values_from_pb(m: Any) -> dict[str, tuple[int, ...]]:
    """Integer buffers from a header's map; the receiver checks them against the job."""
    return {k: tuple(v.values) for k, v in m.items()}


def push_header_to_pb(h: PushHeader) -> pb.PushHeader:
    return pb.PushHeader(
        worker=h.worker,
        clock=h.clock,
        base_version=h.base_version,
        dtype=dtype_to_pb(h.dtype),
        loss_scale=h.loss_scale,
        overflow=h.overflow,
        retry=h.retry,
        verdict_follows=h.verdict_follows,
        absent=list(h.absent),
        int_buffers=int_values_to_pb(h.int_buffers),
        options=options_to_pb(h.options) if h.options.given else None,
    )


def options_to_pb(o: StepOptions) -> pb.StepOptions:
    return pb.StepOptions(lrs=list(o.lrs), clip_norm=o.clip_norm, grad_norm=o.grad_norm)


def options_from_pb(m: pb.StepOptions) -> StepOptions:
    """A push's step options; non-finite or negative values are refused (INVALID_ARGUMENT)."""
    try:
        return StepOptions(lrs=tuple(m.lrs), clip_norm=m.clip_norm, grad_norm=m.grad_norm)
    except ValueError as e:
        raise InvalidArgument(str(e), reason="malformed") from None


def push_header_from_pb(m: pb.PushHeader) -> PushHeader:
    """loss_scale is checked (finite, > 0) by the shard's check_header."""
    return PushHeader(
        worker=m.worker,
        clock=check_count("push clock", m.clock),
        base_version=check_count("push base_version", m.base_version),
        dtype=dtype_from_pb(m.dtype),
        loss_scale=m.loss_scale,
        overflow=m.overflow,
        retry=m.retry,
        verdict_follows=m.verdict_follows,
        absent=tuple(m.absent),
        int_buffers=int_values_from_pb(m.int_buffers),
        options=options_from_pb(m.options),
    )


def push_reply_to_pb(
    outcome: PushOutcome, version: int, already_applied: bool, incarnation: int
) -> pb.PushReply:
    """What ShardState.finish_push returned, as both transports answer it."""
    return pb.PushReply(
        applied=outcome.applied,
        already_applied=already_applied,
        dropped_nonfinite=outcome.dropped_nonfinite,
        version=version,
        staleness=outcome.staleness,
        incarnation=incarnation,
    )


def pull_header_to_pb(h: PullHeader) -> pb.PullHeader:
    return pb.PullHeader(
        version=h.version,
        rounds=h.rounds,
        loss_scale=h.loss_scale,
        last_round_skipped=h.last_round_skipped,
        skipped_rounds=h.skipped_rounds,
        dtype=dtype_to_pb(h.dtype),
        clock_gap=h.clock_gap,
        int_buffers=int_values_to_pb(h.int_buffers),
        batches=list(h.batches),
        data_done=h.data_done,
        live_workers=h.live_workers,
    )


def pull_header_from_pb(m: pb.PullHeader) -> PullHeader:
    return PullHeader(
        version=m.version,
        rounds=m.rounds,
        loss_scale=m.loss_scale,
        last_round_skipped=m.last_round_skipped,
        skipped_rounds=m.skipped_rounds,
        dtype=dtype_from_pb(m.dtype),
        clock_gap=m.clock_gap,
        int_buffers=int_values_from_pb(m.int_buffers),
        batches=tuple(m.batches),
        data_done=m.data_done,
        live_workers=m.live_workers,
    )


_SPEC_FIELDS = (
    "name rows dim optimizer lr eps beta1 beta2 init_std init_seed shard_index num_shards"
).split()


def spec_to_pb(s: TableSpec) -> pb.TableSpec:
    return pb.TableSpec(**{f: getattr(s, f) for f in _SPEC_FIELDS})


def spec_from_pb(m: pb.TableSpec) -> TableSpec:
    check_finite_fields(f"table {quote(m.name)}", m, _SPEC_FIELDS)
    try:
        return TableSpec(**{f: getattr(m, f) for f in _SPEC_FIELDS})
    except ValueError as e:
        raise InvalidArgument(f"CreateTables: {e}") from None


INIT_FAILED_PREFIX = "the worker of rank 0 could not initialise the shards"
"""Starts the FAILED_PRECONDITION details a shard answers GetJob(wait) with once rank 0
reported that its init failed (ReportInitFailure); the client knows InitFailed by it."""
JOB_STOPPED_PREFIX = "the job was stopped"
"""Starts the FAILED_PRECONDITION details of every call to a job a worker stopped because
its workers disagree about its size (StopJob, ps/server/membership/membership.py); the
client knows JobStopped by it."""
MAX_INIT_ERROR_CHARS = 2000
"""Rank 0's error text is cut to this (it travels in status details, i.e. a header)."""


def init_failure_to_pb(worker: int, error: str) -> pb.InitFailedRequest:
    return pb.InitFailedRequest(worker=worker, error=error[:MAX_INIT_ERROR_CHARS])


def init_failure_details(m: pb.InitFailedRequest) -> str:
    """What workers waiting for the init are told: rank 0's own words, and what to do."""
    error = m.error[:MAX_INIT_ERROR_CHARS] or "(no reason given)"
    return (
        f"{INIT_FAILED_PREFIX} (worker {m.worker} reported): {error} -- fix that and "
        "start the workers again"
    )
