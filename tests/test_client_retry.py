"""The real PSClient's retries: a lost push reply is re-sent with retry=true and never
applied twice; a shard that is not up yet is waited for (UNAVAILABLE, backoff)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.psclient import ClientConfig, PSClient, PSClientError
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import (
    PARAMS,
    free_port,
    grad_for,
    init_values,
    make_job,
    make_slots,
    push_chunks,
    raw_stub,
    serving,
    stats_digest,
)

FAST = ClientConfig(timeout_s=10.0, pull_timeout_s=10.0, reconnect_timeout_s=10.0)


def shard_jobs(num_shards: int, mode: str = "sync", num_workers: int = 1) -> list[Job]:
    return [
        make_job(
            mode,
            num_workers=num_workers,
            slots=make_slots(PARAMS, num_shards, shard=i),
            shard_index=i,
            num_shards=num_shards,
        )
        for i in range(num_shards)
    ]


def all_values(jobs: list[Job]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for j in jobs:
        out.update(init_values(j, seed=j.shard_index))
    return out


def all_grads(jobs: list[Job], worker: int, clock: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for j in jobs:
        out.update(grad_for(j, worker, clock))
    return out


class LostReply(grpc.RpcError):
    """What the client sees when the connection drops after the shard took the push."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset (simulated: the reply was lost)"


class RecordingStub:
    """Wraps a real stub and records every Push header the client sends through it.
    With lose_first, the first Push reaches the shard but its reply never arrives."""

    def __init__(self, stub: Any, *, lose_first: bool = False) -> None:
        self._stub = stub
        self.lose_first = lose_first
        self.headers: list[pb.PushHeader] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Push(self, chunks: Iterator[pb.PushChunk], **kw: Any) -> pb.PushReply:  # noqa: N802
        chunks = list(chunks)
        self.headers.append(chunks[0].header)
        reply = self._stub.Push(iter(chunks), **kw)
        if self.lose_first and len(self.headers) == 1:
            raise LostReply()
        return reply


@pytest.fixture
def two_shards() -> Iterator[list[tuple[int, Any]]]:
    with serving() as a, serving() as b:
        yield [a, b]


def test_lost_push_reply_is_retried_and_applied_once(two_shards: list) -> None:
    jobs = shard_jobs(2)
    addrs = [f"127.0.0.1:{port}" for port, _ in two_shards]
    with PSClient(addrs, worker=0, cfg=FAST) as client:
        client.set_slots(plan_slots(PARAMS, 2, chunk_bytes=32))
        assert client.init(jobs, all_values(jobs)) == [False, False]
        lossy = RecordingStub(client._stubs[1], lose_first=True)
        client._stubs[1] = lossy
        replies = client.push(
            clock=1, base_versions=[0, 0], dtype=torch.float32, grads=all_grads(jobs, 0, 1)
        )
        # Shard 0 answered normally; shard 1's first reply was lost, so the client sent
        # the push again with retry=true and the shard acknowledged it without re-applying.
        assert [h.retry for h in lossy.headers] == [False, True]
        assert replies[0].applied and not replies[0].already_applied
        assert replies[1].already_applied and not replies[1].applied
        assert [r.version for r in replies] == [1, 1]
        stats = client.stats()
        assert [s["version"] for s in stats] == [1, 1]
        assert [s["updates_applied"] for s in stats] == [1, 1]
        assert [s["worker_clocks"] for s in stats] == [[1], [1]]
        # The next step goes through untouched.
        replies = client.push(
            clock=2, base_versions=[1, 1], dtype=torch.float32, grads=all_grads(jobs, 0, 2)
        )
        assert [(r.applied, r.already_applied, r.version) for r in replies] == [
            (True, False, 2)
        ] * 2


