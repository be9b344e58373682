"""Property test: malformed and adversarial requests against a live shard.

Random bytes, wrong dtypes, truncated streams, huge declared shapes, NaN/inf, out-of-
order clocks, stale incarnations... Whatever arrives, the shard stays up, answers with
a status code (never UNKNOWN, i.e. never an unhandled exception), refuses with the
right code where the header alone decides it, and its master weights and optimizer
state (Stats' state_digest) stay byte-for-byte what they were.

The shard is in sync mode with 2 workers; worker 0 has pushed clock 1 and the round
waits for worker 1, so the only push that could change state is worker 1's clock-1
push (or its overflow flag): the generator never makes that one valid.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.server.config import ServerConfig
from tests.ps_fixtures import grad_for, init_chunks, push_chunks, raw_stub, serving
from tests.test_shard_bad_input import make_ready

SC = grpc.StatusCode
MAX_MESSAGE = 64 << 10
TIMEOUT = 5.0
REAL = -1  # placeholder for "the shard's real incarnation"
KEYS = ["w#0", "w#1", "b#0", "nope#0", "", "w#0" * 50]
U64 = [0, 1, 2, 3, 5, 2**31, 2**63, 2**64 - 1]
REFUSALS = {
    SC.INVALID_ARGUMENT,
    SC.FAILED_PRECONDITION,
    SC.NOT_FOUND,
    SC.RESOURCE_EXHAUSTED,
    SC.ABORTED,
    SC.UNIMPLEMENTED,
}


@pytest.fixture(scope="module")
def shard() -> Iterator:
    cfg = ServerConfig(
        bind="127.0.0.1:0", threads=8, max_message_bytes=MAX_MESSAGE, message_bytes=16 << 10
    )
    with serving(cfg) as (port, state), raw_stub(port) as stub:
        ready = make_ready(stub)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        yield ready, state, channel
        channel.close()


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([1.0, 0.0, -1.0, math.inf, -math.inf, math.nan, 1e-45, 3.4e38]),
)


def tensor_bytes(values: list[float], dtype: str) -> bytes:
    """Little-endian fp32 ("f") or fp16 ("e") bytes; fp16 overflows to inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype="<f4").astype("<f2" if dtype == "e" else "<f4").tobytes()


payload = st.one_of(
    st.binary(max_size=80),
    st.lists(floats, max_size=12).map(lambda v: tensor_bytes(v, "f")),
    st.lists(floats, max_size=12).map(lambda v: tensor_bytes(v, "e")),
    st.just(b"\x00" * (MAX_MESSAGE + 8)),  # over the message size limit
)

data_chunk = st.builds(
    lambda k, o, d: pb.PushChunk(data=pb.TensorData(key=k, offset=o, data=d)),
    st.sampled_from(KEYS),
    st.sampled_from([0, 1, 3, 4, 8, 12, 2**40, 2**64 - 1]),
    payload,
)


@st.composite
def push_header(draw: st.DrawFn) -> dict:
    return {
        "worker": draw(st.sampled_from([0, 1, 1, 1, 2, 9, 2**32 - 1])),
        "clock": draw(st.sampled_from(U64)),
        "base_version": draw(st.sampled_from(U64)),
        "dtype": draw(st.sampled_from([1, 1, 2, 3, 0, 4, 6])),
        "loss_scale": draw(st.one_of(st.just(1.0), st.just(1024.0), floats)),
        "overflow": draw(st.booleans()),
        "retry": draw(st.booleans()),
        "incarnation": draw(st.sampled_from([0, REAL, 12345, 2**64 - 1])),
    }


def could_apply(h: dict) -> bool:
    """Worker 1's clock-1 push against the current state would close the round."""
    ls = h["loss_scale"]
    return (
        h["worker"] == 1
        and h["clock"] == 1
        and h["dtype"] in (1, 2, 3)
        and ls > 0
        and math.isfinite(ls)
        and h["incarnation"] in (0, REAL)
    )


def expected_push_code(h: dict, incarnation: int) -> grpc.StatusCode | None:
    """The code the header alone decides (checked in this order by the shard)."""
    ls = h["loss_scale"]
    if h["dtype"] not in (1, 2, 3) or h["worker"] >= 2 or not (ls > 0 and math.isfinite(ls)):
        return SC.INVALID_ARGUMENT
    if h["incarnation"] not in (0, incarnation):
        return SC.ABORTED
    return None


@st.composite
def request(draw: st.DrawFn) -> tuple:
    kind = draw(
        st.sampled_from(["push", "push", "push", "nonfinite", "pull", "init", "raw", "member"])
    )
    if kind == "nonfinite":  # the one push that would apply, but for a NaN/inf inside
        return (
            "nonfinite",
            draw(st.sampled_from(["w#0", "w#1", "b#0"])),
            draw(st.integers(0, 3)),
            draw(st.sampled_from([math.nan, math.inf, -math.inf])),
            draw(st.sampled_from([pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16])),
        )
    if kind == "push":
        h = draw(push_header())
        assume(not could_apply(h))
        layout = draw(st.sampled_from(["header+data", "header-only", "data-only", "two-headers"]))
        return ("push", h, layout, draw(st.lists(data_chunk, max_size=6)))
    if kind == "pull":
        return (
            "pull",
            draw(st.sampled_from([0, 1, 2, 9])),
            draw(st.sampled_from([0, 2, 5, 2**64 - 1])),  # never 1: that pull would wait
            draw(st.integers(0, 6)),
            draw(st.sampled_from([0, REAL, 777])),
        )
    if kind == "init":
        return ("init", draw(st.sampled_from(["huge", "workers0", "mode", "slots", "garbage"])))
    if kind == "raw":
        method = draw(st.sampled_from(["Push", "Init", "Pull", "Register", "Leave", "Nope"]))
        return ("raw", method, draw(st.binary(max_size=200)))
    return (
        "member",
        draw(st.sampled_from(["Heartbeat", "RegisterQuery", "RegisterBad", "Rollback", "Leave"])),
        draw(st.sampled_from([2, 3, 2**32 - 1])),  # workers not in the job (0 and 1 are)
        draw(st.sampled_from(U64)),
    )


