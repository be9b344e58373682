"""Per-connection bounds of the data plane (ps/server/doors/dataplane.py, issue #18), against a
real shard and raw sockets on loopback (no mocks).

- A piece prefix that claims 16 MiB and then goes silent costs the shard what was sent,
  not what was claimed (the shard's own buffered-bytes counter, not RSS).
- A connection with no frame for --data-idle-s is closed (before its hello too), a frame
  that stops arriving is cut at its deadline; a push cut either way applies nothing.
- A stalled push connection is superseded by the worker's next push, which goes through.
- --data-max-conns-per-peer refuses the extra connections with a status frame.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import DataPlaneClient
from psar.ps.job import Job
from psar.ps.server.config import ServerConfig
from psar.ps.server.doors.dataplane import DataPlaneServer
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import grad_for, init_values, make_job, without_speculation
from tests.test_dataplane import END, header, items, piece, pull_into, raw_conn, read_frame

SC = grpc.StatusCode
TIMEOUT = 10.0
CLAIM = 16 << 20


@dataclass
class Live:
    state: ShardState
    dp: DataPlaneServer
    job: Job

    @property
    def port(self) -> int:
        return self.dp.port


@contextlib.contextmanager
def live(mode: str = "sync", workers: int = 2, **cfg: Any) -> Iterator[Live]:
    """A real shard (initialised in place: the data plane is what is under test)."""
    base: dict[str, Any] = {"bind": "127.0.0.1:0", "threads": 8, "max_message_bytes": 32 << 20}
    base.update(cfg)
    server, _, state = start_server(ServerConfig(**base))
    try:
        job = make_job(mode, num_workers=workers)
        state.init(job, init_values(job))
        yield Live(state, server.psar_dataplane, job)
    finally:
        stop_server(server)


def until(cond: Callable[[], bool], what: str, limit_s: float = TIMEOUT) -> None:
    """Poll a condition the shard reaches on its own threads (the limit only ends a hung test)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def closed_with(sock: socket.socket) -> pb.DataFrame:
    """The status frame the shard sent before closing; then the connection ends."""
    frame = read_frame(sock)
    assert frame.WhichOneof("kind") == "status", frame
    assert sock.recv(1) == b"", "the shard did not close the connection"
    return frame


def code(frame: pb.DataFrame) -> grpc.StatusCode:
    return fr.CODE_BY_NUMBER[frame.status.code]


def first_piece(job: Job, worker: int, clock: int) -> bytes:
    """Frames of one whole piece (the first slot) of a push."""
    _, key, off, t = items(grad_for(job, worker, clock))[0]
    data = t.numpy().tobytes()
    return fr.encode(piece(key, off), len(data)) + data


# ---- memory ---------------------------------------------------------------------------


def test_a_claimed_length_is_not_allocated_before_its_bytes_arrive() -> None:
    """Issue #18 (2): hello, a refused push header, a piece prefix claiming 16 MiB, and
    silence, on 32 connections: the shard holds about what was sent, not 32 x 16 MiB."""
    with live() as s:
        refused = fr.encode(pb.DataFrame(push_header=header(5, 1)))  # worker 5: not in the job
        head = fr.encode(piece("b#0"), CLAIM)
        socks, sent = [], 0
        try:
            for _ in range(32):
                sock = raw_conn(s.port)
                sock.sendall(refused)
                frame = read_frame(sock)  # refused at once; the rest of the push is drained
                assert code(frame) == SC.INVALID_ARGUMENT, frame
                sock.sendall(head + b"\0" * 1000)
                sent += len(refused) + len(head) + 1000
                socks.append(sock)
            until(lambda: s.dp.stats()["connections"] == 32, "32 connections open")
            time.sleep(0.3)  # let the shard read what came
            st = s.dp.stats()
            claimed = 32 * CLAIM
            # At most the first growth step per connection (64 KiB) until more arrives.
            bound = 32 * fr.FIRST_GROWTH_BYTES
            assert st["buffered_bytes"] <= bound, (st, sent)
            assert st["peak_buffered_bytes"] <= bound < claimed // 100
            # The drain goes on as bytes arrive: the rest of the piece, then the end.
            sock = socks[0]
            sock.sendall(b"\0" * (CLAIM - 1000) + fr.encode(END))
            sock.sendall(fr.encode(pb.DataFrame(push_header=header(0, 1))))
            until(lambda: s.dp.stats()["pushes"] == 33, "the next push read on that connection")
            assert s.dp.stats()["peak_buffered_bytes"] <= 32 * fr.FIRST_GROWTH_BYTES + (
                fr.DISCARD_CHUNK_BYTES
            )
        finally:
            for sock in socks:
                sock.close()
        until(lambda: s.dp.stats()["buffered_bytes"] == 0, "buffers given back on close")