def test_resent_push_with_retry_flag_changes_nothing() -> None:
    jobs = shard_jobs(1)
    with serving() as (port, state), raw_stub(port) as stub:
        with PSClient([f"127.0.0.1:{port}"], worker=0, cfg=FAST) as client:
            client.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
            client.init(jobs, all_values(jobs))
            grads = all_grads(jobs, 0, 1)
            [reply] = client.push(clock=1, base_versions=[0], dtype=torch.float32, grads=grads)
            assert reply.applied and reply.version == 1
        # The worker never saw that reply: it sends the same push again, flagged.
        before = stub.Stats(pb.StatsRequest(), timeout=5)
        header = pb.PushHeader(
            worker=0, clock=1, base_version=0, dtype=pb.FLOAT32, loss_scale=1.0, retry=True
        )
        again = stub.Push(iter(push_chunks(header, grads)), timeout=5)
        assert again.already_applied and not again.applied and again.version == 1
        after = stub.Stats(pb.StatsRequest(), timeout=5)
        assert after == before and after.state_digest == before.state_digest
        # Without the flag the same push is a duplicate, refused, and still changes nothing.
        header.retry = False
        with pytest.raises(grpc.RpcError) as e:
            stub.Push(iter(push_chunks(header, grads)), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "duplicate" in e.value.details()
        assert stats_digest(stub) == before.state_digest == state.state_digest()


class LateServer:
    """A shard on a free port that starts ~0.5 s after `start()`; stopped at teardown."""

    def __init__(self) -> None:
        self.port = free_port()
        self.servers: list[grpc.Server] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, state: ShardState | None = None, delay_s: float = 0.5) -> None:
        def run() -> None:
            if self._stop.wait(delay_s):
                return
            cfg = ServerConfig(bind=f"127.0.0.1:{self.port}", threads=8)
            server, _, _ = start_server(cfg, state)
            self.servers.append(server)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for server in self.servers:
            stop_server(server)


@pytest.fixture
def late() -> Iterator[LateServer]:
    srv = LateServer()
    try:
        yield srv
    finally:
        srv.close()


def test_client_waits_for_a_shard_that_is_not_up_yet(late: LateServer) -> None:
    jobs = shard_jobs(1)
    with PSClient([f"127.0.0.1:{late.port}"], worker=0, cfg=FAST) as client:
        late.start()
        assert not late.servers, "the shard must not be up when the client starts"
        assert client.get_jobs(wait=False) == [None]  # waited for the shard: no job yet
        assert late.servers
        assert client.init(jobs, all_values(jobs)) == [False]
        assert client.get_jobs(wait=True) == jobs


def test_init_waits_for_a_shard_that_is_not_up_yet(late: LateServer) -> None:
    jobs = shard_jobs(1)
    with PSClient([f"127.0.0.1:{late.port}"], worker=0, cfg=FAST) as client:
        late.start()
        assert not late.servers
        assert client.init(jobs, all_values(jobs)) == [False]
        assert client.init(jobs, all_values(jobs)) == [True]  # a retried init is harmless


def test_push_retries_unavailable_until_the_shard_is_up(late: LateServer) -> None:
    """Push does not wait for a connection: UNAVAILABLE is retried with backoff, and the
    attempt that gets through carries retry=true (harmless: the shard never saw the
    earlier ones, so it is applied as a normal push)."""
    jobs = shard_jobs(1, mode="async", num_workers=2)
    state = ShardState()
    state.init(jobs[0], all_values(jobs))
    with PSClient([f"127.0.0.1:{late.port}"], worker=1, cfg=FAST) as client:
        client.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
        client._stubs[0] = rec = RecordingStub(client._stubs[0])
        late.start(state)
        assert not late.servers, "the shard must not be up when the client starts"
        [reply] = client.push(
            clock=1, base_versions=[0], dtype=torch.float32, grads=all_grads(jobs, 1, 1)
        )
    assert late.servers
    # The first attempt found no shard; the retries said so.
    assert len(rec.headers) >= 2
    assert [h.retry for h in rec.headers] == [False] + [True] * (len(rec.headers) - 1)
    assert reply.applied and not reply.already_applied and reply.version == 1
    assert state.clocks == [0, 1] and state.updates_applied == 1


def test_give_up_after_retry_timeout() -> None:
    cfg = ClientConfig(timeout_s=1.0, reconnect_timeout_s=0.3)
    port = free_port()
    with PSClient([f"127.0.0.1:{port}"], worker=0, cfg=cfg) as client:
        client.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
        jobs = shard_jobs(1)
        with pytest.raises(PSClientError) as e:
            client.push(
                clock=1, base_versions=[0], dtype=torch.float32, grads=all_grads(jobs, 0, 1)
            )
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"127.0.0.1:{port}" in str(e.value)
