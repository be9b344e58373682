"""ps/tls_stream.py: standard TLS with the socket I/O in large chunks, over real TCP.

- It is standard TLS: it talks to Python's own SSLSocket in either role (TLS 1.2 and 1.3)
  and to the openssl command line's s_client and s_server, several MiB each way, every
  byte checked.
- What SSLSocket checks, it checks: an untrusted CA, a name the certificate does not
  carry, mutual TLS without a client certificate the CA signed; a damaged record is an
  error, never data.
- Large chunks: one recv_into hands over every record already received (many records
  per call, straight into the caller's buffer); a sendall writes whole chunks of records.
- Deadlines (a silent peer in the handshake, a read, a peer that does not read), a cut
  (0 bytes, as SSLSocket reads one), a shutdown from another thread, pending() for bytes
  held here, and unwrap() leaving the bytes after the peer's close_notify in the kernel.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ps import framing as fr
from ps import tls_stream
from ps.client.tcp_transport import client_ssl_context
from ps.server.doors.dataplane import server_ssl_context
from ps.tls_stream import TLSStream
from tests.test_security import certs  # noqa: F401 - the fixture
from worker.launch import free_port

TIMEOUT = 10.0
PAYLOAD = os.urandom(3 << 20) + os.urandom(12_345)  # not a whole number of records


def server_ctx(certs: Path, ca: str = "") -> ssl.SSLContext:  # noqa: F811
    return server_ssl_context(str(certs / "server.pem"), str(certs / "server.key"), ca)


def client_ctx(certs: Path, ca: str = "ca", who: str = "", tls12: bool = False) -> ssl.SSLContext:  # noqa: F811
    cert, key = (str(certs / f"{who}.pem"), str(certs / f"{who}.key")) if who else ("", "")
    ctx = client_ssl_context(str(certs / f"{ca}.pem"), cert, key)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def wrap(kind: str, ctx: ssl.SSLContext, sock: socket.socket, server: bool) -> socket.socket:
    """One TLS end of `kind` (stream: TLSStream; sslsocket: Python's SSLSocket)."""
    name = None if server else "127.0.0.1"
    if kind == "stream":
        return tls_stream.wrap_socket(ctx, sock, server_side=server, server_hostname=name)
    return ctx.wrap_socket(sock, server_side=server, server_hostname=name)


@contextlib.contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=TIMEOUT)
        server, _ = listener.accept()
    server.settimeout(TIMEOUT)
    for s in (client, server):
        fr.tune(s)
    try:
        yield client, server
    finally:
        client.close()
        server.close()


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run fn in a thread; the returned call joins it and gives its result (or raises)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the joiner
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(TIMEOUT * 3)
        assert not t.is_alive(), "the peer thread hung"
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


