"""Sealed records (ps/sealed.py): the TLS data plane's bytes in AES-GCM records under keys
agreed inside TLS (issue #18, "TLS at full speed").

Over real socket pairs: bytes arrive whole and in order whatever the read sizes; a record
altered, replayed, reordered or cut short is refused (SealError) and never handed up; a
length out of range is refused before anything is allocated for it; a claim of a large
record followed by silence holds only what arrived; a read that timed out mid-record
resumes where it stopped; a trickling peer is cut at the record deadline. Over a real TLS
shard: a worker's connections are sealed (and train the same bits as TLS records, which
--data-tls-records keeps), a bad share is refused with a status, and garbage after the
switch drops the connection with the shard's state untouched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps import sealed
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import DataPlaneClient
from psar.ps.partition import plan_slots
from tests.ps_fixtures import grad_for, init_values, make_job, without_speculation
from tests.test_dataplane import header, items, pull_into
from tests.test_dataplane_tls import tls, tls_shard
from tests.test_security import certs  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not sealed.available(), reason="needs the cryptography package")

KEY_A, KEY_B = bytes(range(16)), bytes(range(16, 32))


@contextlib.contextmanager
def pair(record_timeout_s: float | None = None) -> Iterator[tuple[sealed.SealedSocket, ...]]:
    """Two sealed ends of one socket pair (a's send key is b's receive key)."""
    ra, rb = socket.socketpair()
    a = sealed.SealedSocket(ra, KEY_A, KEY_B)
    b = sealed.SealedSocket(rb, KEY_B, KEY_A, record_timeout_s=record_timeout_s)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def recv_all(sock: socket.socket, n: int, chunk: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        r = sock.recv_into(view[got:], min(chunk, n - got))
        assert r > 0
        got += r
    return bytes(out)


def sent_by(write: Callable[[sealed.SealedSocket], None], key: bytes, first: int = 0) -> bytes:
    """The bytes a SealedSocket with `key` puts on the wire for write(sock) (records
    numbered from `first`)."""
    ra, rb = socket.socketpair()
    s = sealed.SealedSocket(ra, key, key)
    s._send_ctr = first

    def send() -> None:
        with s:
            write(s)

    t = threading.Thread(target=send)
    t.start()
    data = bytearray()
    while chunk := rb.recv(1 << 20):
        data += chunk
    t.join()
    rb.close()
    return bytes(data)


def records_of(payload: bytes, key: bytes, first: int = 0) -> list[bytes]:
    """The sealed records a SealedSocket sends for `payload` (one per MAX_RECORD_BYTES)."""
    data = bytearray(sent_by(lambda s: s.sendall(payload), key, first))
    out: list[bytes] = []
    while data:
        (n,) = struct.unpack_from("<I", data)
        out.append(bytes(data[: 4 + n + sealed.TAG_BYTES]))
        del data[: 4 + n + sealed.TAG_BYTES]
    return out


@pytest.mark.parametrize("size", [1, 17, sealed.MAX_RECORD_BYTES, 3 * sealed.MAX_RECORD_BYTES + 5])
@pytest.mark.parametrize("chunk", [7, 4096, 1 << 22])
def test_bytes_arrive_whole_and_in_order(size: int, chunk: int) -> None:
    payload = os.urandom(size)
    with pair() as (a, b):
        t = threading.Thread(target=a.sendall, args=(payload,))
        t.start()
        assert recv_all(b, size, chunk) == payload
        t.join()
        assert b.pending() == 0


def test_both_directions_and_the_framing_on_top() -> None:
    """Frames (prefix, header, payload) go through the framing's own calls both ways."""
    with pair() as (a, b):
        frame = pb.DataFrame(piece=pb.DataPiece(key="w", offset=3))
        payload = os.urandom(600_000)
        t = threading.Thread(target=fr.send, args=(a, frame, payload))
        t.start()
        got, plen = fr.read_header(b, max_payload_bytes=1 << 20, scratch=fr.Scratch())
        assert got == frame and plen == len(payload)
        assert bytes(fr.recv_payload(b, plen, fr.Scratch())) == payload
        t.join()
        b.sendall(b"back")
        assert recv_all(a, 4, 4) == b"back"


def test_the_close_record_is_a_clean_end_and_a_cut_is_not() -> None:
    """Issue #33: a stream ends cleanly only with the sender's close record; a connection
    cut at a record boundary (what an attacker on the path can do) is a SealError."""
    with pair() as (a, b):
        a.sendall(b"x")
        a.send_close()
        socket.socket.shutdown(a, socket.SHUT_WR)
        assert b.recv(10) == b"x"
        assert b.recv(10) == b"" and b.recv(10) == b""
    with pair() as (a, b):
        a.sendall(b"x")
        socket.socket.shutdown(a, socket.SHUT_WR)  # a cut right after a whole record
        assert b.recv(10) == b"x"
        with pytest.raises(sealed.SealError, match="without the peer's close record"):
            b.recv(10)
    with pair() as (a, b):  # close() sends it
        a.sendall(b"y")
        a.close()
        assert b.recv(10) == b"y" and b.recv(10) == b""


