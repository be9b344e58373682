"""The data plane (ps/server/doors/dataplane.py, ps/client/tcp_transport.py): push and pull as plain TCP
frames next to gRPC, against real shards and sockets on loopback (no mocks).

- The same pushes through the data plane and through gRPC leave byte-identical shards
  (state digest) and pull identical weights; a verdict overflow skips a sync round.
- Every bad input gets the right status code and a message saying what to do, and leaves
  the shard's state and counters as they were; the shard keeps serving.
- Token, --data-port -1, cancel_all, deadlines, unreachable shards (TLS: test_dataplane_tls.py,
  bounds per connection: test_dataplane_bounds.py).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import DataPlaneClient, DataPlaneError
from psar.ps.job import Job
from psar.ps.server.config import ServerConfig
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import (
    grad_for,
    init_chunks,
    init_values,
    make_job,
    push_chunks,
    raw_stub,
    serving,
    weights_digest,
    without_speculation,
)

SC = grpc.StatusCode
MAX_MESSAGE = 64 << 10
TIMEOUT = 10.0

# The first optimizer a process builds imports torch._dynamo: seconds on a loaded machine,
# which must not be spent inside the first test's Init deadline.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def config(**kw: object) -> ServerConfig:
    base: dict[str, object] = {
        "bind": "127.0.0.1:0",
        "threads": 8,
        "max_message_bytes": MAX_MESSAGE,
        "message_bytes": 16 << 10,
    }
    base.update(kw)
    return ServerConfig(**base)  # type: ignore[arg-type]


@dataclass
class Shard:
    port: int
    data_port: int
    state: ShardState
    stub: object
    job: Job


@contextlib.contextmanager
def shard(
    job: Job | None = None, cfg: ServerConfig | None = None, seed: int = 0
) -> Iterator[Shard]:
    """A real shard (gRPC + data plane) on loopback, initialised through gRPC."""
    with serving(cfg or config()) as (port, state), raw_stub(port) as stub:
        if job is not None:
            stub.Init(iter(init_chunks(job, init_values(job, seed))), timeout=TIMEOUT)
        reply = stub.GetJob(pb.GetJobRequest(), timeout=TIMEOUT)
        yield Shard(port, reply.data_port, state, stub, job)  # type: ignore[arg-type]


def header(worker: int, clock: int, base_version: int = 0, **kw: object) -> pb.PushHeader:
    fields: dict[str, object] = {
        "worker": worker,
        "clock": clock,
        "base_version": base_version,
        "dtype": pb.FLOAT32,
        "loss_scale": 1.0,
    }
    fields.update(kw)
    return pb.PushHeader(**fields)  # type: ignore[arg-type]


def items(grads: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> list[tuple]:
    return [("data", k, 0, t.to(dtype).contiguous()) for k, t in grads.items()]


def pull_into(
    c: DataPlaneClient, job: Job, worker: int, clock: int, dtype: int = pb.FLOAT32
) -> tuple[pb.PullHeader, dict[str, torch.Tensor]]:
    out = {s.key: torch.full((s.numel,), float("nan")) for s in job.slots}
    head = c.pull(pb.PullRequest(worker=worker, clock=clock, dtype=dtype), out, timeout_s=TIMEOUT)
    return head, out


def grpc_pull(stub, worker: int, clock: int, job: Job, dtype: int = pb.FLOAT32):  # noqa: ANN001, ANN201
    chunks = list(
        stub.Pull(pb.PullRequest(worker=worker, clock=clock, dtype=dtype), timeout=TIMEOUT)
    )
    out = {s.key: torch.full((s.numel,), float("nan")) for s in job.slots}
    wdt = serde.dtype_from_pb(dtype)
    for ch in chunks[1:]:
        src = wire.decode(ch.data.data, wdt)
        out[ch.data.key][ch.data.offset : ch.data.offset + src.numel()].copy_(src)
    return chunks[0].header, out


# ---- same results as gRPC -------------------------------------------------------------


@pytest.mark.parametrize(("mode", "dtype"), [("sync", pb.FLOAT32), ("async", pb.FLOAT16)])
def test_same_state_and_weights_as_grpc(mode: str, dtype: int) -> None:
    """Two workers, three clocks (one pushing during backward with a verdict): a shard fed
    through the data plane ends byte-identical to one fed the same pushes through gRPC."""
    job = make_job(mode, num_workers=2, optimizer="adamw")
    tdt = serde.dtype_from_pb(dtype)
    with (
        shard(job) as a,
        shard(job) as b,
        DataPlaneClient("127.0.0.1", b.data_port, max_frame_bytes=12) as c,
    ):
        versions = {0: 0, 1: 0}
        for clock in (1, 2, 3):
            for w in (0, 1):
                g = grad_for(job, w, clock)
                streamed = clock == 2 and w == 1
                h = header(w, clock, versions[w], dtype=dtype, verdict_follows=streamed)
                ra = a.stub.Push(iter(_grpc_push(h, g, tdt, streamed)), timeout=TIMEOUT)
                its = items(g, tdt)
                if streamed:  # the verdict arrives before the last pieces
                    its.insert(1, ("verdict", False))
                rb = c.push(h, its, timeout_s=TIMEOUT)
                assert (ra.applied, ra.version, ra.staleness) == (
                    rb.applied,
                    rb.version,
                    rb.staleness,
                )
            for w in (0, 1):
                ha, wa = grpc_pull(a.stub, w, clock, job, dtype)
                hb, wb = pull_into(c, job, w, clock, dtype)
                assert (ha.version, ha.rounds, ha.loss_scale) == (
                    hb.version,
                    hb.rounds,
                    hb.loss_scale,
                )
                assert hb.incarnation == b.state.incarnation
                for k in wa:
                    assert torch.equal(wa[k], wb[k]), k
                versions[w] = hb.version
        assert b.state.version == 3 if mode == "sync" else 6
        assert a.state.state_digest() == b.state.state_digest()


def _grpc_push(h: pb.PushHeader, g: dict[str, torch.Tensor], dtype: torch.dtype, verdict: bool):  # noqa: ANN202
    chunks = push_chunks(h, g, dtype=dtype, message_bytes=12)
    if verdict:
        chunks.insert(2, pb.PushChunk(verdict=pb.PushVerdict(overflow=False)))
    return chunks


def test_pull_converts_dtype_and_reports_each_piece() -> None:
    job = make_job("async", num_workers=1)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        out16 = {sl.key: torch.zeros(sl.numel, dtype=torch.float16) for sl in job.slots}
        seen: list[tuple[str, int, int]] = []
        c.pull(
            pb.PullRequest(worker=0, clock=0, dtype=pb.FLOAT32),
            out16,
            timeout_s=TIMEOUT,
            on_piece=lambda *a: seen.append(a),
        )
        for key, p in s.state.masters.items():
            assert torch.equal(out16[key], p.detach().to(torch.float16))
        assert [k for k, _, _ in seen] == [sl.key for sl in job.slots]
        assert all(n == sl.numel for (_, _, n), sl in zip(seen, job.slots, strict=True))


def test_verdict_overflow_skips_the_sync_round() -> None:
    job = make_job("sync", num_workers=2)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        before = weights_digest(s.state)
        c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        g = items(grad_for(job, 1, 1))
        r = c.push(header(1, 1, verdict_follows=True), [g[0], ("verdict", True)], timeout_s=TIMEOUT)
        assert r.applied
        head, _ = pull_into(c, job, 0, 1)
        assert head.last_round_skipped and head.skipped_rounds == 1 and head.rounds == 1
        assert head.version == 0 and weights_digest(s.state) == before


# ---- bad input ------------------------------------------------------------------------


def raw_conn(port: int, hello: bool = True, token: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    if hello:
        sock.sendall(fr.encode(pb.DataFrame(hello=pb.DataHello(token=token, version=fr.VERSION))))
        frame = read_frame(sock)
        assert frame.status.code == 0, frame
    return sock


def read_frame(sock: socket.socket) -> pb.DataFrame:
    frame, plen = fr.read_header(sock, max_payload_bytes=1 << 30, scratch=fr.Scratch())
    assert plen == 0
    return frame


def prefix(hlen: int, plen: int, magic: bytes = fr.MAGIC) -> bytes:
    return struct.pack("<4sIQ", magic, hlen, plen)


def raw(
    payload: bytes, *, hello: bool = True, half_close: bool = False
) -> Callable[[Shard], pb.DataFrame]:
    """Send raw bytes on a fresh connection; the shard's status frame."""

    def go(s: Shard) -> pb.DataFrame:
        with raw_conn(s.data_port, hello=hello) as sock:
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            return read_frame(sock)

    return go


