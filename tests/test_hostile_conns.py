"""Hostile connections against a real `psar server` process (#18): slow senders, stalled
and idle connections, floods, oversize length claims, a token shard, undecodable unary
requests. The harness and the per-request checks are tests/hostile.py and the Campaign of
tests/test_hostile.py (a mirror shard: refused requests leave no trace, accepted ones
change the state exactly as they should); every test prints its summary line.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from tests import hostile as h
from tests import hostile_wire as w
from tests.ps_fixtures import init_chunks
from tests.test_hostile import Campaign, _code, _flood_data_plane, assert_clean

SC = grpc.StatusCode


# ---- floods, slow senders, oversize claims ---------------------------------------------


def _answer(sock: socket.socket, timeout: float) -> tuple[grpc.StatusCode | None, bool]:
    """(the first refusal the shard sent on `sock`, whether it closed it) within `timeout`."""
    sock.settimeout(timeout)
    frames: list[pb.DataFrame] = []
    closed = False
    scratch = fr.Scratch()
    with contextlib.suppress(OSError, fr.FramingError):
        try:
            while True:
                f, plen = fr.read_header(sock, max_payload_bytes=1 << 30, scratch=scratch)
                if plen:
                    fr.recv_payload(sock, plen, scratch)
                frames.append(f)
        except fr.ConnectionClosed:
            closed = True
    return h.refusal(frames), closed


@pytest.mark.slow
def test_undecodable_unary_requests_get_a_status(tmp_path: Path) -> None:
    """Every unary method of the shard, given bytes that are no message: a status that
    says so (never UNKNOWN, no traceback in the log), and nothing changes."""
    methods = ["Pull", "Stats", "GetJob", "Heartbeat", "Register", "Leave", "Rollback",
               "ReportInitFailure"]  # fmt: skip
    with h.hostile_shard(tmp_path) as s:
        c = Campaign(s, "undecodable-unary", 1803)
        bad: list[tuple[str, SC | None]] = []
        for method in methods:
            path = f"/psar.v1.ParameterServer/{method}"
            if method == "Pull":
                call = s.channel.unary_stream(path, request_serializer=h._identity)
                send = lambda raw, call=call: list(call(raw, timeout=h.TIMEOUT))  # noqa: E731
            else:
                call = s.channel.unary_unary(path, request_serializer=h._identity)
                send = lambda raw, call=call: call(raw, timeout=h.TIMEOUT)  # noqa: E731
            for raw in (w.GARBAGE, b"\x0a\xff", bytes(c.rng.randrange(256) for _ in range(30))):
                code = _code(lambda send=send, raw=raw: send(raw))
                c.check(f"{method} with {raw[:8]!r}", code, False, False)
                if code not in (SC.INVALID_ARGUMENT, SC.INTERNAL):
                    bad.append((method, code))
        t = c.finish()
        assert not bad, bad
        assert_clean(t)


@pytest.mark.slow
def test_init_with_an_empty_piece_gets_a_status(tmp_path: Path) -> None:
    """An Init data piece of no bytes used to reach torch.frombuffer (ValueError: UNKNOWN
    and a traceback); it is a piece of nothing, accepted."""
    with h.hostile_shard(tmp_path) as s:
        c = Campaign(s, "empty-init-piece", 1810)
        chunks = init_chunks(s.job, s.values, message_bytes=4096)
        empty = pb.InitChunk(data=pb.TensorData(key=chunks[1].data.key, offset=0, data=b""))
        raw = [x.SerializeToString() for x in [chunks[0], empty, *chunks[1:]]]
        code = _code(lambda: c.init_call(iter(raw), timeout=h.TIMEOUT))
        c.check("an Init with an empty piece", code, code is None, code is None)
        t = c.finish()
        assert code in (None, SC.INVALID_ARGUMENT), code
        assert_clean(t)


@pytest.mark.slow
def test_hostile_slow_senders(tmp_path: Path) -> None:
    """A data-plane push sent a byte at a time and a gRPC push dribbled message by
    message: both land whole, while another worker's pushes go through meanwhile."""
    with h.hostile_shard(tmp_path) as s:
        c = Campaign(s, "slow-senders", 1804)
        for door in ("tcp", "grpc"):
            half = threading.Event()
            go_on = threading.Event()
            out: dict[str, object] = {}
            chunks = h.valid_push(s, 0, random.Random(7))
            chunks[0].header.verdict_follows = False
            chunks = [ch for ch in chunks if not ch.HasField("verdict")]
            if door == "tcp":
                data = w.encode_frames(w.push_frames(chunks))
                thread = threading.Thread(target=_dribble, args=(s, data, half, go_on, out))
            else:
                raw = [ch.SerializeToString() for ch in chunks]
                thread = threading.Thread(target=_slow_grpc, args=(c, raw, half, go_on, out))
            thread.start()
            assert half.wait(60), "the slow sender never got half way"
            c.control(1, "tcp")  # the other worker is not held up by the slow one
            c.control(1, "grpc")
            go_on.set()
            thread.join(120)
            assert not thread.is_alive()
            ok = bool(out.get("ok"))
            mirror_ok = w.replay_push(
                s.mirror, chunks[0].header, [w.as_item(x) for x in chunks[1:]]
            )
            c.check(f"slow {door} push", out.get("code"), ok, mirror_ok)  # type: ignore[arg-type]
            assert ok, out
        assert_clean(c.finish())