@pytest.mark.parametrize("forgery", ["bare", "replayed", "wrong key"])
def test_a_forged_close_record_is_refused(forgery: str) -> None:
    """A close record is authenticated like any record: an attacker cannot end a stream
    early with one of its own, an old one, or one from another connection."""
    recs = records_of(b"payload", KEY_A)  # [data record 0, close record 1]
    assert len(recs) == 2 and recs[1][:4] == b"\0\0\0\0"
    if forgery == "bare":
        close = struct.pack("<I", 0) + bytes(sealed.TAG_BYTES)
    elif forgery == "replayed":  # a genuine close record, numbered 1, sent as record 0
        close = recs[1]
    else:
        close = records_of(b"payload", KEY_B)[1]
    s = _feed(close + recs[0])
    with pytest.raises(sealed.SealError, match="authentication"):
        s.recv(100)
    s.close()


def test_keys_are_replaced_every_rekey_records() -> None:
    """Both ends move to the next key (HKDF of the last) every rekey_records records, in
    step: bytes flow across several key changes; an end that does not is refused there."""
    with pair() as (a, b):
        a.rekey_records = b.rekey_records = 3
        payload = os.urandom(7 * 100)
        for i in range(7):  # seven records: keys change before records 3 and 6
            a.sendall(payload[100 * i : 100 * (i + 1)])
        assert recv_all(b, len(payload), 100) == payload
        assert a._send_key == b._recv_key == sealed.next_key(sealed.next_key(KEY_A))
    with pair() as (a, b):
        a.rekey_records = 3  # b keeps the default: record 3 does not open under its key
        for _ in range(4):
            a.sendall(b"z" * 10)
        assert recv_all(b, 30, 10) == b"z" * 30
        with pytest.raises(sealed.SealError):
            b.recv(10)


def _feed(raw: bytes) -> sealed.SealedSocket:
    """A sealed end receiving `raw` (sent by a thread: more than a socket buffer holds)."""
    ra, rb = socket.socketpair()

    def send() -> None:
        with contextlib.suppress(OSError), ra:  # the reader may stop early
            ra.sendall(raw)

    threading.Thread(target=send, daemon=True).start()
    rb.settimeout(5)
    return sealed.SealedSocket(rb, KEY_B, KEY_A)


@pytest.mark.parametrize("damage", ["flip", "replay", "reorder", "truncate", "wrong key"])
def test_damaged_records_are_refused_and_never_handed_up(damage: str) -> None:
    recs = records_of(os.urandom(2 * sealed.MAX_RECORD_BYTES), KEY_A)
    if damage == "flip":
        r = bytearray(recs[1])
        r[1000] ^= 0x40
        stream = recs[0] + bytes(r)
    elif damage == "replay":
        stream = recs[0] + recs[0]
    elif damage == "reorder":
        stream = recs[1] + recs[0]
    elif damage == "truncate":
        stream = recs[0] + recs[1][:-1]
    else:
        stream = b"".join(records_of(os.urandom(100), KEY_B))
    s = _feed(stream)
    buf = bytearray(4 * sealed.MAX_RECORD_BYTES)
    got = 0
    with pytest.raises(sealed.SealError):
        while True:
            got += s.recv_into(memoryview(buf)[got:])
    # Only records that opened were handed up (a first good record at most).
    assert got in (0, sealed.MAX_RECORD_BYTES) if damage != "reorder" else got == 0
    s.close()


@pytest.mark.parametrize("length", [0, sealed.MAX_RECORD_BYTES + 1, 2**32 - 1])
def test_a_length_out_of_range_is_refused(length: int) -> None:
    # (0 is a close record: this one's tag is zeros, so it fails authentication.)
    s = _feed(struct.pack("<I", length) + b"\0" * 64)
    with pytest.raises(sealed.SealError, match="sealed record"):
        s.recv(100)
    assert len(s._rx) <= 64 << 10  # nothing allocated for it
    s.close()


def test_a_large_claim_then_silence_holds_only_what_arrived() -> None:
    ra, rb = socket.socketpair()
    b = sealed.SealedSocket(rb, KEY_B, KEY_A)
    ra.sendall(struct.pack("<I", sealed.MAX_RECORD_BYTES) + b"\0" * 100)
    b.settimeout(0.2)
    with pytest.raises(TimeoutError):
        b.recv(10)
    assert len(b._rx) <= 64 << 10  # not the MAX_RECORD_BYTES claimed
    assert b.pending() and fr.peer_spoke(b)
    ra.close()
    b.close()