@contextlib.contextmanager
def tls_pair(
    certs: Path,  # noqa: F811
    client: str = "stream",
    server: str = "stream",
    cctx: ssl.SSLContext | None = None,
    sctx: ssl.SSLContext | None = None,
) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(client end, server end), handshakes done, over a real TCP connection."""
    cctx = cctx or client_ctx(certs)
    sctx = sctx or server_ctx(certs)
    with tcp_pair() as (c, s):
        server_end = in_thread(lambda: wrap(server, sctx, s, True))
        client_end = wrap(client, cctx, c, False)
        ends = client_end, server_end()
        try:
            yield ends
        finally:
            for e in ends:
                e.close()


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    fr.recv_exact(sock, memoryview(buf))
    return bytes(buf)


# ---- standard TLS: interoperation --------------------------------------------------------


@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
@pytest.mark.parametrize(
    "client,server", [("stream", "stream"), ("stream", "sslsocket"), ("sslsocket", "stream")]
)
def test_it_speaks_tls_with_pythons_sslsocket(
    certs: Path,  # noqa: F811
    client: str,
    server: str,
    tls12: bool,
) -> None:
    """Several MiB each way (the server echoes), every byte checked, both roles."""
    with tls_pair(certs, client, server, cctx=client_ctx(certs, tls12=tls12)) as (c, s):
        assert c.version() == s.version() == ("TLSv1.2" if tls12 else "TLSv1.3")

        def echo() -> None:
            s.sendall(read_exact(s, len(PAYLOAD)))

        done = in_thread(echo)
        c.sendall(PAYLOAD)
        assert read_exact(c, len(PAYLOAD)) == PAYLOAD
        done()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command line")
def test_openssl_s_client_talks_to_it(certs: Path) -> None:  # noqa: F811
    """A stock TLS client (openssl s_client, verifying the certificate and the address)
    sends 1 MiB to a TLSStream server, which sends it back and closes."""
    data = os.urandom(1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        cmd = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-quiet",
               "-CAfile", str(certs / "ca.pem"), "-verify_return_error",
               "-verify_ip", "127.0.0.1"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        out = in_thread(proc.stdout.read)  # what s_client received, until the end
        try:
            listener.settimeout(TIMEOUT)
            raw, _ = listener.accept()
            raw.settimeout(TIMEOUT)
            with tls_stream.wrap_socket(server_ctx(certs), raw, server_side=True) as s:
                proc.stdin.write(data)
                proc.stdin.close()
                got = read_exact(s, len(data))
                s.sendall(got)
            assert out() == data
        finally:
            proc.kill()
            proc.wait()
    assert got == data


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command line")
def test_it_talks_to_openssl_s_server(certs: Path, tmp_path: Path) -> None:  # noqa: F811
    """A TLSStream client downloads 4 MiB from a stock TLS server (openssl s_server -WWW)."""
    data = os.urandom(4 << 20)
    (tmp_path / "blob").write_bytes(data)
    port = free_port()
    cmd = ["openssl", "s_server", "-accept", str(port), "-WWW", "-naccept", "1", "-quiet",
           "-cert", str(certs / "server.pem"), "-key", str(certs / "server.key")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + TIMEOUT
        while True:
            try:
                raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end and proc.poll() is None, "s_server did not start"
                time.sleep(0.05)
        with tls_stream.wrap_socket(client_ctx(certs), raw, server_hostname="127.0.0.1") as c:
            c.sendall(b"GET /blob HTTP/1.0\r\n\r\n")
            reply = bytearray()
            while chunk := c.recv(1 << 20):
                reply += chunk
    finally:
        proc.kill()
        proc.wait()
    head, _, body = bytes(reply).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head
    assert body == data


# ---- what TLS checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "ca,name,why",
    [("rogue-ca", "127.0.0.1", "certificate"), ("ca", "shard.example", "mismatch")],
    ids=["untrusted-ca", "wrong-name"],
)
def test_an_untrusted_certificate_or_a_wrong_name_fails_the_handshake(
    certs: Path,  # noqa: F811
    ca: str,
    name: str,
    why: str,
) -> None:
    with tcp_pair() as (c, s):
        server_end = in_thread(lambda: wrap("stream", server_ctx(certs), s, True))
        with pytest.raises(ssl.SSLCertVerificationError) as e:
            tls_stream.wrap_socket(client_ctx(certs, ca), c, server_hostname=name)
        assert why in str(e.value).lower()
        with pytest.raises(ssl.SSLError):  # our alert reached the shard's end
            server_end()


@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
@pytest.mark.parametrize("who", ["", "rogue-client"], ids=["no-cert", "rogue-cert"])
def test_mutual_tls_refuses_a_client_without_a_certificate_the_ca_signed(
    certs: Path,  # noqa: F811
    who: str,
    tls12: bool,
) -> None:
    sctx = server_ctx(certs, str(certs / "ca.pem"))
    cctx = client_ctx(certs, who=who, tls12=tls12)
    with tcp_pair() as (c, s):
        server_end = in_thread(lambda: wrap("stream", sctx, s, True))
        with pytest.raises(ssl.SSLError):
            # TLS 1.2 fails in the handshake; 1.3 at the first read after it
            client = tls_stream.wrap_socket(cctx, c, server_hostname="127.0.0.1")
            client.sendall(b"hello")
            client.recv(10)
        with pytest.raises(ssl.SSLError):
            server_end()


def test_mutual_tls_accepts_the_right_client(certs: Path) -> None:  # noqa: F811
    sctx = server_ctx(certs, str(certs / "ca.pem"))
    with tls_pair(certs, cctx=client_ctx(certs, who="client"), sctx=sctx) as (c, s):
        c.sendall(b"ping")
        assert read_exact(s, 4) == b"ping"
        assert dict(x[0] for x in s.getpeercert()["subject"])["commonName"] == "client"


def test_a_damaged_record_is_an_error_not_data(certs: Path) -> None:  # noqa: F811
    """One bit flipped in a record on the wire: the reader gets ssl.SSLError (an OSError:
    the framing drops the connection), never the bytes."""
    with tcp_pair() as (c, s):
        server_end = in_thread(lambda: wrap("stream", server_ctx(certs), s, True))
        client = tls_stream.wrap_socket(client_ctx(certs), c, server_hostname="127.0.0.1")
        server = server_end()
        # The record, as the client's TLS writes it, damaged before it goes out.
        client._tls.write(b"x" * 1000)
        record = bytearray(client._outgoing.read())
        record[len(record) // 2] ^= 0x10
        socket.socket.sendall(client, record)
        with pytest.raises(ssl.SSLError):
            server.recv(2000)


# ---- large chunks ------------------------------------------------------------------------


def test_one_read_hands_over_every_record_already_received(certs: Path) -> None:  # noqa: F811
    """With 1 MiB waiting in the kernel, one recv_into decrypts many 16 KiB records
    straight into the caller's buffer (SSLSocket: one record per call)."""
    with tls_pair(certs) as (c, s):
        c.sendall(b"y" * (1 << 20))  # all of it in the receiver's kernel buffer now
        buf = bytearray(1 << 20)
        got = s.recv_into(buf)
        assert got >= min(tls_stream.RECV_BYTES, 1 << 20) - (16 << 10) > 16 << 10
        fr.recv_exact(s, memoryview(buf)[got:])
        assert buf == b"y" * (1 << 20)


