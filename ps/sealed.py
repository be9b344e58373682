"""Sealed records: the data plane's tensor bytes under TLS-agreed keys, at near plain speed.

Why: Python's ssl moves one 16 KiB TLS record per call (two reads and a write syscall
per record, plus the call), about 1 CPU-second per GB on each end here against 0.25 for
plain TCP, so a secured job ran at 0.6x (issue #18). The crypto itself (AES-GCM with
AES-NI) costs about 0.2 s/GB. This module keeps TLS for what TLS is for (certificates,
mutual TLS, the token in the hello, agreeing fresh keys) and then carries the
connection's bytes in large AES-128-GCM records.

How a connection gets here (ps/client/tcp_transport.py, ps/server/doors/dataplane_conn.py):

1. TLS handshake, as before (the same --tls-cert/--tls-key/--tls-ca as gRPC).
2. Inside TLS the worker's hello carries 32 random bytes (`seal_share`); the shard's OK
   carries 32 of its own. Nobody else sees them (TLS), and both are fresh per connection.
3. Both ends close TLS (close_notify each way: `SSLSocket.unwrap`) and go on on the same
   TCP connection with `SealedSocket`: one AES-128 key per direction, from HKDF-SHA256
   (the `cryptography` package's) over worker share || shard share.

An opt-in of the shard (psar server --data-sealed-records); standard TLS records are the
default. What this protects and what it does not: docs/sealed-records.md.

A record is ``<u32 little-endian plaintext length L>`` then L + 16 bytes: AES-128-GCM of
the plaintext with the length as associated data and the nonce = the record's number in
that direction (64-bit counter, never reused under a key; keys are never reused across
connections). So a record that was altered, dropped, replayed, reordered or cut short
fails to open (SealError, an OSError: the connection is dropped as any broken one is).
L = 0 is the close record (its tag alone, over nothing): a sender's authenticated end of
its stream, as TLS's close_notify. A stream that ends without it (a cut, even at a
record boundary) is a SealError, never a clean end. Every REKEY_RECORDS records a
direction's key is replaced by one derived from it (HKDF), so no key seals more than
16 GiB.

`SealedSocket` is a socket.socket (same fd), so select(), settimeout(), shutdown() and
the unbound socket.socket calls the framing uses keep working; it overrides the byte
calls. Reads never allocate for bytes that have not arrived: a record's buffer grows as
its bytes come, up to MAX_RECORD_BYTES.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

SHARE_BYTES = 32
"""Random bytes each end contributes (DataHello.seal_share, DataStatus.seal_share)."""
MAX_RECORD_BYTES = 1 << 20
"""Plaintext bytes per record at most: large enough that the per-record cost (one AEAD
call, one write, the Python around them) vanishes, small enough to stay in cache between
encrypt and send. Measured (bench/step_throughput --tls-only, median-step rate, same
session): 256 KiB 0.76-0.78x no TLS, 1 MiB 0.81-0.91x, 4 MiB 0.83x."""
TAG_BYTES = 16
_LEN = struct.Struct("<I")
_FIRST_BUFFER_BYTES = 64 << 10
_RECORD_EXTRA = 4 + TAG_BYTES
_MAX_BUFFER_BYTES = 2 * (MAX_RECORD_BYTES + _RECORD_EXTRA)
_SALT = b"psar data plane sealed records v2"
REKEY_RECORDS = 1 << 14
"""Records sealed under one key at most (16 GiB of 1 MiB records: 2^30 AES blocks, far
inside AES-GCM's usage limits); then both ends of that direction derive the next key."""
_INFO_UP, _INFO_DOWN = b"psar sealed worker->shard", b"psar sealed shard->worker"
_INFO_REKEY = b"psar sealed next key"


class SealError(OSError):
    """A record that does not open (altered, replayed, reordered, truncated) or a length
    out of range: the connection cannot be trusted any more."""


def available() -> bool:
    """Whether the AEAD this needs is importable (`cryptography` with AESGCM.encrypt_into)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return False
    return hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


def new_share() -> bytes:
    return os.urandom(SHARE_BYTES)


def derive_keys(worker_share: bytes, shard_share: bytes) -> tuple[bytes, bytes]:
    """(worker->shard key, shard->worker key) from both ends' shares: HKDF-SHA256 (RFC
    5869, `cryptography`'s), one derivation per direction."""
    if len(worker_share) != SHARE_BYTES or len(shard_share) != SHARE_BYTES:
        raise ValueError(f"seal shares must be {SHARE_BYTES} bytes each")
    ikm = worker_share + shard_share
    return _hkdf(ikm, _SALT, _INFO_UP), _hkdf(ikm, _SALT, _INFO_DOWN)


def next_key(key: bytes) -> bytes:
    """The key that follows `key` in its direction after REKEY_RECORDS records."""
    return _hkdf(key, None, _INFO_REKEY)


def _hkdf(ikm: bytes, salt: bytes | None, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=16, salt=salt, info=info).derive(ikm)


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class SealedSocket(socket.socket):
    """A TCP socket whose bytes travel in sealed records (see the module docstring).

    Not thread-safe for concurrent readers or concurrent writers (neither is a TLS
    socket); one reader and one writer at a time is fine."""

    def __init__(
        self,
        raw: socket.socket,
        send_key: bytes,
        recv_key: bytes,
        *,
        record_timeout_s: float | None = None,
    ) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        timeout = raw.gettimeout()
        super().__init__(raw.family, raw.type, raw.proto, fileno=raw.detach())
        self._user_timeout: float | None = None
        self._os_timeout: float | None = None
        self.settimeout(timeout)
        self._aead = AESGCM
        self._send_key, self._recv_key = send_key, recv_key
        self._seal, self._open = AESGCM(send_key), AESGCM(recv_key)
        self._send_ctr = self._recv_ctr = 0
        self.rekey_records = REKEY_RECORDS
        """Records per key in each direction (both ends must agree; tests lower it)."""
        self._close_sent = self._close_received = False
        # Records waiting for one write: sized by what is sent (a connection that only
        # sends frame headers never holds two whole records).
        self._out = bytearray(0)
        # Received sealed bytes not opened yet, [_rx_at, _rx_end) of _rx: the record
        # being received, and whatever of the next ones one read brought with it.
        self._rx = bytearray(0)
        self._rx_at = self._rx_end = 0
        self._rec_deadline: float | None = None
        # Opened bytes the caller has not taken yet.
        self._plain = bytearray(0)
        self._plain_at = self._plain_end = 0
        self.record_timeout_s = record_timeout_s
        """Once a record's first byte is in, the rest must come within this many seconds
        (None: only the caller's timeout), so a trickling peer cannot hold a read."""

    # ---- what the framing asks of a socket ----------------------------------------------

    def settimeout(self, value: float | None) -> None:
        self._user_timeout = value
        self._os(value)

    def gettimeout(self) -> float | None:
        return self._user_timeout

    def pending(self) -> int:
        """Bytes here that the socket no longer holds: opened ones ready to read, and
        sealed ones of a record (or records) not opened yet. Non-zero: the peer spoke."""
        return (self._plain_end - self._plain_at) + (self._rx_end - self._rx_at)

    def sendall(self, data: Any, flags: int = 0) -> None:  # type: ignore[override]
        self.send_buffers([data])

    def send_buffers(self, buffers: Any) -> None:
        """sendall of several buffers, one record per MAX_RECORD_BYTES of each: records
        go out in writes of up to two records (a frame's header with its payload's
        first record: one write, not two)."""
        deadline = self._deadline()
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) + (len(v) // MAX_RECORD_BYTES + 1) * _RECORD_EXTRA for v in views)
        if len(self._out) < min(total, _MAX_BUFFER_BYTES):
            self._out = bytearray(min(total, _MAX_BUFFER_BYTES))
        out = memoryview(self._out)
        used = 0
        try:
            for view in views:
                for at in range(0, len(view), MAX_RECORD_BYTES):
                    chunk = view[at : at + MAX_RECORD_BYTES]
                    n = len(chunk)
                    if used + _LEN.size + n + TAG_BYTES > len(out):
                        self._wait_until(deadline)
                        super().sendall(out[:used])
                        used = 0
                    _LEN.pack_into(out, used, n)
                    head = bytes(out[used : used + _LEN.size])
                    end = used + _LEN.size + n + TAG_BYTES
                    self._seal_send_key()
                    self._seal.encrypt_into(
                        _nonce(self._send_ctr), chunk, head, out[used + _LEN.size : end]
                    )
                    self._send_ctr += 1
                    used = end
            if used:
                self._wait_until(deadline)
                super().sendall(out[:used])
        finally:
            out.release()
            self._os(self._user_timeout)

    def send(self, data: Any, flags: int = 0) -> int:  # type: ignore[override]
        self.sendall(data)
        return len(data)

    def send_close(self) -> None:
        """Send the close record (once): the authenticated end of this direction, which
        the peer needs to read our stream's end as clean rather than as a cut."""
        if self._close_sent:
            return
        self._close_sent = True
        head = _LEN.pack(0)
        self._seal_send_key()
        tag = self._seal.encrypt(_nonce(self._send_ctr), b"", head)
        self._send_ctr += 1
        deadline = self._deadline()
        try:
            self._wait_until(deadline)
            super().sendall(head + tag)
        finally:
            self._os(self._user_timeout)

    def close(self) -> None:
        """Close, ending our stream with its close record first where the connection
        still takes it (best effort, 1 s at most: a close never blocks on the peer)."""
        if self.fileno() >= 0 and not self._close_sent:
            try:
                self.settimeout(min(1.0, self._user_timeout or 1.0))
                self.send_close()
            except OSError:
                pass
        super().close()

    def _seal_send_key(self) -> None:
        """Before sealing record number _send_ctr: move to the next key every
        rekey_records records (the receiver does the same at the same number)."""
        if self._send_ctr and self._send_ctr % self.rekey_records == 0:
            self._send_key = next_key(self._send_key)
            self._seal = self._aead(self._send_key)

    def sendmsg(self, *args: Any, **kw: Any) -> int:  # type: ignore[override]
        raise NotImplementedError("a sealed socket takes sendall (records, not scatter)")

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        """Up to nbytes opened bytes into buffer (at least 1 unless the peer closed
        between records: 0). A whole record is opened straight into the buffer when it
        fits; else the rest is kept for the next reads."""
        view = memoryview(buffer).cast("B")
        n = len(view) if nbytes <= 0 else min(nbytes, len(view))
        if n == 0:
            return 0
        if self._plain_end > self._plain_at:
            return self._take(view, n)
        if self._close_received:
            return 0
        try:
            length = self._next_record()
            if length is None:
                return 0
            if length <= n:  # straight into the caller's buffer: no second copy
                self._open_into(view[:length], length)
                return length
            if len(self._plain) < length:  # grown only once a record this long has come
                self._plain = bytearray(length)
            self._open_into(memoryview(self._plain)[:length], length)
        except SealError:
            self._close_sent = True  # a broken stream is never ended as a clean one
            raise
        finally:
            self._os(self._user_timeout)
        self._plain_at, self._plain_end = 0, length
        return self._take(view, n)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:  # type: ignore[override]
        buf = bytearray(max(0, bufsize))
        got = self.recv_into(buf, bufsize)
        return bytes(buf[:got])

    # ---- timeouts -----------------------------------------------------------------------

    def _os(self, value: float | None) -> None:
        """The descriptor's own timeout (a syscall or two each time: only on change)."""
        if value != self._os_timeout:
            super().settimeout(value)
            self._os_timeout = value

    def _deadline(self) -> float | None:
        t = self._user_timeout
        return None if t is None else time.monotonic() + t

    def _wait_until(self, deadline: float | None) -> None:
        """Before a blocking read or write: the descriptor's timeout must not outlast
        `deadline` (TimeoutError when it has passed). A shorter one is kept: a read it
        cuts short is retried (_recv_some) until the deadline really passes."""
        if deadline is None:
            self._os(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("sealed record deadline passed")
        t = self._os_timeout
        if t is None or t > left + 1e-3:
            self._os(left)

    # ---- records ------------------------------------------------------------------------

    def _next_record(self) -> int | None:
        """Have one whole record in _rx (resuming one a timeout interrupted); its
        plaintext length, or None once the peer's close record came (opened here)."""
        deadline = self._deadline()
        if not self._have(_LEN.size, deadline):
            raise SealError(
                "connection cut without the peer's close record: the stream may have been "
                "truncated, so it is not taken as a clean end"
            )
        (length,) = _LEN.unpack_from(self._rx, self._rx_at)
        if length > MAX_RECORD_BYTES:
            raise SealError(
                f"sealed record of {length} bytes (0..{MAX_RECORD_BYTES} allowed): "
                "the peer does not speak sealed records, or the stream is damaged"
            )
        self._have(_LEN.size + length + TAG_BYTES, deadline)
        if length == 0:
            self._open_into(memoryview(bytearray(0)), 0)  # the close record: its tag only
            self._close_received = True
            return None
        return length

    def _have(self, need: int, deadline: float | None) -> bool:
        """At least `need` sealed bytes buffered; False when the peer closed with none."""
        while self._rx_end - self._rx_at < need:
            began = self._rx_end > self._rx_at
            if began and self._rec_deadline is None and self.record_timeout_s is not None:
                self._rec_deadline = time.monotonic() + self.record_timeout_s
            if not self._recv_some(need, self._record_deadline(deadline)):
                if not began:
                    return False
                raise SealError("connection closed inside a sealed record")
        return True

    def _record_deadline(self, deadline: float | None) -> float | None:
        if self._rec_deadline is None:
            return deadline
        return self._rec_deadline if deadline is None else min(deadline, self._rec_deadline)

    def _recv_some(self, need: int, deadline: float | None) -> int:
        """One read into _rx's free space; 0: the peer closed. A record's body is read
        up to its end and the next record's length prefix, so what stays behind after
        it is opened is a few bytes to move, not a part of the next record."""
        self._room_for(need)
        free = len(self._rx) - self._rx_end
        have = self._rx_end - self._rx_at
        # Small records (frame headers) often come whole with their prefix; a large one
        # is then read to its end plus the next prefix, so what stays behind after it is
        # opened is a few bytes to move, not part of the next record.
        free = min(free, need + _LEN.size - have if need > _LEN.size else _FIRST_BUFFER_BYTES)
        while True:
            self._wait_until(deadline)
            try:
                r = super().recv_into(memoryview(self._rx)[self._rx_end :], free)
            except TimeoutError:
                if deadline is not None and time.monotonic() < deadline:
                    continue  # the descriptor's timeout was the shorter one: go on
                raise
            self._rx_end += r
            return r

    def _room_for(self, need: int) -> None:
        """Free space at the end of _rx for the rest of `need` bytes. What is buffered
        moves to the front while it is little (a record's prefix, or the start of the
        next one): a record's bulk is never moved. Else _rx grows (doubling, so never
        to more than twice what has arrived, and never past two records)."""
        at, end = self._rx_at, self._rx_end
        have, rest, free = end - at, need - (end - at), len(self._rx) - end
        if free >= rest:
            return
        if at and (len(self._rx) - have >= rest or not free):
            view = memoryview(self._rx)
            view[:have] = view[at:end]  # memmove, no temporary copy (memoryview to itself)
            view.release()
            self._rx_at, self._rx_end = 0, have
            return
        if free:
            return  # read what fits; grow once it is full
        size = min(_MAX_BUFFER_BYTES, max(_FIRST_BUFFER_BYTES, 2 * len(self._rx)))
        grown = bytearray(size)
        grown[:have] = memoryview(self._rx)[at:end]
        self._rx, self._rx_at, self._rx_end = grown, 0, have

    def _open_into(self, dest: memoryview, length: int) -> None:
        from cryptography.exceptions import InvalidTag

        at = self._rx_at
        rx = memoryview(self._rx)
        head = bytes(rx[at : at + _LEN.size])
        sealed = rx[at + _LEN.size : at + _LEN.size + length + TAG_BYTES]
        if self._recv_ctr and self._recv_ctr % self.rekey_records == 0:
            self._recv_key = next_key(self._recv_key)  # as the sender did at this number
            self._open = self._aead(self._recv_key)
        try:
            if length:
                self._open.decrypt_into(_nonce(self._recv_ctr), sealed, head, dest)
            else:
                self._open.decrypt(_nonce(self._recv_ctr), bytes(sealed), head)
        except InvalidTag:
            raise SealError(
                "a sealed record failed authentication (altered, replayed, out of order or a "
                "forged close record): the connection is dropped"
            ) from None
        finally:
            sealed.release()
            rx.release()
        self._recv_ctr += 1
        self._rx_at += _LEN.size + length + TAG_BYTES
        if self._rx_at == self._rx_end:
            self._rx_at = self._rx_end = 0
        self._rec_deadline = None

    def _take(self, view: memoryview, n: int) -> int:
        k = min(n, self._plain_end - self._plain_at)
        view[:k] = memoryview(self._plain)[self._plain_at : self._plain_at + k]
        self._plain_at += k
        return k


def seal(
    tls: socket.socket,
    send_key: bytes,
    recv_key: bytes,
    *,
    record_timeout_s: float | None = None,
) -> SealedSocket:
    """Close TLS on `tls` (close_notify both ways; bytes after the peer's stay unread in
    the kernel) and carry the rest of the connection in sealed records."""
    raw = tls.unwrap()  # type: ignore[attr-defined]
    return SealedSocket(raw, send_key, recv_key, record_timeout_s=record_timeout_s)


__all__ = [
    "MAX_RECORD_BYTES",
    "SHARE_BYTES",
    "SealError",
    "SealedSocket",
    "available",
    "derive_keys",
    "new_share",
    "next_key",
    "seal",
]