def frames(*fs: pb.DataFrame, payloads: dict[int, bytes] | None = None) -> bytes:
    out = b""
    for i, f in enumerate(fs):
        p = (payloads or {}).get(i, b"")
        out += fr.encode(f, len(p)) + p
    return out


def piece(key: str, offset: int = 0) -> pb.DataFrame:
    return pb.DataFrame(piece=pb.DataPiece(key=key, offset=offset))


def client_push(
    h: pb.PushHeader, its: Callable[[Job], list], **kw: object
) -> Callable[[Shard], pb.DataFrame]:
    def go(s: Shard) -> pb.DataFrame:
        with DataPlaneClient("127.0.0.1", s.data_port, **kw) as c:  # type: ignore[arg-type]
            try:
                c.push(h, its(s.job), timeout_s=TIMEOUT)
            except DataPlaneError as e:
                return fr.status_frame(e.code(), e.details())
        raise AssertionError("the push was accepted")

    return go


def client_pull(
    worker: int, clock: int, dtype: int = pb.FLOAT32
) -> Callable[[Shard], pb.DataFrame]:
    def go(s: Shard) -> pb.DataFrame:
        with DataPlaneClient("127.0.0.1", s.data_port) as c:
            try:
                pull_into(c, s.job, worker, clock, dtype)
            except DataPlaneError as e:
                return fr.status_frame(e.code(), e.details())
        raise AssertionError("the pull was served")

    return go


