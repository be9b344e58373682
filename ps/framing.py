"""Frames of the data plane (proto/psar/v1/ps.proto, "data plane"), shared by both ends.

A frame is a 16-byte little-endian prefix ``<4sIQ`` (magic b"PSD1", header length,
payload length), a serialized ``DataFrame`` header, then the payload: raw tensor bytes,
only in ``piece`` frames. Everything here moves buffers with ``sendmsg``/``recv_into``
(no per-byte Python, no joining of payloads); the caller owns the sockets, which may be
plain TCP, TLS (``ssl.SSLSocket``) or sealed records after a TLS hello
(``psar.ps.sealed.SealedSocket``): those have no sendmsg and no recv flags, so they take the
plain sendall/recv_into path.

Reading never trusts a length before its bytes arrive: buffers for headers and payloads
(Scratch) grow as bytes are received, so a prefix that claims 16 MiB and then goes
silent costs what was sent, not what was claimed. A `deadline` (time.monotonic()) bounds
every read of a frame once it has started.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, PSError, ResourceExhausted
from psar.ps.sealed import SealedSocket

MAGIC = b"PSD1"
PREFIX = struct.Struct("<4sIQ")
VERSION = 1
"""Data-plane protocol version, sent in DataHello."""
MAX_HEADER_BYTES = 64 << 10
"""Largest DataFrame header accepted (headers are small; only piece frames carry bytes)."""
SOCKET_BUFFER_BYTES = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for on both ends (the kernel may cap it)."""

FIRST_GROWTH_BYTES = 64 << 10
"""A Scratch that must grow starts from at most this many bytes, then doubles as bytes
arrive (a payload's claimed length is never allocated up front)."""
PAYLOAD_KINDS = ("piece", "rows_pull", "rows", "tables_pull", "tables_rows", "rows_push")
"""The frames that may carry a payload: tensor pieces, and the sparse rows calls' ids,
rows and row gradients (proto DataRowsPull, DataRows, DataTablesPull, DataTablesRows,
DataRowsPush)."""
DISCARD_CHUNK_BYTES = 1 << 20
"""Payload bytes that are read only to be dropped go through at most this much buffer."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 60, 15, 4
"""TCP keepalive: a peer that vanished (no FIN, no RST) is found within ~2 minutes."""

DEADLINE_SLACK_S = 0.05
"""A read under a frame's deadline may end up to twice this after it (see _set_deadline)."""

_JOIN_BYTES = 64 << 10
"""Small buffers sent together over TLS are joined into one write (one record)."""

CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


class Scratch:
    """A reusable receive buffer, replaced (never resized: views may be alive) to grow.

    `on_resize(delta)` (optional) hears every change of its size: the shard adds them
    up into the bytes its connections hold buffered."""

    def __init__(self, on_resize: Callable[[int], None] | None = None) -> None:
        self.buf = bytearray(0)
        self._on_resize = on_resize

    def _replace(self, buf: bytearray) -> None:
        old, self.buf = len(self.buf), buf
        if self._on_resize is not None:
            self._on_resize(len(buf) - old)

    def view(self, n: int) -> memoryview:
        """A view of n bytes, allocated at once (for payloads this end chose the size of)."""
        if len(self.buf) < n:
            self._replace(bytearray(n))
        return memoryview(self.buf)[:n]

    def fill(self, sock: socket.socket, n: int, deadline: float | None = None) -> memoryview:
        """Receive exactly n bytes into the buffer, growing it only as they arrive
        (doubling from FIRST_GROWTH_BYTES, copying what came), never past n."""
        if len(self.buf) >= n:
            view = memoryview(self.buf)[:n]
            recv_exact(sock, view, deadline=deadline)
            return view
        got = 0
        size = min(n, max(len(self.buf), FIRST_GROWTH_BYTES))
        if size > len(self.buf):
            self._replace(bytearray(size))
        while True:
            target = min(n, len(self.buf))
            recv_exact(sock, memoryview(self.buf)[got:target], deadline=deadline)
            got = target
            if got == n:
                return memoryview(self.buf)[:n]
            grown = bytearray(min(n, 2 * len(self.buf)))
            grown[:got] = memoryview(self.buf)[:got]
            self._replace(grown)

    def release(self) -> None:
        """Give the buffer back (the connection ended)."""
        self._replace(bytearray(0))


class ConnectionClosed(Exception):
    """The peer closed the connection (`mid_frame`: in the middle of a frame)."""

    def __init__(self, mid_frame: bool) -> None:
        super().__init__("connection closed mid-frame" if mid_frame else "connection closed")
        self.mid_frame = mid_frame


