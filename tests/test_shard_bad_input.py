"""Hand-made bad requests against a real shard on loopback, through raw stubs.

Each case must get the right status code and a message that says what was wrong, and
must leave the shard's state (Stats: state_digest and every counter) byte-for-byte as
it was. The shard keeps serving afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.job import Job
from psar.ps.server.config import ServerConfig
from tests.ps_fixtures import (
    grad_for,
    init_chunks,
    init_values,
    make_job,
    push_chunks,
    raw_stub,
    serving,
    without_speculation,
)

MAX_MESSAGE = 64 << 10
TIMEOUT = 10.0


def server_config() -> ServerConfig:
    return ServerConfig(
        bind="127.0.0.1:0", threads=8, max_message_bytes=MAX_MESSAGE, message_bytes=16 << 10
    )


@dataclass
class Shard:
    stub: pb_grpc.ParameterServerStub
    job: Job
    values: dict[str, torch.Tensor]


def make_ready(stub: pb_grpc.ParameterServerStub) -> Shard:
    """Sync, 2 workers, initialised; worker 0 pushed clock 1, worker 1 has not pushed."""
    job = make_job("sync", num_workers=2, optimizer="adamw")
    values = init_values(job)
    stub.Init(iter(init_chunks(job, values)), timeout=TIMEOUT)
    reply = stub.Push(iter(push_chunks(header(0), grad_for(job, 0, 1))), timeout=TIMEOUT)
    assert reply.applied and reply.version == 0
    return Shard(stub, job, values)


def header(worker: int = 1, clock: int = 1, **kw: object) -> pb.PushHeader:
    fields: dict[str, object] = {
        "worker": worker,
        "clock": clock,
        "base_version": 0,
        "dtype": pb.FLOAT32,
        "loss_scale": 1.0,
    }
    fields.update(kw)
    return pb.PushHeader(**fields)  # type: ignore[arg-type]


def data(key: str, offset: int, raw: bytes) -> pb.PushChunk:
    return pb.PushChunk(data=pb.TensorData(key=key, offset=offset, data=raw))


def push(s: Shard, chunks: list[pb.PushChunk]) -> None:
    s.stub.Push(iter(chunks), timeout=TIMEOUT)


def grads(s: Shard, worker: int = 1, **edits: torch.Tensor) -> dict[str, torch.Tensor]:
    g = grad_for(s.job, worker, 1)
    g.update(edits)
    return {k: v for k, v in g.items() if v.numel()}


def pull(s: Shard, worker: int, clock: int, dtype: int = pb.FLOAT32) -> None:
    for _ in s.stub.Pull(pb.PullRequest(worker=worker, clock=clock, dtype=dtype), timeout=TIMEOUT):
        pass


def init(s: Shard, chunks: Iterator[pb.InitChunk] | list[pb.InitChunk]) -> None:
    s.stub.Init(iter(chunks), timeout=TIMEOUT)


def bad_mode_init(s: Shard) -> list[pb.InitChunk]:
    chunks = init_chunks(s.job, s.values)
    chunks[0].header.job.mode = pb.MODE_UNSPECIFIED
    return chunks


def conflicting_init(s: Shard) -> list[pb.InitChunk]:
    other = make_job("sync", num_workers=2, optimizer="adamw", job_id="someone else's run")
    return init_chunks(other, s.values)


def nan_grads(s: Shard) -> dict[str, torch.Tensor]:
    g = grads(s)
    g["w#0"][3] = float("nan")
    return g


def verdict(overflow: bool = False) -> pb.PushChunk:
    return pb.PushChunk(verdict=pb.PushVerdict(overflow=overflow))


def streamed(s: Shard, *tail: pb.PushChunk, **head: object) -> list[pb.PushChunk]:
    """A push that streams during backward (verdict_follows), then `tail`."""
    return [*push_chunks(header(verdict_follows=True, **head), grads(s)), *tail]


SC = grpc.StatusCode
Case = tuple[str, Callable[[Shard], None], grpc.StatusCode, tuple[str, ...]]

# (id, request, status code, words the message must contain). All against the ready shard.
READY_CASES: list[Case] = [
    # verdicts of pushes streamed during backward
    (
        "verdict-not-announced",
        lambda s: push(s, [*push_chunks(header(), grads(s)), verdict()]),
        SC.INVALID_ARGUMENT,
        ("verdict_follows",),
    ),
    (
        "verdict-twice",
        lambda s: push(s, streamed(s, verdict(), verdict())),
        SC.INVALID_ARGUMENT,
        ("one verdict",),
    ),
    (
        "verdict-missing",
        lambda s: push(s, streamed(s)),
        SC.INVALID_ARGUMENT,
        ("without one", "PushVerdict"),
    ),
    (
        "data-after-overflow-verdict",
        lambda s: push(
            s,
            [
                pb.PushChunk(header=header(verdict_follows=True)),
                verdict(True),
                *push_chunks(header(), grads(s))[1:],
            ],
        ),  # fmt: skip
        SC.INVALID_ARGUMENT,
        ("overflow", "no more data"),
    ),
    (
        "verdict-follows-with-header-overflow",
        lambda s: push(s, [pb.PushChunk(header=header(verdict_follows=True, overflow=True))]),
        SC.INVALID_ARGUMENT,
        ("verdict_follows", "PushVerdict"),
    ),
    # shape and byte count
    (
        "too-many-elements",
        lambda s: push(s, push_chunks(header(), grads(s, **{"b#0": torch.zeros(6)}))),
        SC.INVALID_ARGUMENT,
        ("b#0", "holds 5"),
    ),
    (
        "too-few-elements",
        lambda s: push(s, push_chunks(header(), grads(s, **{"b#0": torch.zeros(4)}))),
        SC.INVALID_ARGUMENT,
        ("incomplete", "b#0"),
    ),
    (
        "missing-slot",
        lambda s: push(s, push_chunks(header(), grads(s, **{"w#1": torch.zeros(0)}))),
        SC.INVALID_ARGUMENT,
        ("incomplete", "w#1"),
    ),
    (
        "bytes-not-whole-fp32-elements",
        lambda s: push(s, [pb.PushChunk(header=header()), data("b#0", 0, b"\0" * 7)]),
        SC.INVALID_ARGUMENT,
        ("7 bytes", "whole number"),
    ),
    (
        "bytes-not-whole-fp16-elements",
        lambda s: push(
            s, [pb.PushChunk(header=header(dtype=pb.FLOAT16)), data("b#0", 0, b"\0" * 3)]
        ),
        SC.INVALID_ARGUMENT,
        ("3 bytes", "whole number"),
    ),
    (
        "piece-at-wrong-offset",
        lambda s: push(s, [pb.PushChunk(header=header()), data("b#0", 2, b"\0" * 8)]),
        SC.INVALID_ARGUMENT,
        ("offset 2", "expected 0"),
    ),
    (
        "unknown-key",
        lambda s: push(s, [pb.PushChunk(header=header()), data("nope#0", 0, b"\0" * 4)]),
        SC.NOT_FOUND,
        ("unknown slot key", "nope#0"),
    ),
    # malformed streams and enums
    (
        "stream-without-header",
        lambda s: push(s, push_chunks(header(), grads(s))[1:]),
        SC.INVALID_ARGUMENT,
        ("start with a header",),
    ),
    ("empty-stream", lambda s: push(s, []), SC.INVALID_ARGUMENT, ("start with a header",)),
    (
        "two-headers",
        lambda s: push(s, [pb.PushChunk(header=header()), pb.PushChunk(header=header())]),
        SC.INVALID_ARGUMENT,
        ("only one header",),
    ),
    (
        "push-dtype-unknown",
        lambda s: push(s, push_chunks(header(dtype=9), grads(s))),
        SC.INVALID_ARGUMENT,
        ("dtype", "9"),
    ),
    (
        "push-dtype-unspecified",
        lambda s: push(s, push_chunks(header(dtype=pb.DTYPE_UNSPECIFIED), grads(s))),
        SC.INVALID_ARGUMENT,
        ("dtype",),
    ),
    ("pull-dtype-unknown", lambda s: pull(s, 0, 0, dtype=9), SC.INVALID_ARGUMENT, ("dtype",)),
    (
        "bad-loss-scale",
        lambda s: push(s, push_chunks(header(loss_scale=0.0), grads(s))),
        SC.INVALID_ARGUMENT,
        ("loss_scale",),
    ),
    (
        "overflow-flag-with-data",
        lambda s: push(s, push_chunks(header(overflow=True), grads(s))),
        SC.INVALID_ARGUMENT,
        ("overflow", "no data"),
    ),
    (
        "unknown-worker",
        lambda s: push(s, push_chunks(header(worker=2), grads(s))),
        SC.INVALID_ARGUMENT,
        ("worker 2", "not in this job"),
    ),
    (
        "pull-unknown-worker",
        lambda s: pull(s, 7, 0),
        SC.INVALID_ARGUMENT,
        ("worker 7", "not in this job"),
    ),
    (
        "leave-unknown-worker",
        lambda s: s.stub.Leave(pb.LeaveRequest(worker=3), timeout=TIMEOUT),
        SC.INVALID_ARGUMENT,
        ("worker 3",),
    ),
    # order and duplicates
    (
        "duplicate-push",
        lambda s: push(s, push_chunks(header(worker=0), grads(s, worker=0))),
        SC.FAILED_PRECONDITION,
        ("duplicate", "clock 1"),
    ),
    (
        "clock-zero",
        lambda s: push(s, push_chunks(header(clock=0, retry=True), grads(s))),
        SC.INVALID_ARGUMENT,
        ("clock must be >= 1",),
    ),
    (
        "out-of-order-clock",
        lambda s: push(s, push_chunks(header(clock=2), grads(s))),
        SC.FAILED_PRECONDITION,
        ("out-of-order", "expected 1"),
    ),
    (
        "gradient-from-wrong-version",
        lambda s: push(s, push_chunks(header(base_version=3), grads(s))),
        SC.FAILED_PRECONDITION,
        ("version 3",),
    ),
    (
        "pull-ahead-of-own-clock",
        lambda s: pull(s, 1, 1),
        SC.FAILED_PRECONDITION,
        ("pushed only 0",),
    ),
    (
        "nan-push-sync-without-overflow-flag",
        lambda s: push(s, push_chunks(header(), nan_grads(s))),
        SC.INVALID_ARGUMENT,
        ("non-finite", "overflow=true"),
    ),
    # init
    (
        "conflicting-init",
        lambda s: init(s, conflicting_init(s)),
        SC.FAILED_PRECONDITION,
        ("different job",),
    ),
    (
        "init-without-header",
        lambda s: init(s, init_chunks(s.job, s.values)[1:]),
        SC.INVALID_ARGUMENT,
        ("header",),
    ),
    ("init-mode-unknown", lambda s: init(s, bad_mode_init(s)), SC.INVALID_ARGUMENT, ("mode",)),
    (
        "init-short-slot",
        lambda s: init(s, init_chunks(s.job, s.values)[:-1]),
        SC.INVALID_ARGUMENT,
        ("incomplete",),
    ),
    # size
    (
        "over-size-message",
        lambda s: push(s, [pb.PushChunk(header=header()), data("b#0", 0, b"\0" * (80 << 10))]),
        SC.RESOURCE_EXHAUSTED,
        ("larger than max",),
    ),
    (
        "over-size-first-message",
        lambda s: push(s, [data("w#0", 0, b"\0" * (MAX_MESSAGE + 4))]),
        SC.RESOURCE_EXHAUSTED,
        ("larger than max",),
    ),
]

# Against a shard nobody has initialised yet.
FRESH_CASES: list[Case] = [
    (
        "push-before-init",
        lambda s: push(s, push_chunks(header(worker=0), grads(s, worker=0))),
        SC.FAILED_PRECONDITION,
        ("not initialised",),
    ),
    (
        "overflow-push-before-init",
        lambda s: push(s, [pb.PushChunk(header=header(worker=0, overflow=True))]),
        SC.FAILED_PRECONDITION,
        ("not initialised",),
    ),
    ("pull-before-init", lambda s: pull(s, 0, 0), SC.FAILED_PRECONDITION, ("not initialised",)),
    (
        "leave-before-init",
        lambda s: s.stub.Leave(pb.LeaveRequest(worker=0), timeout=TIMEOUT),
        SC.FAILED_PRECONDITION,
        ("not initialised",),
    ),
]


@pytest.fixture(scope="module")
def ready() -> Iterator[Shard]:
    with serving(server_config()) as (port, _), raw_stub(port) as stub:
        yield make_ready(stub)


@pytest.fixture(scope="module")
def fresh() -> Iterator[Shard]:
    with serving(server_config()) as (port, _), raw_stub(port) as stub:
        job = make_job("sync", num_workers=2)
        yield Shard(stub, job, init_values(job))


def refused(s: Shard, request: Callable[[Shard], None]) -> grpc.RpcError:
    before = s.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as e:
        request(s)
    after = s.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
    assert after.state_digest == before.state_digest
    assert without_speculation(after) == without_speculation(before), (
        "a refused request changed the shard's counters"
    )
    return e.value


def check(err: grpc.RpcError, code: grpc.StatusCode, words: tuple[str, ...]) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for w in words:
        assert w in err.details(), f"{w!r} not in {err.details()!r}"


@pytest.mark.parametrize(
    ("request_fn", "code", "words"), [c[1:] for c in READY_CASES], ids=[c[0] for c in READY_CASES]
)
def test_refused_when_ready(ready: Shard, request_fn, code, words) -> None:  # noqa: ANN001
    check(refused(ready, request_fn), code, words)


@pytest.mark.parametrize(
    ("request_fn", "code", "words"), [c[1:] for c in FRESH_CASES], ids=[c[0] for c in FRESH_CASES]
)
def test_refused_before_init(fresh: Shard, request_fn, code, words) -> None:  # noqa: ANN001
    check(refused(fresh, request_fn), code, words)


def test_still_serving_after_every_bad_request() -> None:
    """A fresh shard takes every bad request above, then trains on as if none came."""
    with serving(server_config()) as (port, state), raw_stub(port) as stub:
        fresh = Shard(stub, make_job("sync", num_workers=2), init_values(make_job("sync")))
        for _, request_fn, code, words in FRESH_CASES:
            check(refused(fresh, request_fn), code, words)
        s = make_ready(stub)
        digest = state.state_digest()
        for _, request_fn, code, words in READY_CASES:
            check(refused(s, request_fn), code, words)
        assert state.state_digest() == digest
        # Worker 1's real push closes the round; both workers pull the new weights.
        reply = stub.Push(iter(push_chunks(header(), grads(s))), timeout=TIMEOUT)
        assert reply.applied and reply.version == 1
        for worker in (0, 1):
            chunks = list(
                stub.Pull(pb.PullRequest(worker=worker, clock=1, dtype=pb.FLOAT32), timeout=TIMEOUT)
            )
            head = serde.pull_header_from_pb(chunks[0].header)
            assert head.version == 1 and head.rounds == 1
            assert {c.data.key for c in chunks[1:]} == {sl.key for sl in s.job.slots}
        stats = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
        assert stats.version == 1 and list(stats.worker_clocks) == [1, 1]
        assert stats.state_digest != digest
