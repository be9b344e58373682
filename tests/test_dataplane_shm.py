"""The data plane's shared-memory segments (ps/shm.py): real shards, real sockets, real memfds.

- Pushes and pulls through a segment leave a shard byte-identical to one fed through the
  socket, and pull the same weights; pieces that do not fit the segment go in the socket
  in the same call; a shard started with --no-data-shm, or offered a segment under TLS
  (tests/test_dataplane_tls.py covers TLS), keeps the socket.
- A worker's hello naming anything but a sealed memfd of this host with its nonce (a file
  path, an unsealed memfd, a wrong nonce) is not attached: the connection keeps the socket.
- A piece naming shared-memory bytes that are not there (no segment, outside it, with a
  payload too) is refused INVALID_ARGUMENT saying what to do, and the shard is untouched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from psar.ps import framing as fr
from psar.ps import shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import DataPlaneClient, DataPlaneError
from psar.ps.partition import plan_slots
from psar.ps.server.config import ServerConfig
from psar.ps.server.metrics.prometheus import ShardMetrics
from psar.ps.server.serve import start_server, stop_server
from psar.ps.shm import Segment, SegmentRefused
from psar.trainkit.prom import serve_metrics, stop_metrics
from tests.ps_fixtures import grad_for, init_values, make_job, weights_digest
from tests.test_dataplane import END, header, items, pull_into, read_frame
from tests.test_dataplane_bounds import Live

# A model of 23,010 parameters (92 KB in fp32): many pieces, many laps of a small ring.
SLOTS = plan_slots([("w", 20000), ("b", 3000), ("c", 10)], 1)


@contextlib.contextmanager
def live(metrics: Any = None, **cfg: Any) -> Iterator[Live]:
    """A real shard (gRPC server and data plane) with a 2-worker sync job of SLOTS."""
    base: dict[str, Any] = {"bind": "127.0.0.1:0", "threads": 8, "max_message_bytes": 32 << 20}
    server, _, state = start_server(ServerConfig(**{**base, **cfg}), metrics=metrics)
    try:
        job = make_job("sync", num_workers=2, slots=SLOTS)
        state.init(job, init_values(job))
        yield Live(state, server.psar_dataplane, job)
    finally:
        stop_server(server)


pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memfds here")
SC = grpc.StatusCode
TIMEOUT = 10.0


def _train(
    c: DataPlaneClient, s, dtype: int = pb.FLOAT32, first: int = 1
) -> dict[str, torch.Tensor]:  # noqa: ANN001, E501
    """Two workers, two sync rounds through `c` (clocks `first`, `first` + 1); the
    weights worker 0 pulls last."""
    tdt = torch.float16 if dtype == pb.FLOAT16 else torch.float32
    out: dict[str, torch.Tensor] = {}
    for clock in (first, first + 1):
        for w in (0, 1):
            its = items(grad_for(s.job, w, clock), tdt)
            h = header(w, clock, s.state.version, dtype=dtype, verdict_follows=True)
            r = c.push(h, [*its, ("verdict", False)], timeout_s=TIMEOUT)
            assert r.applied
        _, out = pull_into(c, s.job, 0, clock)
    return out


@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.FLOAT16])
def test_a_segment_gives_the_bits_of_the_socket(dtype: int) -> None:
    with live() as a, live() as b:
        with DataPlaneClient("127.0.0.1", a.port) as plain:
            wa = _train(plain, a, dtype)
        with DataPlaneClient("127.0.0.1", b.port, shm_bytes=1 << 20, max_frame_bytes=256) as c:
            wb = _train(c, b, dtype)
            seg = c._idle[0].segment
            assert seg is not None and any(seg.view[shm.HEADER : shm.HEADER + 256])
        assert a.dp.stats()["shm"] == 0
        assert b.dp.stats()["shm"] >= 1
        assert a.state.state_digest() == b.state.state_digest()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k


def test_pieces_past_the_segment_go_in_the_socket() -> None:
    with live() as a, live() as b:
        with DataPlaneClient("127.0.0.1", a.port, max_frame_bytes=1024) as plain:
            wa = _train(plain, a)
        with DataPlaneClient("127.0.0.1", b.port, shm_bytes=200, max_frame_bytes=1024) as c:
            wb = _train(c, b)
            conn = c._idle[0]
            assert conn.segment is not None and conn.segment.size == shm.HEADER + 200
            assert conn.segment.placed > 0
        assert b.dp.stats()["shm"] >= 1
        assert a.state.state_digest() == b.state.state_digest()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_shard_with_no_data_shm_keeps_the_socket() -> None:
    with live(data_shm=False) as s:  # noqa: SIM117
        with DataPlaneClient("127.0.0.1", s.port, shm_bytes=1 << 20) as c:
            _train(c, s)
            assert all(conn.segment is None for conn in c._idle)
        assert s.dp.stats()["shm"] == 0


def _hello(port: int, path: str, nonce: bytes) -> tuple[socket.socket, pb.DataStatus]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    hello = pb.DataHello(version=fr.VERSION, shm_path=path, shm_nonce=nonce)
    sock.sendall(fr.encode(pb.DataFrame(hello=hello)))
    return sock, read_frame(sock).status


def test_only_a_sealed_memfd_of_this_host_with_its_nonce_is_attached(tmp_path) -> None:  # noqa: ANN001
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 4096)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    good = Segment.create(4096)
    try:
        offers = [
            (str(victim), b"0" * 16),  # a file path: never opened
            ("/proc/self/fd/0", b"0" * 16),  # the shard's own stdin, say
            (f"/proc/{os.getpid()}/fd/{unsealed}", b"0" * 16),  # not sealed
            (good.path, b"1" * 16),  # the wrong nonce
            (good.path, good.nonce[:8]),  # a short one
            (f"/proc/{os.getpid()}/fd/99999", good.nonce),  # not there (another host)
        ]
        with live() as s:
            for path, nonce in offers:
                sock, status = _hello(s.port, path, nonce)
                sock.close()
                assert status.code == 0 and not status.shm, path
            assert victim.read_bytes() == b"x" * 4096
            assert s.dp.stats()["shm"] == 0
            sock, status = _hello(s.port, good.path, good.nonce)
            sock.close()
            assert status.code == 0 and status.shm
    finally:
        os.close(unsealed)
        good.close()


@pytest.mark.parametrize(
    ("with_segment", "at", "nbytes", "payload", "words"),
    [
        (False, shm.HEADER, 16, 0, ("no segment", "in the frame")),
        (True, 0, 4097, 0, ("does not lie inside the shared segment's ring",)),
        (True, 4096 - 8, 16, 0, ("does not lie inside the shared segment's ring",)),
        (True, 0, 16, 16, ("also carries a payload",)),
    ],
    ids=["no-segment", "larger-than-the-ring", "across-the-end", "payload-too"],
)
def test_a_piece_naming_bytes_that_are_not_there_is_refused(
    with_segment: bool, at: int, nbytes: int, payload: int, words: tuple[str, ...]
) -> None:
    seg = Segment.create(4096)
    try:
        with live() as s:
            before = weights_digest(s.state)
            if with_segment:
                sock, status = _hello(s.port, seg.path, seg.nonce)
                assert status.shm
            else:
                sock, status = _hello(s.port, "", b"")
                assert not status.shm
            key = s.job.slots[0].key
            bad = pb.DataFrame(piece=pb.DataPiece(key=key, shm_at=at, shm_bytes=nbytes))
            frames = fr.encode(pb.DataFrame(push_header=header(0, 1))) + fr.encode(bad, payload)
            sock.sendall(frames + b"\0" * payload + fr.encode(END))
            reply = read_frame(sock)
            sock.close()
            assert reply.status.code == SC.INVALID_ARGUMENT.value[0], reply
            for w in words:
                assert w in reply.status.details, reply.status.details
            assert weights_digest(s.state) == before
            assert s.state.version == 0
    finally:
        seg.close()


def test_the_ring_reuses_what_the_receiver_has_read() -> None:
    """The sender places a piece only over bytes the receiver has read, never across the
    ring's end; with no room it says so (the piece then goes in the socket)."""
    seg = Segment.create(256)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    peer = Segment.attach(seg.path, seg.nonce, conn)  # the receiver's own mapping
    try:
        assert bytes(seg.view[: shm.NONCE_BYTES]) == seg.nonce
        seg.begin()
        a = seg.put(memoryview(b"a" * 10))
        b = seg.put(memoryview(b"b" * 100))
        assert (a, b) == (0, shm.ALIGN)  # numbered from 0, 64-byte aligned
        assert seg.put(memoryview(b"c" * 100)) is None  # 64 + 128 + 100 > 256: not read yet
        assert bytes(peer.get(b, 100)) == b"b" * 100
        out = bytearray(10)
        peer.copy_out(a, 10, memoryview(out))  # read a: room for 64 more bytes only
        assert bytes(out) == b"a" * 10
        assert seg.put(memoryview(b"c" * 100)) is None
        peer.consumed(b, 100)  # read b too: the ring's start is free again
        c = seg.put(memoryview(b"c" * 100))
        assert c == 256  # did not fit before the end (192 + 100 > 256): the next lap
        assert bytes(peer.get(c, 100)) == b"c" * 100
        seg.begin()  # a new call
        assert seg.put(memoryview(b"d" * 256)) == 0
        with pytest.raises(ValueError, match="inside the shared segment's ring"):
            peer.get(200, 57)
        with pytest.raises(ValueError, match="inside the shared segment's ring"):
            peer.get(0, 257)
        with pytest.raises(SegmentRefused, match="not /proc"):
            Segment.attach("/dev/shm/x", seg.nonce, conn)
    finally:
        peer.close()
        seg.close()
        for sock in (conn, client, listener):
            sock.close()