def _dribble(s: h.HostileShard, data: bytes, half: threading.Event, go_on: threading.Event,
             out: dict) -> None:  # fmt: skip
    """Send `data` on the data plane: prefixes and headers a byte at a time, payloads in
    64-byte dribbles; pause at half way until `go_on`."""
    with h.data_conn(s.data_port, timeout=60) as sock:
        pos, starts = 0, set(w.frame_starts(data))
        while pos < len(data):
            step = 1 if any(0 <= pos - st < 60 for st in starts) else 64
            sock.sendall(data[pos : pos + step])
            pos += step
            time.sleep(0.001)
            if pos >= len(data) // 2 and not half.is_set():
                half.set()
                go_on.wait(60)
        sock.shutdown(socket.SHUT_WR)
        code, _ = _answer(sock, 60)
        out["code"] = code
    out["ok"] = code is None


def _slow_grpc(c: Campaign, raw: list[bytes], half: threading.Event, go_on: threading.Event,
               out: dict) -> None:  # fmt: skip
    def messages() -> Iterator[bytes]:
        for i, m in enumerate(raw):
            if i == len(raw) // 2:
                half.set()
                go_on.wait(60)
            time.sleep(0.05)
            yield m

    code = _code(lambda: c.push_call(messages(), timeout=120))
    out["code"], out["ok"] = code, code is None


@pytest.mark.slow
def test_hostile_connection_floods(tmp_path: Path) -> None:
    """200 data-plane connections (a per-peer cap of 64 refuses the rest), 200 raw TCP
    connections to the gRPC port, 200 gRPC channels calling at once: a real worker is
    served meanwhile (gRPC) and afterwards (both doors), and the threads go back down."""
    cap = 64
    with h.hostile_shard(tmp_path, extra=("--data-max-conns-per-peer", str(cap))) as s:
        c = Campaign(s, "floods", 1805)
        base_threads = s.threads()
        socks = _flood_data_plane(s, 200, random.Random(5))
        over = [_answer(sock, 5.0)[0] for sock in socks[cap:]]
        c.t.tried += len(socks)
        c.t.note(f"data plane: {over.count(SC.RESOURCE_EXHAUSTED)} of {len(over)} over the cap "
                 "refused RESOURCE_EXHAUSTED")  # fmt: skip
        c.control(1, "grpc")  # the data plane is full for this peer: gRPC still serves
        host, port = s.address.rsplit(":", 1)
        openings = [b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", w.GARBAGE * 8,
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]  # fmt: skip
        gsocks = []
        for i in range(200):
            with contextlib.suppress(OSError):
                g = socket.create_connection((host, int(port)), timeout=h.TIMEOUT)
                gsocks.append(g)
                g.sendall(openings[i % 4])
        c.t.tried += len(gsocks)
        c.control(0, "grpc")

        def caller(i: int) -> SC | None:
            with grpc.insecure_channel(s.address) as ch:
                stub = pb_grpc.ParameterServerStub(ch)
                if i % 2:
                    return _code(lambda: stub.GetJob(pb.GetJobRequest(), timeout=60))
                head = pb.PushChunk(header=pb.PushHeader(worker=9, dtype=1, loss_scale=1.0))
                return _code(lambda: stub.Push(iter([head]), timeout=60))

        with ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(caller, range(200)))
        for code in codes:  # each answered; every refusal left the state as it was
            c.check("a flood channel", code, code is None, code is None)
        assert set(codes) <= {None, SC.INVALID_ARGUMENT}, set(codes)
        for sock in socks + gsocks:
            sock.close()
        assert h.wait_for(lambda: s.threads_back_to(base_threads), 60), (base_threads, s.threads())
        c.control(1, "tcp")
        t = c.finish()
        assert over.count(SC.RESOURCE_EXHAUSTED) == len(over), over
        assert_clean(t)


@pytest.mark.slow
def test_hostile_stalled_push_is_superseded(tmp_path: Path) -> None:
    """A data-plane push that stalls after one piece does not make its worker's next push
    wait (a new connection of the worker supersedes it: the shard would otherwise hold
    the worker's push lock until the 300 s idle limit, past the client's deadline), and
    finishing the stalled push late applies nothing."""
    with h.hostile_shard(tmp_path) as s:
        c = Campaign(s, "stalled-push", 1806)
        chunks = [ch for ch in h.valid_push(s, 0, random.Random(9)) if not ch.HasField("verdict")]
        chunks[0].header.verdict_follows = False
        frames = w.push_frames(chunks)
        stalled = h.data_conn(s.data_port, 60)
        stalled.sendall(w.encode_frames(frames[:3]))  # hello, header, one piece: silence
        time.sleep(1.0)  # let the shard take the header (and the worker's push lock)
        c.control(0, "tcp")
        with contextlib.suppress(OSError):
            stalled.sendall(w.encode_frames(frames[3:]))
            stalled.shutdown(socket.SHUT_WR)
        code, _ = _answer(stalled, 60)
        stalled.close()
        c.check("a stalled push finished late", code, False, False)
        assert_clean(c.finish())