def test_a_sendall_writes_whole_chunks_of_records(
    certs: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4 MiB go to the kernel in about 4 MiB / SEND_BYTES writes (SSLSocket: one per
    16 KiB record), the frame's small header in the first of them."""
    writes: list[int] = []
    real = TLSStream._flush

    def counting(self: TLSStream, deadline: float | None) -> None:
        writes.append(self._outgoing.pending)
        real(self, deadline)

    with tls_pair(certs) as (c, s):
        done = in_thread(lambda: read_exact(s, 16 + (4 << 20)))
        monkeypatch.setattr(TLSStream, "_flush", counting)
        c.send_buffers([b"h" * 16, memoryview(bytearray(4 << 20))])
        assert done() == b"h" * 16 + bytes(4 << 20)
    sent = [n for n in writes if n]
    assert len(sent) <= (4 << 20) // tls_stream.SEND_BYTES + 1, sent
    assert sum(sent) > 4 << 20  # the records' overhead on top of the bytes


# ---- deadlines, cuts, shutdowns ------------------------------------------------------------


def test_a_silent_peer_times_the_handshake_out(certs: Path) -> None:  # noqa: F811
    with tcp_pair() as (c, s):
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            tls_stream.wrap_socket(server_ctx(certs), s, server_side=True)


def test_a_read_and_a_write_keep_their_deadlines(certs: Path) -> None:  # noqa: F811
    with tls_pair(certs) as (c, s):
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv_into(bytearray(10))  # nothing comes
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.sendall(bytes(64 << 20))  # nobody reads: the socket buffers fill


@pytest.mark.parametrize("where", ["close-notify", "between-records", "mid-record"])
def test_the_end_reads_as_0_after_the_whole_records(certs: Path, where: str) -> None:  # noqa: F811
    """The peer ends its stream (close_notify) or its TCP ends without one (a cut, between
    records or inside one): the whole records before it are read, then 0 bytes for good
    (as SSLSocket reads it), which the framing takes for a closed connection (an error
    inside a frame)."""
    with tcp_pair() as (c, s):
        server_end = in_thread(lambda: wrap("stream", server_ctx(certs), s, True))
        client = tls_stream.wrap_socket(client_ctx(certs), c, server_hostname="127.0.0.1")
        server = server_end()
        client._tls.write(b"a" * 100)
        whole = client._outgoing.read()
        if where == "close-notify":
            with pytest.raises(ssl.SSLWantReadError):  # sent ours, waits for theirs
                client._tls.unwrap()
            tail = client._outgoing.read()
        else:
            client._tls.write(b"b" * 100)
            tail = client._outgoing.read()[: 50 if where == "mid-record" else 0]
        socket.socket.sendall(client, whole + tail)
        socket.socket.shutdown(client, socket.SHUT_WR)
        assert read_exact(server, 100) == b"a" * 100
        assert server.recv(100) == b""
        assert server.recv(100) == b""  # and stays ended
        with pytest.raises(fr.ConnectionClosed) as e:
            fr.recv_exact(server, memoryview(bytearray(1)), at_frame_start=False)
        assert e.value.mid_frame


def test_a_shutdown_from_another_thread_wakes_a_blocked_read(certs: Path) -> None:  # noqa: F811
    with tls_pair(certs) as (c, s):
        s.settimeout(None)
        reader = in_thread(lambda: s.recv(10))
        time.sleep(0.2)  # let it block (the test holds either way)
        fr.hard_shutdown(s)
        assert reader() == b""


def test_pending_counts_the_bytes_held_here(certs: Path) -> None:  # noqa: F811
    """What a read took from the kernel but did not hand over yet is the peer having
    spoken (fr.peer_spoke: a pooled connection with something to read is a dead one)."""
    with tls_pair(certs) as (c, s):
        assert s.pending() == 0 and not fr.peer_spoke(s)
        c.sendall(b"z" * 100_000)
        assert read_exact(s, 10) == b"z" * 10
        assert s.pending() > 0 and fr.peer_spoke(s)
        assert read_exact(s, 100_000 - 10) == b"z" * (100_000 - 10)
        assert s.pending() == 0 and not fr.peer_spoke(s)


@pytest.mark.parametrize("peer", ["stream", "sslsocket"])
def test_unwrap_leaves_the_bytes_after_close_notify_in_the_kernel(
    certs: Path,  # noqa: F811
    peer: str,
) -> None:
    """Both ends close TLS (as the sealed-records opt-in does after its hello) and the
    peer sends plain bytes at once: none of them was swallowed by our TLS reads."""
    with tls_pair(certs, client="stream", server=peer) as (c, s):
        c.sendall(b"before")

        def peer_side() -> tuple[bytes, socket.socket]:
            assert read_exact(s, 6) == b"before"
            plain = s.unwrap()  # type: ignore[attr-defined]
            plain.sendall(b"after the close_notify")
            return read_exact(plain, 5), plain

        done = in_thread(peer_side)
        with c.unwrap() as plain:  # type: ignore[attr-defined]
            assert type(plain) is socket.socket and c.fileno() == -1
            assert read_exact(plain, 22) == b"after the close_notify"
            plain.sendall(b"plain")
            got, theirs = done()
            theirs.close()
        assert got == b"plain"