def test_a_small_ring_carries_a_model_larger_than_itself() -> None:
    """A 4 KiB ring and pieces of 1 KiB: a model many times its size goes through it and
    the socket (pieces finding no room), same bits (laps: the unit test above)."""
    with live() as a, live() as b:
        with DataPlaneClient("127.0.0.1", a.port, max_frame_bytes=1024) as plain:
            wa = _train(plain, a)
        with DataPlaneClient("127.0.0.1", b.port, shm_bytes=4096, max_frame_bytes=1024) as c:
            wb = _train(c, b)
            segs = [conn.segment for conn in c._idle]
            assert all(seg is not None and seg.ring == 4096 for seg in segs)
            # Each of the 4 pushes (92 KB) fills the ring at least once; how many laps
            # more depends on how fast the shard reads (the rest went in the socket).
            assert sum(seg.placed for seg in segs) >= 4 * 4096
        assert a.state.state_digest() == b.state.state_digest()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_worker_whose_shard_cannot_attach_keeps_the_socket(monkeypatch) -> None:  # noqa: ANN001
    """The shard is on this host but cannot open the worker's /proc path (another PID
    namespace, say): the hello's OK says no segment, and training goes on in the socket."""
    with live() as s:
        monkeypatch.setattr(Segment, "create", _elsewhere(Segment.create))
        with DataPlaneClient("127.0.0.1", s.port, shm_bytes=1 << 20) as c:
            _train(c, s)
            assert all(conn.segment is None for conn in c._idle)
        assert s.dp.stats()["shm_refused"] >= 1


