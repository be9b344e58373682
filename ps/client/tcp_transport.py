"""Worker side of the data plane (ps/server/dataplane.py): push and pull frames to one shard.

One DataPlaneClient per shard, thread-safe: each call takes an idle pooled connection or
opens one (hello with the token and protocol version first). Tensor bytes go out as
memoryviews of the caller's tensors (no copy) and come back straight into the caller's
buffers where the dtype matches (otherwise converted on copy, as PSClient.pull does).

Errors are DataPlaneError, a grpc.RpcError with .code() and .details() like gRPC's, so
retry logic written for gRPC handles both: connection refused, reset or closed mid-call
-> UNAVAILABLE; deadline -> DEADLINE_EXCEEDED; cancel_all() -> CANCELLED; a shard's
refusal -> its status code and details verbatim (e.g. ABORTED "restored: ...").
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import grpc
import torch

from ps import framing as fr
from ps import wire
from ps._gen.psar.v1 import ps_pb2 as pb

DEFAULT_MAX_FRAME_BYTES = 4 << 20
"""Tensor bytes per piece frame sent; at most the shard's --max-message-bytes (16 MiB)."""
PULL_GRACE_S = 1.0
"""A pull waits this much past its timeout for the shard's own DEADLINE_EXCEEDED (which
says who it waited for) before giving up locally."""

SC = grpc.StatusCode


