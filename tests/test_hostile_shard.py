"""Hostile cases of issue #45 (wire and shard): every refused request gets its status, not
a dropped connection or UNKNOWN, and leaves the shard's state digest unchanged.

- A data-plane piece whose `shm_at` is 2^64-1 (defect 4): its end does not fit the
  segment's 64-bit stream position; the shard dropped the connection with no status
  frame (an unhandled struct.error). Now INVALID_ARGUMENT naming the field.
- Pushes cut off mid-stream under --chunk-rounds (defect 2): no chunk applied early
  from a cut push stays applied (the masters equal a replay of the accepted pushes).
- Step options through a real shard process over gRPC (defect 1): learning rates the
  masters' fp32 cannot take, above the cap, or options on a job that did not declare
  them: INVALID_ARGUMENT, the state digest unchanged, and the sync round still closes.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps import wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.shm import Segment
from tests import hostile as h
from tests.hostile_wire import replay_grpc_push
from tests.ps_fixtures import weights_digest
from tests.test_dataplane import END, header, read_frame
from tests.test_dataplane_shm import _hello, live

SC = grpc.StatusCode


@pytest.mark.parametrize("at", [(1 << 64) - 1, (1 << 64) - 16])
def test_a_piece_whose_shm_at_overflows_gets_a_status_and_changes_nothing(at: int) -> None:
    seg = Segment.create(4096)
    try:
        with live() as s:
            before, digest = weights_digest(s.state), s.state.state_digest()
            sock, status = _hello(s.port, seg.path, seg.nonce)
            assert status.shm
            key = s.job.slots[0].key
            bad = pb.DataFrame(piece=pb.DataPiece(key=key, shm_at=at, shm_bytes=16))
            frames = fr.encode(pb.DataFrame(push_header=header(0, 1))) + fr.encode(bad)
            sock.sendall(frames + fr.encode(END))
            reply = read_frame(sock)
            sock.close()
            assert reply.status.code == SC.INVALID_ARGUMENT.value[0], reply
            assert "shm_at" in reply.status.details
            assert weights_digest(s.state) == before and s.state.state_digest() == digest
    finally:
        seg.close()


BAD = [3.5e38, 1.7976931348623157e308, 1e30, float("nan"), -0.5, float("inf")]


def _push(s: h.HostileShard, worker: int, lr: float | None) -> SC | None:
    """An fp32 push of `worker` into the open round, with step options when `lr` is given."""
    clock, version = s.next_push(worker)
    head = pb.PushHeader(worker=worker, clock=clock, base_version=version, dtype=pb.FLOAT32,
                         loss_scale=1.0, incarnation=s.incarnation)  # fmt: skip
    if lr is not None:
        head.options.CopyFrom(pb.StepOptions(lrs=[lr]))
    chunks = [pb.PushChunk(header=head)]
    for key, t in h.gradient(s.job, random.Random(worker)).items():
        for off, data in wire.iter_pieces(t.contiguous(), h.PIECE_BYTES):
            chunks.append(pb.PushChunk(data=pb.TensorData(key=key, offset=off, data=data)))
    try:
        s.stub.Push(iter(chunks), timeout=h.TIMEOUT)
    except grpc.RpcError as e:
        return e.code()
    return None


@pytest.mark.slow
@pytest.mark.parametrize("declared", [True, False])
def test_hostile_step_options_leave_the_state_untouched(tmp_path: Path, declared: bool) -> None:
    s = h.HostileShard(tmp_path, mode="sync")
    s.job = dataclasses.replace(s.job, step_options=declared)
    try:
        s.start()
        before = s.trace()
        bad = BAD if declared else [0.01]
        for lr in bad:
            for worker in (0, 1):
                assert _push(s, worker, lr) == SC.INVALID_ARGUMENT, lr
                assert s.trace() == before, lr
        assert not s.new_tracebacks()
        for worker in (0, 1):  # not wedged: the round closes with honest pushes
            assert _push(s, worker, 0.01 if declared else None) is None
        assert s.trace()[2] == 1  # one round closed
    finally:
        s.close()


def _cut_push(s: h.HostileShard, call: object, w: int, head: pb.PushHeader, rng: random.Random,
              dtype: torch.dtype) -> list[bytes] | None:  # fmt: skip
    """One push of `w` into the open round, cut off (the client's stream fails) at a random
    message 6 times in 10; its raw messages when accepted."""
    chunks = [pb.PushChunk(header=head)]
    for key, t in h.gradient(s.job, rng).items():
        for off, data in wire.iter_pieces(t.to(dtype).contiguous(), h.PIECE_BYTES):
            chunks.append(pb.PushChunk(data=pb.TensorData(key=key, offset=off, data=data)))
    raw = [c.SerializeToString() for c in chunks]
    cut = rng.random() < 0.6
    n = rng.randrange(1, len(raw) + 1) if cut else len(raw)

    def messages() -> Iterator[bytes]:
        yield from raw[:n]
        if cut:
            time.sleep(rng.random() * 0.02)  # the other worker's slots may land meanwhile
            raise RuntimeError("cut off")  # grpc cancels the call

    try:
        call(messages(), timeout=h.TIMEOUT)  # type: ignore[operator]
    except grpc.RpcError:
        return None
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16-exact"])
def test_hostile_cut_pushes_under_chunk_rounds_leave_no_chunk_applied(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """Issue #45 defect 2: two workers push each round at once over gRPC, most pushes cut
    off mid-stream, under --chunk-rounds: every round's masters equal the mirror's replay
    of the accepted pushes (whole rounds), so no chunk applied early from a cut push
    stays; and the cuts did meet early-applied chunks (undos happened)."""
    wire_dtype = pb.FLOAT32 if dtype == torch.float32 else pb.FLOAT16
    with h.hostile_shard(tmp_path, mode="sync", extra=("--chunk-rounds",)) as s:
        call = s.channel.stream_unary("/psar.v1.ParameterServer/Push",
                                      request_serializer=h._identity,
                                      response_deserializer=pb.PushReply.FromString)  # fmt: skip
        for r in range(12):
            clock, version = s.mirror.rounds + 1, s.mirror.version
            accepted: dict[int, list[bytes]] = {}

            def worker(w: int, rng: random.Random, clock: int = clock, version: int = version,
                       accepted: dict[int, list[bytes]] = accepted) -> None:  # fmt: skip
                head = pb.PushHeader(worker=w, clock=clock, base_version=version,
                                     dtype=wire_dtype, loss_scale=1.0,
                                     incarnation=s.incarnation)  # fmt: skip
                while w not in accepted:
                    raw = _cut_push(s, call, w, head, rng, dtype)
                    if raw is not None:
                        accepted[w] = raw

            threads = [threading.Thread(target=worker, args=(w, random.Random(r * 2 + w)))
                       for w in (0, 1)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            for w in (0, 1):
                assert replay_grpc_push(s.mirror, accepted[w])
            assert s.trace() == s.mirror_trace(), f"round {r + 1}"
        stats = s.stub.Stats(pb.StatsRequest(), timeout=h.TIMEOUT)
        assert stats.chunks_applied_early > 0 and stats.chunk_undos > 0
        assert not s.new_tracebacks()


def test_an_unforeseen_error_in_a_piece_is_internal_on_both_doors() -> None:
    """A bug the checks missed (here: the intake raising a RuntimeError on a piece) is
    INTERNAL with a message on gRPC and an INTERNAL status frame on the data plane, never
    UNKNOWN or a dropped connection, and the push changes nothing."""
    from psar.ps import auth
    from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
    from psar.ps.server.config import ServerConfig
    from psar.ps.server.serve import start_server, stop_server
    from tests.ps_fixtures import init_values, make_job

    server, port, state = start_server(ServerConfig(bind="127.0.0.1:0", threads=4))
    try:
        job = make_job("sync", num_workers=2)
        state.init(job, init_values(job))
        digest = state.state_digest()

        def broken(*_a: object, **_k: object) -> None:
            raise RuntimeError("a bug")

        state.intake.add_data = broken  # type: ignore[method-assign]
        state.intake.add_data_from = broken  # type: ignore[method-assign]
        key = job.slots[0].key
        head = pb.PushHeader(worker=0, clock=1, base_version=0, dtype=pb.FLOAT32, loss_scale=1.0)
        piece = pb.TensorData(key=key, offset=0, data=bytes(16))
        channel = auth.make_channel(f"127.0.0.1:{port}", [])
        try:
            stub = pb_grpc.ParameterServerStub(channel)
            chunks = [pb.PushChunk(header=head), pb.PushChunk(data=piece)]
            with pytest.raises(grpc.RpcError) as e:
                stub.Push(iter(chunks), timeout=30)
            assert e.value.code() == SC.INTERNAL and "a bug" in e.value.details()
        finally:
            channel.close()
        assert state.state_digest() == digest
        dp = server.psar_dataplane  # type: ignore[attr-defined]
        sock, status = _hello(dp.port, "", b"")
        frames = fr.encode(pb.DataFrame(push_header=head))
        frames += fr.encode(pb.DataFrame(piece=pb.DataPiece(key=key, offset=0)), 16) + bytes(16)
        sock.sendall(frames + fr.encode(END))
        reply = read_frame(sock)
        sock.close()
        assert reply.status.code == SC.INTERNAL.value[0] and "a bug" in reply.status.details
        assert state.state_digest() == digest
    finally:
        stop_server(server)