class FramingError(PSError):
    """A frame that cannot be read (the stream is out of step): answer, then close."""

    def __init__(self, error: PSError) -> None:
        super().__init__(error.args[0], reason=error.reason)
        self.code = error.code


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY, large buffers and keepalive: frames go out as written, 1 MiB+ pieces
    stream, and a peer that vanished without a FIN does not hold the connection forever."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - a kernel that refuses the size
            pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):  # fmt: skip
        opt = getattr(socket, name, None)  # Linux names; other systems keep their defaults
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:  # pragma: no cover
                pass


def hard_shutdown(sock: socket.socket) -> None:
    """Shut both directions of the TCP connection under `sock` (from any thread): a
    thread blocked in recv or send on it wakes with an error. On a TLS socket this
    bypasses SSLSocket.shutdown, which would also drop the TLS state under that thread."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def peer_spoke(sock: socket.socket) -> bool:
    """Has the peer sent anything (bytes, a TLS alert, or its FIN)? For a connection whose
    peer must stay silent until our answer ends (a pull in progress), that means it hung
    up or broke the protocol: either way nobody waits for the answer any more."""
    if is_tls(sock) and sock.pending():  # type: ignore[attr-defined]
        return True
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed under us
        return True


def is_tls(sock: socket.socket) -> bool:
    """TLS or sealed records (ps/sealed.py): no sendmsg, no recv flags, pending()."""
    return isinstance(sock, (ssl.SSLSocket, SealedSocket))


def _set_deadline(sock: socket.socket, deadline: float | None) -> None:
    """Before a blocking read of a frame: the socket's timeout must run out no sooner
    than `deadline` and at most 2 DEADLINE_SLACK_S after it (TimeoutError once it passed).
    It is re-armed only when it left that range, not before every read: a TLS read
    returns one 16 KiB record, and a settimeout per record (a syscall and the Python
    around it) was a tenth of the receiving end's TLS cost (bench/experiments/tls_cost.py)."""
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("frame deadline passed")
    timeout = sock.gettimeout()
    if timeout is None or not remaining <= timeout <= remaining + 2 * DEADLINE_SLACK_S:
        sock.settimeout(remaining + DEADLINE_SLACK_S)


def encode(frame: pb.DataFrame, payload_len: int = 0) -> bytes:
    """Prefix + header of one frame (the payload is sent after it, untouched)."""
    head = frame.SerializeToString()
    return PREFIX.pack(MAGIC, len(head), payload_len) + head


def send(sock: socket.socket, frame: pb.DataFrame, payload: Any = None) -> None:
    """Send one frame; `payload` (any bytes-like, e.g. a tensor's memoryview, or a list of
    them, sent side by side) unchanged."""
    parts = payload if isinstance(payload, list) else [] if payload is None else [payload]
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if not views:
        sock.sendall(encode(frame))
        return
    send_buffers(sock, [encode(frame, sum(len(v) for v in views)), *views])


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """sendall for several buffers in one sendmsg call each round (no concatenation)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, SealedSocket):
        sock.send_buffers(views)
        return
    if is_tls(sock):  # no sendmsg: one write (one or more records) per buffer
        if len(views) > 1 and sum(len(v) for v in views[:-1]) <= _JOIN_BYTES:
            # Prefix + header in one record with the start of the payload costs a copy
            # of the payload; in a record of their own, only theirs.
            views = [memoryview(b"".join(views[:-1])), views[-1]]
        for v in views:
            sock.sendall(v)
        return
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_exact(
    sock: socket.socket,
    view: memoryview,
    *,
    at_frame_start: bool = False,
    deadline: float | None = None,
) -> None:
    """Fill `view` from the socket; ConnectionClosed when the peer closes first,
    TimeoutError when `deadline` (time.monotonic()) passes first."""
    n, got = len(view), 0
    flags = 0 if is_tls(sock) else socket.MSG_WAITALL  # SSLSocket takes no flags
    while got < n:
        _set_deadline(sock, deadline)
        r = sock.recv_into(view[got:], n - got, flags)
        if r == 0:
            raise ConnectionClosed(mid_frame=not (at_frame_start and got == 0))
        got += r


class FrameClock:
    """Read deadlines of one connection: at most `idle_s` waiting for a frame to begin,
    then at most `frame_s` for the whole frame (prefix, header and payload). After
    read_header, `deadline` is the current frame's (pass it to the payload reads)."""

    def __init__(self, idle_s: float, frame_s: float) -> None:
        self.idle_s, self.frame_s = idle_s, frame_s
        self.deadline: float | None = None

    def wait_first_byte(self, sock: socket.socket, prefix: memoryview) -> int:
        """Block up to idle_s for the frame's first bytes (TimeoutError: idle too long)."""
        self.deadline = None
        sock.settimeout(self.idle_s)
        r = sock.recv_into(prefix, len(prefix))
        if r == 0:
            raise ConnectionClosed(mid_frame=False)
        self.deadline = time.monotonic() + self.frame_s
        return r