def g1(job: Job, **edits: torch.Tensor) -> list[tuple]:
    g = grad_for(job, 1, 1)
    g.update(edits)
    return items(g)


PUSH1 = pb.DataFrame(push_header=header(1, 1))
END = pb.DataFrame(end=pb.DataEnd())
BAD_CASES: list[tuple[str, Callable[[Shard], pb.DataFrame], grpc.StatusCode, tuple[str, ...]]] = [
    # framing
    ("garbage-prefix", raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), SC.INVALID_ARGUMENT, ("magic", "--bind")),
    ("http2-preface-before-hello", raw(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", hello=False), SC.INVALID_ARGUMENT, ("magic",)),
    ("short-prefix", raw(b"PSD1\x05", half_close=True), SC.INVALID_ARGUMENT, ("middle of a frame",)),
    ("short-payload", raw(frames(PUSH1) + fr.encode(piece("b#0"), 100) + b"x" * 10, half_close=True), SC.INVALID_ARGUMENT, ("middle",)),
    ("header-over-limit", raw(prefix(1 << 30, 0)), SC.RESOURCE_EXHAUSTED, ("header", "larger than")),
    ("payload-over-limit", raw(prefix(2, 1 << 60) + b"\x1a\x00"), SC.RESOURCE_EXHAUSTED, ("max_message_bytes", "at most")),
    ("payload-just-over-limit", raw(prefix(2, MAX_MESSAGE + 1)), SC.RESOURCE_EXHAUSTED, ("max_message_bytes",)),
    ("undecodable-header", raw(prefix(3, 0) + b"\xff\xff\xff"), SC.INVALID_ARGUMENT, ("undecodable",)),
    ("unknown-frame-kind", raw(prefix(0, 0)), SC.INVALID_ARGUMENT, ("unknown kind",)),
    ("unexpected-kind-at-top", raw(frames(END)), SC.INVALID_ARGUMENT, ("unexpected end frame",)),
    ("payload-on-a-header-frame", raw(fr.encode(PUSH1, 4) + b"\0" * 4), SC.INVALID_ARGUMENT, ("payload", "only piece")),
    ("missing-hello", raw(frames(PUSH1), hello=False), SC.INVALID_ARGUMENT, ("hello",)),
    (
        "wrong-protocol-version",
        raw(frames(pb.DataFrame(hello=pb.DataHello(version=99))), hello=False),
        SC.FAILED_PRECONDITION,
        ("version 99", "same psar version"),
    ),
    # pushes the shard refuses (the same checks and messages as gRPC)
    ("two-headers", raw(frames(PUSH1, PUSH1, END)), SC.INVALID_ARGUMENT, ("only one header",)),
    ("unknown-key", raw(frames(PUSH1, piece("nope#0"), END, payloads={1: b"\0" * 4})), SC.NOT_FOUND, ("nope#0",)),
    ("piece-at-wrong-offset", raw(frames(PUSH1, piece("b#0", 2), END, payloads={1: b"\0" * 8})), SC.INVALID_ARGUMENT, ("offset 2", "expected 0")),
    ("bytes-not-whole-elements", raw(frames(PUSH1, piece("b#0"), END, payloads={1: b"\0" * 7})), SC.INVALID_ARGUMENT, ("7 bytes", "whole number")),
    ("too-many-elements", client_push(header(1, 1), lambda j: g1(j, **{"b#0": torch.zeros(6)})), SC.INVALID_ARGUMENT, ("b#0", "holds 5")),
    ("incomplete-push", client_push(header(1, 1), lambda j: g1(j)[:-1]), SC.INVALID_ARGUMENT, ("incomplete",)),
    ("verdict-never-came", client_push(header(1, 1, verdict_follows=True), g1), SC.INVALID_ARGUMENT, ("verdict",)),
    ("verdict-not-announced", client_push(header(1, 1), lambda j: [*g1(j), ("verdict", False)]), SC.INVALID_ARGUMENT, ("verdict_follows",)),
    ("duplicate-push", client_push(header(0, 1), lambda j: items(grad_for(j, 0, 1))), SC.FAILED_PRECONDITION, ("duplicate",)),
    ("out-of-order-clock", client_push(header(1, 2), g1), SC.FAILED_PRECONDITION, ("out-of-order",)),
    ("unknown-worker", client_push(header(2, 1), g1), SC.INVALID_ARGUMENT, ("worker 2", "not in this job")),
    ("stale-incarnation", client_push(header(1, 1, incarnation=12345), g1), SC.ABORTED, ("restored",)),
    (
        "nan-in-sync-without-overflow",
        client_push(header(1, 1), lambda j: g1(j, **{"b#0": torch.full((5,), float("nan"))})),
        SC.INVALID_ARGUMENT,
        ("non-finite", "overflow=true"),
    ),
    (
        "piece-over-the-shard-limit",
        client_push(header(1, 1), lambda j: g1(j, **{"b#0": torch.zeros(MAX_MESSAGE // 4 + 1)}), max_frame_bytes=1 << 20),
        SC.RESOURCE_EXHAUSTED,
        ("max_message_bytes",),
    ),
    # pulls
    ("pull-ahead-of-own-clock", client_pull(1, 1), SC.FAILED_PRECONDITION, ("pushed only 0",)),
    ("pull-dtype-unknown", client_pull(0, 0, dtype=9), SC.INVALID_ARGUMENT, ("dtype",)),
    ("pull-unknown-worker", client_pull(7, 0), SC.INVALID_ARGUMENT, ("worker 7",)),
]  # fmt: skip


@pytest.fixture(scope="module")
def ready() -> Iterator[Shard]:
    """Sync, 2 workers, AdamW; worker 0 pushed clock 1 (over the data plane), worker 1 not."""
    job = make_job("sync", num_workers=2, optimizer="adamw")
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        reply = c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        assert reply.applied and reply.version == 0
        yield s


@pytest.mark.parametrize(
    ("request_fn", "code", "words"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_input_is_refused_and_changes_nothing(ready: Shard, request_fn, code, words) -> None:  # noqa: ANN001
    before = ready.state.stats()
    status = request_fn(ready)
    assert status.WhichOneof("kind") == "status"
    got = fr.CODE_BY_NUMBER[status.status.code]
    assert got == code, f"{got}: {status.status.details}"
    for w in words:
        assert w in status.status.details, f"{w!r} not in {status.status.details!r}"
    after = without_speculation(ready.state.stats())
    assert after == without_speculation(before), "a refused request changed the shard"


def test_shard_serves_on_after_bad_input_and_reuses_the_connection() -> None:
    job = make_job("sync", num_workers=2)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        digest = s.state.state_digest()
        for _, request_fn, _, _ in BAD_CASES:
            request_fn(Shard(s.port, s.data_port, s.state, s.stub, job))
        with pytest.raises(DataPlaneError) as e:  # refused on a pooled connection...
            c.push(header(1, 1), items(grad_for(job, 1, 1))[:1], timeout_s=TIMEOUT)
        assert e.value.code() == SC.INVALID_ARGUMENT
        assert s.state.state_digest() == digest
        reply = c.push(header(1, 1), items(grad_for(job, 1, 1)), timeout_s=TIMEOUT)  # ...reused
        assert reply.applied and reply.version == 1 and len(c._idle) == 1
        head, _ = pull_into(c, job, 1, 1)
        assert head.version == 1 and head.rounds == 1


def test_push_before_init_is_failed_precondition() -> None:
    job = make_job("sync", num_workers=2)
    with shard(None) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        with pytest.raises(DataPlaneError) as e:
            c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        assert e.value.code() == SC.FAILED_PRECONDITION and "not initialised" in e.value.details()
        with pytest.raises(DataPlaneError) as e:
            pull_into(c, job, 0, 0)
        assert e.value.code() == SC.FAILED_PRECONDITION


# ---- who may connect, and when there is none ------------------------------------------


def test_token_is_required_and_checked(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    job = make_job("async", num_workers=1)
    cfg = config(auth_token_file=str(tmp_path / "token"))
    with serving(cfg) as (port, state):
        state.init(job, init_values(job))
        dp = state.metrics  # NullShardRecorder: nothing to read; the codes are what matters
        del dp
        data_port = _data_port(port, token="s3cret")
        for token, why in (("", "missing"), ("nope", "wrong")):
            with (
                DataPlaneClient("127.0.0.1", data_port, token=token) as c,
                pytest.raises(DataPlaneError) as e,
            ):
                pull_into(c, job, 0, 0)
            assert e.value.code() == SC.UNAUTHENTICATED and why in e.value.details()
        status = raw(frames(pb.DataFrame(push_header=header(0, 1))), hello=False)(
            Shard(port, data_port, state, None, job)  # type: ignore[arg-type]
        )
        assert fr.CODE_BY_NUMBER[status.status.code] == SC.UNAUTHENTICATED
        assert "hello" in status.status.details
        with DataPlaneClient("127.0.0.1", data_port, token="s3cret") as c:
            head, out = pull_into(c, job, 0, 0)
        assert torch.equal(out["b#0"], state.masters["b#0"].detach())


def _data_port(port: int, token: str = "") -> int:
    from psar.ps import auth
    from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc

    channel = auth.make_channel(f"127.0.0.1:{port}", [], token=token)
    try:
        return (
            pb_grpc.ParameterServerStub(channel)
            .GetJob(pb.GetJobRequest(), timeout=TIMEOUT)
            .data_port
        )
    finally:
        channel.close()


def test_data_port_minus_one_turns_it_off_and_a_fixed_port_is_used() -> None:
    with serving(config(data_port=-1)) as (port, _):
        assert _data_port(port) == 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        fixed = probe.getsockname()[1]
    with serving(config(data_port=fixed)) as (port, _):
        assert _data_port(port) == fixed
    with pytest.raises(ValueError, match="--data-port"):
        config(data_port=-2)


def test_unreachable_shard_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with (
        DataPlaneClient("127.0.0.1", port, connect_timeout_s=2) as c,
        pytest.raises(DataPlaneError) as e,
    ):
        pull_into(c, make_job("async", num_workers=1), 0, 0)
    assert e.value.code() == SC.UNAVAILABLE and isinstance(e.value, grpc.RpcError)


# ---- waiting, cancelling, draining ----------------------------------------------------


def test_cancel_all_aborts_a_pull_waiting_on_the_barrier() -> None:
    job = make_job("sync", num_workers=2)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        errors: list[BaseException] = []

        def waiting_pull() -> None:
            try:
                pull_into(c, job, 0, 1)  # waits for worker 1, who never pushes
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=waiting_pull)
        t.start()
        while not c._busy:  # the pull has its connection
            time.sleep(0.01)
        c.cancel_all()
        t.join(TIMEOUT)
        assert not t.is_alive()
        (e,) = errors
        assert isinstance(e, DataPlaneError) and e.code() == SC.CANCELLED
        # The shard is fine and the client still works: the round closes, both pull.
        c.push(header(1, 1), items(grad_for(job, 1, 1)), timeout_s=TIMEOUT)
        assert pull_into(c, job, 0, 1)[0].version == 1


def test_pull_deadline_gives_the_shards_reason() -> None:
    job = make_job("sync", num_workers=2)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        with pytest.raises(DataPlaneError) as e:
            c.pull(pb.PullRequest(worker=0, clock=1, dtype=pb.FLOAT32), {}, timeout_s=0.2)
        assert e.value.code() == SC.DEADLINE_EXCEEDED
        assert "worker clocks" in e.value.details()


def test_push_items_may_block_between_pieces() -> None:
    job = make_job("async", num_workers=1)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        g = items(grad_for(job, 0, 1))

        def slow():  # noqa: ANN202 - the gradient "arrives" while backward runs
            for it in g:
                time.sleep(0.05)
                yield it

        assert c.push(header(0, 1), slow(), timeout_s=TIMEOUT).applied


def test_draining_refuses_and_close_ends_connections() -> None:
    job = make_job("async", num_workers=1)
    with shard(job) as s, DataPlaneClient("127.0.0.1", s.data_port) as c:
        pull_into(c, job, 0, 0)
        s.state.durability.drain()
        with pytest.raises(DataPlaneError) as e:
            c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        assert e.value.code() == SC.UNAVAILABLE and "draining" in e.value.details()
    with pytest.raises(DataPlaneError) as e:  # the shard (and its data plane) is gone
        pull_into(c, job, 0, 0)
    assert e.value.code() in (SC.UNAVAILABLE, SC.CANCELLED)


def test_real_server_process_advertises_and_serves_the_data_plane() -> None:
    from tests.procs import shards

    job = make_job("async", num_workers=1)
    with shards(1) as (addr,):
        port = int(addr.rpartition(":")[2])
        with raw_stub(port) as stub:
            stub.Init(iter(init_chunks(job, init_values(job))), timeout=TIMEOUT)
        data_port = _data_port(port)
        assert data_port > 0
        with DataPlaneClient("127.0.0.1", data_port) as c:
            assert c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT).version == 1
            assert pull_into(c, job, 0, 1)[0].version == 1
    with shards(1, "--data-port", "-1") as (addr,):
        assert _data_port(int(addr.rpartition(":")[2])) == 0