def test_the_send_buffer_is_sized_by_what_is_sent() -> None:
    """A connection that sends only frame headers holds a few bytes, not two records;
    a large payload grows it to two records at most, and the bytes still arrive."""
    with pair() as (a, b):
        a.sendall(b"header")
        assert len(a._out) <= 64 and recv_all(b, 6, 6) == b"header"
        big = os.urandom(3 * sealed.MAX_RECORD_BYTES)
        t = threading.Thread(target=a.sendall, args=(big,))
        t.start()
        assert recv_all(b, len(big), 1 << 20) == big
        t.join()
        assert len(a._out) == 2 * (sealed.MAX_RECORD_BYTES + 4 + sealed.TAG_BYTES)


def test_a_read_that_timed_out_mid_record_resumes() -> None:
    rec = records_of(b"hello sealed world", KEY_A)[0]
    ra, rb = socket.socketpair()
    b = sealed.SealedSocket(rb, KEY_B, KEY_A)
    b.settimeout(0.2)
    ra.sendall(rec[:10])
    with pytest.raises(TimeoutError):
        b.recv(100)
    ra.sendall(rec[10:])
    assert b.recv(100) == b"hello sealed world"
    ra.close()
    b.close()


def test_a_trickling_peer_is_cut_at_the_record_deadline() -> None:
    rec = records_of(os.urandom(1000), KEY_A)[0]
    ra, rb = socket.socketpair()
    b = sealed.SealedSocket(rb, KEY_B, KEY_A, record_timeout_s=0.5)
    b.settimeout(30)
    stop = threading.Event()

    def trickle() -> None:
        for i in range(len(rec) - 1):  # never the last byte
            if stop.wait(0.05):
                return
            ra.sendall(rec[i : i + 1])

    t = threading.Thread(target=trickle)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        b.recv(2000)
    assert time.monotonic() - t0 < 10  # the record deadline, not 30 s per byte
    stop.set()
    t.join()
    ra.close()
    b.close()


def test_keys_differ_per_direction_and_per_connection() -> None:
    w, s = sealed.new_share(), sealed.new_share()
    up, down = sealed.derive_keys(w, s)
    assert up != down and len(up) == len(down) == 16
    assert sealed.derive_keys(w, sealed.new_share())[0] != up
    assert sealed.derive_keys(w, s) == (up, down)  # the two ends agree
    assert sealed.next_key(up) not in (up, down) and sealed.next_key(up) == sealed.next_key(up)
    with pytest.raises(ValueError):
        sealed.derive_keys(b"short", s)


# ---- over a real TLS shard --------------------------------------------------------------


def _raw_tls(port: int, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(sock, server_hostname="127.0.0.1")


def _hello(sock: socket.socket, share: bytes) -> pb.DataFrame:
    fr.send(sock, pb.DataFrame(hello=pb.DataHello(version=fr.VERSION, seal_share=share)))
    frame, _ = fr.read_header(sock, max_payload_bytes=0, scratch=fr.Scratch())
    return frame


def test_pushes_and_pulls_are_sealed_and_give_the_same_bits(certs: Path) -> None:  # noqa: F811
    """The same async pushes (a slot of 1.2 MB: several records per piece) over sealed
    records and over TLS records (the worker not asking): the same weights back."""
    job = make_job("async", num_workers=1, slots=plan_slots([("w", 300_001), ("b", 7)], 1))
    got: dict[bool, dict[str, torch.Tensor]] = {}
    for seal in (True, False):
        with tls_shard(certs, data_sealed_records=True) as (_, dp, state):
            state.init(job, init_values(job))
            with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs),
                                 seal_records=seal) as c:  # fmt: skip
                for clock in (1, 2, 3):
                    assert c.push(header(0, clock), items(grad_for(job, 0, clock)),
                                  timeout_s=10).applied  # fmt: skip
                reply, got[seal] = pull_into(c, job, 0, 3)
            assert reply.version == 3
            assert dp.stats()["sealed"] == (1 if seal else 0), dp.stats()
    for k in got[True]:
        assert not torch.isnan(got[True][k]).any()
        assert torch.equal(got[True][k], got[False][k]), k


@pytest.mark.parametrize("kw", [{}, {"data_tls_records": True}], ids=["default", "tls-records"])
def test_a_shard_keeps_tls_records_unless_it_opts_in(certs: Path, kw: dict) -> None:  # noqa: F811
    """Secure by default (issue #33): a worker asks for sealed records (its hello carries a
    share), but a shard without --data-sealed-records (the default, or the old
    --data-tls-records, now an alias of the default) answers without one: TLS records."""
    job = make_job("async", num_workers=1)
    with tls_shard(certs, **kw) as (_, dp, state):
        state.init(job, init_values(job))
        with DataPlaneClient("127.0.0.1", dp.port, ssl_context=tls(certs)) as c:
            assert c.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=10).applied
            assert pull_into(c, job, 0, 1)[0].version == 1
        assert dp.stats()["sealed"] == 0 and dp.stats()["pushes"] == 1