def _elsewhere(create):  # noqa: ANN001, ANN202
    def make(nbytes: int) -> Segment:
        seg = create(nbytes)
        seg.path = "/proc/999999999/fd/3"
        return seg

    return make


def test_a_refused_shm_push_is_reported_to_the_client() -> None:
    """Through the client: a shard's refusal of a push sent through the segment keeps
    its code and words (here: a slot that is not on the shard)."""
    with live() as s, DataPlaneClient("127.0.0.1", s.port, shm_bytes=1 << 20) as c:
        h = header(0, 1)
        with pytest.raises(DataPlaneError) as e:
            c.push(h, [("data", "nope", 0, torch.zeros(4))], timeout_s=TIMEOUT)
        assert e.value.code() == SC.NOT_FOUND
        assert s.state.version == 0


def test_metrics_say_how_each_connection_carries_its_bytes() -> None:
    """/metrics, scraped over HTTP: psar_ps_data_connections_total{transport} counts the
    connections through the shared-memory ring and those through the socket."""
    metrics = ShardMetrics(shard=0)
    http, _ = serve_metrics(metrics.registry, 0)
    try:
        with live(metrics=metrics) as s:
            with DataPlaneClient("127.0.0.1", s.port, shm_bytes=1 << 20) as c:
                _train(c, s)
                via_shm = len(c._idle)
            with DataPlaneClient("127.0.0.1", s.port) as c:
                _train(c, s, first=3)
                via_socket = len(c._idle)
            url = f"http://127.0.0.1:{http.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
    finally:
        stop_metrics(http)
    got = {
        s.labels["transport"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "psar_ps_data_connections_total"
    }
    assert got["shm"] == via_shm >= 1
    assert got["socket"] == via_socket >= 1