def test_a_buffer_grows_only_as_bytes_arrive() -> None:
    """The reader of a payload (framing.Scratch.fill; headers and converted pieces use
    it) holds at most twice what arrived, however much was claimed."""
    a, b = socket.socketpair()
    with a, b:
        scratch = fr.Scratch()
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(bytes(scratch.fill(b, CLAIM))))
        reader.start()
        data = bytes(range(256)) * (CLAIM // 256)
        part = 300 << 10
        a.sendall(data[:part])
        time.sleep(0.3)
        assert part <= len(scratch.buf) <= 2 * part, len(scratch.buf)
        a.sendall(data[part:])
        reader.join(TIMEOUT)
        assert got == [data] and len(scratch.buf) == CLAIM


# ---- idle and slow connections --------------------------------------------------------


def test_idle_connections_are_closed_after_data_idle_s() -> None:
    with live(data_idle_s=0.5) as s:
        with raw_conn(s.port, hello=False) as silent:  # never says hello
            frame = closed_with(silent)
        assert code(frame) == SC.DEADLINE_EXCEEDED and "hello" in frame.status.details
        with raw_conn(s.port) as pooled:  # said hello, then nothing
            frame = closed_with(pooled)
        assert code(frame) == SC.UNAVAILABLE and "--data-idle-s" in frame.status.details
        assert s.dp.stats()["idle_closed"] == 2
        until(lambda: s.dp.stats()["connections"] == 0, "no connection left open")
        # A worker's pooled connection closed this way is replaced without an error.
        with DataPlaneClient("127.0.0.1", s.port) as c:
            pull_into(c, s.job, 0, 0)
            time.sleep(1.0)
            pull_into(c, s.job, 0, 0)


def test_a_push_gone_silent_or_dripping_is_cut_and_applies_nothing() -> None:
    with live(data_idle_s=0.5) as s:
        before = without_speculation(s.state.stats())
        digest = s.state.state_digest()
        every = b"".join(
            fr.encode(piece(k, o), len(t.numpy().tobytes())) + t.numpy().tobytes()
            for _, k, o, t in items(grad_for(s.job, 1, 1))
        )
        # Every piece, then silence instead of the end frame.
        with raw_conn(s.port) as sock:
            sock.sendall(fr.encode(pb.DataFrame(push_header=header(1, 1))) + every)
            frame = closed_with(sock)
        assert code(frame) == SC.DEADLINE_EXCEEDED and "applies nothing" in frame.status.details
        # A frame that starts, then drips: cut at its deadline, not when it ends.
        with raw_conn(s.port) as sock:
            sock.sendall(fr.encode(pb.DataFrame(push_header=header(1, 1))) + b"PSD1")
            frame = closed_with(sock)
        assert (
            code(frame) == SC.DEADLINE_EXCEEDED and "did not arrive whole" in frame.status.details
        )
        assert s.dp.stats()["deadline_closed"] == 1
        assert s.state.state_digest() == digest
        assert without_speculation(s.state.stats()) == before
        with DataPlaneClient("127.0.0.1", s.port) as c:  # the worker's push still works
            assert c.push(header(1, 1), items(grad_for(s.job, 1, 1)), timeout_s=TIMEOUT).applied


def test_a_stalled_push_is_superseded_by_the_workers_next_one() -> None:
    """Issue #18 (3): a push header and one piece, then silence; the worker's next push
    used to wait 60 s and fail "another push is still in flight"."""
    with live(mode="async", workers=1) as s:
        digest = s.state.state_digest()
        stalled = raw_conn(s.port)
        try:
            stalled.sendall(fr.encode(pb.DataFrame(push_header=header(0, 1))))
            stalled.sendall(first_piece(s.job, 0, 1))
            until(lambda: s.dp.stats()["pushes"] == 1, "the stalled push began")
            time.sleep(0.1)
            assert s.state.state_digest() == digest
            with DataPlaneClient("127.0.0.1", s.port) as c:
                # A deadline well under the 60 s a worker lock used to make it wait.
                reply = c.push(header(0, 1), items(grad_for(s.job, 0, 1)), timeout_s=5.0)
                assert reply.applied and reply.version == 1 and not reply.already_applied
                assert s.dp.stats()["superseded"] == 1
                # The stalled connection was cut: it cannot finish that push any more.
                stalled.settimeout(TIMEOUT)
                with contextlib.suppress(ConnectionResetError):
                    assert stalled.recv(1) == b""
                # And the next push of the worker goes through as usual.
                assert c.push(header(0, 2, base_version=1), items(grad_for(s.job, 0, 2)),
                              timeout_s=5.0).version == 2  # fmt: skip
        finally:
            stalled.close()
        assert s.state.version == 2


# ---- connections per peer -------------------------------------------------------------


def test_connections_per_peer_are_capped_with_a_status() -> None:
    with live(data_max_conns_per_peer=2) as s:
        a, b = raw_conn(s.port), raw_conn(s.port)
        try:
            with raw_conn(s.port, hello=False) as extra:
                extra.sendall(fr.encode(pb.DataFrame(hello=pb.DataHello(version=fr.VERSION))))
                frame = closed_with(extra)
            assert code(frame) == SC.RESOURCE_EXHAUSTED
            assert "--data-max-conns-per-peer" in frame.status.details
            assert s.dp.stats()["refused_peer_cap"] == 1
            # The connections within the cap still serve.
            a.sendall(fr.encode(pb.DataFrame(pull_request=pb.DataPullRequest(
                request=pb.PullRequest(worker=0, clock=0, dtype=pb.FLOAT32), timeout_s=5))))  # fmt: skip
            assert read_frame(a).WhichOneof("kind") == "pull_header"
        finally:
            a.close()
            b.close()
        # Closed ones free their places.
        until(lambda: s.dp.stats()["connections"] == 0, "both connections closed")
        with DataPlaneClient("127.0.0.1", s.port) as c:
            assert pull_into(c, s.job, 0, 0)[0].version == 0


def test_bounds_are_validated() -> None:
    for bad in ({"data_idle_s": 0}, {"data_idle_s": float("inf")}, {"data_idle_s": -1},
                {"data_max_conns_per_peer": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="--data-"):
            ServerConfig(**bad)  # type: ignore[arg-type]
