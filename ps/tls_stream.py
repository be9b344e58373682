"""Standard TLS for the data plane, with the socket I/O done in large reads and writes.

Why: `ssl.SSLSocket` runs OpenSSL over the socket itself, one 16 KiB TLS record at a time:
a receive costs a Python call and two recv syscalls per record. `TLSStream` keeps the same
TLS (OpenSSL, the same SSLContext: certificates, mutual TLS, server names, TLS 1.2+; any
TLS peer talks to it) but moves bytes between OpenSSL and the kernel itself, as asyncio
does: an `ssl.SSLObject` over two `ssl.MemoryBIO`s, the socket read in chunks of up to
RECV_BYTES and written in chunks of up to SEND_BYTES of plaintext (many records per
syscall). Records are decrypted straight into the caller's buffer (`recv_into`: a pulled
piece lands in the worker's tensor, a pushed one in the shard's staging buffer) and
encrypted straight from the caller's (a tensor's memoryview), and a call drains every
record already received before it touches the socket again. The price: two more copies
each way (socket buffer to BIO and BIO to OpenSSL's record buffer; OpenSSL's record
buffer to BIO and BIO to a bytes object) and a memset per BIO write. Measured against
SSLSocket (bench/experiments/tls_cost.py, 1 GiB, paired medians of 8 alternated
repeats): receive 0.88x, send 1.19x CPU per GiB.

`TLSStream` is a socket.socket on the same descriptor (like ps.sealed.SealedSocket), so
select(), shutdown() from another thread and the framing's unbound socket.socket calls
work as before; it overrides the byte calls and answers `pending()` for bytes it holds.
Semantics follow `SSLSocket`'s (with suppress_ragged_eofs, its default): the peer's
close_notify or a TCP end reads as 0 bytes (the framing turns 0 inside a frame into an
error), a record that fails its check raises ssl.SSLError (an OSError), no close_notify
is sent on close(). A timeout (settimeout) bounds each call as a whole: a handshake, a
sendall, a recv_into waiting for its first byte.

One reader and one writer at a time, as for SSLSocket.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any

RECV_BYTES = 256 << 10
"""Raw bytes asked of the kernel per read: 16 records, in a buffer that stays in cache."""
SEND_BYTES = 256 << 10
"""Plaintext bytes encrypted per write to the kernel (and at most that much ciphertext
held between them): of 32 KiB to 1 MiB, 256 KiB cost the least CPU per GiB sent."""
_UNWRAP_MAX_BYTES = 1 << 20
"""unwrap() reads byte by byte (never past the peer's close_notify): at most this many."""
_UNSET = object()


class TLSStream(socket.socket):
    """A TLS connection over `raw` (its descriptor moves here; see the module docstring)."""

    def __init__(
        self,
        raw: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
    ) -> None:
        timeout = raw.gettimeout()
        super().__init__(raw.family, raw.type, raw.proto, fileno=raw.detach())
        self._os_timeout: Any = _UNSET
        self._user_timeout: float | None = None
        self.settimeout(timeout)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side,
            server_hostname=server_hostname,
        )  # fmt: skip
        self._rx = bytearray(RECV_BYTES)
        self._rx_view = memoryview(self._rx)
        self._eof = False

    # ---- the TLS session ---------------------------------------------------------------

    def do_handshake(self) -> None:
        """The TLS handshake, within the socket's timeout as a whole. A failure (an
        untrusted certificate, a name it does not carry, the peer's alert) raises the
        ssl error SSLSocket would, after sending our alert to the peer."""
        deadline = self._deadline()
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush(deadline)
                if self._eof:  # OpenSSL had the end and still asks for more
                    raise ssl.SSLEOFError("connection closed during the TLS handshake") from None
                self._fill(deadline)
            except ssl.SSLError:
                self._flush_quietly()  # our alert: the peer learns why
                raise
        self._flush(deadline)

    def version(self) -> str | None:
        return self._tls.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self._tls.cipher()

    def getpeercert(self, binary_form: bool = False) -> Any:
        return self._tls.getpeercert(binary_form)

    def unwrap(self) -> socket.socket:
        """Close TLS (close_notify both ways) and return the plain TCP socket on the same
        descriptor (this object no longer has it). The peer's close_notify is read byte
        by byte, so the bytes after it stay in the kernel for the plain socket."""
        deadline = self._deadline()
        one = bytearray(1)
        for _ in range(_UNWRAP_MAX_BYTES):
            try:
                self._tls.unwrap()
                break
            except ssl.SSLWantReadError:
                self._flush(deadline)
            self._wait_until(deadline)
            if super().recv_into(one, 1) == 0:
                raise ssl.SSLEOFError("connection closed before the peer's close_notify")
            self._incoming.write(one)
        else:
            raise ssl.SSLError("no close_notify from the peer")
        self._flush(deadline)
        if self._incoming.pending:
            raise ssl.SSLError("bytes after the peer's close_notify, before ours was answered")
        plain = socket.socket(self.family, self.type, self.proto, fileno=self.detach())
        plain.settimeout(self._user_timeout)
        return plain

    # ---- what the framing asks of a socket ----------------------------------------------

    def settimeout(self, value: float | None) -> None:
        self._user_timeout = value
        if value is None:  # blocking calls: the descriptor blocks too, no deadline
            self._os(None)

    def gettimeout(self) -> float | None:
        return self._user_timeout

    def pending(self) -> int:
        """Bytes held here that the kernel no longer has: decrypted and not read yet, or
        received and not decrypted yet. Non-zero: the peer spoke."""
        return self._tls.pending() + self._incoming.pending

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        """Up to nbytes decrypted bytes straight into `buffer`: every record already
        received, then (only if none was) one read of the socket. 0: the peer ended the
        stream (close_notify, or TCP's end as SSLSocket reads it)."""
        if flags:
            raise ValueError("a TLS stream takes no recv flags")
        view = memoryview(buffer).cast("B")
        n = len(view) if nbytes <= 0 else min(nbytes, len(view))
        got = 0
        deadline: float | None = None
        read = self._tls.read
        while got < n:
            try:
                r = read(n - got, view[got:n])
            except ssl.SSLWantReadError:
                r = -1
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got  # close_notify, or a TCP end with no close_notify
            if r > 0:
                got += r
                continue
            if r == 0:
                return got  # close_notify (read() answers 0 after it)
            if got:
                return got  # never wait for more once something came
            if self._eof:
                return 0
            if deadline is None:
                deadline = self._deadline()
            self._fill(deadline)
        return got

    def recv(self, bufsize: int, flags: int = 0) -> bytes:  # type: ignore[override]
        buf = bytearray(max(0, bufsize))
        return bytes(buf[: self.recv_into(buf, bufsize, flags)])

    def sendall(self, data: Any, flags: int = 0) -> None:  # type: ignore[override]
        if flags:
            raise ValueError("a TLS stream takes no send flags")
        self.send_buffers([data])

    def send(self, data: Any, flags: int = 0) -> int:  # type: ignore[override]
        self.sendall(data, flags)
        return memoryview(data).nbytes

    def send_buffers(self, buffers: Any) -> None:
        """sendall of several buffers, encrypted straight from them; a write to the kernel
        per SEND_BYTES of records (a frame's small header goes out with the start of its
        payload). Within the socket's timeout as a whole."""
        deadline = self._deadline()
        write, out = self._tls.write, self._outgoing
        for b in buffers:
            view = memoryview(b).cast("B")
            for at in range(0, len(view), SEND_BYTES):
                write(view[at : at + SEND_BYTES])
                if out.pending >= SEND_BYTES:
                    self._flush(deadline)
        self._flush(deadline)

    def sendmsg(self, *args: Any, **kw: Any) -> int:  # type: ignore[override]
        raise NotImplementedError("a TLS stream takes sendall or send_buffers")

    # ---- between OpenSSL and the kernel -------------------------------------------------

    def _fill(self, deadline: float | None) -> int:
        """One read of the socket into the incoming BIO; 0 (and the BIO's EOF) when the
        peer ended TCP."""
        while True:
            self._wait_until(deadline)
            try:
                r = super().recv_into(self._rx_view, RECV_BYTES)
                break
            except TimeoutError:
                if deadline is not None and time.monotonic() < deadline:
                    continue  # the descriptor's timeout ran out before ours: go on
                raise
        if r == 0:
            self._eof = True
            self._incoming.write_eof()
            return 0
        self._incoming.write(self._rx_view[:r])
        return r

    def _flush(self, deadline: float | None) -> None:
        """Send what OpenSSL wrote (records, alerts) to the kernel."""
        if self._outgoing.pending:
            data = self._outgoing.read()
            self._wait_until(deadline)
            super().sendall(data)

    def _flush_quietly(self) -> None:
        try:
            self._flush(time.monotonic() + 1.0)
        except OSError:
            pass

    # ---- timeouts ------------------------------------------------------------------------

    def _os(self, value: float | None) -> None:
        """The descriptor's own timeout (a syscall each time it changes)."""
        if value != self._os_timeout:
            super().settimeout(value)
            self._os_timeout = value

    def _deadline(self) -> float | None:
        t = self._user_timeout
        return None if t is None else time.monotonic() + t

    def _wait_until(self, deadline: float | None) -> None:
        """Before a blocking read or write: the descriptor waits no longer than until
        `deadline` (TimeoutError when it has passed)."""
        if deadline is None:
            self._os(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("TLS stream: timed out")
        self._os(left)


def wrap_socket(
    context: ssl.SSLContext,
    sock: socket.socket,
    *,
    server_side: bool = False,
    server_hostname: str | None = None,
    do_handshake_on_connect: bool = True,
) -> TLSStream:
    """`context.wrap_socket(sock, ...)`, as a TLSStream (the handshake within the
    socket's timeout, unless do_handshake_on_connect is False)."""
    tls = TLSStream(sock, context, server_side=server_side, server_hostname=server_hostname)
    if do_handshake_on_connect:
        tls.do_handshake()
    return tls


__all__ = ["RECV_BYTES", "SEND_BYTES", "TLSStream", "wrap_socket"]
