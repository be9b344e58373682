"""Waiting calls park instead of holding gRPC handler threads (issue #18, item 6).

Under the sync grpc.server each sync-mode pull waiting for its round held one of the
`--rpc-threads` handler threads: with as many waiting pulls as threads, Stats and the push
that would close the round timed out. The shard now serves with grpc.aio
(ps/server/doors/aio_host.py) and a waiting Pull or GetJob(wait) parks on its event loop
(ps/server/pulls/parking.py). Against a real shard on loopback with `--rpc-threads 16`:

- 128 sync pulls wait for the round of a 129-worker job: Stats and Heartbeat still
  answer, worker 0's round-closing push completes, then all 128 pulls are served the
  round's weights (checked against torch's own optimizer);
- 128 GetJob(wait) calls wait for rank 0's Init: the Init (a streaming call, which needs
  a handler thread) goes through and every waiter gets the job;
- a parked pull still ends at its deadline (DEADLINE_EXCEEDED, the shard's words), and a
  caller that gives up leaves nothing parked behind.

No wall-clock assertions: every wait below is a generous timeout that only fails a hung
shard.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.server.config import ServerConfig
from psar.ps.server.pulls.parking import parking_of
from tests.ps_fixtures import (
    grad_for,
    init_chunks,
    init_values,
    make_job,
    mean_in_rank_order,
    push_chunks,
    reference_weights,
    serving,
)

THREADS = 16
WAITERS = 128  # 8x the handler threads
CHANNELS = 8  # workers have channels of their own; a few connections carry the 128 calls
TIMEOUT = 60.0  # generous: only a hung shard reaches it
SC = grpc.StatusCode


def config() -> ServerConfig:
    # The data plane is off: every push and pull goes through gRPC, as under TLS before
    # the data plane spoke TLS (the setting in which issue #18 saw rounds never finish).
    return ServerConfig(bind="127.0.0.1:0", threads=THREADS, data_port=-1)


@contextlib.contextmanager
def stubs(port: int, n: int = CHANNELS) -> Iterator[list[pb_grpc.ParameterServerStub]]:
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(n)]
    try:
        yield [pb_grpc.ParameterServerStub(ch) for ch in channels]
    finally:
        for ch in channels:
            ch.close()


def eventually(what: str, cond: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.02)


def header(worker: int, clock: int, base_version: int = 0) -> pb.PushHeader:
    return pb.PushHeader(
        worker=worker, clock=clock, base_version=base_version, dtype=pb.FLOAT32, loss_scale=1.0
    )


def assemble(stream: Any, numel: dict[str, int]) -> tuple[pb.PullHeader, dict[str, Any]]:
    """A Pull stream's header and its pieces as flat fp32 tensors."""
    out = {k: torch.empty(n) for k, n in numel.items()}
    head = None
    for chunk in stream:
        if chunk.WhichOneof("kind") == "header":
            head = chunk.header
        else:
            d = chunk.data
            src = wire.decode(d.data, torch.float32)
            out[d.key][d.offset : d.offset + src.numel()].copy_(src)
    assert head is not None, "a pull stream without its header"
    return head, out


def test_128_waiting_pulls_on_16_threads_leave_stats_and_the_closing_push_served() -> None:
    job = make_job("sync", num_workers=WAITERS + 1)
    values = init_values(job)
    grads = {w: grad_for(job, w, 1) for w in range(WAITERS + 1)}
    with serving(config()) as (port, state), stubs(port) as ss:
        assert state.__dict__.get("_parking") is None or len(parking_of(state)) == 0
        ss[0].Init(iter(init_chunks(job, values)), timeout=TIMEOUT)
        # Workers 1..128 push for round 1 and pull at clock 1: the round needs worker 0.
        for w in range(1, WAITERS + 1):
            ss[w % CHANNELS].Push(iter(push_chunks(header(w, 1), grads[w])), timeout=TIMEOUT)
        pulls = [
            ss[w % CHANNELS].Pull(
                pb.PullRequest(worker=w, clock=1, dtype=pb.FLOAT32), timeout=TIMEOUT
            )
            for w in range(1, WAITERS + 1)
        ]
        try:
            parking = parking_of(state)
            eventually(f"{WAITERS} pulls parked", lambda: len(parking) == WAITERS)
            # Every one of them is waiting, not served: the round is still open.
            stats = ss[0].Stats(pb.StatsRequest(), timeout=TIMEOUT)
            assert stats.rounds == 0 and stats.version == 0
            assert list(stats.worker_clocks) == [0] + [1] * WAITERS
            live = ss[1].Heartbeat(pb.HeartbeatRequest(worker=0), timeout=TIMEOUT)
            assert live.live
            # The round-closing push needs a handler thread: it gets one.
            reply = ss[0].Push(iter(push_chunks(header(0, 1), grads[0])), timeout=TIMEOUT)
            assert reply.version == 1
            want = reference_weights(job, values, [mean_in_rank_order(grads)])
            for p in pulls:
                head, got = assemble(p, state.numel)
                assert head.rounds == 1 and head.version == 1
                for k in want:
                    assert torch.equal(got[k], want[k]), f"slot {k} differs"
        finally:
            for p in pulls:
                p.cancel()
        assert len(parking_of(state)) == 0
        assert ss[0].Stats(pb.StatsRequest(), timeout=TIMEOUT).rounds == 1