class DataPlaneError(grpc.RpcError):
    """A failed data-plane call, shaped like a grpc.RpcError (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Conn:
    __slots__ = ("sock", "scratch", "cancelled")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.scratch = fr.Scratch()
        self.cancelled = False


class DataPlaneClient:
    """Push and pull to one shard's data plane (HOST, GetJobReply.data_port)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str = "",
        connect_timeout_s: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"data-plane port must be in [1, 65535], got {port}")
        if max_frame_bytes < 4:
            raise ValueError(f"max_frame_bytes must be >= 4 (one element), got {max_frame_bytes}")
        self.host, self.port = host.strip("[]"), port
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ---- the calls ------------------------------------------------------------------

    def push(
        self, header: pb.PushHeader, items: Iterable[tuple], *, timeout_s: float
    ) -> pb.PushReply:
        """Stream one push: the header, then each item as it comes (the iterator may block
        between items): ("data", key, offset, tensor) - a contiguous CPU tensor in the
        header's dtype, sent from its own memory in frames of <= max_frame_bytes - or
        ("verdict", overflow). Returns the shard's PushReply."""
        deadline = time.monotonic() + timeout_s
        itemsize = wire.DTYPE_ITEMSIZE.get(wire.DTYPE_FROM_WIRE.get(header.dtype), 1)
        per = max(1, self.max_frame_bytes // itemsize) * itemsize
        conn = self._acquire(deadline)
        reusable = False
        try:
            try:
                self._send(conn, pb.DataFrame(push_header=header), None, deadline)
                for item in items:
                    if item[0] == "data":
                        _, key, offset, t = item
                        view = _tensor_bytes(t, header.dtype)
                        for start in range(0, len(view), per):
                            piece = pb.DataPiece(key=key, offset=offset + start // itemsize)
                            chunk = view[start : start + per]
                            self._send(conn, pb.DataFrame(piece=piece), chunk, deadline)
                            self._refused_early(conn, deadline)
                    elif item[0] == "verdict":
                        verdict = pb.PushVerdict(overflow=bool(item[1]))
                        self._send(conn, pb.DataFrame(verdict=verdict), None, deadline)
                    else:
                        raise ValueError(
                            f"push item must be ('data', ...) or ('verdict', ...): {item[0]!r}"
                        )
                self._send(conn, pb.DataFrame(end=pb.DataEnd()), None, deadline)
            except DataPlaneError as e:
                if e.code() in (SC.UNAVAILABLE, SC.DEADLINE_EXCEEDED) and not conn.cancelled:
                    self._status_after_send_failure(conn)  # the shard's reason, if it sent one
                raise
            frame = self._recv_frame(conn, deadline, "push")
            reusable = True
            if frame.WhichOneof("kind") != "push_reply":
                self._unexpected(frame, "push_reply")
            return frame.push_reply
        finally:
            self._release(conn, reusable)

    def pull(
        self,
        req: pb.PullRequest,
        out: dict[str, torch.Tensor],
        *,
        timeout_s: float,
        on_piece: Callable[[str, int, int], None] | None = None,
        on_header: Callable[[pb.PullHeader], None] | None = None,
    ) -> pb.PullHeader:
        """Pull the shard's weights into `out` (flat tensors keyed by slot; any float dtype,
        converted on copy; a same-dtype contiguous CPU slice is received into directly).
        on_piece(key, offset, n) runs after each piece has landed. Returns the header."""
        deadline = time.monotonic() + timeout_s
        conn = self._acquire(deadline)
        reusable = False
        try:
            ask = pb.DataPullRequest(request=req, timeout_s=timeout_s)
            self._send(conn, pb.DataFrame(pull_request=ask), None, deadline)
            frame = self._recv_frame(conn, deadline + PULL_GRACE_S, "pull")
            if frame.WhichOneof("kind") != "pull_header":
                reusable = frame.WhichOneof("kind") == "status"
                self._unexpected(frame, "pull_header")
            header = frame.pull_header
            if on_header is not None:
                on_header(header)  # before the data: the round closed (ps/client/overlap.py)
            dtype = wire.DTYPE_FROM_WIRE.get(header.dtype)
            if dtype is None:
                raise DataPlaneError(SC.INTERNAL, f"pull from {self.address}: dtype {header.dtype}")
            itemsize = wire.DTYPE_ITEMSIZE[dtype]
            while True:
                frame, plen = self._io(
                    conn, deadline + PULL_GRACE_S, "pull", self._read_header, conn
                )
                kind = frame.WhichOneof("kind")
                if kind == "end":
                    break
                if kind != "piece":
                    self._unexpected(frame, "piece")
                key, offset = frame.piece.key, frame.piece.offset
                dest = out.get(key)
                n = plen // itemsize
                if dest is None or plen % itemsize or offset + n > dest.numel():
                    raise DataPlaneError(
                        SC.INTERNAL,
                        f"pull from {self.address}: piece {key!r} at {offset} of {plen} bytes "
                        "does not fit the destination buffers",
                    )
                target = dest[offset : offset + n]
                if target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
                    self._io(
                        conn,
                        deadline + PULL_GRACE_S,
                        "pull",
                        fr.recv_exact,
                        conn.sock,
                        wire.as_bytes_view(target),
                    )
                else:
                    raw = self._io(
                        conn,
                        deadline + PULL_GRACE_S,
                        "pull",
                        fr.recv_payload,
                        conn.sock,
                        plen,
                        conn.scratch,
                    )
                    target.copy_(wire.decode(raw, dtype))
                    raw.release()
                if on_piece is not None:
                    on_piece(key, offset, n)
            reusable = True
            return header
        finally:
            self._release(conn, reusable)

    def cancel_all(self) -> None:
        """Abort every call in flight (from another thread): they raise CANCELLED."""
        with self._lock:
            busy = list(self._busy)
        for c in busy:
            c.cancelled = True
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the pooled connections and abort calls in flight."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.sock.close()
        self.cancel_all()

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- connections ----------------------------------------------------------------

    def _acquire(self, deadline: float) -> _Conn:
        while True:
            with self._lock:
                if self._closed:
                    raise DataPlaneError(
                        SC.CANCELLED, f"data-plane client of {self.address} closed"
                    )
                conn = self._idle.pop() if self._idle else None
                if conn is not None:
                    self._busy.add(conn)
            if conn is None:
                break
            # An idle connection with something to read was closed (or broken) by the shard.
            if not select.select([conn.sock], [], [], 0)[0]:
                return conn
            self._release(conn, False)
        conn = self._connect(deadline)
        with self._lock:
            self._busy.add(conn)
        return conn

    def _release(self, conn: _Conn, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            if reusable and not conn.cancelled and not self._closed:
                self._idle.append(conn)
                return
        conn.sock.close()

    def _connect(self, deadline: float) -> _Conn:
        timeout = min(self.connect_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            raise DataPlaneError(
                SC.DEADLINE_EXCEEDED, f"data plane of {self.address}: deadline passed"
            )
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as e:
            raise DataPlaneError(
                SC.UNAVAILABLE, f"data plane of {self.address} unreachable: {e.strerror or e}"
            ) from None
        conn = _Conn(sock)
        try:
            fr.tune(sock)
            hello = pb.DataHello(token=self.token, version=fr.VERSION)
            self._send(conn, pb.DataFrame(hello=hello), None, deadline)
            frame = self._recv_frame(conn, deadline, "hello")
            if frame.WhichOneof("kind") != "status" or frame.status.code != 0:
                self._unexpected(frame, "status OK")
        except BaseException:
            sock.close()
            raise
        return conn

    # ---- frames, with deadlines and error mapping -----------------------------------

    def _io(
        self, conn: _Conn, deadline: float, what: str, fn: Callable[..., Any], *args: Any
    ) -> Any:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._fail(conn, what, TimeoutError())
        try:
            conn.sock.settimeout(remaining)
            return fn(*args)
        except (OSError, fr.ConnectionClosed, fr.FramingError) as e:
            self._fail(conn, what, e)

    def _fail(self, conn: _Conn, what: str, e: BaseException) -> NoReturn:
        where = f"data-plane {what} to {self.address}"
        if conn.cancelled:
            raise DataPlaneError(SC.CANCELLED, f"{where}: cancelled") from None
        if isinstance(e, TimeoutError):
            raise DataPlaneError(SC.DEADLINE_EXCEEDED, f"{where}: deadline exceeded") from None
        if isinstance(e, fr.FramingError):
            raise DataPlaneError(SC.INTERNAL, f"{where}: bad frame from the shard: {e}") from None
        reason = "connection closed" if isinstance(e, fr.ConnectionClosed) else str(e)
        raise DataPlaneError(SC.UNAVAILABLE, f"{where}: {reason}") from None

    def _send(self, conn: _Conn, frame: pb.DataFrame, payload: Any, deadline: float) -> None:
        self._io(conn, deadline, "send", fr.send, conn.sock, frame, payload)

    def _read_header(self, conn: _Conn) -> tuple[pb.DataFrame, int]:
        return fr.read_header(conn.sock, max_payload_bytes=1 << 62, scratch=conn.scratch)

    def _recv_frame(self, conn: _Conn, deadline: float, what: str) -> pb.DataFrame:
        """One frame without a payload (reply, header, status)."""
        frame, plen = self._io(conn, deadline, what, self._read_header, conn)
        if plen:
            raise DataPlaneError(SC.INTERNAL, f"data-plane {what}: unexpected payload")
        return frame

    def _refused_early(self, conn: _Conn, deadline: float) -> None:
        """Between pieces: has the shard already refused this push? Then stop sending."""
        if select.select([conn.sock], [], [], 0)[0]:
            frame = self._recv_frame(conn, deadline, "push")
            self._unexpected(frame, "nothing before the end of the push")

    def _status_after_send_failure(self, conn: _Conn) -> None:
        """A send failed: the shard may have refused the call and closed; its status
        (already in our receive buffer) says why better than a reset does."""
        try:
            frame = self._recv_frame(conn, time.monotonic() + 0.5, "push")
        except DataPlaneError:
            return
        if frame.WhichOneof("kind") == "status" and frame.status.code != 0:
            self._unexpected(frame, "")

    def _unexpected(self, frame: pb.DataFrame, wanted: str) -> NoReturn:
        if frame.WhichOneof("kind") == "status":
            code = fr.CODE_BY_NUMBER.get(frame.status.code, SC.UNKNOWN)
            raise DataPlaneError(code, frame.status.details)
        raise DataPlaneError(
            SC.INTERNAL,
            f"data plane of {self.address}: got a {frame.WhichOneof('kind')} frame, expected {wanted}",
        )


def _tensor_bytes(t: torch.Tensor, wire_dtype: int) -> memoryview:
    want = wire.DTYPE_FROM_WIRE.get(wire_dtype)
    if t.dtype != want or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"push data must be contiguous CPU tensors of the header's dtype {want}; got "
            f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})"
        )
    return wire.as_bytes_view(t.reshape(-1))