def test_a_bad_share_is_refused_and_garbage_after_the_switch_changes_nothing(
    certs: Path,  # noqa: F811
) -> None:
    job = make_job("async", num_workers=1)
    with tls_shard(certs, data_sealed_records=True) as (_, dp, state):
        state.init(job, init_values(job))
        before = without_speculation(state.stats())
        ctx = tls(certs)
        with _raw_tls(dp.port, ctx) as s:
            frame = _hello(s, b"x" * 5)
        assert frame.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "seal_share" in frame.status.details
        s = _raw_tls(dp.port, ctx)
        frame = _hello(s, sealed.new_share())
        assert frame.status.code == 0 and len(frame.status.seal_share) == sealed.SHARE_BYTES
        raw = s.unwrap()
        # A push header in plaintext (not a sealed record): the shard drops the connection.
        raw.sendall(fr.encode(pb.DataFrame(push_header=header(0, 1))))
        raw.settimeout(10)
        with contextlib.suppress(ConnectionError):
            assert raw.recv(100) == b""
        raw.close()
        end = time.monotonic() + 10
        while dp.stats()["connections"] and time.monotonic() < end:
            time.sleep(0.02)
        assert dp.stats()["connections"] == 0 and dp.stats()["sealed"] == 1
        assert dp.stats()["pushes"] == 0
        assert without_speculation(state.stats()) == before


def _sealed_stream(frames: list[tuple[pb.DataFrame, bytes]], key: bytes) -> bytes:
    """The bytes a sealed worker end sends for these frames (records numbered from 0)."""

    def write(s: sealed.SealedSocket) -> None:
        for frame, payload in frames:
            fr.send(s, frame, payload or None)

    return sent_by(write, key)


def _open_sealed(port: int, ctx: ssl.SSLContext) -> tuple[socket.socket, bytes]:
    """A data-plane connection switched to sealed records: (raw socket, worker->shard key)."""
    s = _raw_tls(port, ctx)
    share = sealed.new_share()
    frame = _hello(s, share)
    assert frame.status.code == 0
    to_shard, _ = sealed.derive_keys(share, bytes(frame.status.seal_share))
    return s.unwrap(), to_shard


@pytest.mark.slow
def test_damaged_sealed_pushes_change_nothing(certs: Path) -> None:  # noqa: F811
    """A valid push in sealed records, each copy with one byte flipped somewhere (prefix,
    tag, header record, payload): every copy is dropped with the shard untouched; the
    undamaged stream then applies (the control)."""
    import random

    job = make_job("async", num_workers=1, slots=plan_slots([("w", 70_001), ("b", 7)], 1))
    grads = grad_for(job, 0, 1)
    frames = [(pb.DataFrame(push_header=header(0, 1)), b"")]
    for k, t in grads.items():
        frames.append((pb.DataFrame(piece=pb.DataPiece(key=k, offset=0)), t.numpy().tobytes()))
    frames.append((pb.DataFrame(end=pb.DataEnd()), b""))
    rng = random.Random(18)
    with tls_shard(certs, data_sealed_records=True) as (_, dp, state):
        state.init(job, init_values(job))
        before = without_speculation(state.stats())
        ctx = tls(certs)
        tried = 0
        for _ in range(40):
            raw, key = _open_sealed(dp.port, ctx)
            stream = bytearray(_sealed_stream(frames, key))
            at = rng.randrange(len(stream))
            stream[at] ^= 1 << rng.randrange(8)
            raw.settimeout(10)
            with contextlib.suppress(OSError), raw:
                raw.sendall(stream)
                while raw.recv(1 << 16):
                    pass
            tried += 1
            assert without_speculation(state.stats()) == before, f"flip at byte {at}"
        raw, key = _open_sealed(dp.port, ctx)
        with raw:
            raw.sendall(_sealed_stream(frames, key))
            raw.settimeout(10)
            assert raw.recv(1 << 16)  # the push reply (sealed)
        end = time.monotonic() + 10
        while state.version != 1 and time.monotonic() < end:
            time.sleep(0.02)
        assert tried == 40 and state.version == 1


def test_the_flags_say_what_they_need() -> None:
    from psar.ps.server.config import ServerConfig

    with pytest.raises(ValueError, match="--data-sealed-records needs TLS"):
        ServerConfig(data_sealed_records=True)
    with pytest.raises(ValueError, match="--data-sealed-records and --data-tls-records"):
        ServerConfig(tls_cert="c", tls_key="k", data_sealed_records=True, data_tls_records=True)
    assert ServerConfig(data_tls_records=True).data_sealed_records is False
