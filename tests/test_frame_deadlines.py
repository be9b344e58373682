"""A frame's deadline over TLS (ps/framing.py _set_deadline): a TLS read returns one 16 KiB
record, so arming the socket's timeout before every read cost a syscall per record on
the receiving end. It is armed once and re-armed only when it drifted out of
[time left, time left + 2 DEADLINE_SLACK_S]: never early, at most that late, and a peer
trickling records still cannot hold a read past the frame's deadline.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psar.ps import framing as fr
from psar.ps.client.tcp_transport import client_ssl_context
from psar.ps.server.doors.dataplane import server_ssl_context
from tests.test_security import certs  # noqa: F401 - the fixture

SLACK = fr.DEADLINE_SLACK_S


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Sock:
    """What _set_deadline asks of a socket: its timeout (pure logic, no descriptor)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout, self.armed = timeout, 0

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, value: float | None) -> None:
        self.timeout, self.armed = value, self.armed + 1


def test_the_timeout_is_armed_once_and_kept_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(fr.time, "monotonic", clock)
    deadline = clock.now + 30.0
    sock = _Sock(300.0)  # the idle limit, set while waiting for the frame's first byte
    for _ in range(1000):  # a 16 MiB frame's records arriving within 20 ms
        fr._set_deadline(sock, deadline)  # type: ignore[arg-type]
        remaining = deadline - clock.now
        assert sock.timeout is not None and remaining <= sock.timeout <= remaining + 2 * SLACK
        clock.now += 20e-6
    assert sock.armed == 1
    # A slow frame: re-armed as time passes, never shorter than the time left.
    for _ in range(300):
        clock.now += 0.09
        fr._set_deadline(sock, deadline)  # type: ignore[arg-type]
        remaining = deadline - clock.now
        assert remaining <= sock.timeout <= remaining + 2 * SLACK
    assert 1 < sock.armed <= 1 + 300
    clock.now = deadline
    with pytest.raises(TimeoutError):
        fr._set_deadline(sock, deadline)  # type: ignore[arg-type]


@pytest.mark.parametrize("left_over", [None, 0.01, 10.0])
def test_a_timeout_left_by_something_else_is_replaced(
    monkeypatch: pytest.MonkeyPatch, left_over: float | None
) -> None:
    """Blocking (None), one shorter than the time left (it would fail the read early) or
    far longer (it would outlast the deadline): armed to the frame's deadline."""
    clock = _Clock()
    monkeypatch.setattr(fr.time, "monotonic", clock)
    sock = _Sock(left_over)
    fr._set_deadline(sock, clock.now + 1.0)  # type: ignore[arg-type]
    assert sock.armed == 1 and 1.0 <= sock.timeout <= 1.0 + 2 * SLACK  # type: ignore[operator]


class _CountingSSLSocket(ssl.SSLSocket):
    armed = 0

    def settimeout(self, value: float | None) -> None:
        type(self).armed += 1
        super().settimeout(value)


@contextlib.contextmanager
def _tls_pair(certs: Path) -> Iterator[tuple[ssl.SSLSocket, ssl.SSLSocket]]:  # noqa: F811
    """(client, server) over real TCP with the data plane's contexts; the server end
    counts its settimeout calls."""
    sctx = server_ssl_context(str(certs / "server.pem"), str(certs / "server.key"))
    sctx.sslsocket_class = _CountingSSLSocket
    cctx = client_ssl_context(str(certs / "ca.pem"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        raw_c = socket.create_connection(listener.getsockname(), timeout=10)
        raw_s, _ = listener.accept()
    raw_s.settimeout(10)
    box: dict[str, ssl.SSLSocket] = {}
    t = threading.Thread(target=lambda: box.update(s=sctx.wrap_socket(raw_s, server_side=True)))
    t.start()
    c = cctx.wrap_socket(raw_c, server_hostname="127.0.0.1")
    t.join(10)
    try:
        yield c, box["s"]
    finally:
        c.close()
        box["s"].close()


def test_a_tls_frame_is_read_with_its_timeout_armed_once(certs: Path) -> None:  # noqa: F811
    """4 MiB (256 records) read under a frame deadline: the bytes all arrive and the
    socket's timeout was set about once (it was set before every record)."""
    payload = bytes(range(256)) * (4 << 12)
    with _tls_pair(certs) as (c, s):
        sender = threading.Thread(target=c.sendall, args=(payload,))
        sender.start()
        buf = bytearray(len(payload))
        _CountingSSLSocket.armed = 0
        fr.recv_exact(s, memoryview(buf), deadline=time.monotonic() + 30)
        sender.join(10)
    assert buf == payload
    assert _CountingSSLSocket.armed <= 3, _CountingSSLSocket.armed


def test_a_peer_trickling_records_cannot_hold_a_read_past_its_deadline(certs: Path) -> None:  # noqa: F811
    stop = threading.Event()
    with _tls_pair(certs) as (c, s):

        def trickle() -> None:  # a record every 20 ms, for as long as it takes
            with contextlib.suppress(OSError):
                while not stop.wait(0.02):
                    c.sendall(b"x")

        t = threading.Thread(target=trickle)
        t.start()
        try:
            with pytest.raises(TimeoutError):
                fr.recv_exact(s, memoryview(bytearray(1 << 20)), deadline=time.monotonic() + 0.5)
        finally:
            stop.set()
            t.join(10)
