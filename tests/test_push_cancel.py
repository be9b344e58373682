"""A push takes effect only when its stream ends cleanly (issue #33, items 2 and 3).

Real shards (gRPC + data plane on loopback), hand-made clients: a real gRPC channel
whose Push stream never half-closes, and raw data-plane sockets that never send the
push's `end` frame.

- A push cancelled by its client at any point (after its header, after some pieces,
  after its last piece or verdict), without half-closing, leaves the shard's state
  digest (Stats.state_digest: masters, optimizer state, clocks, version) unchanged, in
  sync (fp32, and fp16 summed exactly as it arrives: nothing of the cut push stays in
  the round's sum) and async, on both doors; the worker's next push of the same clock
  is then applied as new (not "already applied").
- A data-plane push that stalls (a piece that never comes) does not make the same
  worker's push over gRPC wait for the stalled connection's deadline: the newer push
  supersedes it across doors (the stalled one is cut and applies nothing), as a newer
  data-plane push already did.

The shard's progress through a push is observed with a spy on the real ShardState (its
begin_push and add_data_from run unchanged): the tests wait until the shard has taken
everything the client sent before cutting, and until the cut push released its worker's
lock before comparing digests, so a late apply cannot slip past the check.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.client.tcp_transport import DataPlaneClient
from psar.ps.job import Job
from psar.ps.server.config import ServerConfig
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import grad_for, init_values, make_job, push_chunks
from tests.test_dataplane import header, items, raw_conn
from tests.test_dataplane_bounds import until

TIMEOUT = 10.0
MESSAGE = 24  # bytes per piece: several pieces per slot, so "some pieces" is a real cut


@dataclass
class Spy:
    """What the shard took of the pushes in flight (wraps the real methods)."""

    tickets: list[Any] = field(default_factory=list)
    pieces: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, state: ShardState) -> None:
        intake = state.intake
        begin, add = intake.begin_push, intake.add_data_from

        def begin_push(*a: Any, **kw: Any) -> Any:
            ticket = begin(*a, **kw)
            with self.lock:
                self.tickets.append(ticket)
            return ticket

        def add_data_from(*a: Any, **kw: Any) -> None:
            add(*a, **kw)
            with self.lock:
                self.pieces += 1

        intake.begin_push = begin_push  # type: ignore[method-assign]
        intake.add_data_from = add_data_from  # type: ignore[method-assign]

    def released(self) -> bool:
        """Every push the shard began has let go of its worker's lock (applied or not)."""
        with self.lock:
            return all(t.lock is None for t in self.tickets)


@dataclass
class Shard:
    state: ShardState
    port: int
    data_port: int
    job: Job
    spy: Spy
    stub: Any

    def digest(self) -> str:
        return self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT).state_digest


@contextlib.contextmanager
def shard(mode: str, workers: int) -> Iterator[Shard]:
    server, port, state = start_server(ServerConfig(bind="127.0.0.1:0", threads=8))
    try:
        job = make_job(mode, num_workers=workers, optimizer="adamw")
        state.init(job, init_values(job))
        spy = Spy()
        spy.install(state)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield Shard(state, port, server.psar_dataplane.port, job, spy,
                        pb_grpc.ParameterServerStub(ch))  # fmt: skip
    finally:
        stop_server(server)


def chunks(
    s: Shard, worker: int, clock: int, verdict: bool, fp16: bool = False
) -> list[pb.PushChunk]:
    wire_dtype = {"dtype": pb.FLOAT16} if fp16 else {}
    h = header(worker, clock, verdict_follows=verdict, **wire_dtype)
    dtype = torch.float16 if fp16 else torch.float32
    out = push_chunks(h, grad_for(s.job, worker, clock), dtype=dtype, message_bytes=MESSAGE)
    if verdict:
        out.append(pb.PushChunk(verdict=pb.PushVerdict(overflow=False)))
    return out


# Where the client cuts: after the header, after some pieces, after every piece (and the
# verdict of a push that streams one).
CUTS = ["header", "some", "all", "all+verdict"]


def cut_at(cut: str, stream: list[Any]) -> tuple[int, int]:
    """(messages or frames sent before the cut, pieces the shard will have taken)."""
    pieces = sum(1 for m in stream if m.WhichOneof("kind") in ("data", "piece"))
    if cut == "header":
        return 1, 0
    if cut == "some":
        return 1 + pieces // 2, pieces // 2
    return len(stream), pieces


def grpc_push_cancelled(s: Shard, stream: list[pb.PushChunk], sent: int, pieces: int) -> None:
    """A real gRPC Push that sends `sent` messages and is then cancelled by the client,
    never half-closing its stream."""
    hold = threading.Event()

    def requests() -> Iterator[pb.PushChunk]:
        yield from stream[:sent]
        hold.wait(TIMEOUT)  # no half-close: the stream stays open until the cancel

    future = s.stub.Push.future(requests(), timeout=TIMEOUT)
    try:
        until(lambda: len(s.spy.tickets) == 1 and s.spy.pieces == pieces,
              "the shard took everything sent")  # fmt: skip
        future.cancel()
    finally:
        hold.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()


def frames_of(stream: list[pb.PushChunk]) -> list[tuple[pb.DataFrame, bytes]]:
    out = []
    for m in stream:
        kind = m.WhichOneof("kind")
        if kind == "header":
            out.append((pb.DataFrame(push_header=m.header), b""))
        elif kind == "data":
            piece = pb.DataPiece(key=m.data.key, offset=m.data.offset)
            out.append((pb.DataFrame(piece=piece), m.data.data))
        else:
            out.append((pb.DataFrame(verdict=m.verdict), b""))
    return out