@pytest.mark.slow
def test_hostile_idle_connections_are_closed(tmp_path: Path) -> None:
    """Connections that never send hello, stop after it, or stop inside a frame prefix
    are closed by the shard (--data-idle-s 5); their threads go; a worker is served."""
    with h.hostile_shard(tmp_path, extra=("--data-idle-s", "5")) as s:
        c = Campaign(s, "idle", 1808)
        base_threads = s.threads()
        idlers = []
        for i in range(45):
            sock = h.data_conn(s.data_port, 120)
            sock.sendall([b"", w.encode_frames([w.hello_frame()]), fr.MAGIC][i % 3])
            idlers.append(sock)
        closed = sum(_answer(sock, 120)[1] for sock in idlers)
        c.t.tried += len(idlers)
        c.t.note(f"{closed} of {len(idlers)} idle connections closed by the shard")
        for sock in idlers:
            sock.close()
        assert h.wait_for(lambda: s.threads_back_to(base_threads), 60), (base_threads, s.threads())
        c.control(1, "tcp")
        t = c.finish()
        assert closed == len(idlers)
        assert_clean(t)


@pytest.mark.slow
def test_hostile_oversize_claims(tmp_path: Path) -> None:
    """Length claims past the limits are refused before anything is allocated, on both
    doors; 32 connections each claiming a 16 MiB piece and then going silent cost the
    shard no more than the bytes they sent."""
    big = 16 << 20
    with h.hostile_shard(tmp_path, max_message=big) as s:
        c = Campaign(s, "oversize", 1807)
        hello = w.encode_frames([w.hello_frame()])
        head = pb.DataFrame(piece=pb.DataPiece(key="fc2.bias#0")).SerializeToString()
        pull = pb.DataFrame(pull_request=pb.DataPullRequest()).SerializeToString()
        cases = [
            (hello + w.prefix(2**32 - 1, 0), SC.RESOURCE_EXHAUSTED),
            (hello + w.prefix(len(head), 2**64 - 1) + head, SC.RESOURCE_EXHAUSTED),
            (hello + w.prefix(len(head), big + 1) + head, SC.RESOURCE_EXHAUSTED),
            (hello + w.prefix(len(pull), 1 << 20) + pull, SC.INVALID_ARGUMENT),
            (w.prefix(fr.MAX_HEADER_BYTES + 1, 0), SC.RESOURCE_EXHAUSTED),
        ]
        for data, want in cases:
            code = h.refusal(h.exchange(s.data_port, data))
            c.check(f"claim {data[-len(head) - 16 :][:16]!r}", code, False, False)
            assert code == want, (data[:40], code)
        clock, version = s.next_push(0)
        push_head = pb.PushChunk(header=pb.PushHeader(worker=0, clock=clock, dtype=pb.FLOAT32,
                                                      base_version=version, loss_scale=1.0))  # fmt: skip
        huge = pb.PushChunk(data=pb.TensorData(key="fc1.weight#0", data=bytes(big + 1)))
        code = _code(lambda: c.push_call(iter([push_head.SerializeToString(),
                                               huge.SerializeToString()]), timeout=60))  # fmt: skip
        c.check("a gRPC message over the limit", code, False, False)
        assert code == SC.RESOURCE_EXHAUSTED
        chunks = init_chunks(s.job, s.values, message_bytes=4096)
        chunks[0].header.job.slots[0].numel = 2**40
        code = _code(lambda: c.init_call(iter([x.SerializeToString() for x in chunks]),
                                         timeout=60))  # fmt: skip
        c.check("an Init claiming 2**40 elements", code, False, False)
        assert code in (SC.FAILED_PRECONDITION, SC.RESOURCE_EXHAUSTED, SC.INVALID_ARGUMENT)
        # Claims, then silence: a refused push whose 16 MiB piece never comes.
        refused = pb.DataFrame(push_header=pb.PushHeader(worker=99, dtype=1, loss_scale=1.0))
        claim = w.encode_frames([w.hello_frame(), (refused, b"")])
        claim += w.prefix(len(head), big) + head + bytes(64)
        # CI (2026-12-04): the threads of the cases above, still ending, were counted in
        # the base, and the 32 new ones never reached base + 32.
        threads0 = s.settled_threads()
        rss0 = s.rss_mib()
        held = []
        for _ in range(32):
            sock = h.data_conn(s.data_port, 60)
            sock.sendall(claim)
            held.append(sock)
        assert h.wait_for(lambda: s.threads() >= threads0 + 32, 30)
        time.sleep(1.0)  # the shard reads what was sent (2,848 bytes in the issue)
        grown = s.rss_mib() - rss0
        c.t.tried += len(held)
        c.t.note(f"32 connections claiming {big} bytes each: shard RSS +{grown:.1f} MiB")
        for sock in held:
            sock.close()
        t = c.finish()
        assert grown < 64, f"the shard allocated ahead of the bytes: +{grown:.1f} MiB"
        assert_clean(t)
