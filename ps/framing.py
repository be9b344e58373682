"""Frames of the data plane (proto/psar/v1/ps.proto, "data plane"), shared by both ends.

A frame is a 16-byte little-endian prefix ``<4sIQ`` (magic b"PSD1", header length,
payload length), a serialized ``DataFrame`` header, then the payload: raw tensor bytes,
only in ``piece`` frames. Everything here moves buffers with ``sendmsg``/``recv_into``
(no per-byte Python, no joining of payloads); the caller owns the sockets.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ps._gen.psar.v1 import ps_pb2 as pb
from ps.errors import InvalidArgument, PSError, ResourceExhausted

MAGIC = b"PSD1"
PREFIX = struct.Struct("<4sIQ")
VERSION = 1
"""Data-plane protocol version, sent in DataHello."""
MAX_HEADER_BYTES = 64 << 10
"""Largest DataFrame header accepted (headers are small; only piece frames carry bytes)."""
SOCKET_BUFFER_BYTES = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for on both ends (the kernel may cap it)."""

CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


class Scratch:
    """A reusable receive buffer, replaced (never resized: views may be alive) to grow."""

    def __init__(self) -> None:
        self.buf = bytearray(0)

    def view(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


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
    """TCP_NODELAY and large buffers: frames go out as written, 1 MiB+ pieces stream."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - a kernel that refuses the size
            pass


def encode(frame: pb.DataFrame, payload_len: int = 0) -> bytes:
    """Prefix + header of one frame (the payload is sent after it, untouched)."""
    head = frame.SerializeToString()
    return PREFIX.pack(MAGIC, len(head), payload_len) + head


def send(sock: socket.socket, frame: pb.DataFrame, payload: Any = None) -> None:
    """Send one frame; `payload` (any bytes-like, e.g. a tensor's memoryview) unchanged."""
    if payload is None or len(payload) == 0:
        sock.sendall(encode(frame))
        return
    view = memoryview(payload).cast("B")
    send_buffers(sock, [encode(frame, len(view)), view])


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """sendall for several buffers in one sendmsg call each round (no concatenation)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def recv_exact(sock: socket.socket, view: memoryview, *, at_frame_start: bool = False) -> None:
    """Fill `view` from the socket; ConnectionClosed when the peer closes first."""
    n, got = len(view), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionClosed(mid_frame=not (at_frame_start and got == 0))
        got += r


def read_header(
    sock: socket.socket, *, max_payload_bytes: int, scratch: Scratch
) -> tuple[pb.DataFrame, int]:
    """Read a frame's prefix and header; returns (header, payload length to read next).

    Refuses (FramingError) a bad magic, an undecodable header and lengths over the
    limits, before allocating anything for them."""
    prefix = bytearray(PREFIX.size)
    recv_exact(sock, memoryview(prefix), at_frame_start=True)
    magic, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FramingError(
            InvalidArgument(
                f"not a psar data-plane frame (magic {bytes(magic)!r}, expected {MAGIC!r}): "
                "talk to this port with ps.client.tcp_transport, gRPC goes to the shard's "
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
    view = scratch.view(hlen)
    recv_exact(sock, view)
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
    if plen and kind != "piece":
        raise FramingError(
            InvalidArgument(
                f"a {kind} frame carries a payload of {plen} bytes; only piece frames do",
                reason="malformed",
            )
        )
    return frame, plen


def recv_payload(sock: socket.socket, plen: int, scratch: Scratch) -> memoryview:
    """Read `plen` payload bytes into `scratch` (grown as needed); a view of them."""
    view = scratch.view(plen)
    recv_exact(sock, view)
    return view


def status_frame(code: grpc.StatusCode, details: str) -> pb.DataFrame:
    return pb.DataFrame(status=pb.DataStatus(code=code.value[0], details=details))