class IdleTimeout(Exception):
    """No frame began within the connection's idle limit."""


def read_header(
    sock: socket.socket,
    *,
    max_payload_bytes: int,
    scratch: Scratch,
    clock: FrameClock | None = None,
) -> tuple[pb.DataFrame, int]:
    """Read a frame's prefix and header; returns (header, payload length to read next).

    Refuses (FramingError) a bad magic, an undecodable header and lengths over the
    limits, before allocating anything for them; the header's buffer grows as its bytes
    arrive. With `clock`: IdleTimeout when no frame begins within its idle_s, TimeoutError
    when the frame is not complete within its frame_s (clock.deadline)."""
    prefix = bytearray(PREFIX.size)
    view = memoryview(prefix)
    if clock is None:
        recv_exact(sock, view, at_frame_start=True)
    else:
        try:
            got = clock.wait_first_byte(sock, view)
        except TimeoutError:
            raise IdleTimeout(f"no frame for {clock.idle_s:g} s") from None
        recv_exact(sock, view[got:], deadline=clock.deadline)
    magic, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FramingError(
            InvalidArgument(
                f"not a psar data-plane frame (magic {bytes(magic)!r}, expected {MAGIC!r}): "
                "talk to this port with psar.ps.client.tcp_transport, gRPC goes to the shard's "
                "--bind port",
                reason="malformed",
            )
        )
    if hlen > MAX_HEADER_BYTES:
        raise FramingError(
            ResourceExhausted(
                f"frame header of {hlen} bytes is larger than the limit of {MAX_HEADER_BYTES}; "
                "headers only describe pieces, tensor bytes go in the payload"
            )
        )
    if plen > max_payload_bytes:
        raise FramingError(
            ResourceExhausted(
                f"frame payload of {plen} bytes is larger than max_message_bytes "
                f"{max_payload_bytes} of this shard; send pieces of at most that many bytes "
                "(or raise the shard's --max-message-bytes)"
            )
        )
    view = scratch.fill(sock, hlen, clock.deadline if clock else None)
    frame = pb.DataFrame()
    try:
        frame.ParseFromString(view)
    except DecodeError as e:
        raise FramingError(
            InvalidArgument(f"undecodable frame header ({e}): not a psar.v1.DataFrame")
        ) from None
    finally:
        view.release()
    kind = frame.WhichOneof("kind")
    if kind is None:
        raise FramingError(
            InvalidArgument(
                "frame of an unknown kind (no DataFrame field this shard knows is set); "
                "are the worker and the shard the same psar version?",
                reason="malformed",
            )
        )
    if plen and kind not in PAYLOAD_KINDS:
        raise FramingError(
            InvalidArgument(
                f"a {kind} frame carries a payload of {plen} bytes; only "
                f"{', '.join(PAYLOAD_KINDS)} frames do",
                reason="malformed",
            )
        )
    return frame, plen


def recv_payload(
    sock: socket.socket, plen: int, scratch: Scratch, deadline: float | None = None
) -> memoryview:
    """Read `plen` payload bytes into `scratch` (grown as they arrive); a view of them."""
    return scratch.fill(sock, plen, deadline)


def discard_payload(
    sock: socket.socket, plen: int, scratch: Scratch, deadline: float | None = None
) -> None:
    """Read and drop `plen` payload bytes, through at most DISCARD_CHUNK_BYTES of buffer."""
    while plen > 0:
        n = min(plen, DISCARD_CHUNK_BYTES)
        scratch.fill(sock, n, deadline).release()
        plen -= n


def status_frame(code: grpc.StatusCode, details: str) -> pb.DataFrame:
    return pb.DataFrame(status=pb.DataStatus(code=code.value[0], details=details))


def status_frame_sealing(share: bytes) -> pb.DataFrame:
    """The OK to a hello that asked for sealed records, with the shard's share."""
    return pb.DataFrame(status=pb.DataStatus(code=0, seal_share=share))