def test_128_getjob_waits_on_16_threads_let_rank_0_init_through() -> None:
    job = make_job("sync", num_workers=WAITERS + 1)
    with serving(config()) as (port, state), stubs(port) as ss:
        waits = [
            ss[w % CHANNELS].GetJob.future(pb.GetJobRequest(wait=True), timeout=TIMEOUT)
            for w in range(1, WAITERS + 1)
        ]
        try:
            parking = parking_of(state)
            eventually(f"{WAITERS} GetJob(wait) parked", lambda: len(parking) == WAITERS)
            assert not any(f.done() for f in waits)
            assert ss[0].Stats(pb.StatsRequest(), timeout=TIMEOUT).version == 0
            reply = ss[0].Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
            assert not reply.already_initialized
            for f in waits:
                got = f.result(timeout=TIMEOUT)
                assert got.initialized and serde.job_from_pb(got.job) == job
        finally:
            for f in waits:
                f.cancel()
        eventually("nothing parked", lambda: len(parking_of(state)) == 0)


def test_a_parked_pull_ends_at_its_deadline_and_a_cancelled_one_unparks() -> None:
    job = make_job("sync", num_workers=2)
    with serving(config()) as (port, state), stubs(port, 1) as (stub,):
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        stub.Push(iter(push_chunks(header(1, 1), grad_for(job, 1, 1))), timeout=TIMEOUT)
        req = pb.PullRequest(worker=1, clock=1, dtype=pb.FLOAT32)
        # A deadline passes while it is parked: the shard's own DEADLINE_EXCEEDED (or
        # gRPC's, whichever fires first), and nothing stays parked.
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Pull(req, timeout=1.0))
        assert info.value.code() == SC.DEADLINE_EXCEEDED
        parking = parking_of(state)
        eventually("the timed-out pull unparked", lambda: len(parking) == 0)
        # A caller that gives up: its parked pull goes away with it.
        call = stub.Pull(req, timeout=TIMEOUT)
        eventually("the pull parked", lambda: len(parking) == 1)
        call.cancel()
        eventually("the cancelled pull unparked", lambda: len(parking) == 0)
        # The round still closes and a new pull is served at once.
        stub.Push(iter(push_chunks(header(0, 1), grad_for(job, 0, 1))), timeout=TIMEOUT)
        head = next(iter(stub.Pull(req, timeout=TIMEOUT))).header
        assert head.rounds == 1


def test_a_parked_pull_waits_through_a_drain_for_the_round_in_flight() -> None:
    """SIGTERM's drain lets the sync round in flight finish (docs/reliability.md): a pull
    parked on that round stays parked, then is served when the round closes."""
    job = make_job("sync", num_workers=2)
    with serving(config()) as (port, state), stubs(port, 1) as (stub,):
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        for w in (0, 1):
            stub.Push(iter(push_chunks(header(w, 1), grad_for(job, w, 1))), timeout=TIMEOUT)
        # Round 1 closed; worker 1 pushes for round 2 and waits for it in its pull.
        stub.Push(iter(push_chunks(header(1, 2, 1), grad_for(job, 1, 2))), timeout=TIMEOUT)
        call = stub.Pull(pb.PullRequest(worker=1, clock=2, dtype=pb.FLOAT32), timeout=TIMEOUT)
        parking = parking_of(state)
        eventually("the pull parked", lambda: len(parking) == 1)
        state.durability.drain()  # notifies the shard: the parked pull is looked at and stays
        time.sleep(0.3)
        assert len(parking) == 1  # (call.running() says nothing: unread replies keep it so)
        stub.Push(iter(push_chunks(header(0, 2, 1), grad_for(job, 0, 2))), timeout=TIMEOUT)
        head = next(iter(call)).header  # the round in flight finished: it is served
        assert head.rounds == 2


@pytest.mark.parametrize("method", ["Stats", "GetJob", "Pull", "Heartbeat", "PullRows"])
def test_an_undecodable_request_is_invalid_argument_not_unknown(method: str) -> None:
    """grpc.aio answers a request it cannot decode UNKNOWN from outside the handler; the
    shard's handlers refuse it themselves (ps/server/doors/aio_host.py guard), saying so."""
    job = make_job("sync", num_workers=1)
    with serving(config()) as (port, state), stubs(port, 1) as (stub,):
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        before = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).state_digest
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_stream if method.startswith("Pull") else ch.unary_unary
            rpc = call(f"/psar.v1.ParameterServer/{method}")  # raw bytes out, raw bytes in
            with pytest.raises(grpc.RpcError) as info:
                reply = rpc(b"\xff\xff", timeout=TIMEOUT)
                list(reply) if method.startswith("Pull") else reply
        assert info.value.code() == SC.INVALID_ARGUMENT, info.value
        assert "could not be decoded" in info.value.details()
        assert stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).state_digest == before


def test_a_parked_pull_is_served_when_the_missing_worker_s_lease_expires() -> None:
    """The lease reaper drops a silent worker; the round closes without it and wakes the
    pull parked on it (the reaper's notify reaches the parking watcher)."""
    job = make_job("sync", num_workers=2)
    cfg = ServerConfig(bind="127.0.0.1:0", threads=THREADS, data_port=-1, lease_s=1.0)
    cfg.join_grace_s = 0.0
    with serving(cfg) as (port, state), stubs(port, 1) as (stub,):
        stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        stub.Push(iter(push_chunks(header(1, 1), grad_for(job, 1, 1))), timeout=TIMEOUT)
        call = stub.Pull(pb.PullRequest(worker=1, clock=1, dtype=pb.FLOAT32), timeout=TIMEOUT)
        eventually("the pull parked", lambda: len(parking_of(state)) == 1)

        def round_closed() -> bool:  # worker 1 stays alive meanwhile; worker 0 is silent
            stub.Heartbeat(pb.HeartbeatRequest(worker=1), timeout=TIMEOUT)
            return stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).rounds == 1

        eventually("worker 0 dropped and the round closed", round_closed)
        head = next(iter(call)).header
        assert head.rounds == 1
        stats = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)
        assert list(stats.live_worker_ids) == [1] and stats.lease_expirations == 1
        assert len(parking_of(state)) == 0
