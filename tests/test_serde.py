"""psar.ps.serde: Job, PushHeader and PullHeader survive a trip through the wire; bad enums are
refused with InvalidArgument (which the servicer maps to INVALID_ARGUMENT)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument
from psar.ps.headers import PullHeader, PushHeader
from psar.ps.job import Job
from psar.ps.partition import Slot, plan_slots
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig, ParamGroup, StepOptions

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def via_wire(msg):  # noqa: ANN001, ANN201 - any proto message
    """Serialise and parse back, as the other end of a channel sees it."""
    return type(msg).FromString(msg.SerializeToString())


def _slots(num_shards: int, shard: int) -> list[Slot]:
    plan = plan_slots([("emb", 3000), ("w", 100), ("b", 7)], num_shards, chunk_bytes=4096)
    return [s for s in plan if s.shard == shard]


JOBS = {
    "defaults": Job(),
    "sync-fp16-adamw": Job(
        mode="sync",
        num_workers=4,
        optimizer=OptimizerConfig(
            name="adamw",
            lr=3e-4,
            weight_decay=0.1,
            beta1=0.85,
            beta2=0.95,
            eps=1e-6,
            schedule="warmup_cosine",
            warmup_steps=10,
            total_steps=1000,
            min_lr_ratio=0.1,
        ),
        loss_scale=LossScaleConfig(
            enabled=True,
            init_scale=1024.0,
            growth_factor=4.0,
            backoff_factor=0.25,
            growth_interval=7,
        ),
        shard_index=1,
        num_shards=3,
        slots=_slots(3, 1),
        job_id="run-42",
    ),
    "async-sgd-nesterov": Job(
        mode="async",
        num_workers=3,
        optimizer=OptimizerConfig(name="sgd", lr=0.3, momentum=0.5, nesterov=True),
        slots=_slots(1, 0),
    ),
    "ssp": Job(mode="ssp", staleness=3, num_workers=8, num_shards=2, slots=_slots(2, 0)),
    "own-optimizer-groups": Job(
        optimizer=OptimizerConfig(name="adamw", lr=1.0),
        slots=_slots(1, 0),
        param_groups=(
            ParamGroup(
                params=("emb", "w"), lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1
            ),
            ParamGroup(params=("b",), lr=0.0, amsgrad=True),
        ),
        step_options=True,
    ),
}


@pytest.mark.parametrize("name", list(JOBS))
def test_job_round_trip(name: str) -> None:
    job = JOBS[name]
    spec = via_wire(serde.job_to_pb(job))
    back = serde.job_from_pb(spec)
    assert back == job
    assert serde.job_to_pb(back) == spec


PUSH_HEADERS = [
    PushHeader(worker=0, clock=1, base_version=0, dtype=torch.float32),
    PushHeader(
        worker=7,
        clock=2**40,
        base_version=2**40 - 3,
        dtype=torch.float16,
        loss_scale=65536.0,
        retry=True,
    ),
    PushHeader(
        worker=2**32 - 1,
        clock=5,
        base_version=4,
        dtype=torch.bfloat16,
        loss_scale=0.125,
        overflow=True,
    ),
    PushHeader(
        worker=1,
        clock=3,
        base_version=2,
        dtype=torch.float32,
        options=StepOptions(lrs=(0.1, 0.0, 2.5e-4), clip_norm=1.0, grad_norm=3.25),
    ),
]


@pytest.mark.parametrize("header", PUSH_HEADERS, ids=lambda h: f"w{h.worker}-{h.dtype}")
def test_push_header_round_trip(header: PushHeader) -> None:
    assert serde.push_header_from_pb(via_wire(serde.push_header_to_pb(header))) == header


PULL_HEADERS = [
    PullHeader(
        version=0,
        rounds=0,
        loss_scale=1.0,
        last_round_skipped=False,
        skipped_rounds=0,
        dtype=torch.float32,
        clock_gap=0,
    ),
    PullHeader(
        version=9,
        rounds=12,
        loss_scale=32768.0,
        last_round_skipped=True,
        skipped_rounds=3,
        dtype=torch.float16,
        clock_gap=2,
    ),
    PullHeader(
        version=2**50,
        rounds=2**50,
        loss_scale=2.0**-3,
        last_round_skipped=False,
        skipped_rounds=1,
        dtype=torch.bfloat16,
        clock_gap=-1,
    ),
]


@pytest.mark.parametrize("header", PULL_HEADERS, ids=lambda h: f"v{h.version}-{h.dtype}")
def test_pull_header_round_trip(header: PullHeader) -> None:
    assert serde.pull_header_from_pb(via_wire(serde.pull_header_to_pb(header))) == header


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    worker=st.integers(0, 2**32 - 1),
    clock=st.integers(0, serde.MAX_COUNT),
    base_version=st.integers(0, serde.MAX_COUNT),
    dtype=st.sampled_from(DTYPES),
    loss_scale=st.floats(allow_nan=False),
    overflow=st.booleans(),
    retry=st.booleans(),
)
def test_push_header_round_trip_any(**kw: object) -> None:
    h = PushHeader(**kw)  # type: ignore[arg-type]
    assert serde.push_header_from_pb(via_wire(serde.push_header_to_pb(h))) == h


@pytest.mark.parametrize(
    "options",
    [
        pb.StepOptions(lrs=[0.1, float("nan")]),
        pb.StepOptions(lrs=[-0.1]),
        pb.StepOptions(clip_norm=float("inf")),
        pb.StepOptions(clip_norm=1.0, grad_norm=-2.0),
    ],
)
def test_bad_step_options_are_refused(options: pb.StepOptions) -> None:
    m = pb.PushHeader(worker=0, clock=1, dtype=pb.FLOAT32, options=options)
    with pytest.raises(InvalidArgument, match="step options"):
        serde.push_header_from_pb(m)


@pytest.mark.parametrize("field", ["clock", "base_version"])
def test_push_header_counts_past_the_range_are_refused(field: str) -> None:
    m = pb.PushHeader(**{"worker": 0, "clock": 1, "dtype": pb.FLOAT32, field: serde.MAX_COUNT + 1})
    with pytest.raises(InvalidArgument, match=field):
        serde.push_header_from_pb(via_wire(m))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_enum_round_trip(dtype: torch.dtype) -> None:
    assert serde.dtype_from_pb(serde.dtype_to_pb(dtype)) == dtype


# ---- refused ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [pb.DTYPE_UNSPECIFIED, 4, 99])
def test_bad_dtype_enum(value: int) -> None:
    with pytest.raises(InvalidArgument, match="dtype") as e:
        serde.dtype_from_pb(value)
    assert e.value.reason == "bad_dtype"
    # In a header too, whichever way it arrives.
    push = via_wire(pb.PushHeader(worker=0, clock=1, dtype=value))
    with pytest.raises(InvalidArgument, match="dtype"):
        serde.push_header_from_pb(push)
    pull = via_wire(pb.PullHeader(version=1, dtype=value))
    with pytest.raises(InvalidArgument, match="dtype"):
        serde.pull_header_from_pb(pull)


def test_unsupported_torch_dtype_is_refused_on_the_way_out() -> None:
    with pytest.raises(InvalidArgument, match="dtype"):
        serde.dtype_to_pb(torch.float64)
    h = PushHeader(worker=0, clock=1, base_version=0, dtype=torch.int32)
    with pytest.raises(InvalidArgument, match="dtype"):
        serde.push_header_to_pb(h)


@pytest.mark.parametrize("mode", [pb.MODE_UNSPECIFIED, 4, 1000])
def test_bad_mode_enum(mode: int) -> None:
    spec = serde.job_to_pb(Job())
    spec.mode = mode
    with pytest.raises(InvalidArgument, match="mode"):
        serde.job_from_pb(via_wire(spec))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: setattr(s, "num_workers", 0), "num_workers"),
        (lambda s: setattr(s, "num_shards", 0), "shard_index"),
        (lambda s: setattr(s, "shard_index", 5), "shard_index"),
        (lambda s: setattr(s.optimizer, "name", "lamb"), "optimizer"),
        (lambda s: setattr(s.optimizer, "lr", 0.0), "lr"),
        (lambda s: setattr(s.optimizer, "schedule", "step"), "schedule"),
        (lambda s: setattr(s.loss_scale, "growth_interval", 0), "growth_interval"),
        (lambda s: s.slots.extend([s.slots[0]]), "unique"),
    ],
    ids=["workers", "shards", "shard-index", "optimizer", "lr", "schedule", "growth", "dup-slot"],
)
def test_malformed_job_spec(edit, words: str) -> None:  # noqa: ANN001
    spec = serde.job_to_pb(JOBS["sync-fp16-adamw"])
    edit(spec)
    with pytest.raises(InvalidArgument, match=words) as e:
        serde.job_from_pb(via_wire(spec))
    assert e.value.reason == "malformed"