def data_push_cut(s: Shard, stream: list[pb.PushChunk], sent: int, pieces: int, how: str) -> None:
    """A raw data-plane push: hello, `sent` frames, never its end frame; then the socket
    is closed (FIN) or reset (RST)."""
    sock = raw_conn(s.data_port)
    try:
        sock.sendall(b"".join(fr.encode(f, len(p)) + p for f, p in frames_of(stream)[:sent]))
        until(lambda: len(s.spy.tickets) == 1 and s.spy.pieces == pieces,
              "the shard took everything sent")  # fmt: skip
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("door", ["grpc", "data-fin", "data-reset"])
@pytest.mark.parametrize("mode", ["sync", "sync-fp16", "async"])
def test_a_cancelled_push_changes_nothing(mode: str, door: str, cut: str) -> None:
    fp16 = mode.endswith("fp16")
    mode = mode.removesuffix("-fp16")
    with shard(mode, workers=2) as s:
        before = s.digest()
        stream = chunks(s, 0, 1, verdict=cut == "all+verdict", fp16=fp16)
        sent, pieces = cut_at(cut, stream)
        if door == "grpc":
            grpc_push_cancelled(s, stream, sent, pieces)
        else:
            data_push_cut(s, stream, sent, pieces, door.removeprefix("data-"))
        until(s.spy.released, "the cut push let go of its worker")
        assert s.digest() == before, f"a push cut after {cut} changed the shard ({door})"
        assert s.state.clocks == [0, 0] and s.state.version == 0
        if fp16 and cut != "header":  # its slots were summed as they came, then withdrawn
            exact = s.state.policy.exact
            assert exact is not None and not any(exact.counted.values())
        # The worker's push of the same clock is new, not a duplicate of the cut one.
        reply = s.stub.Push(iter(chunks(s, 0, 1, verdict=False, fp16=fp16)), timeout=TIMEOUT)
        assert not reply.already_applied
        if mode == "sync":
            assert s.state.version == 0  # the round waits for worker 1
            reply = s.stub.Push(iter(chunks(s, 1, 1, verdict=False, fp16=fp16)), timeout=TIMEOUT)
        assert reply.applied and s.state.version == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_that_half_closes_is_applied(mode: str) -> None:
    """The control of the test above: the same hand-made client, half-closing after its
    last piece, is applied (the cut, not the client, is what changes nothing)."""
    with shard(mode, workers=1) as s:
        before = s.digest()
        reply = s.stub.Push(iter(chunks(s, 0, 1, verdict=True)), timeout=TIMEOUT)
        assert reply.applied and not reply.already_applied and s.digest() != before


# ---- item 3: a stalled data-plane push is superseded by a gRPC push -----------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stalled_data_plane_push_is_superseded_by_a_grpc_push(mode: str) -> None:
    """A data-plane push that stalls after one piece holds its worker's push lock; the
    worker's push of the same clock over gRPC takes over at once (well within a deadline
    far under the 60 s the lock would make it wait) and is applied; the stalled
    connection is cut and can no longer finish its push."""
    with shard(mode, workers=1) as s:
        stream = chunks(s, 0, 1, verdict=False)
        frames = frames_of(stream)
        stalled = raw_conn(s.data_port)
        try:
            stalled.sendall(b"".join(fr.encode(f, len(p)) + p for f, p in frames[:2]))
            until(lambda: s.spy.pieces == 1, "the stalled push took its first piece")
            reply = s.stub.Push(iter(stream), timeout=5.0)
            assert reply.applied and not reply.already_applied and s.state.version == 1
            assert s.state.intake.in_flight.superseded == 1
            # The stalled connection was cut: finishing its push late changes nothing.
            stalled.settimeout(TIMEOUT)
            with contextlib.suppress(OSError):
                rest = frames[2:] + [(pb.DataFrame(end=pb.DataEnd()), b"")]
                stalled.sendall(b"".join(fr.encode(f, len(p)) + p for f, p in rest))
                while stalled.recv(1 << 16):
                    pass
        finally:
            stalled.close()
        until(s.spy.released, "the stalled push let go of its worker")
        assert s.state.version == 1 and s.state.clocks == [1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stalled_grpc_push_is_superseded_by_a_data_plane_push(mode: str) -> None:
    """The other way round: a gRPC push that stalls after one piece (its stream open, no
    more messages) does not make the worker's data-plane push wait; the gRPC call ends
    with ABORTED saying it was superseded, and applies nothing."""
    with shard(mode, workers=1) as s:
        stream = chunks(s, 0, 1, verdict=False)
        hold = threading.Event()

        def requests() -> Iterator[pb.PushChunk]:
            yield from stream[:2]
            hold.wait(TIMEOUT)

        stalled = s.stub.Push.future(requests(), timeout=30.0)
        try:
            until(lambda: s.spy.pieces == 1, "the stalled push took its first piece")
            with DataPlaneClient("127.0.0.1", s.data_port) as c:
                g = grad_for(s.job, 0, 1)
                reply = c.push(header(0, 1), items(g), timeout_s=5.0)
            assert reply.applied and not reply.already_applied and s.state.version == 1
            with pytest.raises(grpc.RpcError) as e:
                stalled.result(timeout=TIMEOUT)
            assert e.value.code() == grpc.StatusCode.ABORTED, e.value
            assert "superseded" in e.value.details()
        finally:
            hold.set()
        until(s.spy.released, "the stalled push let go of its worker")
        assert s.state.version == 1 and s.state.clocks == [1]