def send(ready, channel: grpc.Channel, incarnation: int, req: tuple) -> grpc.StatusCode | None:
    """Send one request; returns the expected code where known. Raises grpc.RpcError."""
    stub = ready.stub
    if req[0] == "push":
        _, h, layout, data = req
        header = pb.PushChunk(header=pb.PushHeader(**{**h, "incarnation": incarnation
                                                      if h["incarnation"] == REAL
                                                      else h["incarnation"]}))  # fmt: skip
        chunks = {
            "header+data": [header, *data],
            "header-only": [header],
            "data-only": data,
            "two-headers": [header, header, *data],
        }[layout]
        stub.Push(iter(chunks), timeout=TIMEOUT)
        return expected_push_code(h, incarnation) if layout != "data-only" else None
    if req[0] == "nonfinite":
        _, key, index, bad, dtype = req
        grads = grad_for(ready.job, 1, 1)
        grads[key][index] = bad
        torch_dtype = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16}.get(
            dtype, torch.bfloat16
        )
        header = pb.PushHeader(worker=1, clock=1, base_version=0, dtype=dtype, loss_scale=1.0,
                               incarnation=incarnation)  # fmt: skip
        stub.Push(iter(push_chunks(header, grads, dtype=torch_dtype)), timeout=TIMEOUT)
        return SC.INVALID_ARGUMENT
    if req[0] == "pull":
        _, worker, clock, dtype, inc = req
        inc = incarnation if inc == REAL else inc
        for _ in stub.Pull(
            pb.PullRequest(worker=worker, clock=clock, dtype=dtype, incarnation=inc),
            timeout=TIMEOUT,
        ):
            pass
        return None
    if req[0] == "init":
        chunks = init_chunks(ready.job, ready.values)
        spec = chunks[0].header.job
        what = req[1]
        if what == "huge":
            spec.slots[0].numel = 2**40
        elif what == "workers0":
            spec.num_workers = 0
        elif what == "mode":
            spec.mode = 9
        elif what == "slots":
            spec.slots.add(key="w#0", param="w", start=0, numel=3)
        else:
            chunks = chunks[:1] + [pb.InitChunk(data=pb.TensorData(key="b#0", offset=1, data=b"x"))]
        stub.Init(iter(chunks), timeout=TIMEOUT)
        return None
    if req[0] == "raw":
        _, method, raw = req
        path = f"/psar.v1.ParameterServer/{method}"
        if method in ("Push", "Init"):
            call = channel.stream_unary(path)
            call(iter([raw, raw]), timeout=TIMEOUT)
        elif method == "Pull":
            for _ in channel.unary_stream(path)(raw, timeout=TIMEOUT):
                pass
        else:
            channel.unary_unary(path)(raw, timeout=TIMEOUT)
        return None
    _, what, worker, number = req
    if what == "Heartbeat":
        stub.Heartbeat(pb.HeartbeatRequest(worker=worker), timeout=TIMEOUT)
    elif what == "RegisterQuery":
        stub.Register(
            pb.RegisterRequest(worker=worker % 2, clock=number, query=True), timeout=TIMEOUT
        )
    elif what == "RegisterBad":
        stub.Register(pb.RegisterRequest(worker=worker, clock=number), timeout=TIMEOUT)
    elif what == "Rollback":  # rounds == 0 here: always "already there"
        stub.Rollback(pb.RollbackRequest(max_round=number), timeout=TIMEOUT)
    else:
        stub.Leave(pb.LeaveRequest(worker=worker), timeout=TIMEOUT)
    return SC.INVALID_ARGUMENT if what in ("Heartbeat", "RegisterBad", "Leave") else None


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(req=request())
def test_adversarial_requests_change_nothing(shard, req: tuple) -> None:
    ready, state, channel = shard
    before = ready.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
    want = None
    try:
        want = send(ready, channel, before.incarnation, req)
        code = SC.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code in REFUSALS or (req[0] == "raw" and code == SC.INTERNAL), (
            f"{code}: {e.details()}"
        )
    if want is not None and code != SC.OK:
        assert code == want, f"{req!r}: got {code}, want {want}"
    after = ready.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)  # the shard is still up
    assert after.state_digest == before.state_digest, f"{req!r} changed the shard"
    assert (after.version, after.rounds, list(after.worker_clocks)) == (0, 0, [1, 0])
    assert after.incarnation == before.incarnation


def test_the_shard_still_trains_after_the_fuzzing(shard) -> None:
    ready, state, _ = shard
    header = pb.PushHeader(
        worker=1, clock=1, base_version=0, dtype=pb.FLOAT32, loss_scale=1.0,
        incarnation=state.incarnation,
    )  # fmt: skip
    reply = ready.stub.Push(iter(push_chunks(header, grad_for(ready.job, 1, 1))), timeout=TIMEOUT)
    assert reply.applied and reply.version == 1
